"""The PPO algorithm options and the tests that prove each acts, on the tensors `--debug_dump_steps` writes.

Same format as `rlhfkit.config.effects` (which merges this table); keys are `"ppo:flag"` or shared flag names.
Each test runs a real tiny `rlhfkit ppo` step with the option set away from its default and recomputes the logged
result from the formula in float64 (tests/rl/test_algorithm_options_act.py).
"""

from __future__ import annotations

from rlhfkit.config.effects import Effect, NoEffect, Tested  # noqa: F401

_FILE = "tests/rl/test_algorithm_options_act.py"
GAE = f"{_FILE}::test_gae_with_reference_critic_and_reward_model_folders"
GROUP_NORM = f"{_FILE}::test_group_norm_with_clipping_entropy_and_update_size"
REINFORCE = f"{_FILE}::test_reinforce_with_discount_reward_clip_and_asymmetric_clip"
BASELINE = f"{_FILE}::test_reinforce_baseline_without_std_normalisation"
RLOO = f"{_FILE}::test_rloo_with_the_kl_loss"
DR_GRPO = f"{_FILE}::test_dr_grpo_async_with_icepop_dumps_only_the_steps_asked_for"
DUMP_VALUES = f"{_FILE}::test_debug_dump_steps_values"

PPO_EFFECTS: dict[str, Effect] = {
    "ppo:debug_dump_steps": Tested(
        (DR_GRPO, GROUP_NORM, DUMP_VALUES),
        "writes <run_dir>/debug/step_<N>.pt for exactly the steps asked for (2 of 2; 'all'), holding the experience "
        "and every micro-batch's tensors; bad values are refused"),
    "ppo:advantage_estimator": Tested(
        (GAE, REINFORCE, BASELINE, GROUP_NORM, RLOO, DR_GRPO),
        "each estimator's formula (GAE, discounted returns, group mean / group norm / leave-one-out baselines, "
        "batch whitening where it applies) on the logged rewards and values gives the logged advantages and returns"),
    "ppo:gamma": Tested(
        (GAE, REINFORCE),
        "gamma 0.9 in GAE and 0.7 in REINFORCE returns: the recomputed returns match and differ from gamma 1"),
    "ppo:lambd": Tested((GAE,), "lambd 0.8: GAE recomputed from the logged rewards and values matches and differs "
                                "from lambd 1"),
    "ppo:eps_clip": Tested(
        (GROUP_NORM,), "eps_clip 0.05: -min(rho A, clip(rho, 0.95, 1.05) A) on the logged ratios and advantages is the "
                       "logged per-token loss, which differs from the 0.2 clip's"),
    "ppo:eps_clip_low_high": Tested(
        (REINFORCE,), "0.02 0.4: the asymmetric clip(rho, 0.98, 1.4) reproduces the per-token loss, which differs "
                      "from the symmetric 0.2 clip"),
    "ppo:dual_clip": Tested((GROUP_NORM,), "dual_clip 1.2: -max(min(rho A, clip(rho) A), 1.2 A) for A < 0 reproduces "
                                           "the per-token loss and acts on some tokens"),
    "ppo:value_clip": Tested(
        (GAE,), "value_clip 0.02: 0.5 max((V - G)^2, (V_old + clip(V - V_old, +-0.02) - G)^2) is the logged per-token "
                "value loss; the clipped term is the larger on some tokens"),
    "ppo:no_advantage_std_norm": Tested(
        (BASELINE,), "advantages are the returns minus their batch mean, not divided by the std (which is not 1)"),
    "ppo:entropy_loss_coef": Tested(
        (GROUP_NORM,), "0.05: the loss backward got = policy term - 0.05 x token-mean entropy; the entropies are the "
                       "policy's, recomputed with transformers"),
    "ppo:max_norm": Tested((GROUP_NORM,), "0.05: the gradient norm after clipping is 0.05 where the raw norm is "
                                          "larger"),
    "ppo:actor_learning_rate": Tested(
        (GROUP_NORM,), "2e-2: the first update uses lr 2e-2 and moves parameters by at most 2e-2 "
                       "(Adam's first step)"),
    "ppo:critic_learning_rate": Tested(
        (GAE,), "2e-3: the critic's first update uses lr 2e-3 and moves parameters by at most 2e-3 "
                "(Adam's first step)"),
    "ppo:reward_clip_range": Tested(
        (REINFORCE,), "0.05 0.25: returns are built from clamp(r, 0.05, 0.25), which differs from the raw rewards on "
                      "this batch"),
    "ppo:init_kl_coef": Tested(
        (GAE, RLOO), "0.05 as a reward penalty (-0.05 KL on every token in the GAE rewards) and 0.1 as the "
                     "weight of the KL loss in the loss backward got"),
    "ppo:kl_estimator": Tested(
        (GAE, RLOO), "k2 (experience KL from old and reference log-probs) and k3 (the KL loss from new and reference "
                     "log-probs) reproduce the logged per-token KL"),
    "ppo:use_kl_loss": Tested(
        (RLOO,), "the KL moves from the rewards (rloo advantages carry none) to the loss: + init_kl_coef x token-mean "
                 "KL"),
    "ppo:enable_vllm_is_correction": Tested(
        (GROUP_NORM, DR_GRPO), "the per-token policy loss is multiplied by the importance weights from the trainer's "
                               "old and the engine's log-probs"),
    "ppo:vllm_is_correction_type": Tested(
        (GROUP_NORM, DR_GRPO), "tis clamps exp(old - rollout) into the range; icepop zeroes the weights outside it "
                               "(some kept, some dropped on an --async_train step)"),
    "ppo:vllm_is_truncated_threshold": Tested(
        (GROUP_NORM, DR_GRPO), "1.5 5.0 raises every tis weight to >= 1.5; 0.8 1.25 is the icepop window"),
    "ppo:normalize_reward": Tested(
        (GAE,), "rewards are (score - reward_mean) / reward_std of the reward model's config.json, the score computed "
                "with transformers"),
    "ppo:ref_pretrain": Tested(
        (GAE, RLOO), "the reference log-probs are those of the given (differently initialised) model computed with "
                     "transformers, not the policy's"),
    "ppo:critic_pretrain": Tested(
        (GAE,), "the values are the given scalar model's head at each response position, computed with transformers"),
}
