"""Masked reductions, whitening and loss aggregation over ragged token tensors.

Token tensors are ``[batch, response_len]`` with an ``action_mask`` of the same shape (bool or 0/1); a position
counts when its mask is non-zero. Values at masked positions are never read (they may hold padding, inf or NaN).

Every statistic can be made global across data-parallel ranks by passing ``process_group``: the local sums and
counts are all-reduced (float64) so that the result is the statistic of the concatenated batch, identical for one
rank holding everything and N ranks holding a slice each. ``process_group=None`` means *this rank only* (no
communication); pass ``torch.distributed.group.WORLD`` or a subgroup for the global value. The all-reduced
statistics carry no gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LOSS_AGG_MODES = ("token_mean", "seq_mean", "seq_mean_token_sum_norm")


def as_bool_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Return ``mask != 0`` as a bool tensor shaped like ``like`` (all True when ``mask`` is None)."""
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    if mask.shape != like.shape:
        raise ValueError(f"action_mask has shape {tuple(mask.shape)} but the values have shape {tuple(like.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype math runs in: at least float32 (bf16/fp16 inputs are upcast), float64 stays float64."""
    return torch.promote_types(x.dtype, torch.float32)


def _all_reduce(t: torch.Tensor, process_group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if process_group is not None:
        dist.all_reduce(t, op=op, group=process_group)
    return t


def masked_sum(x: torch.Tensor, mask: torch.Tensor | None, dim: int | None = None) -> torch.Tensor:
    """``sum_i m_i x_i`` over ``dim`` (all elements when None); masked entries contribute exactly 0."""
    m = as_bool_mask(mask, x)
    z = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return z.sum() if dim is None else z.sum(dim=dim)


def global_sum_and_count(
    x: torch.Tensor, mask: torch.Tensor | None, process_group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_i m_i x_i, sum_i m_i)`` over every element on every rank of ``process_group``, in float64, no grad."""
    m = as_bool_mask(mask, x)
    stats = torch.stack([masked_sum(x.detach().double(), m), m.sum().double()])
    stats = _all_reduce(stats, process_group)
    return stats[0], stats[1]


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor | None, dim: int | None = None, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Masked mean ``sum_i m_i x_i / max(sum_i m_i, 1)``.

    ``dim=None``: one scalar over all elements (global over ``process_group`` when given; then no gradient).
    ``dim=d``: per-slice mean along ``d``; a slice with no valid element gives 0. Differentiable when local.
    """
    if process_group is not None:
        if dim is not None:
            raise ValueError("masked_mean: process_group is only supported with dim=None (a global scalar)")
        total, count = global_sum_and_count(x, mask, process_group)
        return (total / count.clamp(min=1)).to(compute_dtype(x))
    m = as_bool_mask(mask, x)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(x, m, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    unbiased: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global masked mean and variance ``(mu, sum_i m_i (x_i - mu)^2 / (N - u))``, ``N = sum_i m_i``, u = 1 if unbiased.

    Two passes (mean first, then squared deviations) in float64, so the result does not suffer the cancellation
    of ``E[x^2] - E[x]^2``. Returns ``(mean, var)`` as float64 scalars with no gradient; var is 0 when ``N <= u``.
    """
    total, count = global_sum_and_count(x, mask, process_group)
    mean = total / count.clamp(min=1)
    sq, _ = global_sum_and_count((x.detach().double() - mean) ** 2, mask, process_group)
    denom = count - (1.0 if unbiased else 0.0)
    var = torch.where(denom > 0, sq / denom.clamp(min=1), torch.zeros_like(sq))
    return mean, var


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    shift_mean: bool = True,
    std_norm: bool = True,
    eps: float = 1e-8,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Whiten over valid tokens: ``(x - mu) / sqrt(max(var, eps))`` with mu, var the global masked mean and
    (population) variance; ``shift_mean=False`` keeps the mean (``x / sqrt(max(var, eps))``), ``std_norm=False``
    only centres (``x - mu``, the ``--no_advantage_std_norm`` case). Masked positions are 0 in the result.
    """
    m = as_bool_mask(mask, x)
    mean, var = masked_var(x, m, process_group=process_group)
    out = x.to(compute_dtype(x))
    if shift_mean:
        out = out - mean.to(out.dtype)
    if std_norm:
        out = out * torch.rsqrt(var.clamp(min=eps)).to(out.dtype)
    return torch.where(m, out, torch.zeros((), dtype=out.dtype, device=out.device))


def aggregate_loss(
    loss: torch.Tensor,
    mask: torch.Tensor | None,
    mode: str = "token_mean",
    *,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``l[b, t]`` to a scalar.

    - ``token_mean``: ``sum_{b,t} m l / N`` with ``N = sum m`` (or ``num_tokens``: pass the token count of the
      whole batch across micro-batches / ranks to get the mean over the whole batch under gradient accumulation).
    - ``seq_mean``: ``(1/B') sum_b (sum_t m l / sum_t m)`` over the ``B'`` rows with at least one valid token
      (or ``num_seqs``).
    - ``seq_mean_token_sum_norm`` (Dr. GRPO, no length normalisation): ``sum_{b,t} m l / (B * L)`` with the
      constant ``L = max_len`` (default: ``response_len``) and ``B = num_seqs`` (default: batch size).
    An empty mask gives 0 (still connected to the graph).
    """
    m = as_bool_mask(mask, loss)
    if mode == "token_mean":
        denom = m.sum().clamp(min=1) if num_tokens is None else num_tokens
        return masked_sum(loss, m) / denom
    if mode == "seq_mean":
        per_seq = masked_mean(loss, m, dim=-1)
        has_tokens = m.any(dim=-1)
        denom = has_tokens.sum().clamp(min=1) if num_seqs is None else num_seqs
        return masked_sum(per_seq, has_tokens) / denom
    if mode == "seq_mean_token_sum_norm":
        length = loss.shape[-1] if max_len is None else max_len
        rows = loss.shape[0] if num_seqs is None else num_seqs
        return masked_sum(loss, m) / (rows * length)
    raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")
