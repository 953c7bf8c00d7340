"""reward_func files: happy path, each failure naming file:function and the sample, the zero policy."""

from __future__ import annotations

import pickle
import textwrap
import time

import pytest
import torch

from rlhfkit.errors import RewardFuncError
from rlhfkit.rewards.reward_func import RewardFuncSource, load_reward_func

QUERIES = ["Q: 1+1? A: 2", "Q: 2+2? A: 4", "Q: bad? A: boom", "Q: 3+3? A: 6"]
PROMPTS = ["Q: 1+1? A:", "Q: 2+2? A:", "Q: bad? A:", "Q: 3+3? A:"]
LABELS = [2, 4, 0, 6]


def write(tmp_path, body: str, name: str = "rf.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def source(tmp_path, body: str, **kwargs) -> RewardFuncSource:
    return RewardFuncSource.from_file(write(tmp_path, body), **kwargs)


GOOD = """
    import torch
    def reward_func(queries, prompts, labels):
        rewards = torch.tensor([float(len(q)) for q in queries])
        return {"rewards": rewards, "scores": rewards / 100, "extra_logs": {"length": [len(q) for q in queries]}}
"""


def test_happy_path(tmp_path):
    src = source(tmp_path, GOOD)
    out = src(QUERIES, PROMPTS, LABELS)
    assert out.rewards.dtype == torch.float32 and out.rewards.tolist() == [float(len(q)) for q in QUERIES]
    assert torch.allclose(out.scores, out.rewards / 100)
    assert out.extra_logs["length"].tolist() == [float(len(q)) for q in QUERIES]
    assert out.failed == 0 and out.extra_logs["reward_failed"].tolist() == [0.0] * 4
    assert src.name.endswith("rf.py:reward_func")


def test_scores_default_to_rewards_and_list_rewards(tmp_path):
    src = source(tmp_path, "def reward_func(q, p, l):\n    return {'rewards': [1, 2.5, 0, -1]}\n")
    out = src(QUERIES, PROMPTS, None)
    assert out.rewards.tolist() == [1.0, 2.5, 0.0, -1.0] and out.scores.tolist() == out.rewards.tolist()


def test_pickles_by_path(tmp_path):
    src = pickle.loads(pickle.dumps(source(tmp_path, GOOD)))
    assert src(QUERIES[:1], PROMPTS[:1], None).rewards.tolist() == [float(len(QUERIES[0]))]


def test_missing_file_and_missing_function(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        load_reward_func(tmp_path / "nope.py")
    path = write(tmp_path, "def other(q, p, l):\n    return {}\n", "nofunc.py")
    with pytest.raises(RewardFuncError, match=r"nofunc\.py.*reward_func"):
        load_reward_func(path)
    path = write(tmp_path, "import not_a_module_xyz\n", "badimport.py")
    with pytest.raises(RewardFuncError, match="badimport.py") as info:
        load_reward_func(path)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


RAISES = """
    def reward_func(queries, prompts, labels):
        for q in queries:
            if "boom" in q:
                raise ValueError("cannot grade this")
        return {"rewards": [1.0] * len(queries)}
"""
SLOW = """
    import time
    def reward_func(queries, prompts, labels):
        if any("boom" in q for q in queries):
            time.sleep(2)
        return {"rewards": [1.0] * len(queries)}
"""
NAN = """
    def reward_func(queries, prompts, labels):
        return {"rewards": [float("nan") if "boom" in q else 1.0 for q in queries]}
"""
WRONG_LENGTH = """
    def reward_func(queries, prompts, labels):
        return {"rewards": [1.0] * (len(queries) - (1 if any("boom" in q for q in queries) else 0))}
"""
MISSING_KEY = """
    def reward_func(queries, prompts, labels):
        if any("boom" in q for q in queries):
            return {"reward": [1.0] * len(queries)}
        return {"rewards": [1.0] * len(queries)}
"""
CASES = {
    "raises": (RAISES, "raised ValueError: cannot grade this"),
    "slow": (SLOW, "timed out after 0.3 s"),
    "nan": (NAN, r"non-finite reward \(nan\)"),
    "wrong_length": (WRONG_LENGTH, "returned 0 rewards for a batch of 1"),
    "missing_key": (MISSING_KEY, "without the 'rewards' key"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_failure_names_function_and_sample(tmp_path, case):
    body, reason = CASES[case]
    src = source(tmp_path, body, timeout=0.3)
    start = time.monotonic()
    with pytest.raises(RewardFuncError) as info:
        src(QUERIES, PROMPTS, LABELS)
    message = str(info.value)
    assert "rf.py:reward_func" in message and "sample 2" in message and "Q: bad? A: boom" in message, message
    assert __import__("re").search(reason, message), message
    if case == "raises":
        assert isinstance(info.value.__cause__, ValueError)
    assert time.monotonic() - start < 2.0  # a timed-out call is abandoned, not awaited


def test_query_preview_is_cut_at_200_chars(tmp_path):
    src = source(tmp_path, RAISES)
    with pytest.raises(RewardFuncError) as info:
        src(["boom " + "x" * 1000], None, None)
    assert "x" * 190 in str(info.value) and "x" * 300 not in str(info.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_zero_policy_counts_failures(tmp_path, case):
    body, _ = CASES[case]
    src = source(tmp_path, body, timeout=0.3, error_policy="zero")
    out = src(QUERIES, PROMPTS, LABELS)
    assert out.failed == 1
    assert out.rewards.tolist() == [1.0, 1.0, 0.0, 1.0] if case != "raises" else out.rewards[2] == 0
    assert out.extra_logs["reward_failed"].tolist() == [0.0, 0.0, 1.0, 0.0]
    reasons = out.extra_logs["reward_error"]
    assert reasons[2] and reasons[0] == reasons[1] == reasons[3] == ""


def test_bad_policy_rejected(tmp_path):
    with pytest.raises(ValueError, match="reward_error_policy"):
        source(tmp_path, GOOD, error_policy="ignore")


def test_batch_only_failure_is_reported_without_blaming_a_sample(tmp_path):
    body = "def reward_func(q, p, l):\n    return {'rewards': [1.0] * (len(q) if len(q) < 3 else 1)}\n"
    with pytest.raises(RewardFuncError, match="no single sample is to blame"):
        source(tmp_path, body)(QUERIES, PROMPTS, LABELS)
    out = source(tmp_path, body, error_policy="zero")(QUERIES, PROMPTS, LABELS)
    assert out.rewards.tolist() == [1.0] * 4 and out.failed == 0


def test_example_math_reward_file():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "reward_funcs" / "math_reward.py"
    src = RewardFuncSource.from_file(path)
    prompts = ["What is 2+2?", "Half of 3?", "Sum?"]
    responses = [r" <think>easy</think><answer>\boxed{4}</answer>", " It is 3/2", " no idea"]
    out = src([p + r for p, r in zip(prompts, responses)], prompts, ["4", "1.5", "7"])
    assert out.rewards.tolist() == pytest.approx([1.1, 1.0, 0.0]) and out.scores.tolist() == [1.0, 1.0, 0.0]
    assert out.extra_logs["format_ok"].tolist() == [1.0, 0.0, 0.0]


def test_no_timeout_still_names_the_sample(tmp_path):
    with pytest.raises(RewardFuncError, match=r"sample 2.*raised ValueError") as info:
        source(tmp_path, RAISES, timeout=0)(QUERIES, PROMPTS, LABELS)
    assert isinstance(info.value.__cause__, ValueError)
