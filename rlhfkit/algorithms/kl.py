"""Per-token KL estimators between the policy and the reference model (Schulman's k1 / k2 / k3).

With ``r_t = log pi(y_t) - log pi_ref(y_t)`` for a token sampled from pi, each estimator's expectation under pi
relates to ``KL(pi || pi_ref)``: k1 is unbiased, k2 and k3 are non-negative (k3 unbiased, k2 low variance).
Selected by ``--kl_estimator k1|k2|k3``; used either as a reward penalty (``--init_kl_coef``, see
``rewards.shape_rewards``) or as a loss term (``--use_kl_loss``, :func:`kl_loss`).
"""

from __future__ import annotations

import torch

from .normalize import aggregate_loss, as_bool_mask, compute_dtype

KL_ESTIMATORS = ("k1", "k2", "k3")


def log_ratio(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, log_ratio_clip: float | None = 20.0
) -> torch.Tensor:
    """``r = clamp(log_probs - ref_log_probs, -c, c)`` in at least float32 (``c = log_ratio_clip``; None: no clamp).

    The clamp keeps ``exp(+-r)`` finite (e^20 ~ 4.9e8) and maps +-inf log-ratios to +-c; its gradient is 0 outside.
    """
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"log-prob shapes differ: {tuple(log_probs.shape)} vs {tuple(ref_log_probs.shape)}")
    dtype = torch.promote_types(compute_dtype(log_probs), compute_dtype(ref_log_probs))
    r = log_probs.to(dtype) - ref_log_probs.to(dtype)
    return r if log_ratio_clip is None else r.clamp(-log_ratio_clip, log_ratio_clip)


def compute_kl(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    action_mask: torch.Tensor | None = None,
    estimator: str = "k1",
    *,
    log_ratio_clip: float | None = 20.0,
    kl_clip: float | None = 10.0,
) -> torch.Tensor:
    """Per-token KL estimate ``[batch, response_len]``, 0 at masked positions.

    ``r = clamp(log pi - log pi_ref, -log_ratio_clip, log_ratio_clip)``, then
    ``k1 = r``;  ``k2 = r^2 / 2``;  ``k3 = exp(-r) - 1 + r``;
    the estimate is finally clamped to ``[-kl_clip, kl_clip]`` (OpenRLHF clamps to +-10; None: no clamp).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"--kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    r = log_ratio(log_probs, ref_log_probs, log_ratio_clip)
    if estimator == "k1":
        kl = r
    elif estimator == "k2":
        kl = 0.5 * r.square()
    else:
        kl = torch.expm1(-r) + r
    if kl_clip is not None:
        kl = kl.clamp(-kl_clip, kl_clip)
    m = as_bool_mask(action_mask, kl)
    return torch.where(m, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    action_mask: torch.Tensor | None,
    estimator: str = "k3",
    *,
    loss_agg_mode: str = "token_mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    max_len: int | None = None,
    log_ratio_clip: float | None = 20.0,
    kl_clip: float | None = 10.0,
    old_log_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL as a loss term (``--use_kl_loss``): ``agg_t(k(r_t))`` with ``k`` from :func:`compute_kl`, differentiable
    in ``log_probs``. The trainer adds ``init_kl_coef * kl_loss`` to the policy loss. On-policy, k2's gradient
    ``r grad log pi`` is unbiased for ``grad KL(pi || pi_ref)``; k3's (GRPO's choice) for ``grad KL(pi_ref || pi)``;
    k1's gradient has zero expectation, so it makes a poor loss.

    Unbiased form (``--use_unbiased_kl``, DeepSeek-V3.2's importance-weighted k3): given ``old_log_probs`` (the
    sampling policy's), each token's estimate is weighted by the differentiable ratio
    ``rho_t = exp(clamp(log pi_t - log pi_old_t, -20, 20))``: ``agg_t(rho_t k(r_t))``. Since
    ``E_{pi_old}[rho k3(r)] = KL(pi || pi_ref)``, its gradient ``rho_t (k3(r_t) + 1 - exp(-r_t)) grad log pi_t
    = rho_t r_t grad log pi_t`` is unbiased for ``grad KL(pi || pi_ref)`` (on-policy ``rho = 1`` in value, so the
    loss value is unchanged and only the gradient gains the score-function term ``k3 grad log pi``).
    """
    kl = compute_kl(log_probs, ref_log_probs, action_mask, estimator, log_ratio_clip=log_ratio_clip, kl_clip=kl_clip)
    if old_log_probs is not None:
        rho = log_ratio(log_probs, old_log_probs.detach(), 20.0 if log_ratio_clip is None else log_ratio_clip).exp()
        kl = torch.where(as_bool_mask(action_mask, kl), rho * kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    return aggregate_loss(kl, action_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)
