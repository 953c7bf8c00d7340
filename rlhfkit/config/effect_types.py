"""The option-effect registry's vocabulary (`Tested`, `NoEffect`) and the test files its entries cite, shared by
`rlhfkit.config.effects` and the tables it merges (`effects_train`, `effects_ppo`); imports nothing of ours."""

from __future__ import annotations

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
_TRUNCATED = "tests/rl/test_truncated_sampling_ppo.py::"
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
_HANGS = "tests/rl/test_engine_hangs.py::"
_RANK_HANGS = "tests/rl/test_trainer_hangs.py::"
_PRECISION = "tests/engine/test_precision.py::"
_SERVE = _CLI + "test_serve_rm_flags_reach_the_reward_source_and_the_server"
_SFT_KEYS = _OPT + "test_sft_keys_template_and_max_len_shape_the_samples"
_PPO_REWARDS = _PPO + "test_reward_flags_combine_the_ppo_reward_sources"
_REMOTE = "tests/rewards/test_remote.py::"  # ppo's and batch-inference's reward clients over real HTTP
_SERVE_LIMITS = "tests/rewards/test_serve_rm_limits.py::"  # serve-rm against misbehaving clients
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
