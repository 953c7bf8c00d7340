"""Micro-batches of a model worker (rlhfkit.rl.worker): a batch cut by rows or, with --use_dynamic_batch, by a token
budget, and a trimmed micro-batch's per-token outputs padded back to the batch's response width."""

from __future__ import annotations

import torch

from rlhfkit.config.rl_options import DynamicBatchOptions


def micro_batches(batch: dict[str, torch.Tensor], size: int, max_tokens: int | None = None) -> list[dict]:
    """Cut a batch into micro-batches: `size` rows each, or (dynamic batch) rows up to `max_tokens` real tokens."""
    rows = batch["sequences"].shape[0]
    if max_tokens is None:
        bounds = [(i, min(rows, i + size)) for i in range(0, rows, size)]
    else:
        lengths = batch["attention_mask"].sum(-1).tolist()
        bounds, start, used = [], 0, 0
        for i, n in enumerate(lengths):
            if i > start and used + n > max_tokens:
                bounds.append((start, i))
                start, used = i, 0
            used += n
        bounds.append((start, rows))
    return [{k: v[a:b] for k, v in batch.items()} for a, b in bounds]


def rollout_budget(cfg: DynamicBatchOptions) -> int | None:
    """Token budget of a forward micro-batch (log-probs, values, rewards) with --use_dynamic_batch:
    --rollout_max_tokens_per_gpu, else --train_max_tokens_per_gpu (OpenRLHF's fallback); None without it."""
    if not cfg.use_dynamic_batch:
        return None
    return cfg.rollout_max_tokens_per_gpu or cfg.train_max_tokens_per_gpu


def pad_to(values: torch.Tensor, width: int) -> torch.Tensor:
    """[b, r] per-response-token values of a trimmed micro-batch back to the batch's response width (0 beyond)."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))
