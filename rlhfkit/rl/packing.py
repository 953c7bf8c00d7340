"""Padding-free RL micro-batches that compute each shared prompt once (`rlhfkit ppo --packing_samples`).

A micro-batch of the Experience layout (left-padded prompt + right-padded response, one row per sample) becomes one
packed row: for each distinct prompt, its tokens once, then the tokens of every response to it. A 4D additive mask
lets a response token attend to its own prompt and its own earlier tokens only; positions count from 0 in each
prompt and continue from the prompt's length in each of its responses. Every response token therefore sees exactly
the context it had in its padded row, so the log-probs equal the padded forward's (up to float summation order;
tests/rl/test_packing.py checks values and gradients). The first token of a response is predicted by the last
token of its prompt, which every response of that prompt shares.

Cost: the forward and backward run over ``sum_prompts p + sum_rows l`` tokens instead of ``B x (max p + max l)``
(padding included): with n samples per prompt (GRPO's groups) the prompt is computed once instead of n times, and
no padding is computed at all. Attention is dense over the packed row (``L x L`` with the mask), which is small next
to the linear layers for the row lengths of a micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhfkit.algorithms.entropy import entropy_from_logits


@dataclass
class PackedRollout:
    """One packed row and how to read the response log-probs back out of its logits.

    input_ids, position_ids: [1, L]; group, segment: [L] (which prompt; -1 on prompt tokens, else the row);
    keep: [K] the positions whose logits are needed; pick: [B, W] index into `keep` of the position that predicts
    response token t of row r; labels: [B, W]; valid: [B, W] (t < that row's response length).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    group: torch.Tensor
    segment: torch.Tensor
    keep: torch.Tensor
    pick: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, L, L] additive: 0 where query i may attend key j (same prompt, j <= i, key in the prompt or in
        the query's own response), dtype-min elsewhere."""
        group, segment = self.group, self.segment
        same_prompt = group[:, None] == group[None, :]
        visible = (segment[None, :] == -1) | (segment[None, :] == segment[:, None])
        causal = torch.ones(len(group), len(group), dtype=torch.bool, device=group.device).tril()
        allowed = same_prompt & visible & causal
        mask = torch.zeros(allowed.shape, dtype=dtype, device=group.device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def pack_rollout(sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int) -> PackedRollout:
    """Pack rows of `sequences` ([B, P + W]: prompt left-padded in the first P columns, response right-padded in the
    last W) into one row, each distinct prompt once (see the module docstring)."""
    rows, width = sequences.shape
    prompt_width = width - response_width
    seq, real = sequences.cpu(), attention_mask.cpu().bool()
    tokens: list[int] = []
    positions: list[int] = []
    group: list[int] = []
    segment: list[int] = []
    prompts: dict[tuple[int, ...], tuple[int, int]] = {}  # prompt tokens -> (group, packed index of its last token)
    pick = torch.zeros(rows, response_width, dtype=torch.long)
    labels = torch.zeros(rows, response_width, dtype=torch.long)
    valid = torch.zeros(rows, response_width, dtype=torch.bool)
    for r in range(rows):
        prompt = seq[r, :prompt_width][real[r, :prompt_width]].tolist()
        n = int(real[r, prompt_width:].sum())
        if not prompt or not bool(real[r, prompt_width:prompt_width + n].all()):
            raise ValueError(f"row {r}: packing needs a non-empty left-padded prompt and a right-padded response")
        key = tuple(prompt)
        if key not in prompts:
            tokens += prompt
            positions += range(len(prompt))
            group += [len(prompts)] * len(prompt)
            segment += [-1] * len(prompt)
            prompts[key] = (len(prompts), len(tokens) - 1)
        g, last = prompts[key]
        start = len(tokens)
        response = seq[r, prompt_width:prompt_width + n]
        tokens += response.tolist()
        positions += range(len(prompt), len(prompt) + n)
        group += [g] * n
        segment += [r] * n
        pick[r, :n] = torch.arange(start - 1, start + n - 1)
        if n:
            pick[r, 0] = last
        labels[r, :n] = response
        valid[r, :n] = True
    keep = torch.unique(pick[valid])
    pick = torch.searchsorted(keep, pick).clamp(max=max(len(keep) - 1, 0)).masked_fill(~valid, 0)
    device = sequences.device
    return PackedRollout(input_ids=torch.tensor([tokens], device=device),
                         position_ids=torch.tensor([positions], device=device),
                         group=torch.tensor(group, device=device), segment=torch.tensor(segment, device=device),
                         keep=keep.to(device), pick=pick.to(device), labels=labels.to(device),
                         valid=valid.to(device))


def packed_response_log_probs(model: torch.nn.Module, packed: PackedRollout, temperature: float, *,
                              mask_dtype: torch.dtype, with_entropy: bool = False,
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[label] of every response token, [B, W] float32 (0 past a row's response),
    and with `with_entropy` the entropy of the same distribution ([B, W], detached), from one packed forward.

    log p = z[label] - logsumexp(z) at the predicting position, z = logits / temperature; the log-sum-exp is taken
    once per kept position, so a prompt's last position, shared by all its responses, costs one row of the head.
    """
    logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                   attention_mask=packed.attention_mask(mask_dtype), use_cache=False,
                   logits_to_keep=packed.keep).logits[0].float() / temperature
    log_norm = torch.logsumexp(logits, dim=-1)                                   # [K]
    picked = logits[packed.pick, packed.labels] - log_norm[packed.pick]          # [B, W]
    log_probs = picked.masked_fill(~packed.valid, 0.0)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits.detach())[packed.pick].masked_fill(~packed.valid, 0.0)
    return log_probs, entropy
