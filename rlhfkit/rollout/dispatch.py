"""Spread a batch of prompts over several rollout engine actors (any backend) and gather the results in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlhfkit.rollout.remote import wait_remote
from rlhfkit.rollout.types import RolloutSample, SamplingConfig


def shard_bounds(num_items: int, num_shards: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, as even as possible (the first `num_items % num_shards` get one more)."""
    if num_shards < 1:
        raise ValueError(f"need at least one engine, got {num_shards}")
    base, extra = divmod(num_items, num_shards)
    bounds, start = [], 0
    for k in range(num_shards):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def generate_on_engines(
    engines: Sequence[Any], prompt_ids: list[list[int]], sampling: SamplingConfig,
    images: list[list[Any]] | None = None,
) -> list[RolloutSample]:
    """Generate on Ray engine actors: contiguous prompt shards, one per engine, run concurrently.

    Returns `len(prompt_ids) * sampling.n` samples ordered by (prompt, sample), with `prompt_index` relative to
    `prompt_ids`. Seeds follow the global prompt index, so the samples do not depend on the number of engines.
    Waits with the deadline (`--remote_call_timeout`): a dead or hung engine raises an error naming it
    (`rlhfkit.rollout.remote`). `images[i]`: prompt i's PIL images (vLLM engines; its ids hold one placeholder
    per image, and the samples' `prompt_ids` come back expanded).
    """
    refs, offsets, used = [], [], []
    for k, (engine, (start, end)) in enumerate(zip(engines, shard_bounds(len(prompt_ids), len(engines)))):
        if start == end:
            continue
        extra = () if images is None else (images[start:end],)
        refs.append(engine.generate.remote(prompt_ids[start:end], sampling.shifted(start), *extra))
        offsets.append(start)
        used.append(k)
    results: list[RolloutSample] = []
    shards = wait_remote(refs, role="engine", method="generate", handles=[engines[k] for k in used], ranks=used)
    for offset, shard in zip(offsets, shards):
        for sample in shard:
            sample.prompt_index += offset
            results.append(sample)
    return results
