"""Deadlines on the online loop's remote calls (--remote_call_timeout): a hung or dead engine, an engine that dies
or hangs before it joins the weight broadcast group, a hung or dead trainer rank. Each gives an error naming the
role, the rank, the node and the method, within the deadline plus a few seconds (never an indefinite wait)."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from rlhfkit.errors import RemoteActorDied, RemoteCallTimeout
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout import remote
from rlhfkit.rollout.types import SamplingConfig

DEADLINE_S = 2.0
SLACK_S = 4.0  # Ray's own reporting of a failure on a loaded 2-core machine


@pytest.fixture
def short_deadline():
    """Call it to run ppo's `--remote_call_timeout 2` as a run's driver does (its process-wide deadline, set by
    build_setup's set_process_deadlines from the parsed flags) until the test ends."""
    from rlhfkit.config.parse import parse_config
    from rlhfkit.rl.setup import set_process_deadlines

    before = remote.remote_call_timeout(), remote.engine_hang_timeout()
    yield lambda: set_process_deadlines(parse_config("ppo", None, ["--remote_call_timeout", f"{DEADLINE_S:g}"]))
    remote.set_remote_call_timeout(before[0])
    remote.set_engine_hang_timeout(before[1])


def _named(err, text: str) -> None:
    """The message names `text` (method on role rank) and the node: 'on node <ip> (<node id>)'."""
    assert re.search(re.escape(text) + r" on node \d+\.\d+\.\d+\.\d+ \([0-9a-f]{12}\)", str(err)), str(err)


def _kill(ray, handle) -> None:
    """`ray.kill`, then wait until Ray's actor table says DEAD: the kill travels through the GCS while a call goes
    straight to the actor, so on a loaded machine a call sent right after the kill could still be answered."""
    from ray._private import state

    ray.kill(handle)
    for _ in range(300):
        if state.actors(handle._actor_id.hex()).get("State") == "DEAD":
            return
        time.sleep(0.1)
    raise AssertionError("the killed actor was not reported dead within 30 s")


def _timed(fn, *args, **kwargs):
    began = time.monotonic()
    with pytest.raises((RemoteCallTimeout, RemoteActorDied)) as info:
        fn(*args, **kwargs)
    took = time.monotonic() - began
    print(f"[deadline] {type(info.value).__name__} after {took:.2f} s: {str(info.value)[:90]}")  # docs/cluster.md
    return info.value, took


def test_hung_then_dead_engine_is_named_within_the_deadline(ray_cluster, tiny_model_dir, short_deadline):
    """A generate past --remote_call_timeout (SIGSTOP: alive to Ray, never answers), the health check (ping) of
    the hung engine, then of the killed one."""
    from rlhfkit.rollout.dispatch import generate_on_engines
    from rlhfkit.rollout.hf_engine import create_hf_engines

    [engine] = create_hf_engines(1, tiny_model_dir, dtype="float32", num_cpus_per_engine=0.25)
    pid = ray_cluster.get(engine.whereabouts.remote())["pid"]
    short_deadline()
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4, n=2, seed=1)
    os.kill(pid, signal.SIGSTOP)  # hung: alive to Ray, never answers
    try:
        err, took = _timed(generate_on_engines, [engine], [[1, 2, 3]], sampling)
        assert isinstance(err, RemoteCallTimeout) and err.method == "generate" and err.ranks == [0]
        _named(err, "generate on engine 0")
        assert f"within {DEADLINE_S:g} s" in str(err)
        assert DEADLINE_S <= took < DEADLINE_S + SLACK_S
        err, took = _timed(remote.ping_engines, [engine], timeout_s=1.0)  # the health check before each step
        assert isinstance(err, RemoteCallTimeout) and "ping on engine 0" in str(err) and took < 1.0 + SLACK_S
    finally:
        os.kill(pid, signal.SIGCONT)
    _kill(ray_cluster, engine)  # dead: named at once, not at the deadline
    err, took = _timed(remote.ping_engines, [engine])
    assert isinstance(err, RemoteActorDied)
    _named(err, "ping on engine 0")
    assert "the actor died" in str(err) and took < SLACK_S


class _FaultyEngine:
    """Injects a fault into the broadcast group's rendezvous: it answers `weight_sync_info`, then dies (or hangs)
    in `join_weight_group`, before it reaches the group."""

    def __init__(self, fault: str) -> None:
        self.fault = fault

    def weight_sync_info(self) -> dict:
        return {"workers": 1, "cuda": False}

    def join_weight_group(self, *args) -> list[int]:
        if self.fault == "die":
            os._exit(1)
        time.sleep(3600)
        return [1]


def test_engine_that_dies_or_hangs_before_joining_the_broadcast_group_is_named(ray_cluster, short_deadline):
    """Was a 600 s wait in the sender's group constructor; now at once (dead) or at the deadline (hung)."""
    from rlhfkit.rollout.weight_broadcast import WeightBroadcaster

    short_deadline()
    faulty = ray_cluster.remote(_FaultyEngine)
    dying, hanging = faulty.options(num_cpus=0).remote("die"), faulty.options(num_cpus=0).remote("hang")
    ray_cluster.get([dying.weight_sync_info.remote(), hanging.weight_sync_info.remote()])  # both started
    err, took = _timed(WeightBroadcaster, [dying], "gloo", timeout_s=60.0)
    assert isinstance(err, RemoteActorDied) and err.method == "join_weight_group"
    _named(err, "join_weight_group on engine 0")
    assert took < SLACK_S
    err, took = _timed(WeightBroadcaster, [hanging], "gloo")  # the driver's deadline, 2 s
    assert isinstance(err, RemoteCallTimeout) and "join_weight_group on engine 0" in str(err)
    assert DEADLINE_S <= took < DEADLINE_S + SLACK_S
    ray_cluster.kill(hanging)


def test_hung_then_dead_trainer_rank_is_named(ray_cluster, short_deadline):
    """A model-group call (what every actor / reference / critic / reward step is) past --remote_call_timeout, or
    to a rank that died, names the role, the rank, the node and the method."""
    from ray.util.placement_group import remove_placement_group

    from rlhfkit.config.parse import parse_config
    from rlhfkit.rl.group import ModelGroup, make_placement_group

    pg = make_placement_group(1, 1, 0.5)
    group = ModelGroup("critic", parse_config("ppo", None, ["--verbose"]), pg, 1)
    try:
        [pid] = [w["pid"] for w in group.call(ModelWorker.whereabouts)]
        short_deadline()
        os.kill(pid, signal.SIGSTOP)
        try:
            err, took = _timed(group.call, ModelWorker.compute_threads)
            assert isinstance(err, RemoteCallTimeout) and err.role == "critic" and err.ranks == [0]
            _named(err, "compute_threads on critic rank 0")
            assert DEADLINE_S <= took < DEADLINE_S + SLACK_S
        finally:
            os.kill(pid, signal.SIGCONT)
        _kill(ray_cluster, group.workers[0])
        err, took = _timed(group.call, ModelWorker.compute_threads)
        assert isinstance(err, RemoteActorDied) and err.ranks == [0] and took < SLACK_S
        _named(err, "compute_threads on critic rank 0")
    finally:
        group.shutdown()
        remove_placement_group(pg)


class _Whereabouts:
    """Injects a fault into the start-up's placement record: `whereabouts` answers, or hangs (sleeps)."""

    def __init__(self, hang: bool) -> None:
        self.hang = hang

    def whereabouts(self) -> dict:
        if self.hang:
            time.sleep(3600)
        return {"pid": os.getpid()}


def test_hung_rank_or_engine_in_collect_whereabouts_is_named(ray_cluster, short_deadline):
    """The driver asks every rank and engine where it runs at start-up (manifest.json `placement`): a hung actor
    there hits the deadline and is named, as in any other call of the run."""
    from types import SimpleNamespace

    from rlhfkit.rl.placement import collect_whereabouts

    cls = ray_cluster.remote(_Whereabouts).options(num_cpus=0)
    fine, hung, engine_fine, engine_hung = cls.remote(False), cls.remote(True), cls.remote(False), cls.remote(True)
    try:
        ray_cluster.get([fine.whereabouts.remote(), engine_fine.whereabouts.remote()])  # started
        short_deadline()
        group = SimpleNamespace(role="actor", heartbeats=None, workers=[fine, hung])
        err, took = _timed(collect_whereabouts, [group], [engine_fine])
        assert isinstance(err, RemoteCallTimeout) and (err.role, err.ranks, err.method) == \
            ("actor", [1], "whereabouts")
        _named(err, "whereabouts on actor rank 1")
        assert DEADLINE_S <= took < DEADLINE_S + SLACK_S
        err, took = _timed(collect_whereabouts, [SimpleNamespace(role="actor", heartbeats=None, workers=[fine])],
                           [engine_fine, engine_hung])
        assert isinstance(err, RemoteCallTimeout) and err.ranks == [1]
        _named(err, "whereabouts on engine 1")
        assert DEADLINE_S <= took < DEADLINE_S + SLACK_S
        _kill(ray_cluster, hung)  # dead: named at once
        err, took = _timed(collect_whereabouts, [group], [])
        assert isinstance(err, RemoteActorDied) and took < SLACK_S
        _named(err, "whereabouts on actor rank 1")
        placed = collect_whereabouts([SimpleNamespace(role="actor", heartbeats=None, workers=[fine])], [engine_fine])
        assert [sorted(p) for p in placed] == [["pid"], ["engine", "pid"]] and placed[1]["engine"] == 0
    finally:
        for handle in (fine, hung, engine_fine, engine_hung):
            ray_cluster.kill(handle)


class _Peer:
    """One rank of a collective: `step` raises what a collective raises when its peer is gone (after `after` s),
    or exits (the peer dying, reported by Ray only later), or raises an ordinary error of its own code."""

    def ready(self) -> bool:
        return True

    def step(self, what: str, after: float) -> int:
        time.sleep(after)
        if what == "die":
            os._exit(1)
        if what == "peer lost":
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.8]:38575")
        raise ValueError("a bug in rank 0's own code")


def test_survivor_losing_its_peer_first_names_the_dead_peer(ray_cluster):
    """A lost node's rank is reported dead by Ray after its peer's collective already failed ('Connection closed
    by peer'): the error names the dead rank (RemoteActorDied), with the survivor's error as the cause. An ordinary
    error of a rank's own code passes through as it is, without waiting for the others."""
    from rlhfkit.rl.group import Pending

    peer = ray_cluster.remote(_Peer).options(num_cpus=0)
    survivor, dying, buggy, waiting = (peer.remote() for _ in range(4))
    ray_cluster.get([h.ready.remote() for h in (survivor, dying, buggy, waiting)])  # all started
    pending = Pending([survivor.step.remote("peer lost", 0.0), dying.step.remote("die", 1.0)], list,
                      ("actor", "train_policy_step", [survivor, dying]))
    err, took = _timed(pending.get)
    assert isinstance(err, RemoteActorDied) and (err.role, err.ranks) == ("actor", [1])
    _named(err, "train_policy_step on actor rank 1")
    assert "actor rank 0 on node" in str(err) and "Connection closed by peer" in str(err)
    assert "Connection closed by peer" in str(err.__cause__) and 1.0 <= took < 30.0
    began = time.monotonic()
    with pytest.raises(ValueError, match="own code"):
        Pending([buggy.step.remote("bug", 0.0), waiting.step.remote("bug", 30.0)], list,
                ("actor", "train_policy_step", [buggy, waiting])).get()
    assert time.monotonic() - began < 10.0  # not held back by the rank still in its step (30 s)
    for handle in (survivor, buggy, waiting):
        ray_cluster.kill(handle)
