"""Preference losses of the offline methods: reward-model pairwise losses (``--loss sigmoid|logexp``,
``--margin_loss``), DPO / IPO / cDPO (``--beta``, ``--ipo``, ``--label_smoothing``) and KTO
(``--desirable_loss_weight``, ``--undesirable_loss_weight``); vanilla KTO with in-batch reference points
(:func:`vanilla_kto_loss`; on a labelled batch :func:`vanilla_kto_labelled_loss`, ``rlhfkit kto --vanilla_loss``).

Sequence log-probabilities are ``log pi(y | x) = sum_t log pi(y_t | x, y_<t)`` over response tokens
(:func:`sequence_log_probs`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .normalize import as_bool_mask, compute_dtype, global_sum_and_count, masked_mean, masked_sum

REDUCTIONS = ("mean", "sum", "none")
RM_LOSSES = ("sigmoid", "logexp")


def _reduce(losses: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return losses.mean() if losses.numel() else losses.sum()
    if reduction == "sum":
        return losses.sum()
    if reduction == "none":
        return losses
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _f(x: torch.Tensor) -> torch.Tensor:
    return x.to(compute_dtype(x))


def sequence_log_probs(token_log_probs: torch.Tensor, mask: torch.Tensor | None, average: bool = False) -> torch.Tensor:
    """``sum_t m_t log p_t`` per row, or the mean ``sum_t m_t log p_t / sum_t m_t`` when ``average`` (0 for an
    empty row)."""
    x = _f(token_log_probs)
    return masked_mean(x, mask, dim=-1) if average else masked_sum(x, as_bool_mask(mask, x), dim=-1)


def pairwise_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Bradley-Terry loss ``-log sigmoid(r_c - r_r - margin)`` (``--loss sigmoid``; margin with ``--margin_loss``)."""
    diff = _f(chosen_rewards) - _f(rejected_rewards)
    if margin is not None:
        diff = diff - (margin.to(diff.dtype) if torch.is_tensor(margin) else margin)
    return _reduce(-F.logsigmoid(diff), reduction)


def logexp_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Log-exp loss ``log(1 + exp(r_r - r_c + margin))`` (``--loss logexp``), computed stably as a softplus.
    Mathematically equal to :func:`pairwise_loss`; kept as its own name for the flag."""
    diff = _f(rejected_rewards) - _f(chosen_rewards)
    if margin is not None:
        diff = diff + (margin.to(diff.dtype) if torch.is_tensor(margin) else margin)
    return _reduce(F.softplus(diff), reduction)


def reward_model_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    loss: str = "sigmoid",
    margin: torch.Tensor | float | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """Dispatch ``--loss sigmoid|logexp`` to :func:`pairwise_loss` / :func:`logexp_loss`."""
    if loss == "sigmoid":
        return pairwise_loss(chosen_rewards, rejected_rewards, margin, reduction)
    if loss == "logexp":
        return logexp_loss(chosen_rewards, rejected_rewards, margin, reduction)
    raise ValueError(f"--loss must be one of {RM_LOSSES}, got {loss!r}")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    ipo: bool = False,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO and its variants on sequence log-probs ``[batch]``. With
    ``h = (log pi(y_c) - log pi(y_r)) - (log pi_ref(y_c) - log pi_ref(y_r))``:

    - DPO: ``-log sigmoid(beta h)``;
    - cDPO (``--label_smoothing eps``): ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``;
    - IPO (``--ipo``): ``(h - 1 / (2 beta))^2`` (the IPO paper uses length-averaged log-probs:
      ``sequence_log_probs(..., average=True)``).

    Returns ``(loss, chosen_rewards, rejected_rewards)`` with the implicit rewards
    ``beta (log pi(y) - log pi_ref(y))`` (detached).
    """
    if beta <= 0:
        raise ValueError(f"--beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"--label_smoothing must be in [0, 0.5), got {label_smoothing}")
    pc, pr, rc, rr = (_f(x) for x in (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps))
    h = (pc - pr) - (rc - rr)
    if ipo:
        losses = (h - 1.0 / (2.0 * beta)).square()
    else:
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    chosen_rewards = (beta * (pc - rc)).detach()
    rejected_rewards = (beta * (pr - rr)).detach()
    return _reduce(losses, reduction), chosen_rewards, rejected_rewards


def kto_reference_kl(
    policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor, process_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """KTO's reference point ``z_ref = max(0, mean_j (log pi(y'_j | x_j) - log pi_ref(y'_j | x_j)))`` over the
    mismatched pairs ``(x_j, y'_j)`` of the batch, global over ``process_group``; detached."""
    total, count = global_sum_and_count(_f(policy_kl_logps) - _f(ref_kl_logps), None, process_group)
    return (total / count.clamp(min=1)).clamp(min=0).to(compute_dtype(policy_kl_logps))


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    policy_kl_logps: torch.Tensor,
    ref_kl_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    desirable_loss_weight: float = 1.0,
    undesirable_loss_weight: float = 1.0,
    process_group: dist.ProcessGroup | None = None,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KTO (Ethayarajh et al., 2024) on sequence log-probs ``[batch]``. With ``r = log pi(y|x) - log pi_ref(y|x)``
    and ``z = kto_reference_kl(...)``:
    desirable ``y``: ``l = lambda_D (1 - sigmoid(beta (r - z)))``;
    undesirable ``y``: ``l = lambda_U (1 - sigmoid(beta (z - r)))``
    (``lambda_D = --desirable_loss_weight``, ``lambda_U = --undesirable_loss_weight``).

    Returns ``(loss, rewards, z)`` with the implicit rewards ``beta r`` (detached) and the reference point ``z``.
    """
    if beta <= 0:
        raise ValueError(f"--beta must be > 0, got {beta}")
    r = _f(policy_logps) - _f(ref_logps)
    z = kto_reference_kl(policy_kl_logps, ref_kl_logps, process_group).to(r.dtype)
    d = as_bool_mask(desirable, r)
    losses = torch.where(
        d,
        desirable_loss_weight * (1.0 - torch.sigmoid(beta * (r - z))),
        undesirable_loss_weight * (1.0 - torch.sigmoid(beta * (z - r))),
    )
    return _reduce(losses, reduction), (beta * r).detach(), z


def vanilla_kto_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Vanilla KTO for even sampling, as OpenRLHF's ``VanillaKTOLoss`` (adapted from ContextualAI HALOs; early
    OpenRLHF KTO trainers selected it with ``--vanilla_loss``, OpenRLHF 0.11 has no KTO; ``kto --vanilla_loss`` runs
    :func:`vanilla_kto_labelled_loss`, its form on a labelled batch): the reference points are in-batch
    means of the other side's log-ratios instead of mismatched pairs. On sequence log-probs, chosen ``[n_c]`` and
    rejected ``[n_r]``, with ``r_c = pc - rc``, ``r_r = pr - rr``,
    ``KL_c = max(0, mean(r_c))``, ``KL_r = max(0, mean(r_r))`` (not detached, as in OpenRLHF's code; local batch):
    chosen ``l = 1 - sigmoid(beta (r_c - KL_r))``, rejected ``l = 1 - sigmoid(beta (KL_c - r_r))``;
    the loss reduces the ``n_c + n_r`` losses together (no desirable / undesirable weights).

    Returns ``(loss, chosen_rewards, rejected_rewards)`` with the implicit rewards ``beta r`` (detached).
    """
    if beta <= 0:
        raise ValueError(f"--beta must be > 0, got {beta}")
    pc, pr, rc, rr = (_f(x) for x in (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps))
    r_c, r_r = pc - rc, pr - rr
    if r_c.numel() == 0 or r_r.numel() == 0:
        raise ValueError("vanilla KTO needs at least one chosen and one rejected sequence in the batch")
    kl_c = r_c.mean().clamp(min=0)
    kl_r = r_r.mean().clamp(min=0)
    losses = torch.cat((1.0 - torch.sigmoid(beta * (r_c - kl_r)), 1.0 - torch.sigmoid(beta * (kl_c - r_r))), 0)
    return _reduce(losses, reduction), (beta * r_c).detach(), (beta * r_r).detach()


def vanilla_kto_labelled_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    *,
    beta: float = 0.1,
    reduction: str = "mean",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`vanilla_kto_loss` on a labelled batch of sequence log-probs ``[batch]`` (``rlhfkit kto
    --vanilla_loss``): with ``r = log pi(y|x) - log pi_ref(y|x)``, ``KL_D = max(0, mean_{desirable} r)``,
    ``KL_U = max(0, mean_{undesirable} r)`` (not detached; a side absent from the batch has reference point 0):
    desirable ``l = 1 - sigmoid(beta (r - KL_U))``, undesirable ``l = 1 - sigmoid(beta (KL_D - r))``.

    Returns ``(loss, rewards, reference points [KL_D, KL_U])`` with the implicit rewards ``beta r`` (detached).
    """
    if beta <= 0:
        raise ValueError(f"--beta must be > 0, got {beta}")
    r = _f(policy_logps) - _f(ref_logps)
    d = as_bool_mask(desirable, r)
    zero = r.new_zeros(())
    kl_d = r[d].mean().clamp(min=0) if bool(d.any()) else zero
    kl_u = r[~d].mean().clamp(min=0) if bool((~d).any()) else zero
    losses = torch.where(d, 1.0 - torch.sigmoid(beta * (r - kl_u)), 1.0 - torch.sigmoid(beta * (kl_d - r)))
    return _reduce(losses, reduction), (beta * r).detach(), torch.stack([kl_d, kl_u]).detach()
