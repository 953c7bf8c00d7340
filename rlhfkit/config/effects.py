"""Every option of every command, with the test that proves it acts or the reason it has no observable effect.

A key is a flag name (`"eps_clip"`), standing for every command that has the flag and reaches it through the same
code (the offline methods share one training loop and one engine), or `"command:flag"` (`"ppo:learning_rate"`) where
a command's path differs; the command-specific key wins. `tests/config/test_option_effects.py` fails when an option
of any command has no entry, when a named test does not exist, or when the test's source never names the flag.
`python -m rlhfkit.cli.docs` renders the table into docs/options.md.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Tested:
    """The option's effect is asserted by these tests: pytest node ids relative to the repository root."""

    tests: tuple[str, ...]
    what: str  # one line: what the tests assert changes when the option is set


@dataclass(frozen=True)
class NoEffect:
    """The option has no effect a test can observe (or is refused); `reason` says why."""

    reason: str


Effect = Tested | NoEffect

OFFLINE = ("sft", "rm", "dpo", "kto", "kd", "prm")  # one scaffold (trainers/common.py), loop and engine

# Test files of the registry (pytest node ids are "<file>::<test>").
_OPT = "tests/trainers/test_options_act.py::"
_SCAFFOLD = _OPT + "test_offline_scaffold_flags_reach_the_model_data_and_engine"
_SHORT_RUN = _OPT + "test_logging_eval_checkpoint_and_tracker_flags_of_a_short_run"
_PPO = "tests/config/test_ppo_options_act.py::"
_PPO_SETUP = _PPO + "test_data_schedule_and_placement_flags_of_build_setup"
_BI = "tests/inference/test_options_act.py::"
_CLI = "tests/config/test_cli_options_act.py::"
_SFT_E2E = "tests/e2e/test_sft.py::"
_LOSSES = "tests/trainers/test_method_losses.py::"
_SAMPLING = "tests/rollout/test_types.py::test_sampling_config_from_flags"
_SOURCES = "tests/rewards/test_sources.py::"
_BIE = "tests/inference/test_batch_inference.py::"
_PPO_FULL = "tests/rl/test_ppo_full.py::"
_PPO_OPTS = "tests/rl/test_ppo_options.py::"
# joins a running 3-node cluster by --ray_address, 2 engines from the flags, a quiet console
_SPREAD = "tests/cluster/test_multinode.py::test_roles_spread_over_three_nodes_match_one_node"
_PPO_RUN = "tests/rl/test_ppo.py::"
_SFT_DATA = "tests/data/test_sft.py::"
_PREF_DATA = "tests/data/test_preference.py::"
_OLD_LP = "tests/rl/test_old_log_probs.py::"
_PUSH = "tests/rl/test_weight_push.py::"
_DEADLINES = "tests/rl/test_deadlines.py::"
_FAULTS = "tests/rl/test_engine_faults.py::"
_PRECISION = "tests/engine/test_precision.py::"
_SERVE = _CLI + "test_serve_rm_flags_reach_the_reward_source_and_the_server"
_SFT_KEYS = _OPT + "test_sft_keys_template_and_max_len_shape_the_samples"
_PPO_REWARDS = _PPO + "test_reward_flags_combine_the_ppo_reward_sources"
_REMOTE = "tests/rewards/test_remote.py::"  # ppo's and batch-inference's reward clients over real HTTP
_BI_SCORING = _BI + "test_scoring_flags_reach_the_reward_source"
_REFUSED_PPO = _OPT + "test_shared_flags_ppo_does_not_act_on_are_refused"
_PPO_MICRO = _PPO + "test_training_micro_batches_follow_the_flags"
_PPO_SAVE = _PPO + "test_checkpoint_and_save_flags_direct_the_workers"
_RUNS = "tests/observability/test_runs_compare.py::"
_BEST = "tests/trainers/test_best_checkpoint.py::"
_EMA = "tests/engine/test_ema.py::"
_RING = "tests/models/test_context_parallel.py::"
_RING_E2E = "tests/e2e/test_ring_attention.py::"
_TP = "tests/models/test_tensor_parallel.py::"
_RING_PPO = "tests/rl/test_ring_ppo.py::"

_CUDA_ONLY = ("FSDP2's CPUOffloadPolicy is applied on CUDA only; on a CPU machine parameters, gradients and optimizer "
              "state already live in host memory, so the flag is accepted and changes nothing there")


def _t(what: str, *tests: str) -> Tested:
    return Tested(tests=tests, what=what)


# The shared and command-specific entries; the PPO algorithm options (proven on the tensors that
# `--debug_dump_steps` writes) live in effects_ppo.py and are merged below; ppo's engine-creation and placement
# flags follow this table.
EFFECTS: dict[str, Effect] = {
    # ---- model (offline commands: load_policy / load_reward_model; ppo: the same loaders in the workers)
    "pretrain": _t("the model that is loaded, trained and saved",
                   _SCAFFOLD, _SFT_E2E + "test_sft_one_rank_learns_and_saves_a_loadable_hf_model"),
    "ppo:pretrain": _t("the policy (its tokenizer formats the prompts)", _PPO_SETUP,
                       _SPREAD),
    "batch-inference:pretrain": _t("the policy sampled from (its tokenizer formats the prompts); with --eval_task "
                                   "rm and no reward flag, the reward model",
                                   _BI + "test_sampling_and_tokenizer_flags_reach_generation",
                                   _BI + "test_scoring_flags_reach_the_reward_source"),
    "demo:pretrain": _t("the model the demo's GRPO run trains", _CLI + "test_demo_flags_reach_the_ppo_command"),
    "lora-merge:pretrain": _t("the base the adapter is merged into",
                              _CLI + "test_lora_merge_writes_the_merged_model_in_param_dtype"),
    "attn_implementation": _t("the attention kernel of the loaded model (config._attn_implementation)", _SCAFFOLD),
    "ppo:attn_implementation": _t("the workers load their models with `load_causal_lm(..., attn_implementation)`, "
                                  "which sets the kernel",
                                  "tests/models/test_loading.py::test_load_causal_lm_dtype_and_attention"),
    "serve-rm:attn_implementation": _t("passed to the reward model loader",
                                       _CLI + "test_serve_rm_flags_reach_the_reward_source_and_the_server"),
    "param_dtype": _t("bf16 compute (FSDP2 mixed precision) instead of fp32: losses agree within bf16 tolerance; an "
                      "explicit dtype is kept over auto",
                      "tests/engine/test_bf16_cpu.py::test_sft_in_bf16_matches_fp32_within_bf16_tolerance",
                      _PRECISION + "test_an_explicit_dtype_is_kept"),
    "ppo:param_dtype": _t("bf16 trainer (and, with vllm_dtype auto, engine)",
                          "tests/engine/test_bf16_cpu.py::test_grpo_with_a_bf16_trainer_and_a_bf16_engine"),
    "batch-inference:param_dtype": _t("the engines' dtype (bfloat16 / float32)",
                                      _BI + "test_engine_flags_reach_the_engines"),
    "serve-rm:param_dtype": _t("the reward model's dtype",
                               _CLI + "test_serve_rm_flags_reach_the_reward_source_and_the_server"),
    "lora-merge:param_dtype": _t("the dtype of the merged weights written",
                                 _CLI + "test_lora_merge_writes_the_merged_model_in_param_dtype"),
    "gradient_checkpointing": _t("activation checkpointing on the model (TrainEngine: offline commands and the ppo "
                                 "actor/critic), use_cache off",
                                 _OPT + "test_gradient_checkpointing_flags_reach_the_model"),
    "gradient_checkpointing_use_reentrant": _t("the checkpoint function's use_reentrant",
                                               _OPT + "test_gradient_checkpointing_flags_reach_the_model"),
    "disable_fast_tokenizer": NoEffect(
        "passed on as AutoTokenizer.from_pretrained(use_fast=False) (offline commands, ppo, batch-inference, "
        "serve-rm), but transformers 5 loads the tokenizers-backed (fast) tokenizer whatever use_fast says when "
        "the model has a tokenizer.json (every model rlhfkit loads); accepted for OpenRLHF compatibility, the "
        "tokenizer is the same"),
    "lora_rank": _t("LoRA adapters of this rank (0: full fine-tuning); the ppo actor uses the same apply_lora call",
                    _SCAFFOLD, "tests/rl/test_lora_rl.py::test_lora_actor_syncs_merged_weights_to_the_engine"),
    "lora_alpha": _t("the adapters' alpha", _SCAFFOLD,
                     "tests/rl/test_lora_rl.py::test_lora_actor_syncs_merged_weights_to_the_engine"),
    "lora_dropout": _t("the adapters' dropout (same apply_lora call in the ppo actor)", _SCAFFOLD),
    "target_modules": _t("which modules get adapters (only those train)", _SCAFFOLD,
                         "tests/models/test_lora.py::test_apply_lora_trains_only_adapters"),
    "load_in_4bit": _t("QLoRA: the base loads in bitsandbytes NF4 (Linear4bit), only the adapters train, the saved "
                       "adapter reloads with peft and reproduces the trained logits; without --lora_rank a "
                       "ConfigError; the ppo actor syncs dequantized merged weights",
                       "tests/trainers/test_qlora.py::"
                       "test_sft_load_in_4bit_trains_lora_on_an_nf4_base_and_the_adapter_reloads",
                       "tests/rl/test_lora_rl.py::test_qlora_actor_syncs_dequantized_merged_weights"),
    "aux_loss_coef": _t("MoE: the loss gains coef x the router load-balancing loss (checked against a float64 "
                        "recomputation), logged as train/aux_loss; a dense model refuses it",
                        "tests/trainers/test_moe_aux_loss.py::"
                        "test_sft_on_moe_adds_aux_loss_coef_times_the_load_balancing_loss",
                        "tests/trainers/test_moe_aux_loss.py::test_dpo_trains_the_moe_model_with_aux_loss"),
    # ---- data (offline)
    "dataset": _t("the rows trained on", _SCAFFOLD),
    "dataset_probs": _t("the mixing proportions of several --dataset entries",
                        _OPT + "test_dataset_probs_mix_the_training_sets"),
    "dataset_split": _t("the split read from a dataset folder", _SCAFFOLD),
    "max_samples": _t("at most this many rows", _SCAFFOLD),
    "eval_dataset": _t("held-out rows evaluated (eval/* metrics)", _SCAFFOLD, _SHORT_RUN),
    "eval_split": _t("the split of --eval_dataset", _SCAFFOLD),
    "input_key": _t("the row key of the prompt", _SCAFFOLD, _SFT_KEYS,
                    _SFT_DATA + "test_chat_conversation_without_output_key_trains_last_turn",
                    _PPO_SETUP),
    "output_key": _t("the row key of the response (the loss is on its tokens)", _SCAFFOLD, _SFT_KEYS,
                     _SFT_DATA + "test_missing_key_names_file_line_key_and_present_keys"),
    "input_template": _t("the prompt is formatted with the template", _SFT_KEYS,
                         _PREF_DATA + "test_plain_template", _OPT + "test_preference_keys_and_the_rm_margin",
                         _LOSSES + "test_kto_loss_equals_reference_function",
                         _LOSSES + "test_kd_loss_equals_reference_function",
                         _LOSSES + "test_prm_loss_equals_reference_function"),
    "apply_chat_template": _t("the prompt is formatted with the tokenizer's chat template",
                              _PREF_DATA + "test_prompt_key_with_chat_template",
                              _SFT_DATA + "test_chat_template_single_turn"),
    "tokenizer_chat_template": _t("replaces the tokenizer's chat template", _SCAFFOLD),
    "max_len": _t("over-long samples are truncated or dropped, and counted", _SFT_KEYS,
                  _SFT_DATA + "test_over_long_rule_truncates_or_drops_and_counts",
                  _PREF_DATA + "test_over_long_pairs"),
    "packing_samples": _t("a micro-batch is collated as one packed row (per-sample lengths and positions); loss "
                          "and gradient equal the padded batch's", _SCAFFOLD,
                          _LOSSES + "test_packed_dpo_batch_gives_the_padded_loss_and_gradient",
                          "tests/e2e/test_dpo.py::test_packed_dpo_run_reproduces_the_padded_run"),
    # ---- engine (TrainEngine: offline commands, and the ppo actor and critic)
    "train_batch_size": _t("samples per optimizer step: accumulation and step counts", _SCAFFOLD),
    "micro_train_batch_size": _t("samples per forward/backward: accumulation", _SCAFFOLD),
    "max_epochs": _t("passes over the data: total steps", _SCAFFOLD),
    "learning_rate": _t("the peak learning rate of the schedule", _OPT + "test_lr_flags_shape_the_schedule"),
    "lr_warmup_ratio": _t("linear warmup over this fraction of the steps (closed form)",
                          _OPT + "test_lr_flags_shape_the_schedule"),
    "lr_scheduler": _t("the LR curve after warmup (cosine_with_min_lr / cosine / linear / constant, closed forms)",
                       _OPT + "test_lr_flags_shape_the_schedule"),
    "min_lr_ratio": _t("the final LR of cosine_with_min_lr", _OPT + "test_lr_flags_shape_the_schedule"),
    "adam_betas": _t("AdamW betas in every param group; a step equals torch's AdamW with them",
                     _OPT + "test_adam_betas_and_l2_reach_the_optimizer"),
    "l2": _t("weight decay of the matrices (not of 1-D params); a step equals torch's AdamW",
             _OPT + "test_adam_betas_and_l2_reach_the_optimizer"),
    "zero_stage": _t("3 reshards parameters after forward, 2 keeps them gathered (FSDP2, when sharding applies)",
                     _OPT + "test_zero_stage_decides_whether_parameters_stay_gathered_after_forward"),
    "adam_offload": NoEffect(_CUDA_ONLY),
    "seed": _t("the data mix and the epoch order", _OPT + "test_seed_decides_the_mix_and_the_epoch_order"),
    "ppo:seed": _t("the sampling seed of the engines", _SAMPLING, _PPO + "test_engine_options_from_the_rollout_flags"),
    "batch-inference:seed": _t("the sampling seed", _BI + "test_sampling_and_tokenizer_flags_reach_generation",
                               _BI + "test_engine_flags_reach_the_engines"),
    "full_determinism": _t("torch.use_deterministic_algorithms(True) during training", _SCAFFOLD),
    "ppo:full_determinism": _t("refused with the reason (not implemented for the Ray workers)", _REFUSED_PPO),
    "eval_steps": _t("evaluate every N steps instead of at each epoch's end", _SHORT_RUN),
    # ---- context parallel (rlhfkit.models.context_parallel; docs/parallelism.md)
    "ring_attn_size": _t("each sequence split over N ranks (world = data parallel x N): loss and gradients of 2 gloo "
                         "ranks equal the unsharded forward's (padded, packed, GQA, RM head); sft/dpo/rm/kto runs on 2 "
                         "ranks reproduce the 1-rank losses and grad norms; a size not dividing the world is refused",
                         _RING + "test_ring_size_must_divide_the_world_size",
                         _RING_E2E + "test_sft_ring_attn_size_2_reproduces_one_rank",
                         _RING_E2E + "test_dpo_rm_kto_ring_attn_size_2_reproduce_one_rank"),
    "ring_head_stride": _t("KV heads gathered per step: stride 1 and 2 give the unsharded result; a stride not "
                           "dividing the KV heads, or one without --ring_attn_size > 1, is refused",
                           _RING + "test_ring_attention_over_two_ranks_equals_the_unsharded_forward",
                           _RING + "test_ring_size_must_divide_the_world_size",
                           _RING_E2E + "test_sft_ring_attn_size_2_reproduces_one_rank"),
    "ppo:ring_attn_size": _t("the actor, reference and critic ranks split each sequence over N ranks (world = data "
                             "parallel x N; reward models unsplit): 2 gloo ranks give the 1-rank log-probs, entropy, "
                             "values and loss gradients, padded and packed; a 1-step ppo run on 2 actor ranks with "
                             "--ring_attn_size 2 reproduces the 1-rank step; a size not dividing a role's ranks is "
                             "refused", _RING_PPO + "test_ring_workers_equal_the_unsharded_workers",
                             _RING_PPO + "test_ppo_ring_flags_are_checked_against_the_roles",
                             _RING_PPO + "test_a_ppo_step_with_ring_attn_size_2_equals_one_rank"),
    "ppo:ring_head_stride": _t("KV heads gathered per step in the actor, reference and critic (stride 2 gives the "
                               "unsharded result); without --ring_attn_size > 1 refused",
                               _RING_PPO + "test_ring_workers_equal_the_unsharded_workers",
                               _RING_PPO + "test_ppo_ring_flags_are_checked_against_the_roles"),
    **{f"kd:{flag}": _t("student and teacher split each sequence over the ring group; the KD loss (NLL + KL to the "
                        "teacher) and its gradients on 2 gloo ranks equal the unsharded ones, padded and packed",
                        _RING + "test_ring_attention_over_two_ranks_equals_the_unsharded_forward")
       for flag in ("ring_attn_size", "ring_head_stride")},
    **{f"prm:{flag}": _t("refused with the reason (context parallel covers sft, rm, dpo, kto, kd and ppo)",
                         _RING + "test_commands_without_context_parallel_refuse_the_ring_flags")
       for flag in ("ring_attn_size", "ring_head_stride")},
    # ---- tensor parallel (rlhfkit.models.tensor_parallel; docs/parallelism.md)
    "ds_tensor_parallel_size": _t("attention/MLP weights and the vocabulary split over N ranks on a (dp, tp) mesh: "
                                  "loss, gradients, clipped norm and weights after one AdamW step of 4 gloo ranks "
                                  "(dp 2 x tp 2) equal the unsharded step (Llama, Qwen2 GQA, RM); sft on 2 ranks "
                                  "reproduces the 1-rank losses and saved weights; heads/world not divisible, other "
                                  "families, ring attention and LoRA are refused",
                                  _TP + "test_tp_2_by_dp_2_equals_the_unsharded_step",
                                  _TP + "test_tp_size_must_divide_heads_world_and_fit_the_family",
                                  _TP + "test_tp_flag_names_on_the_training_commands",
                                  _TP + "test_tp_with_ring_attention_or_lora_is_refused",
                                  "tests/e2e/test_tensor_parallel.py::test_sft_tp_size_2_reproduces_one_rank"),
    **{f"{command}:ds_tensor_parallel_size": _t("refused with the reason (tensor parallel covers sft, rm, dpo, kto)",
                                                _TP + "test_commands_without_tensor_parallel_refuse_the_flags")
       for command in ("ppo", "kd", "prm")},
    "ppo:eval_steps": _t("evaluate every N steps", _OLD_LP + "test_reused_old_log_probs_give_the_same_run"),
    # ---- checkpoints
    "save_path": _t("where the final HF folder is written", _SHORT_RUN),
    "save_steps": _t("full-state checkpoints every N steps",
                     _SFT_E2E + "test_resume_from_a_checkpoint_reproduces_the_uninterrupted_losses", _SHORT_RUN),
    "ckpt_path": _t("the folder of the checkpoints (and what --load_checkpoint reads)",
                    _SFT_E2E + "test_resume_from_a_checkpoint_reproduces_the_uninterrupted_losses", _SHORT_RUN),
    "max_ckpt_num": _t("older checkpoints are deleted", _SFT_E2E + "test_max_ckpt_num_keeps_the_newest", _SHORT_RUN),
    "load_checkpoint": _t("resumes: the losses after the checkpoint equal the uninterrupted run's",
                          _SFT_E2E + "test_resume_from_a_checkpoint_reproduces_the_uninterrupted_losses"),
    "save_hf_ckpt": _t("an HF folder inside each checkpoint", _SHORT_RUN),
    "ppo:save_steps": _t("checkpoints every N steps; resuming reproduces the run",
                         _PPO_RUN + "test_resume_reproduces_the_uninterrupted_run"),
    "ppo:max_ckpt_num": _t("handed to the workers' checkpoint writers", _PPO_SAVE),
    "ppo:load_checkpoint": _t("restores actor and critic", _PPO_RUN + "test_resume_reproduces_the_uninterrupted_run",
                              _PPO_FULL + "test_resume_restores_actor_and_critic"),
    "ppo:ckpt_path": _t("where actor and critic checkpoints are written; a missing critic checkpoint there is an "
                        "error on resume", _PPO_SAVE,
                        _PPO_FULL + "test_resume_without_the_critic_checkpoint_is_an_error"),
    "best_metric_key": _t("<ckpt_path>/best holds the weights of the evaluation with the lowest eval/loss (those of "
                          "that step's checkpoint) and best_metric.json its step and value; an unknown key stops the "
                          "run at the first evaluation, listing the eval metrics",
                          _BEST + "test_sft_keeps_the_model_of_the_lowest_eval_loss",
                          _BEST + "test_sft_with_an_unknown_best_metric_key_stops_at_the_first_evaluation"),
    "ppo:best_metric_key": _t("<ckpt_path>/best holds the saved model (the EMA) of the step with the highest "
                              "eval/reward_mean; the best so far is in the resume checkpoint; an unknown key or no "
                              "--eval_dataset is refused before the run", _PPO_RUN + "test_resume_reproduces_the_"
                              "uninterrupted_run", _BEST + "test_tracker_direction_values_and_resume_state"),
    "ppo:enable_ema": _t("the saved model is the actor's EMA, not the actor: equal to a float64 hand computation from "
                         "the per-step checkpoints' actor weights, the same after a resume, the same on 1 and 2 "
                         "(sharded) actor ranks", _PPO_RUN + "test_resume_reproduces_the_uninterrupted_run",
                         _PPO_RUN + "test_two_trainer_ranks_match_one",
                         _EMA + "test_ema_after_real_steps_matches_a_float64_hand_computation"),
    "ppo:ema_beta": _t("the EMA's decay (0.5 and 0.25 in the runs); outside (0, 1), or without --enable_ema, refused",
                       _PPO_RUN + "test_resume_reproduces_the_uninterrupted_run",
                       _EMA + "test_ema_beta_outside_the_interval_or_without_enable_ema_is_refused"),
    # ---- logging (MetricsLogger: offline loop and the ppo loop)
    "run_dir": _t("the run folder (manifest, metrics.jsonl)", _SCAFFOLD, _SHORT_RUN),
    "ppo:run_dir": _t("the run folder (manifest)", _PPO_SETUP),
    "demo:run_dir": _t("the run folder of the demo's ppo run", _CLI + "test_demo_flags_reach_the_ppo_command"),
    "logging_steps": _t("only every N-th step is logged", _SHORT_RUN),
    "ppo:logging_steps": _t("refused with the reason (ppo logs every step)", _REFUSED_PPO),
    "use_tensorboard": _t("TensorBoard event files in this folder", _SHORT_RUN),
    "use_wandb": _t("metrics go to W&B (offline mode here)", _SHORT_RUN),
    "wandb_org": _t("wandb.init(entity=...)", _SHORT_RUN),
    "wandb_group": _t("wandb.init(group=...)", _SHORT_RUN),
    "wandb_project": _t("wandb.init(project=...)", _SHORT_RUN),
    "wandb_run_name": _t("wandb.init(name=...)", _SHORT_RUN),
    # ---- sft / kd
    "multiturn": _t("loss on every assistant turn",
                    _SFT_DATA + "test_multiturn_trains_every_assistant_turn_but_not_headers"),
    "pretrain_mode": _t("loss on every token", _SFT_DATA + "test_pretrain_mode_trains_every_token"),
    "csft_keys": _t("the row's attribute values put before the prompt; the condition steers generation",
                    "tests/e2e/test_csft.py::test_the_condition_steers_the_output"),
    "teacher_model": _t("the teacher of the KL term", "tests/e2e/test_kd.py::test_student_kl_to_teacher_falls"),
    "kd_coef": _t("loss = (1 - kd_coef) NLL + kd_coef KL", "tests/e2e/test_kd.py::test_student_kl_to_teacher_falls",
                  _LOSSES + "test_kd_loss_equals_reference_function"),
    "teacher_offload": NoEffect(_CUDA_ONLY),
    # ---- rm / dpo / kto / prm
    "prompt_key": _t("the row key of the prompt (unset: whole texts)", _SCAFFOLD,
                     _PREF_DATA + "test_full_conversations_without_prompt_key",
                     _OPT + "test_preference_keys_and_the_rm_margin"),
    "chosen_key": _t("the row key of the chosen response", _OPT + "test_preference_keys_and_the_rm_margin"),
    "rejected_key": _t("the row key of the rejected response", _OPT + "test_preference_keys_and_the_rm_margin"),
    "loss": _t("sigmoid or logexp pairwise loss (reference function)",
               _LOSSES + "test_reward_model_loss_equals_reference_function"),
    "margin_loss": _t("each pair carries its margin into the batch the loss reads",
                      _OPT + "test_preference_keys_and_the_rm_margin"),
    "margin_key": _t("the row key the margin is read from", _OPT + "test_preference_keys_and_the_rm_margin"),
    "compute_fp32_loss": _t("the reward-model loss is float32 always: the switch is the default, "
                            "--no-compute_fp32_loss is refused",
                            _OPT + "test_pair_commands_refuse_row_keys_and_a_loss_outside_float32"),
    **{f"{_command}:{_flag}": _t("refused with the reason (pairs: --prompt_key, --chosen_key, --rejected_key)",
                                 _OPT + "test_pair_commands_refuse_row_keys_and_a_loss_outside_float32")
       for _command in ("rm", "dpo") for _flag in ("input_key", "output_key")},
    "value_head_prefix": NoEffect("the only accepted value is 'score' (the head rlhfkit's reward models and critic "
                                  "have); any other value is refused by the parser"),
    "serve-rm:value_head_prefix": _t("anything but 'score' is refused",
                                     _CLI + "test_serve_rm_flags_reach_the_reward_source_and_the_server"),
    "beta": _t("the DPO / KTO temperature (reference functions)", _LOSSES + "test_dpo_loss_equals_reference_function",
               _LOSSES + "test_kto_loss_equals_reference_function"),
    "label_smoothing": _t("cDPO loss", _LOSSES + "test_dpo_loss_equals_reference_function"),
    "ipo": _t("IPO loss on length-averaged log-probs", _LOSSES + "test_dpo_loss_equals_reference_function"),
    "nll_loss_coef": _t("adds the chosen responses' NLL", _LOSSES + "test_dpo_loss_equals_reference_function"),
    "dpo:ref_pretrain": _t("the reference model's log-probs are the ones used",
                           _LOSSES + "test_precomputed_reference_equals_live_reference"),
    "kto:ref_pretrain": _t("the reference model's log-probs are the ones used (same loader as dpo)",
                           _LOSSES + "test_precomputed_reference_equals_live_reference"),
    "ref_mode": _t("precompute attaches reference log-probs to the samples, live runs the reference per batch; "
                   "without either the loss refuses",
                   _LOSSES + "test_precomputed_reference_equals_live_reference",
                   _LOSSES + "test_dpo_without_reference_log_probs_is_an_error"),
    "ref_offload": NoEffect(_CUDA_ONLY),
    "desirable_loss_weight": _t("weight of desirable samples (reference function)",
                                _LOSSES + "test_kto_loss_equals_reference_function"),
    "undesirable_loss_weight": _t("weight of undesirable samples (reference function)",
                                  _LOSSES + "test_kto_loss_equals_reference_function"),
    "label_key": _t("the row key of the labels", _SCAFFOLD, _LOSSES + "test_kto_loss_equals_reference_function",
                    _LOSSES + "test_prm_loss_equals_reference_function"),
    "ppo:label_key": _t("the label handed to the reward function", _PPO_SETUP),
    "batch-inference:label_key": _t("labels passed to the reward and copied to the rows",
                                    _BI + "test_prompt_flags_shape_the_prompts",
                                    _BI + "test_scoring_flags_reach_the_reward_source"),
    "placeholder_token": _t("the step marker the reward token is predicted at",
                            _LOSSES + "test_prm_loss_equals_reference_function",
                            "tests/e2e/test_prm.py::test_prm_classifies_steps_above_chance"),
    "reward_tokens": _t("softmax over these tokens only", _LOSSES + "test_prm_loss_equals_reference_function",
                        "tests/e2e/test_prm.py::test_prm_classifies_steps_above_chance"),
    # ---- ppo: data, schedule, placement, rollout, rewards
    "ppo:learning_rate": _t("refused with the reason (use --actor_learning_rate / --critic_learning_rate)",
                            _REFUSED_PPO),
    "ppo:train_batch_size": _t("samples per optimizer step: the number of updates", _PPO_SETUP),
    "ppo:max_epochs": _t("PPO epochs over each rollout: the number of updates", _PPO_SETUP),
    "ppo:micro_train_batch_size": _t("rows per training micro-batch", _PPO_MICRO),
    "ppo:max_samples": _t("at most this many prompts", _PPO_SETUP),
    "ppo:input_key": _t("the row key of the prompt", _PPO_SETUP),
    "ppo:input_template": _t("the prompt template", _PPO_SETUP),
    "ppo:apply_chat_template": _t("prompts formatted with the chat template (load_prompts passes the flag to "
                                  "build_prompt_samples)", "tests/data/test_prompts.py::test_chat_prompt_with_label"),
    "ppo:tokenizer_chat_template": _t("replaces the tokenizer's chat template", _PPO_SETUP),
    "ppo:eval_dataset": _t("held-out prompts", _PPO_SETUP),
    "ppo:eval_split": _t("the split of --eval_dataset", _PPO_SETUP),
    "prompt_data": _t("the prompts", _PPO_SETUP),
    "prompt_data_probs": _t("the mix of several --prompt_data", _PPO_SETUP),
    "prompt_split": _t("the split of --prompt_data", _PPO_SETUP),
    "pretrain_data": _t("the auxiliary LM loss data", _PPO_SETUP,
                        _PPO_FULL + "test_colocate_actor_ref_with_the_ptx_loss"),
    "pretrain_data_probs": _t("the mix of several --pretrain_data", _PPO_SETUP),
    "pretrain_split": _t("the split of --pretrain_data", _PPO_SETUP),
    "pretrain_input_key": _t("the text key of --pretrain_data", _PPO_SETUP),
    "pretrain_output_key": _t("loss on the response only", _PPO_SETUP),
    "ptx_coef": _t("weight of the auxiliary loss (0: the data is not even loaded)", _PPO_SETUP,
                   _PPO_FULL + "test_colocate_actor_ref_with_the_ptx_loss"),
    "num_episodes": _t("passes over the prompts: steps and updates", _PPO_SETUP),
    "rollout_batch_size": _t("prompts per step: steps and updates", _PPO_SETUP),
    "n_samples_per_prompt": _t("samples per prompt (sampling n) and the buffer size", _SAMPLING, _PPO_SETUP),
    "actor_num_nodes": _t("nodes of the actor's placement group", _PPO_SETUP),
    "actor_num_gpus_per_node": _t("ranks per node of the actor's placement group", _PPO_SETUP),
    "ref_num_nodes": _t("nodes of the reference's placement group", _PPO_SETUP),
    "ref_num_gpus_per_node": _t("ranks per node of the reference's placement group", _PPO_SETUP),
    "critic_num_nodes": _t("nodes of the critic's placement group", _PPO_SETUP),
    "critic_num_gpus_per_node": _t("ranks per node of the critic's placement group", _PPO_SETUP),
    "reward_num_nodes": _t("nodes of the reward model's placement group", _PPO + "test_reward_group_placement_flags"),
    "reward_num_gpus_per_node": _t("ranks per node of the reward model's placement group",
                                   _PPO + "test_reward_group_placement_flags"),
    "verbose": _t("without it the Ray actors' output (vLLM, workers) goes to the run folder's logs/ and the console "
                  "keeps rlhfkit's lines; with it, live on the console",
                  "tests/observability/test_quiet_console.py::"
                  "test_verbose_keeps_the_actors_output_live_and_otherwise_it_goes_to_the_run_folder",
                  _SPREAD),
    "ray_address": _t("joins that Ray cluster", _SPREAD,
                      _BI + "test_engine_flags_reach_the_engines"),
    "torch_threads_per_worker": _t("torch threads of each worker",
                                   "tests/rl/test_cpu_threads.py::"
                                   "test_ray_alone_gives_one_thread_and_the_workers_take_the_cores"),
    "rollout_backend": _t("transformers (hf) engines are created instead of vLLM ones",
                          _PPO + "test_rollout_backend_and_vllm_dtype_pick_the_engines",
                          "tests/rl/test_sync_check.py::test_an_engine_computing_with_other_weights_stops_the_run_at_start"),
    "demo:rollout_backend": _t("passed to the demo's ppo run", _CLI + "test_demo_flags_reach_the_ppo_command"),
    "vllm_tensor_parallel_size": _t("the engines' tensor_parallel_size (vLLM engine arguments; GPUs only)",
                                    _PPO + "test_engine_options_from_the_rollout_flags"),
    "vllm_gpu_memory_utilization": _t("vLLM's gpu_memory_utilization (GPUs; on CPU --vllm_kv_cache_mb sizes the "
                                      "cache)", _PPO + "test_engine_options_from_the_rollout_flags",
                                      _BI + "test_engine_flags_reach_the_engines"),
    "vllm_kv_cache_mb": _t("the CPU engines' KV cache bytes", _PPO + "test_engine_options_from_the_rollout_flags",
                           _BI + "test_engine_flags_reach_the_engines"),
    "enforce_eager": _t("vLLM's enforce_eager (no CUDA graphs; CPU engines never capture them)",
                        _PPO + "test_engine_options_from_the_rollout_flags",
                        _BI + "test_engine_flags_reach_the_engines"),
    "enable_prefix_caching": _t("vLLM's enable_prefix_caching", _PPO + "test_engine_options_from_the_rollout_flags",
                                _BI + "test_engine_flags_reach_the_engines"),
    "vllm_dtype": _t("the engines' dtype, resolved beside the trainer's",
                     _PPO + "test_rollout_backend_and_vllm_dtype_pick_the_engines",
                     _PRECISION + "test_apply_resolves_both_flags_and_warns_once_with_the_measured_slowdown"),
    "remote_call_timeout": _t("the deadline of every remote call: a hung engine, trainer rank or broadcast-group "
                              "join raises an error naming role, rank, node and method within it",
                              _DEADLINES + "test_hung_then_dead_engine_is_named_within_the_deadline",
                              _DEADLINES + "test_hung_then_dead_trainer_rank_is_named",
                              _FAULTS + "test_killed_then_hung_engine_is_restarted_synced_and_the_run_finishes"),
    "max_engine_restarts": _t("a killed and a hung engine are restarted, synced and counted (fault/engine_restarts "
                              "1, then 2; one events.jsonl line each) and the run finishes",
                              _FAULTS + "test_killed_then_hung_engine_is_restarted_synced_and_the_run_finishes"),
    "vllm_sync_backend": _t("the weight transport (gloo broadcast equals the ray path; nccl without GPUs falls "
                            "back to gloo with one warning)",
                            _PUSH + "test_gloo_broadcast_run_matches_the_ray_run",
                            _PUSH + "test_nccl_without_gpus_falls_back_to_gloo_with_one_warning"),
    "lora_sync": _t("with --lora_rank: adapter sends only the LoRA A/B tensors (sync/bytes = the adapter's bytes) and "
                    "the LoRA engine's log-probs equal the trainer's; merged (default) as test_lora_rl; auto picks "
                    "adapter only where the engines serve LoRA of the rank; adapter that cannot work: ConfigError",
                    "tests/rl/test_lora_sync.py::test_ppo_lora_run_syncs_the_adapter_only",
                    "tests/rl/test_lora_sync.py::test_resolve_lora_sync_picks_adapter_only_where_the_engines_serve_the_rank",
                    "tests/rl/test_lora_sync.py::test_lora_sync_adapter_that_cannot_work_stops_before_ray"),
    "weight_sync_bucket_mb": _t("weights are pushed in buckets of this size (several buckets at 1 MiB)",
                                _PUSH + "test_gloo_broadcast_run_matches_the_ray_run"),
    "prompt_max_len": _t("over-long prompts dropped and counted; the engines' max_model_len",
                         "tests/data/test_prompts.py::test_over_long_prompts_are_dropped_and_counted",
                         _PPO + "test_engine_options_from_the_rollout_flags"),
    "batch-inference:prompt_max_len": _t("over-long prompts dropped; max_model_len of the engines",
                                         _BI + "test_prompt_flags_shape_the_prompts",
                                         _BI + "test_engine_flags_reach_the_engines"),
    "generate_max_len": _t("max new tokens of the sampling; the engines' max_model_len", _SAMPLING,
                           _PPO + "test_engine_options_from_the_rollout_flags"),
    "temperature": _t("sampling temperature, and the trainer's log-prob temperature", _SAMPLING,
                      "tests/models/test_logprobs.py::test_response_log_probs_shapes_temperature_and_left_padding"),
    "top_p": _t("nucleus sampling", _SAMPLING),
    "micro_rollout_batch_size": _t("rows per reward-model / log-prob forward", _SOURCES + "test_from_config"),
    "eval_temperature": _t("temperature of the evaluation's sampling",
                           _PPO + "test_eval_flags_set_the_evaluation_sampling"),
    "eval_n_samples_per_prompt": _t("samples per eval prompt, pass@k up to it",
                                    _PPO + "test_eval_flags_set_the_evaluation_sampling"),
    "dynamic_filtering": _t("all-equal groups dropped and refilled",
                            _PPO_OPTS + "test_dynamic_filtering_drops_all_equal_groups_and_refills"),
    "dynamic_filtering_reward_range": _t("the mean-score range of kept groups",
                                         _PPO + "test_dynamic_filtering_reward_range_picks_the_groups"),
    "use_dynamic_batch": _t("micro-batches by token budget; the update equals the fixed-size one", _PPO_MICRO,
                            _PPO_OPTS + "test_dynamic_batch_gives_the_same_update"),
    "train_max_tokens_per_gpu": _t("the token budget of --use_dynamic_batch micro-batches", _PPO_MICRO),
    "rollout_max_tokens_per_gpu": _t("the token budget of the forward passes' micro-batches; same outputs",
                                     _PPO + "test_forward_micro_batches_follow_the_rollout_budget",
                                     _PPO_OPTS + "test_dynamic_batch_gives_the_same_update"),
    "ppo:packing_samples": _t("one packed row per micro-batch, each shared prompt once; the packed step equals the "
                              "padded one (metrics and weights)",
                              "tests/rl/test_packing.py::test_packed_ppo_steps_equal_the_padded_ones",
                              "tests/rl/test_packing.py::"
                              "test_packed_log_probs_entropy_and_gradients_equal_the_padded_forward"),
    "async_train": _t("generation one step ahead (one step off-policy), still learns",
                      "tests/rl/test_async.py::test_async_samples_one_step_behind_and_still_learns"),
    "async_queue_size": _t("rollouts generated ahead; staleness logged and never above N (N=2: exactly 2 once "
                           "the queue is full)",
                           "tests/rl/test_async.py::test_a_queue_of_two_keeps_every_sample_at_most_two_versions_stale"),
    "partial_rollout": _t("engines generate in chunks and resume across the weight sync; samples carry mixed "
                          "versions and train with the IS correction; checkpoints keep the rollout in flight",
                          "tests/rl/test_async.py::test_partial_rollouts_resume_across_the_sync_with_mixed_versions"),
    "partial_rollout_chunk_tokens": _t("new tokens per chunk: a sync lands between two chunks, so a sample's tokens "
                                       "carry the versions of their chunks",
                                       "tests/rl/test_async.py::"
                                       "test_partial_rollouts_resume_across_the_sync_with_mixed_versions"),
    "freezing_actor_steps": _t("the actor does not train in the first N steps (no policy loss)",
                               _PPO_FULL + "test_colocate_critic_reward_with_two_reward_models"),
    "recompute_old_log_probs": _t("old log-probs from a separate pass; the run is the same",
                                  _OLD_LP + "test_reused_old_log_probs_give_the_same_run"),
    "reward_pretrain": _t("reward model(s) scored with",
                          _PPO_FULL + "test_colocate_all_models_with_a_serve_rm_reward",
                          _SOURCES + "test_from_config"),
    "agent_func_path": _t("the environment gives the reward (another reward source is refused)",
                          "tests/agents/test_agent_ppo.py::test_an_agent_and_another_reward_source_contradict"),
    "agent_action_max_len": _t("caps a turn; refused without --agent_func_path",
                               "tests/agents/test_agent_ppo.py::test_an_agent_and_another_reward_source_contradict"),
    "remote_rm_url": _t("the reward function / server scored with", _PPO_REWARDS,
                        _PPO_RUN + "test_a_raising_reward_function_stops_the_run_naming_it"),
    "reward_timeout": _t("the reward sources' timeout", _PPO_REWARDS, _SOURCES + "test_from_config"),
    "reward_error_policy": _t("zero: failing samples score 0 and are counted", _PPO_REWARDS,
                              _PPO_OPTS + "test_zero_policy_scores_failing_samples_zero_and_counts_them"),
    "reward_combine": _t("sum / mean of several rewards", _PPO_REWARDS, _SOURCES + "test_from_config",
                         _PPO_FULL + "test_colocate_critic_reward_with_two_reward_models"),
    "reward_weights": _t("weighted sum of the rewards", _PPO_REWARDS,
                         _SOURCES + "test_combined_source_mean_and_weights"),
    "reward_format_pattern": _t("the regex of builtin:format",
                                _PPO + "test_reward_format_pattern_reaches_the_format_reward"),
    "remote_rm_timeout": _t("seconds per request to a reward server (default --reward_timeout)",
                            _REMOTE + "test_remote_rm_timeout_flag_bounds_each_request", _BI_SCORING),
    "remote_rm_retries": _t("attempts per request: retries + 1",
                            _REMOTE + "test_remote_rm_retries_and_backoff_flags_space_the_attempts", _BI_SCORING),
    "remote_rm_backoff": _t("the wait before each retry (doubling)",
                            _REMOTE + "test_remote_rm_retries_and_backoff_flags_space_the_attempts", _BI_SCORING),
    "remote_rm_token": _t("the bearer token a serve-rm --auth_token server asks for",
                          _REMOTE + "test_remote_rm_token_flag_authenticates", _BI_SCORING),
    "save_value_network": _t("the critic saved as <save_path>_critic", _PPO_SAVE,
                             _PPO_FULL + "test_colocate_all_models_with_a_serve_rm_reward"),
    "ppo:save_path": _t("where the actor's final HF folder is written", _PPO_SAVE),
    "ppo:save_hf_ckpt": _t("an HF folder of the actor inside each checkpoint", _PPO_SAVE),
    # ---- batch-inference
    "batch-inference:dataset": _t("the prompts / rows", _BI + "test_prompt_flags_shape_the_prompts"),
    "batch-inference:dataset_probs": _t("the mix of several --dataset",
                                        _BI + "test_dataset_split_and_probs_pick_the_rows"),
    "batch-inference:dataset_split": _t("the split read", _BI + "test_dataset_split_and_probs_pick_the_rows"),
    "batch-inference:max_samples": _t("at most this many rows", _BI + "test_prompt_flags_shape_the_prompts"),
    "batch-inference:input_key": _t("the row key of the prompt", _BI + "test_prompt_flags_shape_the_prompts",
                                    _BI + "test_scoring_flags_reach_the_reward_source"),
    "batch-inference:output_key": _t("the row key of the response scored",
                                     _BI + "test_scoring_flags_reach_the_reward_source"),
    "batch-inference:input_template": _t("the prompt template", _BI + "test_prompt_flags_shape_the_prompts"),
    "batch-inference:apply_chat_template": _t("prompts formatted with the chat template",
                                              _BI + "test_prompt_flags_shape_the_prompts"),
    "batch-inference:tokenizer_chat_template": _t("replaces the chat template",
                                                  _BI + "test_sampling_and_tokenizer_flags_reach_generation"),
    "batch-inference:max_len": _t("tokens a reward model scores (left-truncated)",
                                  _BI + "test_scoring_flags_reach_the_reward_source",
                                  "tests/rewards/test_reward_model.py::test_truncation_keeps_the_end"),
    "output_path": _t("where the rows are written", _BIE + "test_the_command_starts_its_own_engine"),
    "lora-merge:output_path": _t("where the merged folder is written",
                                 _CLI + "test_lora_merge_writes_the_merged_model_in_param_dtype"),
    "eval_task": _t("generate / rm scoring of rows",
                    _BIE + "test_rm_task_and_rejection_sampling_pick_the_best_scored_output",
                    _BI + "test_engine_flags_reach_the_engines"),
    "best_of_n": _t("samples per prompt", _BI + "test_sampling_and_tokenizer_flags_reach_generation"),
    "max_new_tokens": _t("max new tokens; max_model_len of the engines",
                         _BI + "test_sampling_and_tokenizer_flags_reach_generation",
                         _BI + "test_engine_flags_reach_the_engines"),
    "batch-inference:temperature": _t("sampling temperature",
                                      _BI + "test_sampling_and_tokenizer_flags_reach_generation"),
    "batch-inference:top_p": _t("nucleus sampling", _BI + "test_sampling_and_tokenizer_flags_reach_generation"),
    "greedy_sampling": _t("temperature 0", _BI + "test_sampling_and_tokenizer_flags_reach_generation",
                          _BIE + "test_the_command_starts_its_own_engine"),
    "iter": _t("only the --iter slice of prompts, with the global seeds",
               _BI + "test_prompt_flags_shape_the_prompts",
               _BIE + "test_generate_scores_and_slices_reproducibly"),
    "batch-inference:rollout_batch_size": _t("prompts per --iter slice", _BI + "test_prompt_flags_shape_the_prompts"),
    "enable_csft": _t("the condition put before every prompt", _BI + "test_prompt_flags_shape_the_prompts"),
    "csft_prompt": _t("the condition text", _BI + "test_prompt_flags_shape_the_prompts"),
    "post_processor": _t("rs / iter_dpo rows", _BIE + "test_rm_task_and_rejection_sampling_pick_the_best_scored_output",
                         _BIE + "test_iterative_dpo_round_trip"),
    "batch-inference:reward_pretrain": _t("reward models scored with",
                                          _BI + "test_scoring_flags_reach_the_reward_source"),
    "batch-inference:remote_rm_url": _t("reward sources scored with",
                                        _BI + "test_scoring_flags_reach_the_reward_source",
                                        _BIE + "test_generate_scores_and_slices_reproducibly"),
    "batch-inference:normalize_reward": _t("reward models normalised with their statistics",
                                           _BI + "test_scoring_flags_reach_the_reward_source",
                                           "tests/rewards/test_reward_model.py::"
                                           "test_normalize_reward_reads_config_stats"),
    "batch-inference:reward_timeout": _t("the reward sources' timeout",
                                         _BI + "test_scoring_flags_reach_the_reward_source"),
    "micro_batch_size": _t("rows per reward-model forward", _BI + "test_scoring_flags_reach_the_reward_source"),
    "batch-inference:vllm_num_engines": _t("engines started", _BI + "test_engine_flags_reach_the_engines"),
    "tp_size": _t("the engines' tensor_parallel_size (vLLM engine arguments; GPUs only)",
                  _BI + "test_engine_flags_reach_the_engines"),
    # ---- serve-rm
    **{f"serve-rm:{flag}": _t(what, _SERVE) for flag, what in {
        "reward_pretrain": "the reward model(s) served", "remote_rm_url": "the reward function served",
        "host": "the bind address", "port": "the port (0: any free one)",
        "auth_token": "requests must carry this bearer token", "normalize_reward": "reward models normalised",
        "max_len": "tokens scored (reward model)", "batch_size": "micro-batch of the reward model",
        "reward_timeout": "timeout of the reward function", "reward_error_policy": "zero: failing samples score 0",
        "reward_combine": "sum / mean of several sources", "reward_weights": "weights of the sources",
        "reward_format_pattern": "the regex of builtin:format"}.items()},
    # ---- lora-merge, report, demo
    "lora_path": _t("the adapter merged", _CLI + "test_lora_merge_writes_the_merged_model_in_param_dtype"),
    "report:run_dir": _t("the run folder read (a missing one is an error)",
                         "tests/observability/test_report.py::test_missing_run_dir_or_metrics_is_a_clear_error"),
    "report:output": _t("where report.html goes",
                        "tests/observability/test_report.py::test_cli_writes_the_page_and_honours_output"),
    "report:step": _t("the step the samples page (samples.html) shows; a step without samples is an error",
                      "tests/observability/test_trace.py::test_the_report_writes_the_samples_page_of_a_step"),
    "runs:runs_dir": _t("the folder searched for run folders (default ./runs; a missing one is an error)",
                        _RUNS + "test_runs_lists_command_date_steps_and_outcome_oldest_first",
                        _RUNS + "test_runs_default_dir_without_manifest_and_errors"),
    "compare:run_a": _t("the first run overlaid (A, blue)",
                        _RUNS + "test_compare_overlays_the_shared_metrics_of_two_runs"),
    "compare:run_b": _t("the second run overlaid (B, red); a folder without metrics.jsonl is an error",
                        _RUNS + "test_compare_overlays_the_shared_metrics_of_two_runs",
                        _RUNS + "test_compare_default_output_and_a_folder_that_is_not_a_run"),
    "compare:output": _t("where the page goes (default ./compare.html)",
                         _RUNS + "test_compare_overlays_the_shared_metrics_of_two_runs",
                         _RUNS + "test_compare_default_output_and_a_folder_that_is_not_a_run"),
    "steps": _t("prompts for exactly this many GRPO steps", _CLI + "test_demo_flags_reach_the_ppo_command",
                "tests/e2e/test_demo.py::test_demo_runs_grpo_and_prints_before_after"),
    "eval_prompts": _t("held-out prompts for before/after", _CLI + "test_demo_flags_reach_the_ppo_command"),
}
# ppo's engine-creation, placement and weight-check flags: runs that build their own engines, placement read from
# the manifest (what each Ray actor reported) and checked against Ray's actor table.
_OWN = "tests/rl/test_engines_from_flags.py::"
_FULL = "tests/rl/test_ppo_full.py::"
_SYNC = "tests/rl/test_sync_check.py::"
EFFECTS.update({
    "ppo:vllm_num_engines": _t("that many engine actors, the prompts of a step split between them",
                               _SPREAD),
    "ppo:colocate_all_models": _t("the engine and the reference on the actor's placement group",
                                  _OWN + "test_colocate_all_models_puts_the_engine_on_the_actors_bundle"),
    "ppo:colocate_actor_ref": _t("the reference on the actor's placement group, critic and reward model apart",
                                 _FULL + "test_colocate_actor_ref_with_the_ptx_loss"),
    "ppo:colocate_critic_reward": _t("every reward-model group on the critic's placement group",
                                     _FULL + "test_colocate_critic_reward_with_two_reward_models"),
    "ppo:vllm_enable_sleep": _t("CUDA: engines asleep between generation and sync (call order with a stand-in "
                                "engine); CPU: the run logs that the engines stay up",
                                _FULL + "test_phases_order_sleep_and_offload_around_generation",
                                _OWN + "test_colocate_all_models_puts_the_engine_on_the_actors_bundle"),
    "ppo:fsdp_enable_offload": _t("CUDA: trainer state in host RAM during generation (call order); CPU: the run "
                                  "logs that it is a no-op",
                                  _FULL + "test_phases_order_sleep_and_offload_around_generation",
                                  _OWN + "test_colocate_all_models_puts_the_engine_on_the_actors_bundle"),
    "ppo:ref_reward_offload": NoEffect("CUDA only: the reference and reward models visit the GPU for their forwards; "
                                       "on CPU their parameters already live in host RAM (accepted, inert: run in "
                                       "tests/rl/test_ppo_full.py::test_colocate_all_models_with_a_serve_rm_reward)"),
    "ppo:sync_logprob_tolerance": _t("the bound of the engine-vs-trainer log-prob check after each sync (0: off)",
                                     _SYNC + "test_an_engine_computing_with_other_weights_stops_the_run_at_start",
                                     _SYNC + "test_the_probe_fits_the_context_and_the_flag_sets_the_bound"),
})
for _command in OFFLINE:  # ppo's max_norm is registered with the PPO algorithm options
    EFFECTS[f"{_command}:max_norm"] = _t("gradients are clipped to this global norm before the step (0: not clipped); "
                                         "the pre-clip norm is logged", _OPT + "test_max_norm_clips_the_gradient")

# ---- optimiser choice (every training command) and ppo's per-role optimiser flags (#13)
_MUON_STEP = "tests/engine/test_muon.py::test_a_muon_step_matches_the_float64_formulas"
_ROLES = "tests/config/test_ppo_optim_roles.py::"
_INHERIT = _ROLES + "test_unset_role_flags_inherit_the_shared_ones"
EFFECTS.update({
    "adam_eps": _t("AdamW's epsilon in every AdamW group: two steps equal the float64 AdamW formula with it; ppo's "
                   "actor and critic inherit it", _MUON_STEP, _INHERIT),
    "optim": _t("muon: torch.optim.Muon over the hidden matrices (attention and MLP projections; LoRA A/B), AdamW "
                "over embeddings, lm_head, the value head, norms; two steps equal the float64 formulas; an SFT run "
                "with only the Muon matrices learning lowers the held-out loss; FSDP2-sharded Muon equals the whole-"
                "matrix update", _MUON_STEP, "tests/engine/test_muon.py::test_the_muon_parameter_split",
                "tests/engine/test_muon.py::test_sft_with_muon_learns_and_resumes_its_momentum_exactly",
                "tests/engine/test_muon.py::test_fsdp2_sharded_muon_orthogonalises_the_whole_matrix", _INHERIT),
    "muon_lr": _t("the Muon group's peak lr (same schedule as AdamW's): the step's lr sqrt(max(1, m/n)) x NS(U)",
                  _MUON_STEP, _INHERIT),
    "muon_momentum": _t("B <- mu B + (1 - mu) G in the float64 reference the step matches", _MUON_STEP, _INHERIT),
    "muon_ns_steps": _t("the number of quintic Newton-Schulz iterations of the reference the step matches",
                        _MUON_STEP),
    "muon_nesterov": _t("U = (1 - mu) G + mu B (on) or B (--no-muon_nesterov): each matches its reference and not "
                        "the other's", _MUON_STEP),
})
for _role in ("actor", "critic"):
    for _flag in ("optim", "adam_betas", "adam_eps", "l2", "max_norm", "lr_scheduler", "lr_warmup_ratio",
                  "min_lr_ratio", "muon_lr", "muon_momentum", "muon_ns_steps", "muon_nesterov"):
        EFFECTS[f"ppo:{_role}_{_flag}"] = _t(
            f"the {_role} worker's optimizer groups / LambdaLR / clipping take it (the other role keeps its own or "
            f"the shared --{_flag}); out-of-range values are refused naming the flag",
            _ROLES + "test_per_role_flags_reach_each_workers_optimizer_schedule_and_clipping")


_merged = False


def registry() -> dict[str, Effect]:
    """EFFECTS with the tables of effects_ppo.py merged in (once). Use this rather than EFFECTS: when effects_ppo is
    imported first, it imports this module before its own table exists, and the merge waits for the first call."""
    global _merged
    if not _merged:
        from rlhfkit.config.effects_ppo import PPO_EFFECTS

        overlap = sorted(set(EFFECTS) & set(PPO_EFFECTS))
        assert not overlap, f"options listed twice in effects.py and effects_ppo.py: {overlap}"
        EFFECTS.update(PPO_EFFECTS)
        _merged = True
    return EFFECTS


def effect_of(command: str, flag: str) -> Effect | None:
    """The entry for `--flag` of `rlhfkit command`: the command-specific key first, then the shared one."""
    effects = registry()
    return effects.get(f"{command}:{flag}") or effects.get(flag)


def _importing_effects_ppo() -> bool:
    module = sys.modules.get("rlhfkit.config.effects_ppo")
    return module is not None and not hasattr(module, "PPO_EFFECTS")


if not _importing_effects_ppo():
    registry()
