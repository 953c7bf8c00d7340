"""Online RL options end to end: dynamic filtering, dynamic batch, the zero reward policy, joining a cluster."""

from __future__ import annotations

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


def test_dynamic_batch_gives_the_same_update(grpo_one_step, tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                            tmp_path):
    fixed_out, fixed = grpo_one_step  # the session's fixed-batch step of the same flags (tests/rl/conftest.py)
    dynamic = run(tiny_model_dir, echo_prompt_file, tmp_path / "dynamic", rollout_vllm_engine, max_samples=4,
                  use_dynamic_batch=True, train_max_tokens_per_gpu=300, rollout_max_tokens_per_gpu=200)
    assert_same_step(fixed, dynamic, fixed_out, tmp_path / "dynamic", tiny_model_dir)


def test_zero_policy_scores_failing_samples_zero_and_counts_them(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                                 tmp_path, monkeypatch):
    monkeypatch.setenv("FAIL_ON_RED", "1")
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, max_samples=8, rollout_batch_size=8,
               train_batch_size=64, remote_rm_url=str(HERE / "prompt_dependent_reward.py"),
               reward_error_policy="zero")
    red = sum("red" in r["input"] for r in echo_rows(48, seed=3)[:8])
    assert rows[0]["rollout/reward_failed"] == red * 8
