"""Faults survived: a rollout engine that dies or hangs is restarted, given the actor's current weights, and the run
goes on (`--max_engine_restarts`, default 3 per run).

A fault is found by the engines' health check before each step (`ping`, a short deadline), or by any engine call
of the step passing `--remote_call_timeout` or finding its actor dead (`rlhfkit.rollout.remote`: the error names
the engine, its node and the method). Then, for each engine named:

1. the old actor is killed (a hung process would otherwise keep its resources);
2. a new one is started with the same options, seed and placement (`RLSetup.engine_factory`: the code that
   created the run's engines from the flags, for these indices only);
3. the actor's current weights are pushed into every engine (`push_actor_weights`; the broadcast group is rebuilt
   with the new member) and the log-prob check confirms the new engine computes what the trainer does;
4. the interrupted work (generation, weight sync, evaluation) runs again. Generation repeats with the same prompts
   and per-sample seeds, so nothing is lost: the step's samples are the ones it would have drawn.

Each restart is a line in `<run_dir>/events.jsonl` (`{"event": "engine_restart", ...}`: which engine, the fault,
the method, seconds to detect and to recover) and counts in the step's metrics (`fault/engine_restarts`, the run's
total, and `time/engine_restart`). Past the cap, or for engines handed to the run (tests, notebooks: there is no
factory), the run stops with the attributable error; `--load_checkpoint` resumes from the last checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from rlhfkit.errors import RemoteCallError
from rlhfkit.rl.weight_push import push_actor_weights
from rlhfkit.rollout.remote import ping_engines

if TYPE_CHECKING:
    from rlhfkit.rl.setup import RLSetup

log = logging.getLogger("rlhfkit")
T = TypeVar("T")


def engine_fault(err: BaseException) -> RemoteCallError | None:
    """The engine fault `err` is (also when raised inside an actor, e.g. the actor rank driving the broadcast, and
    re-raised by Ray), or None."""
    for candidate in (err, getattr(err, "cause", None)):
        if isinstance(candidate, RemoteCallError) and getattr(candidate, "role", "") == "engine" and \
                getattr(candidate, "ranks", None):
            return candidate
    return None


class EngineFaults:
    """Restarts the engines of a run (`s`: `RLSetup`) after faults; `guard` wraps each piece of engine work."""

    def __init__(self, s: RLSetup) -> None:
        self.s = s
        self.max_restarts = s.cfg.max_engine_restarts
        self.restarts = 0
        self.step = s.start_step
        self.seconds = 0.0  # recovery time in the current step

    def take_step_metrics(self) -> dict[str, float]:
        out = {"fault/engine_restarts": float(self.restarts)}
        if self.seconds:
            out["time/engine_restart"] = self.seconds
        self.seconds = 0.0
        return out

    def health_check(self) -> None:
        """Ping every engine (short deadline); restart the dead or hung ones."""
        self.guard("health check", lambda: ping_engines(self.s.engines))

    def guard(self, what: str, work: Callable[[], T]) -> T:
        """`work()`; after an engine fault, restart the engines it names and run `work()` again."""
        while True:
            try:
                return work()
            except Exception as err:
                fault = engine_fault(err)
                if fault is None:
                    raise
                self.recover(fault, what, err)

    def recover(self, fault: RemoteCallError, what: str, raised: BaseException) -> None:
        s, ranks = self.s, sorted(set(fault.ranks))
        if s.engine_factory is None or self.restarts + len(ranks) > self.max_restarts:
            why = ("the engines were handed to the run, which cannot recreate them" if s.engine_factory is None else
                   f"{self.restarts} engine restart(s) used of --max_engine_restarts {self.max_restarts}")
            raise type(fault)(f"{fault} [during {what} at step {self.step}; not restarted: {why}. Resume from the "
                              "last checkpoint with --load_checkpoint]", role=fault.role, ranks=fault.ranks,
                              method=fault.method, waited_s=fault.waited_s) from raised
        import ray

        began = time.perf_counter()
        log.warning("engine fault during %s at step %d, restarting engine(s) %s: %s", what, self.step, ranks, fault)
        for k in ranks:
            ray.kill(s.engines[k], no_restart=True)
        for k, engine in zip(ranks, s.engine_factory(ranks)):
            s.engines[k] = engine  # in place: every holder of the list sees the new engine
            if s.phases is not None:
                s.phases.engines[k] = engine
        push_actor_weights(s.actor, s.engines, s.cfg, s.plan)  # the actor's current weights, into the new engine too
        if s.sync_check is not None:
            s.sync_check.check(s.actor, s.engines, f"engine {ranks} restarted")
        seconds = time.perf_counter() - began
        self.restarts += len(ranks)
        self.seconds += seconds
        event = {"event": "engine_restart", "step": self.step, "engines": ranks, "during": what,
                 "fault": type(fault).__name__, "method": fault.method, "detected_after_s": round(fault.waited_s, 3),
                 "recovered_in_s": round(seconds, 3), "restarts": self.restarts,
                 "max_engine_restarts": self.max_restarts, "error": str(fault)}
        if s.plan.run_dir:
            with (Path(s.plan.run_dir) / "events.jsonl").open("a") as f:
                f.write(json.dumps(event) + "\n")
        log.warning("engine(s) %s restarted and synced in %.1f s (%d of %d restarts used)", ranks, seconds,
                    self.restarts, self.max_restarts)
