"""Agents over an OpenAI-compatible endpoint: `async def run_agent(base_url, prompt, label) -> float`.

For a rollout, rlhfkit starts one small HTTP server (stdlib `http.server`, loopback, a free port) over the rollout
engines; episode r gets its own `base_url` (`http://127.0.0.1:PORT/episodes/r/v1`) and may call it, with the
`openai` client or plain HTTP, as often as it likes:

- `POST /v1/chat/completions` (`messages`, `max_tokens`/`max_completion_tokens`, `tools` passed to the template),
- `POST /v1/completions` (`prompt`: text or token ids),
- `GET /v1/models`, `POST /tokenize` (`prompt` or `messages`; also under `/v1`).

Sampling follows the run (`--temperature`, `--top_k`, `--top_p`, seeds), not the request: the trainer's log-probs
must be the policy's at the sampling temperature and truncation. `max_tokens` is capped by `--agent_action_max_len`
and by what is left of the episode's `--generate_max_len` budget (a call with no room left answers an empty "length"
completion).

Every call records its prompt token ids, the sampled ids and their log-probs. Token in, token out: when a call's
rendered prompt text continues the previous call's prompt text plus the text it returned (the assistant message as
the template writes it, its end-of-turn token included), the previous ids are kept as sampled and only the new text
is tokenised. The episode becomes one sequence: the first call's prompt, then per call its sampled ids (trained)
and the new prompt tokens of the next call (masked). A call whose prompt does not continue the previous prompt and
sampled tokens (the agent edited or re-templated history: multi-turn drift) is refused with HTTP 400, and the run
stops with an AgentError naming the episode and the call (turn), whatever the agent did with the error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from rlhfkit.agents.environment import AgentSpec
from rlhfkit.agents.executor import AgentRollout, seed_agent_generators
from rlhfkit.errors import AgentError, DriftError
from rlhfkit.rollout.dispatch import generate_on_engines
from rlhfkit.rollout.types import FinishReason, RolloutSample, SamplingConfig

TURN_STRIDE = 1_000_003
MODEL_NAME = "rlhfkit-policy"
_ROUTE = re.compile(r"^/episodes/(\d+)(/v1)?(/chat/completions|/completions|/models|/tokenize)/?$")


@dataclass
class Call:
    prompt_ids: list[int]
    prompt_text: str | None       # None: the call gave token ids
    sampled: list[int]
    logprobs: list[float]
    continuation: str             # the text that continues prompt_text in a faithful next prompt
    finish: FinishReason


@dataclass
class EpisodeLog:
    """The calls of one episode, and the assembled sequence: `prompt_ids` + `tokens` (`mask`: sampled)."""

    row: int
    calls: list[Call] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    error: str | None = None
    budget_spent: bool = False    # a call found no room left in --generate_max_len
    lock: threading.Lock = field(default_factory=threading.Lock)

    def context(self, text: str | None, ids: list[int] | None, encode: Callable[[str], list[int]]) -> list[int]:
        """The token ids of the next call's prompt; DriftError when it does not continue the episode."""
        if not self.calls:
            return list(ids) if ids is not None else encode(text or "")
        last = self.calls[-1]
        before = last.prompt_ids + last.sampled
        if text is not None and last.prompt_text is not None:
            prefix = last.prompt_text + last.continuation
            if text.startswith(prefix):
                return before + encode(text[len(prefix):])
            ids = encode(text)
        elif ids is None:  # text only, after a call that was given ids
            ids = encode(text or "")
        if ids[:len(before)] == before:
            return list(ids)
        turn = len(self.calls)
        at = next((i for i, (a, b) in enumerate(zip(ids, before)) if a != b), min(len(ids), len(before)))
        raise DriftError(f"episode {self.row}, call {turn}: its prompt does not start with call {turn - 1}'s prompt "
                         f"+ sampled tokens ({len(before)} tokens; first difference at token {at}: multi-turn drift, "
                         "the history was edited or re-rendered differently from what was sampled)")

    def record(self, call: Call) -> None:
        if not self.calls:
            self.prompt_ids = list(call.prompt_ids)
        else:
            last = self.calls[-1]
            new = call.prompt_ids[len(last.prompt_ids) + len(last.sampled):]
            self.tokens += new
            self.logprobs += [0.0] * len(new)
            self.mask += [False] * len(new)
        self.tokens += call.sampled
        self.logprobs += call.logprobs
        self.mask += [True] * len(call.sampled)
        self.calls.append(call)


class EndpointServer:
    """The loopback HTTP server of one rollout: episode r's calls go to `base_url(r)`."""

    def __init__(self, engines: Sequence[Any], tokenizer: Any, sampling: SamplingConfig, episodes: list[EpisodeLog],
                 action_max_len: int | None = None, generate: Callable = generate_on_engines):
        self.engines, self.tokenizer, self.sampling = engines, tokenizer, sampling
        self.episodes, self.action_max_len, self.generate = episodes, action_max_len, generate
        self.generation_seconds = 0.0
        self._clock = threading.Lock()
        self._tok = threading.RLock()   # a fast tokenizer is not safe to call from several handler threads at once
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:   # quiet
                pass

            def do_GET(self) -> None:
                self._serve(None)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except json.JSONDecodeError as err:
                    return self._reply(400, {"error": {"message": f"invalid JSON: {err}", "type": "invalid_request"}})
                self._serve(body)

            def _serve(self, body: dict | None) -> None:
                match = _ROUTE.match(self.path.split("?")[0])
                if match is None or int(match.group(1)) >= len(server.episodes):
                    return self._reply(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                try:
                    self._reply(200, server.handle(int(match.group(1)), match.group(3), body))
                except DriftError as err:
                    self._reply(400, {"error": {"message": str(err), "type": "multi_turn_drift"}})
                except Exception as err:  # noqa: BLE001 - reported to the client, and to the run via the log
                    self._reply(400, {"error": {"message": f"{type(err).__name__}: {err}", "type": "invalid_request"}})

            def _reply(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        # a short poll: shutdown() waits for it, once per rollout
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def base_url(self, row: int) -> str:
        return f"http://127.0.0.1:{self.port}/episodes/{row}/v1"

    def __enter__(self) -> EndpointServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ---- the routes ----
    def handle(self, row: int, route: str, body: dict | None) -> dict:
        if route == "/models":
            return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "rlhfkit"}]}
        if body is None:
            raise ValueError(f"{route} takes a POST with a JSON body")
        if route == "/tokenize":
            text = self._render(body) if "messages" in body else body.get("prompt", "")
            ids = self._encode(text)
            return {"tokens": ids, "count": len(ids), "max_model_len": None}
        episode = self.episodes[row]
        with episode.lock:   # one episode's calls are sequential, as a conversation is
            try:
                if route == "/chat/completions":
                    return self._chat(episode, body)
                return self._complete(episode, body)
            except DriftError as err:
                episode.error = episode.error or str(err)
                raise

    def _render(self, body: dict) -> str:
        kwargs = {"tools": body["tools"]} if body.get("tools") else {}
        with self._tok:
            return self.tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True,
                                                      **kwargs)

    def _encode(self, text: str) -> list[int]:
        with self._tok:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        with self._tok:
            return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _chat(self, episode: EpisodeLog, body: dict) -> dict:
        text = self._render(body)
        call = self._sample(episode, text, None, body.get("max_completion_tokens") or body.get("max_tokens"))
        content = self._decode(call.sampled, skip_special_tokens=True)
        stop = self._decode(call.sampled[-1:]) if call.finish == "stop" and call.sampled and \
            call.sampled[-1] in self.tokenizer.all_special_ids else ""
        call.continuation = content + stop
        if call.sampled:
            episode.record(call)
        message = {"role": "assistant", "content": content}
        return self._response("chat.completion", call, {"message": message, "logprobs": self._logprobs(call, True)})

    def _complete(self, episode: EpisodeLog, body: dict) -> dict:
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, [int(t) for t in prompt])
        call = self._sample(episode, text, ids, body.get("max_tokens") or 16)
        call.continuation = self._decode(call.sampled)
        if call.sampled:
            episode.record(call)
        logprobs = self._logprobs(call, False) if body.get("logprobs") is not None else None
        return self._response("text_completion", call, {"text": call.continuation, "logprobs": logprobs})

    def _sample(self, episode: EpisodeLog, text: str | None, ids: list[int] | None, max_tokens: Any) -> Call:
        prompt_ids = episode.context(text, ids, self._encode)
        budget = self.sampling.new_tokens(len(episode.calls[0].prompt_ids if episode.calls else prompt_ids))
        used = len(episode.tokens)   # response tokens so far, plus this call's new (environment) prompt tokens
        if episode.calls:
            used += len(prompt_ids) - len(episode.calls[-1].prompt_ids) - len(episode.calls[-1].sampled)
        cap = min(budget - used, self.action_max_len or budget, int(max_tokens) if max_tokens else budget)
        if cap < 1:   # nothing left of the episode's budget: an empty completion, nothing recorded
            episode.budget_spent = True
            return Call(prompt_ids, text, [], [], "", "length")
        turn = len(episode.calls)
        seed = None if self.sampling.seed is None else self.sampling.seed + episode.row + turn * TURN_STRIDE
        sampling = dataclasses.replace(self.sampling, n=1, max_new_tokens=cap, seed=seed)
        began = time.perf_counter()
        [sample] = self.generate(self.engines, [prompt_ids], sampling)
        with self._clock:
            self.generation_seconds += time.perf_counter() - began
        return Call(prompt_ids, text, list(sample.response_ids), list(sample.response_logprobs), "",
                    sample.finish_reason)

    def _logprobs(self, call: Call, chat: bool) -> dict:
        pieces = [self._decode([t]) for t in call.sampled]
        if chat:
            return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                                for p, lp in zip(pieces, call.logprobs)]}
        return {"tokens": pieces, "token_logprobs": call.logprobs, "top_logprobs": None, "text_offset": None}

    def _response(self, kind: str, call: Call, choice: dict) -> dict:
        return {"id": f"rlhfkit-{id(call):x}", "object": kind, "created": int(time.time()), "model": MODEL_NAME,
                "choices": [{"index": 0, "finish_reason": call.finish, **choice,
                             "prompt_token_ids": call.prompt_ids, "token_ids": call.sampled}],
                "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.sampled),
                          "total_tokens": len(call.prompt_ids) + len(call.sampled)}}


def run_endpoint_episodes(engines: Sequence[Any], prompts: list[dict[str, Any]], sampling: SamplingConfig,
                          agent: AgentSpec, tokenizer: Any, action_max_len: int | None = None,
                          generate: Callable = generate_on_engines) -> AgentRollout:
    """Run `sampling.n` episodes of `agent.run_agent` per prompt concurrently against one loopback endpoint."""
    rows = [(i, j, p) for i, p in enumerate(prompts) for j in range(sampling.n)]
    logs = [EpisodeLog(r) for r in range(len(rows))]
    seed_agent_generators(sampling.seed)  # draws made before the episodes' first await are then reproducible
    began = time.perf_counter()
    with EndpointServer(engines, tokenizer, sampling, logs, action_max_len, generate) as server:
        async def one(row: int, prompt: dict) -> Any:
            try:
                out = agent.run_agent(server.base_url(row), prompt["prompt"], prompt.get("label"))
                return await out if inspect.isawaitable(out) else out
            except Exception as err:
                if logs[row].error:
                    raise AgentError(f"{agent.where('run_agent', row)}: {logs[row].error}") from err
                raise AgentError(f"{agent.where('run_agent', row)} raised {type(err).__name__}: {err}") from err

        async def gather() -> list[Any]:
            return list(await asyncio.gather(*(one(r, p) for r, (_, _, p) in enumerate(rows))))

        rewards = asyncio.run(gather())
    total = time.perf_counter() - began
    samples = []
    for (i, j, _), log, reward in zip(rows, logs, rewards):
        where = agent.where("run_agent", log.row)
        if log.error:   # the agent swallowed the refusal: the episode is still not trainable
            raise AgentError(f"{where}: {log.error}")
        if not log.calls:
            raise AgentError(f"{where} made no model call: an episode needs at least one completion to train on")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward or \
                reward in (float("inf"), float("-inf")):
            raise AgentError(f"{where} returned {reward!r}; expected a finite number (the episode's reward)")
        finish = "length" if log.budget_spent else log.calls[-1].finish
        samples.append(RolloutSample(i, j, log.prompt_ids, log.tokens, log.logprobs, finish,
                                     {"turns": len(log.calls)}, log.mask))
    rewards_t = torch.tensor([float(r) for r in rewards], dtype=torch.float32)
    return AgentRollout(
        samples=samples, rewards=rewards_t, scores=rewards_t.clone(),
        texts=[tokenizer.decode(log.tokens, skip_special_tokens=True) for log in logs],
        extra_logs={"calls": torch.tensor([float(len(log.calls)) for log in logs])},
        generation_seconds=server.generation_seconds, environment_seconds=max(0.0, total - server.generation_seconds))
