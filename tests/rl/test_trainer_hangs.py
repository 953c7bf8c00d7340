"""Hangs inside a model-group call (--trainer_hang_timeout): every model-worker rank beats to the job's heartbeat
board from a thread of its own (its compute stays on the main thread), and the driver's wait on a call checks the
beats of the ranks still working. A rank stopped (SIGSTOP: alive to Ray, answers nothing, beats no more) inside a
call is named hung within the hang timeout, not at --remote_call_timeout (1800 s by default), and killed; a live
rank beats however long its call, so a long step is never interrupted.

- one real ModelWorker rank (the tiny model, a log-prob pass over a big batch): stopped a moment into the call, it
  is named hung (`RemoteActorHung`: role, rank, node, method) within the 2 s hang timeout although the deadline is
  600 s, and its process is killed; the same call on a live rank, several times the 1 s hang timeout long, finishes;
- a full GRPO run (2 actor ranks, one vLLM engine from the flags), default flags: actor rank 1 stopped at step 2
  stops the run with the error naming it within 120 s of the stop, and no process of the run is left."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from observers import AroundHealthCheck
from test_engine_faults import metrics_rows, run_flags

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.errors import RemoteActorHung
from rlhfkit.rl import ppo_trainer
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout import heartbeat, remote

SLACK_S = 4.0  # Ray's own round trips on a loaded 2-core machine
VOCAB = 49152  # the tiny model's (SmolLM2's tokenizer): the LM head over it is most of a log-prob pass's work


@pytest.fixture
def process_settings():
    """The driver's process-wide --remote_call_timeout, restored after the test (a run sets it for its process)."""
    deadline = remote.remote_call_timeout()
    yield
    remote.set_remote_call_timeout(deadline)


@pytest.fixture
def reference_rank(ray_cluster, tiny_model_dir):
    """Make one frozen reference rank (the tiny model loaded) with a given --trainer_hang_timeout; torn down after."""
    from ray.util.placement_group import remove_placement_group

    from rlhfkit.rl.group import ModelGroup, make_placement_group

    made = []

    def make(hang_timeout: float):
        pg = make_placement_group(1, 1, 0.5)
        cfg = parse_config("ppo", None, ["--verbose", "--trainer_hang_timeout", str(hang_timeout),
                                         "--micro_rollout_batch_size", "8"])
        group = ModelGroup("ref", cfg, pg, 1)
        made.append((group, pg))
        group.call(ModelWorker.init_model, tiny_model_dir, False)
        return group

    yield make
    for group, pg in made:
        group.shutdown()
        remove_placement_group(pg)


def long_batch(rows: int, width: int = 96) -> dict[str, torch.Tensor]:
    """`rows` random sequences of 2 x `width` tokens, the second half the response: a log-prob pass of seconds."""
    gen = torch.Generator().manual_seed(0)
    return {"sequences": torch.randint(0, VOCAB, (rows, 2 * width), generator=gen),
            "attention_mask": torch.ones(rows, 2 * width, dtype=torch.long),
            "action_mask": torch.ones(rows, width, dtype=torch.bool)}


def process_gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.1)
    return not Path(f"/proc/{pid}").exists()


def test_rank_stopped_inside_a_call_is_named_hung_and_killed_within_the_hang_timeout(reference_rank,
                                                                                    process_settings):
    """A log-prob pass of several seconds on a reference rank with --trainer_hang_timeout 2 (deadline 600 s); the
    rank is SIGSTOPped 1 s into it. The wait raises RemoteActorHung naming ref rank 0, its node and log_probs
    within 2 s + one beat interval (0.5 s) + one board query (0.5 s) of the stop (+ slack), not at the deadline,
    and the stopped process is killed."""
    group = reference_rank(2.0)
    [where] = group.call(ModelWorker.whereabouts)
    remote.set_remote_call_timeout(600.0)
    pending = group.map_rows_async(ModelWorker.log_probs, long_batch(512))
    time.sleep(1.0)
    os.kill(where["pid"], signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        with pytest.raises(RemoteActorHung) as info:
            pending.get()
        took = time.monotonic() - stopped
    finally:
        if Path(f"/proc/{where['pid']}").exists():
            os.kill(where["pid"], signal.SIGCONT)
    err = info.value
    assert (err.role, err.ranks, err.method) == ("ref", [0], "log_probs")
    assert "log_probs on ref rank 0 on node " in str(err) and f"({where['node_id'][:12]})" in str(err), str(err)
    assert "no heartbeat for" in str(err) and "--trainer_hang_timeout 2" in str(err)
    # waited from the stop (the wait began then): its last beat came at most one beat interval (0.5 s) before it,
    # and the driver looks at the board every interval (+ the query's own round trip)
    assert 2.0 - 0.5 <= err.waited_s < 2.0 + 0.5 + 0.5 + SLACK_S, err.waited_s
    assert took < err.waited_s + heartbeat.KILL_WAIT_S + 1.0  # then killed (awaited) and raised
    assert process_gone(where["pid"], 10.0), "the stopped rank's process was not killed"
    print(f"\n[hang] ref rank stopped 1 s into log_probs: named hung {err.waited_s:.2f} s after the stop "
          f"(--trainer_hang_timeout 2), raised with its process killed {took:.2f} s after it")


def test_long_call_on_a_live_rank_outlasts_the_hang_timeout(reference_rank, process_settings, monkeypatch):
    """The same kind of log-prob pass, over twice --trainer_hang_timeout 3 long (a beat every 0.75 s), on a live
    rank finishes with every row: the rank beat all along from its heartbeat thread while its main thread computed.
    (The timeout leaves room for a 2-core machine at load 20, where a thread can wait a second to be scheduled.)"""
    looks: list[dict[int, float]] = []
    real = heartbeat.HeartbeatCheck.check

    def check(beats, working, now):  # record the silences the driver saw
        hung = real(beats, working, now)
        looks.append(dict(beats.silent_s))
        return hung

    monkeypatch.setattr(heartbeat.HeartbeatCheck, "check", check)
    group = reference_rank(3.0)
    assert group.call(ModelWorker.compute_threads)  # the rank is up (and beating)
    # sized from a measured probe so the call lasts about 3 timeouts on any CPU and load (384 rows took 5.5 s on a
    # quiet AMD EPYC Zen 5 once the fused log-probs landed: a fixed size goes stale as the forward gets faster)
    began = time.monotonic()
    group.map_rows(ModelWorker.log_probs, long_batch(96))
    per_row = (time.monotonic() - began) / 96
    rows = min(96 * 64, max(384, 96 * (int(9.0 / per_row) // 96 + 1)))
    looks.clear()
    began = time.monotonic()
    out = group.map_rows(ModelWorker.log_probs, long_batch(rows))
    took = time.monotonic() - began
    assert out.shape == (rows, 96) and torch.isfinite(out).all() and (out < 0).all()
    assert took > 2 * 3.0, f"the call took {took:.2f} s: too short to show anything"
    answered = [look[0] for look in looks if 0 in look]
    assert len(answered) >= 4 and max(answered) < 3.0  # looked at all along, never silent for the timeout
    print(f"\n[hang] live log_probs of {took:.1f} s with --trainer_hang_timeout 3: {len(looks)} looks at the "
          f"board, longest silence seen {max(answered):.2f} s")


def test_a_negative_trainer_hang_timeout_is_refused():
    from rlhfkit.errors import ConfigError
    from rlhfkit.rl.validate import validate_rl

    flags = ["--pretrain", "m", "--prompt_data", "p", "--remote_rm_url", "builtin:format"]
    with pytest.raises(ConfigError, match=r"--trainer_hang_timeout -1\.0: must be >= 0 seconds \(0 turns"):
        validate_rl(parse_config("ppo", None, [*flags, "--trainer_hang_timeout", "-1"]))
    validate_rl(parse_config("ppo", None, [*flags, "--trainer_hang_timeout", "0"]))  # 0: off


@pytest.mark.slow
def test_actor_rank_stopped_mid_run_stops_it_within_120_s_with_default_flags(ray_cluster, tiny_model_dir, tmp_path,
                                                                           monkeypatch, process_settings):
    """Default --trainer_hang_timeout (60) and --remote_call_timeout (1800): SIGSTOP of actor rank 1 after step
    2's health check, so the step's first call to the actor finds it stopped while rank 0 waits for it in an FSDP
    collective. The heartbeat check names it hung (RemoteActorHung, actor rank 1, its node) about 60 s after the
    stop, kills it, and the run stops with that error within 120 s of the stop; rank 0 (its peer gone) and the
    stopped process are both gone after the run's clean-up."""
    from rlhfkit.rl.setup import RLSetup
    from rlhfkit.rollout.remote import RemoteActors

    flags = run_flags(tmp_path, pretrain=tiny_model_dir)
    del flags["remote_call_timeout"]  # the default, 1800 s
    seen: dict = {}

    def inject(s, step, when):
        if (step, when) == (2, "after health check"):
            actor = RemoteActors(s.actor.workers, role="actor")
            [seen["survivor"], seen["victim"]] = actor.call(ModelWorker.whereabouts)
            os.kill(seen["victim"]["pid"], signal.SIGSTOP)
            seen["stopped_at"] = time.monotonic()

    real_close = RLSetup.close

    def close(s):
        seen.setdefault("raised_at", time.monotonic())
        real_close(s)

    monkeypatch.setattr(RLSetup, "close", close)
    cfg = parse_config("ppo", None, flags_to_argv(flags))
    assert (cfg.trainer_hang_timeout, cfg.remote_call_timeout) == (60.0, 1800.0)
    try:
        with pytest.raises(RemoteActorHung) as info:
            ppo_trainer.train_ppo(cfg, observer=AroundHealthCheck(inject))
    finally:
        if "victim" in seen and Path(f"/proc/{seen['victim']['pid']}").exists():
            os.kill(seen["victim"]["pid"], signal.SIGCONT)
    detected_s = seen["raised_at"] - seen["stopped_at"]
    err = info.value
    assert (err.role, err.ranks) == ("actor", [1])
    node = seen["victim"]["node_id"][:12]
    assert f"{err.method} on actor rank 1 on node " in str(err) and f"({node})" in str(err), str(err)
    assert "--trainer_hang_timeout 60" in str(err)
    assert 60.0 <= detected_s < 120.0, f"stopped at step 2, the run stopped {detected_s:.1f} s later"
    assert process_gone(seen["victim"]["pid"], 10.0), "the stopped rank's process is still there"
    assert process_gone(seen["survivor"]["pid"], 10.0), "the surviving rank's process is still there"
    assert [r["step"] for r in metrics_rows(tmp_path / "run")] == [1]
    print(f"\n[hang] actor rank 1 stopped at step 2: {type(err).__name__} ({err.method}) raised {detected_s:.1f} s "
          f"after the stop (found {err.waited_s:.1f} s into the wait)")
