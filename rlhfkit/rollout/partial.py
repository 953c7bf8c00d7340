"""Partial rollouts (`--partial_rollout`): generation in chunks of at most `chunk_tokens` new tokens, so the engines
can load new weights between two chunks and resume the same requests.

Token in, token out: the unfinished rows are resumed with prompt ids + the response ids generated so far (never
re-tokenised text); each chunk's tokens keep the sampling log-probs of the weights that drew them, and
`sample.extra["policy_versions"]` records, per response token, the policy version the engines held for its chunk.
`hold(chunk)` is a context manager that yields the engines' current policy version and keeps a weight sync out for
the length of chunk `chunk` (0, 1, ...) of the call (`rlhfkit.rl.async_rollout.EngineGate.hold`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from rlhfkit.rollout.dispatch import generate_on_engines
from rlhfkit.rollout.types import RolloutSample, SamplingConfig

VERSIONS_KEY = "policy_versions"  # RolloutSample.extra[...]: one policy version per response token
CHUNK_SEED_STRIDE = 1_000_003     # chunk k >= 1 of a seeded rollout samples with seed + k * stride + row


def generate_in_chunks(engines: Sequence[Any], prompt_ids: list[list[int]], sampling: SamplingConfig,
                       chunk_tokens: int, hold: Callable[[int], AbstractContextManager[int]]) -> list[RolloutSample]:
    """`generate_on_engines` in chunks: the first chunk is the usual call with `max_new_tokens = min(chunk_tokens,
    max_new_tokens)` (same seeds as an unchunked call); the rows it left unfinished ("length" before
    `sampling.max_new_tokens`) go on, one request each (n = 1), from prompt + response so far, until every row
    stopped or reached `sampling.max_new_tokens`. Returns the samples in the usual (prompt, sample) order."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    limit = sampling.max_new_tokens
    first = dataclasses.replace(sampling, max_new_tokens=min(chunk_tokens, limit))
    with hold(0) as version:
        samples = generate_on_engines(engines, prompt_ids, first)
    versions = [[version] * len(s.response_ids) for s in samples]
    chunk = 1
    while rows := [i for i, s in enumerate(samples) if s.finish_reason == "length" and len(s.response_ids) < limit]:
        done = {len(samples[i].response_ids) for i in rows}
        if len(done) != 1:
            raise RuntimeError(f"partial rollout: unfinished rows of unequal lengths {sorted(done)} after chunk "
                               f"{chunk} (an engine stopped a row short of max_tokens)")
        seed = None if sampling.seed is None else sampling.seed + chunk * CHUNK_SEED_STRIDE
        step = dataclasses.replace(sampling, n=1, max_new_tokens=min(chunk_tokens, limit - done.pop()), seed=seed)
        resumed = [list(samples[i].prompt_ids) + list(samples[i].response_ids) for i in rows]
        with hold(chunk) as version:
            more = generate_on_engines(engines, resumed, step)
        for i, extra in zip(rows, more):
            sample = samples[i]
            sample.response_ids = list(sample.response_ids) + list(extra.response_ids)
            sample.response_logprobs = list(sample.response_logprobs) + list(extra.response_logprobs)
            sample.finish_reason = extra.finish_reason
            versions[i] += [version] * len(extra.response_ids)
        chunk += 1
    for sample, per_token in zip(samples, versions):
        sample.extra[VERSIONS_KEY] = per_token
    return samples
