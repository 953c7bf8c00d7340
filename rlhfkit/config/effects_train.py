"""The training side of the option-effect registry: model, data, engine and parallelism options (offline commands,
and the ppo actor and critic) and the offline methods' own options (sft, kd, rm, dpo, kto, prm).

Same format as `rlhfkit.config.effects`, which merges this table into its registry."""

from __future__ import annotations

from rlhfkit.config.effect_types import (
    _BI,
    _CLI,
    _CUDA_ONLY,
    _LOSSES,
    _OLD_LP,
    _OPT,
    _PPO,
    _PPO_SETUP,
    _PRECISION,
    _PREF_DATA,
    _REFUSED_PPO,
    _RING,
    _RING_E2E,
    _RING_PPO,
    _SAMPLING,
    _SCAFFOLD,
    _SFT_DATA,
    _SFT_E2E,
    _SFT_KEYS,
    _SHORT_RUN,
    _SPREAD,
    _TP,
    Effect,
    NoEffect,
    _t,
)

# an offline command parses the ring and tensor-parallel flags and its scaffold sets the groups up from them
_PARALLEL_FLAGS = "test_parallel_flags_are_checked_against_the_world_by_the_command"

TRAIN_EFFECTS: dict[str, Effect] = {
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
    "lora-merge:model_path": _t("an alias (OpenRLHF's name): the same parse as --pretrain, the base the adapter is "
                                "merged into",
                                "tests/config/test_seed_flags.py::test_lora_merge_model_path_is_pretrain"),
    "attn_implementation": _t("the attention kernel of the loaded model (config._attn_implementation)", _SCAFFOLD),
    "ppo:attn_implementation": _t("the kernel the actor, reference and critic workers load their models with "
                                  "(eager here; sdpa without the flag)",
                                  "tests/rl/test_worker_flags.py::test_attn_implementation_is_the_kernel_of_every_role",
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
    "eval_split": _t("the split of --eval_dataset (check: that split's 8 rows, not train's 16)", _SCAFFOLD),
    "input_key": _t("the row key of the prompt", _SCAFFOLD, _SFT_KEYS,
                    _SFT_DATA + "test_chat_conversation_without_output_key_trains_last_turn",
                    _PPO_SETUP),
    "output_key": _t("the row key of the response (the loss is on its tokens)", _SCAFFOLD, _SFT_KEYS,
                     _SFT_DATA + "test_missing_key_names_file_line_key_and_present_keys"),
    "input_template": _t("the prompt is formatted with the template", _SFT_KEYS,
                         _PREF_DATA + "test_plain_template", _OPT + "test_preference_keys_and_the_rm_margin"),
    "apply_chat_template": _t("the prompt is formatted with the tokenizer's chat template (sft through its parsed "
                              "flag: the template's role headers are context, the answer and end-of-turn the target)",
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
    "master_weights_rounding": _t("one rank in bf16: nearest rounds the fp32 masters into the compute copy by a cast; "
                                  "stochastic gives each weight a bf16 neighbour at the odds that make it unbiased",
                                  "tests/engine/test_master_weights.py::"
                                  "test_master_weights_rounding_flag_decides_how_the_engine_rounds"),
    "seed": _t("the data mix and the epoch order", _OPT + "test_seed_decides_the_mix_and_the_epoch_order"),
    "ppo:seed": _t("the sampling seed of the engines", _SAMPLING, _PPO + "test_engine_options_from_the_rollout_flags"),
    "batch-inference:seed": _t("the sampling seed", _BI + "test_sampling_and_tokenizer_flags_reach_generation",
                               _BI + "test_engine_flags_reach_the_engines"),
    "full_determinism": _t("torch.use_deterministic_algorithms(True) during training", _SCAFFOLD),
    "dataloader_num_workers": NoEffect("accepted so that OpenRLHF scripts port (--data.dataloader_num_workers): "
                                       "rlhfkit tokenizes the data once, up front, in the training process and cuts "
                                       "batches from those tensors, so there are no loader workers; a value other "
                                       "than 0 is logged as changing nothing and a negative one is refused "
                                       "(tests/config/test_seed_flags.py::"
                                       "test_dataloader_num_workers_is_accepted_and_changes_nothing)"),
    "ppo:full_determinism": _t("refused with the reason (not implemented for the Ray workers)", _REFUSED_PPO),
    "eval_steps": _t("evaluate every N steps instead of at each epoch's end", _SHORT_RUN),
    # ---- context parallel (rlhfkit.models.context_parallel; docs/parallelism.md)
    "ring_attn_size": _t("each sequence split over N ranks (world = data parallel x N): loss and gradients of 2 gloo "
                         "ranks equal the unsharded forward's (padded, packed, GQA, RM head); sft/dpo/rm/kto runs on 2 "
                         "ranks reproduce the 1-rank losses and grad norms; a size not dividing the world is refused "
                         "(by the command, in a 1-process world)",
                         _RING + "test_ring_size_must_divide_the_world_size", _OPT + _PARALLEL_FLAGS,
                         _RING_E2E + "test_sft_ring_attn_size_2_reproduces_one_rank",
                         _RING_E2E + "test_dpo_rm_kto_ring_attn_size_2_reproduce_one_rank"),
    "ring_head_stride": _t("KV heads gathered per step: stride 1 and 2 give the unsharded result; a stride not "
                           "dividing the KV heads, or one without --ring_attn_size > 1, is refused (by the command)",
                           _RING + "test_ring_attention_over_two_ranks_equals_the_unsharded_forward",
                           _OPT + _PARALLEL_FLAGS,
                           _RING + "test_ring_size_must_divide_the_world_size",
                           _RING_E2E + "test_sft_ring_attn_size_2_reproduces_one_rank"),
    "ppo:ring_attn_size": _t("the actor, reference and critic ranks split each sequence over N ranks (world = data "
                             "parallel x N; reward models unsplit): 2 gloo ranks give the 1-rank log-probs, entropy, "
                             "values and loss gradients, padded and packed; a 1-step ppo run on 2 actor ranks with "
                             "--ring_attn_size 2 reproduces the 1-rank step; a size not dividing a role's ranks is "
                             "refused", _RING_PPO + "test_ring_workers_equal_the_unsharded_workers",
                             _RING_PPO + "test_ppo_ring_flags_are_checked_against_the_roles",
                             _RING_PPO + "test_a_ppo_step_with_ring_attn_size_2_equals_one_rank"),
    "ppo:ring_head_stride": _t("KV heads per all-gather of the ring attention in the actor, reference and critic "
                               "(stride 2: the tiny model's 2 KV heads in one message, stride 1 would send two) with "
                               "the unsharded result; without --ring_attn_size > 1 refused",
                               _RING_PPO + "test_ring_workers_equal_the_unsharded_workers",
                               _RING_PPO + "test_ppo_ring_flags_are_checked_against_the_roles"),
    **{f"kd:{flag}": _t("student and teacher split each sequence over the ring group; the KD loss (NLL + KL to the "
                        "teacher) and its gradients on 2 gloo ranks equal the unsharded ones, padded and packed; "
                        "`rlhfkit kd` sets the ring up from the flags (a ring of 2 in a 1-process world, or a head "
                        "stride without a ring, is refused)",
                        _RING + "test_ring_attention_over_two_ranks_equals_the_unsharded_forward",
                        _OPT + _PARALLEL_FLAGS)
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
    # --tp_size: the alias of --ds_tensor_parallel_size on the training commands (batch-inference's own flag is the
    # engines' tensor parallelism, the "tp_size" entry)
    **{f"{command}:tp_size": _t("an alias of --ds_tensor_parallel_size: the same checks and mesh (the command refuses "
                                "--tp_size 2 in a 1-process world as --ds_tensor_parallel_size 2)",
                                _TP + "test_tp_size_must_divide_heads_world_and_fit_the_family", _OPT + _PARALLEL_FLAGS,
                                "tests/e2e/test_tensor_parallel.py::test_sft_tp_size_2_reproduces_one_rank")
       for command in ("sft", "rm", "dpo", "kto")},
    **{f"{command}:tp_size": _t("refused with the reason (tensor parallel covers sft, rm, dpo, kto)",
                                _TP + "test_commands_without_tensor_parallel_refuse_the_flags")
       for command in ("ppo", "kd", "prm")},
    "ppo:eval_steps": _t("evaluate every N steps", _OLD_LP + "test_reused_old_log_probs_give_the_same_run"),
    # ---- sft / kd
    "multiturn": _t("loss on every assistant turn",
                    _SFT_DATA + "test_multiturn_trains_every_assistant_turn_but_not_headers"),
    "pretrain_mode": _t("loss on every token", _SFT_DATA + "test_pretrain_mode_trains_every_token"),
    "csft_keys": _t("the row's attribute values put before the prompt; the condition steers generation",
                    "tests/e2e/test_csft.py::test_the_condition_steers_the_output"),
    "kd:teacher_model": _t("the teacher of the KL term", "tests/e2e/test_kd.py::test_student_kl_to_teacher_falls"),
    "kd_coef": _t("loss = (1 - kd_coef) NLL + kd_coef KL: 0.25 gives 0.75 NLL + 0.25 KL (float64 reference)",
                  "tests/e2e/test_kd.py::test_student_kl_to_teacher_falls",
                  _LOSSES + "test_kd_loss_equals_reference_function"),
    "teacher_offload": NoEffect(_CUDA_ONLY),
    # ---- rm / dpo / kto / prm
    "prompt_key": _t("the row key of the prompt (unset: whole texts)", _SCAFFOLD,
                     _PREF_DATA + "test_full_conversations_without_prompt_key",
                     _OPT + "test_preference_keys_and_the_rm_margin"),
    "chosen_key": _t("the row key of the chosen response", _OPT + "test_preference_keys_and_the_rm_margin"),
    "rejected_key": _t("the row key of the rejected response", _OPT + "test_preference_keys_and_the_rm_margin"),
    "loss": NoEffect("logexp computes log(1 + exp(r_r - r_c + m)) as a softplus, mathematically equal to sigmoid's "
                     "-log sigmoid(r_c - r_r - m): the loss and its gradient do not change (both equal the float64 "
                     "Bradley-Terry value: tests/trainers/test_method_losses.py::test_reward_model_loss_equals_"
                     "reference_function, through the parsed flag); kept so that OpenRLHF scripts port; another name "
                     "is refused"),
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
    "beta": _t("the DPO / KTO temperature: the parsed flag's loss equals the reference function's with that beta",
               _LOSSES + "test_dpo_loss_equals_reference_function",
               _LOSSES + "test_kto_loss_equals_reference_function"),
    "label_smoothing": _t("cDPO loss (0.2: the reference function's)",
                          _LOSSES + "test_dpo_loss_equals_reference_function"),
    "ipo": _t("IPO loss on length-averaged log-probs (the reference function's)",
              _LOSSES + "test_dpo_loss_equals_reference_function"),
    "nll_loss_coef": _t("adds coef x the chosen responses' length-averaged NLL",
                        _LOSSES + "test_dpo_loss_equals_reference_function"),
    "dpo:ref_pretrain": _t("the reference model's log-probs are the ones used (precomputed and live), not --pretrain's",
                           _LOSSES + "test_precomputed_reference_equals_live_reference",
                           _LOSSES + "test_dpo_loss_equals_reference_function"),
    "kto:ref_pretrain": _t("the reference model's log-probs are the ones used (same loader as dpo), not --pretrain's",
                           _LOSSES + "test_kto_loss_equals_reference_function"),
    "ref_mode": _t("precompute attaches reference log-probs to the samples, live runs the reference per batch; "
                   "without either the loss refuses",
                   _LOSSES + "test_ref_mode_flag_precomputes_or_runs_the_reference_live",
                   _LOSSES + "test_dpo_without_reference_log_probs_is_an_error"),
    "ref_offload": NoEffect(_CUDA_ONLY),
    "vanilla_loss": _t("vanilla KTO: the parsed flag's loss equals the float64 formula with reference points from the "
                       "other side's mean log-ratio (differs from the default loss on the same batch); with sample "
                       "weights it is refused",
                       _LOSSES + "test_vanilla_kto_loss_through_the_parsed_config",
                       "tests/config/test_parity_flags.py::test_vanilla_loss_parses_and_refuses_sample_weights",
                       "tests/algorithms/test_parity_methods.py::"
                       "test_vanilla_kto_on_a_labelled_batch_matches_the_formula_and_carries_gradient"),
    "desirable_loss_weight": _t("weight of desirable samples (1.5: the reference function's loss)",
                                _LOSSES + "test_kto_loss_equals_reference_function"),
    "undesirable_loss_weight": _t("weight of undesirable samples (0.5: the reference function's loss)",
                                  _LOSSES + "test_kto_loss_equals_reference_function"),
    "label_key": _t("the row key of the labels", _SCAFFOLD, _LOSSES + "test_kto_loss_equals_reference_function",
                    _LOSSES + "test_prm_loss_equals_reference_function"),
    "ppo:label_key": _t("the label handed to the reward function", _PPO_SETUP),
    "batch-inference:label_key": _t("labels passed to the reward and copied to the rows",
                                    _BI + "test_prompt_flags_shape_the_prompts",
                                    _BI + "test_scoring_flags_reach_the_reward_source"),
    "placeholder_token": _t("the step marker the reward token is predicted at (the loss by hand at each marker)",
                            _LOSSES + "test_prm_loss_equals_reference_function",
                            "tests/e2e/test_prm.py::test_prm_classifies_steps_above_chance"),
    "reward_tokens": _t("softmax over these tokens only (the cross-entropy over the two, by hand)",
                        _LOSSES + "test_prm_loss_equals_reference_function",
                        "tests/e2e/test_prm.py::test_prm_classifies_steps_above_chance"),
}
