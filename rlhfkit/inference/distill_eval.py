"""Held-out measurement of on-policy distillation: how far a student's own samples are from a teacher.

`heldout_reverse_kl(student, teacher, prompt_ids)`: the student samples a response to each held-out prompt
(transformers `generate`, seeded), and both models score it; the result is the mean over the response tokens of the
exact reverse KL ``KL(pi_student(. | prefix) || pi_teacher(. | prefix))`` over the whole vocabulary
(`rlhfkit.algorithms.kl.full_reverse_kl`): the quantity on-policy distillation minimises, on the student's own
prefixes. Also returns the decoded responses, for a task score. Plain single-process code for examples and tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlhfkit.algorithms.kl import full_reverse_kl


@dataclass
class HeldOutKL:
    reverse_kl: float          # mean over response tokens of KL(student || teacher), nats per token
    responses: list[str]       # the student's decoded responses, one per prompt
    tokens: int                # response tokens scored


@torch.no_grad()
def heldout_reverse_kl(student: Any, teacher: Any, tokenizer: Any, prompt_ids: list[list[int]], *,
                       max_new_tokens: int = 32, temperature: float = 1.0, seed: int = 0) -> HeldOutKL:
    """Sample one response per prompt from `student` (temperature `temperature`, torch seeded with `seed`) and
    average the per-token full-vocabulary reverse KL to `teacher` over the response tokens (up to and including the
    first eos). Both models must share `tokenizer`'s vocabulary (the logits are compared id by id)."""
    torch.manual_seed(seed)
    total, count, responses = 0.0, 0, []
    eos = tokenizer.eos_token_id
    for ids in prompt_ids:
        prompt = torch.tensor([ids])
        out = student.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                               temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                               pad_token_id=tokenizer.pad_token_id)
        response = out[0, len(ids):].tolist()
        if eos in response:
            response = response[: response.index(eos) + 1]
        if not response:
            continue
        seq = torch.tensor([ids + response])
        # the logits at positions p-1 .. end-1 predict the response tokens
        s_logits = student(seq).logits[0, len(ids) - 1: -1].float()
        t_logits = teacher(seq).logits[0, len(ids) - 1: -1].float()
        vocab = min(s_logits.shape[-1], t_logits.shape[-1], len(tokenizer))
        kl = full_reverse_kl(s_logits[:, :vocab], t_logits[:, :vocab])
        total += float(kl.sum())
        count += kl.numel()
        responses.append(tokenizer.decode(response, skip_special_tokens=True))
    return HeldOutKL(total / max(count, 1), responses, count)
