"""The example environments in examples/agents behave as their docstrings say (run without an engine)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlhfkit.agents.environment import call_all, load_agent, parse_step

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agents"


def steps(agent, actions: list[str], label: str, finish: str = "stop") -> list:
    instance = agent.cls()
    out = []
    for turn, action in enumerate(actions):
        states = {"observation_text": "", "action_text": action, "label": label, "turn": turn,
                  "finish_reason": finish}
        [result] = call_all(agent, "step", [(instance, states, 0, turn)])
        out.append(parse_step(agent, result, 0, turn))
    return out


def test_retry_env_pays_less_for_later_right_answers():
    agent = load_agent(str(EXAMPLES / "retry_env.py"))
    [first] = steps(agent, ["7"], "7")
    assert (first.reward, first.score, first.done, first.feedback) == (1.0, 1.0, True, "")
    results = steps(agent, ["5", "6", "The answer is 7."], "7")
    assert [r.reward for r in results] == [0.0, 0.0, pytest.approx(1 / 3)]
    assert [r.done for r in results] == [False, False, True] and "Try again" in results[0].feedback
    # the end-of-turn marker is added only when the action was cut before writing it
    assert results[0].feedback.startswith("\n<|im_start|>user\n")
    assert steps(agent, ["5"], "7", finish="length")[0].feedback.startswith("<|im_end|>\n<|im_start|>user\n")
    failed = steps(agent, ["1", "2", "3"], "7")
    assert failed[-1].done and failed[-1].reward == 0.0 and failed[-1].extra_logs == {"attempts": 3.0, "solved": 0.0}


def test_calculator_evaluates_arithmetic_and_nothing_else():
    load_agent(str(EXAMPLES / "calculator_env.py"))
    calc = sys.modules[load_agent(str(EXAMPLES / "calculator_env.py")).cls.__module__].calculate
    assert calc("123 + 456 * 2") == 1035 and calc("(7 - 10) // 2") == -2 and calc("-2 ** 3") == -8
    for bad in ("__import__('os').system('true')", "x + 1", "2 ** 1000", "1 / 0", "1 +"):
        assert str(calc(bad)).startswith("error:"), bad


def test_calculator_env_answers_tool_calls_then_checks_the_answer():
    agent = load_agent(str(EXAMPLES / "calculator_env.py"))
    call, answer = steps(agent, ["Let me compute <calc>123+456</calc>", "579"], "579")
    assert not call.done and "<result>579</result>" in call.feedback and call.reward == 0.0
    assert answer.done and answer.score == 1.0 and answer.reward == pytest.approx(0.95)
    [direct] = steps(agent, ["580"], "579")
    assert direct.done and direct.reward == 0.0
    many = steps(agent, ["<calc>1+1</calc>"] * 4, "2")  # the 4th call is over MAX_CALLS: read as the answer
    assert [r.done for r in many] == [False, False, False, True] and many[-1].extra_logs["tool_calls"] == 3.0
