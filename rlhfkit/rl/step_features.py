"""The features of the online step, each built once before the loop (`build_features`) and called by every step
(`ppo_trainer.train_step`); where a feature is off, its null object does nothing.

    engines      LiveEngines: health check before the rollout, weight sync after training, engine restarts on a
                 fault (--max_engine_restarts, rl/engine_faults.py); NoEngines with --rollout_replay_dir
    source       where the rollout comes from (rl/rollout_source.py): generated, generated ahead, replayed
    evaluation   --eval_dataset (+ --best_metric_key): Evaluation at step 0, every --eval_steps and the last step
    checkpoints  --save_steps: Checkpoints (after the evaluation: the best so far is part of the state)
    rollout_dump --rollout_dump_dir: each step's rollout, as collected (rl/rollout_dump.py)
    debug_dump   --debug_dump_steps: the tensors of chosen steps (rl/debug_dump.py)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from rlhfkit.config.validate import need
from rlhfkit.observability.metrics import MetricsLogger
from rlhfkit.rl.async_rollout import EngineGate
from rlhfkit.rl.debug_dump import step_record, wants_dump, write_dump
from rlhfkit.rl.engine_faults import EngineFaults
from rlhfkit.rl.evaluation import evaluate, keep_best
from rlhfkit.rl.experience import Experience
from rlhfkit.rl.make_experience import PromptStream, Rollout, Timer
from rlhfkit.rl.observer import StepObserver
from rlhfkit.rl.rollout_dump import RolloutDump
from rlhfkit.rl.rollout_source import RolloutSource, rollout_source
from rlhfkit.rl.setup import RLSetup, push_actor_weights

log = logging.getLogger("rlhfkit")


@contextmanager
def timed(timer: Timer, phase: str) -> Iterator[None]:
    """The seconds of the block, added to `timer` under `phase` (time/<phase> in the step's metrics)."""
    began = time.perf_counter()
    yield
    timer.add(phase, began)


# ------------------------------------------------------------------ engines: health check, weight sync, faults
class Engines(Protocol):
    def health_check(self, step: int) -> None: ...
    def sync(self, step: int, timer: Timer) -> dict[str, float]: ...
    def fault_metrics(self) -> dict[str, float]: ...


def sync_engines(s: RLSetup, timer: Timer) -> dict[str, float]:
    """The actor's weights into the engines (woken first where they sleep), then --sync_check's comparison."""
    with timed(timer, "weight_sync"):
        if s.phases is not None:
            s.phases.wake_engines()
        stats = push_actor_weights(s.actor, s.engines, s.cfg, s.plan)
    with timed(timer, "sync_check"):
        checked = s.sync_check.check(s.actor, s.engines, "weight sync") if s.sync_check is not None else {}
    return {"sync/bytes": stats.bytes, "sync/buckets": stats.buckets, **checked}


class LiveEngines:
    """The rollout engines of the run. Each piece of engine work is guarded (`EngineFaults`: a dead or hung engine
    is restarted and the work redone) and holds the gate's lock (with --partial_rollout: between two chunks)."""

    def __init__(self, s: RLSetup, faults: EngineFaults, gate: EngineGate, observer: StepObserver) -> None:
        self.s, self.faults, self.gate, self.observer = s, faults, gate, observer

    def health_check(self, step: int) -> None:
        """Ping: a dead or hung engine is found (and restarted) now, not mid-generation."""
        self.faults.step = step
        with self.gate.lock:
            self.observer.before_health_check(self.s, step)
            self.faults.health_check()
            self.observer.after_health_check(self.s, step)

    def sync(self, step: int, timer: Timer) -> dict[str, float]:
        """The weights of `step` into the engines; a partial rollout in flight resumes with them."""
        with self.gate.lock:
            metrics = self.faults.guard("weight sync", partial(sync_engines, self.s, timer))
            self.gate.version = step
        return metrics

    def fault_metrics(self) -> dict[str, float]:
        return self.faults.take_step_metrics()


class NoEngines(LiveEngines):
    """--rollout_replay_dir: no engines to check or sync (the fault counters still report 0 restarts)."""

    def health_check(self, step: int) -> None:
        self.faults.step = step

    def sync(self, step: int, timer: Timer) -> dict[str, float]:
        return {}


# ------------------------------------------------------------------ evaluation and the best model
class Evaluation:
    """--eval_dataset: `evaluate` at step 0 (a fresh run), every --eval_steps and at the last step; each result may
    replace the best model (--best_metric_key, `keep_best`)."""

    def __init__(self, s: RLSetup, faults: EngineFaults, gate: EngineGate) -> None:
        self.s, self.faults, self.gate = s, faults, gate

    def at_start(self, metrics_log: MetricsLogger) -> None:
        if self.s.start_step == 0:
            evaluated = self.faults.guard("evaluation", partial(evaluate, self.s, 0))
            metrics_log.log(0, evaluated)
            keep_best(self.s, 0, evaluated)

    def after_step(self, step: int) -> dict[str, float]:
        cfg = self.s.cfg
        if not ((cfg.eval_steps > 0 and step % cfg.eval_steps == 0) or step == self.s.total_steps):
            return {}
        with self.gate.lock:
            evaluated = self.faults.guard("evaluation", partial(evaluate, self.s, step))
        keep_best(self.s, step, evaluated)
        return evaluated


class NoEvaluation:
    def at_start(self, metrics_log: MetricsLogger) -> None:
        pass

    def after_step(self, step: int) -> dict[str, float]:
        return {}


# ------------------------------------------------------------------ checkpoints
class Checkpoints:
    """--save_steps: the checkpoint of every save step; what the source generated ahead is finished and kept."""

    def __init__(self, s: RLSetup, stream: PromptStream, source: RolloutSource) -> None:
        self.s, self.stream, self.source = s, stream, source

    def after_step(self, step: int) -> None:
        if step % self.s.cfg.save_steps:
            return
        self.source.finish_in_flight(step)
        self.s.save_checkpoint(step, self.stream.cursor)
        self.source.save_in_flight(step)


class NoCheckpoints:
    def after_step(self, step: int) -> None:
        pass


# ------------------------------------------------------------------ dumps
class RolloutDumping:
    """--rollout_dump_dir: each step's rollout as collected (before the length penalties change its rewards)."""

    def __init__(self, dump: RolloutDump, stream: PromptStream) -> None:
        self.dump, self.stream = dump, stream

    def write(self, step: int, rollout: Rollout, filter_metrics: dict[str, float], timer: Timer) -> None:
        self.dump.write(step, rollout, filter_metrics, self.stream.cursor, timer.seconds)


class NoRolloutDump:
    def write(self, step: int, rollout: Rollout, filter_metrics: dict[str, float], timer: Timer) -> None:
        pass


class DebugDumping:
    """--debug_dump_steps: a chosen step's experience and, from the trainers, each optimizer step's micro-batches."""

    def __init__(self, s: RLSetup) -> None:
        self.cfg, self.plan, self.run_dir = s.cfg, s.plan, need(s.plan.run_dir, "--run_dir")

    def begin(self, step: int, exp: Experience, raw_rewards: Any) -> dict[str, Any] | None:
        """The step's record (None when `step` is not dumped): `train_on_experience` adds the updates to it."""
        if not wants_dump(self.cfg, step):
            return None
        return step_record(self.cfg, step, {**exp.tensors(), "rewards_before_penalty": raw_rewards,
                                            "truncated": exp.info["truncated"]}, self.plan.resolved_flags())

    def write(self, record: dict[str, Any] | None) -> None:
        if record is not None:
            write_dump(self.run_dir, record)


class NoDebugDump:
    def begin(self, step: int, exp: Experience, raw_rewards: Any) -> dict[str, Any] | None:
        return None

    def write(self, record: dict[str, Any] | None) -> None:
        pass


# ------------------------------------------------------------------ all of them
@dataclass
class StepFeatures:
    stream: PromptStream
    source: RolloutSource
    engines: Engines
    evaluation: Evaluation | NoEvaluation
    checkpoints: Checkpoints | NoCheckpoints
    rollout_dump: RolloutDumping | NoRolloutDump
    debug_dump: DebugDumping | NoDebugDump


def build_features(s: RLSetup, observer: StepObserver) -> StepFeatures:
    """Each feature of the step, or its null object, from the run's set-up and flags."""
    cfg, replay = s.cfg, s.rollout_replay is not None  # a replay has no engines: no health check, sync or evaluation
    if s.eval_prompts and replay:
        log.warning("--rollout_replay_dir: no rollout engines, so --eval_dataset is not evaluated")
    stream = PromptStream(s.prompts, cfg.seed, s.start_cursor)
    faults = EngineFaults(s)  # a dead or hung engine is restarted (--max_engine_restarts), see rl/engine_faults.py
    gate = EngineGate(s.start_step, observer)  # the engines' policy version; a partial rollout's chunk holds its lock
    source = rollout_source(s, stream, gate, faults)
    return StepFeatures(
        stream=stream, source=source,
        engines=NoEngines(s, faults, gate, observer) if replay else LiveEngines(s, faults, gate, observer),
        evaluation=Evaluation(s, faults, gate) if s.eval_prompts and not replay else NoEvaluation(),
        checkpoints=Checkpoints(s, stream, source) if cfg.save_steps > 0 else NoCheckpoints(),
        rollout_dump=RolloutDumping(s.rollout_dump, stream) if s.rollout_dump is not None else NoRolloutDump(),
        debug_dump=DebugDumping(s) if cfg.debug_dump_steps else NoDebugDump())
