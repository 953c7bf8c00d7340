"""Rollout: generate responses (token ids + sampling log-probs) on vLLM or HF engines, and sync weights to them.

Cheap to import: vLLM, Ray and transformers are imported where they are used.

- `types`: `SamplingConfig`, `RolloutSample`, `RolloutEngine` (the protocol), `SyncStats`
- `vllm_engine`: `VLLMEngine`, `create_vllm_engines`
- `hf_engine`: `HFEngine`, `create_hf_engines`
- `dispatch`: `generate_on_engines` (contiguous shards over engine actors, results in order)
- `weight_sync`: `sync_weights`, `named_weights_for_sync` (transports: ray object store, gloo/nccl broadcast)
- `weight_broadcast`: `WeightBroadcaster` (the sender of a reusable gloo/nccl broadcast group), `WeightGroupMember`
- `worker_ext`: `WeightReloadExtension` (vLLM worker extension; not imported directly by users)
"""

from rlhfkit.rollout.dispatch import generate_on_engines
from rlhfkit.rollout.types import RolloutEngine, RolloutSample, SamplingConfig, SyncStats
from rlhfkit.rollout.weight_sync import named_weights_for_sync, sync_weights

__all__ = [
    "RolloutEngine",
    "RolloutSample",
    "SamplingConfig",
    "SyncStats",
    "generate_on_engines",
    "named_weights_for_sync",
    "sync_weights",
]
