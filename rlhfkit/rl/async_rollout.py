"""`--async_train`: rollouts generated ahead of training (`--async_queue_size N`) and partial rollouts.

Policy version v: the actor's weights after v optimizer steps (0: the initial weights). The trainer of step t holds
version t - 1; a sample whose tokens were generated with versions v_min..v_max is `t - 1 - v_min` steps stale.

The queue: before step t trains, the rollouts of steps t+1 .. t+N are submitted (in order) to one generation
thread; step t+1 takes the first. Without --partial_rollout a weight sync needs idle engines, so step t waits for
every rollout in flight before it syncs: the rollout of step t+N is generated with version t-1 and trained with
version t+N-1, staleness exactly N (at most N in the first steps); N = 1 is the one-step pipeline. With
--partial_rollout the engines generate in chunks (`rlhfkit.rollout.partial`) and the sync waits only for the
current chunk (`EngineGate`): the rollout in flight resumes with the new weights, its tokens carry mixed versions,
and its first token is still at most N versions old (it was submitted while the trainer held version t-1).

Checkpoints keep what is in flight: at a save step the loop waits for the queued rollouts to finish (with
--partial_rollout their remaining chunks use the just-synced weights) and saves them beside the checkpoint; a
resumed run trains on them first, with the versions they recorded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlhfkit.config.commands import PPOConfig
from rlhfkit.engine.safe_state import load_state, save_state
from rlhfkit.rl.engine_faults import EngineFaults, engine_fault
from rlhfkit.rl.make_experience import register_rollout_types
from rlhfkit.rl.observer import NullObserver, StepObserver
from rlhfkit.rollout.partial import VERSIONS_KEY, generate_in_chunks
from rlhfkit.rollout.types import RolloutSample, SamplingConfig

log = logging.getLogger("rlhfkit")
Collected = tuple[Any, dict, Any]  # (Rollout, filter metrics, Timer): what rollout_source.collect_timed returns


class EngineGate:
    """The policy version the engines hold, and a lock that a partial rollout's chunk holds while it generates: a
    weight sync (or an evaluation, or a health check) holds it too, so it happens between two chunks. `observer` is
    told before each chunk takes the lock (`StepObserver.before_chunk`)."""

    def __init__(self, version: int, observer: StepObserver | None = None) -> None:
        self.version = version
        self.lock = threading.Lock()
        self.observer: StepObserver = observer or NullObserver()

    @contextmanager
    def hold(self, chunk: int = 0) -> Iterator[int]:
        self.observer.before_chunk(self, chunk)
        with self.lock:
            yield self.version

    def chunked(self, chunk_tokens: int) -> Callable[..., list[RolloutSample]]:
        """A `generate` for `generate_and_score`: chunks of `chunk_tokens`, each at the version of its moment."""
        return partial(_chunked, chunk_tokens=chunk_tokens, hold=self.hold)


def _chunked(engines: Any, prompt_ids: list[list[int]], sampling: SamplingConfig, *, chunk_tokens: int,
             hold: Callable) -> list[RolloutSample]:
    return generate_in_chunks(engines, prompt_ids, sampling, chunk_tokens, hold)


def stamp_versions(rollout: Any, version: int) -> None:
    """Samples generated in one piece (no --partial_rollout) get `version` for every response token."""
    for sample in rollout.samples:
        sample.extra.setdefault(VERSIONS_KEY, [version] * len(sample.response_ids))


def sample_versions(sample: RolloutSample, default: int) -> list[int]:
    """The policy version of each response token (`default` where none was recorded; at least one entry)."""
    return list(sample.extra.get(VERSIONS_KEY) or [default])


def staleness_metrics(rollout: Any, exp: Any, step: int, bound: int | None) -> dict[str, float]:
    """async/staleness_{max,mean} (trainer version step - 1 minus each sample's oldest token version),
    async/policy_version_{min,max} and async/mixed_version_frac (samples whose tokens span several versions);
    [B] `policy_version_min`/`policy_version_max` go to `exp.info`. Staleness above `bound` is a bug: raised."""
    lows = torch.tensor([min(sample_versions(x, step - 1)) for x in rollout.samples], dtype=torch.long)
    highs = torch.tensor([max(sample_versions(x, step - 1)) for x in rollout.samples], dtype=torch.long)
    exp.info["policy_version_min"], exp.info["policy_version_max"] = lows, highs
    stale = (step - 1) - lows
    if bound is not None and int(stale.max()) > bound:
        raise RuntimeError(f"step {step}: a sample is {int(stale.max())} policy versions stale, more than "
                           f"--async_queue_size {bound}")
    return {"async/staleness_max": float(stale.max()), "async/staleness_mean": float(stale.float().mean()),
            "async/policy_version_min": float(lows.min()), "async/policy_version_max": float(highs.max()),
            "async/mixed_version_frac": float((highs > lows).float().mean())}


@dataclass
class _Ahead:
    step: int
    future: Future | None = None
    done: Collected | None = None
    cursor: int | None = None  # the prompt cursor when its generation began (for a regeneration after a fault)


class RolloutQueue:
    """Rollouts of the coming steps, in step order (see the module docstring). `collect(faults)` collects one
    rollout now (rollout_source.collect_timed with the loop's stream and sampling, versions stamped)."""

    def __init__(self, cfg: PPOConfig, stream: Any, gate: EngineGate, collect: Callable[..., Collected],
                 total_steps: int, pending: list[Collected] | None = None, first_step: int = 1) -> None:
        self.size, self.partial = cfg.async_queue_size, bool(cfg.partial_rollout)
        self.stream, self.gate, self.collect, self.total_steps = stream, gate, collect, total_steps
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self.items: deque[_Ahead] = deque(_Ahead(first_step + k, done=d) for k, d in enumerate(pending or []))

    def take(self, step: int, faults: EngineFaults) -> tuple[Collected | None, float]:
        """The rollout of `step` if one was generated ahead (waiting for it if still in flight), else None; and the
        seconds waited."""
        if not self.items or self.items[0].step != step:
            return None, 0.0
        waited = self._resolve(0, faults)
        item = self.items.popleft()
        return item.done, waited

    def fill(self, step: int) -> None:
        """Submit the rollouts of steps up to step + N (at most the last step) not yet queued."""
        last = self.items[-1].step if self.items else step
        for ahead in range(last + 1, min(step + self.size, self.total_steps) + 1):
            item = _Ahead(ahead)
            item.future = self.pool.submit(self._job, item)
            self.items.append(item)

    def _job(self, item: _Ahead) -> Collected:
        item.cursor = self.stream.cursor
        return self.collect(None)

    def before_sync(self, faults: EngineFaults) -> float:
        """Without --partial_rollout: wait for every rollout in flight (the engines must be idle to load weights);
        returns the seconds waited. With it: nothing (the sync waits for the current chunk only)."""
        return 0.0 if self.partial else self.settle(faults)

    def settle(self, faults: EngineFaults) -> float:
        """Wait until every queued rollout is generated (before a checkpoint keeps them); the seconds waited."""
        waited, k = 0.0, 0
        while k < len(self.items):  # a fault drops the items after the faulty one (see _resolve)
            waited += self._resolve(k, faults)
            k += 1
        return waited

    def finished(self) -> list[Collected]:
        return [item.done for item in self.items if item.done is not None]

    def _resolve(self, k: int, faults: EngineFaults) -> float:
        item, began = self.items[k], time.perf_counter()
        if item.future is not None:
            try:
                item.done = item.future.result()
            except Exception as err:  # an engine fault while generating ahead: restart it, generate again here
                fault = engine_fault(err)
                if fault is None:
                    raise
                self._drop_after(k)
                faults.recover(fault, "generation ahead (--async_train)", err)
                log.warning("--async_train: the rollout of step %d is generated again after the engine restart, with "
                            "the newest synced weights (less stale than usual)", item.step)
                self.stream.cursor = item.cursor
                item.done = self.collect(faults)
            item.future = None
        return time.perf_counter() - began

    def _drop_after(self, k: int) -> None:
        """Forget the rollouts queued after item k (they are submitted again by the next `fill`)."""
        while len(self.items) > k + 1:
            later = self.items.pop()
            if later.future is not None and not later.future.cancel():
                try:
                    later.future.result()
                except Exception:  # noqa: BLE001 -- the engine fault of item k is being handled
                    log.warning("--async_train: the rollout of step %d is dropped and generated again", later.step)

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


def pending_path(cfg: PPOConfig, step: int) -> Path:
    return Path(cfg.ckpt_path) / "driver" / f"pending_rollout_step{step}.pt"


def save_pending(cfg: PPOConfig, step: int, rollouts: list[Collected]) -> None:
    """--async_train: the rollouts generated ahead are part of the run's state; saved beside the checkpoint of `step`
    (temporary file + rename), so a resumed run trains on exactly the rollouts the uninterrupted run would."""
    path = pending_path(cfg, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    register_rollout_types()
    save_state(list(rollouts), tmp)
    tmp.replace(path)
    kept = sorted(path.parent.glob("pending_rollout_step*.pt"), key=lambda p: int(p.stem.rsplit("step", 1)[1]))
    for old in kept[:-max(1, cfg.max_ckpt_num)]:
        old.unlink()


def load_pending(cfg: PPOConfig, step: int) -> list[Collected]:
    """The rollouts saved at `step` (a file of an older version holds one tuple: that one), or [] with a warning."""
    register_rollout_types()
    path = pending_path(cfg, step)
    if not path.exists():
        log.warning("--async_train resume: no rollout generated ahead at step %d (%s); generating it now with the "
                    "resumed weights, so this run is not bit-identical to an uninterrupted async run", step, path)
        return []
    loaded = load_state(path, "the rollouts generated ahead (--async_train)")
    rollouts = [loaded] if isinstance(loaded, tuple) else list(loaded)
    log.info("--async_train resume: %d rollout(s) generated ahead before step %d are trained first (%s)",
             len(rollouts), step, path)
    return rollouts
