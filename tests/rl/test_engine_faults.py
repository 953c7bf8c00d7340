"""Faults during a full run whose engines and model groups are created from the flags (2 actor ranks, one vLLM
engine, 3 GRPO steps), each compared with the same run uninterrupted (module fixture `uninterrupted`):

- a vLLM engine actor killed, then hung (SIGSTOP): restarted with the same options, given the actor's current
  weights, the interrupted work redone, the run finishes (--max_engine_restarts) with the uninterrupted metrics;
- a trainer rank killed mid-step while the other rank waits in a collective: the run stops at once with the error
  naming role, rank, node and method, the survivor is torn down, and --load_checkpoint from the last checkpoint
  finishes the run with the uninterrupted metrics."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from observers import AroundHealthCheck

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.data.synthetic import echo_rows, write_jsonl
from rlhfkit.errors import RemoteActorDied
from rlhfkit.rl import ppo_trainer
from rlhfkit.rl.worker import ModelWorker

HERE = Path(__file__).parent
# The per-step metrics a fault must not change: every rollout/, train/ and sync/ metric (rewards, lengths, losses,
# grad norms, entropy, the engine-vs-trainer log-prob check). The same prompts, the same per-sample seeds (a
# generation that is redone draws the samples the lost one would have), the same fp32 updates on the same 2 ranks:
# exact in practice (measured 0.0); the tolerance leaves room for the order in which threads sum.
COMPARED = ("rollout/", "train/", "sync/")
TOLERANCE = 1e-6


def run_flags(tmp: Path, **extra) -> dict:
    prompts = write_jsonl(echo_rows(12, seed=3), tmp / "prompts.jsonl")
    return {"pretrain": extra.pop("pretrain"), "prompt_data": prompts, "input_key": "input", "label_key": "label",
            "apply_chat_template": True, "remote_rm_url": str(HERE / "letters_reward.py"),
            "advantage_estimator": "group_norm", "n_samples_per_prompt": 4, "rollout_batch_size": 4,
            "train_batch_size": 16, "micro_train_batch_size": 8, "micro_rollout_batch_size": 16,
            "generate_max_len": 8, "prompt_max_len": 128, "actor_learning_rate": 3e-2, "lr_warmup_ratio": 0.0,
            "init_kl_coef": 0.0, "num_episodes": 1, "seed": 5, "vllm_kv_cache_mb": 32, "enforce_eager": True,
            "max_samples": 12, "remote_call_timeout": 120.0, "actor_num_gpus_per_node": 2,
            "run_dir": str(tmp / "run"), "save_path": str(tmp / "hf"), "ckpt_path": str(tmp / "ckpt"), **extra}


def metrics_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_metrics(rows: list[dict], reference: list[dict], label: str) -> float:
    """Each of `rows` equals the reference run's row of the same step on COMPARED; returns the largest relative
    difference seen."""
    by_step, worst = {r["step"]: r for r in reference}, 0.0
    for row in rows:
        ref = by_step[row["step"]]
        keys = [k for k in ref if k.startswith(COMPARED)]
        assert {"train/policy_loss", "train/grad_norm", "rollout/reward_mean", "sync/logprob_diff"} <= set(keys)
        for key in keys:
            assert row[key] == pytest.approx(ref[key], rel=TOLERANCE, abs=TOLERANCE), (label, row["step"], key)
            worst = max(worst, abs(row[key] - ref[key]) / max(abs(ref[key]), 1e-12))
    print(f"\n[faults] {label}: steps {[r['step'] for r in rows]} equal the uninterrupted run's, largest relative "
          f"difference {worst:.1e}")
    return worst


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tiny_model_dir, tmp_path_factory) -> list[dict]:
    """The 3-step run without faults: the reference every fault test compares with."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    ppo_trainer.train_ppo(parse_config("ppo", None, flags_to_argv(run_flags(tmp, pretrain=tiny_model_dir))))
    rows = metrics_rows(tmp / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    return rows


def test_killed_then_hung_engine_is_restarted_synced_and_the_run_finishes(uninterrupted, ray_cluster, tiny_model_dir,
                                                                          tmp_path, monkeypatch):
    """Step 2: ray.kill of the engine after its health check, so step 2's generate finds it dead (RemoteActorDied
    naming engine 0). Step 3: SIGSTOP of the new engine before the health check, whose ping passes its deadline
    (RemoteCallTimeout; 2 s here). Each time the run restarts the engine (--max_engine_restarts 2), pushes the
    actor's current weights into it, redoes the interrupted work and goes on; --remote_call_timeout bounds every
    other call. The recovered steps equal the uninterrupted run's."""
    from rlhfkit.rollout import remote

    monkeypatch.setattr(remote, "HEALTH_CHECK_TIMEOUT_S", 2.0)
    flags = run_flags(tmp_path, pretrain=tiny_model_dir, max_engine_restarts=2)
    killed: dict = {}

    def inject(s, step, when):
        if (step, when) == (2, "after health check"):
            killed["kill"] = s.engines[0]._actor_id.hex()
            ray_cluster.kill(s.engines[0])
        if (step, when) == (3, "before health check"):
            killed["stop"] = s.engines[0]._actor_id.hex()
            os.kill(ray_cluster.get(s.engines[0].whereabouts.remote())["pid"], signal.SIGSTOP)
            killed["stopped_at"] = time.monotonic()

    ppo_trainer.train_ppo(parse_config("ppo", None, flags_to_argv(flags)), observer=AroundHealthCheck(inject))
    rows = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]  # the run finished
    assert [r["fault/engine_restarts"] for r in rows] == [0, 1, 2]
    assert "time/engine_restart" in rows[1] and "time/engine_restart" not in rows[0]
    assert all(r["sync/logprob_diff"] <= 1e-3 for r in rows)  # the new engines compute with the trainer's weights
    killed_event, hung_event = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text()
                                .splitlines()]
    assert (killed_event["event"], killed_event["engines"], killed_event["step"], killed_event["fault"],
            killed_event["method"]) == ("engine_restart", [0], 2, "RemoteActorDied", "generate")
    assert "generate on engine 0 on node" in killed_event["error"]
    assert (hung_event["engines"], hung_event["step"], hung_event["fault"], hung_event["method"]) == \
        ([0], 3, "RemoteCallTimeout", "ping")
    assert "ping on engine 0 on node" in hung_event["error"] and 1.9 <= hung_event["detected_after_s"] < 6.0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    [engine] = [e for e in manifest["placement"] if e["role"] == "engine"]
    assert engine["actor_id"] not in (killed["kill"], killed["stop"])
    assert engine["prompts_generated"] == 4  # step 3 ran on the third engine
    for name, event, row in (("killed", killed_event, rows[1]), ("hung", hung_event, rows[2])):
        print(f"\n[faults] engine {name}: detected after {event['detected_after_s']:.2f} s, restarted and synced in "
              f"{event['recovered_in_s']:.1f} s; step {row['step']} took {row['time/step']:.1f} s "
              f"(step 1: {rows[0]['time/step']:.1f} s)")
    # nothing lost: step 2's generation redone with its prompts and seeds on the new engine, step 3 on the third
    assert_same_metrics(rows, uninterrupted, "engine killed at step 2, hung at step 3")


def test_killed_trainer_rank_stops_the_run_at_once_and_the_checkpoint_finishes_it(uninterrupted, ray_cluster,
                                                                                  tiny_model_dir, tmp_path,
                                                                                  monkeypatch):
    """Step 2: actor rank 1 killed (ray.kill) after the health check, so rank 0 enters the training step's first
    FSDP collective without it. The driver's wait on the step names the dead rank at once (RemoteActorDied:
    train_policy_step, actor rank 1, its node), not at --remote_call_timeout (120 s here); the survivor is not left
    in its collective (gloo sees the dead peer's sockets close and raises there), and the run's clean-up kills it;
    --load_checkpoint from step 1's checkpoint runs steps 2-3 to the uninterrupted run's metrics."""
    from rlhfkit.rl.group import Pending
    from rlhfkit.rl.setup import RLSetup
    from rlhfkit.rollout.remote import RemoteActors

    flags = run_flags(tmp_path, pretrain=tiny_model_dir, save_steps=1)
    seen: dict = {}

    def inject(s, step, when):
        if (step, when) == (2, "after health check"):
            actor = RemoteActors(s.actor.workers, role="actor")
            [seen["survivor"], seen["victim"]] = actor.call(ModelWorker.whereabouts)
            ray_cluster.kill(s.actor.workers[1])
            seen["killed_at"] = time.monotonic()

    real_get, real_close = Pending.get, RLSetup.close

    def get(pending):  # the driver's wait on a group call: keep the refs of the call that failed
        try:
            return real_get(pending)
        except RemoteActorDied:
            seen["refs"] = pending.refs
            raise

    def close(s):  # the run's clean-up after the error: first see what became of the survivor's call
        seen["raised_at"] = time.monotonic()
        if "refs" in seen:
            try:
                ray_cluster.get(seen["refs"][0], timeout=30)
            except Exception as survivor_err:  # noqa: BLE001 - what the survivor's own call raised
                seen["survivor_error"] = str(survivor_err)
            seen["survivor_done_s"] = time.monotonic() - seen["killed_at"]
        real_close(s)

    monkeypatch.setattr(RLSetup, "close", close)
    monkeypatch.setattr(Pending, "get", get)
    with pytest.raises(RemoteActorDied) as info:
        ppo_trainer.train_ppo(parse_config("ppo", None, flags_to_argv(flags)), observer=AroundHealthCheck(inject))
    detected_s = seen["raised_at"] - seen["killed_at"]
    err = info.value
    assert (err.role, err.ranks) == ("actor", [1])
    node = seen["victim"]["node_id"][:12]
    assert f"{err.method} on actor rank 1 on node " in str(err) and f"({node})" in str(err), str(err)
    assert "the actor died" in str(err)
    assert detected_s < 60.0  # named when Ray reports the death, far before the 120 s deadline
    # the survivor was not left in its collective: gloo saw the dead peer's sockets close and raised in it
    assert "Connection closed by peer" in seen["survivor_error"] and "train_policy_step" in seen["survivor_error"]
    for _ in range(100):  # torn down: the survivor's process (in its collective) is gone
        if not Path(f"/proc/{seen['survivor']['pid']}").exists():
            break
        time.sleep(0.1)
    assert not Path(f"/proc/{seen['survivor']['pid']}").exists()
    assert not Path(f"/proc/{seen['victim']['pid']}").exists()
    rows = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1] and (tmp_path / "ckpt" / "actor").is_dir()
    print(f"\n[faults] actor rank 1 killed at step 2: {type(err).__name__} ({err.method}) raised {err.waited_s:.2f} s "
          f"after the call, {detected_s:.2f} s after the kill (the step's generation in between); the survivor's "
          f"collective raised by {seen['survivor_done_s']:.2f} s after the kill")

    monkeypatch.setattr(RLSetup, "close", real_close)
    resumed_flags = {**flags, "load_checkpoint": True, "run_dir": str(tmp_path / "resumed")}
    began = time.monotonic()
    ppo_trainer.train_ppo(parse_config("ppo", None, flags_to_argv(resumed_flags)))
    resumed = metrics_rows(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [2, 3]
    print(f"[faults] resumed from step 1's checkpoint, steps 2-3 in {time.monotonic() - began:.1f} s")
    assert_same_metrics(rows + resumed, uninterrupted, "trainer rank killed at step 2, resumed from step 1")
