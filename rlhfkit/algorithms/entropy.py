"""Policy entropy from logits (``--entropy_loss_coef``)."""

from __future__ import annotations

import torch

from .normalize import aggregate_loss, compute_dtype


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of ``softmax(z)`` over the last dim: ``H = logsumexp(z) - sum_v p_v z_v``,
    in at least float32; ``-inf`` logits (banned tokens) contribute 0."""
    z = logits.to(compute_dtype(logits))
    p = torch.softmax(z, dim=-1)
    finite_z = torch.where(p > 0, z, torch.zeros((), dtype=z.dtype, device=z.device))  # no -inf * 0 in backward
    return torch.logsumexp(z, dim=-1) - (p * finite_z).sum(dim=-1)


def policy_entropy(
    logits: torch.Tensor,
    action_mask: torch.Tensor | None,
    *,
    loss_agg_mode: str = "token_mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Aggregated entropy ``agg_t H(pi(. | s_t))`` over valid tokens; ``logits`` is ``[batch, len, vocab]``
    aligned with ``action_mask`` ``[batch, len]``. The entropy bonus is ``loss -= entropy_loss_coef * this``."""
    return aggregate_loss(
        entropy_from_logits(logits),
        action_mask,
        loss_agg_mode,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        max_len=max_len,
    )
