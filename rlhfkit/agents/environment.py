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

OpenRLHF's shape works too (rlhfkit.agents.base): `class AgentInstance(AgentInstanceBase)` with
`class AgentExecutor(MultiTurnAgentExecutor)`, imported from `rlhfkit.agents`; its episode reward is the sum of the
step rewards, as in OpenRLHF.

Anything else (no `AgentInstance`, a missing key, a NaN reward, an exception) stops the run with an error naming
the file, the method, the episode and the turn.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhfkit.agents.base import AgentInstanceBase, MultiTurnAgentExecutor, as_real
from rlhfkit.errors import AgentError, ConfigError
from rlhfkit.userfiles import import_user_file

FLAG = "--agent_func_path"
AGENT_CLASS = "AgentInstance"
EXECUTOR_CLASS = "AgentExecutor"  # OpenRLHF's: class AgentExecutor(MultiTurnAgentExecutor) naming its instance class
RUN_AGENT = "run_agent"   # or: async def run_agent(base_url, prompt, label) -> reward (rlhfkit.agents.openai_server)
FILE_SHAPE = (f"a .py file defining class {AGENT_CLASS} with step(states), or async def {RUN_AGENT}(base_url, prompt, "
              "label); see docs/agents.md")


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
    executor: MultiTurnAgentExecutor | None = None  # OpenRLHF's shape: its episodes adapt `cls` (rlhfkit.agents.base)

    @property
    def name(self) -> str:
        return f"{Path(self.path).name}:{self.cls.__name__ if self.cls is not None else 'run_agent'}"

    def where(self, method: str, episode: int, turn: int | None = None) -> str:
        at = f"episode {episode}" + (f", turn {turn}" if turn is not None else "")
        owner = f"{self.cls.__name__}." if self.cls is not None and method != "run_agent" else ""
        return f"{self.path}: {owner}{method} ({at})"


def load_agent(path: str, action_max_len: int | None = None) -> AgentSpec:
    """Import `path` and return its environment; ConfigError naming the file when it is unusable.

    In order: an `AgentExecutor` (OpenRLHF's shape: a MultiTurnAgentExecutor subclass naming the instance class), an
    `AgentInstance` (an AgentInstanceBase subclass follows OpenRLHF's contract, a plain class rlhfkit's), `run_agent`.
    """
    module = import_user_file(path, FLAG, (AGENT_CLASS, EXECUTOR_CLASS, RUN_AGENT), FILE_SHAPE)
    executor = _executor(module, path)
    if executor is not None:
        return AgentSpec(str(path), executor.agent_instance_cls, action_max_len, executor=executor)
    cls = getattr(module, AGENT_CLASS, None)
    run_agent = getattr(module, RUN_AGENT, None)
    if not inspect.isclass(cls) and callable(run_agent):
        return AgentSpec(str(path), None, action_max_len, run_agent)
    if not inspect.isclass(cls):
        raise ConfigError(f"{FLAG} {path}: {AGENT_CLASS} is a {type(cls).__name__}, not a class ({FILE_SHAPE})")
    if not callable(getattr(cls, "step", None)):
        raise ConfigError(f"{FLAG} {path}: {AGENT_CLASS} has no step(self, states) method")
    return AgentSpec(str(path), cls, action_max_len)


def _executor(module: Any, path: str) -> MultiTurnAgentExecutor | None:
    """The file's `AgentExecutor()`, or one made around an AgentInstanceBase `AgentInstance`; None for other files."""
    cls = getattr(module, EXECUTOR_CLASS, None)
    if cls is None:
        instance_cls = getattr(module, AGENT_CLASS, None)
        if inspect.isclass(instance_cls) and issubclass(instance_cls, AgentInstanceBase):
            return MultiTurnAgentExecutor(instance_cls)
        return None
    if not (inspect.isclass(cls) and issubclass(cls, MultiTurnAgentExecutor)):
        raise ConfigError(f"{FLAG} {path}: {EXECUTOR_CLASS} must be a subclass of rlhfkit.agents."
                          "MultiTurnAgentExecutor (write `from rlhfkit.agents import AgentInstanceBase, "
                          "MultiTurnAgentExecutor`); a custom executor with its own execute() is not supported: for an "
                          f"agent that calls an OpenAI-compatible server define {RUN_AGENT}(base_url, prompt, label), "
                          "see docs/agents.md")
    if callable(getattr(cls, "execute", None)):
        raise ConfigError(f"{FLAG} {path}: {EXECUTOR_CLASS}.execute is not supported: rlhfkit runs the turns itself "
                          "(batched, token in and token out) and calls your AgentInstance's reset/step; remove "
                          f"execute, or define {RUN_AGENT}(base_url, prompt, label) for an agent of its own loop")
    make: Callable[[], MultiTurnAgentExecutor] = cls  # the file's subclass: its __init__ takes no argument
    try:
        return make()
    except Exception as err:
        raise ConfigError(f"{FLAG} {path}: {EXECUTOR_CLASS}() raised {type(err).__name__}: {err}") from err


def new_instance(agent: AgentSpec, episode: int) -> Any:
    make: Callable[[], Any] | None = agent.executor.new_episode if agent.executor is not None else agent.cls
    if make is None:
        raise AgentError(f"{agent.name}: no environment class to make episode {episode} from (a run_agent file)")
    try:
        return make()
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
    _refuse_unsupported(result, where)
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


def _refuse_unsupported(result: dict, where: str) -> None:
    """OpenRLHF's step keys rlhfkit cannot honour: refused rather than ignored."""
    if result.get("sampling_params") is not None:
        raise AgentError(f"{where} returned sampling_params {result['sampling_params']!r}: every turn samples with the "
                         "run's settings (--temperature, --top_k, --top_p, --agent_action_max_len); return None (or "
                         "states['sampling_params'], which is None) and set those flags instead")
    if result.get("environment_images"):
        raise AgentError(f"{where} returned environment_images: images in environment feedback are not supported; "
                         "return text feedback only")


def _number(value: Any, where: str, key: str) -> float:
    number = as_real(value)
    if number is None:
        raise AgentError(f"{where}: {key!r} must be a number, got {value!r}")
    if not math.isfinite(number):
        raise AgentError(f"{where}: {key!r} is {number} (not finite); an environment reward must be a finite number")
    return number
