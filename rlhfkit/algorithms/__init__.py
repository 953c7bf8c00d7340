"""Pure RL / preference math over tensors: no models, no I/O, no Ray. See docs/algorithms.md."""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages_and_returns,
    discounted_returns,
    gae_advantages_and_returns,
    group_mean_baseline,
    group_normalize,
    rloo_advantages,
)
from .entropy import entropy_from_logits, policy_entropy
from .kl import KL_ESTIMATORS, compute_kl, kl_loss, log_ratio
from .normalize import (
    LOSS_AGG_MODES,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from .offpolicy import IS_CORRECTION_TYPES, importance_weights, logprob_mismatch
from .policy_loss import POLICY_LOSS_TYPES, clip_bounds, ppo_policy_loss
from .preference import (
    dpo_loss,
    kto_loss,
    kto_reference_kl,
    logexp_loss,
    pairwise_loss,
    reward_model_loss,
    sequence_log_probs,
    vanilla_kto_loss,
)
from .rewards import (
    AdaptiveKLController,
    FixedKLController,
    clip_rewards,
    last_token_index,
    length_penalties,
    overlong_penalty,
    shape_rewards,
    stop_properly_penalty,
)
from .supervised import distillation_loss, masked_lm_loss, prm_token_loss, ptx_loss
from .value_loss import value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "IS_CORRECTION_TYPES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_TYPES",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate_loss",
    "clip_bounds",
    "clip_rewards",
    "compute_advantages_and_returns",
    "compute_kl",
    "discounted_returns",
    "distillation_loss",
    "dpo_loss",
    "entropy_from_logits",
    "gae_advantages_and_returns",
    "group_mean_baseline",
    "group_normalize",
    "importance_weights",
    "kl_loss",
    "kto_loss",
    "kto_reference_kl",
    "last_token_index",
    "length_penalties",
    "log_ratio",
    "logexp_loss",
    "logprob_mismatch",
    "masked_lm_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "pairwise_loss",
    "policy_entropy",
    "ppo_policy_loss",
    "prm_token_loss",
    "ptx_loss",
    "reward_model_loss",
    "rloo_advantages",
    "sequence_log_probs",
    "shape_rewards",
    "stop_properly_penalty",
    "value_loss",
    "vanilla_kto_loss",
]
