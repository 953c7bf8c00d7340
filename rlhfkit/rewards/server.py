"""``rlhfkit serve-rm``: serve a reward source over HTTP (standard library ``ThreadingHTTPServer``).

API (OpenRLHF's ``/get_reward``):

* ``POST /get_reward`` with JSON ``{"query": [str, ...], "prompts": [str, ...], "labels": [...]}`` (``prompts`` and
  ``labels`` optional, same length as ``query``) -> 200 ``{"rewards": [...], "scores": [...], "extra_logs": {...},
  "failed": int}``;
* ``GET /health`` -> 200 ``{"status": "ok", "source": name}``.

Errors are JSON ``{"error": "..."}``: 400 malformed request, 401 missing / wrong bearer token (when a token is set
by ``--auth_token`` or env ``RLHFKIT_RM_TOKEN``), 404 unknown path, 413 body too large, 422 the reward source
failed on the batch (e.g. a reward_func error naming the sample; not retried by the client), 500 anything else.
Requests are scored one at a time (a lock; a model's forward hooks are not re-entrant): for throughput run several
servers and give the client all their URLs. The server binds 127.0.0.1 unless ``--host`` says otherwise (OpenRLHF
binds 0.0.0.0; exposing a reward server is an explicit choice here).
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from rlhfkit.config.commands import ServeRMConfig
from rlhfkit.config.parse import parse_config
from rlhfkit.config.serve_options import DESCRIPTION
from rlhfkit.errors import ConfigError, RewardError
from rlhfkit.rewards.base import RewardSource, check_batch
from rlhfkit.rewards.remote import ENDPOINT, TOKEN_ENV
from rlhfkit.rewards.sources import build_reward_source, code_sandbox_options

logger = logging.getLogger(__name__)
MAX_BODY_BYTES = 256 * 1024 * 1024
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class BadRequest(ValueError):
    """A request the server answers with 4xx; ``status`` is the code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class RewardServer(ThreadingHTTPServer):
    """A threading HTTP server holding one reward source, an optional bearer token and a scoring lock."""

    daemon_threads = True

    def __init__(self, source: RewardSource, host: str = "127.0.0.1", port: int = 5000,
                 token: str | None = None) -> None:
        super().__init__((host, port), RewardHandler)
        self.source, self.token, self.lock = source, token or None, threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        assert isinstance(host, str)  # an AF_INET server: (host, port)
        return f"http://{host}:{port}{ENDPOINT}"


class RewardHandler(BaseHTTPRequestHandler):
    """``POST /get_reward`` and ``GET /health``."""

    server: RewardServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.rstrip("/") != "/health":
            return self._send(404, {"error": f"unknown path {self.path!r}; use POST {ENDPOINT}"})
        self._send(200, {"status": "ok", "source": self.server.source.name})

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        try:
            body = self._read_body()  # read first: closing with unread data would reset the connection
            if self.path.rstrip("/") != ENDPOINT:
                raise BadRequest(404, f"unknown path {self.path!r}; use POST {ENDPOINT}")
            self._authorize()
            queries, prompts, labels = parse_request(body)
        except BadRequest as err:
            return self._send(err.status, {"error": str(err)})
        try:
            with self.server.lock:
                out = self.server.source(queries, prompts, labels)
        except (RewardError, ValueError, TypeError) as err:
            logger.error("serve-rm: %s", err)
            return self._send(422, {"error": f"{type(err).__name__}: {err}"})
        except Exception as err:
            logger.exception("serve-rm: reward source %s crashed", self.server.source.name)
            return self._send(500, {"error": f"{type(err).__name__}: {err}"})
        self._send(200, out.to_json())

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise BadRequest(400, "missing or invalid Content-Length header")
        if int(length) > MAX_BODY_BYTES:
            raise BadRequest(413, f"request body of {length} bytes exceeds {MAX_BODY_BYTES}")
        return self.rfile.read(int(length))

    def _authorize(self) -> None:
        token = self.server.token
        if token is None:
            return
        given = self.headers.get("Authorization", "")
        if not (given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), token.encode())):
            raise BadRequest(401, "missing or wrong bearer token (header 'Authorization: Bearer <token>')")

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - signature of the base class
        logger.debug("serve-rm %s: " + format, self.address_string(), *args)


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
    opts = parse_config("serve-rm", None, argv, DESCRIPTION)  # a ServeRMConfig
    return server_from_options(opts)


def server_from_options(opts: ServeRMConfig) -> RewardServer:
    """Load the reward source ``opts`` name and bind the server; ConfigError when there is no source."""
    specs = [s for s in (opts.reward_pretrain, opts.remote_rm_url) if s]
    if not specs:
        raise ConfigError("give --reward_pretrain (a reward model) and/or --remote_rm_url (a reward_func file)")
    model_kwargs = {"normalize_reward": opts.normalize_reward, "max_len": opts.max_len,
                    "micro_batch_size": opts.batch_size, "dtype": DTYPES[opts.param_dtype],
                    "attn_implementation": opts.attn_implementation,
                    "use_fast_tokenizer": not opts.disable_fast_tokenizer}
    weights = [float(w) for w in opts.reward_weights.split(",")] if opts.reward_weights else None
    source = build_reward_source(specs, timeout=opts.reward_timeout, error_policy=opts.reward_error_policy,
                                 combine_rule=opts.reward_combine, weights=weights,
                                 format_pattern=opts.reward_format_pattern, model_kwargs=model_kwargs,
                                 code_kwargs=code_sandbox_options(opts))
    token = opts.auth_token if opts.auth_token is not None else os.environ.get(TOKEN_ENV)
    return RewardServer(source, opts.host, opts.port, token)


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
