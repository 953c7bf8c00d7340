"""HTTP client for reward servers (``rlhfkit serve-rm`` or any server speaking OpenRLHF's ``/get_reward``).

Request: ``POST <url>`` with JSON ``{"query": [...], "prompts": [...], "labels": [...]}``; answer: JSON
``{"rewards": [...], "scores": [...], "extra_logs": {...}}`` (``scores`` defaults to ``rewards``). A URL with no
path gets ``/get_reward`` appended. With several URLs (replicas of one reward source) the batch is cut into
contiguous shards, one per server that is up, sent concurrently and re-assembled in order.

Each attempt has a deadline of ``timeout`` seconds of wall time, from connecting to the last byte of the answer (a
watchdog closes the socket at the deadline, so a server that drips a byte now and then cannot stretch it), and an
answer may be at most ``max_response_bytes`` long (the Content-Length is checked before reading; the body is read in
chunks and cut off past the cap). A failed attempt - connection errors, the deadline, 5xx / 408 / 429 answers,
malformed or oversized answers (not JSON, missing ``rewards``, wrong lengths, non-numbers, NaN/inf) - fails over to
the next URL of the group; a round tries every URL once, and ``retries`` more rounds follow after jittered exponential
backoff (``backoff * 2**k`` seconds times a factor drawn from [1, 1.5)). A server that failed is marked down for
``DOWN_COOLDOWN_S`` seconds: later batches give it no shard and try it last. Other 4xx answers (bad request, 401, a
reward function error reported by ``serve-rm`` as 422) are not retried. When every server has failed, the error names
each URL with its last error; nothing becomes a silent None or zero.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

from rlhfkit.errors import RemoteRewardError
from rlhfkit.rewards.base import (
    RewardOutput,
    check_batch,
    concat_outputs,
    nonfinite_indices,
    normalize_extra_logs,
    preview,
    to_float_vector,
)

TOKEN_ENV = "RLHFKIT_RM_TOKEN"
ENDPOINT = "/get_reward"
_RETRY_STATUS = {408, 429}
DEFAULT_REMOTE_TIMEOUT = 60.0
DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
DOWN_COOLDOWN_S = 30.0  # a server that failed gets no shard of later batches for this long
READ_CHUNK = 64 * 1024
ERROR_DETAIL_BYTES = 500


def max_response_bytes(megabytes: float) -> int:
    """--remote_rm_max_response_mb in bytes."""
    return int(float(megabytes) * 1024 * 1024)


def remote_timeout(remote_rm_timeout: float | None, reward_timeout: float | None) -> float:
    """Seconds per request to a reward server: --remote_rm_timeout, else --reward_timeout; a request always has a
    deadline, so --reward_timeout 0 (no timeout for reward functions) gives the reward servers 60 s."""
    if remote_rm_timeout is not None:
        return float(remote_rm_timeout)
    return float(reward_timeout) if reward_timeout else DEFAULT_REMOTE_TIMEOUT


class _Attempt(Exception):
    """One failed attempt; ``retry`` says whether another attempt can help."""

    def __init__(self, message: str, retry: bool = True) -> None:
        super().__init__(message)
        self.message, self.retry = message, retry


def endpoint_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/get_reward``; a URL with a path is kept as given."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"reward server URL {url!r} must look like http://host:port/get_reward")
    return url.rstrip("/") + ENDPOINT if parsed.path in ("", "/") else url


def shard_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges splitting ``n`` items over ``parts`` (earlier shards get the extra one)."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        bounds.append((start, end))
        start = end
    return bounds


class RemoteRewardClient:
    """Reward source backed by one or more reward servers (see the module docstring)."""

    def __init__(self, urls: list[str] | str, timeout: float = 60.0, retries: int = 3, backoff: float = 1.0,
                 token: str | None = None, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("RemoteRewardClient needs at least one URL")
        if timeout <= 0 or retries < 0 or backoff < 0 or max_response_bytes <= 0:
            raise ValueError(f"timeout ({timeout}) and max_response_bytes ({max_response_bytes}) must be > 0, "
                             f"retries ({retries}) and backoff ({backoff}) >= 0")
        self.urls = [endpoint_url(u) for u in urls]
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.max_response_bytes = int(max_response_bytes)
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.name = "remote:" + ",".join(self.urls)
        self._down_until: dict[str, float] = {}  # url -> monotonic time until which it is considered down
        self._lock = threading.Lock()
        self._random = random.Random()

    def __call__(self, queries: list[str], prompts: list[str] | None = None,
                 labels: list[Any] | None = None) -> RewardOutput:
        """Rewards for a batch, each server that is up scoring its contiguous shard (failing over to the others)."""
        queries, prompts, labels = check_batch(queries, prompts, labels, f"reward client {self.name}")
        up = self.urls_by_health()
        live = [u for u in up if not self._is_down(u)] or up
        bounds = [b for b in shard_bounds(len(queries), len(live)) if b[1] > b[0]]
        jobs = [(live[i], queries[s:e], prompts[s:e], labels[s:e], s) for i, (s, e) in enumerate(bounds)]
        if len(jobs) <= 1:
            return self.request(*jobs[0]) if jobs else concat_outputs([])
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="reward-client") as pool:
            parts = list(pool.map(lambda job: self.request(*job), jobs))
        return concat_outputs(parts)

    def urls_by_health(self) -> list[str]:
        """The URLs, those not marked down first (each part in the given order)."""
        return sorted(self.urls, key=self._is_down)

    def _is_down(self, url: str) -> bool:
        with self._lock:
            return self._down_until.get(url, 0.0) > time.monotonic()

    def _mark(self, url: str, down: bool) -> None:
        with self._lock:
            if down:
                self._down_until[url] = time.monotonic() + DOWN_COOLDOWN_S
            else:
                self._down_until.pop(url, None)

    def backoff_delay(self, round_index: int) -> float:
        """Seconds to wait before retry round ``round_index + 1``: ``backoff * 2**round_index`` times a factor drawn
        uniformly from [1, 1.5) (jitter, so that clients that failed together do not retry together)."""
        return self.backoff * 2 ** round_index * (1.0 + 0.5 * self._random.random())

    def request(self, url: str, queries: list[str], prompts: list[str], labels: list[Any],
                offset: int = 0) -> RewardOutput:
        """POST one shard, first to ``url``, failing over to the group's other URLs and retrying in rounds with
        backoff; ``offset`` is the shard's first index in the whole batch."""
        try:
            body = json.dumps({"query": queries, "prompts": prompts, "labels": labels}, allow_nan=False).encode()
        except (TypeError, ValueError) as err:
            raise RemoteRewardError(f"reward server {url}: the batch cannot be sent as JSON "
                                    f"(labels must be JSON values): {err}") from err
        order = [url] + [u for u in self.urls_by_health() if u != url]
        attempts = (self.retries + 1) * len(order)
        attempt, last_error = 0, {}
        for round_index in range(self.retries + 1):
            if round_index:
                time.sleep(self.backoff_delay(round_index - 1))
            for target in order:
                attempt += 1
                try:
                    out = self._parse(self._post(target, body), len(queries), offset, queries)
                except _Attempt as failure:
                    last_error[target] = failure.message
                    if not failure.retry:
                        raise RemoteRewardError(f"reward server {target} refused the batch after {attempt} of "
                                                f"{attempts} attempt(s) (not retried): {failure.message}") from None
                    self._mark(target, down=True)
                    continue
                self._mark(target, down=False)
                return out
        errors = "; ".join(f"{u}: {m}" for u, m in last_error.items())
        which = f"reward server {order[0]}" if len(order) == 1 else f"all {len(order)} reward servers"
        raise RemoteRewardError(f"{which} failed after {attempt} of {attempts} attempt(s) (deadline "
                                f"{self.timeout:g} s per request, {self.retries + 1} round(s)): {errors}")

    def _post(self, url: str, body: bytes) -> bytes:
        """One POST with a wall-time deadline of ``self.timeout`` and the answer capped at ``max_response_bytes``;
        raises :class:`_Attempt` for network errors, the deadline, oversized and non-200 answers."""
        deadline = time.monotonic() + self.timeout
        parsed = urlparse(url)
        connection_class = http.client.HTTPSConnection if parsed.scheme == "https" else http.client.HTTPConnection
        connection = connection_class(parsed.hostname or "", parsed.port, timeout=self.timeout)
        expired = threading.Event()

        def cut_off() -> None:  # the deadline: unblock whatever read or write is waiting
            expired.set()
            sock = connection.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        watchdog = threading.Timer(self.timeout, cut_off)
        watchdog.daemon = True
        headers = {"Content-Type": "application/json", "Connection": "close"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        path = parsed.path + (f"?{parsed.query}" if parsed.query else "")
        try:
            watchdog.start()
            connection.connect()
            if expired.is_set():  # the deadline passed while connecting; the watchdog found no socket to close
                raise TimeoutError
            try:
                connection.request("POST", path, body=body, headers=headers)
            except OSError as err:  # the server answered early (413, 401, 503) and closed: read that answer
                if expired.is_set():
                    raise
                try:
                    response = connection.getresponse()
                except (OSError, http.client.HTTPException):
                    raise err from None
            else:
                response = connection.getresponse()
            if response.status != 200:
                detail = _read_capped(response, ERROR_DETAIL_BYTES, deadline)[:ERROR_DETAIL_BYTES]
                retry = response.status >= 500 or response.status in _RETRY_STATUS
                raise _Attempt(f"HTTP {response.status} {response.reason}: "
                               f"{detail.decode('utf-8', 'replace')}", retry)
            length = response.getheader("Content-Length")
            if length and length.strip().isdigit() and int(length) > self.max_response_bytes:
                raise _Attempt(f"answer of {int(length)} bytes exceeds the cap of {self.max_response_bytes} bytes "
                               "(--remote_rm_max_response_mb); not read")
            raw = _read_capped(response, self.max_response_bytes, deadline)
            if len(raw) > self.max_response_bytes:
                raise _Attempt(f"answer longer than the cap of {self.max_response_bytes} bytes "
                               "(--remote_rm_max_response_mb); cut off")
            return raw
        except _Attempt:
            raise
        except Exception as err:  # refused, reset, timed out, cut off by the watchdog, bad status line
            if expired.is_set() or time.monotonic() >= deadline or isinstance(err, TimeoutError):
                raise _Attempt(f"timed out: no complete answer within the {self.timeout:g} s deadline") from None
            if not isinstance(err, (OSError, http.client.HTTPException)):
                raise
            raise _Attempt(f"{type(err).__name__}: {err}") from None
        finally:
            watchdog.cancel()
            connection.close()

    def _parse(self, raw: bytes, n: int, offset: int, queries: list[str]) -> RewardOutput:
        """Validate an answer body for a shard of ``n`` samples."""
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise _Attempt(f"answer is not JSON ({err}): {preview(raw.decode('utf-8', 'replace'))}") from None
        if not isinstance(data, dict) or "rewards" not in data:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise _Attempt(f"answer has no 'rewards' key (got {keys})")
        try:
            rewards = to_float_vector(data["rewards"], "'rewards'")
            scores = rewards.clone() if data.get("scores") is None else to_float_vector(data["scores"], "'scores'")
            logs = normalize_extra_logs(data.get("extra_logs"), n, "answer")
        except (TypeError, ValueError) as err:
            raise _Attempt(f"malformed answer: {err}") from None
        for key, values in (("rewards", rewards), ("scores", scores)):
            if values.shape[0] != n:
                raise _Attempt(f"answer has {values.shape[0]} {key} for {n} queries")
            bad = nonfinite_indices(values)
            if bad:
                raise _Attempt(f"answer has a non-finite {key[:-1]} ({float(values[bad[0]])}) for sample "
                               f"{offset + bad[0]} (query: {preview(queries[bad[0]])})")
        failed = data.get("failed", 0)
        return RewardOutput(rewards, scores, logs, int(failed) if isinstance(failed, int) else 0)



def _read_capped(response: http.client.HTTPResponse, cap: int, deadline: float) -> bytes:
    """The body of ``response`` in chunks, stopping after ``cap + 1`` bytes or at ``deadline`` (TimeoutError)."""
    chunks, size = [], 0
    while size <= cap:
        if time.monotonic() >= deadline:
            raise TimeoutError
        chunk = response.read(min(READ_CHUNK, cap + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
