"""Multi-turn episodes on the real vLLM engine (tiny model): token-in-token-out bookkeeping, masks, budget, errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlhfkit.agents.environment import load_agent
from rlhfkit.agents.executor import run_episodes
from rlhfkit.errors import AgentError
from rlhfkit.rl.experience import build_experience
from rlhfkit.rollout.dispatch import generate_on_engines
from rlhfkit.rollout.types import SamplingConfig

HERE = Path(__file__).parent
QUESTIONS = ["Say hello.", "What is 2 + 2?", "Name a colour."]
LOGPROB_TOL = 1e-4  # fp32 tiny model; engine and trainer agree to ~1e-6


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[dict]:
    out = []
    for q in QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False)
        out.append({"prompt": text, "prompt_ids": tokenizer(text, add_special_tokens=False)["input_ids"]})
    return out


def two_turn_agent(action_max_len: int | None = 6):
    agent = load_agent(str(HERE / "two_turn_env.py"), action_max_len)
    return agent, sys.modules[agent.cls.__module__]


def split_turns(sample) -> list[tuple[bool, list[int]]]:
    """(is_action, tokens) runs of a multi-turn response."""
    runs: list[tuple[bool, list[int]]] = []
    for token, is_action in zip(sample.response_ids, sample.action_mask):
        if not runs or runs[-1][0] != is_action:
            runs.append((is_action, []))
        runs[-1][1].append(token)
    return runs


def test_episodes_interleave_sampled_actions_and_masked_feedback(rollout_vllm_engine, tokenizer, prompts):
    agent, env = two_turn_agent()
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=64, n=2, seed=7)
    out = run_episodes([rollout_vllm_engine], prompts, sampling, agent, tokenizer, agent.action_max_len)
    feedback = tokenizer(env.FEEDBACK, add_special_tokens=False)["input_ids"]
    assert [(s.prompt_index, s.sample_index) for s in out.samples] == [(i, j) for i in range(3) for j in range(2)]
    steps = [states for kind, states in env.CALLS if kind == "step"]
    assert len(steps) == 2 * len(out.samples) and [k for k, _ in env.CALLS[:6]] == ["reset"] * 6
    for row, (sample, reward) in enumerate(zip(out.samples, out.rewards)):
        (a0, first), (f, fed), (a1, second) = split_turns(sample)
        assert (a0, f, a1) == (True, False, True) and fed == feedback
        assert 1 <= len(first) <= 6 and 1 <= len(second) <= 6 and sample.extra["turns"] == 2
        assert all(lp == 0.0 for lp, m in zip(sample.response_logprobs, sample.action_mask) if not m)
        texts = [tokenizer.decode(first, skip_special_tokens=True), tokenizer.decode(second, skip_special_tokens=True)]
        # the environment saw each action's text, and the episode so far as context
        prompt = prompts[sample.prompt_index]["prompt"]
        finish = ["stop" if ids[-1] == tokenizer.eos_token_id else "length" for ids in (first, second)]
        assert steps[row] == {"observation_text": prompt, "action_text": texts[0], "label": None, "turn": 0,
                              "finish_reason": finish[0]}
        assert steps[len(out.samples) + row] == {
            "observation_text": prompt + tokenizer.decode(first, skip_special_tokens=False) + env.FEEDBACK,
            "action_text": texts[1], "label": None, "turn": 1, "finish_reason": finish[1]}
        assert reward == pytest.approx(env.upper_share(texts))  # the last step's reward
    assert out.extra_logs["turn"].tolist() == [1.0] * 6
    assert out.generation_seconds > 0 and out.environment_seconds > 0


def test_turn_zero_draws_the_single_turn_tokens(rollout_vllm_engine, tokenizer, prompts):
    agent, _ = two_turn_agent()
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=64, n=2, seed=11)
    out = run_episodes([rollout_vllm_engine], prompts, sampling, agent, tokenizer, agent.action_max_len)
    single = generate_on_engines([rollout_vllm_engine], [p["prompt_ids"] for p in prompts],
                                 SamplingConfig(temperature=1.0, max_new_tokens=6, n=2, seed=11))
    for multi, one in zip(out.samples, single):
        assert split_turns(multi)[0][1] == one.response_ids


def test_trainer_and_engine_score_the_multi_turn_tokens_as_sampled(rollout_vllm_engine, tokenizer, prompts,
                                                                    tiny_model_dir):
    """Token in, token out: the sequences the trainer sees reproduce the sampling log-probs on every action token."""
    import ray

    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.models.logprobs import response_log_probs

    agent, _ = two_turn_agent(action_max_len=5)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=64, n=2, seed=3)
    out = run_episodes([rollout_vllm_engine], prompts, sampling, agent, tokenizer, agent.action_max_len)
    s = out.samples
    exp = build_experience([x.prompt_ids for x in s], [x.response_ids for x in s], [x.response_logprobs for x in s],
                           [x.prompt_index for x in s], tokenizer.pad_token_id, [x.action_mask for x in s])
    assert exp.action_mask.sum().item() == sum(sum(x.action_mask) for x in s)
    assert (~exp.action_mask & exp.attention_mask[:, -exp.action_mask.shape[1]:].bool()).any()  # holes
    model = load_causal_lm(tiny_model_dir).eval()
    with torch.no_grad():
        logp = response_log_probs(model, exp.sequences, exp.attention_mask)[:, -exp.action_mask.shape[1]:]
    diff = (logp - exp.rollout_log_probs).abs()[exp.action_mask]
    assert diff.max().item() < LOGPROB_TOL
    scored = ray.get(rollout_vllm_engine.score.remote([x.prompt_ids for x in s], [x.response_ids for x in s]))
    for sample, engine_logp in zip(s, scored):
        for got, want, is_action in zip(engine_logp, sample.response_logprobs, sample.action_mask):
            if is_action:
                assert abs(got - want) < LOGPROB_TOL


def test_the_budget_ends_an_episode_without_dangling_feedback(rollout_vllm_engine, tokenizer, prompts):
    agent, env = two_turn_agent(action_max_len=6)
    feedback = len(tokenizer(env.FEEDBACK, add_special_tokens=False)["input_ids"])
    budget = 6 + feedback  # room for the first action and the feedback, none for a second action
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=budget, n=1, seed=5, ignore_eos=True)
    out = run_episodes([rollout_vllm_engine], prompts, sampling, agent, tokenizer, agent.action_max_len)
    for sample in out.samples:
        assert sample.response_ids and all(sample.action_mask) and len(sample.response_ids) == 6
        assert sample.finish_reason == "length" and sample.extra["turns"] == 1
    # without a per-action cap, the first action takes the whole budget
    out = run_episodes([rollout_vllm_engine], prompts, sampling, agent, tokenizer, None)
    assert all(len(x.response_ids) == budget and x.finish_reason == "length" for x in out.samples)


def test_a_failing_environment_stops_the_rollout_naming_episode_and_turn(rollout_vllm_engine, tokenizer, prompts):
    agent = load_agent(str(HERE / "broken_envs.py"), 3)
    module = sys.modules[agent.cls.__module__]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=32, n=1, seed=1)
    for mode, message in [("raise", "raised KeyError: 'no such tool'"), ("nan", "'rewards' is nan"),
                          ("no_done", "returned no 'done'"), ("str", "returned str")]:
        module.MODE = mode
        with pytest.raises(AgentError, match=message) as err:
            run_episodes([rollout_vllm_engine], prompts, sampling, agent, tokenizer, agent.action_max_len)
        assert "broken_envs.py: AgentInstance.step (episode 0, turn 1)" in str(err.value)
