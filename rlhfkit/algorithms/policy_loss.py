"""The PPO clipped surrogate policy loss with asymmetric and dual clipping (``--eps_clip``,
``--eps_clip_low_high``, ``--dual_clip``), optionally weighted by off-policy importance weights, with a per-token
(``--policy_loss_type ppo``) or per-sequence (``gspo``) importance ratio, and CISPO's clipped-weight REINFORCE
(``cispo``)."""

from __future__ import annotations

import torch

from .kl import log_ratio
from .normalize import aggregate_loss, as_bool_mask, masked_mean

POLICY_LOSS_TYPES = ("ppo", "gspo", "cispo")


def clip_bounds(eps_clip: float = 0.2, eps_clip_low_high: tuple[float, float] | None = None) -> tuple[float, float]:
    """``(eps_low, eps_high)``: ``--eps_clip_low_high`` when given, else ``(eps_clip, eps_clip)``."""
    low, high = (eps_clip, eps_clip) if eps_clip_low_high is None else eps_clip_low_high
    if low < 0 or high < 0 or low > 1:
        raise ValueError(f"clip range must satisfy 0 <= eps_low <= 1 and eps_high >= 0, got ({low}, {high})")
    return float(low), float(high)


def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor | None,
    *,
    eps_clip: float = 0.2,
    eps_clip_low_high: tuple[float, float] | None = None,
    dual_clip: float | None = None,
    loss_agg_mode: str = "token_mean",
    is_weights: torch.Tensor | None = None,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    max_len: int | None = None,
    log_ratio_clip: float = 20.0,
    token_out: dict[str, torch.Tensor] | None = None,
    policy_loss_type: str = "ppo",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate, per token then aggregated (``loss_agg_mode``, see ``normalize.aggregate_loss``):

    ``rho = exp(clamp(log pi - log pi_old, -20, 20))``, ``s1 = rho A``, ``s2 = clip(rho, 1 - eps_low, 1 + eps_high) A``,
    ``l = -min(s1, s2)``; with dual clip ``c > 1``: ``l = -max(min(s1, s2), c A)`` where ``A < 0``;
    with off-policy weights ``w`` (``offpolicy.importance_weights``, treated as constants): ``l <- w l``.

    ``policy_loss_type="gspo"`` (GSPO, Zheng et al. 2025, ``--policy_loss_type gspo``): one ratio per sequence,
    ``s_i = exp(mean_{t in y_i} clamp(log pi_t - log pi_old_t, -20, 20))`` over the valid tokens of row i, in
    the paper's token-level stop-gradient form ``s_{i,t} = sg[s_i] * pi_t / sg[pi_t]``: its value is ``s_i`` on
    every token of the row, its gradient ``s_i grad log pi_t``; ``rho`` above is ``s_{i,t}``, so the clip acts on
    whole sequences. With ``loss_agg_mode="seq_mean"`` and a per-sequence advantage this is exactly the gradient of
    the sequence-level objective ``-min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)``.

    ``policy_loss_type="cispo"`` (CISPO, MiniMax-M1, arXiv 2506.13585, ``--policy_loss_type cispo``): REINFORCE
    weighted by the clipped, stop-gradient importance ratio, ``l = -sg[clip(rho, 1 - eps_low, 1 + eps_high)] A
    log pi`` (no min, no dual clip): every token keeps the gradient ``-clip(rho) A grad log pi``, a token whose
    ratio left the range is down-weighted, never switched off. ``(eps_low, eps_high)`` are the PPO clip flags, as
    in verl (the paper sets no lower bound: ``--eps_clip_low_high 1 eps_high``). ``clip_frac`` is the share of
    tokens whose ratio is outside the range.

    Returns ``(loss, metrics)``; metrics (detached scalars over valid tokens): ``clip_frac`` (share of tokens
    where the clipped term is active, ``s2 < s1``), ``dual_clip_frac``, ``approx_kl`` (``mean(log pi_old - log pi)``),
    ``ratio_mean``, ``ratio_max``, ``ratio_min``.
    ``token_out`` (a dict, for ``--debug_dump_steps``): filled with the detached per-token ``ratio`` and ``loss``
    (``l`` after the weights; 0 at masked positions).
    """
    low, high = clip_bounds(eps_clip, eps_clip_low_high)
    if policy_loss_type not in POLICY_LOSS_TYPES:
        raise ValueError(f"--policy_loss_type must be one of {POLICY_LOSS_TYPES}, got {policy_loss_type!r}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"--dual_clip must be > 1, got {dual_clip}")
    if dual_clip is not None and policy_loss_type == "cispo":
        raise ValueError("--dual_clip bounds PPO's min(rho A, clip(rho) A); cispo has no such min: drop --dual_clip")
    m = as_bool_mask(action_mask, log_probs)
    lr = log_ratio(log_probs, old_log_probs.detach(), log_ratio_clip)
    adv = advantages.detach().to(lr.dtype)
    if policy_loss_type == "gspo":
        seq = masked_mean(lr.detach(), m, dim=-1).clamp(-log_ratio_clip, log_ratio_clip)
        lp = torch.where(m, log_probs.to(lr.dtype), torch.zeros((), dtype=lr.dtype, device=lr.device))
        ratio = torch.exp(seq.unsqueeze(-1) + (lp - lp.detach()))  # value s_i, gradient s_i grad log pi_t
    else:
        ratio = lr.exp()
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - low, 1.0 + high) * adv
    clipped = torch.min(surr1, surr2)
    objective = clipped
    dual_active = torch.zeros_like(m)
    clip_active = surr2 < surr1
    if policy_loss_type == "cispo":
        zero = torch.zeros((), dtype=lr.dtype, device=lr.device)
        lp = torch.where(m, log_probs.to(lr.dtype), zero)  # padding may hold -inf
        objective = ratio.detach().clamp(1.0 - low, 1.0 + high) * adv * lp
        clip_active = (ratio < 1.0 - low) | (ratio > 1.0 + high)
    elif dual_clip is not None:
        dual_active = (adv < 0) & (dual_clip * adv > clipped)
        objective = torch.where(dual_active, dual_clip * adv, clipped)
    loss = -objective
    if is_weights is not None:
        loss = loss * is_weights.detach().to(loss.dtype)
    if token_out is not None:
        token_out["ratio"] = ratio.detach()
        token_out["loss"] = torch.where(m, loss.detach(), torch.zeros((), dtype=loss.dtype, device=loss.device))
    total = aggregate_loss(loss, m, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(clip_active.to(lr.dtype), m),
            "dual_clip_frac": masked_mean(dual_active.to(lr.dtype), m),
            "approx_kl": masked_mean(-lr, m),
            **ratio_stats(ratio, m),
        }
    return total, metrics


def ratio_stats(ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``ratio_mean``, ``ratio_max``, ``ratio_min`` of ``ratio`` over valid tokens (0 when none is valid)."""
    m = as_bool_mask(mask, ratio)
    ratio = ratio.detach()
    any_valid = m.any()
    inf = torch.tensor(float("inf"), dtype=ratio.dtype, device=ratio.device)
    zero = ratio.new_zeros(())
    return {
        "ratio_mean": masked_mean(ratio, m),
        "ratio_max": torch.where(any_valid, torch.where(m, ratio, -inf).amax(), zero),
        "ratio_min": torch.where(any_valid, torch.where(m, ratio, inf).amin(), zero),
    }
