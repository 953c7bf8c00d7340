"""builtin:code: programs from responses run against label tests in limited subprocesses."""

from __future__ import annotations

import json
import time

import pytest

from rlhfkit.rewards.code import Case, extract_program, make_code_reward_func, parse_cases, run_case
from rlhfkit.rewards.sources import build_reward_source

ADD_OK = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
ADD_WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"]}
SUM_STDIN = {"inputs": ["1 2\n", "10 20\n"], "outputs": ["3\n", "30"]}


def test_the_last_fenced_block_is_the_program():
    assert extract_program("```python\nx = 1\n```\ntext\n```\ny = 2\n```") == ("y = 2\n", True)
    assert extract_program("print(1)") == ("print(1)", False)


def test_rewards_are_the_fraction_of_passing_cases_and_scores_need_all():
    reward = make_code_reward_func(timeout=5)
    stdin_program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    out = reward(["P" + ADD_OK, "P" + ADD_WRONG, "P" + "def add(a, b) return", "P" + stdin_program],
                 ["P"] * 4, [TESTS, json.dumps(TESTS), TESTS, SUM_STDIN])
    # a - b passes add(0, 0) == 0 only; -1 - 1 != 0; the syntax error fails everything
    assert out["rewards"] == pytest.approx([1.0, 1 / 3, 0.0, 1.0])
    assert out["scores"] == [1.0, 0.0, 0.0, 1.0]
    assert out["extra_logs"]["code_has_block"] == [1.0, 1.0, 0.0, 1.0]


def test_a_runaway_program_is_stopped_by_the_timeout():
    began = time.perf_counter()
    assert run_case("while True:\n    pass", Case(), timeout=1.0) == (False, True)
    assert time.perf_counter() - began < 5


@pytest.mark.parametrize("program", [
    "x = bytearray(2 * 1024 ** 3)",                         # over the 512 MiB address-space limit
    "open('big', 'wb').write(b'0' * (32 * 1024 ** 2))",     # over the 16 MiB file-size limit
])
def test_resource_limits_fail_the_case(program):
    assert run_case(program, Case(), timeout=10.0) == (False, False)


def test_cases_run_isolated_in_an_empty_directory_with_an_empty_environment():
    program = "import os, sys\nassert os.listdir('.') == []\nassert 'HOME' not in os.environ\nassert '' not in sys.path"
    assert run_case(program, Case(), timeout=10.0) == (True, False)


@pytest.mark.parametrize("label, message", [
    ("not json", "sample 0: the label is not JSON"),
    ({"inputs": ["1"], "outputs": []}, "needs 'tests', or 'inputs' and 'outputs' lists of the same length"),
    (["assert True"], "the label must be a dict"),
])
def test_bad_labels_name_the_sample(label, message):
    with pytest.raises(ValueError, match=message):
        parse_cases(label, 0)


def test_builtin_code_is_a_reward_source():
    source = build_reward_source("builtin:code")
    out = source(["Q" + ADD_OK, "Q" + ADD_WRONG], ["Q", "Q"], [TESTS, TESTS])
    assert out.rewards.tolist() == pytest.approx([1.0, 1 / 3])
    assert out.extra_logs["code_pass_rate"].tolist() == pytest.approx([1.0, 1 / 3])
    with pytest.raises(Exception, match="builtin:code needs a label"):
        source(["Q" + ADD_OK], ["Q"], None)
