"""The agent-environment contract: a Python file (`--agent_func_path`) defining `AgentInstance` with `reset`/`step`.

The shape OpenRLHF users already write::

    class AgentInstance:
        def __init__(self):                      # one instance per episode (prompt sample)
            self.turn = 0

        async def reset(self, states: dict) -> dict:   # optional; sync or async
            return {"observation": states["observation"]}   # may replace the prompt text

        async def step(self, states: dict) -> dict:     # sync or async
            return {"rewards": 0.0, "scores": 0.0, "environment_feedback": "...", "done": False,
                    "extra_logs": {"name": 1.0}}

`reset` gets `{"observation": prompt text, "label": label}`. `step` gets, after every action,
`{"observation_text": the episode so far (prompt + every earlier action and feedback), "action_text": this action,
"label": label, "turn": 0-based turn, "finish_reason": "stop" when the action ended on a stop token (kept
in the context, e.g. `<|im_end|>`), "length" when it was cut at a length cap}`. It must return `done` (bool)
and `rewards` (a finite number); `scores` defaults to `rewards`, `environment_feedback` to `""`, `extra_logs` to
`{}`. The reward of an episode is the one returned by its last `step`. `environment_feedback` is tokenised once
(no special tokens added; chat-template markers written in it are parsed) and appended to the context of the next
turn, masked from the loss.

Or the file defines `async def run_agent(base_url, prompt, label) -> float` instead: the agent calls the policy
through an OpenAI-compatible endpoint (`rlhfkit.agents.openai_server`) and returns the episode's reward.

Anything else (no `AgentInstance`, a missing key, a NaN reward, an exception) stops the run with an error naming
the file, the method, the episode and the turn.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import math
import numbers
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhfkit.errors import AgentError, ConfigError

AGENT_CLASS = "AgentInstance"
RUN_AGENT = "run_agent"   # or: async def run_agent(base_url, prompt, label) -> reward (rlhfkit.agents.openai_server)


@dataclass
class StepResult:
    """What one `step` returned, checked."""

    reward: float
    score: float
    feedback: str
    done: bool
    extra_logs: dict[str, float] = field(default_factory=dict)


@dataclass
class AgentSpec:
    """The loaded `--agent_func_path`: the environment class and where it came from (for error messages)."""

    path: str
    cls: type | None
    action_max_len: int | None = None  # --agent_action_max_len
    run_agent: Any = None              # `async def run_agent(base_url, prompt, label)`: the OpenAI-endpoint shape

    @property
    def name(self) -> str:
        return f"{Path(self.path).name}:{self.cls.__name__ if self.cls is not None else 'run_agent'}"

    def where(self, method: str, episode: int, turn: int | None = None) -> str:
        at = f"episode {episode}" + (f", turn {turn}" if turn is not None else "")
        owner = f"{self.cls.__name__}." if self.cls is not None and method != "run_agent" else ""
        return f"{self.path}: {owner}{method} ({at})"


def load_agent(path: str, action_max_len: int | None = None) -> AgentSpec:
    """Import `path` and return its `AgentInstance` class; ConfigError naming the file when it is unusable."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--agent_func_path {path}: no such file (a .py file defining class {AGENT_CLASS})")
    module_name = f"rlhfkit_agent_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ConfigError(f"--agent_func_path {path}: cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    cls = getattr(module, AGENT_CLASS, None)
    run_agent = getattr(module, RUN_AGENT, None)
    if not inspect.isclass(cls) and callable(run_agent):
        return AgentSpec(str(path), None, action_max_len, run_agent)
    if not inspect.isclass(cls):
        raise ConfigError(f"--agent_func_path {path}: defines no class {AGENT_CLASS} (with step(states) and "
                          f"optionally reset(states)) and no {RUN_AGENT}(base_url, prompt, label); see docs/agents.md")
    if not callable(getattr(cls, "step", None)):
        raise ConfigError(f"--agent_func_path {path}: {AGENT_CLASS} has no step(self, states) method")
    return AgentSpec(str(path), cls, action_max_len)


def new_instance(agent: AgentSpec, episode: int) -> Any:
    try:
        return agent.cls()
    except Exception as err:
        raise AgentError(f"{agent.where('__init__', episode)} raised {type(err).__name__}: {err}") from err


def call_all(agent: AgentSpec, method: str, calls: list[tuple[Any, dict, int, int | None]]) -> list[Any]:
    """Run `instance.method(states)` for every (instance, states, episode, turn); async methods run concurrently.

    A missing `reset` returns the states unchanged. Exceptions become AgentError naming the episode and turn.
    """
    async def one(instance: Any, states: dict, episode: int, turn: int | None) -> Any:
        fn = getattr(instance, method, None)
        if fn is None:
            return states
        try:
            out = fn(states)
            return await out if inspect.isawaitable(out) else out
        except Exception as err:
            raise AgentError(f"{agent.where(method, episode, turn)} raised {type(err).__name__}: {err}") from err

    async def gather() -> list[Any]:
        return list(await asyncio.gather(*(one(*c) for c in calls)))

    return asyncio.run(gather())


def parse_reset(agent: AgentSpec, result: Any, episode: int) -> str | None:
    """The observation text `reset` returned (None: keep the prompt)."""
    if not isinstance(result, dict):
        raise AgentError(f"{agent.where('reset', episode)} returned {type(result).__name__}; expected a dict "
                         "such as {'observation': text}")
    observation = result.get("observation")
    if observation is not None and not isinstance(observation, str):
        raise AgentError(f"{agent.where('reset', episode)}: 'observation' must be a string, got "
                         f"{type(observation).__name__}")
    return observation


def parse_step(agent: AgentSpec, result: Any, episode: int, turn: int) -> StepResult:
    """Check one `step` result: a dict with a bool `done` and a finite `rewards` (optional scores, feedback, logs)."""
    where = agent.where("step", episode, turn)
    if not isinstance(result, dict):
        raise AgentError(f"{where} returned {type(result).__name__}; expected a dict with 'rewards' and 'done'")
    missing = [k for k in ("rewards", "done") if k not in result]
    if missing:
        raise AgentError(f"{where} returned no {' and no '.join(repr(k) for k in missing)} (keys: {sorted(result)})")
    reward = _number(result["rewards"], where, "rewards")
    score = _number(result.get("scores", reward), where, "scores")
    feedback = result.get("environment_feedback") or ""
    if not isinstance(feedback, str):
        raise AgentError(f"{where}: 'environment_feedback' must be a string, got {type(feedback).__name__}")
    done = result["done"]
    if not isinstance(done, bool):
        done = _number(done, where, "done") != 0
    logs = {str(k): _number(v, where, f"extra_logs[{k!r}]") for k, v in (result.get("extra_logs") or {}).items()}
    return StepResult(reward, score, feedback, done, logs)


def _number(value: Any, where: str, key: str) -> float:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise AgentError(f"{where}: {key!r} must be a number, got {value!r}")
    if not math.isfinite(float(value)):
        raise AgentError(f"{where}: {key!r} is {value} (not finite); an environment reward must be a finite number")
    return float(value)
