"""Online RL options end to end: dynamic filtering, dynamic batch, the zero reward policy, joining a cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ppo_helpers import assert_same_step, run

from rlhfkit.data.synthetic import echo_rows

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def test_dynamic_filtering_drops_all_equal_groups_and_refills(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                              tmp_path):
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, max_samples=12, rollout_batch_size=4,
               dynamic_filtering=True, remote_rm_url=str(HERE / "prompt_dependent_reward.py"))
    red = sum("red" in r["input"] for r in echo_rows(48, seed=3)[:12])
    assert red > 0  # the fixture data has prompts whose groups are all 1
    for row in rows:
        assert row["filter/kept_groups"] == 4
        assert row["rollout/reward_mean"] < 0.9  # no all-1 group survived
    assert sum(r["filter/sampled_groups"] for r in rows) > 4 * len(rows)


def test_dynamic_batch_gives_the_same_update(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    fixed = run(tiny_model_dir, echo_prompt_file, tmp_path / "fixed", rollout_vllm_engine, max_samples=4)
    dynamic = run(tiny_model_dir, echo_prompt_file, tmp_path / "dynamic", rollout_vllm_engine, max_samples=4,
                  use_dynamic_batch=True, train_max_tokens_per_gpu=300, rollout_max_tokens_per_gpu=200)
    assert_same_step(fixed, dynamic, tmp_path / "fixed", tmp_path / "dynamic", tiny_model_dir)


def test_zero_policy_scores_failing_samples_zero_and_counts_them(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                                 tmp_path, monkeypatch):
    monkeypatch.setenv("FAIL_ON_RED", "1")
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, max_samples=8, rollout_batch_size=8,
               train_batch_size=64, remote_rm_url=str(HERE / "prompt_dependent_reward.py"),
               reward_error_policy="zero")
    red = sum("red" in r["input"] for r in echo_rows(48, seed=3)[:8])
    assert rows[0]["rollout/reward_failed"] == red * 8


def test_joins_a_running_cluster_by_address(tiny_model_dir, echo_prompt_file, ray_cluster, tmp_path):
    address = ray_cluster.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "rlhfkit.cli.ppo", "--ray_address", address, "--pretrain", tiny_model_dir,
           "--prompt_data", echo_prompt_file, "--input_key", "input", "--apply_chat_template", "--max_samples", "4",
           "--remote_rm_url", str(HERE / "letters_reward.py"), "--advantage_estimator", "group_norm",
           "--n_samples_per_prompt", "4", "--rollout_batch_size", "4", "--train_batch_size", "16",
           "--generate_max_len", "4", "--prompt_max_len", "128", "--init_kl_coef", "0", "--vllm_kv_cache_mb", "16",
           "--enforce_eager", "--run_dir", str(tmp_path / "run"), "--save_path", str(tmp_path / "hf")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Started a local Ray instance" not in done.stderr
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["train/grad_norm"] > 0
    # A quiet console (no --verbose): the table, the bar and rlhfkit's own lines; vLLM's and the workers' logs are
    # in the run folder, one file per model rank and engine.
    console = (done.stdout + done.stderr).splitlines()
    table = [line for line in console if line[:1] in "┌│├└" or line.strip() == "rlhfkit ppo"]
    rest = [line for line in console if line not in table and line.strip()]
    assert len(table) > 15 and len(rest) <= 12, "\n".join(rest)
    assert not any("VLLMEngine" in line or "ModelWorker" in line or "vllm" in line.lower() for line in rest), rest
    logs = tmp_path / "run" / "logs"
    assert "Initializing a V1 LLM engine" in (logs / "engine0.log").read_text()
    assert (logs / "actor_rank0.log").exists()
