"""Deadlines on Ray remote calls, and errors that name the culprit (role, rank, node, method).

Every remote call of the online loop waits through `wait_remote` (model-group methods, engine calls, the weight
sync, reward-model calls). A call past its deadline raises `RemoteCallTimeout`, one whose actor died (killed,
crashed, node lost) `RemoteActorDied`; both name the role, the rank(s), the node (IP and Ray node id) and the
method, and say how long they waited. An exception raised by the callee's own code passes through unchanged.

The deadline is `--remote_call_timeout` (seconds, default 1800): the driver sets it once for its process
(`set_remote_call_timeout`), and passes it to the actor rank that drives the weight broadcast. Engines also get a
cheap health check before each step (`ping_engines`, a shorter deadline: `HEALTH_CHECK_TIMEOUT_S`).

Hangs inside a call: the deadline must be long (a live generation can take minutes), so while an engine call runs,
`wait_remote` also probes each engine still working: its `ping`, every few seconds (`PROBE_INTERVAL_MAX_S`). The
engine classes serve `ping` in a concurrency group of its own (`@ray.method(concurrency_group=LIVENESS_GROUP)`,
declared by `engine_actor_class`: one thread beside the one running the call), so a live engine answers at once
however long its generation; a stopped or frozen process answers nothing. A probe unanswered for
`--engine_hang_timeout` seconds (default 60; 0: no probes) raises `RemoteActorHung` naming the engine, which the
run handles as a dead engine (`rlhfkit.rl.engine_faults`). The driver sets the timeout for its process
(`set_engine_hang_timeout`), and so does the actor rank that drives the weight broadcast.

Model-group ranks compute on their main thread and cannot answer a probe mid-step: they send heartbeats from a
thread of their own instead (`rlhfkit.rollout.heartbeat`), and a wait given `heartbeats=` names a rank silent for
`--trainer_hang_timeout` seconds (default 60) hung (`RemoteActorHung`), after killing it.

Typed calls: a remote method is named by the method itself, never by a string: `RemoteActors(engines,
role="engine").call(RolloutEngine.ping)` (`rlhfkit.rollout.engine_api.RolloutEngine`, the engines' interface), or
`ModelGroup.call(ModelWorker.save_hf, path, spec)` (`rlhfkit.rl.group`); mypy checks the arguments against the
method's signature and types the results (`list[R]`). `method_name` resolves the name Ray dispatches on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from rlhfkit.errors import RemoteActorDied, RemoteActorHung, RemoteCallError, RemoteCallTimeout
from rlhfkit.rollout.heartbeat import HeartbeatCheck, Heartbeats

DEFAULT_REMOTE_CALL_TIMEOUT_S = 1800.0
# An error a collective raises when one of its peers is gone (gloo, NCCL, the store): the peer is the culprit
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "DistBackendError",
             "NCCL communicator was aborted", "ncclRemoteError", "Socket Timeout")
PEER_GRACE_S = 60.0  # how long to wait for Ray to report that peer dead (a lost node: its health checks)
HEALTH_CHECK_TIMEOUT_S = 30.0
DEFAULT_ENGINE_HANG_TIMEOUT_S = 60.0
PROBE_INTERVAL_MAX_S = 5.0  # a busy engine is probed this often at most (a quarter of the hang timeout if shorter)
LIVENESS_GROUP = "liveness"  # the engines' concurrency group serving `ping` (see ENGINE_CONCURRENCY_GROUPS)
ENGINE_CONCURRENCY_GROUPS = {LIVENESS_GROUP: 1}  # what engine_actor_class declares
_timeout_s = DEFAULT_REMOTE_CALL_TIMEOUT_S
_hang_timeout_s = DEFAULT_ENGINE_HANG_TIMEOUT_S

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
RemoteMethod = Callable[..., Any]  # a method of the callee's class, never its name as a string


def method_name(method: RemoteMethod) -> str:
    """The name Ray dispatches a call on: the method's own name (`ModelWorker.save_hf` -> "save_hf"); a string (a
    call by name, which neither mypy nor a reader can follow across Ray) is refused."""
    name = getattr(method, "__name__", None)
    if not isinstance(name, str) or not callable(method):
        raise TypeError(f"a remote call needs a method of the callee's class (e.g. ModelWorker.save_hf), got "
                        f"{method!r}")
    return name


class RemoteActors:
    """Ray actor handles of one role, called by typed method: `call(Cls.method, *args, **kwargs)` runs
    `method(*args, **kwargs)` on every actor (waited with `wait_remote`: the deadline, dead and hung callees named)
    and returns every actor's result, typed `list[R]` from the method's return type."""

    def __init__(self, handles: Sequence[Any], *, role: str, ranks: Sequence[int] | None = None,
                 timeout_s: float | None = None, hang_timeout_s: float | None = None,
                 heartbeats: Heartbeats | None = None) -> None:
        self.handles, self.role, self.ranks = list(handles), role, ranks
        self.timeout_s, self.hang_timeout_s, self.heartbeats = timeout_s, hang_timeout_s, heartbeats

    def call(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> list[R]:
        return self._call(method, *args, **kwargs)

    def _call(self, method: RemoteMethod, *args: Any, **kwargs: Any) -> list[Any]:
        name = method_name(method)
        refs = [getattr(h, name).remote(*args, **kwargs) for h in self.handles]
        return wait_remote(refs, role=self.role, method=name, handles=self.handles, ranks=self.ranks,
                           timeout_s=self.timeout_s, hang_timeout_s=self.hang_timeout_s, heartbeats=self.heartbeats)


class Pending(Generic[T]):
    """Results of calls already sent to actors; `get()` waits (with the deadline, naming the callee on a timeout, a
    dead or a hung rank: `wait_remote`) and assembles them. `callees`: (role, method, worker handles), one handle
    per ref; `heartbeats`: the ranks' heartbeat check (e.g. ModelGroup.heartbeats)."""

    def __init__(self, refs: list[Any], assemble: Callable[[list[Any]], T],
                 callees: tuple[str, str, list[Any]] | None = None, heartbeats: Heartbeats | None = None) -> None:
        self.refs, self.assemble, self.callees, self.heartbeats = refs, assemble, callees, heartbeats

    def get(self) -> T:
        import ray

        if self.callees is None:
            return self.assemble(ray.get(self.refs))
        role, method, handles = self.callees
        return self.assemble(wait_remote(self.refs, role=role, method=method, handles=handles,
                                         heartbeats=self.heartbeats))


def set_remote_call_timeout(seconds: float) -> None:
    """This process's deadline for every remote call that is not given one (`--remote_call_timeout`)."""
    global _timeout_s
    if not seconds > 0:
        raise ValueError(f"--remote_call_timeout {seconds}: must be > 0 (seconds)")
    _timeout_s = float(seconds)


def remote_call_timeout() -> float:
    return _timeout_s


def engine_actor_class(cls: type) -> Any:
    """`ray.remote(cls)` for an engine class: declares the concurrency group its `ping` is served in
    (`LIVENESS_GROUP`), so the probe is answered beside a running call. Ray refuses to create an actor of a class
    whose method names an undeclared group."""
    import ray

    return ray.remote(concurrency_groups=ENGINE_CONCURRENCY_GROUPS)(cls)  # type: ignore[call-overload]  # not in stubs


def set_engine_hang_timeout(seconds: float) -> None:
    """This process's liveness-probe timeout for engine calls (`--engine_hang_timeout`; 0: no probes)."""
    global _hang_timeout_s
    if not seconds >= 0:
        raise ValueError(f"--engine_hang_timeout {seconds}: must be >= 0 (seconds; 0 turns the probes off)")
    _hang_timeout_s = float(seconds)


def engine_hang_timeout() -> float:
    return _hang_timeout_s


def actor_node(handle: Any) -> str:
    """'node <ip> (<node id>)' of a Ray actor as Ray's actor table records it (also for a dead actor)."""
    try:
        from ray._private import state

        row = state.actors(handle._actor_id.hex())
        address = row.get("Address") or {}
        ip, node = address.get("IPAddress") or "?", address.get("NodeID") or "?"
        return f"node {ip} ({node[:12]})"
    except Exception:  # the table is not reachable: say so rather than fail while reporting a failure
        return "node unknown"


def _who(role: str, ranks: Sequence[int], handles: Sequence[Any]) -> str:
    label = "engine" if role == "engine" else f"{role} rank"
    return "; ".join(f"{label} {r} on {actor_node(h)}" for r, h in zip(ranks, handles))


def wait_remote(refs: Sequence[Any], *, role: str, method: str, handles: Sequence[Any],
                ranks: Sequence[int] | None = None, timeout_s: float | None = None,
                started: float | None = None, hang_timeout_s: float | None = None,
                heartbeats: Heartbeats | None = None) -> list[Any]:
    """`ray.get(refs)` with a deadline; `refs[i]` is `method` called on actor `handles[i]` (rank `ranks[i]`, default
    `i`) of `role`. Raises `RemoteActorDied` as soon as any callee is found dead, `RemoteCallTimeout` naming every
    callee still pending at the deadline; an error of the callee's own code is raised as Ray raises it.
    `started` (`time.monotonic()`): when the wait began, if before this call (the deadline counts from then).
    Engines (`role` "engine") still working are probed meanwhile (`LivenessProbes`): one whose probe goes
    unanswered for `hang_timeout_s` (default: this process's `--engine_hang_timeout`; 0: no probes) raises
    `RemoteActorHung` naming it. Model-group ranks (`heartbeats`: the board they beat to and the silence that is a
    hang, `rlhfkit.rollout.heartbeat`) are checked meanwhile: one still working and silent for
    `heartbeats.hang_timeout_s` (`--trainer_hang_timeout`) is killed and `RemoteActorHung` names it."""
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    refs = list(refs)
    ranks = list(range(len(refs))) if ranks is None else list(ranks)
    deadline_s = remote_call_timeout() if timeout_s is None else timeout_s
    began = time.monotonic() if started is None else started
    if hang_timeout_s is None:
        hang_timeout_s = engine_hang_timeout() if role == "engine" else 0.0
    probes = LivenessProbes(handles, hang_timeout_s, began) if hang_timeout_s > 0 and method != "ping" else None
    beats = HeartbeatCheck(heartbeats, handles, began) if heartbeats is not None and \
        heartbeats.hang_timeout_s > 0 else None
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    while pending:
        now = time.monotonic()
        left = deadline_s - (now - began)
        wait_s = left
        if probes is not None:
            hung = probes.check([index[r] for r in pending], now)
            if hung:
                raise probes.hung_error(hung, role, method, ranks, began)
            wait_s = min(wait_s, probes.next_event([index[r] for r in pending], now) - now)
        if beats is not None:
            hung = beats.check([index[r] for r in pending], now)
            if hung:
                error = _silent_error(beats, hung, role, method, ranks, began)  # names the node before the kill
                beats.kill(hung)
                raise error
            wait_s = min(wait_s, beats.next_event(now) - now)
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, wait_s)) if left > 0 else ([], pending)
        if not ready and time.monotonic() - began >= deadline_s:
            waited = time.monotonic() - began
            late = [index[r] for r in pending]
            raise RemoteCallTimeout(
                f"{method} on {_who(role, [ranks[i] for i in late], [handles[i] for i in late])} did not answer "
                f"within {deadline_s:g} s (waited {waited:.1f} s; deadline: --remote_call_timeout, or the health "
                "check's). The process is hung or overloaded: see its log in <run_dir>/logs/.",
                role=role, ranks=[ranks[i] for i in late], method=method, waited_s=waited)
        for ref in ready:
            try:
                ray.get(ref)
            except (ActorDiedError, ActorUnavailableError, RayActorError) as err:
                raise _died(err, index[ref], role, method, handles, ranks, began) from err
            except Exception as err:
                if any(text in str(err) for text in PEER_LOST):  # a collective lost a peer: name the peer
                    _raise_dead_peer(err, refs, index[ref], role, method, handles, ranks, began, deadline_s)
                raise
    return ray.get(refs)


class LivenessProbes:
    """The liveness probes of one wait: callee `i` (still working) gets `handles[i].ping()`, which the engine
    classes serve in their `LIVENESS_GROUP` (beside the running call, so a live callee answers at once), first
    `interval` seconds into the wait, then `interval` seconds after each answer; one probe in flight per callee.
    A probe in flight for `hang_timeout_s` marks its callee hung. `interval` = min(PROBE_INTERVAL_MAX_S,
    hang_timeout_s / 4): a stop is found within hang_timeout_s + interval of it."""

    def __init__(self, handles: Sequence[Any], hang_timeout_s: float, began: float) -> None:
        self.handles, self.hang_timeout_s = handles, hang_timeout_s
        self.interval = min(PROBE_INTERVAL_MAX_S, hang_timeout_s / 4)
        # when callee i's next probe is sent; actors without a ping (not an engine class) are not probed
        self.due = {i: began + self.interval for i, h in enumerate(handles) if hasattr(h, "ping")}
        self.in_flight: dict[int, tuple[Any, float]] = {}  # callee -> (probe ref, when sent)

    def check(self, working: list[int], now: float) -> list[int]:
        """Collect the answers, send the probes due to the `working` callees; returns the hung ones."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        if self.in_flight:
            refs = [ref for ref, _ in self.in_flight.values()]
            answered, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for i, (ref, _) in list(self.in_flight.items()):
                if ref in answered:
                    del self.in_flight[i]
                    self.due[i] = now + self.interval
                    try:
                        ray.get(ref)
                    except (ActorDiedError, ActorUnavailableError, RayActorError):
                        pass  # dead: its own call reports it (RemoteActorDied)
        working = [i for i in working if i in self.due]
        hung = [i for i in working if i in self.in_flight and now - self.in_flight[i][1] >= self.hang_timeout_s]
        for i in working:
            if i not in self.in_flight and now >= self.due[i]:
                self.in_flight[i] = (self.handles[i].ping.remote(), now)
        return hung

    def next_event(self, working: list[int], now: float) -> float:
        """When the next probe of a `working` callee is due, or the oldest one in flight becomes a hang."""
        times = [self.in_flight[i][1] + self.hang_timeout_s if i in self.in_flight else self.due[i]
                 for i in working if i in self.due]
        return max(now, min(times)) if times else now + self.interval

    def hung_error(self, hung: list[int], role: str, method: str, ranks: list[int], began: float) -> RemoteActorHung:
        waited = time.monotonic() - began
        return RemoteActorHung(
            f"{method} on {_who(role, [ranks[i] for i in hung], [self.handles[i] for i in hung])}: hung, its "
            f"liveness probe (ping, served beside the running call) got no answer for {self.hang_timeout_s:g} s "
            f"(--engine_hang_timeout), {waited:.1f} s into the call. The process is stopped, frozen, or holds the "
            "interpreter: see its log in <run_dir>/logs/ (a live call, however long, answers the probe).",
            role=role, ranks=[ranks[i] for i in hung], method=method, waited_s=waited)


def _silent_error(beats: HeartbeatCheck, hung: list[int], role: str, method: str, ranks: list[int],
                  began: float) -> RemoteActorHung:
    waited = time.monotonic() - began
    silent = max(beats.silent_s[i] for i in hung)
    return RemoteActorHung(
        f"{method} on {_who(role, [ranks[i] for i in hung], [beats.handles[i] for i in hung])}: hung, no heartbeat "
        f"for {silent:.1f} s (--trainer_hang_timeout {beats.hang_timeout_s:g}), found {waited:.1f} s into the "
        "wait; killed. The process was stopped, frozen, or held the interpreter: see its log in <run_dir>/logs/ "
        f"(a live rank, however long its step, beats every {beats.interval:g} s from a thread of its own). Resume "
        "from the last checkpoint with --load_checkpoint.",
        role=role, ranks=[ranks[i] for i in hung], method=method, waited_s=waited)


def _died(err: BaseException, i: int, role: str, method: str, handles: Sequence[Any], ranks: Sequence[int],
          began: float) -> RemoteActorDied:
    waited = time.monotonic() - began
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return RemoteActorDied(f"{method} on {_who(role, [ranks[i]], [handles[i]])}: the actor died after {waited:.1f} s "
                           f"({type(err).__name__}: {first[:300]})", role=role, ranks=[ranks[i]], method=method,
                           waited_s=waited)


def _raise_dead_peer(err: BaseException, refs: list[Any], failed: int, role: str, method: str,
                     handles: Sequence[Any], ranks: Sequence[int], began: float, deadline_s: float) -> None:
    """Callee `failed` raised because a collective lost a peer: a peer killed or lost with its node is often
    reported dead by Ray only after the survivor's error arrives. Wait (up to PEER_GRACE_S, within the deadline)
    for another callee of this call to be found dead and raise `RemoteActorDied` naming it, with the survivor's
    error as the cause; return if none is (the caller re-raises the survivor's error)."""
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    others = [i for i in range(len(refs)) if i != failed]
    grace_end = time.monotonic() + min(PEER_GRACE_S, max(0.0, deadline_s - (time.monotonic() - began)))
    pending = [refs[i] for i in others]
    while pending and time.monotonic() < grace_end:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, grace_end - time.monotonic()))
        for ref in ready:
            try:
                ray.get(ref)
            except (ActorDiedError, ActorUnavailableError, RayActorError) as died:
                i = refs.index(ref)
                culprit = _died(died, i, role, method, handles, ranks, began)
                survivor = str(err).strip().splitlines()[-1][:200]
                raise RemoteActorDied(f"{culprit} [{_who(role, [ranks[failed]], [handles[failed]])} lost it as a "
                                      f"peer first: {survivor}]", role=role, ranks=[ranks[i]], method=method,
                                      waited_s=culprit.waited_s) from err
            except Exception:  # noqa: BLE001 - another survivor's error: keep looking for the dead one
                pass


def ping_engines(engines: Sequence[Any], timeout_s: float | None = None) -> None:
    """The engines' health check: `ping()` on each (served in its liveness group: it does not wait behind a call
    in flight, e.g. a generation ahead with --async_train), with a short deadline (dead or hung: `RemoteCallError`)."""
    if timeout_s is None:
        timeout_s = min(HEALTH_CHECK_TIMEOUT_S, remote_call_timeout())
    from rlhfkit.rollout.engine_api import RolloutEngine

    RemoteActors(engines, role="engine", timeout_s=timeout_s).call(RolloutEngine.ping)


__all__ = ["ENGINE_CONCURRENCY_GROUPS", "LIVENESS_GROUP", "LivenessProbes", "Pending", "RemoteActorDied",
           "RemoteActorHung", "RemoteActors", "RemoteCallError", "RemoteCallTimeout", "RemoteMethod", "actor_node",
           "engine_actor_class", "engine_hang_timeout", "method_name", "ping_engines",
           "remote_call_timeout", "set_engine_hang_timeout", "set_remote_call_timeout", "wait_remote"]
