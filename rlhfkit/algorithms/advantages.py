"""Advantages and returns for the PPO family (``--advantage_estimator``).

Rows are laid out prompt-major: the ``n = n_samples_per_prompt`` responses of one prompt are consecutive rows
(a *group*). Group statistics never cross ranks, so a group must live on one rank; batch whitening is global
over ``process_group``. Time recursions run over valid tokens only: masked positions (padding, or environment
tokens inside a multi-turn response) are skipped, get advantage and return 0, and do not consume a discount step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .normalize import as_bool_mask, compute_dtype, masked_whiten
from .rewards import clip_rewards, shape_rewards

ADVANTAGE_ESTIMATORS = ("gae", "reinforce", "reinforce_baseline", "group_norm", "dr_grpo", "rloo", "flash_reinforce",
                        "on_policy_distill")
GROUP_ESTIMATORS = ("reinforce_baseline", "group_norm", "dr_grpo", "rloo")
# whole-response rewards compared against a baseline (a group's or the batch's): undiscounted returns
BASELINE_ESTIMATORS = (*GROUP_ESTIMATORS, "flash_reinforce")
WHITENED_ESTIMATORS = ("gae", "reinforce", "reinforce_baseline")


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def gae_advantages_and_returns(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float = 1.0,
    lambd: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (``--gamma``, ``--lambd``) over the valid tokens ``t_1 < ... < t_K``:
    ``delta_k = R_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}`` (``V_{t_{K+1}} = 0``),
    ``A_{t_k} = delta_k + gamma * lambd * A_{t_{k+1}}``, returns ``G_t = A_t + V_t``; both 0 at masked positions.
    """
    m = as_bool_mask(action_mask, rewards)
    if values.shape != rewards.shape:
        raise ValueError(f"values {tuple(values.shape)} and rewards {tuple(rewards.shape)} must have the same shape")
    dtype = torch.promote_types(compute_dtype(rewards), compute_dtype(values))
    r = torch.where(m, rewards.to(dtype), torch.zeros((), dtype=dtype, device=m.device))
    v = torch.where(m, values.to(dtype), torch.zeros((), dtype=dtype, device=m.device))
    advantages = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    last_gae = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        valid = m[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        gae = delta + gamma * lambd * last_gae
        last_gae = torch.where(valid, gae, last_gae)
        next_value = torch.where(valid, v[:, t], next_value)
        advantages[:, t] = torch.where(valid, gae, _zero(gae))
    returns = torch.where(m, advantages + v, _zero(v))
    return advantages, returns


def discounted_returns(rewards: torch.Tensor, action_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go over the valid tokens ``t_1 < ... < t_K``: ``G_{t_k} = sum_{j >= k} gamma^(j-k) R_{t_j}``;
    0 at masked positions (REINFORCE++ returns)."""
    m = as_bool_mask(action_mask, rewards)
    r = torch.where(m, rewards.to(compute_dtype(rewards)), _zero(rewards.to(compute_dtype(rewards))))
    if gamma == 1.0:
        returns = r.flip(-1).cumsum(-1).flip(-1)
        return torch.where(m, returns, _zero(r))
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        returns[:, t] = torch.where(m[:, t], running, _zero(running))
    return returns


def _groups(rewards: torch.Tensor, n_samples_per_prompt: int, min_n: int = 2) -> torch.Tensor:
    n = n_samples_per_prompt
    if rewards.dim() != 1:
        raise ValueError(f"group baselines take sequence rewards [batch], got shape {tuple(rewards.shape)}")
    if n < min_n:
        raise ValueError(f"this estimator needs --n_samples_per_prompt >= {min_n} (a group per prompt), got {n}")
    if rewards.shape[0] % n != 0:
        raise ValueError(f"batch of {rewards.shape[0]} rows is not a whole number of groups of {n} samples")
    return rewards.double().view(-1, n)


def _constant(g: torch.Tensor) -> torch.Tensor:
    return (g.amax(dim=-1, keepdim=True) == g.amin(dim=-1, keepdim=True)).expand_as(g)


def group_mean_baseline(rewards: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """``r_i - mean_{j in group(i)} r_j`` (REINFORCE++-baseline and Dr. GRPO); exactly 0 for a constant group."""
    g = _groups(rewards, n_samples_per_prompt)
    out = torch.where(_constant(g), torch.zeros_like(g), g - g.mean(dim=-1, keepdim=True))
    return out.view(-1).to(compute_dtype(rewards))


def rloo_advantages(rewards: torch.Tensor, n_samples_per_prompt: int) -> torch.Tensor:
    """Leave-one-out: ``r_i - (sum_{j in group(i), j != i} r_j) / (n - 1)``; exactly 0 for a constant group."""
    g = _groups(rewards, n_samples_per_prompt)
    n = n_samples_per_prompt
    baseline = (g.sum(dim=-1, keepdim=True) - g) / (n - 1)
    out = torch.where(_constant(g), torch.zeros_like(g), g - baseline)
    return out.view(-1).to(compute_dtype(rewards))


def group_normalize(rewards: torch.Tensor, n_samples_per_prompt: int, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: ``(r_i - mean_g) / (std_g + eps)`` with the unbiased (n - 1) std of the group; exactly 0 for a
    constant group (zero std)."""
    g = _groups(rewards, n_samples_per_prompt)
    std = g.std(dim=-1, keepdim=True, correction=1)
    out = torch.where(_constant(g), torch.zeros_like(g), (g - g.mean(dim=-1, keepdim=True)) / (std + eps))
    return out.view(-1).to(compute_dtype(rewards))


def batch_mean_baseline(rewards: torch.Tensor, process_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """FlashREINFORCE (``--advantage_estimator flash_reinforce``, Molt's estimator of that name):
    ``r_i - mean_j r_j`` with the mean over every row of the batch on every rank of ``process_group`` (no prompt
    groups: it is meant for one sample per prompt), not divided by a std. Computed in float64."""
    if rewards.dim() != 1:
        raise ValueError(f"the batch baseline takes sequence rewards [batch], got shape {tuple(rewards.shape)}")
    r = rewards.double()
    total = torch.stack([r.sum(), torch.tensor(float(r.shape[0]), dtype=r.dtype, device=r.device)])
    if process_group is not None:
        dist.all_reduce(total, group=process_group)
    if total[1] == 0:
        return rewards.to(compute_dtype(rewards))
    return (r - total[0] / total[1]).to(compute_dtype(rewards))


def on_policy_distill_advantages(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    action_mask: torch.Tensor,
    rewards: torch.Tensor | None = None,
    *,
    kl_coef: float = 1.0,
    reward_weight: float = 0.0,
    n_samples_per_prompt: int = 1,
) -> torch.Tensor:
    """On-policy distillation (``--advantage_estimator on_policy_distill``): per valid token ``t`` of a response
    the student sampled,

    ``A_t = kl_coef * (log pi_teacher(y_t) - log pi_student_old(y_t)) + reward_weight * A_task``

    i.e. ``-kl_coef`` times the sampled reverse KL ``log pi_student(y_t) - log pi_teacher(y_t)`` (whose expectation
    under the student is ``KL(pi_student || pi_teacher)`` at that position). Discount 0: each token gets only its
    own term (no reward-to-go), no whitening, no critic. ``A_task`` is the sequence reward ``r`` (already clipped)
    broadcast to every valid token; with ``n_samples_per_prompt >= 2`` it is ``r - mean_g r`` (the group-mean
    baseline of Dr. GRPO; 0 for a constant group). ``reward_weight = 0`` (pure distillation) reads no reward.
    Masked positions get 0. Computed in float64 when any input is float64, else float32.
    """
    m = as_bool_mask(action_mask, student_log_probs)
    for name, t in (("student_log_probs", student_log_probs), ("teacher_log_probs", teacher_log_probs)):
        if t.shape != action_mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, the action mask {tuple(action_mask.shape)}")
    dtype = torch.promote_types(compute_dtype(student_log_probs), compute_dtype(teacher_log_probs))
    advantages = kl_coef * (teacher_log_probs.to(dtype) - student_log_probs.to(dtype))
    if reward_weight != 0.0:
        if rewards is None or rewards.shape != action_mask.shape[:1]:
            raise ValueError(f"--opd_reward_weight {reward_weight} needs sequence rewards [batch], got "
                             f"{None if rewards is None else tuple(rewards.shape)}")
        task = group_mean_baseline(rewards, n_samples_per_prompt) if n_samples_per_prompt >= 2 else rewards
        advantages = advantages + reward_weight * task.to(dtype)[:, None]
    return torch.where(m, advantages, torch.zeros((), dtype=dtype, device=advantages.device))


def _check_shapes(rewards: torch.Tensor, action_mask: torch.Tensor, **token_tensors) -> None:
    if action_mask.dim() != 2 or rewards.shape != action_mask.shape[:1]:
        raise ValueError(
            f"want rewards [batch] and action_mask [batch, len], got {tuple(rewards.shape)}, {tuple(action_mask.shape)}"
        )
    for name, t in token_tensors.items():
        if t is not None and t.shape != action_mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, the action mask {tuple(action_mask.shape)}")


def compute_advantages_and_returns(
    estimator: str,
    rewards: torch.Tensor,
    action_mask: torch.Tensor,
    *,
    n_samples_per_prompt: int = 1,
    values: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lambd: float = 1.0,
    reward_clip_range: tuple[float, float] | None = None,
    std_norm: bool = True,
    group_eps: float = 1e-6,
    process_group: dist.ProcessGroup | None = None,
    student_log_probs: torch.Tensor | None = None,
    teacher_log_probs: torch.Tensor | None = None,
    opd_kl_coef: float = 1.0,
    opd_reward_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns ``[batch, response_len]`` (0 at masked positions) for ``--advantage_estimator``.

    1. ``r = clip(rewards, --reward_clip_range)`` (sequence rewards ``[batch]``).
    2. group baseline on ``r``: ``reinforce_baseline``/``dr_grpo``: ``r - mean_g``; ``group_norm``:
       ``(r - mean_g) / (std_g + group_eps)``; ``rloo``: ``r - mean_{g, j != i}``; ``flash_reinforce``: ``r - mean_B``,
       the mean over all rows of the batch on every rank of ``process_group``; ``gae``/``reinforce``: none.
    3. token rewards ``R = shape_rewards(r, mask, kl, kl_coef)`` (r on the last token, ``-kl_coef * kl`` on all).
    4. ``gae``: ``A, G = GAE(R, values, gamma, lambd)``; otherwise ``G = discounted_returns(R, gamma)``, ``A = G``.
    5. ``gae``, ``reinforce``, ``reinforce_baseline``: ``A <- (A - mu) / sqrt(var)`` over all valid tokens of the
       batch on every rank of ``process_group`` (``std_norm=False``, i.e. ``--no_advantage_std_norm``: ``A - mu``).
       ``group_norm``, ``dr_grpo``, ``rloo`` and ``flash_reinforce`` are left as they are. Returns are never whitened.

    ``on_policy_distill`` skips steps 2-5: ``A = G = on_policy_distill_advantages(student_log_probs,
    teacher_log_probs, mask, clip(rewards), opd_kl_coef, opd_reward_weight)`` (``kl``/``values`` unused).
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"--advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    _check_shapes(rewards, action_mask, values=values, kl=kl)
    m = as_bool_mask(action_mask, action_mask)
    r = clip_rewards(rewards, reward_clip_range)
    if estimator == "on_policy_distill":
        if student_log_probs is None or teacher_log_probs is None:
            raise ValueError("--advantage_estimator on_policy_distill needs the student's and the teacher's log-probs")
        advantages = on_policy_distill_advantages(student_log_probs, teacher_log_probs, m, r, kl_coef=opd_kl_coef,
                                                  reward_weight=opd_reward_weight,
                                                  n_samples_per_prompt=n_samples_per_prompt)
        return advantages, advantages.clone()
    if estimator in ("reinforce_baseline", "dr_grpo"):
        r = group_mean_baseline(r, n_samples_per_prompt)
    elif estimator == "group_norm":
        r = group_normalize(r, n_samples_per_prompt, group_eps)
    elif estimator == "rloo":
        r = rloo_advantages(r, n_samples_per_prompt)
    elif estimator == "flash_reinforce":
        r = batch_mean_baseline(r, process_group)
    token_rewards = shape_rewards(r, m, kl, kl_coef)
    if estimator == "gae":
        if values is None:
            raise ValueError("--advantage_estimator gae needs critic values")
        advantages, returns = gae_advantages_and_returns(token_rewards, values, m, gamma, lambd)
    else:
        returns = discounted_returns(token_rewards, m, gamma)
        advantages = returns.clone()
    if estimator in WHITENED_ESTIMATORS:
        advantages = masked_whiten(advantages, m, std_norm=std_norm, process_group=process_group)
    return advantages, returns
