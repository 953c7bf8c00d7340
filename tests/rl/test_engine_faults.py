"""Faults survived: a vLLM engine actor killed, then hung (SIGSTOP), during a run whose engines are created from the
flags is restarted with the same options, given the actor's current weights, and the run finishes
(--max_engine_restarts)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.config.rl_options import RL_GROUPS
from rlhfkit.data.synthetic import echo_rows, write_jsonl
from rlhfkit.rl import ppo_trainer

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def test_killed_then_hung_engine_is_restarted_synced_and_the_run_finishes(ray_cluster, tiny_model_dir, tmp_path,
                                                                          monkeypatch):
    """Step 2: ray.kill of the engine after its health check, so step 2's generate finds it dead (RemoteActorDied
    naming engine 0). Step 3: SIGSTOP of the new engine before the health check, whose ping passes its deadline
    (RemoteCallTimeout; 2 s here). Each time the run restarts the engine (--max_engine_restarts 2), pushes the
    actor's current weights into it, redoes the interrupted work and goes on; --remote_call_timeout bounds every
    other call."""
    from rlhfkit.rollout import remote

    monkeypatch.setattr(remote, "HEALTH_CHECK_TIMEOUT_S", 2.0)
    prompts = write_jsonl(echo_rows(12, seed=3), tmp_path / "prompts.jsonl")
    flags = {"pretrain": tiny_model_dir, "prompt_data": prompts, "input_key": "input", "label_key": "label",
             "apply_chat_template": True, "remote_rm_url": str(HERE / "letters_reward.py"),
             "advantage_estimator": "group_norm", "n_samples_per_prompt": 4, "rollout_batch_size": 4,
             "train_batch_size": 16, "micro_train_batch_size": 16, "micro_rollout_batch_size": 16,
             "generate_max_len": 8, "prompt_max_len": 128, "actor_learning_rate": 3e-2, "lr_warmup_ratio": 0.0,
             "init_kl_coef": 0.0, "num_episodes": 1, "seed": 5, "vllm_kv_cache_mb": 32, "enforce_eager": True,
             "max_samples": 12, "remote_call_timeout": 120.0, "max_engine_restarts": 2,
             "run_dir": str(tmp_path / "run"), "save_path": str(tmp_path / "hf"), "ckpt_path": str(tmp_path / "ckpt")}
    killed: dict = {}

    def inject(s, step, when):
        if (step, when) == (2, "after health check"):
            killed["kill"] = s.engines[0]._actor_id.hex()
            ray_cluster.kill(s.engines[0])
        if (step, when) == (3, "before health check"):
            killed["stop"] = s.engines[0]._actor_id.hex()
            os.kill(ray_cluster.get(s.engines[0].whereabouts.remote())["pid"], signal.SIGSTOP)
            killed["stopped_at"] = time.monotonic()

    monkeypatch.setattr(ppo_trainer, "FAULT_HOOK", inject)
    ppo_trainer.train_ppo(parse_config("ppo", RL_GROUPS, flags_to_argv(flags)))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
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
