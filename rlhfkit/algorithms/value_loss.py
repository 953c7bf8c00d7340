"""The critic's value loss with optional clipping (``--value_clip``)."""

from __future__ import annotations

import torch

from .normalize import aggregate_loss, as_bool_mask, compute_dtype, masked_mean


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    action_mask: torch.Tensor | None,
    *,
    value_clip: float | None = None,
    loss_agg_mode: str = "token_mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    max_len: int | None = None,
    token_out: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``0.5 * agg(l)`` with ``l = (V - G)^2``, or with ``value_clip = c`` (``--value_clip``):
    ``l = max((V - G)^2, (V_old + clip(V - V_old, -c, c) - G)^2)``.

    Returns ``(loss, metrics)``: ``value_clip_frac`` (share of valid tokens where the clipped term is the larger)
    and ``values_mean``. ``token_out`` (a dict, for ``--debug_dump_steps``): filled with the detached per-token
    ``loss`` ``0.5 * l`` (0 at masked positions; with ``token_mean`` its masked sum over ``num_tokens`` is the loss).
    """
    m = as_bool_mask(action_mask, values)
    dtype = compute_dtype(values)
    v, g = values.to(dtype), returns.to(dtype).detach()
    unclipped = (v - g).square()
    if value_clip is None:
        per_token = unclipped
        clip_active = torch.zeros_like(m)
    else:
        if value_clip <= 0:
            raise ValueError(f"--value_clip must be > 0, got {value_clip}")
        v_old = old_values.to(dtype).detach()
        clipped = (v_old + (v - v_old).clamp(-value_clip, value_clip) - g).square()
        per_token = torch.max(unclipped, clipped)
        clip_active = clipped > unclipped
    if token_out is not None:
        token_out["loss"] = torch.where(m, 0.5 * per_token.detach(), torch.zeros((), dtype=dtype, device=m.device))
    loss = 0.5 * aggregate_loss(per_token, m, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)
    with torch.no_grad():
        metrics = {
            "value_clip_frac": masked_mean(clip_active.to(dtype), m),
            "values_mean": masked_mean(v.detach(), m),
        }
    return loss, metrics
