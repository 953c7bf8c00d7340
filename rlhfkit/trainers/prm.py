"""Process reward model: a causal LM that, at the placeholder token ending each step, predicts a reward token.

    loss = mean over step placeholders of  -sum_k q_k log softmax(z[K])_k                (a step weighs 1)

with ``z`` the logits at the placeholder position restricted to the ``--reward_tokens`` classes ``K`` (the whole
vocabulary when unset) and ``q`` one-hot on the labelled reward token (hard labels) or ``(p, 1 - p)`` (soft labels).
Only the placeholder positions carry loss. The math is `rlhfkit.algorithms.supervised.prm_token_loss`; the data is
`rlhfkit.data.process`. At inference `prm_step_scores` returns, per step, the probability of the first (good)
reward token, as OpenRLHF's PRM does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from rlhfkit.algorithms.supervised import prm_token_loss
from rlhfkit.config.commands import PRMConfig
from rlhfkit.config.validate import need
from rlhfkit.data.collate import collate_packed, collate_padded, model_inputs
from rlhfkit.data.encoding import Encoder
from rlhfkit.data.formatting import apply_input_template
from rlhfkit.data.process import IGNORE, ProcessLabels, build_process_samples, encode_steps, single_token_id
from rlhfkit.engine.distributed import DistInfo
from rlhfkit.trainers.loop import OfflineMethod
from rlhfkit.trainers.sequence_logps import model_device, to_device


def prm_samples(cfg: PRMConfig, tokenizer: Any, rows: Any) -> tuple[list[dict], dict[str, Any]]:
    return build_process_samples(rows, tokenizer, input_key=cfg.input_key, label_key=need(cfg.label_key, "--label_key"),
                                 placeholder_token=need(cfg.placeholder_token, "--placeholder_token"),
                                 reward_tokens=cfg.reward_tokens,
                                 input_template=cfg.input_template, max_len=cfg.max_len)


def collate_prm(samples: Sequence[dict], pad_token_id: int, packed: bool = False) -> dict[str, Any]:
    """Padded ``input_ids`` etc. plus ``labels [B, T]``: long (token ids) for hard labels, float for soft ones.
    With `packed`, one ``[1, total]`` row of the samples and their labels (the loss reads placeholder positions,
    wherever they are)."""
    soft = any(isinstance(v, float) for s in samples for v in s["labels"])
    dtype = torch.float32 if soft else torch.long
    if packed:
        batch = collate_packed(samples, keys=("input_ids", None))
        batch["labels"] = torch.tensor([v for s in samples for v in s["labels"]], dtype=dtype)[None]
        return batch
    batch = collate_padded(samples, pad_token_id, keys=("input_ids", None))
    labels = torch.full(batch["input_ids"].shape, IGNORE, dtype=dtype)
    for b, s in enumerate(samples):
        labels[b, :len(s["labels"])] = torch.tensor(s["labels"], dtype=labels.dtype)
    batch["labels"] = labels
    return batch


def prm_batch_loss(model: nn.Module, batch: dict[str, Any], *, placeholder_token_id: int,
                   reward_token_ids: list[int] | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over the micro-batch's steps of the token loss, and the number of correctly classified steps."""
    batch = to_device(batch, model_device(model))
    logits = model(**model_inputs(batch, model=model)).logits
    loss, accuracy = prm_token_loss(logits, batch["input_ids"], batch["labels"],
                                    placeholder_token_id=placeholder_token_id, reward_token_ids=reward_token_ids)
    steps = (batch["input_ids"] == placeholder_token_id).sum()
    return loss * steps, {"accuracy": accuracy * steps}


def prm_method(cfg: PRMConfig, tokenizer: Any, dist_info: DistInfo) -> OfflineMethod:
    conv = ProcessLabels(tokenizer, need(cfg.placeholder_token, "--placeholder_token"), cfg.reward_tokens)
    pad_id = tokenizer.pad_token_id
    return OfflineMethod(
        name="prm", collate=lambda samples: collate_prm(samples, pad_id, cfg.packing_samples),
        weight=lambda s: float(s["num_steps"]),
        loss=lambda model, batch: prm_batch_loss(model, batch, placeholder_token_id=conv.placeholder_id,
                                                 reward_token_ids=conv.reward_ids),
        tokens=lambda s: len(s["input_ids"]))


@torch.no_grad()
def prm_step_scores(model: nn.Module, tokenizer: Any, texts: Sequence[str], *, placeholder_token: str,
                    reward_tokens: Sequence[str], input_template: str | None = None) -> list[list[float]]:
    """For each text, one score per step: ``p(reward_tokens[0])`` among the reward tokens at each placeholder."""
    if not reward_tokens:
        raise ValueError("prm_step_scores needs reward_tokens (the good token first)")
    placeholder_id = single_token_id(tokenizer, placeholder_token, "--placeholder_token")
    reward_ids = [single_token_id(tokenizer, t, "--reward_tokens") for t in reward_tokens]
    encoder = Encoder(tokenizer)
    rows = [{"input_ids": encode_steps(encoder, apply_input_template(t, input_template).split(placeholder_token),
                                       placeholder_id)} for t in texts]
    batch = to_device(collate_padded(rows, tokenizer.pad_token_id, keys=("input_ids", None)), model_device(model))
    logits = model(**model_inputs(batch, model=model)).logits.float()
    probs = torch.softmax(logits[..., reward_ids], dim=-1)[..., 0]
    at = batch["input_ids"] == placeholder_id
    return [probs[b][at[b]].cpu().tolist() for b in range(len(rows))]


def validate_prm(cfg: PRMConfig) -> None:
    from rlhfkit.errors import ConfigError

    if not cfg.placeholder_token:
        raise ConfigError("--placeholder_token is required for 'rlhfkit prm' (the token that ends each step)")
