"""Agents over the OpenAI-compatible endpoint (`run_agent(base_url, prompt, label)`), with the real `openai`
client against the tiny model on the session's vLLM engine: the recorded calls become one token sequence (sampled
ids trained, tool/prompt ids masked), sampled exactly as the engine scored them; drift and misuse are refused."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest
from ppo_helpers import run, series

from rlhfkit.agents.environment import load_agent
from rlhfkit.agents.openai_server import run_endpoint_episodes
from rlhfkit.errors import AgentError
from rlhfkit.rollout.types import SamplingConfig

HERE = Path(__file__).parent
LOGPROB_TOL = 1e-4
PROMPTS = [{"prompt": "Count the words you write.", "label": None}, {"prompt": "Say hi.", "label": None}]


def endpoint_agent(mode: str):
    agent = load_agent(str(HERE / "endpoint_agent.py"), None)
    module = sys.modules[agent.run_agent.__module__]
    module.MODE = mode
    module.CALLS.clear()
    return agent, module


def test_a_tool_using_agent_becomes_one_token_sequence(rollout_vllm_engine, tokenizer):
    import ray

    agent, module = endpoint_agent("tool")
    assert agent.cls is None and agent.name == "endpoint_agent.py:run_agent"
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=64, n=2, seed=4)
    out = run_endpoint_episodes([rollout_vllm_engine], PROMPTS, sampling, agent, tokenizer)
    assert [(s.prompt_index, s.sample_index) for s in out.samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(module.CALLS) == 4
    for row, sample in enumerate(out.samples):
        [calls] = [c for url, c in module.CALLS.items() if f"/episodes/{row}/v1" in url]
        assert len(calls) == 2 and sample.extra["turns"] == 2
        first, second = (c.choices[0].model_extra for c in calls)
        # the first call's prompt is the episode's prompt; every later prompt continues prompt + sampled ids
        assert sample.prompt_ids == first["prompt_token_ids"]
        assert second["prompt_token_ids"][:len(first["prompt_token_ids"]) + len(first["token_ids"])] == \
            first["prompt_token_ids"] + first["token_ids"]
        assert sample.prompt_ids + sample.response_ids == second["prompt_token_ids"] + second["token_ids"]
        env = second["prompt_token_ids"][len(first["prompt_token_ids"]) + len(first["token_ids"]):]
        assert "words: " in tokenizer.decode(env) and "<|im_start|>tool" in tokenizer.decode(env)
        assert sample.action_mask == [True] * len(first["token_ids"]) + [False] * len(env) + \
            [True] * len(second["token_ids"])
        # the chat logprobs the client got are the recorded ones
        assert [x.logprob for x in calls[1].choices[0].logprobs.content] == \
            pytest.approx(sample.response_logprobs[-len(second["token_ids"]):])
        assert calls[0].choices[0].message.content == tokenizer.decode(first["token_ids"], skip_special_tokens=True)
        texts = [c.choices[0].message.content for c in calls]
        assert out.rewards[row].item() == pytest.approx(module.upper_share(texts))
    # token in, token out: the engine scores the assembled sequence as it sampled it, on every trained token
    scored = ray.get(rollout_vllm_engine.score.remote([s.prompt_ids for s in out.samples],
                                                      [s.response_ids for s in out.samples]))
    for sample, engine_logp in zip(out.samples, scored):
        for got, want, trained in zip(engine_logp, sample.response_logprobs, sample.action_mask):
            assert abs(got - want) < LOGPROB_TOL if trained else want == 0.0
    assert out.extra_logs["calls"].tolist() == [2.0] * 4 and out.generation_seconds > 0


def test_completions_models_and_tokenize_routes(rollout_vllm_engine, tokenizer):
    agent, module = endpoint_agent("completions")
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=64, n=1, seed=2)
    out = run_endpoint_episodes([rollout_vllm_engine], PROMPTS[:1], sampling, agent, tokenizer)
    [calls] = module.CALLS.values()
    first, second = (c.choices[0].model_extra for c in calls)
    assert first["prompt_token_ids"] == tokenizer(PROMPTS[0]["prompt"], add_special_tokens=False)["input_ids"]
    [sample] = out.samples
    assert sample.prompt_ids + sample.response_ids == second["prompt_token_ids"] + second["token_ids"]
    assert sample.action_mask.count(False) == 1   # the "\n" the agent added
    assert calls[1].choices[0].logprobs.token_logprobs == pytest.approx(sample.response_logprobs[-len(
        second["token_ids"]):])
    # /v1/models and /tokenize on a live server
    from openai import OpenAI

    from rlhfkit.agents.openai_server import EndpointServer, EpisodeLog

    with EndpointServer([rollout_vllm_engine], tokenizer, sampling, [EpisodeLog(0)]) as server:
        client = OpenAI(base_url=server.base_url(0), api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["rlhfkit-policy"]
        for url in (server.base_url(0).removesuffix("/v1") + "/tokenize", server.base_url(0) + "/tokenize"):
            body = json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
            with urllib.request.urlopen(urllib.request.Request(url, body, {"Content-Type": "application/json"})) as r:
                got = json.load(r)
            want = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
            assert got["tokens"] == list(getattr(want, "input_ids", want)) and got["count"] == len(got["tokens"])


@pytest.mark.parametrize("mode", ["drift", "swallow"])
def test_multi_turn_drift_is_refused_naming_the_episode_and_call(rollout_vllm_engine, tokenizer, mode):
    agent, _ = endpoint_agent(mode)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=64, n=1, seed=1)
    with pytest.raises(AgentError, match=r"endpoint_agent.py: run_agent \(episode 0\): episode 0, call 1: its prompt "
                                         r"does not start with call 0's prompt \+ sampled tokens"):
        run_endpoint_episodes([rollout_vllm_engine], PROMPTS[:1], sampling, agent, tokenizer)


def test_an_agent_that_never_calls_is_refused(rollout_vllm_engine, tokenizer):
    agent, _ = endpoint_agent("nocall")
    with pytest.raises(AgentError, match=r"run_agent \(episode 0\) made no model call"):
        run_endpoint_episodes([rollout_vllm_engine], PROMPTS, SamplingConfig(max_new_tokens=8, n=1), agent,
                              tokenizer)


@pytest.mark.slow
def test_one_ppo_step_with_an_endpoint_agent(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    endpoint_agent("tool")
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, remote_rm_url=None,
               agent_func_path=str(HERE / "endpoint_agent.py"), apply_chat_template=False, generate_max_len=40,
               n_samples_per_prompt=4, rollout_batch_size=2, train_batch_size=8, micro_train_batch_size=8,
               micro_rollout_batch_size=8, max_samples=2)
    assert len(series(rows, "rollout/reward_mean")) == 1
    assert series(rows, "rollout/turns_mean") == [2.0] and series(rows, "reward/calls") == [2.0]
    assert series(rows, "rollout/env_tokens_mean")[0] > 5     # the tool turns are in the sequences, masked
    assert max(series(rows, "rollout/logprob_abs_diff_mean")) < 1e-3
    assert "train/policy_loss" in rows[-1]


def test_the_example_calculator_agent_over_a_scripted_engine(tokenizer):
    """examples/agents/openai_calculator_agent.py: a <calc> reply gets a tool message, the answer is checked."""
    from rlhfkit.rollout.types import RolloutSample

    agent = load_agent(str(HERE.parents[1] / "examples" / "agents" / "openai_calculator_agent.py"))
    script = {}

    def generate(engines, prompt_ids, sampling):   # reply by the number of calls the episode made so far
        [ids] = prompt_ids
        key = tokenizer.decode(ids).count("<|im_start|>assistant")
        ids_out = tokenizer(script[key], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return [RolloutSample(0, 0, ids, ids_out, [-0.5] * len(ids_out), "stop")]

    prompts = [{"prompt": "What is 123 + 456?", "label": "579"}]
    script.update({1: "Let me use <calc>123 + 456</calc>", 2: "579"})
    out = run_endpoint_episodes([None], prompts, SamplingConfig(max_new_tokens=100, n=1), agent, tokenizer,
                                generate=generate)
    [sample] = out.samples
    assert out.rewards.tolist() == [pytest.approx(0.95)] and sample.extra["turns"] == 2
    runs = [(m, tokenizer.decode([t for t, mm in zip(sample.response_ids, sample.action_mask) if mm == m]))
            for m in (True, False)]
    assert runs[0][1] == "Let me use <calc>123 + 456</calc><|im_end|>579<|im_end|>"
    assert runs[1][1] == "\n<|im_start|>tool\n579<|im_end|>\n<|im_start|>assistant\n"
    script.update({1: "580"})
    out = run_endpoint_episodes([None], prompts, SamplingConfig(max_new_tokens=100, n=1), agent, tokenizer,
                                generate=generate)
    assert out.rewards.tolist() == [0.0] and out.samples[0].action_mask == [True] * len(out.samples[0].response_ids)


def test_the_episode_budget_caps_calls_and_a_bad_reward_is_refused(tokenizer):
    """--generate_max_len bounds an episode's sampled + in-between prompt tokens: a call with no room left gets an
    empty "length" completion and nothing is recorded; a reward that is not a finite number stops the run."""
    from openai import AsyncOpenAI

    from rlhfkit.agents.environment import AgentSpec
    from rlhfkit.rollout.types import RolloutSample

    seen = []

    def generate(engines, prompt_ids, sampling):   # always as many tokens as allowed: "a a a ..."
        seen.append(sampling.max_new_tokens)
        ids = tokenizer(" a" * sampling.max_new_tokens, add_special_tokens=False)["input_ids"]
        return [RolloutSample(0, 0, prompt_ids[0], ids, [-1.0] * len(ids), "length")]

    async def run_agent(base_url, prompt, label, reward=1.0):
        client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        messages, finishes = [{"role": "user", "content": prompt}], []
        for _ in range(3):
            reply = await client.chat.completions.create(model="p", messages=messages, max_tokens=6)
            finishes.append((reply.choices[0].finish_reason, reply.choices[0].message.content))
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "tool", "content": "ok"}]
        FINISHES.append(finishes)
        return label

    FINISHES: list = []
    agent = AgentSpec("budget_env.py", None, None, run_agent)
    prompts = [{"prompt": "hi", "label": 0.5}]
    out = run_endpoint_episodes([None], prompts, SamplingConfig(max_new_tokens=20, n=1), agent, tokenizer,
                                generate=generate)
    [sample] = out.samples
    env = len(tokenizer("<|im_end|>\n<|im_start|>tool\nok<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)["input_ids"])
    assert seen == [6, 20 - 6 - env] and len(sample.response_ids) == 20 == 6 + env + seen[1]
    assert FINISHES == [[("length", " a a a a a a"), ("length", " a" * seen[1]), ("length", "")]]
    assert sample.finish_reason == "length" and sample.extra["turns"] == 2 and out.rewards.tolist() == [0.5]
    for bad in (float("nan"), "1.0", None):
        with pytest.raises(AgentError, match=r"budget_env.py: run_agent \(episode 0\) returned .*expected a finite"):
            run_endpoint_episodes([None], [{"prompt": "hi", "label": bad}], SamplingConfig(max_new_tokens=20),
                                  agent, tokenizer, generate=generate)
