"""HTTP client for reward servers (``rlhfkit serve-rm`` or any server speaking OpenRLHF's ``/get_reward``).

Request: ``POST <url>`` with JSON ``{"query": [...], "prompts": [...], "labels": [...]}``; answer: JSON
``{"rewards": [...], "scores": [...], "extra_logs": {...}}`` (``scores`` defaults to ``rewards``). A URL with no
path gets ``/get_reward`` appended. With several URLs (replicas of one reward source) the batch is cut into
contiguous shards, one per server, sent concurrently and re-assembled in order.

Each request has a socket timeout of ``timeout`` seconds. Failures are retried ``retries`` times with exponential
backoff (``backoff * 2**k`` seconds): connection errors, timeouts, 5xx / 408 / 429 answers and malformed answers
(not JSON, missing ``rewards``, wrong lengths, non-numbers, NaN/inf). Other 4xx answers (bad request, 401, a reward
function error reported by ``serve-rm`` as 422) are not retried. When a server stays down the error names the URL,
the attempts made and the last error; nothing becomes a silent None or zero.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request
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
                 token: str | None = None) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("RemoteRewardClient needs at least one URL")
        if timeout <= 0 or retries < 0 or backoff < 0:
            raise ValueError(f"timeout ({timeout}) must be > 0, retries ({retries}) and backoff ({backoff}) >= 0")
        self.urls = [endpoint_url(u) for u in urls]
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.name = "remote:" + ",".join(self.urls)

    def __call__(self, queries: list[str], prompts: list[str] | None = None,
                 labels: list[Any] | None = None) -> RewardOutput:
        """Rewards for a batch, each server scoring its contiguous shard."""
        queries, prompts, labels = check_batch(queries, prompts, labels, f"reward client {self.name}")
        bounds = [b for b in shard_bounds(len(queries), len(self.urls)) if b[1] > b[0]]
        jobs = [(self.urls[i], queries[s:e], prompts[s:e], labels[s:e], s) for i, (s, e) in enumerate(bounds)]
        if len(jobs) <= 1:
            return self.request(*jobs[0]) if jobs else concat_outputs([])
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="reward-client") as pool:
            parts = list(pool.map(lambda job: self.request(*job), jobs))
        return concat_outputs(parts)

    def request(self, url: str, queries: list[str], prompts: list[str], labels: list[Any],
                offset: int = 0) -> RewardOutput:
        """POST one shard to ``url`` with retries; ``offset`` is the shard's first index in the whole batch."""
        try:
            body = json.dumps({"query": queries, "prompts": prompts, "labels": labels}, allow_nan=False).encode()
        except (TypeError, ValueError) as err:
            raise RemoteRewardError(f"reward server {url}: the batch cannot be sent as JSON "
                                    f"(labels must be JSON values): {err}") from err
        attempts, attempt, last = self.retries + 1, 0, None
        while attempt < attempts:
            attempt += 1
            try:
                return self._parse(self._post(url, body), len(queries), offset, queries)
            except _Attempt as failure:
                last = failure
                if not failure.retry:
                    break
                if attempt < attempts:
                    time.sleep(self.backoff * 2 ** (attempt - 1))
        assert last is not None  # attempts >= 1, and every attempt that returns nothing failed
        raise RemoteRewardError(f"reward server {url} failed after {attempt} of {attempts} attempt(s) "
                                f"(timeout {self.timeout:g} s per request): {last.message}")

    def _post(self, url: str, body: bytes) -> bytes:
        """One POST; raises :class:`_Attempt` for network errors and non-200 answers."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:500].decode("utf-8", "replace")
            retry = err.code >= 500 or err.code in _RETRY_STATUS
            raise _Attempt(f"HTTP {err.code} {err.reason}: {detail}", retry) from None
        except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, bad status line
            reason = getattr(err, "reason", err)
            raise _Attempt(f"{type(err).__name__}: {reason}") from None

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

