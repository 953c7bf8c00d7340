"""Multi-turn rollouts, token in and token out: generate an action, let the environment answer, repeat.

One episode per (prompt, sample). Turns are batched: every turn, the still-running episodes generate their next
action together on the rollout engines, then the environment steps them (async `step`s run concurrently). The
context of turn k is the episode's token ids so far, `prompt + action_1 + feedback_1 + ... + feedback_(k-1)`:
sampled tokens are never decoded and re-encoded, so the trainer scores exactly the tokens the engine sampled.
Environment feedback is tokenised once, appended with `action_mask` False and log-prob 0.

Budget: the whole response (actions and feedback) of an episode is at most `sampling.new_tokens(prompt length)`
tokens (`--generate_max_len`, capped by what `--max_len` leaves), and one action at most `action_max_len`
(`--agent_action_max_len`; default: what is left of the budget). An action that runs into the budget is cut there
and stepped anyway (finish "length"); feedback that would leave no room for another action ends the episode without
being appended.

Seeds: turn t of the episode at position r of the running list is sampled with seed `seed + r + t * TURN_STRIDE`,
so turn 0 draws exactly the tokens a single-turn rollout of the same prompts draws.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlhfkit.agents.environment import AgentSpec, StepResult, call_all, new_instance, parse_reset, parse_step
from rlhfkit.rollout.dispatch import generate_on_engines
from rlhfkit.rollout.types import FinishReason, RolloutSample, SamplingConfig

TURN_STRIDE = 1_000_003


@dataclass
class Episode:
    """One (prompt, sample) conversation with its environment instance."""

    row: int                             # position in the rollout (prompt-major): how errors name the episode
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    transcript: str                      # prompt text + every action and feedback so far (what `step` sees)
    label: Any
    instance: Any
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    last_action: list[int] = field(default_factory=list)
    last_action_stopped: bool = False    # the last action ended on a stop token (else it was cut at a length cap)
    turns: int = 0
    done: bool = False
    finish: FinishReason = "stop"
    result: StepResult | None = None


@dataclass
class AgentRollout:
    """Samples (prompt-major, as the single-turn path) with the last step's rewards and scores."""

    samples: list[RolloutSample]
    rewards: torch.Tensor
    scores: torch.Tensor
    texts: list[str]
    extra_logs: dict[str, torch.Tensor]
    generation_seconds: float
    environment_seconds: float


def run_episodes(engines: Sequence[Any], prompts: list[dict[str, Any]], sampling: SamplingConfig, agent: AgentSpec,
                 tokenizer: Any, action_max_len: int | None = None,
                 generate: Callable = generate_on_engines) -> AgentRollout:
    """Run `sampling.n` episodes per prompt (`prompt_ids`, `prompt`, optional `label`) to the end."""
    if action_max_len is not None and action_max_len < 1:
        raise ValueError(f"action_max_len (--agent_action_max_len) must be >= 1, got {action_max_len}")
    clock = {"generation": 0.0, "environment": 0.0}
    seed_agent_generators(sampling.seed)
    began = time.perf_counter()
    episodes = _start(prompts, sampling.n, agent, tokenizer)
    clock["environment"] += time.perf_counter() - began
    turn = 0
    while running := [e for e in episodes if not e.done]:
        began = time.perf_counter()
        _act(engines, running, sampling, action_max_len, turn, generate)
        clock["generation"] += time.perf_counter() - began
        began = time.perf_counter()
        _respond(running, agent, tokenizer, sampling, turn)
        clock["environment"] += time.perf_counter() - began
        turn += 1
    return _collect(episodes, tokenizer, clock)


def seed_agent_generators(seed: int | None) -> None:
    """Seed Python's, NumPy's and torch's global generators in this (the driver's) process from the step's sampling
    seed, so an agent file that draws from them (OpenRLHF's example draws its episode length with `random`) runs the
    same under the same `--seed`, resumed or not. Unseeded sampling (`seed` None) leaves them alone."""
    if seed is None:
        return
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _start(prompts: list[dict[str, Any]], n: int, agent: AgentSpec, tokenizer: Any) -> list[Episode]:
    episodes: list[Episode] = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            row = len(episodes)
            episodes.append(Episode(row, i, j, list(prompt["prompt_ids"]), prompt["prompt"], prompt.get("label"),
                                    new_instance(agent, row)))
    results = call_all(agent, "reset", [(e.instance, {"observation": e.transcript, "label": e.label}, e.row, None)
                                        for e in episodes])
    for e, result in zip(episodes, results):
        observation = parse_reset(agent, result, e.row)
        if observation is not None and observation != e.transcript:
            e.transcript, e.prompt_ids = observation, _encode(tokenizer, observation)
    return episodes


def _act(engines: Sequence[Any], running: list[Episode], sampling: SamplingConfig, action_max_len: int | None,
         turn: int, generate: Callable) -> None:
    """Every running episode samples its next action (at most `action_max_len` tokens, within its budget).

    One engine call for all: it samples up to the largest cap and each action is cut to its own (a seeded
    sample's prefix does not depend on how long it may grow)."""
    budgets = [sampling.new_tokens(len(e.prompt_ids)) for e in running]  # with --max_len: its share of it
    caps = [min(budget - len(e.tokens), action_max_len or budget) for e, budget in zip(running, budgets)]
    seed = None if sampling.seed is None else sampling.seed + turn * TURN_STRIDE
    turn_sampling = dataclasses.replace(sampling, n=1, max_new_tokens=max(caps), seed=seed)
    samples = generate(engines, [e.prompt_ids + e.tokens for e in running], turn_sampling)
    for e, sample, cap, budget in zip(running, samples, caps, budgets):
        ids, logprobs = sample.response_ids[:cap], sample.response_logprobs[:cap]
        stopped = sample.finish_reason == "stop" and len(sample.response_ids) <= cap
        e.last_action_stopped = stopped
        if len(e.tokens) + len(ids) >= budget and not stopped:
            e.finish = "length"
        e.tokens += ids
        e.logprobs += logprobs
        e.mask += [True] * len(ids)
        e.last_action = ids


def _respond(running: list[Episode], agent: AgentSpec, tokenizer: Any, sampling: SamplingConfig, turn: int) -> None:
    """Step every running episode with its last action; append the feedback of those that go on."""
    calls: list[tuple[Any, dict[str, Any], int, int | None]] = []
    for e in running:
        states = {"observation_text": e.transcript,
                  "action_text": tokenizer.decode(e.last_action, skip_special_tokens=True),
                  "label": e.label, "turn": turn, "finish_reason": "stop" if e.last_action_stopped else "length"}
        calls.append((e.instance, states, e.row, turn))
    for e, result in zip(running, call_all(agent, "step", calls)):
        e.result = parse_step(agent, result, e.row, turn)
        e.turns += 1
        e.transcript += tokenizer.decode(e.last_action, skip_special_tokens=False)
        budget = sampling.new_tokens(len(e.prompt_ids))
        if e.result.done or len(e.tokens) >= budget:
            e.done = True
            continue
        feedback = _encode(tokenizer, e.result.feedback)
        if len(e.tokens) + len(feedback) >= budget:
            e.done, e.finish = True, "length"
            continue
        e.tokens += feedback
        e.logprobs += [0.0] * len(feedback)
        e.mask += [False] * len(feedback)
        e.transcript += e.result.feedback


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _last_result(e: Episode) -> StepResult:
    """The episode's last step result (every finished episode has one: `_respond` sets it before `done`)."""
    if e.result is None:
        raise RuntimeError(f"episode {e.row} finished without a step result")
    return e.result


def _collect(episodes: list[Episode], tokenizer: Any, clock: dict[str, float]) -> AgentRollout:
    samples = [RolloutSample(e.prompt_index, e.sample_index, e.prompt_ids, e.tokens, e.logprobs, e.finish,
                             {"turns": e.turns}, e.mask) for e in episodes]
    results = [_last_result(e) for e in episodes]
    logs: dict[str, list[float]] = {}
    for result in results:
        for key, value in result.extra_logs.items():
            logs.setdefault(key, []).append(value)
    return AgentRollout(
        samples=samples,
        rewards=torch.tensor([r.reward for r in results], dtype=torch.float32),
        scores=torch.tensor([r.score for r in results], dtype=torch.float32),
        texts=[tokenizer.decode(e.tokens, skip_special_tokens=True) for e in episodes],
        extra_logs={k: torch.tensor(v, dtype=torch.float32) for k, v in logs.items()},
        generation_seconds=clock["generation"],
        environment_seconds=clock["environment"],
    )
