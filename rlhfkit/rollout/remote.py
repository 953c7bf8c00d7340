"""Deadlines on Ray remote calls, and errors that name the culprit (role, rank, node, method).

Every remote call of the online loop waits through `wait_remote` (model-group methods, engine calls, the weight
sync, reward-model calls). A call past its deadline raises `RemoteCallTimeout`, one whose actor died (killed,
crashed, node lost) `RemoteActorDied`; both name the role, the rank(s), the node (IP and Ray node id) and the
method, and say how long they waited. An exception raised by the callee's own code passes through unchanged.

The deadline is `--remote_call_timeout` (seconds, default 1800): the driver sets it once for its process
(`set_remote_call_timeout`), and passes it to the actor rank that drives the weight broadcast. Engines also get a
cheap health check before each step (`ping_engines`, a shorter deadline: `HEALTH_CHECK_TIMEOUT_S`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rlhfkit.errors import RemoteActorDied, RemoteCallError, RemoteCallTimeout

DEFAULT_REMOTE_CALL_TIMEOUT_S = 1800.0
# An error a collective raises when one of its peers is gone (gloo, NCCL, the store): the peer is the culprit
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "DistBackendError",
             "NCCL communicator was aborted", "ncclRemoteError", "Socket Timeout")
PEER_GRACE_S = 60.0  # how long to wait for Ray to report that peer dead (a lost node: its health checks)
HEALTH_CHECK_TIMEOUT_S = 30.0
_timeout_s = DEFAULT_REMOTE_CALL_TIMEOUT_S


def set_remote_call_timeout(seconds: float) -> None:
    """This process's deadline for every remote call that is not given one (`--remote_call_timeout`)."""
    global _timeout_s
    if not seconds > 0:
        raise ValueError(f"--remote_call_timeout {seconds}: must be > 0 (seconds)")
    _timeout_s = float(seconds)


def remote_call_timeout() -> float:
    return _timeout_s


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
                started: float | None = None) -> list[Any]:
    """`ray.get(refs)` with a deadline; `refs[i]` is `method` called on actor `handles[i]` (rank `ranks[i]`, default
    `i`) of `role`. Raises `RemoteActorDied` as soon as any callee is found dead, `RemoteCallTimeout` naming every
    callee still pending at the deadline; an error of the callee's own code is raised as Ray raises it.
    `started` (`time.monotonic()`): when the wait began, if before this call (the deadline counts from then)."""
    import ray
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    refs = list(refs)
    ranks = list(range(len(refs))) if ranks is None else list(ranks)
    deadline_s = remote_call_timeout() if timeout_s is None else timeout_s
    began = time.monotonic() if started is None else started
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    while pending:
        left = deadline_s - (time.monotonic() - began)
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, left)) if left > 0 else ([], pending)
        if not ready:
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


def call_all(handles: Sequence[Any], method: str, *args: Any, role: str, ranks: Sequence[int] | None = None,
             timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
    """`method(*args, **kwargs)` on every actor in `handles`, waited with `wait_remote`."""
    refs = [getattr(h, method).remote(*args, **kwargs) for h in handles]
    return wait_remote(refs, role=role, method=method, handles=handles, ranks=ranks, timeout_s=timeout_s)


def ping_engines(engines: Sequence[Any], timeout_s: float | None = None) -> None:
    """The engines' health check: `ping()` on each, with a short deadline (dead or hung: `RemoteCallError`)."""
    if timeout_s is None:
        timeout_s = min(HEALTH_CHECK_TIMEOUT_S, remote_call_timeout())
    call_all(engines, "ping", role="engine", timeout_s=timeout_s)


__all__ = ["RemoteActorDied", "RemoteCallError", "RemoteCallTimeout", "actor_node", "call_all", "ping_engines",
           "remote_call_timeout", "set_remote_call_timeout", "wait_remote"]
