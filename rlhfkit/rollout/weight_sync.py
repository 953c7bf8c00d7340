"""Trainer -> rollout engines weight sync: full (unsharded) HF-named tensors, in size-bounded buckets, in place.

Every transport drives the same in-place update on each engine: `begin_weight_update`, one load per bucket,
`finish_weight_update` (vLLM: layerwise reload, tied modules re-processed, prefix cache reset). Transports
(`--vllm_sync_backend`):

- `ray`: the object store. Each bucket is `ray.put` once and the same ref goes to every engine, so the bytes are
  serialised once per bucket whatever the number of engines; at most one bucket is in flight. In the RL loop the
  trainer's rank 0 first returns its whole state dict to the driver, which buckets it (`sync_weights` here).
- `gloo` / `nccl`: a torch.distributed broadcast from the sender (trainer rank 0) into every engine worker, over
  a group of its own built once and reused (`rlhfkit.rollout.weight_broadcast.WeightBroadcaster`; OpenRLHF's
  GPU transport). nccl needs CUDA everywhere and cannot connect two processes on one GPU (colocated engines);
  gloo works on CPU and GPU. `sync_weights(..., transport="gloo")` builds a one-shot group (for repeated syncs
  keep a `WeightBroadcaster`).

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

from rlhfkit.rollout.buckets import DEFAULT_BUCKET_BYTES, iter_buckets
from rlhfkit.rollout.engine_api import RolloutEngine
from rlhfkit.rollout.lora_sync import begin_update, finish_update
from rlhfkit.rollout.remote import RemoteActors
from rlhfkit.rollout.types import SyncStats

TRANSPORTS = ("ray", "gloo", "nccl")


def named_weights_for_sync(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every parameter of an unsharded HF model, tied parameters once."""
    for name, param in model.named_parameters():
        yield name, param.detach()


def sync_weights(
    engines: Sequence[Any],
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    transport: str = "ray",
    lora_config: dict[str, Any] | None = None,
    keep_vision_tower: bool = False,
) -> SyncStats:
    """Replace every engine's weights in place with `named_tensors` (full HF-named tensors); return timings.

    `engines` are rollout engine Ray actors (vLLM or HF). Each engine enters update mode, loads every bucket,
    then finishes the update (vLLM: processes pending layers and resets the prefix cache when enabled).
    `named_tensors` is consumed lazily, one bucket at a time: with FSDP2 pass, on the rank that syncs, a
    generator that gathers one full tensor at a time. `transport` "gloo"/"nccl" builds a broadcast group for this
    one sync and closes it (see `WeightBroadcaster` to keep one). With `lora_config` (a peft adapter config)
    `named_tensors` are a LoRA adapter's A/B tensors and the engines serve them as a new adapter on their unchanged
    base (`rlhfkit.rollout.lora_sync`). `keep_vision_tower`: `named_tensors` leave out a frozen vision tower
    (`rlhfkit.models.vision.without_vision_tower`), which the engines keep.
    """
    import ray

    if transport not in TRANSPORTS:
        raise ValueError(f"unknown weight sync transport {transport!r}; expected one of {TRANSPORTS}")
    if transport != "ray":
        from rlhfkit.rollout.weight_broadcast import WeightBroadcaster

        sender = WeightBroadcaster(engines, transport)
        try:
            return sender.sync(named_tensors, bucket_bytes, lora_config=lora_config,
                               keep_vision_tower=keep_vision_tower)
        finally:
            sender.close()
    start = time.perf_counter()
    begin_update(engines, lora_config, keep_vision_tower=keep_vision_tower)
    total_bytes = buckets = tensors = 0
    for bucket in iter_buckets(named_tensors, bucket_bytes):
        ref: Any = ray.put(bucket)  # a top-level ObjectRef argument: Ray hands each engine the bucket itself
        RemoteActors(engines, role="engine").call(RolloutEngine.load_weight_bucket, ref)
        del ref
        buckets += 1
        tensors += len(bucket)
        total_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    finish_update(engines, lora_config)
    return SyncStats(seconds=time.perf_counter() - start, bytes=total_bytes, buckets=buckets, tensors=tensors)


