"""Every option of every command, with the test that proves it acts or the reason it has no observable effect.

A key is a flag name (`"eps_clip"`), standing for every command that has the flag and reaches it through the same
code (the offline methods share one training loop and one engine), or `"command:flag"` (`"ppo:learning_rate"`) where
a command's path differs; the command-specific key wins. `tests/config/test_option_effects.py` fails when an option
of any command has no entry, when a named test does not exist, or when the test never names the flag as a word;
tools/check_option_claims.py (CI, after both tiers) fails an entry whose cited tests never set the flag non-default.
`python -m rlhfkit.cli.docs` renders the table into docs/options.md.
"""

from __future__ import annotations

import sys

from rlhfkit.config.effect_types import (
    _BEST,
    _BI,
    _BI_SCORING,
    _BIE,
    _CLI,
    _DEADLINES,
    _EMA,
    _FAULTS,
    _HANGS,
    _OLD_LP,
    _OPT,
    _PPO,
    _PPO_FULL,
    _PPO_MICRO,
    _PPO_OPTS,
    _PPO_REWARDS,
    _PPO_RUN,
    _PPO_SAVE,
    _PPO_SETUP,
    _PRECISION,
    _PUSH,
    _RANK_HANGS,
    _REFUSED_PPO,
    _REMOTE,
    _RUNS,
    _SAMPLING,
    _SCAFFOLD,
    _SERVE,
    _SERVE_LIMITS,
    _SFT_E2E,
    _SHORT_RUN,
    _SOURCES,
    _SPREAD,
    _TRUNCATED,
    OFFLINE,
    Effect,
    NoEffect,
    Tested,
    _t,
)
from rlhfkit.config.effects_train import TRAIN_EFFECTS

__all__ = ["EFFECTS", "OFFLINE", "Effect", "NoEffect", "Tested", "effect_of", "registry"]

_CODE = "tests/rewards/test_code_sandbox_modes.py::"

# The shared and command-specific entries; the model, data, engine and parallelism options and the offline methods'
# own live in effects_train.py and the PPO algorithm options (proven on the tensors that `--debug_dump_steps` writes)
# in effects_ppo.py, both merged below; ppo's engine-creation and placement flags follow this table.
EFFECTS: dict[str, Effect] = {
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
    "demo:run_dir": _t("the folder of the demo's data and ppo run, and the one its summary reads (default "
                       "runs/demo-<time>)", _CLI + "test_demo_run_dir_is_the_folder_its_ppo_run_writes_and_reads"),
    "logging_steps": _t("only every N-th step is logged", _SHORT_RUN),
    "ppo:logging_steps": _t("refused with the reason (ppo logs every step)", _REFUSED_PPO),
    "use_tensorboard": _t("TensorBoard event files in this folder", _SHORT_RUN),
    "use_wandb": _t("metrics go to W&B (offline mode here)", _SHORT_RUN),
    "wandb_org": _t("wandb.init(entity=...)", _SHORT_RUN),
    "wandb_group": _t("wandb.init(group=...)", _SHORT_RUN),
    "wandb_project": _t("wandb.init(project=...)", _SHORT_RUN),
    "wandb_run_name": _t("wandb.init(name=...)", _SHORT_RUN),
    # ---- ppo: data, schedule, placement, rollout, rewards
    "ppo:learning_rate": _t("refused with the reason (use --actor_learning_rate / --critic_learning_rate)",
                            _REFUSED_PPO),
    "ppo:train_batch_size": _t("samples per optimizer step: the number of updates", _PPO_SETUP),
    "ppo:max_epochs": _t("PPO epochs over each rollout: the number of updates", _PPO_SETUP),
    "ppo:micro_train_batch_size": _t("rows per training micro-batch", _PPO_MICRO),
    "ppo:max_samples": _t("at most this many prompts", _PPO_SETUP),
    "ppo:input_key": _t("the row key of the prompt", _PPO_SETUP),
    "ppo:input_template": _t("the prompt template", _PPO_SETUP),
    "ppo:apply_chat_template": _t("the run's prompts (rl.setup.load_prompts) are the chat template's, generation "
                                  "header included; without it the text as written",
                                  "tests/data/test_prompts.py::test_ppo_apply_chat_template_formats_the_prompts_of_"
                                  "the_run"),
    "ppo:tokenizer_chat_template": _t("replaces the tokenizer's chat template", _PPO_SETUP),
    "ppo:eval_dataset": _t("held-out prompts", _PPO_SETUP),
    "ppo:eval_split": _t("the split of --eval_dataset (eval: that split's 4 rows, not train's)", _PPO_SETUP),
    "prompt_data": _t("the prompts", _PPO_SETUP),
    "prompt_data_probs": _t("the mix of several --prompt_data", _PPO_SETUP),
    "prompt_split": _t("the split of --prompt_data", _PPO_SETUP),
    "pretrain_data": _t("the auxiliary LM loss data", _PPO_SETUP,
                        _PPO_FULL + "test_colocate_actor_ref_with_the_ptx_loss"),
    "pretrain_data_probs": _t("the mix of several --pretrain_data", _PPO_SETUP),
    "pretrain_split": _t("the split of --pretrain_data", _PPO_SETUP),
    "pretrain_input_key": _t("the text key of --pretrain_data", _PPO_SETUP),
    "pretrain_output_key": _t("loss on the response only", _PPO_SETUP),
    "ptx_coef": _t("weight of the auxiliary LM loss: a real actor step's gradient gains ptx_coef x the LM-loss "
                   "gradient of the --pretrain_data batch (float64 reference)",
                   "tests/rl/test_ptx_coef.py::test_ptx_coef_weights_the_lm_loss_gradient_of_the_policy_step",
                   _PPO_FULL + "test_colocate_actor_ref_with_the_ptx_loss"),
    "num_episodes": _t("passes over the prompts: steps and updates", _PPO_SETUP),
    "rollout_batch_size": _t("prompts per step: steps and updates", _PPO_SETUP),
    "n_samples_per_prompt": _t("samples per prompt (sampling n) and the buffer size", _SAMPLING, _PPO_SETUP),
    "actor_num_nodes": _t("nodes of the actor's placement group (2: a (2 nodes, 2 ranks) group)", _PPO_SETUP),
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
    "engine_hang_timeout": _t("a stopped engine's call raises RemoteActorHung naming it within the hang timeout (2 s "
                              "here; 0: the plain deadline instead); a generation several times the timeout (0.5 s) "
                              "on a live engine finishes, probed all along, with no restart",
                              _HANGS + "test_stopped_engine_is_named_hung_within_the_hang_timeout_and_0_turns_the_"
                              "probe_off",
                              _HANGS + "test_long_generation_on_a_live_engine_outlasts_the_hang_timeout",
                              _HANGS + "test_long_generation_in_a_run_is_not_interrupted_by_a_short_hang_timeout",
                              _HANGS + "test_long_generation_in_a_run_is_not_interrupted_by_a_short_hang_timeout"),
    "trainer_hang_timeout": _t("a model-group rank stopped inside a call is killed and named hung (RemoteActorHung: "
                               "role, rank, node, method) within the hang timeout (2 s here) although the deadline is "
                               "600 s; a live call over twice the timeout (3 s) finishes, its rank beating all along; "
                               "with the default (60 s) a rank stopped mid-run stops the run within 120 s; < 0 refused",
                               _RANK_HANGS + "test_rank_stopped_inside_a_call_is_named_hung_and_killed_within_the_"
                               "hang_timeout",
                               _RANK_HANGS + "test_long_call_on_a_live_rank_outlasts_the_hang_timeout",
                               _RANK_HANGS + "test_actor_rank_stopped_mid_run_stops_it_within_120_s_with_default_flags",
                               _RANK_HANGS + "test_a_negative_trainer_hang_timeout_is_refused"),
    "max_engine_restarts": _t("a killed and a hung engine are restarted, synced and counted (fault/engine_restarts "
                              "1, then 2; one events.jsonl line each) and the run finishes",
                              _FAULTS + "test_killed_then_hung_engine_is_restarted_synced_and_the_run_finishes"),
    "vllm_sync_backend": _t("the weight transport of the run's plan (gloo broadcast equals the ray path; on GPUs "
                            "gloo / ray / nccl as asked; nccl without GPUs falls back to gloo with one warning)",
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
    "top_p": _t("nucleus sampling; the trainer's log-probs over the same nucleus", _SAMPLING,
                "tests/rollout/test_engines.py::test_truncated_sampling_logprobs_are_the_trainers_truncated_ones"),
    "top_k": _t("top-k sampling; the trainer's log-probs over the same k tokens", _SAMPLING,
                "tests/rollout/test_engines.py::test_truncated_sampling_logprobs_are_the_trainers_truncated_ones",
                _TRUNCATED + "test_top_k_and_top_p_packed_with_a_reference"),
    "logprobs_truncation": _t("off: the trainer's log-probs are the whole softmax, biased against the engines' "
                              "truncated ones (rollout/logprob_abs_diff_mean 0.105 at --top_p 0.9 instead of 4e-7)",
                              _TRUNCATED + "test_top_p_ratios_are_exact_with_the_fix_and_biased_without",
                              _TRUNCATED + "test_the_flags_choose_the_trainers_truncation"),
    "micro_rollout_batch_size": _t("rows per log-prob / value / reward-model forward of the workers (4: 6 rows in "
                                   "forwards of 4 and 2)",
                                   _PPO + "test_forward_micro_batches_follow_the_rollout_budget"),
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
    "ppo:packing_samples": _t("one packed row per micro-batch, each shared prompt once (an actor worker's forward: "
                              "1 row of 25 tokens for 6 samples, the padded log-probs); the packed step equals the "
                              "padded one (metrics and weights)",
                              "tests/rl/test_worker_flags.py::"
                              "test_packing_samples_forwards_one_packed_row_with_the_padded_log_probs",
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
    "reward_pretrain": _t("reward model(s) scored with: each one a reward group of its own that loads it",
                          _PPO_FULL + "test_colocate_all_models_with_a_serve_rm_reward",
                          _PPO + "test_reward_group_placement_flags"),
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
    **{flag: _t(what, _CODE + test) for flag, what, test in (
        ("code_sandbox", "builtin:code's sandbox mode (also in the manifest)",
         "test_code_sandbox_flag_picks_the_mode_and_the_manifest_names_it[rlimit]"),
        ("code_memory_mb", "RLIMIT_AS of a program run", "test_code_limit_flags_reach_the_sandbox[code_memory_mb-300-"
                                                           "assert limits() == [300 * 2 ** 20]]"),
        ("code_max_open_files", "RLIMIT_NOFILE of a program run",
         "test_code_limit_flags_reach_the_sandbox[code_max_open_files-17-assert limits() == [17]]"),
        ("code_max_file_mb", "RLIMIT_FSIZE of a program run",
         "test_code_limit_flags_reach_the_sandbox[code_max_file_mb-3-assert limits() == [3 * 2 ** 20]]"),
        ("code_max_procs", "RLIMIT_NPROC of a program run",
         "test_code_max_procs_and_max_output_kb_flags_reach_the_sandbox"),
        ("code_max_output_kb", "output read before the program is killed",
         "test_code_max_procs_and_max_output_kb_flags_reach_the_sandbox"))},
    "remote_rm_timeout": _t("seconds per request to a reward server (default --reward_timeout)",
                            _REMOTE + "test_remote_rm_timeout_flag_bounds_each_request", _BI_SCORING),
    "remote_rm_retries": _t("rounds per request: retries + 1 (each round tries every URL)",
                            _REMOTE + "test_remote_rm_retries_and_backoff_flags_space_the_attempts", _BI_SCORING),
    "remote_rm_backoff": _t("the wait before each retry round (doubling, jittered)",
                            _REMOTE + "test_remote_rm_retries_and_backoff_flags_space_the_attempts", _BI_SCORING),
    "remote_rm_max_response_mb": _t("a larger answer fails the attempt unread",
                                    _REMOTE + "test_remote_rm_max_response_mb_flag_caps_the_answer", _BI_SCORING),
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
    "batch-inference:top_k": _t("top-k sampling", _BI + "test_sampling_and_tokenizer_flags_reach_generation",
                                "tests/rollout/test_types.py::test_sampling_config_from_the_batch_inference_flags"),
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
        "auth_token": "requests must carry this bearer token", "normalize_reward": "reward models normalised",
        "max_len": "tokens scored (reward model)", "batch_size": "micro-batch of the reward model",
        "reward_timeout": "timeout of the reward function", "reward_error_policy": "zero: failing samples score 0",
        "reward_combine": "sum / mean of several sources", "reward_weights": "weights of the sources",
        "reward_format_pattern": "the regex of builtin:format"}.items()},
    **{f"serve-rm:{flag}": _t(what, _SERVE_LIMITS + test) for flag, (what, test) in {
        "allow_unauthenticated": ("a non-loopback --host binds without a token (with a warning) instead of being "
                                  "refused", "test_a_non_loopback_host_without_a_token_is_refused"),
        "request_timeout": ("a client slower than this in total (not per read) gets 408",
                            "test_a_byte_dripping_client_is_cut_off_at_the_request_deadline"),
        "max_request_mb": ("a larger Content-Length gets 413 before the body is read",
                           "test_oversized_request_is_refused_before_its_body_is_read"),
        "max_connections": ("connections over it get 503 at once",
                            "test_connection_cap_answers_503_at_once_and_a_retrying_client_gets_through"),
        "batch_max_queries": ("the most queries merged into one scored batch (0: none merged)",
                              "test_batch_max_queries_caps_the_merged_batch")}.items()},
    "serve-rm:host": _t("the address the server binds: it answers over HTTP there and not on the default 127.0.0.1",
                        _CLI + "test_serve_rm_listens_on_the_host_and_port_it_is_given"),
    "serve-rm:port": _t("the port the server listens on (0: a free one the system picks)",
                        _CLI + "test_serve_rm_listens_on_the_host_and_port_it_is_given", _SERVE),
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
_overlap = sorted(set(EFFECTS) & set(TRAIN_EFFECTS))
assert not _overlap, f"options listed twice in effects.py and effects_train.py: {_overlap}"
EFFECTS.update(TRAIN_EFFECTS)
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
    "ppo:vllm_enable_sleep": _t("CUDA: engines asleep between generation and sync (the phases of the parsed flag "
                                "on a cluster with GPUs: call order with a stand-in engine); CPU: the run logs that "
                                "the engines stay up",
                                _FULL + "test_phases_order_sleep_and_offload_around_generation",
                                _OWN + "test_colocate_all_models_puts_the_engine_on_the_actors_bundle"),
    "ppo:fsdp_enable_offload": _t("CUDA: trainer state in host RAM during generation (the phases of the parsed "
                                  "flag on a cluster with GPUs: call order); CPU: the run logs that it is a no-op",
                                  _FULL + "test_phases_order_sleep_and_offload_around_generation",
                                  _OWN + "test_colocate_all_models_puts_the_engine_on_the_actors_bundle"),
    "ppo:ref_reward_offload": NoEffect("CUDA only: the reference and reward models visit the GPU for their forwards; "
                                       "on CPU their parameters already live in host RAM (accepted, inert: run in "
                                       "tests/rl/test_ppo_full.py::test_colocate_all_models_with_a_serve_rm_reward)"),
    "ppo:sync_logprob_tolerance": _t("one bound for every engine-vs-trainer log-prob check, at start and after "
                                     "each sync, replacing the bound derived from the dtypes (0: off, nothing scored)",
                                     _SYNC + "test_an_engine_computing_with_other_weights_stops_the_run_at_start",
                                     _SYNC + "test_the_flag_sets_one_bound_and_zero_turns_the_check_off"),
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
