"""OpenRLHF's agent classes, `AgentInstanceBase` and `MultiTurnAgentExecutor`, over rlhfkit's environment protocol.

An OpenRLHF agent file (`examples/python/agent_func.py` of OpenRLHF 0.11) runs unchanged but for its import line::

    from rlhfkit.agents import AgentInstanceBase, MultiTurnAgentExecutor   # was: from openrlhf.utils.agent import ...

    class AgentInstance(AgentInstanceBase):
        def __init__(self, *args, **kwargs): ...
        async def reset(self, states: dict, **kwargs): return {"observation": states["observation"]}
        async def step(self, states: dict, **kwargs):
            return {"rewards": r, "scores": s, "environment_feedback": text, "done": done,
                    "sampling_params": states.get("sampling_params", None), "extra_logs": {...}}

    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)

`load_agent` (rlhfkit.agents.environment) takes the file's `AgentExecutor` (or wraps an `AgentInstanceBase`
subclass itself) and gives the rollout loop one `OpenRLHFEpisode` per episode: rlhfkit's `reset`/`step` protocol
with OpenRLHF's return contract. What differs from rlhfkit's plain `AgentInstance` is the reward: OpenRLHF's
executor sums the step rewards, so the episode's reward is

    R = sum_t rewards_t,    scores = the last step's `scores` (default: R),    extra_logs = the last step's.

`step` gets `states["sampling_params"] = None`: every turn samples with the run's settings (`--temperature`, `--top_k`,
`--top_p`, `--agent_action_max_len`), so a step that returns other `sampling_params` is refused (parse_step).
"""

from __future__ import annotations

import inspect
import math
import numbers
from abc import ABC, abstractmethod
from typing import Any


class AgentInstanceBase(ABC):
    """One episode's environment, as OpenRLHF defines it: made with no arguments, `reset` once, `step` per action."""

    @abstractmethod
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        """`states`: {"observation": prompt text, "label": label}; returns {"observation": text} (default: as is)."""
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs: Any) -> dict:
        """`states`: {"observation_text", "action_text", "label", "sampling_params"} (rlhfkit adds "turn" and
        "finish_reason"); returns {"rewards", "scores", "environment_feedback", "done", "sampling_params",
        "extra_logs"}."""
        raise NotImplementedError("AgentInstance.step is not implemented")


class MultiTurnAgentExecutor:
    """Holds the `AgentInstanceBase` subclass whose instances are the episodes (OpenRLHF's `AgentExecutor` shape).

    rlhfkit's rollout loop runs the turns (batched across episodes, token in and token out), so unlike OpenRLHF's
    class this one has no `execute`: a subclass that defines one is refused when the file is loaded."""

    def __init__(self, agent_instance_cls: type) -> None:
        if not (inspect.isclass(agent_instance_cls) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError(f"MultiTurnAgentExecutor({agent_instance_cls!r}): the agent instance class must inherit "
                            "from rlhfkit.agents.AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls

    def new_episode(self) -> OpenRLHFEpisode:
        """A fresh instance (`agent_instance_cls()`, as OpenRLHF makes one per prompt sample) behind the adapter."""
        return OpenRLHFEpisode(self.agent_instance_cls())


class OpenRLHFEpisode:
    """rlhfkit's per-episode environment over one OpenRLHF `AgentInstance`: passes `reset` through; `step` adds
    `sampling_params: None` to the states and returns the running sum of the rewards as the step's `rewards`
    (rlhfkit takes the last step's, so the episode gets the sum, as OpenRLHF's executor computes it)."""

    def __init__(self, instance: AgentInstanceBase) -> None:
        self.instance = instance
        self.total_reward = 0.0

    async def reset(self, states: dict) -> Any:
        return await _maybe_await(self.instance.reset(states))

    async def step(self, states: dict) -> Any:
        result = await _maybe_await(self.instance.step({**states, "sampling_params": None}))
        reward = as_real(result.get("rewards")) if isinstance(result, dict) else None
        if reward is None or not math.isfinite(reward):
            return result  # parse_step names what is wrong with it
        self.total_reward += reward
        return {**result, "rewards": self.total_reward, "scores": result.get("scores", self.total_reward)}


def as_real(value: Any) -> float | None:
    """`value` as a float when it is a real number (not a bool) or a one-element tensor of one; else None."""
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
