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
UNBIASED_KL_RHO_MAX = 10.0  # the cap on --use_unbiased_kl's importance weight (OpenRLHF's)


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

    Unbiased form (``--use_unbiased_kl``, DeepSeek-V3.2's importance-weighted k3; k3 only): given ``old_log_probs``
    (the sampling policy's), each token's estimate is weighted by ``rho_t = min(exp(clamp(log pi_t - log pi_old_t,
    -c, c)), 10)`` (c = ``log_ratio_clip``; the cap at 10 is OpenRLHF's): value ``agg_t(rho_t k3(r_t))``. Since
    ``E_{pi_old}[rho k3(r)] = KL(pi || pi_ref)`` and ``d(rho k3)/d log pi = rho (k3 + 1 - exp(-r)) = rho r``, the
    gradient per token is ``rho_t r_t grad log pi_t``: unbiased for ``grad KL(pi || pi_ref)`` (up to the cap). It is
    written in that form (a stop-gradient surrogate), not by differentiating ``rho * clamp(k3, +-kl_clip)``: where
    the clamp is active the clamped estimate has no gradient of its own, and the product's gradient would be
    ``rho * kl_clip * grad log pi``, always positive, pushing a token far below the reference further down.
    k1 and k2 have no such unbiased weighted form (``rho k1`` and ``rho k2`` differentiate to ``rho (r + 1)`` and
    ``rho r (1 + r/2)``): refused.
    """
    kl = compute_kl(log_probs, ref_log_probs, action_mask, estimator, log_ratio_clip=log_ratio_clip, kl_clip=kl_clip)
    if old_log_probs is not None:
        if estimator != "k3":
            raise ValueError(f"the importance-weighted (unbiased) KL loss is defined for k3 only, got {estimator!r}: "
                             "rho * k1 and rho * k2 are not unbiased gradients of KL(pi || pi_ref)")
        clip = 20.0 if log_ratio_clip is None else log_ratio_clip
        rho = log_ratio(log_probs, old_log_probs, clip).exp().clamp(max=UNBIASED_KL_RHO_MAX).detach()
        r = log_ratio(log_probs, ref_log_probs, log_ratio_clip).detach()
        score = log_probs.to(kl.dtype) - log_probs.detach().to(kl.dtype)  # 0 in value, gradient 1
        weighted = (rho * kl).detach() + rho * r * score
        kl = torch.where(as_bool_mask(action_mask, kl), weighted, torch.zeros((), dtype=kl.dtype, device=kl.device))
    return aggregate_loss(kl, action_mask, loss_agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)


def full_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                    mask: torch.Tensor | None = None) -> torch.Tensor:
    """Exact per-position reverse KL over the whole vocabulary, ``[..., len]`` from logits ``[..., len, vocab]``:
    ``KL(p_s || p_t) = sum_v p_s(v) (log p_s(v) - log p_t(v))`` with ``p = softmax(logits)`` (in float32 or wider);
    0 at masked positions. The quantity on-policy distillation's sampled signal estimates (held-out evaluation)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(student_logits.shape)} vs {tuple(teacher_logits.shape)}: "
                         "the two models must share the vocabulary")
    dtype = torch.promote_types(compute_dtype(student_logits), compute_dtype(teacher_logits))
    log_s = torch.log_softmax(student_logits.to(dtype), dim=-1)
    log_t = torch.log_softmax(teacher_logits.to(dtype), dim=-1)
    kl = (log_s.exp() * (log_s - log_t)).sum(-1)
    m = as_bool_mask(mask, kl)
    return torch.where(m, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
