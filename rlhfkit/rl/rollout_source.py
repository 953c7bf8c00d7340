"""Where a step's rollout comes from, behind one interface (`RolloutSource`), chosen once before the loop:

    Collection        generated now, for this step (the default)
    AheadCollection   --async_train: generated ahead by a thread while the previous steps train (rl/async_rollout.py)
    Replay            --rollout_replay_dir: read from a --rollout_dump_dir of an earlier run (rl/rollout_dump.py)

A collected rollout is `collect_rollout`'s: --rollout_batch_size prompt groups, with --dynamic_filtering refilled
after the all-equal groups are dropped; `collect_timed` gives it its own Timer and redoes it after an engine fault.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from rlhfkit.launch.engine_spec import sampling_config
from rlhfkit.rl.async_rollout import Collected, EngineGate, RolloutQueue, load_pending, save_pending, stamp_versions
from rlhfkit.rl.engine_faults import EngineFaults
from rlhfkit.rl.make_experience import (
    PromptStream,
    Rollout,
    Timer,
    generate_and_score,
    keep_groups,
    merge_rollouts,
    select_groups,
)
from rlhfkit.rl.rollout_dump import RolloutReplay
from rlhfkit.rl.setup import RLSetup
from rlhfkit.rollout.types import SamplingConfig

log = logging.getLogger("rlhfkit")
MAX_REFILL_ROUNDS = 8


class RolloutSource(Protocol):
    """A step's rollout, and what a source must do around the step's training, weight sync and checkpoint."""

    def take(self, step: int) -> Collected:
        """(Rollout, filter metrics, Timer) of `step`; the Timer becomes the step's."""

    def before_train(self, step: int) -> None:
        """The step's experience is made: the engines are free until the weight sync."""

    def before_sync(self) -> dict[str, float]:
        """The weights are about to be pushed to the engines; the metrics of the wait, if any."""

    def finish_in_flight(self, step: int) -> None:
        """The checkpoint of `step` is next: finish what is being generated."""

    def save_in_flight(self, step: int) -> None:
        """The checkpoint of `step` is written: keep what was generated for the coming steps beside it."""

    def close(self) -> None:
        """The run is over (or failed)."""


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


def collect_timed(s: RLSetup, stream: PromptStream, sampling: SamplingConfig,
                  faults: EngineFaults | None = None, generate: Any = None) -> Collected:
    """`collect_rollout` with its own Timer (generation and reward seconds), which becomes the step's timer. With
    `faults`, an engine fault restarts the engine and the rollout is collected again from the same prompts (same
    seeds: the same samples). `generate`: see `generate_and_score` (--partial_rollout)."""
    cursor = stream.cursor

    def attempt() -> Collected:
        stream.cursor = cursor
        timer = Timer()
        rollout, metrics = collect_rollout(s, stream, sampling, timer, generate)
        return rollout, metrics, timer

    return attempt() if faults is None else faults.guard("generation", attempt)


def collect_versioned(s: RLSetup, stream: PromptStream, sampling: SamplingConfig, gate: EngineGate,
                      generate: Any, faults: EngineFaults | None = None) -> Collected:
    """`collect_timed`, each sample's tokens stamped with the policy version they were generated with (chunked
    generation stamps each chunk itself; otherwise the engines hold one version for the whole rollout)."""
    version = gate.version
    collected = collect_timed(s, stream, sampling, faults, generate)
    stamp_versions(collected[0], version)
    return collected


class NothingInFlight:
    """A source that holds no rollout between steps: nothing to wait for or to keep."""

    def before_train(self, step: int) -> None:
        pass

    def before_sync(self) -> dict[str, float]:
        return {}

    def finish_in_flight(self, step: int) -> None:
        pass

    def save_in_flight(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class Collection(NothingInFlight):
    """Each step's rollout generated when the step asks for it."""

    def __init__(self, collect: Callable[[EngineFaults | None], Collected], faults: EngineFaults) -> None:
        self.collect, self.faults = collect, faults

    def take(self, step: int) -> Collected:
        return self.collect(self.faults)


class AheadCollection:
    """--async_train: the rollouts of steps t+1 .. t+N (--async_queue_size) are generated while step t trains
    (`RolloutQueue`); a resumed run first trains on the ones its checkpoint kept."""

    def __init__(self, s: RLSetup, stream: PromptStream, gate: EngineGate,
                 collect: Callable[[EngineFaults | None], Collected], faults: EngineFaults) -> None:
        self.cfg, self.collect, self.faults = s.cfg, collect, faults
        pending = load_pending(s.cfg, s.start_step) if s.start_step else None
        self.queue = RolloutQueue(s.cfg, stream, gate, collect, s.total_steps, pending, s.start_step + 1)
        self.waited = 0.0

    def take(self, step: int) -> Collected:
        ahead, self.waited = self.queue.take(step, self.faults)
        return ahead or self.collect(self.faults)

    def before_train(self, step: int) -> None:
        self.queue.fill(step)  # no restarts in the generation thread: a fault is handled when its rollout is taken

    def before_sync(self) -> dict[str, float]:
        if not self.queue.items:
            return {}
        return {"time/wait_rollout": self.waited + self.queue.before_sync(self.faults)}

    def finish_in_flight(self, step: int) -> None:
        if not self.queue.items:
            return
        waited = self.queue.settle(self.faults)
        if self.cfg.partial_rollout:
            log.info("--partial_rollout: step %d's checkpoint waited %.1f s for the %d rollout(s) in flight to finish "
                     "(their last chunks with the weights of step %d); they are saved with it, not regenerated",
                     step, waited, len(self.queue.items), step)

    def save_in_flight(self, step: int) -> None:
        if self.queue.items:
            save_pending(self.cfg, step, self.queue.finished())

    def close(self) -> None:
        self.queue.close()


class Replay(NothingInFlight):
    """--rollout_replay_dir: step t's dumped rollout, the prompt stream moved to where the original's was
    (checkpoints of the replay resume from the right prompt), and a Timer holding the read's seconds (replay_load)."""

    def __init__(self, replay: RolloutReplay, stream: PromptStream) -> None:
        self.replay, self.stream = replay, stream

    def take(self, step: int) -> Collected:
        began = time.perf_counter()
        rollout, filter_metrics, cursor = self.replay.read(step)
        self.stream.cursor = cursor
        timer = Timer()
        timer.add("replay_load", began)
        return rollout, filter_metrics, timer


def rollout_source(s: RLSetup, stream: PromptStream, gate: EngineGate, faults: EngineFaults) -> RolloutSource:
    """The run's source: a replay, rollouts generated ahead (--async_train), or generated step by step."""
    if s.rollout_replay is not None:
        return Replay(s.rollout_replay, stream)
    cfg = s.cfg
    sampling = sampling_config(cfg, cfg.seed, stop_token_ids=s.stop_ids)
    generate = gate.chunked(cfg.partial_rollout_chunk_tokens) if cfg.async_train and cfg.partial_rollout else None
    collect = partial(collect_versioned, s, stream, sampling, gate, generate)
    return AheadCollection(s, stream, gate, collect, faults) if cfg.async_train else Collection(collect, faults)
