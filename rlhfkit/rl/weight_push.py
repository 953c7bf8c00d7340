"""Actor -> rollout engines weight sync in the online loop (start with reused engines, every step, resume).

`--vllm_sync_backend`:
- `ray`: the actor's rank 0 returns its full state dict to the driver, which streams it to the engines in
  buckets through the object store (`rlhfkit.rollout.weight_sync.sync_weights`).
- `gloo` / `nccl`: the actor's rank 0 broadcasts each bucket straight into the engine workers over a process group
  of its own (`rlhfkit.rollout.weight_broadcast`), built on the first sync and reused; every actor rank takes part
  in gathering the full parameters from FSDP2.
- `auto`: nccl on GPU clusters unless --colocate_all_models puts engines and trainer on the same GPUs (NCCL cannot
  connect two processes on one GPU: then ray); gloo on CPU-only clusters (faster than ray there, see
  docs/benchmarks.md). `rlhfkit.config.plan.resolve_sync_backend` resolves it once, with the run's plan.

`--lora_sync` (with --lora_rank): `merged` sends the full weights with the adapters merged in; `adapter` sends only
the LoRA A/B tensors, which the engines serve on their unchanged base (`rlhfkit.rollout.lora_sync`). The driver
resolves auto once the engines exist (`resolve_lora_sync`) and keeps the result in the run's plan.
"""

from __future__ import annotations

from typing import Any

from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.plan import RunPlan
from rlhfkit.rl.group import ModelGroup
from rlhfkit.rl.vision_batch import keeps_vision_tower
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout.types import SyncStats
from rlhfkit.rollout.weight_sync import sync_weights


def push_actor_weights(actor: ModelGroup, engines: list[Any], cfg: PPOConfig, plan: RunPlan) -> SyncStats:
    """Load the actor's current full weights into every rollout engine in place, over the plan's transport (ray,
    gloo or nccl), the adapter alone where the plan's --lora_sync resolved to adapter."""
    bucket_bytes = cfg.weight_sync_bucket_mb << 20
    backend = plan.transport
    adapter = plan.adapter_sync
    if backend == "ray":
        state = next(sd for sd in actor.call(ModelWorker.state_dict_for_sync, adapter) if sd is not None)
        lora_config = actor.call(ModelWorker.lora_config)[0] if adapter else None
        return sync_weights(engines, state.items(), bucket_bytes=bucket_bytes, lora_config=lora_config,
                            keep_vision_tower=keeps_vision_tower(cfg, plan.model_path))
    actor.call(ModelWorker.join_weight_group, engines, backend)  # builds the group on the first sync, then reuses it
    stats = actor.call(ModelWorker.broadcast_weights, bucket_bytes, adapter)
    return next(s for s in stats if s is not None)
