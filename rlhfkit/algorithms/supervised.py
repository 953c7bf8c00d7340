"""Supervised token losses: masked LM (SFT, ``--nll_loss_coef``), the PPO auxiliary pretraining term
(``--ptx_coef``), distillation to a teacher (``--kd_coef``) and the process-reward-model token loss
(``--placeholder_token``, ``--reward_tokens``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .normalize import aggregate_loss, as_bool_mask, compute_dtype

IGNORE_INDEX = -100


def masked_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    shift: bool = True,
    ignore_index: int = IGNORE_INDEX,
    num_tokens: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Token-mean negative log-likelihood ``-sum_t m_t log softmax(z_t)[y_t] / sum_t m_t``.

    ``logits [batch, len, vocab]``, ``labels [batch, len]``. ``shift=True`` (Hugging Face's ``labels``
    convention): ``z_t`` predicts ``labels[t + 1]``. A label counts when it is not ``ignore_index`` and
    ``loss_mask`` (same shape as ``labels``) is non-zero there. ``num_tokens`` replaces the local count.
    """
    z = logits.to(compute_dtype(logits))
    mask = as_bool_mask(loss_mask, labels) & (labels != ignore_index)
    if shift:
        z, labels, mask = z[:, :-1], labels[:, 1:], mask[:, 1:]
    safe = torch.where(mask, labels, torch.zeros_like(labels))
    nll = -torch.log_softmax(z, dim=-1).gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    return aggregate_loss(nll, mask, "token_mean", num_tokens=num_tokens)


def ptx_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    *,
    ptx_coef: float = 0.05,
    shift: bool = True,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The PPO auxiliary SFT term ``ptx_coef * masked_lm_loss(...)`` on pretraining / SFT data (``--ptx_coef``)."""
    return ptx_coef * masked_lm_loss(logits, labels, loss_mask, shift=shift, ignore_index=ignore_index)


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    num_tokens: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward KL to the teacher, token mean over valid response tokens:
    ``KL(p_T || p_S)_t = sum_v p_T(v) (log p_T(v) - log p_S(v))`` with ``p = softmax(logits)`` at position t
    (logits ``[batch, len, vocab]`` aligned with ``mask`` ``[batch, len]``; terms with ``p_T(v) = 0`` are 0).
    Its gradient equals that of the teacher cross-entropy ``-sum_v p_T log p_S``. The KD trainer mixes
    ``(1 - kd_coef) * masked_lm_loss + kd_coef * distillation_loss`` (``--kd_coef``).
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ: "
            "the two models must share the tokenizer and vocabulary size"
        )
    log_ps = torch.log_softmax(student_logits.to(compute_dtype(student_logits)), dim=-1)
    log_pt = torch.log_softmax(teacher_logits.detach().to(log_ps.dtype), dim=-1)
    pt = log_pt.exp()
    terms = torch.where(pt > 0, pt * (log_pt - log_ps), torch.zeros((), dtype=pt.dtype, device=pt.device))
    kl = terms.sum(dim=-1)
    return aggregate_loss(kl, as_bool_mask(mask, kl), "token_mean", num_tokens=num_tokens)


def prm_token_loss(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    placeholder_token_id: int,
    reward_token_ids: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Process-reward token loss: cross-entropy at the step placeholders
    ``P = {(b, t): input_ids[b, t] = placeholder}``,
    ``-mean_{(b,t) in P} sum_k q_k log softmax(z[b, t, K])_k`` with the logits restricted to the classes
    ``K = reward_token_ids`` (the whole vocabulary when None); ``z`` is taken at the placeholder position itself.

    Hard labels (integer ``labels``): the reward token id at each placeholder, ``q`` one-hot on its class.
    Soft labels (float ``labels``, needs two reward tokens): ``p`` = probability that the step is good,
    ``q = (p, 1 - p)`` over ``(reward_token_ids[0], reward_token_ids[1])``.
    Returns ``(loss, accuracy)`` (argmax class = target's argmax class); both 0 when there is no placeholder.
    """
    at = input_ids == placeholder_token_id
    if not bool(at.any()):
        zero = logits.sum() * 0.0
        return zero, zero.detach()
    z = logits[at].to(compute_dtype(logits))
    y = labels[at]
    if reward_token_ids is not None:
        z = z[:, torch.as_tensor(reward_token_ids, device=z.device)]
    if y.is_floating_point():
        if reward_token_ids is None or len(reward_token_ids) != 2:
            raise ValueError("soft PRM labels need exactly two --reward_tokens (good, bad)")
        if bool(((y < 0) | (y > 1)).any()):
            raise ValueError("soft PRM labels must be probabilities in [0, 1]")
        target = torch.stack([y, 1.0 - y], dim=-1).to(z.dtype)
        losses = -(target * torch.log_softmax(z, dim=-1)).sum(dim=-1)
        target_class = (y < 0.5).long()
    else:
        target_class = _token_ids_to_classes(y, reward_token_ids)
        losses = F.cross_entropy(z, target_class, reduction="none")
    accuracy = (z.argmax(dim=-1) == target_class).to(z.dtype).mean()
    return losses.mean(), accuracy.detach()


def _token_ids_to_classes(y: torch.Tensor, reward_token_ids: list[int] | None) -> torch.Tensor:
    if reward_token_ids is None:
        return y.long()
    ids = torch.as_tensor(reward_token_ids, device=y.device, dtype=y.dtype)
    hits = y.unsqueeze(-1) == ids
    if not bool(hits.any(dim=-1).all()):
        bad = sorted(set(y[~hits.any(dim=-1)].tolist()))
        raise ValueError(f"PRM labels {bad} at placeholder positions are not among --reward_tokens {reward_token_ids}")
    return hits.long().argmax(dim=-1)
