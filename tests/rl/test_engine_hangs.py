"""Hangs inside an engine call (--engine_hang_timeout): while a call runs, the driver probes each engine still
working with `ping`, which the engine serves on a thread of its own (a Ray concurrency group). A stopped engine
(SIGSTOP: alive to Ray, answers nothing) is declared hung within the hang timeout, not at --remote_call_timeout
(1800 s by default), and is handled as a dead one; a live engine answers the probe however long its generation,
so a long generation is never interrupted.

- the probe itself, on a real engine actor: a stopped engine's generate raises `RemoteActorHung` naming it within
  the hang timeout; with --engine_hang_timeout 0 the same wait runs to the deadline; a long generate on a live
  engine with a hang timeout far shorter than it finishes, its probes answered all along;
- full GRPO runs (2 actor ranks, one vLLM engine from the flags): with default flags, an engine stopped just before
  step 2's generation is restarted within 120 s of the stop and the run finishes; with a 0.5 s hang timeout, a
  generation of several seconds finishes with no restart."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from observers import AroundHealthCheck
from test_engine_faults import metrics_rows, run_flags

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.errors import RemoteActorHung, RemoteCallTimeout
from rlhfkit.rl import engine_faults, ppo_trainer
from rlhfkit.rollout import remote
from rlhfkit.rollout.types import SamplingConfig

SLACK_S = 4.0  # Ray's own round trips on a loaded 2-core machine


@pytest.fixture
def process_settings():
    """The driver's process-wide --engine_hang_timeout and --remote_call_timeout, restored after the test (a run
    sets them for its process)."""
    hang, deadline = remote.engine_hang_timeout(), remote.remote_call_timeout()
    yield
    remote.set_engine_hang_timeout(hang)
    remote.set_remote_call_timeout(deadline)


class ProbeSpy:
    """Records the probes the driver sends (`LivenessProbes.check`, wrapped): the distinct probe refs, so a test
    can tell that a long call was probed, and answered, many times."""

    def __init__(self, monkeypatch) -> None:
        self.sent: set = set()
        real = remote.LivenessProbes.check

        def check(probes, working, now):
            hung = real(probes, working, now)
            self.sent.update(ref for ref, _ in probes.in_flight.values())
            return hung

        monkeypatch.setattr(remote.LivenessProbes, "check", check)


def test_stopped_engine_is_named_hung_within_the_hang_timeout_and_0_turns_the_probe_off(ray_cluster, tiny_model_dir,
                                                                                      process_settings):
    """generate on a SIGSTOPped engine with --engine_hang_timeout 2 (deadline 600 s): RemoteActorHung naming
    engine 0, its node and generate, 2 s to 2.5 s (+ slack) into the call. With --engine_hang_timeout 0 the same
    wait runs to the deadline (3 s here) and raises the plain RemoteCallTimeout."""
    from rlhfkit.rollout.dispatch import generate_on_engines
    from rlhfkit.rollout.hf_engine import create_hf_engines

    [engine] = create_hf_engines(1, tiny_model_dir, dtype="float32", num_cpus_per_engine=0.25)
    pid = ray_cluster.get(engine.whereabouts.remote())["pid"]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4, n=2, seed=1)
    remote.set_remote_call_timeout(600.0)
    remote.set_engine_hang_timeout(2.0)
    os.kill(pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        with pytest.raises(RemoteActorHung) as info:
            generate_on_engines([engine], [[1, 2, 3]], sampling)
        took = time.monotonic() - began
        err = info.value
        assert (err.role, err.ranks, err.method) == ("engine", [0], "generate")
        assert "generate on engine 0 on node " in str(err) and "--engine_hang_timeout" in str(err)
        assert 2.0 <= took < 2.0 + 0.5 + SLACK_S, took
        print(f"\n[hang] stopped engine named hung after {took:.2f} s (--engine_hang_timeout 2)")

        remote.set_engine_hang_timeout(0.0)  # no probes: --remote_call_timeout alone
        remote.set_remote_call_timeout(3.0)
        began = time.monotonic()
        with pytest.raises(RemoteCallTimeout) as info:
            generate_on_engines([engine], [[1, 2, 3]], sampling)
        took = time.monotonic() - began
        assert not isinstance(info.value, RemoteActorHung) and "within 3 s" in str(info.value)
        assert 3.0 <= took < 3.0 + SLACK_S, took
    finally:
        os.kill(pid, signal.SIGCONT)
        ray_cluster.kill(engine)


def test_long_generation_on_a_live_engine_outlasts_the_hang_timeout(ray_cluster, tiny_model_dir, process_settings,
                                                                    monkeypatch):
    """A generate lasting several times --engine_hang_timeout (2 s here: a probe every 0.5 s) on a live engine
    finishes with every sample: the probes, served beside the generation, were answered all along. The work (32
    prompts x 2 samples x 128 forced tokens, one prompt at a time) is sized to outlast 3 timeouts on a quiet machine,
    and the timeout to stay far above a probe's answer time on a loaded one (1.5 s seen at load 18 on 2 cores)."""
    from rlhfkit.rollout.dispatch import generate_on_engines
    from rlhfkit.rollout.hf_engine import create_hf_engines

    [engine] = create_hf_engines(1, tiny_model_dir, dtype="float32", num_cpus_per_engine=0.25)
    spy = ProbeSpy(monkeypatch)
    remote.set_engine_hang_timeout(2.0)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=128, n=2, seed=1, ignore_eos=True)
    prompts = [[1 + i % 50, 2, 3 + i % 7] for i in range(32)]
    try:
        began = time.monotonic()
        samples = generate_on_engines([engine], prompts, sampling)
        took = time.monotonic() - began
    finally:
        ray_cluster.kill(engine)
    assert len(samples) == 64 and all(len(s.response_ids) == 128 for s in samples)
    assert took > 3 * 2.0, f"the generation took {took:.2f} s: too short to show anything"
    assert len(spy.sent) >= 4  # probed all along (every 0.5 s once due), each answered within 2 s
    print(f"\n[hang] live generate of {took:.1f} s, {len(spy.sent)} probes answered (--engine_hang_timeout 2)")


@pytest.mark.slow
def test_engine_stopped_mid_run_is_restarted_within_120_s_with_default_flags(ray_cluster, tiny_model_dir, tmp_path,
                                                                           monkeypatch, process_settings):
    """Default --engine_hang_timeout (60) and --remote_call_timeout (1800): SIGSTOP of the engine after step 2's
    health check, so step 2's generate goes to a stopped engine. The probe names it hung (RemoteActorHung,
    generate, engine 0) about 60 s later; the run kills it, starts a new one, pushes the actor's weights into it,
    redoes step 2's generation and finishes. Stop to recovered: under 120 s."""
    flags = run_flags(tmp_path, pretrain=tiny_model_dir)
    del flags["remote_call_timeout"]  # the default, 1800 s
    seen: dict = {}

    def inject(s, step, when):
        if (step, when) == (2, "after health check"):
            seen["stopped"] = s.engines[0]._actor_id.hex()
            os.kill(ray_cluster.get(s.engines[0].whereabouts.remote())["pid"], signal.SIGSTOP)
            seen["stopped_at"] = time.monotonic()

    real_recover = engine_faults.EngineFaults.recover

    def recover(faults, fault, what, raised):  # when the new engine is up and synced
        real_recover(faults, fault, what, raised)
        seen["recovered_at"] = time.monotonic()

    monkeypatch.setattr(engine_faults.EngineFaults, "recover", recover)
    cfg = parse_config("ppo", None, flags_to_argv(flags))
    assert (cfg.engine_hang_timeout, cfg.remote_call_timeout) == (60.0, 1800.0)
    ppo_trainer.train_ppo(cfg, observer=AroundHealthCheck(inject))
    finished = time.monotonic() - seen["stopped_at"]
    recovered = seen["recovered_at"] - seen["stopped_at"]
    rows = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]  # the run finished
    assert [r["fault/engine_restarts"] for r in rows] == [0, 1, 1]
    [event] = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert (event["event"], event["engines"], event["step"], event["fault"], event["method"], event["during"]) == \
        ("engine_restart", [0], 2, "RemoteActorHung", "generate", "generation")
    assert "generate on engine 0 on node" in event["error"] and "--engine_hang_timeout" in event["error"]
    assert 60.0 <= event["detected_after_s"] < 60.0 + remote.PROBE_INTERVAL_MAX_S + SLACK_S
    assert recovered < 120.0, f"stopped at step 2, recovered {recovered:.1f} s later"
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    [engine] = [e for e in manifest["placement"] if e["role"] == "engine"]
    assert engine["actor_id"] != seen["stopped"] and engine["prompts_generated"] == 8  # steps 2 (redone) and 3
    assert all(r["sync/logprob_diff"] <= 1e-3 for r in rows)  # the new engine computes with the trainer's weights
    print(f"\n[hang] engine stopped at step 2: named hung {event['detected_after_s']:.1f} s into generate, restarted "
          f"and synced in {event['recovered_in_s']:.1f} s, recovered {recovered:.1f} s after the stop; the run "
          f"finished {finished:.1f} s after it")


@pytest.mark.slow
def test_long_generation_in_a_run_is_not_interrupted_by_a_short_hang_timeout(ray_cluster, tiny_model_dir, tmp_path,
                                                                           monkeypatch, process_settings):
    """--engine_hang_timeout 0.5 and a generation several times longer (384 new tokens x 16 samples on the vLLM
    engine: 2.2 s on a quiet machine, more under load): probed every 0.125 s throughout, never declared hung; one
    step, no restart."""
    spy = ProbeSpy(monkeypatch)
    flags = run_flags(tmp_path, pretrain=tiny_model_dir, engine_hang_timeout=0.5, generate_max_len=384,
                      max_samples=4, vllm_kv_cache_mb=64)
    ppo_trainer.train_ppo(parse_config("ppo", None, flags_to_argv(flags)))
    [row] = metrics_rows(tmp_path / "run")
    assert row["fault/engine_restarts"] == 0 and not (tmp_path / "run" / "events.jsonl").exists()
    assert row["time/generation"] > 3 * 0.5, f"generation took {row['time/generation']:.2f} s: too short"
    assert row["rollout/response_length_mean"] > 64  # long responses: the tiny random model rarely draws EOS
    assert len(spy.sent) >= 3  # probed repeatedly (5 to 11 seen), each answered within 0.5 s
    print(f"\n[hang] generation of {row['time/generation']:.1f} s with --engine_hang_timeout 0.5: {len(spy.sent)} "
          "probes answered, no restart")
