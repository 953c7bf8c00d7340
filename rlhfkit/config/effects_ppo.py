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
_RECENT = "tests/rl/test_recent_algorithms_act.py"
GSPO = f"{_RECENT}::test_gspo_sequence_ratio_and_loss"
CISPO = f"{_RECENT}::test_cispo_with_a_sequence_level_truncated_is_correction"
GRID_CHECKED = f"{_RECENT}::test_grid_and_cispo_flags_are_checked"
PENALTIES = f"{_RECENT}::test_length_penalties_seq_mask_tis_adaptive_and_unbiased_kl"
GAMMA_REFUSED = f"{_RECENT}::test_gamma_is_refused_for_group_estimators"
REFUSED = f"{_RECENT}::test_refused_values_of_the_recent_flags"
_UNIT = "tests/algorithms/test_recent_methods.py"
_VISION = "tests/rl/test_vision_batch.py"
_SEED = "tests/config/test_seed_flags.py::"
VISION_E2E = "tests/rl/test_ppo_vision.py::test_grpo_on_images_runs_stays_on_policy_and_keeps_the_frozen_tower"
_OPD = "tests/rl/test_on_policy_distill.py::"
_OPD_UNIT = "tests/algorithms/test_on_policy_distill.py::"
_OPD_CONFIG = "tests/config/test_on_policy_distill.py::"
VISION_DATA = f"{_VISION}::test_image_prompts_load_and_a_bad_row_is_an_error_naming_the_file_row_and_key"

_REPLAY = "tests/rl/test_rollout_replay.py::"
_PARITY_UNIT = "tests/algorithms/test_parity_methods.py::"
_PARITY_CONFIG = "tests/config/test_parity_flags.py::"
REPLAY_RUN = f"{_REPLAY}test_a_replay_trains_exactly_as_the_dumped_run_without_engines"

PPO_EFFECTS: dict[str, Effect] = {
    "ppo:rollout_dump_dir": Tested(
        (REPLAY_RUN, f"{_REPLAY}test_a_dumped_step_reads_back_field_for_field",
         f"{_REPLAY}test_replay_refuses_other_settings_a_missing_step_and_a_crafted_file"),
        "writes DIR/rollout_manifest.json and one safe step_<N>.pt per step holding the rollout (ids, engine "
        "log-probs, rewards, metadata) field for field; a folder of other settings is refused"),
    "ppo:rollout_replay_dir": Tested(
        (REPLAY_RUN, f"{_REPLAY}test_replay_refuses_other_settings_a_missing_step_and_a_crafted_file",
         f"{_REPLAY}test_a_replay_needs_no_reward"),
        "trains with no engine created: every training metric and the saved weights equal the dumping run's bit for "
        "bit (fp32); other settings, a missing step file and a crafted file are refused naming the file"),
    "ppo:eval_only": Tested(
        (f"{_REPLAY}test_eval_only_gives_the_runs_evaluation_and_trains_nothing",),
        "one metrics row of eval/* equal to a training run's evaluation at step 0 (and, with --load_checkpoint, at "
        "the checkpoint's step), no training metrics, no saved model, the checkpoint untouched"),
    "ppo:debug_dump_steps": Tested(
        (DR_GRPO, GROUP_NORM, DUMP_VALUES),
        "writes <run_dir>/debug/step_<N>.pt for exactly the steps asked for (2 of 2; 'all'), holding the experience "
        "and every micro-batch's tensors; bad values are refused"),
    "ppo:advantage_estimator": Tested(
        (GAE, REINFORCE, BASELINE, GROUP_NORM, RLOO, DR_GRPO, f"{_OPD}test_one_step_against_a_float64_reference",
         f"{_PARITY_UNIT}test_flash_reinforce_is_reward_minus_the_batch_mean_without_whitening",
         f"{_PARITY_CONFIG}test_flash_reinforce_parses_in_both_dialects_needs_no_group_and_refuses_gamma",
         f"{_OPD}test_the_student_moves_toward_the_teacher"),
        "each estimator's formula (GAE, discounted returns, group mean / group norm / leave-one-out baselines, "
        "batch whitening where it applies) on the logged rewards and values gives the logged advantages and returns; "
        "on_policy_distill: each token's advantage is log pi_teacher - log pi_student (float64 from logits) and the "
        "student's held-out reverse KL to the teacher falls; flash_reinforce: r - the batch's mean reward, not "
        "whitened (float64 formula), gamma refused"),
    "ppo:teacher_model": Tested(
        (f"{_OPD}test_the_student_moves_toward_the_teacher", f"{_OPD}test_one_step_against_a_float64_reference",
         f"{_OPD_CONFIG}test_the_teacher_is_the_reference_role_"
         "and_no_reference_kl_is_kept", f"{_OPD_CONFIG}test_a_teacher_with_another_tokenizer_is_refused_naming_both"),
        "the reference role loads this model and its log-probs (equal to transformers' in float64) make the "
        "advantages: the student's held-out reverse KL to it falls; a teacher with another tokenizer stops the run "
        "naming both models"),
    "ppo:opd_kl_coef": Tested(
        (f"{_OPD}test_one_step_against_a_float64_reference",
         f"{_OPD_UNIT}test_the_estimator_of_compute_advantages_clips_and_does_not_whiten_or_discount",
         f"{_OPD_CONFIG}test_the_distillation_flags_need_the_estimator"),
        "0.5: each token's advantage in a real run is 0.5 x (log pi_teacher - log pi_student) (+ the reward term), "
        "both log-probs recomputed with transformers in float64; <= 0 is refused, and so is a value without "
        "on_policy_distill"),
    "ppo:opd_reward_weight": Tested(
        (f"{_OPD}test_one_step_against_a_float64_reference",
         f"{_OPD_UNIT}test_the_estimator_of_compute_advantages_clips_and_does_not_whiten_or_discount",
         f"{_OPD}test_it_runs_async_and_colocated", f"{_OPD_CONFIG}test_the_distillation_flags_need_the_estimator"),
        "0.5: every token's advantage in a real run gains 0.5 x (r - group mean r) (float64 reference, a non-zero "
        "reward term); refused without on_policy_distill"),
    "ppo:gamma": Tested(
        (GAE, REINFORCE, GAMMA_REFUSED),
        "gamma 0.9 in GAE and 0.7 in REINFORCE returns: the recomputed returns match and differ from gamma 1; "
        "gamma != 1 with group_norm / rloo / reinforce_baseline / dr_grpo is refused (ConfigError)"),
    "ppo:policy_loss_type": Tested(
        (GSPO, f"{_UNIT}::test_gspo_value_per_token_loss_and_gradient", CISPO,
         "tests/algorithms/test_cispo.py::test_cispo_value_and_gradient_match_the_formula_with_the_clip_active"),
        "gspo: the logged ratio is exp(mean_t(log pi - log pi_old)) on every token of a row, the per-token loss the "
        "sequence-clipped surrogate and the loss its per-sequence mean; gradients match the GSPO formula; cispo: "
        "the per-token loss is -w clip(rho, 1 - eps, 1 + eps) A log pi (not PPO's loss on the same tensors), its "
        "gradient -clip(rho) A with the clip active; --dual_clip refused"),
    "ppo:is_correction_level": Tested(
        (CISPO, GRID_CHECKED, "tests/algorithms/test_is_grid.py::test_every_cell_matches_the_float64_formula"),
        "seq: every token's weight is its row's min(prod_t exp(old - rollout), high) in a real run; each of token, "
        "seq, geo gives the float64 formula's weights with each mode; refused without --is_correction_mode, "
        "without --enable_vllm_is_correction, with gspo or beside another --vllm_is_correction_type"),
    "ppo:algo.advantage.is_correction_level": Tested(
        (GRID_CHECKED,), "an alias (Molt's name): --algo.advantage.is_correction_level geo sets --is_correction_level "
                         "geo"),
    "ppo:algo.advantage.is_correction_mode": Tested(
        (GRID_CHECKED,), "an alias (Molt's name): --algo.advantage.is_correction_mode clip sets --is_correction_mode "
                         "clip"),
    "ppo:is_correction_gating": Tested(
        (f"{_PARITY_UNIT}test_divergence_gates_match_the_float64_formula",
         f"{_PARITY_CONFIG}test_divergence_gate_passes_the_config_to_the_policy_loss",
         f"{_PARITY_CONFIG}test_divergence_gate_refusals_name_the_flags",
         f"{_PARITY_CONFIG}test_divergence_gate_parses_and_reaches_the_weights"),
        "binary_kl / tv: tokens (seq: rows) whose Bernoulli KL / total variation between the rollout's and the "
        "trainer's probability of the sampled token exceeds DELTA get weight 0, the others their IS ratio (float64 "
        "formula; the parsed flag reaches the policy loss's weights); refused without the correction, outside a "
        "token/seq x mask cell, with a threshold other than 0 DELTA, with gspo"),
    "ppo:algo.advantage.is_correction_gating": Tested(
        (f"{_PARITY_CONFIG}test_divergence_gate_parses_and_reaches_the_weights",),
        "an alias (Molt's name): --algo.advantage.is_correction_gating tv sets --is_correction_gating tv"),
    "ppo:is_correction_mode": Tested(
        (CISPO, GRID_CHECKED, "tests/algorithms/test_is_grid.py::test_every_cell_matches_the_float64_formula",
         "tests/algorithms/test_is_grid.py::test_presets_equal_their_cells"),
        "trunc caps the row weights at high and leaves those below it (both seen in a real run); mask and clip give "
        "the formula's weights in every level; the presets tis / icepop / seq-mask-tis equal their cells"),
    "ppo:kl_target": Tested(
        (PENALTIES, REFUSED, f"{_RECENT}::test_the_adaptive_kl_coefficient_is_checkpointed_and_resumed",
         f"{_UNIT}::test_adaptive_kl_controller_follows_ziegler_update"),
        "0.1: train/kl_coef of step 2 is beta_1 (1 + clip(KL_1 / 0.1 - 1, +-0.2) x 32 / kl_horizon) from step 1's "
        "logged KL, not --init_kl_coef; beta is checkpointed and resumed; refused without --init_kl_coef > 0"),
    "ppo:kl_horizon": Tested(
        (PENALTIES, REFUSED),
        "64: the adaptive coefficient moves by clip(.) x 32 / 64 in one step; 0 is refused"),
    "ppo:use_unbiased_kl": Tested(
        (PENALTIES, REFUSED, f"{_UNIT}::test_unbiased_kl_loss_value_and_gradient"),
        "the loss backward got adds beta x token-mean(pi / pi_old x k3), with pi / pi_old != 1 on the second "
        "update; the gradient is rho r grad log pi; refused without --use_kl_loss"),
    "ppo:overlong_buffer_len": Tested(
        (PENALTIES, REFUSED, f"{_UNIT}::test_overlong_penalty_ramps_over_the_buffer"),
        "6 (with --generate_max_len 8): the rewards lose min(max(|y| - 2, 0), 6) / 6 x factor before the "
        "advantages; rollout/overlong_penalty_mean is logged; a buffer longer than --generate_max_len is refused"),
    "ppo:overlong_penalty_factor": Tested(
        (PENALTIES, f"{_UNIT}::test_overlong_penalty_ramps_over_the_buffer",
         "tests/config/test_ppo_options_act.py::test_overlong_penalty_factor_scales_the_penalty_of_the_step_rewards"),
        "0.5: the largest overlong penalty is -0.5 (at --generate_max_len tokens), in the step's rewards"),
    "ppo:stop_properly_penalty_coef": Tested(
        (PENALTIES, REFUSED, f"{_UNIT}::test_stop_properly_penalty_scales_or_replaces_truncated_rewards"),
        "0.5: the rewards of responses with finish reason 'length' are halved (after the overlong penalty); < 0 "
        "replaces them; > 1 is refused"),
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
        (GROUP_NORM, DR_GRPO, PENALTIES),
        "tis clamps exp(old - rollout) into the range; icepop zeroes the weights outside it (some kept, some "
        "dropped on an --async_train step); seq-mask-tis zeroes whole rows whose geometric-mean weight is outside "
        "it and clamps the token weights of the rows it keeps (some rows kept, some dropped, tokens icepop would "
        "drop kept)"),
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
    "ppo:image_key": Tested(
        (VISION_E2E, VISION_DATA, f"{_VISION}::test_image_key_needs_a_vision_language_model"),
        "prompts carry their images (paths, base64) and one placeholder each; the engine samples with them and the "
        "trainer's log-probs with the processor's pixel tensors equal the engine's (< 1e-4); a bad image names the "
        "file, row and key; a text-only --pretrain is refused"),
    "ppo:max_images_per_prompt": Tested(
        (VISION_DATA,), "1 (the default): a row with 2 images is an error naming the file and the row; 2: that row "
                        "loads with both images and a row with 3 is the error"),
    "ppo:freeze_vision_tower": Tested(
        (VISION_E2E, f"{_VISION}::test_image_key_needs_a_vision_language_model",
         "tests/models/test_vision.py::test_frozen_vision_tower_does_not_train_and_is_not_sent"),
        "on: the saved policy's vision tower equals the initial one while the connector and text layers moved, "
        "and the sync leaves it out; --no-freeze_vision_tower syncs it"),
    # OpenRLHF's seed-era flat names, aliases of the flags above (#28)
    "ppo:freeze_visual_encoder": Tested(
        (_SEED + "test_freeze_visual_encoder_is_freeze_vision_tower",),
        "an alias: --no-freeze_visual_encoder sets --freeze_vision_tower False (as --actor.freeze_visual_encoder "
        "false does), whose effect the --freeze_vision_tower entry proves"),
    "ppo:max_new_tokens": Tested(
        (_SEED + "test_max_new_tokens_is_generate_max_len",),
        "an alias: --max_new_tokens 7 sets --generate_max_len 7 (as --rollout.max_new_tokens 7 does): the sampling's "
        "max new tokens and the engines' context"),
    "ppo:max_len": Tested(
        (_SEED + "test_max_len_bounds_prompt_plus_response_per_prompt",
         _SEED + "test_the_0_11_scripts_with_data_max_len_64_keep_their_40_token_prompts"),
        "prompt + response <= max_len: a prompt of p tokens gets min(--generate_max_len, max_len - p) new tokens "
        "(the vLLM request's max_tokens), prompts that leave no room are dropped, the engines' context is at most "
        "max_len; OpenRLHF 0.11's scripts with --data.max_len 64 keep their ~40-token prompts"),
}
