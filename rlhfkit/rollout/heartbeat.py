"""Heartbeats of the model-worker ranks (actor, reference, critic, reward model): how a rank stopped inside a call is
found within `--trainer_hang_timeout` instead of at `--remote_call_timeout`.

A model worker computes on its process's main thread (torch's CPU thread settings are per thread, so its work is
never moved to a thread pool, as a Ray concurrency group would): it cannot answer a probe while a step runs. Instead
each rank starts a daemon thread at construction (`Heartbeat`) that sends a beat every `beat_interval` seconds
(min(5 s, timeout / 4)) to the job's `HeartbeatBoard`, a small threaded actor on the driver's node that records,
per worker (its Ray actor id), when the last beat arrived, on the board's own clock. A live rank beats however long
its step (torch and collectives release the interpreter; a Python loop yields it every few milliseconds); a stopped
(SIGSTOP), frozen or interpreter-holding process sends nothing.

While the driver waits on model-group calls (`rlhfkit.rollout.remote.wait_remote` with `heartbeats=`), it asks the
board every beat interval how long each rank still working has been silent (`HeartbeatCheck`, one query in flight);
a rank silent for `--trainer_hang_timeout` seconds is killed (`ray.kill`; a stopped process is killed by its raylet)
and the wait raises `RemoteActorHung` naming the role, rank, node and method. A rank that has not beaten yet (its
process still starting) is not judged; a board that does not answer judges no one (the deadline still holds).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

BEAT_INTERVAL_MAX_S = 5.0
BOARD_NAME = "rlhfkit-heartbeats-{job}"  # one board per Ray job (created by the first model group that needs it)
KILL_WAIT_S = 30.0  # how long a hung rank's kill is awaited (Ray's actor table saying DEAD) before the error


def beat_interval(hang_timeout_s: float) -> float:
    """Seconds between a rank's beats, and between the waiter's looks at the board: min(5 s, timeout / 4)."""
    return min(BEAT_INTERVAL_MAX_S, hang_timeout_s / 4)


class HeartbeatBoard:
    """The job's record of model-worker beats (a Ray actor, threaded: beats and queries never wait on each other):
    per worker actor id, when its last beat arrived (`time.monotonic()` of the board's process)."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[float, int]] = {}  # actor id -> (arrival, sequence number)

    def beat(self, actor_id: str, seq: int) -> None:
        self.last[actor_id] = (time.monotonic(), seq)

    def silences(self, actor_ids: Sequence[str]) -> list[float | None]:
        """Seconds since each worker's last beat (None: it never beat)."""
        now = time.monotonic()
        return [now - self.last[a][0] if a in self.last else None for a in actor_ids]

    def forget(self, actor_ids: Sequence[str]) -> None:
        for actor_id in actor_ids:
            self.last.pop(actor_id, None)


def heartbeat_board() -> Any:
    """The job's `HeartbeatBoard` actor: created on the calling process's node on first use, then found by its name,
    which holds the Ray job id (two drivers on one cluster each have their own; a board lives as long as its job)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    context = ray.get_runtime_context()
    here = NodeAffinitySchedulingStrategy(context.get_node_id(), soft=True)
    board_cls = ray.remote(HeartbeatBoard)
    return board_cls.options(name=BOARD_NAME.format(job=context.get_job_id()),  # type: ignore[attr-defined]
                             get_if_exists=True, num_cpus=0, max_concurrency=8, scheduling_strategy=here).remote()


class Heartbeat:
    """The beating thread of one model-worker process: `board.beat(<this actor's id>, seq)` every `interval_s`
    seconds, from a daemon thread (it stops with the process; a beat that fails is dropped, the next one tries)."""

    def __init__(self, board: Any, interval_s: float) -> None:
        import ray

        self.board, self.interval_s = board, interval_s
        self.actor_id = ray.get_runtime_context().get_actor_id()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rlhfkit-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        seq = 0
        while not self.stopped.is_set():
            try:
                self.board.beat.remote(self.actor_id, seq)
            except Exception:  # noqa: BLE001 - the board is gone (the job ends): nothing to report to
                pass
            seq += 1
            self.stopped.wait(self.interval_s)

    def stop(self) -> None:
        self.stopped.set()


@dataclass(frozen=True)
class Heartbeats:
    """What a wait on model-worker calls checks: the board the callees beat to, and the silence that is a hang
    (`--trainer_hang_timeout`; 0: not checked)."""

    board: Any
    hang_timeout_s: float


class HeartbeatCheck:
    """The heartbeat checks of one wait (`wait_remote`): every beat interval one `silences` query to the board for
    the callees still working; a callee silent for `hang_timeout_s` is hung. A stop is found within the timeout plus
    one interval (plus the board's round trip)."""

    def __init__(self, heartbeats: Heartbeats, handles: Sequence[Any], began: float) -> None:
        self.board, self.hang_timeout_s = heartbeats.board, heartbeats.hang_timeout_s
        self.handles = handles
        self.actor_ids = [h._actor_id.hex() for h in handles]
        self.interval = beat_interval(self.hang_timeout_s)
        self.due = began + self.interval  # the first look: a short call never asks the board
        self.in_flight: tuple[Any, list[int]] | None = None  # (query ref, the callees asked about)
        self.silent_s: dict[int, float] = {}  # callee -> its silence at the last answer

    def check(self, working: list[int], now: float) -> list[int]:
        """Send the board a query when due and collect its answer (waiting for it up to a fraction of an interval:
        the board answers in milliseconds); returns the `working` callees found hung."""
        import ray

        if self.in_flight is None and now >= self.due and working:
            self.in_flight = (self.board.silences.remote([self.actor_ids[i] for i in working]), list(working))
        if self.in_flight is not None:
            ref, asked = self.in_flight
            ready, _ = ray.wait([ref], timeout=min(1.0, self.interval / 2))
            if ready:
                self.in_flight = None
                self.due = now + self.interval
                try:
                    silences = ray.get(ref)
                except Exception:  # noqa: BLE001 - the board failed: judge no one (the deadline still holds)
                    silences = [None] * len(asked)
                self.silent_s = {i: s for i, s in zip(asked, silences) if s is not None}
        return [i for i in working if self.silent_s.get(i, 0.0) >= self.hang_timeout_s]

    def next_event(self, now: float) -> float:
        """When to look again: the next query, or (one unanswered) a fraction of an interval on."""
        return now + self.interval / 2 if self.in_flight is not None else max(now, self.due)

    def kill(self, hung: list[int]) -> None:
        """Kill the hung callees' actors and wait (at most KILL_WAIT_S) until Ray reports them dead: a stopped
        process is killed by its raylet, and its peers, in a collective with it, see its sockets close."""
        import ray
        from ray._private import state

        for i in hung:
            ray.kill(self.handles[i], no_restart=True)
        end = time.monotonic() + KILL_WAIT_S
        for i in hung:
            while time.monotonic() < end:
                try:
                    if state.actors(self.actor_ids[i]).get("State") == "DEAD":
                        break
                except Exception:  # noqa: BLE001 - the actor table is unreachable: do not wait on it
                    break
                time.sleep(0.1)
