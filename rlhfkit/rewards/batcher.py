"""The request batcher of ``rlhfkit serve-rm``: queued requests are scored together, one batch at a time.

The reward source is called from one scoring thread (a model's forward hooks are not re-entrant, and one batch of
many queries uses the hardware better than many small ones). Requests that arrive while a batch is scored wait in a
queue; when the batch is done the queued requests are merged into the next batch, in arrival order, up to
``max_queries`` queries (a request larger than the cap is scored alone; ``max_queries`` 0 never merges). Before a
queued request joins a batch the batcher asks whether its client is still there (``Pending.gone``): work whose client
has closed the connection is dropped, so a client's retries do not pile up behind the requests it gave up on.

A merged batch that fails is scored again one request at a time, so the error (a reward_func error naming the sample)
reaches the request it belongs to with that request's own sample numbers, and the other requests still get their
rewards. The batcher runs on the server's asyncio loop; only the reward source runs in the scoring thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhfkit.rewards.base import FAILURE_KEY, RewardOutput, RewardSource

logger = logging.getLogger(__name__)


class ClientGone(ConnectionError):
    """Set on a queued request that was dropped because its client closed the connection."""


@dataclass
class Pending:
    """One parsed request waiting for its rewards: ``future`` gets a :class:`RewardOutput` or the source's error;
    ``gone()`` says whether the client has closed its connection."""

    queries: list[str]
    prompts: list[str]
    labels: list[Any]
    future: asyncio.Future[RewardOutput]
    gone: Callable[[], bool] = field(default=lambda: False)


class RequestBatcher:
    """Queue of :class:`Pending` requests scored in merged batches by ``source`` on ``executor`` (one thread)."""

    def __init__(self, source: RewardSource, executor: Executor, max_queries: int) -> None:
        if max_queries < 0:
            raise ValueError(f"max_queries must be >= 0 (0: never merge requests), got {max_queries}")
        self.source, self.executor, self.max_queries = source, executor, max_queries
        self._queue: deque[Pending] = deque()
        self._wake = asyncio.Event()
        self.requests_dropped = 0  # queued requests whose client had gone

    def __len__(self) -> int:
        """Requests queued (not yet scoring)."""
        return len(self._queue)

    def submit(self, request: Pending) -> None:
        """Queue ``request`` (call on the loop)."""
        self._queue.append(request)
        self._wake.set()

    async def run(self) -> None:
        """Score queued requests until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._next_batch()
                if batch:
                    await self._score(batch)

    def _next_batch(self) -> list[Pending]:
        """Live requests from the head of the queue, in order, while their queries fit ``max_queries`` (the first
        always fits); requests whose client has gone are dropped on the way."""
        batch: list[Pending] = []
        size = 0
        while self._queue:
            head = self._queue[0]
            if head.future.done() or head.gone():
                self._queue.popleft()
                self._drop(head)
                continue
            if batch and (self.max_queries == 0 or size + len(head.queries) > self.max_queries):
                break
            batch.append(self._queue.popleft())
            size += len(head.queries)
        return batch

    def _drop(self, request: Pending) -> None:
        self.requests_dropped += 1
        logger.info("serve-rm: dropped a queued request of %d queries: its client closed the connection",
                    len(request.queries))
        if not request.future.done():
            request.future.set_exception(ClientGone("the client closed the connection"))

    async def _score(self, batch: list[Pending]) -> None:
        loop = asyncio.get_running_loop()
        queries = [q for r in batch for q in r.queries]
        prompts = [p for r in batch for p in r.prompts]
        labels = [label for r in batch for label in r.labels]
        try:
            out = await loop.run_in_executor(self.executor, self.source, queries, prompts, labels)
            parts = split_output(out, [len(r.queries) for r in batch])
        except Exception as err:  # noqa: BLE001 - handed to the request it belongs to
            if len(batch) == 1:
                _settle(batch[0].future, error=err)
                return
            logger.info("serve-rm: a merged batch of %d requests failed (%s); scoring them one at a time",
                        len(batch), err)
            for request in batch:
                if not request.gone():
                    await self._score([request])
                else:
                    self._drop(request)
            return
        for request, part in zip(batch, parts):
            _settle(request.future, result=part)


def _settle(future: asyncio.Future[RewardOutput], result: RewardOutput | None = None,
            error: BaseException | None = None) -> None:
    if future.done():  # the connection's handler gave up on it (client gone, server stopping)
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert result is not None
        future.set_result(result)


def split_output(out: RewardOutput, sizes: list[int]) -> list[RewardOutput]:
    """Cut ``out`` into consecutive parts of ``sizes`` samples. ``failed`` is counted per part from the per-sample
    ``extra_logs["reward_failure"]`` reasons; a merged output that counts failures without naming the samples cannot
    be split (ValueError: the batcher then scores each request alone)."""
    if len(out) != sum(sizes):
        raise ValueError(f"reward source {out!r} returned {len(out)} rewards for {sum(sizes)} queries")
    if len(sizes) == 1:
        return [out]
    reasons = out.extra_logs.get(FAILURE_KEY)
    if out.failed and not isinstance(reasons, list):
        raise ValueError(f"{out.failed} failed samples without per-sample reasons; cannot split a merged batch")
    parts, start = [], 0
    for size in sizes:
        end = start + size
        logs: dict[str, torch.Tensor | list] = {k: v[start:end] for k, v in out.extra_logs.items()}
        failed = sum(1 for r in reasons[start:end] if r) if isinstance(reasons, list) else 0
        parts.append(RewardOutput(out.rewards[start:end].clone(), out.scores[start:end].clone(), logs, failed))
        start = end
    return parts
