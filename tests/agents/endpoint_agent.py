"""A test agent over the OpenAI-compatible endpoint: ask, run a "tool" on the reply (a word count), give the
tool's result back as a `tool` message, ask again. Reward: the share of uppercase ASCII letters in both replies.
Every call's request and response are recorded in CALLS (row -> list) so the tests can check the assembly.

MODE: "tool" (above), "drift" (the second call edits the first reply), "swallow" (drift, and the agent catches
the refusal), "nocall" (returns without calling), "completions" (the /v1/completions route with token ids)."""

import string

from openai import AsyncOpenAI, BadRequestError

MODE = "tool"
MAX_TOKENS = 6
CALLS: dict[str, list] = {}


def upper_share(texts):
    chars = [c for t in texts for c in t if not c.isspace()]
    return sum(c in string.ascii_uppercase for c in chars) / len(chars) if chars else 0.0


async def run_agent(base_url, prompt, label):
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    calls = CALLS.setdefault(base_url, [])
    if MODE == "nocall":
        return 0.0
    if MODE == "completions":
        first = await client.completions.create(model="policy", prompt=prompt, max_tokens=MAX_TOKENS)
        calls.append(first)
        ids = first.choices[0].model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
        nxt = await client.completions.create(model="policy", prompt=ids + [198], max_tokens=MAX_TOKENS, logprobs=1)
        calls.append(nxt)
        return upper_share([first.choices[0].text, nxt.choices[0].text])
    messages = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
    calls.append(first)
    reply = first.choices[0].message.content
    edited = "(edited) " + reply if MODE in ("drift", "swallow") else reply
    messages += [{"role": "assistant", "content": edited},
                 {"role": "tool", "content": f"words: {len(reply.split())}"}]
    try:
        second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=MAX_TOKENS)
    except BadRequestError:
        if MODE == "swallow":
            return 0.0
        raise
    calls.append(second)
    return upper_share([reply, second.choices[0].message.content])
