"""Off-policy correction between the rollout engine's log-probs (vLLM) and the trainer's
(``--enable_vllm_is_correction``; the grid ``--is_correction_level token|seq|geo`` x
``--is_correction_mode mask|clip|trunc``, or its named points ``--vllm_is_correction_type tis|icepop|seq-mask-tis``;
``--vllm_is_truncated_threshold``; Molt's divergence gates ``--is_correction_gating binary_kl|tv``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .kl import log_ratio
from .normalize import as_bool_mask, masked_mean, masked_sum

IS_CORRECTION_LEVELS = ("token", "seq", "geo")
IS_CORRECTION_MODES = ("mask", "clip", "trunc")
# the named corrections OpenRLHF has, as cells (level, mode) of the grid
IS_CORRECTION_PRESETS: dict[str, tuple[str, str]] = {
    "tis": ("token", "clip"), "icepop": ("token", "mask"), "seq-mask-tis": ("geo", "mask"),
}
IS_CORRECTION_TYPES = tuple(IS_CORRECTION_PRESETS)
# what is compared with the bounds: the importance ratio, or (Molt) a divergence of the sampled token's probability
IS_CORRECTION_GATINGS = ("ratio", "binary_kl", "tv")
PROB_CLAMP = 1e-6  # binary_kl: probabilities kept in [1e-6, 1 - 1e-6] so both logs stay finite (Molt's clamp)


def sampled_token_divergence(gating: str, train_log_probs: torch.Tensor,
                             rollout_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token divergence between the rollout engine's and the trainer's probability of the sampled token,
    ``p = exp(rollout_log_probs)``, ``q = exp(train_log_probs)`` (Molt's ``is_correction_gating``):

    - ``binary_kl``: ``KL(Bernoulli(p) || Bernoulli(q)) = p log(p / q) + (1 - p) log((1 - p) / (1 - q))``, with
      ``p`` and ``q`` clamped to ``[1e-6, 1 - 1e-6]``;
    - ``tv``: the total variation of those two Bernoullis, ``|p - q|``.

    Both are >= 0 and 0 exactly when the engines agree on the token."""
    p = rollout_log_probs.exp()
    q = train_log_probs.exp()
    if gating == "tv":
        return (p - q).abs()
    if gating != "binary_kl":
        raise ValueError(f"--is_correction_gating must be one of {IS_CORRECTION_GATINGS}, got {gating!r}")
    p, q = p.clamp(PROB_CLAMP, 1 - PROB_CLAMP), q.clamp(PROB_CLAMP, 1 - PROB_CLAMP)
    return p * (p.log() - q.log()) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))


def is_correction_cell(correction_type: str | None = None, level: str | None = None,
                       mode: str | None = None) -> tuple[str, str]:
    """The grid cell ``(level, mode)``: ``(level, mode)`` when both are given, else the preset ``correction_type``."""
    if (level is None) != (mode is None):
        raise ValueError("--is_correction_level and --is_correction_mode go together: give both (or neither, and "
                         "--vllm_is_correction_type names the cell)")
    if level is None or mode is None:
        if correction_type not in IS_CORRECTION_PRESETS:
            raise ValueError(f"--vllm_is_correction_type must be one of {IS_CORRECTION_TYPES}, got {correction_type!r}")
        return IS_CORRECTION_PRESETS[correction_type]
    if level not in IS_CORRECTION_LEVELS:
        raise ValueError(f"--is_correction_level must be one of {IS_CORRECTION_LEVELS}, got {level!r}")
    if mode not in IS_CORRECTION_MODES:
        raise ValueError(f"--is_correction_mode must be one of {IS_CORRECTION_MODES}, got {mode!r}")
    return level, mode


def importance_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    action_mask: torch.Tensor | None,
    *,
    correction_type: str | None = "tis",
    level: str | None = None,
    mode: str | None = None,
    low: float = 0.5,
    high: float = 5.0,
    log_ratio_clip: float = 20.0,
    gating: str = "ratio",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token importance weights (detached, 0 at masked positions) that multiply the per-token policy loss.

    Token weight ``w_t = exp(l_t)``, ``l_t = clamp(log pi_train_old - log pi_rollout, -20, 20)``. The *unit* weight
    ``u`` by level: ``token``: ``u_t = w_t``; ``seq`` (the sequence's IS weight, the product of its token weights):
    ``u_i = exp(clamp(sum_{t in y_i} l_t, -20, 20))``; ``geo`` (its geometric mean): ``u_i = exp(mean_{t in y_i} l_t)``.
    Then by mode, with ``(low, high)`` = ``--vllm_is_truncated_threshold`` (default ``(0.5, 5.0)``):

    - ``trunc`` (truncated IS): ``w'_t = min(u, high)`` (``low`` unused);
    - ``clip``: ``w'_t = clamp(u, low, high)``;
    - ``mask``: the unit is dropped when ``u`` is outside ``[low, high]``, a kept unit's tokens carry their own
      weight clamped into the range: ``w'_t = clamp(w_t, low, high) 1[low <= u <= high]`` (at token level the clamp
      is a no-op: a kept token's ``w_t`` is in the range).

    ``u_i`` is broadcast over the tokens of row i. The named corrections are cells (``IS_CORRECTION_PRESETS``):
    ``tis`` = token x clip, ``icepop`` = token x mask, ``seq-mask-tis`` = geo x mask. ``(level, mode)`` given
    together override ``correction_type``.

    ``gating`` ``binary_kl`` / ``tv`` (Molt's divergence gates, a trust region on the rollout/trainer mismatch):
    the unit statistic is ``d_t = sampled_token_divergence(gating, old, rollout)`` at ``token`` level, its mean over
    the row's valid tokens at ``seq`` level; the unit is dropped when ``d > high`` (``low`` must be 0) and a kept
    unit's tokens carry their own unclamped ``w_t`` (as Molt). Only ``mask`` mode and the ``token``/``seq`` levels
    apply: a divergence is no weight to clamp, and ``geo`` is a ratio's mean.
    Metrics: ``is_weight_mean`` (of ``w'``) and ``is_truncated_frac`` (share of valid tokens whose unit weight is
    outside ``[low, high]``; for ``trunc``, above ``high``).
    """
    level, mode = is_correction_cell(correction_type, level, mode)
    if not 0 <= low <= high:
        raise ValueError(f"--vllm_is_truncated_threshold must be (low, high) with 0 <= low <= high, got {low}, {high}")
    if gating not in IS_CORRECTION_GATINGS:
        raise ValueError(f"--is_correction_gating must be one of {IS_CORRECTION_GATINGS}, got {gating!r}")
    m = as_bool_mask(action_mask, old_log_probs)
    if gating != "ratio":
        return _divergence_gated_weights(old_log_probs, rollout_log_probs, m, gating=gating, level=level, mode=mode,
                                         low=low, high=high, log_ratio_clip=log_ratio_clip)
    with torch.no_grad():
        lw = log_ratio(old_log_probs.detach(), rollout_log_probs.detach(), log_ratio_clip)
        lw = torch.where(m, lw, torch.zeros_like(lw))  # padding may hold anything
        w = lw.exp()
        if level == "token":
            unit = w
        elif level == "seq":
            unit = masked_sum(lw, m, dim=-1).clamp(-log_ratio_clip, log_ratio_clip).exp().unsqueeze(-1).expand_as(w)
        else:
            unit = masked_mean(lw, m, dim=-1).exp().unsqueeze(-1).expand_as(w)
        inside = (unit >= low) & (unit <= high)
        if mode == "trunc":
            weights = unit.clamp(max=high)
            outside = unit > high
        elif mode == "clip":
            weights = unit.clamp(low, high)
            outside = ~inside
        else:
            weights = torch.where(inside, w.clamp(low, high), torch.zeros_like(w))
            outside = ~inside
        weights = torch.where(m, weights, torch.zeros_like(weights))
        metrics = {
            "is_weight_mean": masked_mean(weights, m),
            "is_truncated_frac": masked_mean(outside.to(w.dtype), m),
        }
    return weights, metrics


def _divergence_gated_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, m: torch.Tensor, *,
                              gating: str, level: str, mode: str, low: float, high: float,
                              log_ratio_clip: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``importance_weights`` for ``gating`` binary_kl / tv (see there)."""
    if mode != "mask" or level not in ("token", "seq"):
        raise ValueError(f"--is_correction_gating {gating} drops the tokens or sequences whose divergence exceeds the "
                         f"bound: it takes mode mask at level token or seq, got {level} x {mode}")
    if low != 0:
        raise ValueError(f"--is_correction_gating {gating} bounds a divergence from above only: give "
                         f"--vllm_is_truncated_threshold 0 DELTA (Molt's single delta), got {low}, {high}")
    with torch.no_grad():
        old, rollout = old_log_probs.detach(), rollout_log_probs.detach()
        lw = log_ratio(old, rollout, log_ratio_clip)
        lw = torch.where(m, lw, torch.zeros_like(lw))
        w = lw.exp()
        zeros = torch.zeros_like(w)
        div = torch.where(m, sampled_token_divergence(gating, torch.where(m, old, zeros),
                                                      torch.where(m, rollout, zeros)), zeros)
        unit = div if level == "token" else masked_mean(div, m, dim=-1).unsqueeze(-1).expand_as(w)
        outside = unit > high
        weights = torch.where(m & ~outside, w, zeros)
        metrics = {
            "is_weight_mean": masked_mean(weights, m),
            "is_truncated_frac": masked_mean(outside.to(w.dtype), m),
            "is_divergence_mean": masked_mean(div, m),
        }
    return weights, metrics


def logprob_mismatch(
    train_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    action_mask: torch.Tensor | None,
    *,
    process_group: dist.ProcessGroup | None = None,
    log_ratio_clip: float = 20.0,
) -> dict[str, torch.Tensor]:
    """Mismatch between trainer and rollout-engine log-probs of the sampled tokens,
    ``d = log pi_train - log pi_rollout`` (global over ``process_group`` when given):

    ``logprob_abs_diff_mean = mean |d|``, ``logprob_abs_diff_max = max |d|``,
    ``is_ratio_mean = mean exp(d)`` (1 when the engines agree: ``E_rollout[pi_train / pi_rollout] = 1``),
    ``rollout_kl_k3 = mean(exp(d) - 1 - d)`` (k3 estimate of ``KL(pi_rollout || pi_train)``); ``d`` clamped to +-20.
    """
    m = as_bool_mask(action_mask, train_log_probs)
    with torch.no_grad():
        d = log_ratio(train_log_probs.detach(), rollout_log_probs.detach(), log_ratio_clip)
        abs_d = d.abs()
        max_abs = torch.where(m, abs_d, torch.zeros_like(abs_d)).amax() if m.numel() else abs_d.new_zeros(())
        if process_group is not None:
            dist.all_reduce(max_abs, op=dist.ReduceOp.MAX, group=process_group)
        return {
            "logprob_abs_diff_mean": masked_mean(abs_d, m, process_group=process_group),
            "logprob_abs_diff_max": max_abs,
            "is_ratio_mean": masked_mean(d.exp(), m, process_group=process_group),
            "rollout_kl_k3": masked_mean(torch.expm1(d) - d, m, process_group=process_group),
        }
