"""Token in, token out across chat templates: property tests of the multi-turn episode assembly.

For random episodes (1-4 turns, random user/tool texts, random sampled assistant ids or texts, stopped or cut) under
three chat templates set on the embedded SmolLM2 tokenizer -- ChatML, a Llama-3-style one and a Qwen3-style one that
drops earlier turns' `<think>...</think>` blocks when it re-renders history -- `run_episodes` (the executor path
`rlhfkit ppo --agent_func_path` uses) is driven with a scripted engine (`generate=`) and an environment whose
feedback is rendered by the template. The Experience the trainer gets must be, position by position, the prompt, the
ids the engine sampled and the environment's ids, with the action mask on exactly the sampled ids.
"""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlhfkit.agents.environment import AgentSpec
from rlhfkit.agents.executor import run_episodes
from rlhfkit.rl.experience import build_experience
from rlhfkit.rollout.types import RolloutSample, SamplingConfig

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}"
          "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
          "{% endif %}")
# Qwen3-style: an assistant message before the last user turn loses its <think>...</think> block when re-rendered
THINK_DROPPING = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEMPLATES = {"chatml": (CHATML, "<|im_end|>"), "llama3": (LLAMA3, "<|eot_id|>"),
             "think_dropping": (THINK_DROPPING, "<|im_end|>")}
SENTINEL = "ASSISTANT_SENTINEL_TEXT"

WORDS = ["the", "tool", "says", "42", "error:", "ls", "-la", "import", "os", "Paris", "café", "日本", "x=1;",
         "{\"a\": 2}", "\n", "  ", "ok", "<think>", "</think>", "hmm", "yes", "no"]
texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=8).map(" ".join)


@pytest.fixture(scope="module")
def templated():
    """One tokenizer per template (fresh copies of the embedded SmolLM2 tokenizer, the session one is untouched)."""
    from rlhfkit.models.tiny import tiny_tokenizer

    out = {}
    for name, (template, stop) in TEMPLATES.items():
        tok = tiny_tokenizer()
        tok.chat_template = template
        if stop not in tok.get_vocab():
            tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", stop]})
        out[name] = (tok, tok.convert_tokens_to_ids(stop))
    return out


def render(tok, messages, generation_prompt):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode(tok, text):
    return list(tok(text, add_special_tokens=False)["input_ids"])


def turn_suffix(tok, message, stop_text, stopped):
    """What the template writes between an assistant message's content and the next assistant content: the
    end-of-turn marker (unless the engine sampled it), the observation message and the generation prompt."""
    text = render(tok, [{"role": "user", "content": "q"}, {"role": "assistant", "content": SENTINEL}, message], True)
    suffix = text.split(SENTINEL, 1)[1]
    assert suffix.startswith(stop_text)
    return suffix[len(stop_text):] if stopped else suffix


@st.composite
def episodes(draw, vocab_size):
    """A scripted episode: the prompt's messages and, per turn, the engine's sampled ids (random ids or a random
    text's tokens, maybe with a <think> block), whether it stopped on the stop token, and the observation after it."""
    turns = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["ids", "text", "think"]))
        if kind == "ids":
            action = draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=12))
        else:
            body = draw(texts)
            action = f"<think>{draw(texts)}</think>\n{body}" if kind == "think" else body
        turns.append({"action": action, "stopped": draw(st.booleans()),
                      "observation": {"role": draw(st.sampled_from(["user", "tool"])), "content": draw(texts)}})
    system = draw(st.one_of(st.none(), texts))
    prompt = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": draw(texts)}]
    return {"prompt": prompt, "turns": turns}


def resolve(tok, stop_id, plans, seed):
    """Resolve the planned actions to the ids "the engine sampled" (the stop id only last, when it stopped)."""
    rng = random.Random(seed)
    for plan in plans:
        for t in plan["turns"]:
            ids = t["action"] if isinstance(t["action"], list) else encode(tok, t["action"])
            ids = [i for i in ids if i != stop_id] or [rng.randrange(3, min(len(tok), 49152))]
            t["ids"] = ids + [stop_id] if t["stopped"] else ids
            t["logprobs"] = [-rng.random() * 5 for _ in t["ids"]]


def scripted_run(tok, stop_id, stop_text, plans, seed):
    """Run `run_episodes` on scripted episodes; returns (rollout, per-episode expected (sampled, env) pieces)."""
    resolve(tok, stop_id, plans, seed)
    prompts = []
    for plan in plans:
        text = render(tok, plan["prompt"], True)
        prompts.append({"prompt": text, "prompt_ids": encode(tok, text)})
    contexts: list[list[list[int]]] = []
    turn_counter = itertools.count()

    def generate(engines, prompt_ids, sampling):
        turn = next(turn_counter)
        running = [p for p in plans if len(p["turns"]) > turn]
        assert len(running) == len(prompt_ids)
        contexts.append(prompt_ids)
        return [RolloutSample(i, 0, list(ctx), list(p["turns"][turn]["ids"]), list(p["turns"][turn]["logprobs"]),
                              "stop" if p["turns"][turn]["stopped"] else "length")
                for i, (p, ctx) in enumerate(zip(running, prompt_ids))]

    rows = itertools.count()

    class Environment:
        def __init__(self):
            self.plan = plans[next(rows)]

        async def step(self, states):
            turns = self.plan["turns"]
            t = turns[states["turn"]]
            assert states["finish_reason"] == ("stop" if t["stopped"] else "length")
            assert states["action_text"] == tok.decode(t["ids"], skip_special_tokens=True)
            done = states["turn"] == len(turns) - 1
            feedback = "" if done else turn_suffix(tok, t["observation"], stop_text, t["stopped"])
            t["feedback_ids"] = encode(tok, feedback)
            return {"rewards": 1.0, "done": done, "environment_feedback": feedback}

    agent = AgentSpec("scripted_env.py", Environment)
    sampling = SamplingConfig(max_new_tokens=100_000, n=1, seed=0)
    out = run_episodes([None], prompts, sampling, agent, tok, None, generate=generate)
    return out, prompts, contexts


def check_token_in_token_out(tok, out, prompts, plans, contexts):
    s = out.samples
    exp = build_experience([x.prompt_ids for x in s], [x.response_ids for x in s], [x.response_logprobs for x in s],
                           [x.prompt_index for x in s], tok.pad_token_id, [x.action_mask for x in s])
    width_r = exp.action_mask.shape[1]
    width_p = exp.sequences.shape[1] - width_r
    for row, (plan, prompt) in enumerate(zip(plans, prompts)):
        want_ids, want_mask, want_logp = [], [], []
        for k, t in enumerate(plan["turns"]):
            # the engine was asked to continue exactly the assembled ids so far
            assert contexts[k][sum(len(p["turns"]) > k for p in plans[:row])] == prompt["prompt_ids"] + want_ids
            want_ids += t["ids"]
            want_mask += [True] * len(t["ids"])
            want_logp += t["logprobs"]
            if k < len(plan["turns"]) - 1:
                want_ids += t["feedback_ids"]
                want_mask += [False] * len(t["feedback_ids"])
                want_logp += [0.0] * len(t["feedback_ids"])
        n_p, n_r = len(prompt["prompt_ids"]), len(want_ids)
        valid = exp.attention_mask[row].bool()
        # what the trainer sees, position by position: prompt, then sampled ids and environment ids interleaved
        assert exp.sequences[row][valid].tolist() == prompt["prompt_ids"] + want_ids
        assert exp.sequences[row, width_p - n_p:width_p + n_r].tolist() == prompt["prompt_ids"] + want_ids
        assert exp.action_mask[row, :n_r].tolist() == want_mask and not exp.action_mask[row, n_r:].any()
        assert exp.rollout_log_probs[row, :n_r].tolist() == pytest.approx(want_logp)
        assert int(exp.action_mask[row].sum()) == sum(len(t["ids"]) for t in plan["turns"])


def rerendered_history(tok, plan, stop_text):
    """The conversation as the template would render it from the decoded actions (what a re-tokenising trainer
    would train on)."""
    messages = list(plan["prompt"])
    for k, t in enumerate(plan["turns"]):
        messages.append({"role": "assistant", "content": tok.decode(t["ids"], skip_special_tokens=True)})
        if k < len(plan["turns"]) - 1:
            messages.append(t["observation"])
    return render(tok, messages, False)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_trainer_sees_exactly_the_sampled_and_environment_ids(templated, name):
    tok, stop_id = templated[name]
    stop_text = TEMPLATES[name][1]

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(plans=st.lists(episodes(len(tok)), min_size=1, max_size=3), seed=st.integers(0, 2**16))
    def prop(plans, seed):
        out, prompts, contexts = scripted_run(tok, stop_id, stop_text, plans, seed)
        check_token_in_token_out(tok, out, prompts, plans, contexts)
        for sample, plan in zip(out.samples, plans):
            assert sample.extra["turns"] == len(plan["turns"]) and sample.finish_reason in ("stop", "length")

    prop()


def test_a_history_the_template_rerenders_differently_keeps_the_sampled_ids(templated):
    """The <think>-dropping template renders the first answer without its thoughts once a later user turn exists;
    the trainer still gets the sampled thoughts (rlhfkit never re-renders or re-tokenises history)."""
    tok, stop_id = templated["think_dropping"]
    plan = {"prompt": [{"role": "user", "content": "What is 6 * 7?"}],
            "turns": [{"action": "<think>six sevens</think>\n42", "stopped": True,
                       "observation": {"role": "user", "content": "And 6 * 8?"}},
                      {"action": "<think>one more six</think>\n48", "stopped": True,
                       "observation": {"role": "user", "content": "-"}}]}
    out, prompts, contexts = scripted_run(tok, stop_id, "<|im_end|>", [plan], 0)
    check_token_in_token_out(tok, out, prompts, [plan], contexts)
    trained = tok.decode(prompts[0]["prompt_ids"] + out.samples[0].response_ids, skip_special_tokens=False)
    assert "<think>six sevens</think>" in trained and "<think>one more six</think>" in trained
    rerendered = rerendered_history(tok, plan, "<|im_end|>")
    assert "six sevens" not in rerendered and not rerendered.startswith(trained)


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_where_the_template_is_faithful_the_tokens_spell_its_rendering(templated, name):
    """Sanity of the scripted environment: for text actions that stopped, the assembled episode decodes to the
    template's own rendering of the conversation (so the feedback really is the template's)."""
    tok, stop_id = templated[name]
    stop_text = TEMPLATES[name][1]

    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(plan=episodes(len(tok)))
    def prop(plan):
        for t in plan["turns"]:
            t["stopped"] = True
            if isinstance(t["action"], list):
                t["action"] = "fine"
            if name == "llama3":   # the Llama-3 template trims contents
                t["action"] = t["action"].strip() or "fine"
                t["observation"]["content"] = t["observation"]["content"].strip() or "ok"
        for m in plan["prompt"]:
            m["content"] = m["content"].strip() or "hi" if name == "llama3" else m["content"]
        out, prompts, _ = scripted_run(tok, stop_id, stop_text, [plan], 0)
        trained = tok.decode(prompts[0]["prompt_ids"] + out.samples[0].response_ids, skip_special_tokens=False)
        assert rerendered_history(tok, plan, stop_text).startswith(trained)

    prop()


# ---- the same episodes through the OpenAI-compatible endpoint (run_agent), which does render history ----

def expected_drift_call(name, plan):
    """The first call whose rendered history no longer continues the previous prompt + reply, or None.

    Llama-3 trims contents (a reply with surrounding whitespace renders differently); the <think>-dropping template
    drops a reply's thoughts once a user turn follows it (not when only tool turns do)."""
    turns = plan["turns"]
    for c in range(1, len(turns)):
        content = [tok_content for tok_content in (t["content"] for t in turns[:c])]
        if name == "llama3" and content[c - 1] != content[c - 1].strip():
            return c
        if name == "think_dropping" and turns[c - 1]["observation"]["role"] == "user":
            for j in range(c):   # reply j loses its thoughts now, and did not in call c-1's prompt
                if "</think>" in content[j] and all(t["observation"]["role"] != "user" for t in turns[j:c - 1]):
                    return c
    return None


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_endpoint_keeps_sampled_ids_or_refuses_naming_the_call(templated, name):
    """run_agent episodes with the real openai client: the trained sequence is the sampled ids and the new prompt
    tokens between calls, position by position; where the template re-renders a reply differently (<think>
    dropped, Llama-3's trim), the episode is refused naming the call, never silently re-tokenised."""
    from openai import AsyncOpenAI

    from rlhfkit.agents.openai_server import run_endpoint_episodes
    from rlhfkit.errors import AgentError

    tok, stop_id = templated[name]
    seen: set[bool] = set()

    @settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(plan=episodes(len(tok)), seed=st.integers(0, 2**16))
    def prop(plan, seed):
        resolve(tok, stop_id, [plan], seed)
        for t in plan["turns"]:
            t["content"] = tok.decode(t["ids"], skip_special_tokens=True)
        contexts, calls = [], itertools.count()

        def generate(engines, prompt_ids, sampling):
            [ctx] = prompt_ids
            t = plan["turns"][next(calls)]
            contexts.append(ctx)
            return [RolloutSample(0, 0, ctx, list(t["ids"]), list(t["logprobs"]),
                                  "stop" if t["stopped"] else "length")]

        async def run_agent(base_url, prompt, label):
            client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
            messages = list(plan["prompt"])
            for t in plan["turns"]:
                reply = await client.chat.completions.create(model="p", messages=messages, max_tokens=10**4)
                assert reply.choices[0].message.content == t["content"]
                messages += [{"role": "assistant", "content": reply.choices[0].message.content}, t["observation"]]
            return 1.0

        agent = AgentSpec("endpoint_env.py", None, None, run_agent)
        prompts = [{"prompt": "", "label": None}]
        drift = expected_drift_call(name, plan)
        seen.add(drift is not None)
        if drift is not None:
            with pytest.raises(AgentError, match=rf"episode 0, call {drift}: its prompt does not start with call "
                                                 rf"{drift - 1}'s prompt \+ sampled tokens"):
                run_endpoint_episodes([None], prompts, SamplingConfig(max_new_tokens=10**5), agent, tok,
                                      generate=generate)
            return
        out = run_endpoint_episodes([None], prompts, SamplingConfig(max_new_tokens=10**5), agent, tok,
                                    generate=generate)
        [sample] = out.samples
        assert sample.prompt_ids == encode(tok, render(tok, plan["prompt"], True)) == contexts[0]
        want, mask, logp = [], [], []
        for k, t in enumerate(plan["turns"]):
            if k:   # the engine continued exactly the previous context and the ids it sampled
                before = contexts[k - 1] + plan["turns"][k - 1]["ids"]
                assert contexts[k][:len(before)] == before
                env = contexts[k][len(before):]
                want, mask, logp = want + env, mask + [False] * len(env), logp + [0.0] * len(env)
            want, mask, logp = want + t["ids"], mask + [True] * len(t["ids"]), logp + t["logprobs"]
        assert sample.response_ids == want and sample.action_mask == mask
        assert sample.response_logprobs == pytest.approx(logp)
        exp = build_experience([sample.prompt_ids], [sample.response_ids], [sample.response_logprobs], [0],
                               tok.pad_token_id, [sample.action_mask])
        assert exp.sequences[0][exp.attention_mask[0].bool()].tolist() == sample.prompt_ids + want
        assert exp.action_mask[0, :len(want)].tolist() == mask
        # the new tokens between calls spell what the template writes there (turn markers, the observation)
        for k in range(1, len(plan["turns"])):
            env_text = tok.decode(contexts[k][len(contexts[k - 1]) + len(plan["turns"][k - 1]["ids"]):])
            assert plan["turns"][k - 1]["observation"]["content"].strip() in env_text

    prop()
    assert seen == ({False} if name == "chatml" else {False, True})   # both outcomes were exercised
