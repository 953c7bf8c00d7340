"""The online loop (`rlhfkit ppo`): read it top to bottom.

    set-up: Ray -> tokenizer, prompts -> model groups (actor, ref, critic, reward) -> rollout engines -> rewards
    each step: generate + score (+ dynamic filtering) -> log-probs, KL, advantages -> train critic/actor
               -> sync weights to the engines -> log metrics and samples -> eval (-> best model) -> checkpoint
    --rollout_dump_dir writes each step's rollout; --rollout_replay_dir reads it instead of generating (no engines,
    no sync, no eval: rl/rollout_dump.py); --eval_only makes the evaluation alone (`evaluate_only`)
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.parse import config_to_dict
from rlhfkit.config.validate import need
from rlhfkit.engine.best import BestTracker, check_key, tracker_for
from rlhfkit.errors import ConfigError
from rlhfkit.launch.engine_spec import sampling_config
from rlhfkit.observability.console import print_derived_table, progress_bar
from rlhfkit.observability.metrics import MetricsLogger, is_extremum, merge_metrics
from rlhfkit.observability.mfu import mfu
from rlhfkit.observability.placement import record_placement
from rlhfkit.observability.trace import add_loss_weights, take_trainer_mismatch, write_step_trace
from rlhfkit.rewards.base import failure_metrics
from rlhfkit.rl.async_rollout import (
    EngineGate,
    RolloutQueue,
    load_pending,
    save_pending,
    staleness_metrics,
    stamp_versions,
)
from rlhfkit.rl.debug_dump import add_updates, step_record, wants_dump, write_dump
from rlhfkit.rl.engine_faults import EngineFaults
from rlhfkit.rl.experience import Experience
from rlhfkit.rl.group import ModelGroup, run_side_by_side
from rlhfkit.rl.make_experience import (
    PromptStream,
    Rollout,
    Timer,
    apply_length_penalties,
    fill_log_probs_and_advantages,
    filled,
    generate_and_score,
    keep_groups,
    merge_rollouts,
    select_groups,
    to_experience,
)
from rlhfkit.rl.placement import collect_whereabouts
from rlhfkit.rl.rollout_dump import RolloutReplay
from rlhfkit.rl.setup import RLSetup, build_setup, push_actor_weights, save_final
from rlhfkit.rl.vision_batch import attach_pixels
from rlhfkit.rollout.types import SamplingConfig

log = logging.getLogger("rlhfkit")
MAX_REFILL_ROUNDS = 8
FAULT_HOOK: Any = None  # tests only: FAULT_HOOK(s, step, when) before / after each step's health check (faults)


def collect_rollout(s: RLSetup, stream: PromptStream, sampling: SamplingConfig, timer: Timer,
                    generate: Any = None) -> tuple[Rollout, dict]:
    """rollout_batch_size groups; with --dynamic_filtering, drop all-equal groups and refill (bounded)."""
    cfg, n = s.cfg, s.cfg.n_samples_per_prompt
    kept: list[Rollout] = []
    have, rounds, seen = 0, 0, 0
    while have < cfg.rollout_batch_size:
        offset = stream.cursor
        prompts = stream.take(cfg.rollout_batch_size - have if rounds else cfg.rollout_batch_size)
        part = generate_and_score(s.engines, prompts, sampling, s.reward_fn, s.tokenizer, timer, offset, s.phases,
                                  s.agent, generate)
        seen += len(prompts)
        if cfg.dynamic_filtering:
            low, high = cfg.dynamic_filtering_reward_range
            part = select_groups(part, keep_groups(part.scores, n, low, high), n)
        kept.append(part)
        have += len(part.prompts)
        rounds += 1
        if not cfg.dynamic_filtering or rounds > MAX_REFILL_ROUNDS:
            break
    rollout = merge_rollouts(kept)
    return rollout, {"filter/kept_groups": len(rollout.prompts), "filter/sampled_groups": seen,
                     "filter/rounds": rounds}


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
            if record is not None:  # the workers see it and send their tensors back
                tensors["row_index"] = index
            tensors["trace_row"] = index  # the per-sample trace's mismatch, where the training forward gives it
            calls, roles = [], []  # critic and actor train side by side when they do not share bundles
            if s.critic is not None:
                calls.append((s.critic, partial(s.critic.scatter_async, "train_critic_step",
                                                _shards(tensors, s.critic), num_tokens)))
                roles.append("critic")
            if step > cfg.freezing_actor_steps:
                calls.append((s.actor, partial(s.actor.scatter_async, "train_policy_step",
                                               _shards(tensors, s.actor), num_tokens,
                                               per_rank=s.ptx_per_rank(mini.batch_size),
                                               num_seqs=num_seqs, kl_coef=kl_coef)))
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


def sync_engines(s: RLSetup, timer: Timer) -> dict[str, float]:
    began = time.perf_counter()
    if s.phases is not None:
        s.phases.wake_engines()
    stats = push_actor_weights(s.actor, s.engines, s.cfg, s.plan)
    timer.add("weight_sync", began)
    began = time.perf_counter()
    checked = s.sync_check.check(s.actor, s.engines, "weight sync") if s.sync_check is not None else {}
    timer.add("sync_check", began)
    return {"sync/bytes": stats.bytes, "sync/buckets": stats.buckets, **checked}


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
        if value is not None and done > 0:
            out[f"perf/mfu_{stage}"] = value
    return out


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


def pass_at_k(correct: int, n: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n - c, k) / C(n, k)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def evaluate(s: RLSetup, step: int) -> dict[str, float]:
    """Held-out prompts at --eval_temperature, --eval_n_samples_per_prompt each; a sample is correct if score > 0."""
    cfg, n = s.cfg, s.cfg.eval_n_samples_per_prompt
    sampling = SamplingConfig(temperature=cfg.eval_temperature, top_p=1.0, max_new_tokens=cfg.generate_max_len, n=n,
                              seed=cfg.seed + 99991, stop_token_ids=tuple(s.stop_ids), max_len=cfg.max_len or None)
    rollout = generate_and_score(s.engines, s.eval_prompts, sampling, s.reward_fn, s.tokenizer, Timer(), 0,
                                 s.phases, s.agent)
    correct = (rollout.scores.view(-1, n) > 0).sum(-1).tolist()
    out = {"eval/reward_mean": float(rollout.rewards.mean()), "eval/score_mean": float(rollout.scores.mean())}
    for k in sorted({1, n}):
        out[f"eval/pass@{k}"] = sum(pass_at_k(c, n, k) for c in correct) / len(correct)
    _write_samples(s, step, rollout, "eval", limit=16)  # the same 16 held-out prompts at every evaluation
    return out


def _write_samples(s: RLSetup, step: int, rollout: Rollout, kind: str, limit: int = 6) -> None:
    """The first sample of each of the first `limit` prompts, to samples.jsonl (for the report)."""
    rows = [i for i, sample in enumerate(rollout.samples) if sample.sample_index == 0][:limit]
    with (Path(need(s.plan.run_dir, "--run_dir")) / "samples.jsonl").open("a") as f:
        for i in rows:
            prompt = rollout.prompts[rollout.samples[i].prompt_index]
            failure = rollout.reward_failure[i] if rollout.reward_failure else ""
            f.write(json.dumps({"step": step, "kind": kind, "prompt": prompt["prompt"], "response": rollout.texts[i],
                                "reward": float(rollout.rewards[i]), "label": prompt.get("label"),
                                "reward_failure": failure or None}) + "\n")


def eval_metric_keys(cfg: PPOConfig) -> list[str]:
    """The metrics `evaluate` returns (known before the run: --best_metric_key is checked against them)."""
    ks = sorted({1, cfg.eval_n_samples_per_prompt})
    return ["eval/reward_mean", "eval/score_mean", *(f"eval/pass@{k}" for k in ks)]


def best_tracker(cfg: PPOConfig) -> BestTracker | None:
    """--best_metric_key: its tracker (default key eval/pass@1), refused before anything starts when it names no
    metric of `evaluate` or there is no --eval_dataset."""
    best = tracker_for(cfg, "eval/pass@1", bool(cfg.eval_dataset))
    if best is not None:
        check_key(best.key, eval_metric_keys(cfg))
    return best


def keep_best(s: RLSetup, step: int, eval_metrics: dict[str, float]) -> None:
    """A new best evaluation: the actor's HF folder (the EMA with --enable_ema) replaces <ckpt_path>/best."""
    if s.best is None or not s.best.improves(step, eval_metrics):
        return
    shutil.rmtree(s.best.staging, ignore_errors=True)
    s.actor.call("save_hf", str(s.best.staging), s.plan.model_path)
    s.best.commit()


def train_ppo(cfg: PPOConfig, engines: list[Any] | None = None) -> dict[str, float]:
    """The run (`rlhfkit ppo`): the training loop, or with --eval_only one evaluation. Returns the last metrics."""
    s = build_setup(cfg, engines, None if cfg.eval_only else best_tracker(cfg))
    try:
        return evaluate_only(s) if cfg.eval_only else _loop(s)
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


def _loop(s: RLSetup) -> dict[str, float]:
    """One step: rollout -> experience -> train -> sync -> log/checkpoint/eval. With --async_train the rollouts of
    steps t+1 .. t+N (--async_queue_size) are generated while step t trains (`rl.async_rollout.RolloutQueue`)."""
    cfg = s.cfg
    run_dir = need(s.plan.run_dir, "--run_dir")  # resolved by build_setup (the plan)
    replay = s.rollout_replay  # --rollout_replay_dir: no engines (no health check, sync or evaluation)
    evaluating = bool(s.eval_prompts) and replay is None
    if s.eval_prompts and replay is not None:
        log.warning("--rollout_replay_dir: no rollout engines, so --eval_dataset is not evaluated")
    stream = PromptStream(s.prompts, cfg.seed, s.start_cursor)
    sampling = sampling_config(cfg, cfg.seed, stop_token_ids=s.stop_ids)
    print_derived_table("rlhfkit ppo", {**s.summary, "run dir": run_dir})
    metrics_log = MetricsLogger(run_dir, cfg)
    bar = progress_bar(s.total_steps, s.start_step, True, "ppo")
    last: dict[str, float] = {}
    faults = EngineFaults(s)  # a dead or hung engine is restarted (--max_engine_restarts), see rl/engine_faults.py
    gate = EngineGate(s.start_step)  # the engines' policy version; a partial rollout's chunk holds its lock
    generate = gate.chunked(cfg.partial_rollout_chunk_tokens) if cfg.async_train and cfg.partial_rollout else None
    collect = partial(_collect_versioned, s, stream, sampling, gate, generate)
    if evaluating and s.start_step == 0:
        evaluated = faults.guard("evaluation", partial(evaluate, s, 0))
        metrics_log.log(0, evaluated)
        keep_best(s, 0, evaluated)
    queue = RolloutQueue(cfg, stream, gate, collect, s.total_steps, load_pending(cfg, s.start_step) if s.start_step
                         else None, s.start_step + 1) if cfg.async_train and replay is None else None
    for step in range(s.start_step + 1, s.total_steps + 1):
        began = time.perf_counter()
        faults.step = step
        if replay is None:
            with gate.lock:  # with --partial_rollout: between two chunks
                _health_check(s, step, faults)
        ahead, waited = queue.take(step, faults) if queue is not None else (None, 0.0)
        if replay is not None:
            rollout, filter_metrics, timer = _replayed(replay, step, stream)
        else:
            rollout, filter_metrics, timer = ahead or collect(faults)
        if s.rollout_dump is not None:  # before the length penalties change the rewards in place
            s.rollout_dump.write(step, rollout, filter_metrics, stream.cursor, timer.seconds)
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
        record = step_record(cfg, step, {**exp.tensors(), "rewards_before_penalty": raw_rewards,
                                         "truncated": exp.info["truncated"]},
                             s.plan.resolved_flags()) if wants_dump(cfg, step) else None
        if queue is not None:  # the engines still hold the weights this step trains from
            queue.fill(step)  # no restarts in the generation thread: a fault is handled when its rollout is taken
        t_train = time.perf_counter()
        metrics.update(train_on_experience(s, exp, step, record))
        timer.add("training", t_train)
        write_step_trace(s, step, rollout, exp)  # samples.jsonl: every sample of the step
        if getattr(s, "kl_ctl", None) is not None and "rollout/kl" in metrics:  # adaptive KL: the next coefficient
            s.kl_ctl.update(metrics["rollout/kl"], cfg.rollout_batch_size * cfg.n_samples_per_prompt)
        if record is not None:
            write_dump(run_dir, record)
        if queue is not None and queue.items:
            metrics["time/wait_rollout"] = waited + queue.before_sync(faults)
        if replay is None:
            with gate.lock:  # with --partial_rollout the generation in flight pauses here, and resumes with the new
                metrics.update(faults.guard("weight sync", partial(sync_engines, s, timer)))  # weights
                gate.version = step
        metrics.update({f"time/{k}": v for k, v in timer.seconds.items()})
        metrics.update(stage_utilisation(s, exp, timer))
        metrics["time/step"] = time.perf_counter() - began
        if evaluating and ((cfg.eval_steps > 0 and step % cfg.eval_steps == 0) or step == s.total_steps):
            with gate.lock:
                evaluated = faults.guard("evaluation", partial(evaluate, s, step))
            metrics.update(evaluated)
            keep_best(s, step, evaluated)
        if cfg.save_steps > 0 and step % cfg.save_steps == 0:  # after the evaluation: it holds the best so far
            _checkpoint(s, step, stream, queue, faults)
        metrics.update(faults.take_step_metrics())
        metrics_log.log(step, metrics)
        last = metrics
        bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}",
                        gen_s=f"{timer.seconds.get('generation', 0.0):.1f}")
        bar.update(1)
    if queue is not None:
        queue.close()
    bar.close()
    record_placement(run_dir, collect_whereabouts(s.groups, s.engines))  # now with prompts per engine
    save_final(s)
    metrics_log.close()
    resolved = {**config_to_dict(cfg), **s.plan.resolved_flags()}  # the flags as the run resolved them
    (Path(run_dir) / "config.json").write_text(json.dumps(resolved, indent=2, default=str))
    return last


def _health_check(s: RLSetup, step: int, faults: EngineFaults) -> None:
    """Ping: a dead or hung engine is found (and restarted) now, not mid-generation."""
    if FAULT_HOOK is not None:
        FAULT_HOOK(s, step, "before health check")
    faults.health_check()
    if FAULT_HOOK is not None:
        FAULT_HOOK(s, step, "after health check")


def _replayed(replay: RolloutReplay, step: int, stream: PromptStream) -> tuple[Rollout, dict, Timer]:
    """--rollout_replay_dir: step `step`'s dumped rollout, the prompt stream moved to where the original's was
    (checkpoints of the replay resume from the right prompt), and a Timer holding the read's seconds (replay_load)."""
    began = time.perf_counter()
    rollout, filter_metrics, cursor = replay.read(step)
    stream.cursor = cursor
    timer = Timer()
    timer.add("replay_load", began)
    return rollout, filter_metrics, timer


def _checkpoint(s: RLSetup, step: int, stream: PromptStream, queue: RolloutQueue | None,
                faults: EngineFaults) -> None:
    """The checkpoint of `step`; with --async_train the rollouts generated ahead are finished first and kept."""
    if queue is not None and queue.items:
        waited = queue.settle(faults)
        if s.cfg.partial_rollout:
            log.info("--partial_rollout: step %d's checkpoint waited %.1f s for the %d rollout(s) in flight to finish "
                     "(their last chunks with the weights of step %d); they are saved with it, not regenerated",
                     step, waited, len(queue.items), step)
    s.save_checkpoint(step, stream.cursor)
    if queue is not None and queue.items:
        save_pending(s.cfg, step, queue.finished())


def _collect_versioned(s: RLSetup, stream: PromptStream, sampling: SamplingConfig, gate: EngineGate,
                       generate: Any, faults: EngineFaults | None = None) -> tuple[Rollout, dict, Timer]:
    """`collect_timed`, each sample's tokens stamped with the policy version they were generated with (chunked
    generation stamps each chunk itself; otherwise the engines hold one version for the whole rollout)."""
    version = gate.version
    collected = collect_timed(s, stream, sampling, faults, generate)
    stamp_versions(collected[0], version)
    return collected


def collect_timed(s: RLSetup, stream: PromptStream, sampling: SamplingConfig,
                  faults: EngineFaults | None = None, generate: Any = None) -> tuple[Rollout, dict, Timer]:
    """`collect_rollout` with its own Timer (generation and reward seconds), which becomes the step's timer. With
    `faults`, an engine fault restarts the engine and the rollout is collected again from the same prompts (same
    seeds: the same samples). `generate`: see `generate_and_score` (--partial_rollout)."""
    cursor = stream.cursor

    def attempt() -> tuple[Rollout, dict, Timer]:
        stream.cursor = cursor
        timer = Timer()
        rollout, metrics = collect_rollout(s, stream, sampling, timer, generate)
        return rollout, metrics, timer

    return attempt() if faults is None else faults.guard("generation", attempt)
