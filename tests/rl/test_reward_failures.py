"""One bad sample costs that sample, not the run (issue #28): a GRPO run whose reward file sees a 5,000-digit
number and program output that is not UTF-8 finishes, those samples score 0, metrics.jsonl counts them per reason
and samples.jsonl names each one's reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ppo_helpers import run

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def test_per_sample_reward_failures_score_zero_are_counted_and_traced(tiny_model_dir, echo_prompt_file,
                                                                     rollout_vllm_engine, tmp_path):
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, max_samples=4,
               remote_rm_url=str(HERE / "failing_verifiers_reward.py"))
    [step] = rows  # 4 prompts x 8 samples, one step: it finished
    assert step["reward/failed_number_too_long"] == 4.0 and step["reward/failed_undecodable_output"] == 4.0
    assert step["rollout/reward_failed"] == 8.0
    trace = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    train = [r for r in trace if r["kind"] == "train"]
    assert len(train) == 32
    for row in train:
        want = {0: "number_too_long", 1: "undecodable_output"}.get(row["sample_index"])
        assert row["reward_failure"] == want, row
        if want:
            assert row["reward"] == 0.0
