"""``rlhfkit serve-rm``: serve a reward source over HTTP (an asyncio front end, one scoring thread).

API (OpenRLHF's ``/get_reward``):

* ``POST /get_reward`` with JSON ``{"query": [str, ...], "prompts": [str, ...], "labels": [...]}`` (``prompts`` and
  ``labels`` optional, same length as ``query``) -> 200 ``{"rewards": [...], "scores": [...], "extra_logs": {...},
  "failed": int}``;
* ``GET /health`` -> 200 ``{"status": "ok", "source": name, "queued": n, "dropped": n}``.

Errors are JSON ``{"error": "..."}``: 400 malformed request, 401 missing / wrong bearer token (when a token is set
by ``--auth_token`` or env ``RLHFKIT_RM_TOKEN``), 404 unknown path, 405 wrong method, 408 the request did not arrive
within ``--request_timeout``, 411 no Content-Length, 413 body over ``--max_request_mb``, 422 the reward source failed
on the batch (e.g. a reward_func error naming the sample; not retried by the client), 431 headers over 64 KiB, 503
``--max_connections`` connections already open (``Retry-After: 1``), 500 anything else. Every answer closes the
connection.

What a client must get right before the server spends anything on it: the request line and headers are read first
(at most 64 KiB), then the path, the method, the bearer token and the Content-Length (against the cap) are checked,
and only then is the body read. Headers and body must arrive within ``--request_timeout`` seconds of the connection
(a total, not per read), so a client that sends a byte now and then is cut off too. Connections are served by one
asyncio loop: a stalled client holds no thread, only one of the ``--max_connections`` slots, and only until its
deadline. Scoring is done by :class:`rlhfkit.rewards.batcher.RequestBatcher`: one batch at a time on one thread,
requests that queued meanwhile merged into the next batch (up to ``--batch_max_queries``), queued requests of clients
that have gone dropped.

The server binds 127.0.0.1 unless ``--host`` says otherwise (OpenRLHF binds 0.0.0.0). A non-loopback address without
a token is refused: a reward source may run code (``builtin:code``) or read files, so serving it to the network
without a token must be said out loud with ``--allow_unauthenticated`` (and is then logged as a warning).
"""

from __future__ import annotations

import asyncio
import hmac
import http.client
import io
import ipaddress
import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import torch

from rlhfkit.config.commands import ServeRMConfig
from rlhfkit.config.parse import parse_config
from rlhfkit.config.serve_options import DESCRIPTION
from rlhfkit.errors import ConfigError, RewardError
from rlhfkit.rewards.base import RewardOutput, RewardSource, check_batch
from rlhfkit.rewards.batcher import ClientGone, Pending, RequestBatcher
from rlhfkit.rewards.remote import ENDPOINT, TOKEN_ENV
from rlhfkit.rewards.sources import build_reward_source, code_sandbox_options

logger = logging.getLogger(__name__)
MB = 1024 * 1024
MAX_HEADER_BYTES = 64 * 1024
LINGER_S = 2.0               # after an early answer, how long unread request bytes are drained before closing
LINGER_MAX_BYTES = 4 * MB
PARSE_WORKERS = 2            # threads that decode request bodies (JSON) off the event loop
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HEALTH = "/health"


@dataclass(frozen=True)
class ServerLimits:
    """What one client may cost the server (``serve-rm`` flags in brackets).

    ``request_timeout`` [--request_timeout]: seconds from the connection to the last byte of the body, and the bound
    on sending an answer; ``max_body_bytes`` [--max_request_mb]: the largest Content-Length accepted;
    ``max_connections`` [--max_connections]: connections served at once (more are answered 503 at once);
    ``batch_max_queries`` [--batch_max_queries]: the most queries merged into one scored batch (0: no merging)."""

    request_timeout: float = 30.0
    max_body_bytes: int = 256 * MB
    max_connections: int = 64
    batch_max_queries: int = 1024

    def __post_init__(self) -> None:
        for name, flag in (("request_timeout", "--request_timeout"), ("max_body_bytes", "--max_request_mb"),
                           ("max_connections", "--max_connections")):
            if not getattr(self, name) > 0:
                raise ConfigError(f"serve-rm {flag} must be > 0, got {getattr(self, name)}")
        if self.batch_max_queries < 0:
            raise ConfigError(f"serve-rm --batch_max_queries must be >= 0 (0: never merge requests), got "
                              f"{self.batch_max_queries}")


class BadRequest(ValueError):
    """A request the server answers with 4xx; ``status`` is the code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (``""`` means every interface: no)."""
    if not host:
        return False
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def check_exposure(host: str, token: str | None, allow_unauthenticated: bool) -> None:
    """Refuse (ConfigError) to serve a non-loopback ``host`` without a token, unless ``allow_unauthenticated``
    (then log a warning)."""
    if token or is_loopback(host):
        return
    if not allow_unauthenticated:
        raise ConfigError(
            f"serve-rm --host {host!r} is not a loopback address and no token is set: anyone who can reach the port "
            "could call the reward source (with builtin:code or a reward_func file that runs programs, that is "
            "running code on this machine). Set --auth_token TOKEN (or the RLHFKIT_RM_TOKEN environment variable) "
            "and give the clients --remote_rm_token, or bind --host 127.0.0.1, or pass --allow_unauthenticated to "
            "serve without a token on purpose")
    logger.warning("serve-rm: SERVING WITHOUT A TOKEN ON %s (--allow_unauthenticated): anyone who can reach this "
                   "port can call the reward source; set --auth_token unless the network is yours alone", host)


class RewardServer:
    """A reward source served over HTTP at ``host:port``, with an optional bearer token and :class:`ServerLimits`.

    The socket is bound on construction (``server_address`` holds the port when ``port`` is 0); ``serve_forever()``
    serves in the calling thread until ``shutdown()`` (from another thread) or Ctrl-C; ``server_close()`` releases
    the socket (the method names of :mod:`socketserver`)."""

    def __init__(self, source: RewardSource, host: str = "127.0.0.1", port: int = 5000, token: str | None = None,
                 *, limits: ServerLimits | None = None, allow_unauthenticated: bool = False) -> None:
        self.source, self.token = source, token or None
        self.limits = limits or ServerLimits()
        check_exposure(host, self.token, allow_unauthenticated)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family, backlog=128)
        self.server_address: tuple[Any, ...] = self.socket.getsockname()
        self.batcher: RequestBatcher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready, self._done = threading.Event(), threading.Event()
        self._open = 0
        self._pools: list[ThreadPoolExecutor] = []

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}{ENDPOINT}"

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until :meth:`shutdown` (``poll_interval`` is accepted for socketserver's signature; unused)."""
        self._done.clear()
        try:
            asyncio.run(self._serve())
        finally:
            self._done.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop :meth:`serve_forever` (from another thread) and wait for it to return."""
        give_up = time.monotonic() + timeout
        while not self._ready.wait(0.05):  # serve_forever has not started its loop yet (or failed before it did)
            if self._done.is_set() or time.monotonic() > give_up:
                return
        if self._loop is None or self._stop is None:
            return
        stop = self._stop
        try:
            self._loop.call_soon_threadsafe(stop.set)
        except RuntimeError:  # the loop has already closed
            return
        self._done.wait(timeout)

    def server_close(self) -> None:
        self.socket.close()
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        scorer = ThreadPoolExecutor(1, thread_name_prefix="serve-rm-score")
        self._parser = ThreadPoolExecutor(PARSE_WORKERS, thread_name_prefix="serve-rm-parse")
        self._pools = [scorer, self._parser]
        self.batcher = RequestBatcher(self.source, scorer, self.limits.batch_max_queries)
        server = await asyncio.start_server(self._connection, sock=self.socket, limit=MAX_HEADER_BYTES)
        batching = asyncio.create_task(self.batcher.run())
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            batching.cancel()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= self.limits.max_connections:
            await self._reply(reader, writer, 503, {"error": f"server busy: {self._open} connections open "
                                                             "(serve-rm --max_connections); retry later"},
                              headers={"Retry-After": "1"}, linger=True)
            return
        self._open += 1
        try:
            await self._exchange(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        except asyncio.CancelledError:
            pass  # the server is stopping (asyncio.run cancels the open connections)
        except Exception:
            logger.exception("serve-rm: error while serving a connection")
        finally:
            self._open -= 1
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request and its answer."""
        timeout = self.limits.request_timeout
        try:
            body = await asyncio.wait_for(self._read_request(reader, writer), timeout)
        except asyncio.TimeoutError:
            return await self._reply(reader, writer, 408, {"error": f"the request did not arrive within {timeout:g} s "
                                                                    "(serve-rm --request_timeout)"})
        except BadRequest as err:
            return await self._reply(reader, writer, err.status, {"error": str(err)}, linger=True)
        if body is None:
            assert self.batcher is not None
            return await self._reply(reader, writer, 200, {"status": "ok", "source": self.source.name,
                                                           "queued": len(self.batcher),
                                                           "dropped": self.batcher.requests_dropped})
        loop = asyncio.get_running_loop()
        try:
            queries, prompts, labels = await loop.run_in_executor(self._parser, parse_request, body)
        except BadRequest as err:
            return await self._reply(reader, writer, err.status, {"error": str(err)})
        pending = Pending(queries, prompts, labels, loop.create_future(),
                          gone=lambda: reader.at_eof() or writer.transport.is_closing())
        assert self.batcher is not None
        self.batcher.submit(pending)
        try:
            out: RewardOutput = await pending.future
            answer = json.dumps(out.to_json(), allow_nan=False)
        except ClientGone:
            return
        except (RewardError, ValueError, TypeError) as err:
            logger.error("serve-rm: %s", err)
            return await self._reply(reader, writer, 422, {"error": f"{type(err).__name__}: {err}"})
        except Exception as err:
            logger.exception("serve-rm: reward source %s crashed", self.source.name)
            return await self._reply(reader, writer, 500, {"error": f"{type(err).__name__}: {err}"})
        await self._reply(reader, writer, 200, answer)

    async def _read_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes | None:
        """The body of a valid ``POST /get_reward`` (None for ``GET /health``); :class:`BadRequest` otherwise. The
        body is read only after the path, method, token and Content-Length passed."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise BadRequest(431, f"request line and headers over {MAX_HEADER_BYTES} bytes") from None
        line, _, rest = head.partition(b"\r\n")
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise BadRequest(400, f"malformed request line {line[:100]!r}")
        method, path = parts[0], urlsplit(parts[1]).path.rstrip("/") or "/"
        try:
            headers = http.client.parse_headers(io.BytesIO(rest))
        except http.client.HTTPException as err:
            raise BadRequest(400, f"malformed headers: {err}") from None
        if path == HEALTH and method in ("GET", "HEAD"):
            return None
        if path != ENDPOINT:
            raise BadRequest(404, f"unknown path {parts[1][:200]!r}; use POST {ENDPOINT}")
        if method != "POST":
            raise BadRequest(405, f"{method} {ENDPOINT}: use POST")
        self._authorize(headers)
        length = (headers.get("Content-Length") or "").strip()
        if headers.get("Transfer-Encoding") or not length:
            raise BadRequest(411, "send the body with a Content-Length header (chunked bodies are not accepted)")
        if not length.isdigit():
            raise BadRequest(400, f"invalid Content-Length {length[:40]!r}")
        if int(length) > self.limits.max_body_bytes:
            raise BadRequest(413, f"request body of {length} bytes exceeds {self.limits.max_body_bytes} "
                                  "(serve-rm --max_request_mb); send smaller batches")
        if headers.get("Expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return await reader.readexactly(int(length))

    def _authorize(self, headers: http.client.HTTPMessage) -> None:
        if self.token is None:
            return
        given = headers.get("Authorization", "")
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), self.token.encode())):
            raise BadRequest(401, "missing or wrong bearer token (header 'Authorization: Bearer <token>')")

    async def _reply(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int,
                     payload: dict[str, Any] | str, *, linger: bool = False,
                     headers: dict[str, str] | None = None) -> None:
        """Send one answer and close. ``linger``: the request may have unread bytes (an early refusal); drain them
        for a moment so that closing does not reset the connection before the client has read the answer."""
        body = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
        lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "Content-Type: application/json",
                 f"Content-Length: {len(body)}", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if status == 401:
            lines.append("WWW-Authenticate: Bearer")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        try:
            await asyncio.wait_for(writer.drain(), self.limits.request_timeout)
            if linger and writer.can_write_eof():
                writer.write_eof()
                await asyncio.wait_for(_discard(reader), LINGER_S)
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def _discard(reader: asyncio.StreamReader) -> None:
    drained = 0
    while drained < LINGER_MAX_BYTES:
        chunk = await reader.read(64 * 1024)
        if not chunk:
            return
        drained += len(chunk)


def parse_request(body: bytes) -> tuple[list[str], list[str], list[Any]]:
    """``(queries, prompts, labels)`` from a request body; :class:`BadRequest` (400) with the reason otherwise."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(400, f"body is not valid JSON: {err}") from err
    if not isinstance(data, dict) or not isinstance(data.get("query"), list):
        raise BadRequest(400, 'body must be a JSON object with "query": [str, ...] (and optional "prompts", '
                              '"labels" lists of the same length)')
    prompts, labels = data.get("prompts"), data.get("labels")
    for key, value in (("prompts", prompts), ("labels", labels)):
        if value is not None and not isinstance(value, list):
            raise BadRequest(400, f'"{key}" must be a list, got {type(value).__name__}')
    try:
        return check_batch(data["query"], prompts, labels, "request")
    except (TypeError, ValueError) as err:
        raise BadRequest(400, str(err)) from err


def build_server(argv: list[str] | None = None) -> RewardServer:
    """Parse the flags of ``rlhfkit serve-rm`` (the shared `parse_config` path: OpenRLHF's dotted names, --config,
    refusals), load the reward source and bind the server (not yet serving)."""
    opts = parse_config(ServeRMConfig, None, argv, DESCRIPTION)
    return server_from_options(opts)


def server_from_options(opts: ServeRMConfig) -> RewardServer:
    """Load the reward source ``opts`` name and bind the server; ConfigError when there is no source, for limits out
    of range, and for a non-loopback ``--host`` without a token (unless ``--allow_unauthenticated``)."""
    specs = [s for s in (opts.reward_pretrain, opts.remote_rm_url) if s]
    if not specs:
        raise ConfigError("give --reward_pretrain (a reward model) and/or --remote_rm_url (a reward_func file)")
    limits = ServerLimits(request_timeout=float(opts.request_timeout),
                          max_body_bytes=int(float(opts.max_request_mb) * MB),
                          max_connections=int(opts.max_connections), batch_max_queries=int(opts.batch_max_queries))
    token = opts.auth_token if opts.auth_token is not None else os.environ.get(TOKEN_ENV)
    if not opts.allow_unauthenticated:
        check_exposure(opts.host, token or None, False)  # refused before a model is loaded (the server warns)
    model_kwargs = {"normalize_reward": opts.normalize_reward, "max_len": opts.max_len,
                    "micro_batch_size": opts.batch_size, "dtype": DTYPES[opts.param_dtype],
                    "attn_implementation": opts.attn_implementation,
                    "use_fast_tokenizer": not opts.disable_fast_tokenizer}
    weights = [float(w) for w in opts.reward_weights.split(",")] if opts.reward_weights else None
    source = build_reward_source(specs, timeout=opts.reward_timeout, error_policy=opts.reward_error_policy,
                                 combine_rule=opts.reward_combine, weights=weights,
                                 format_pattern=opts.reward_format_pattern, model_kwargs=model_kwargs,
                                 code_kwargs=code_sandbox_options(opts))
    return RewardServer(source, opts.host, opts.port, token, limits=limits,
                        allow_unauthenticated=opts.allow_unauthenticated)


def serve_rm_main(argv: list[str] | None = None) -> None:
    """``rlhfkit serve-rm``: build the server and serve until interrupted."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = build_server(argv)
    logger.info("serving %s at %s%s", server.source.name, server.url, " (bearer token required)" * bool(server.token))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        logger.info("serve-rm: interrupted, shutting down")
    finally:
        server.server_close()
