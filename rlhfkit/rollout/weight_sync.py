"""Trainer -> rollout engines weight sync: full (unsharded) HF-named tensors, in size-bounded buckets, in place.

Transport on CPU (and the default): Ray's object store. Each bucket is `ray.put` once and the same ref goes to
every engine, so the bytes are serialised once per bucket whatever the number of engines; at most one bucket is
in flight, so the extra memory is one bucket. On GPU, OpenRLHF broadcasts each bucket over an NCCL group
spanning trainer rank 0 and every vLLM worker (`--vllm_sync_backend nccl`); that transport is not written yet
(`transport="nccl"` raises, see `_NCCL_TODO`).

Names: HF and vLLM use the same parameter names for Llama-family models (vLLM fuses q/k/v and gate/up while
loading), so the mapping is the identity. Tied weights are sent once: `named_weights_for_sync` walks
`named_parameters()`, which yields a shared tensor (e.g. `lm_head.weight` tied to `model.embed_tokens.weight`)
under its first name only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from rlhfkit.rollout.types import NamedTensors, SyncStats

DEFAULT_BUCKET_BYTES = 64 * 2**20  # --weight_sync_bucket_mb
_NCCL_TODO = (
    "weight sync over NCCL (--vllm_sync_backend nccl) is not implemented yet; use the Ray object store transport "
    "(--vllm_sync_with_ray), which works on CPU and GPU"
)


def named_weights_for_sync(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter of an unsharded HF model, tied parameters once."""
    for name, param in model.named_parameters():
        yield name, param.detach()


def hf_to_vllm_name(name: str) -> str:
    """HF parameter name -> the name vLLM's `load_weights` expects (identity for Llama-family models)."""
    return name


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Group (name, tensor) pairs, in order, into buckets of at most `bucket_bytes` (a larger tensor goes alone).

    Tensors are detached, moved to CPU and made contiguous (they will be pickled into the object store).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named_tensors:
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((hf_to_vllm_name(name), tensor))
        size += nbytes
    if bucket:
        yield bucket


def sync_weights(
    engines: Sequence[Any],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    transport: str = "ray",
) -> SyncStats:
    """Replace every engine's weights in place with `named_tensors` (full HF-named tensors); return timings.

    `engines` are rollout engine Ray actors (vLLM or HF). Each engine enters update mode, loads every bucket,
    then finishes the update (vLLM: processes pending layers and resets the prefix cache when enabled).
    `named_tensors` is consumed lazily, one bucket at a time: with FSDP2 pass, on the rank that syncs, a
    generator that gathers one full tensor at a time.
    """
    import ray

    if transport == "nccl":
        raise NotImplementedError(_NCCL_TODO)
    if transport != "ray":
        raise ValueError(f"unknown weight sync transport {transport!r}; expected 'ray' (or 'nccl', not yet written)")
    start = time.perf_counter()
    ray.get([e.begin_weight_update.remote() for e in engines])
    total_bytes = buckets = tensors = 0
    for bucket in iter_buckets(named_tensors, bucket_bytes):
        ref = ray.put(bucket)
        ray.get([e.load_weight_bucket.remote(ref) for e in engines])
        del ref
        buckets += 1
        tensors += len(bucket)
        total_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    ray.get([e.finish_weight_update.remote() for e in engines])
    return SyncStats(seconds=time.perf_counter() - start, bytes=total_bytes, buckets=buckets, tensors=tensors)
