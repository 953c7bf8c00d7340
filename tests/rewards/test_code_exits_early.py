"""`builtin:code`: a program that exits with status 0 before the appended assertions run does not pass them."""

from __future__ import annotations

import pytest

from rlhfkit.rewards.code import Case, make_code_reward_func, run_case

FAILING = Case(append="assert add(1, 2) == 4")


@pytest.mark.parametrize("exit_call", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit(0)",
                                       "import sys\nsys.stdout.flush()\nsys.exit()"])
def test_exiting_before_the_tests_fails_them(exit_call):
    program = f"def add(a, b):\n    return a + b\n{exit_call}\n"
    assert run_case(program, FAILING) == (False, False)
    assert run_case(program, Case(append="assert add(1, 2) == 3")) == (False, False)  # never ran, so not passed


def test_a_correct_program_that_prints_still_passes_and_a_wrong_one_fails():
    program = "def add(a, b):\n    print('adding', a, b)\n    return a + b\nprint('ready')\n"
    assert run_case(program, Case(append="assert add(1, 2) == 3")) == (True, False)
    assert run_case(program, FAILING) == (False, False)


def test_stdout_cases_may_still_exit_early():
    program = "import sys\nprint(sum(map(int, sys.stdin.read().split())))\nsys.exit(0)\n"
    assert run_case(program, Case(stdin="1 2\n", expected_stdout="3\n")) == (True, False)


def test_the_reward_counts_an_early_exit_as_a_failed_case():
    reward = make_code_reward_func(workers=2)
    response = "```python\ndef add(a, b):\n    return 0\nimport sys\nsys.exit(0)\n```"
    out = reward([f"Q: write add\nA: {response}"], ["Q: write add\nA: "],
                 [{"tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]}])
    assert out["rewards"] == [0.0] and out["scores"] == [0.0]
