"""Checks of the `ppo` flags before anything starts (`validate_rl`): contradictions and values the run cannot use
raise a ConfigError naming the flags and what to do; the doubtful ones log a warning. The run's plan
(`rlhfkit.config.plan.RunPlan`) is made here, once (`plan_run`): validation checks it, build_setup completes it
against the cluster."""

from __future__ import annotations

import logging
from pathlib import Path

from rlhfkit.algorithms.offpolicy import IS_CORRECTION_PRESETS
from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.optim_options import validate_optim
from rlhfkit.config.plan import RunPlan, reference_model, resolve_plan
from rlhfkit.config.validate import check_loader_workers, require
from rlhfkit.engine.ema import validate_ema
from rlhfkit.errors import ConfigError
from rlhfkit.models.loading import attention_kernel
from rlhfkit.rl.debug_dump import dump_steps
from rlhfkit.rl.reward_group import model_specs
from rlhfkit.rl.ring import validate_ring
from rlhfkit.rl.vision_batch import validate_vision

log = logging.getLogger("rlhfkit")


def plan_run(cfg: PPOConfig) -> RunPlan:
    """The run's plan from its flags (`resolve_plan`, with the --reward_pretrain specs that are reward models)."""
    return resolve_plan(cfg, reward_models=tuple(model_specs(cfg)))


def validate_rl(cfg: PPOConfig) -> RunPlan:
    """Every check of the ppo flags that needs no cluster (build_setup runs it first; the tests call it alone);
    returns the run's plan it checked (`plan_run`), which build_setup completes against the cluster."""
    require(cfg, "pretrain", "prompt_data")
    check_loader_workers(cfg)
    if cfg.agent_func_path and (cfg.remote_rm_url or cfg.reward_pretrain):
        given = "--remote_rm_url" if cfg.remote_rm_url else "--reward_pretrain"
        raise ConfigError(f"--agent_func_path and {given} both give the reward: an agent environment rewards its "
                          f"episodes from step(); drop {given}, or call your reward inside step()")
    if cfg.agent_action_max_len is not None and (cfg.agent_action_max_len < 1 or not cfg.agent_func_path):
        raise ConfigError(f"--agent_action_max_len {cfg.agent_action_max_len}: must be >= 1 and goes with "
                          "--agent_func_path (it caps one turn of a multi-turn episode)")
    _validate_replay(cfg)
    if not cfg.engine_hang_timeout >= 0:
        raise ConfigError(f"--engine_hang_timeout {cfg.engine_hang_timeout}: must be >= 0 seconds (0 turns the "
                          "engines' liveness probes off; the default, 60, finds a stopped engine within a minute)")
    if not cfg.trainer_hang_timeout >= 0:
        raise ConfigError(f"--trainer_hang_timeout {cfg.trainer_hang_timeout}: must be >= 0 seconds (0 turns the "
                          "model ranks' heartbeats off; the default, 60, finds a stopped rank within a minute)")
    if not (cfg.remote_rm_url or cfg.reward_pretrain or cfg.agent_func_path or cfg.rollout_replay_dir):
        raise ConfigError("give a reward: --remote_rm_url (reward_func .py, builtin:NAME or http URL) "
                          "or --reward_pretrain")
    if cfg.lora_sync == "adapter":  # what the flags alone rule out fails before anything starts
        from rlhfkit.launch.engine_spec import lora_sync_spec
        from rlhfkit.rollout.lora_sync import adapter_sync_blocker

        if (blocker := adapter_sync_blocker(lora_sync_spec(cfg))) is not None:
            raise ConfigError(f"--lora_sync adapter cannot work here: {blocker}. Use --lora_sync merged (or auto)")
    plan = plan_run(cfg)
    validate_vision(cfg, plan.needs_critic)
    validate_ring(cfg, {role: plan.world(role) for role, used in (("actor", True), ("ref", plan.needs_ref),
                                                                  ("critic", plan.needs_critic)) if used})
    trained = ("actor", "critic") if plan.needs_critic else ("actor",)
    validate_optim(cfg, trained, absent=() if plan.needs_critic else ("critic",))
    if plan.group_estimator and cfg.n_samples_per_prompt < 2:
        raise ConfigError(f"--advantage_estimator {cfg.advantage_estimator} compares the samples of a prompt: "
                          "set --n_samples_per_prompt >= 2")
    if cfg.advantage_estimator == "flash_reinforce" and cfg.gamma != 1.0:
        raise ConfigError(f"--gamma {cfg.gamma} with --advantage_estimator flash_reinforce: the batch baseline "
                          "compares whole-response rewards, so the returns are undiscounted: drop --gamma, or use "
                          "gae / reinforce")
    if plan.group_estimator and cfg.gamma != 1.0:
        raise ConfigError(f"--gamma {cfg.gamma} with --advantage_estimator {cfg.advantage_estimator}: a group "
                          "baseline compares whole-response rewards, so the returns are undiscounted (OpenRLHF "
                          "sets gamma to 1 for it): drop --gamma, or use gae / reinforce")
    if cfg.packing_samples and attention_kernel(cfg.attn_implementation) not in ("sdpa", "eager"):  # as it runs
        raise ConfigError(f"--packing_samples with --attn_implementation {cfg.attn_implementation}: the packed row "
                          "needs a 4D block mask, which only sdpa and eager honour; use one of them, or drop "
                          "--packing_samples")
    _validate_algorithm_flags(cfg)
    _validate_distill(cfg, plan)
    validate_ema(cfg)
    if cfg.dynamic_filtering and cfg.n_samples_per_prompt < 2:
        raise ConfigError("--dynamic_filtering needs --n_samples_per_prompt >= 2")
    buffer = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    if buffer % cfg.train_batch_size and not cfg.dynamic_filtering:
        raise ConfigError(f"--rollout_batch_size x --n_samples_per_prompt = {buffer} is not a multiple of "
                          f"--train_batch_size {cfg.train_batch_size}")
    if cfg.top_k < 0:
        raise ConfigError(f"--top_k {cfg.top_k}: the number of most likely tokens to sample among, >= 1 (0: off)")
    if (cfg.top_p < 1.0 or cfg.top_k > 0) and cfg.logprobs_truncation == "off":
        log.warning("--top_p %s / --top_k %s with --logprobs_truncation off: the engines report log-probs of the "
                    "truncated distribution, the trainer computes the whole softmax, so every PPO ratio and "
                    "importance weight carries that bias (drop the flag: auto computes the truncated log-probs)",
                    cfg.top_p, cfg.top_k)
    if cfg.reward_weights is not None:
        try:
            [float(w) for w in cfg.reward_weights.split(",")]
        except ValueError:
            raise ConfigError(f"--reward_weights {cfg.reward_weights!r}: expected comma-separated numbers") from None
    if cfg.ptx_coef < 0:
        raise ConfigError(f"--ptx_coef {cfg.ptx_coef} must be >= 0")
    if cfg.pretrain_data and cfg.ptx_coef == 0:
        log.warning("--pretrain_data is given but --ptx_coef is 0: the auxiliary loss is off")
    if cfg.async_train and cfg.colocate_all_models:
        raise ConfigError("--async_train generates while the models train, but --colocate_all_models puts the engines "
                          "on the training devices (they take turns): drop one of the two")
    _validate_async(cfg)
    if cfg.async_train and not cfg.enable_vllm_is_correction:
        log.warning("--async_train samples with weights one step old: add --enable_vllm_is_correction to correct "
                    "the policy loss with truncated importance weights")
    dump_steps(cfg.debug_dump_steps)  # ConfigError on a bad value
    _validate_colocation(cfg, plan)
    return plan


def _validate_replay(cfg: PPOConfig) -> None:
    """--rollout_dump_dir, --rollout_replay_dir and --eval_only (rl/rollout_dump.py, ppo_trainer.evaluate_only)."""
    if cfg.rollout_replay_dir and cfg.rollout_dump_dir and \
            Path(cfg.rollout_replay_dir).resolve() == Path(cfg.rollout_dump_dir).resolve():
        raise ConfigError(f"--rollout_dump_dir and --rollout_replay_dir are both {cfg.rollout_replay_dir}: a replay "
                          "reads that folder; drop --rollout_dump_dir (or dump to another folder)")
    if cfg.eval_only and not cfg.eval_dataset:
        raise ConfigError("--eval_only evaluates --eval_dataset: give it")
    if cfg.eval_only and cfg.rollout_replay_dir:
        raise ConfigError("--eval_only generates on the eval prompts, but --rollout_replay_dir starts no rollout "
                          "engines: drop one of the two")
    if cfg.eval_only and cfg.rollout_dump_dir:
        raise ConfigError("--eval_only trains no step, so --rollout_dump_dir would write nothing: drop it")


def _validate_async(cfg: PPOConfig) -> None:
    """--async_queue_size and --partial_rollout (rl/async_rollout.py)."""
    if cfg.async_queue_size < 1:
        raise ConfigError(f"--async_queue_size {cfg.async_queue_size}: must be >= 1 (rollouts generated ahead)")
    if cfg.partial_rollout and not cfg.async_train:
        raise ConfigError("--partial_rollout resumes generations across weight syncs while the trainer steps: it "
                          "needs --async_train")
    if cfg.partial_rollout and cfg.agent_func_path:
        raise ConfigError("--partial_rollout chunks single-turn generation; with --agent_func_path the episodes "
                          "are generated whole: drop one of the two")
    if cfg.partial_rollout and cfg.max_len:
        raise ConfigError(f"--partial_rollout with --max_len {cfg.max_len}: the chunks resume every unfinished row "
                          "to one --generate_max_len, not to each prompt's share of --max_len; drop --max_len and "
                          "bound the rollout with --prompt_max_len and --generate_max_len")
    if cfg.max_len and cfg.max_len < 2:
        raise ConfigError(f"--max_len {cfg.max_len}: prompt + response needs at least 2 tokens (0: no total bound)")
    if cfg.partial_rollout_chunk_tokens < 1:
        raise ConfigError(f"--partial_rollout_chunk_tokens {cfg.partial_rollout_chunk_tokens}: must be >= 1")


def _validate_algorithm_flags(cfg: PPOConfig) -> None:
    """--kl_target / --kl_horizon, --use_unbiased_kl, --reward_clip_range, the length penalties, --policy_loss_type
    cispo and the IS-correction grid."""
    if cfg.policy_loss_type == "cispo" and cfg.dual_clip is not None:
        raise ConfigError(f"--dual_clip {cfg.dual_clip} bounds PPO's min(ratio x A, clip(ratio) x A); "
                          "--policy_loss_type cispo has no such min: drop --dual_clip")
    _validate_is_correction(cfg)
    if cfg.kl_target is not None:
        if cfg.kl_target <= 0 or cfg.kl_horizon <= 0:
            raise ConfigError(f"--kl_target {cfg.kl_target} and --kl_horizon {cfg.kl_horizon} must be > 0")
        if cfg.init_kl_coef <= 0:
            raise ConfigError("--kl_target adapts the KL coefficient from --init_kl_coef, which is 0 (no reference "
                              "model, and 0 stays 0): set --init_kl_coef > 0")
    if cfg.use_kl_loss and cfg.init_kl_coef <= 0:
        raise ConfigError("--use_kl_loss adds init_kl_coef x KL(policy || reference) to the loss, but "
                          f"--init_kl_coef is {cfg.init_kl_coef} (no reference model is loaded): set --init_kl_coef "
                          "> 0, or drop --use_kl_loss")
    if cfg.use_unbiased_kl and not cfg.use_kl_loss:
        raise ConfigError("--use_unbiased_kl weights the KL loss: it goes with --use_kl_loss")
    if cfg.use_unbiased_kl and cfg.kl_estimator != "k3":
        raise ConfigError(f"--use_unbiased_kl with --kl_estimator {cfg.kl_estimator}: the importance-weighted KL "
                          "loss is an unbiased gradient of KL(policy || reference) for k3 only (rho * k1 and rho * k2 "
                          "differentiate to other quantities); use --kl_estimator k3")
    if cfg.overlong_buffer_len is not None and not 0 < cfg.overlong_buffer_len <= cfg.generate_max_len:
        raise ConfigError(f"--overlong_buffer_len {cfg.overlong_buffer_len} must be in (0, --generate_max_len "
                          f"{cfg.generate_max_len}]")
    if not 0 <= cfg.generate_min_len <= cfg.generate_max_len:
        raise ConfigError(f"--generate_min_len {cfg.generate_min_len} must be in [0, --generate_max_len "
                          f"{cfg.generate_max_len}]")
    if len(cfg.reward_clip_range) != 2:
        given = " ".join(map(str, cfg.reward_clip_range))
        raise ConfigError(f"--reward_clip_range {given}: give two numbers, low high")
    coef = cfg.stop_properly_penalty_coef
    if coef is not None and coef > 1:
        raise ConfigError(f"--stop_properly_penalty_coef {coef}: a scale in [0, 1], or a fixed reward < 0")


def _validate_distill(cfg: PPOConfig, plan: RunPlan) -> None:
    """On-policy distillation's flags (--advantage_estimator on_policy_distill): a teacher, named once, and none of
    the reference-KL flags (the reference role holds the teacher); its flags refused on other estimators."""
    opd_flags = [f"--{name} {value}" for name, value, default in (("teacher_model", cfg.teacher_model, None),
                                                                  ("opd_kl_coef", cfg.opd_kl_coef, 1.0),
                                                                  ("opd_reward_weight", cfg.opd_reward_weight, 0.0))
                 if value != default]
    if not plan.distill:
        if opd_flags:
            raise ConfigError(f"{', '.join(opd_flags)}: on-policy distillation flags, but --advantage_estimator is "
                              f"{cfg.advantage_estimator}: add --advantage_estimator on_policy_distill, or drop them")
        return
    if cfg.teacher_model and cfg.ref_pretrain:
        raise ConfigError(f"--teacher_model {cfg.teacher_model} and --ref_pretrain {cfg.ref_pretrain}: with "
                          "on_policy_distill the reference role loads the teacher, so give it once (--teacher_model)")
    if plan.reference_model is None:
        reference_model(cfg)  # the ConfigError naming --teacher_model
    if cfg.use_kl_loss or cfg.kl_target is not None:
        given = "--use_kl_loss" if cfg.use_kl_loss else f"--kl_target {cfg.kl_target}"
        raise ConfigError(f"{given} with --advantage_estimator on_policy_distill: the reference role holds the "
                          "teacher, and the reverse KL to it is already the advantage (weighted by --opd_kl_coef); "
                          f"drop {given.split()[0]}")
    if cfg.gamma != 1.0:
        raise ConfigError(f"--gamma {cfg.gamma} with --advantage_estimator on_policy_distill: each token's "
                          "advantage is its own teacher log-ratio (discount 0, no reward-to-go); drop --gamma")
    if cfg.opd_kl_coef <= 0:
        raise ConfigError(f"--opd_kl_coef {cfg.opd_kl_coef}: the weight of the reverse-KL term must be > 0 (for "
                          "task reward alone, use group_norm or another estimator)")
    if cfg.opd_reward_weight < 0:
        raise ConfigError(f"--opd_reward_weight {cfg.opd_reward_weight}: must be >= 0 (0: pure distillation)")


def _validate_colocation(cfg: PPOConfig, plan: RunPlan) -> None:
    """Colocated roles share bundles rank for rank, so their rank counts must match (as in OpenRLHF)."""
    has_critic = plan.needs_critic
    has_rm = bool(plan.reward_models)
    pairs: list[tuple[str, str, bool]] = []  # (role, role colocated with it, whether the run has the second)
    if cfg.colocate_all_models:
        pairs = [("actor", role, used) for role, used in (("ref", plan.needs_ref), ("critic", has_critic),
                                                          ("reward", has_rm))]
    else:
        if cfg.colocate_actor_ref:
            pairs.append(("actor", "ref", plan.needs_ref))
        if cfg.colocate_critic_reward:
            pairs.append(("critic", "reward", has_critic and has_rm))
    for a, b, used in pairs:
        if used and plan.world(a) != plan.world(b):
            flag = "--colocate_all_models" if cfg.colocate_all_models else f"--colocate_{a}_{b}"
            raise ConfigError(f"{flag}: the {a} has {plan.world(a)} ranks ({a}_num_nodes x {a}_num_gpus_per_node) "
                              f"but the {b} {plan.world(b)}; colocated roles share bundles rank for rank: set "
                              f"--{b}_num_nodes {plan.nodes(a)} --{b}_num_gpus_per_node {plan.ranks_per_node(a)}")


def _validate_is_gating(cfg: PPOConfig) -> None:
    """--is_correction_gating binary_kl|tv: with the correction on, a mask cell at token or seq level, a (0, DELTA)
    threshold, not with gspo."""
    gating = cfg.is_correction_gating
    if gating == "ratio":
        return
    if not cfg.enable_vllm_is_correction:
        raise ConfigError(f"--is_correction_gating {gating} gates the rollout/trainer mismatch correction, but it is "
                          "off: add --enable_vllm_is_correction")
    if cfg.policy_loss_type == "gspo":
        raise ConfigError(f"--is_correction_gating {gating} with --policy_loss_type gspo: GSPO's IS correction is "
                          "its sequence ratio against the engine's log-probs (no token weights); drop the gate")
    if cfg.is_correction_level is not None and cfg.is_correction_mode is not None:
        level, mode = cfg.is_correction_level, cfg.is_correction_mode
    else:
        level, mode = IS_CORRECTION_PRESETS.get(cfg.vllm_is_correction_type, ("", ""))
    if mode != "mask" or level not in ("token", "seq"):
        raise ConfigError(f"--is_correction_gating {gating} drops the units whose divergence exceeds the bound: it "
                          f"needs mode mask at level token or seq, the cell here is {level} x {mode}: add "
                          "--vllm_is_correction_type icepop (token x mask) or --is_correction_level token|seq "
                          "--is_correction_mode mask")
    low, high = cfg.vllm_is_truncated_threshold
    if low != 0 or high <= 0:
        raise ConfigError(f"--is_correction_gating {gating} bounds a divergence from above: set "
                          f"--vllm_is_truncated_threshold 0 DELTA with DELTA > 0 (e.g. 0 0.005), got {low} {high}")


def _validate_is_correction(cfg: PPOConfig) -> None:
    """--is_correction_level and --is_correction_mode: both or neither, with --enable_vllm_is_correction, not with
    gspo (whose IS correction is its ratio against the engine's log-probs), not beside a named
    --vllm_is_correction_type other than the default."""
    _validate_is_gating(cfg)
    level, mode = cfg.is_correction_level, cfg.is_correction_mode
    if level is None and mode is None:
        return
    if level is None or mode is None:
        given, missing = ("--is_correction_level", "--is_correction_mode") if mode is None else \
            ("--is_correction_mode", "--is_correction_level")
        raise ConfigError(f"{given} without {missing}: the grid cell needs both (token|seq|geo x mask|clip|trunc)")
    if not cfg.enable_vllm_is_correction:
        raise ConfigError(f"--is_correction_level {level} --is_correction_mode {mode} choose how the rollout/trainer "
                          "mismatch is corrected, but the correction is off: add --enable_vllm_is_correction")
    if cfg.policy_loss_type == "gspo":
        raise ConfigError("--is_correction_level/--is_correction_mode with --policy_loss_type gspo: GSPO's IS "
                          "correction is its sequence ratio taken against the engine's log-probs (no token "
                          "weights, as in OpenRLHF); drop the grid flags")
    if cfg.vllm_is_correction_type != "tis":
        raise ConfigError(f"--vllm_is_correction_type {cfg.vllm_is_correction_type} and --is_correction_level "
                          f"{level} --is_correction_mode {mode} both name the correction: give one (the preset is "
                          "the cell docs/algorithms.md lists)")
