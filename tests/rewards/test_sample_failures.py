"""A failure that belongs to one sample costs that sample (reward 0, a reason, a count), not the run (issue #28).

The built-ins' own per-sample failures (a number too long to convert, program output that is not UTF-8, one
program over its time limit), a user reward_func's reported failures, and the culprits of --reward_error_policy
zero all land in `extra_logs["reward_failure"]`; the online loop counts them per step (`reward/failed_<reason>`)
and writes each sample's reason to samples.jsonl (`reward_failure`)."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.errors import RewardFuncError
from rlhfkit.observability.trace import trace_rows
from rlhfkit.rewards.base import RewardOutput, failure_counts, failure_metrics, reason_name
from rlhfkit.rewards.reward_func import RewardFuncSource
from rlhfkit.rewards.sources import RewardSpec, build_reward_source, combine, reward_source_from_config
from rlhfkit.rewards.verifiers import math_reward_func
from rlhfkit.rl.make_experience import Timer, generate_and_score, merge_rollouts, select_groups, to_experience
from rlhfkit.rl.ppo_trainer import rollout_metrics
from rlhfkit.rollout.types import RolloutSample, SamplingConfig

HUGE = "7" * 5000  # over Python's 4,300-digit int-string conversion limit
ADD_OK = "```python\ndef add(a, b):\n    return a + b\n```"
ADD_TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
NOT_UTF8 = "```python\nimport sys\nsys.stdout.buffer.write(b'3\\xff\\xfe\\n')\n```"
ECHO_CASE = {"inputs": ["1 2\n"], "outputs": ["3\n"]}
SLOW = "```python\nimport time\ntime.sleep(60)\ndef add(a, b):\n    return a + b\n```"


def test_math_on_a_5000_digit_number_scores_that_sample_zero_with_the_reason():
    queries = ["Q: 2+2? A: " + HUGE, "Q: 2+2? A: 4", "Q: 1+1? A: 2"]
    out = build_reward_source("builtin:math")(queries, ["Q: 2+2? A: ", "Q: 2+2? A: ", "Q: 1+1? A: "],
                                              ["4", "4", HUGE])  # a huge label fails its sample too
    assert out.rewards.tolist() == [0.0, 1.0, 0.0] and out.scores.tolist() == [0.0, 1.0, 0.0]
    assert out.extra_logs["reward_failure"] == ["number_too_long", "", "number_too_long"]
    assert out.failed == 2 and out.extra_logs["reward_failed"].tolist() == [1.0, 0.0, 1.0]
    # the built-in itself (the reward_func shape a user file can call)
    assert math_reward_func(["x = " + HUGE], [""], [1])["extra_logs"]["reward_failure"] == ["number_too_long"]


def test_code_printing_bytes_that_are_not_utf8_scores_that_sample_zero_with_the_reason():
    source = build_reward_source("builtin:code", timeout=20)
    out = source(["P" + NOT_UTF8, "P" + ADD_OK], ["P", "P"], [ECHO_CASE, ADD_TESTS])
    assert out.rewards.tolist() == [0.0, 1.0] and out.scores.tolist() == [0.0, 1.0]
    assert out.extra_logs["reward_failure"] == ["undecodable_output", ""] and out.failed == 1


def test_one_slow_program_costs_only_its_sample_and_the_limit_is_per_program():
    """--reward_timeout bounds each program of builtin:code, not the batch: the slow sample scores 0 (`timeout`),
    the others keep their rewards although the whole batch takes longer than the limit."""
    source = reward_source_from_config(RewardSpec(remote_rm_url="builtin:code", reward_timeout=3))
    assert source.timeout is None  # no batch deadline: each program has its own
    out = source(["P" + ADD_OK, "P" + SLOW, "P" + ADD_OK, "P" + ADD_OK], ["P"] * 4, [ADD_TESTS] * 4)
    assert out.rewards.tolist() == [1.0, 0.0, 1.0, 1.0] and out.scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert out.extra_logs["reward_failure"] == ["", "timeout", "", ""] and out.failed == 1
    assert out.extra_logs["code_timeouts"].tolist() == [0.0, 2.0, 0.0, 0.0]
    assert out.extra_logs["code_pass_rate"].tolist() == [1.0, 0.0, 1.0, 1.0]


def test_a_reward_func_can_report_per_sample_failures_under_either_policy():
    def reward_func(queries, prompts, labels):
        return {"rewards": [1.0, 0.5, 0.25], "scores": [1.0, 1.0, 1.0],
                "extra_logs": {"reward_failure": ["", "Bad Format!", None]}}

    for policy in ("raise", "zero"):
        out = RewardFuncSource(reward_func, "rf", error_policy=policy)(["a", "b", "c"])
        assert out.rewards.tolist() == [1.0, 0.0, 0.25] and out.scores.tolist() == [1.0, 0.0, 1.0]
        assert out.extra_logs["reward_failure"] == ["", "Bad Format!", ""] and out.failed == 1
        assert failure_counts(out.extra_logs["reward_failure"]) == {"bad_format": 1}

    def malformed(queries, prompts, labels):
        return {"rewards": [1.0] * len(queries), "extra_logs": {"reward_failure": [0] * len(queries)}}

    with pytest.raises(RewardFuncError, match="must hold one reason string per sample"):
        RewardFuncSource(malformed, "bad")(["a"])


def test_zero_policy_culprits_get_short_reasons():
    def reward_func(queries, prompts, labels):
        if "boom" in queries:
            raise ValueError("cannot grade")
        return {"rewards": [float("nan") if q == "nan" else 1.0 for q in queries]}

    out = RewardFuncSource(reward_func, "rf", error_policy="zero")(["ok", "boom", "nan", "ok"])
    assert out.rewards.tolist() == [1.0, 0.0, 0.0, 1.0] and out.failed == 2
    assert out.extra_logs["reward_failure"] == ["", "error", "nonfinite", ""]
    assert "raised ValueError: cannot grade" in out.extra_logs["reward_error"][1]


def test_combined_sources_join_each_samples_reasons():
    def part(reasons):
        return RewardOutput(torch.zeros(3), torch.zeros(3), {"reward_failure": reasons})

    out = combine([part(["timeout", "", ""]), part(["nonfinite", "", "error"]),
                   RewardOutput(torch.ones(3), torch.ones(3))], ["a", "b", "rm"])
    assert out.extra_logs["reward_failure"] == ["timeout,nonfinite", "", "error"]
    assert failure_counts(out.extra_logs["reward_failure"]) == {"error": 1, "nonfinite": 1, "timeout": 1}
    assert failure_metrics({"timeout": 2}) == {"reward/failed_timeout": 2.0}
    assert reason_name(" Not UTF-8 / output ") == "not_utf_8_output" and reason_name("!!") == "unknown"


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def test_failures_reach_the_step_metrics_and_the_sample_trace():
    """generate_and_score -> (dynamic filtering) -> rollout_metrics / trace_rows: counts per reason over every scored
    sample, and each kept row's reason in samples.jsonl."""
    def reward_func(queries, prompts, labels):
        reasons = ["timeout" if q.endswith("b") else "number_too_long" if q.endswith("c") else "" for q in queries]
        return {"rewards": [1.0 if q.endswith("d") else 0.5 for q in queries],
                "extra_logs": {"reward_failure": reasons}}

    def generate(engines, prompt_ids, sampling):  # prompt 0: a, b (timeout); prompt 1: c (too long), d
        return [RolloutSample(p, j, ids, [2 * p + j], [-0.5], "stop", {}) for p, ids in enumerate(prompt_ids)
                for j in range(2)]

    prompts = [{"prompt": "x", "prompt_ids": [1]}, {"prompt": "y", "prompt_ids": [2]}]
    rollout = generate_and_score([], prompts, SamplingConfig(n=2), RewardFuncSource(reward_func, "rf"),
                                 _Tokenizer(), Timer(), 0, generate=generate)
    assert rollout.reward_failure == ["", "timeout", "number_too_long", ""] and rollout.reward_failed == 2
    assert rollout.rewards.tolist() == [0.5, 0.0, 0.0, 1.0]
    kept = merge_rollouts([select_groups(rollout, [1], 2)])  # dynamic filtering keeps prompt 1 only
    exp = to_experience(kept, 0)
    exp.rewards, exp.scores = kept.rewards, kept.scores
    metrics = rollout_metrics(kept, exp)
    assert metrics["reward/failed_timeout"] == 1.0 and metrics["reward/failed_number_too_long"] == 1.0
    assert metrics["rollout/reward_failed"] == 2.0
    rows = trace_rows(1, kept, exp, _Tokenizer())
    assert [r["reward_failure"] for r in rows] == ["number_too_long", None]
    assert [r["reward"] for r in rows] == [0.0, 1.0]
