"""Size-bounded buckets of (name, tensor) pairs: the unit every weight-sync transport sends (`weight_sync` over
Ray's object store, `weight_broadcast` over a torch.distributed group). Imports neither of them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from rlhfkit.rollout.types import NamedTensors

DEFAULT_BUCKET_BYTES = 64 * 2**20  # --weight_sync_bucket_mb


def hf_to_vllm_name(name: str) -> str:
    """HF parameter name -> the name vLLM's `load_weights` expects (identity for Llama-family models)."""
    return name


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, device: str | torch.device = "cpu"
) -> Iterator[NamedTensors]:
    """Group (name, tensor) pairs, in order, into buckets of at most `bucket_bytes` (a larger tensor goes alone).

    Tensors are detached, moved to `device` (CPU: they will be pickled into the object store or sent by gloo) and
    made contiguous.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named_tensors:
        tensor = tensor.detach().to(device).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((hf_to_vllm_name(name), tensor))
        size += nbytes
    if bucket:
        yield bucket
