"""OpenRLHF agent files run with only their import line changed (`from rlhfkit.agents import AgentInstanceBase,
MultiTurnAgentExecutor`): openrlhf_agent_func.py is OpenRLHF's examples/python/agent_func.py so changed. Its episodes
go through rlhfkit's environment protocol (load_agent -> OpenRLHFEpisode -> call_all / parse_step -> run_episodes),
with OpenRLHF's return contract: the episode reward is the sum of the step rewards."""

from __future__ import annotations

import asyncio
import itertools
import random
import sys
from pathlib import Path

import pytest
import torch

from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor
from rlhfkit.agents.base import OpenRLHFEpisode
from rlhfkit.agents.environment import AgentSpec, call_all, load_agent, new_instance, parse_reset, parse_step
from rlhfkit.agents.executor import run_episodes
from rlhfkit.errors import AgentError, ConfigError
from rlhfkit.rollout.types import RolloutSample, SamplingConfig

HERE = Path(__file__).parent
FILE = HERE / "openrlhf_agent_func.py"
# the file's feedback texts (examples/python/agent_func.py): mid-episode and at the end
INCORRECT = "\n\nHuman: [INCORRECT]\nPlease analyze the issues and try again.\n</s>\n\nAssistant: "
CORRECT = "\n\nHuman: [CORRECT]\n</s>"


def test_the_openrlhf_example_loads_through_its_agent_executor():
    agent = load_agent(str(FILE), action_max_len=4)
    module = sys.modules[agent.cls.__module__]
    assert type(agent.executor) is module.AgentExecutor and isinstance(agent.executor, MultiTurnAgentExecutor)
    assert agent.cls is module.AgentInstance and issubclass(agent.cls, AgentInstanceBase)
    assert agent.name == "openrlhf_agent_func.py:AgentInstance" and agent.action_max_len == 4
    assert isinstance(new_instance(agent, 0), OpenRLHFEpisode)


def run_one_episode(agent: AgentSpec, row: int, actions: list[str]) -> tuple[list, list[dict]]:
    """Step episode `row` through the adapter (call_all/parse_step, as run_episodes does) until done."""
    episode = new_instance(agent, row)
    [reset] = call_all(agent, "reset", [(episode, {"observation": "Q", "label": "L"}, row, None)])
    assert parse_reset(agent, reset, row) == "Q"
    results, raw = [], []
    for turn, action in enumerate(actions):
        states = {"observation_text": "Q", "action_text": action, "label": "L", "turn": turn, "finish_reason": "stop"}
        [out] = call_all(agent, "step", [(episode, states, row, turn)])
        raw.append(out)
        results.append(parse_step(agent, out, row, turn))
        if results[-1].done:
            break
    return results, raw


def test_reset_and_step_give_the_rewards_and_feedback_the_file_computes():
    agent = load_agent(str(FILE))
    module = sys.modules[agent.cls.__module__]
    for row in range(6):
        random.seed(row)  # the file draws max_steps = randint(1, 3) in __init__
        torch.manual_seed(100 + row)  # ... and the final reward with torch.randint at the last step
        results, raw = run_one_episode(agent, row, ["a", "b", "c", "d", "e"])
        random.seed(row)
        torch.manual_seed(100 + row)
        direct = module.AgentInstance()  # the reference: the file's own instance, stepped directly
        want = [asyncio.run(direct.step({"observation_text": "Q", "action_text": "x", "label": "L"}))
                for _ in range(direct.max_steps + 1)]
        assert len(results) == direct.max_steps + 1 and [r.done for r in results] == [w["done"] for w in want]
        assert [r.feedback for r in results] == [INCORRECT] * direct.max_steps + [CORRECT]
        total = sum(float(w["rewards"]) for w in want)  # OpenRLHF: total_reward += rewards.item()
        assert results[-1].reward == total and results[-1].score == float(want[-1]["scores"])
        assert total in (0.0, 1.0) and all(float(w["rewards"]) == 0.0 for w in want[:-1])
        assert results[-1].extra_logs == {"dummy_scores": float(want[-1]["extra_logs"]["dummy_scores"])}
        assert all(out["sampling_params"] is None for out in raw)  # the file echoes states["sampling_params"]


class Summed(AgentInstanceBase):
    """Rewards 1, 2, 3 over three steps (tensors, as OpenRLHF's executor expects); scores only on the last step."""

    def __init__(self):
        self.turn = 0

    async def step(self, states, **kwargs):
        self.turn += 1
        done = self.turn == 3
        out = {"rewards": torch.tensor(float(self.turn)), "environment_feedback": "" if done else f" <fb{self.turn}>",
               "done": done, "extra_logs": {"turn": self.turn}}
        return {**out, "scores": 0.5} if done else out


def test_the_episode_reward_is_the_sum_of_the_step_rewards():
    agent = AgentSpec("summed.py", Summed, executor=MultiTurnAgentExecutor(Summed))
    results, _ = run_one_episode(agent, 0, ["a", "b", "c"])
    assert [r.reward for r in results] == [1.0, 3.0, 6.0]  # running sums: 1, 1 + 2, 1 + 2 + 3
    assert [r.score for r in results] == [1.0, 3.0, 0.5]   # scores default to the sum; the last step's when given
    assert results[-1].extra_logs == {"turn": 3.0}


def test_an_agent_instance_base_file_without_an_executor_gets_openrlhfs_contract_too(tmp_path):
    path = tmp_path / "no_executor.py"
    path.write_text("import torch\nfrom rlhfkit.agents import AgentInstanceBase\n\n"
                    "class AgentInstance(AgentInstanceBase):\n    def __init__(self):\n        self.turn = 0\n\n"
                    "    async def step(self, states, **kwargs):\n        self.turn += 1\n"
                    "        return {'rewards': torch.tensor(2.0), 'environment_feedback': '', "
                    "'done': self.turn == 2}\n")
    agent = load_agent(str(path))
    assert agent.executor is not None and agent.executor.agent_instance_cls is agent.cls
    results, _ = run_one_episode(agent, 0, ["a", "b"])
    assert [r.reward for r in results] == [2.0, 4.0]  # summed; a plain class (no base) would end on 2.0


def test_run_episodes_on_the_openrlhf_file_with_a_scripted_engine():
    """The whole agent path: three turns at most, the file's feedback in the sequence and masked, reward summed."""
    from rlhfkit.models.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    agent = load_agent(str(FILE))
    prompts = [{"prompt": q, "prompt_ids": tok(q, add_special_tokens=False)["input_ids"]} for q in ["Q1?", "Q2?"]]
    action = tok("Yes.", add_special_tokens=False)["input_ids"]
    calls = itertools.count()

    def generate(engines, contexts, sampling):
        next(calls)
        return [RolloutSample(i, 0, list(c), list(action), [-0.5] * len(action), "length")
                for i, c in enumerate(contexts)]

    random.seed(3)  # run_episodes seeds the generators from the sampling seed (3) itself: disturb them first
    random.random()
    sampling = SamplingConfig(max_new_tokens=400, n=3, seed=3)
    out = run_episodes([None], prompts, sampling, agent, tok, generate=generate)
    random.seed(3)
    draws = [random.randint(1, 3) for _ in range(6)]  # the max_steps the file drew for the six episodes
    feedback = tok(INCORRECT, add_special_tokens=False)["input_ids"]
    assert next(calls) == max(draws) + 1  # one batched engine call per turn
    for sample, steps, reward in zip(out.samples, draws, out.rewards.tolist()):
        assert sample.extra["turns"] == steps + 1
        assert sample.response_ids == (action + feedback) * steps + action
        assert sample.action_mask == ([True] * len(action) + [False] * len(feedback)) * steps + [True] * len(action)
        assert reward in (0.0, 1.0)
    assert out.scores.tolist() == out.rewards.tolist() == out.extra_logs["dummy_scores"].tolist()
    again = run_episodes([None], prompts, sampling, agent, tok, generate=generate)  # same seed: the same episodes
    assert again.rewards.tolist() == out.rewards.tolist()
    assert [s.response_ids for s in again.samples] == [s.response_ids for s in out.samples]


@pytest.mark.parametrize("body, message", [
    ("from rlhfkit.agents import MultiTurnAgentExecutor\nclass AgentInstance:\n    def step(self, s):\n"
     "        return s\nclass AgentExecutor(MultiTurnAgentExecutor):\n    def __init__(self):\n"
     "        super().__init__(AgentInstance)\n",
     r"AgentExecutor\(\) raised TypeError: .*must inherit from rlhfkit.agents.AgentInstanceBase"),
    ("from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor\nclass A(AgentInstanceBase):\n"
     "    def __init__(self):\n        pass\n    async def step(self, s):\n        return s\n"
     "class AgentExecutor(MultiTurnAgentExecutor):\n    def __init__(self):\n        super().__init__(A)\n"
     "    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):\n"
     "        pass\n", "AgentExecutor.execute is not supported"),
    ("class AgentExecutor:\n    async def execute(self, *args):\n        pass\n",
     "AgentExecutor must be a subclass of rlhfkit.agents.MultiTurnAgentExecutor"),
])
def test_executors_rlhfkit_cannot_run_are_config_errors_naming_the_file(tmp_path, body, message):
    path = tmp_path / "agent.py"
    path.write_text(body)
    with pytest.raises(ConfigError, match=message) as err:
        load_agent(str(path))
    assert str(err.value).startswith(f"--agent_func_path {path}: ")


@pytest.mark.parametrize("extra, message", [
    ({"sampling_params": {"temperature": 0.1}}, "returned sampling_params .*run's settings"),
    ({"environment_images": ["img"]}, "returned environment_images"),
])
def test_step_keys_rlhfkit_cannot_honour_are_refused(extra, message):
    agent = load_agent(str(FILE))
    with pytest.raises(AgentError, match=message) as err:
        parse_step(agent, {"rewards": 0.0, "done": True, **extra}, episode=2, turn=1)
    assert "openrlhf_agent_func.py: AgentInstance.step (episode 2, turn 1)" in str(err.value)
