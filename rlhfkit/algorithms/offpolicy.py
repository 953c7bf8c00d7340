"""Off-policy correction between the rollout engine's log-probs (vLLM) and the trainer's
(``--enable_vllm_is_correction``, ``--vllm_is_correction_type tis|icepop|seq-mask-tis``,
``--vllm_is_truncated_threshold``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .kl import log_ratio
from .normalize import as_bool_mask, masked_mean

IS_CORRECTION_TYPES = ("tis", "icepop", "seq-mask-tis")


def importance_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    action_mask: torch.Tensor | None,
    *,
    correction_type: str = "tis",
    low: float = 0.5,
    high: float = 5.0,
    log_ratio_clip: float = 20.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token importance weights (detached, 0 at masked positions) that multiply the per-token policy loss.

    ``w = exp(clamp(log pi_train_old - log pi_rollout, -20, 20))``;
    ``tis`` (truncated IS): ``w' = clamp(w, low, high)``; ``icepop``: ``w' = w * 1[low <= w <= high]``;
    ``seq-mask-tis`` (sequence-level mask, OpenRLHF's rule): the geometric-mean weight of row i,
    ``W_i = exp(mean_{t in y_i} log w_t)``, decides for the whole sequence, ``w'_t = w_t * 1[low <= W_i <= high]``
    (the token weights themselves are not clamped, as in OpenRLHF's code).
    ``(low, high)`` is ``--vllm_is_truncated_threshold`` (default ``(0.5, 5.0)``).
    Metrics: ``is_weight_mean`` (of ``w'``) and ``is_truncated_frac`` (share of tokens with ``w`` outside the range;
    for ``seq-mask-tis``, share of tokens in sequences with ``W_i`` outside it).
    """
    if correction_type not in IS_CORRECTION_TYPES:
        raise ValueError(f"--vllm_is_correction_type must be one of {IS_CORRECTION_TYPES}, got {correction_type!r}")
    if not 0 <= low <= high:
        raise ValueError(f"--vllm_is_truncated_threshold must be (low, high) with 0 <= low <= high, got {low}, {high}")
    m = as_bool_mask(action_mask, old_log_probs)
    with torch.no_grad():
        lw = log_ratio(old_log_probs.detach(), rollout_log_probs.detach(), log_ratio_clip)
        w = lw.exp()
        inside = (w >= low) & (w <= high)
        if correction_type == "tis":
            weights = w.clamp(low, high)
        elif correction_type == "seq-mask-tis":
            seq_w = masked_mean(torch.where(m, lw, torch.zeros_like(lw)), m, dim=-1).exp().unsqueeze(-1)
            inside = ((seq_w >= low) & (seq_w <= high)).expand_as(w)
            weights = torch.where(inside, w, torch.zeros_like(w))
        else:
            weights = torch.where(inside, w, torch.zeros_like(w))
        weights = torch.where(m, weights, torch.zeros_like(weights))
        metrics = {
            "is_weight_mean": masked_mean(weights, m),
            "is_truncated_frac": masked_mean((~inside).to(w.dtype), m),
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
