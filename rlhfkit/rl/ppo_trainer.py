"""The online run (`rlhfkit ppo`): `train_ppo` sets it up, `run_steps` loops, `train_step` is one step.

    set-up: Ray -> tokenizer, prompts -> model groups (actor, ref, critic, reward) -> rollout engines -> rewards
            (rl/setup.py), then the step's features, each or its null object (rl/step_features.py)
    each step (`train_step`): collect (generate + score, generated ahead, or replayed) -> experience (log-probs,
            KL, penalties, advantages) -> train critic/actor -> sync weights to the engines -> eval (-> best model),
            checkpoint -> metrics. docs/architecture.md maps where each piece lives.
    --eval_only makes the evaluation alone (`evaluate_only`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.parse import config_to_dict
from rlhfkit.config.validate import need
from rlhfkit.errors import ConfigError
from rlhfkit.observability.console import print_derived_table, progress_bar
from rlhfkit.observability.metrics import MetricsLogger, is_extremum, merge_metrics
from rlhfkit.observability.mfu import mfu
from rlhfkit.observability.placement import record_placement
from rlhfkit.observability.trace import add_loss_weights, take_trainer_mismatch, write_step_trace
from rlhfkit.rewards.base import failure_metrics
from rlhfkit.rl.async_rollout import staleness_metrics
from rlhfkit.rl.debug_dump import add_updates
from rlhfkit.rl.engine_faults import EngineFaults
from rlhfkit.rl.evaluation import best_tracker, evaluate
from rlhfkit.rl.experience import Experience
from rlhfkit.rl.group import ModelGroup, run_side_by_side
from rlhfkit.rl.make_experience import (
    Rollout,
    Timer,
    apply_length_penalties,
    fill_log_probs_and_advantages,
    filled,
    to_experience,
)
from rlhfkit.rl.observer import NullObserver, StepObserver
from rlhfkit.rl.placement import collect_whereabouts
from rlhfkit.rl.setup import RLSetup, build_setup, save_final
from rlhfkit.rl.step_features import StepFeatures, build_features, timed
from rlhfkit.rl.vision_batch import attach_pixels
from rlhfkit.rl.worker import ModelWorker

log = logging.getLogger("rlhfkit")


def train_step(s: RLSetup, f: StepFeatures, step: int) -> dict[str, float]:
    """One online step, top to bottom. `f`: the run's features, built once (`build_features`); each is called here
    every step and does nothing where it is off."""
    began = time.perf_counter()
    f.engines.health_check(step)  # a dead or hung engine is restarted now, not mid-generation
    # collect: this step's rollout (generated now, generated ahead with --async_train, or replayed)
    rollout, filter_metrics, timer = f.source.take(step)
    f.rollout_dump.write(step, rollout, filter_metrics, timer)  # before the length penalties change the rewards
    # experience: tensors, length penalties, log-probs, KL, advantages
    exp, raw_rewards, metrics = make_step_experience(s, rollout, filter_metrics, step, timer)
    record = f.debug_dump.begin(step, exp, raw_rewards)
    f.source.before_train(step)  # --async_train: the engines generate the next rollouts while this step trains
    # train: critic and actor, mini-batches of --train_batch_size, --max_epochs
    with timed(timer, "training"):
        metrics.update(train_on_experience(s, exp, step, record))
    write_step_trace(s, step, rollout, exp)  # samples.jsonl: every sample of the step
    update_kl_controller(s, metrics)
    f.debug_dump.write(record)
    # sync: the new weights into the engines
    metrics.update(f.source.before_sync())
    metrics.update(f.engines.sync(step, timer))
    metrics.update(step_times(s, exp, timer, began))
    # evaluate (-> best model), checkpoint (after the evaluation: it holds the best so far)
    metrics.update(f.evaluation.after_step(step))
    f.checkpoints.after_step(step)
    metrics.update(f.engines.fault_metrics())
    return metrics


def run_steps(s: RLSetup, observer: StepObserver) -> dict[str, float]:
    """The loop: the features built once, the first evaluation, `train_step` for each step, the final save."""
    run_dir = need(s.plan.run_dir, "--run_dir")  # resolved by build_setup (the plan)
    print_derived_table("rlhfkit ppo", {**s.summary, "run dir": run_dir})
    metrics_log = MetricsLogger(run_dir, s.cfg)
    bar = progress_bar(s.total_steps, s.start_step, True, "ppo")
    features = build_features(s, observer)
    last: dict[str, float] = {}
    features.evaluation.at_start(metrics_log)
    for step in range(s.start_step + 1, s.total_steps + 1):
        last = train_step(s, features, step)
        metrics_log.log(step, last)
        bar.set_postfix(reward=f"{last['rollout/reward_mean']:.3f}", gen_s=f"{last.get('time/generation', 0.0):.1f}")
        bar.update(1)
    features.source.close()
    bar.close()
    record_placement(run_dir, collect_whereabouts(s.groups, s.engines))  # now with prompts per engine
    save_final(s)
    metrics_log.close()
    resolved = {**config_to_dict(s.cfg), **s.plan.resolved_flags()}  # the flags as the run resolved them
    (Path(run_dir) / "config.json").write_text(json.dumps(resolved, indent=2, default=str))
    return last


def make_step_experience(s: RLSetup, rollout: Rollout, filter_metrics: dict[str, float], step: int,
                         timer: Timer) -> tuple[Experience, torch.Tensor, dict[str, float]]:
    """The rollout as training rows: tensors (+ pixels with --image_key), the length penalties on the rewards, the
    old/reference log-probs, values, KL and advantages. Returns the experience, the rewards before the penalties
    and the step's metrics so far (`filter_metrics`: the collection's)."""
    cfg = s.cfg
    exp = to_experience(rollout, s.tokenizer.pad_token_id)
    if s.vision is not None:  # --image_key: the rows' pixel tensors
        attach_pixels(exp, rollout, s.vision)
    raw_rewards = filled(exp.rewards, "rewards")
    penalty_metrics = apply_length_penalties(rollout, exp, cfg)  # before the advantages
    metrics = {**filter_metrics, **rollout_metrics(rollout, exp), **penalty_metrics}
    if cfg.async_train:  # a replay's samples carry the versions the original recorded
        metrics.update(staleness_metrics(rollout, exp, step, cfg.async_queue_size))
    kl_coef = kl_coefficient(s)
    metrics["train/kl_coef"] = kl_coef
    metrics.update(fill_log_probs_and_advantages(exp, cfg, s.plan, s.actor, s.ref, s.critic, timer, kl_coef))
    return exp, raw_rewards, metrics


def update_kl_controller(s: RLSetup, metrics: dict[str, float]) -> None:
    """Adaptive KL (--kl_target): the next step's coefficient from this step's measured KL."""
    if getattr(s, "kl_ctl", None) is not None and "rollout/kl" in metrics:
        s.kl_ctl.update(metrics["rollout/kl"], s.cfg.rollout_batch_size * s.cfg.n_samples_per_prompt)


def step_times(s: RLSetup, exp: Experience, timer: Timer, began: float) -> dict[str, float]:
    """time/<phase> of each timed phase, perf/* (`stage_utilisation`) and time/step (up to the weight sync)."""
    return {**{f"time/{k}": v for k, v in timer.seconds.items()}, **stage_utilisation(s, exp, timer),
            "time/step": time.perf_counter() - began}


def learning_rows(action_mask: torch.Tensor) -> float:
    """The rows of a mini-batch that have a token to learn from (at least 1): a sequence-mean loss (gspo) divides by
    these, as OpenRLHF and `aggregate_loss`'s seq_mean do; a row whose action mask is empty (a filtered or zero-length
    response) is left out."""
    return float((action_mask.sum(-1) > 0).sum().clamp(min=1))


def train_on_experience(s: RLSetup, exp: Experience, step: int,
                        record: dict[str, Any] | None = None) -> dict[str, float]:
    """PPO epochs over the buffer in global mini-batches of --train_batch_size rows. `record` (--debug_dump_steps):
    the step's dump, to which each optimizer step's micro-batch tensors are added."""
    cfg = s.cfg
    rows = exp.batch_size
    sums: dict[str, float] = {}
    tokens_seen = 0.0
    updates = 0
    for epoch in range(cfg.max_epochs):
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 97 + epoch))
        for start in range(0, rows, cfg.train_batch_size):
            index = order[start:start + cfg.train_batch_size]
            if cfg.packing_samples:  # a prompt's samples on one rank, so its packed micro-batch computes it once
                index = index[torch.argsort(exp.prompt_index[index], stable=True)]
            mini = exp.select(index)
            num_tokens = float(mini.action_mask.sum().clamp(min=1))
            num_seqs = learning_rows(mini.action_mask)
            kl_coef = kl_coefficient(s)
            tensors = mini.tensors()
            tensors["row_index"] = index  # each row's place in `exp` (the dump's and the per-sample trace's rows)
            calls, roles = [], []  # critic and actor train side by side when they do not share bundles
            if s.critic is not None:
                calls.append((s.critic, partial(s.critic.scatter_async, ModelWorker.train_critic_step,
                                                _shards(tensors, s.critic), num_tokens,
                                                debug_dump=record is not None)))
                roles.append("critic")
            if step > cfg.freezing_actor_steps:
                calls.append((s.actor, partial(s.actor.scatter_async, ModelWorker.train_policy_step,
                                               _shards(tensors, s.actor), num_tokens,
                                               per_rank=s.ptx_per_rank(mini.batch_size),
                                               num_seqs=num_seqs, kl_coef=kl_coef,
                                               debug_dump=record is not None)))
                roles.append("actor")
                add_loss_weights(exp, index, mini.action_mask, num_tokens, num_seqs,
                                 cfg.policy_loss_type == "gspo")  # the per-sample trace's loss_weight
            for role, results in zip(roles, run_side_by_side(calls)):
                if record is not None:
                    add_updates(record, role, updates, epoch, num_tokens, [r.pop("debug") for r in results])
                take_trainer_mismatch(exp, results)
                _add(sums, results)
            tokens_seen += num_tokens
            updates += 1
    out = {}
    for key, value in sums.items():
        if key.startswith("rollout/"):  # measured by the training step (old log-probs from its own forward)
            out[key] = value if is_extremum(key) else value / tokens_seen
        elif is_extremum(key):
            out[f"train/{key}"] = value
        elif key in ("grad_norm", "lr", "critic_grad_norm", "critic_lr"):
            out[f"train/{key}"] = value / max(1, updates * (s.critic.world_size if "critic" in key and s.critic
                                                             else s.actor.world_size))
        else:
            out[f"train/{key}"] = value / tokens_seen
    return out


def kl_coefficient(s: RLSetup) -> float:
    """This step's KL coefficient: the adaptive controller's value (--kl_target), else --init_kl_coef."""
    kl_ctl = getattr(s, "kl_ctl", None)
    return s.plan.kl_coef(None if kl_ctl is None else kl_ctl.value)


def _shards(tensors: dict[str, torch.Tensor], group: ModelGroup) -> list[dict[str, torch.Tensor]]:
    """Each rank's rows of a mini-batch: split over the data-parallel ranks (a ring group's ranks share them)."""
    parts = group.rank_rows(next(iter(tensors.values())).shape[0])
    if any(not p for p in parts):
        raise ConfigError(f"a mini-batch has fewer rows than the {len(parts) // group.ring} data-parallel trainer "
                          "ranks: raise --train_batch_size")
    return [{k: v[torch.tensor(p)] for k, v in tensors.items()} for p in parts]


def _add(sums: dict[str, float], results: list[dict[str, float]]) -> None:
    for result in results:
        merge_metrics(sums, result)


def stage_utilisation(s: RLSetup, exp: Experience, timer: Timer) -> dict[str, float]:
    """perf/mfu_training and perf/mfu_log_probs (model FLOPs over the measured matmul ceiling of the precision in
    use, `rlhfkit.observability.mfu`) and perf/generation_tokens_per_s. The critic's FLOPs count where it works in
    the same stage; the reference's and critic's forwards in the log-prob stage."""
    cfg, flops, seconds = s.cfg, s.flops, timer.seconds
    tokens, logit_tokens = float(exp.attention_mask.sum()), float(exp.action_mask.shape[0] + exp.action_mask.sum())
    out = {"perf/generation_tokens_per_s": float(exp.action_mask.sum()) / max(seconds.get("generation", 0.0), 1e-9)}
    if flops is None:
        return out
    precision = s.plan.precision
    if precision is None:
        raise RuntimeError("stage_utilisation: the plan has no precision (build_setup's plan.on_cluster sets it)")
    ceiling = precision.ceiling_gflops()
    devices = s.actor.world_size if precision.device == "cuda" else cfg.actor_num_nodes
    policy_tokens = packed_tokens(exp) if cfg.packing_samples else tokens  # the critic's pass stays padded
    train = flops.training(policy_tokens, logit_tokens) + (flops.training(tokens, 0) if s.critic is not None else 0.0)
    policy_passes = (exp.old_log_probs is not None) + (s.ref is not None)  # actor (unless reused) and reference
    forward = flops.forward(policy_tokens, logit_tokens) * policy_passes + \
        flops.forward(tokens, 0) * (s.critic is not None)
    for stage, done in (("training", train * cfg.max_epochs), ("log_probs", forward)):
        value = mfu(done, seconds.get(stage, 0.0), ceiling, devices)
        if value is not None and value > 1.0 and precision.device == "cpu":
            _forget_a_wrong_ceiling(stage, value, ceiling)
            # no ceiling for the rest of this run: no MFU rather than a wrong one
            s.plan = dataclasses.replace(s.plan, precision=dataclasses.replace(
                cast(Any, precision), fp32_gflops=None, bf16_gflops=None))
            return out
        if value is not None and done > 0:
            out[f"perf/mfu_{stage}"] = value
    return out


def _forget_a_wrong_ceiling(stage: str, value: float, ceiling: float | None) -> None:
    """A stage computed faster than the CPU's measured matmul ceiling: the cached probe was read on a busy machine.
    Say so and delete it (the next run measures again); the caller reports no MFU from here on."""
    from rlhfkit.engine.precision import forget_cpu_rates

    path = forget_cpu_rates()
    log.warning("perf/mfu_%s would read %.0f%%: this stage ran faster than the matmul ceiling the precision probe "
                "measured (%s GFLOP/s), so that probe ran beside other work. MFU is not reported for the rest of "
                "this run; the cached probe %s, and the next run measures the ceiling again.", stage, 100 * value,
                ceiling, f"({path}) is deleted" if path is not None else "is already gone")


def packed_tokens(exp: Experience) -> float:
    """Tokens a --packing_samples pass computes: each prompt once, every response token. (A group that a mini-batch
    or micro-batch boundary splits computes its prompt once per part, so MFU from this count errs low.)"""
    prompt_width = exp.sequences.shape[1] - exp.action_mask.shape[1]
    prompt_lengths = exp.attention_mask[:, :prompt_width].sum(-1)
    first_of_prompt = {int(p): i for i, p in reversed(list(enumerate(exp.prompt_index.tolist())))}
    distinct = float(sum(int(prompt_lengths[i]) for i in first_of_prompt.values()))
    return distinct + float(exp.attention_mask[:, prompt_width:].sum())


def rollout_metrics(rollout: Rollout, exp: Experience) -> dict[str, float]:
    lengths = exp.response_length.float()
    rewards = rollout.rewards
    metrics = {"rollout/reward_mean": float(rewards.mean()),
               "rollout/reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
               "rollout/score_mean": float(rollout.scores.mean()),
               "rollout/response_length_mean": float(lengths.mean()),
               "rollout/response_length_max": float(lengths.max()),
               "rollout/truncated_frac": float(exp.info["truncated"].mean()),
               "rollout/reward_failed": float(rollout.reward_failed)}
    if any(x.action_mask is not None for x in rollout.samples):  # multi-turn agent episodes
        metrics["rollout/turns_mean"] = sum(x.extra["turns"] for x in rollout.samples) / len(rollout.samples)
        metrics["rollout/env_tokens_mean"] = sum(x.action_mask.count(False) for x in rollout.samples
                                                 if x.action_mask is not None) / len(rollout.samples)
    for key, value in rollout.extra_logs.items():
        if isinstance(value, torch.Tensor) and value.numel() and value.dtype.is_floating_point:
            metrics[f"reward/{key}"] = float(value.float().mean())
    metrics.update(failure_metrics(rollout.reward_failures))  # reward/failed_<reason>: samples scored 0 for it
    return metrics


def train_ppo(cfg: PPOConfig, engines: list[Any] | None = None,
              observer: StepObserver | None = None) -> dict[str, float]:
    """The run (`rlhfkit ppo`): the training loop, or with --eval_only one evaluation. Returns the last metrics.
    `observer` is told of the step's moments (rl/observer.py; none by default)."""
    s = build_setup(cfg, engines, None if cfg.eval_only else best_tracker(cfg))
    try:
        return evaluate_only(s) if cfg.eval_only else run_steps(s, observer or NullObserver())
    finally:
        s.close()


def evaluate_only(s: RLSetup) -> dict[str, float]:
    """--eval_only: the evaluation the run makes at step 0 (or, with --load_checkpoint, at the checkpoint's step),
    logged to metrics.jsonl and samples.jsonl at that step and printed; no training step, no checkpoint, no saved
    model."""
    run_dir = need(s.plan.run_dir, "--run_dir")
    print_derived_table("rlhfkit ppo --eval_only", {**s.summary, "run dir": run_dir, "evaluated step": s.start_step})
    metrics_log = MetricsLogger(run_dir, s.cfg)
    try:
        evaluated = EngineFaults(s).guard("evaluation", partial(evaluate, s, s.start_step))
        metrics_log.log(s.start_step, evaluated)
    finally:
        metrics_log.close()
    shown = ", ".join(f"{k} {v:.4f}" for k, v in evaluated.items())
    print(f"evaluation (step {s.start_step}, {len(s.eval_prompts)} prompts): {shown}")
    record_placement(run_dir, collect_whereabouts(s.groups, s.engines))
    config = {**config_to_dict(s.cfg), **s.plan.resolved_flags()}  # the flags as the run resolved them
    (Path(run_dir) / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return evaluated
