"""The environment contract: loading `--agent_func_path`, checking reset/step results, naming the culprit."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rlhfkit.agents.environment import call_all, load_agent, parse_reset, parse_step
from rlhfkit.errors import AgentError, ConfigError

HERE = Path(__file__).parent


def test_load_agent_finds_the_class_and_names_the_file():
    agent = load_agent(str(HERE / "two_turn_env.py"), action_max_len=4)
    assert agent.cls.__name__ == "AgentInstance" and agent.action_max_len == 4
    assert agent.name == "two_turn_env.py:AgentInstance"


@pytest.mark.parametrize("body, message", [
    (None, "no such file"),
    ("x = 1\n", "defines no AgentInstance and no AgentExecutor and no run_agent"),
    ("class AgentInstance:\n    pass\n", r"has no step\(self, states\) method"),
])
def test_unusable_agent_files_are_config_errors(tmp_path, body, message):
    path = tmp_path / "env.py"
    if body is not None:
        path.write_text(body)
    with pytest.raises(ConfigError, match=message) as err:
        load_agent(str(path))
    assert str(path) in str(err.value)


def test_step_results_are_checked_and_defaulted():
    agent = load_agent(str(HERE / "two_turn_env.py"))
    r = parse_step(agent, {"rewards": 1, "done": 0}, episode=3, turn=1)
    assert (r.reward, r.score, r.feedback, r.done, r.extra_logs) == (1.0, 1.0, "", False, {})
    import torch

    r = parse_step(agent, {"rewards": torch.tensor(0.5), "scores": 2, "done": True, "environment_feedback": "ok",
                           "extra_logs": {"a": torch.tensor([3.0])}}, episode=0, turn=0)
    assert (r.reward, r.score, r.feedback, r.done, r.extra_logs) == (0.5, 2.0, "ok", True, {"a": 3.0})


@pytest.mark.parametrize("result, message", [
    ({"done": True}, "returned no 'rewards'"),
    ({"rewards": 1.0}, "returned no 'done'"),
    ({"rewards": math.nan, "done": True}, "'rewards' is nan"),
    ({"rewards": "high", "done": True}, "'rewards' must be a number"),
    ({"rewards": 1.0, "done": True, "extra_logs": {"x": math.inf}}, "extra_logs\\['x'\\]"),
    ({"rewards": 1.0, "done": False, "environment_feedback": 7}, "'environment_feedback' must be a string"),
    ([1.0], "returned list"),
])
def test_bad_step_results_name_the_file_episode_and_turn(result, message):
    agent = load_agent(str(HERE / "two_turn_env.py"))
    with pytest.raises(AgentError, match=message) as err:
        parse_step(agent, result, episode=5, turn=2)
    assert "two_turn_env.py: AgentInstance.step (episode 5, turn 2)" in str(err.value)


def test_reset_may_replace_the_observation_or_keep_it():
    agent = load_agent(str(HERE / "two_turn_env.py"))
    assert parse_reset(agent, {"observation": "new"}, 0) == "new"
    assert parse_reset(agent, {}, 0) is None
    with pytest.raises(AgentError, match="expected a dict"):
        parse_reset(agent, "text", 1)


def test_call_all_runs_sync_and_async_methods_and_wraps_exceptions():
    agent = load_agent(str(HERE / "two_turn_env.py"))
    instances = [agent.cls(), agent.cls()]
    out = call_all(agent, "step", [(inst, {"action_text": "AB", "turn": 1, "observation_text": ""}, i, 1)
                                   for i, inst in enumerate(instances)])
    assert [o["rewards"] for o in out] == [1.0, 1.0] and all(o["done"] for o in out)
    # a missing reset returns the states unchanged
    broken = load_agent(str(HERE / "broken_envs.py"))
    assert call_all(broken, "reset", [(broken.cls(), {"observation": "p"}, 0, None)]) == [{"observation": "p"}]
    with pytest.raises(AgentError, match=r"broken_envs.py: AgentInstance.step \(episode 4, turn 1\) raised KeyError"):
        call_all(broken, "step", [(broken.cls(), {"turn": 1}, 4, 1)])
