"""vLLM worker extension: in-place, bucketed weight replacement.

Passed to vLLM as `worker_extension_cls="rlhfkit.rollout.worker_ext.WeightReloadExtension"`; vLLM mixes it into
its worker class, so `self` is the worker and `self.model_runner` its model runner. Reached through
`LLM.collective_rpc(<method name>, args=...)`, which runs on every tensor-parallel worker.

The weights arrive in checkpoint (HF) format and are loaded through vLLM's layerwise reload: the same steps as
`model_runner.reload_weights(weights_iterator=...)` (record -> load -> process -> copy back into the kernel
tensors), split across calls so the weights can stream in size-bounded buckets. A layer whose weights straddle
two buckets (e.g. q/k/v fused into `qkv_proj`) is buffered until complete, then processed (on CPU the backend
repacks linear weights: plain `param.copy_` would be wrong).

Tied weights: vLLM loads a tied tensor (e.g. `lm_head.weight` = `embed_tokens.weight`) under one name only, so
the other module is never "loaded" and layerwise reload does not re-run its post-load processing. On CPU that
processing packs `lm_head`'s GEMM weights into a separate buffer, which would keep the old weights (measured:
log-probs off by ~0.1 after a sync). `_reprocess_tied_modules` re-runs it for every module sharing a weight.

Mixture-of-experts on CPU: vLLM 0.32 re-runs the experts' generic processing on a reload but skips the CPU
kernel's prepacking (`fused_experts.process_weights_after_loading`, run only when the kernel is first built), so
the reloaded expert weights sit unpacked where the kernel reads packed ones (measured on a tiny Qwen3-MoE: log-probs
off by 1e-2 after a sync that changed nothing). `_repack_cpu_moe_experts` runs that step again.

Weights arrive either as tensors in the call (`rlhf_load_weight_bucket`, the Ray transport) or through a
torch.distributed broadcast from the trainer (`rlhf_join_weight_group` once, then `rlhf_receive_weight_bucket`
per bucket: `--vllm_sync_backend gloo|nccl`, see `rlhfkit.rollout.weight_broadcast`); both load the same way.

Adapter-only LoRA sync (`--lora_sync adapter`, see `rlhfkit.rollout.lora_sync`): `rlhf_begin_lora_update`, the
same bucket loads (which then collect the LoRA tensors instead of loading them into the model), and
`rlhf_finish_lora_update(path, config)`, which writes the adapter folder the engine then serves as a new LoRA.

Method names carry an `rlhf_` prefix so they never
collide with the worker's own (`update_weights` exists already).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, cast

import torch

from rlhfkit.rollout.types import NamedTensors
from rlhfkit.rollout.weight_broadcast import WeightGroupSlot

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class ModelRunner(Protocol):
    """What this extension uses of the vLLM worker's model runner (`GPUModelRunner`, or its subclass
    `CPUModelRunner` on CPU)."""

    vllm_config: VllmConfig

    def get_model(self) -> torch.nn.Module: ...

    def reset_lora_state(self) -> None: ...

    def reset_encoder_cache(self) -> None: ...

    def reset_mm_cache(self) -> None: ...


class LoadsWeights(Protocol):
    """A vLLM model's loader (every vLLM model class has it): loads (HF name, tensor) pairs, returns the names of
    the parameters it loaded (None for a model that does not report them)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str] | None: ...


class QuantMethod(Protocol):
    """A vLLM layer's `quant_method` (also for unquantised layers): its post-load step packs the kernel weights."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None: ...


class WeightReloadExtension:
    """Mixed into vLLM's worker. State between calls lives on the worker (`_rlhf_loaded`)."""

    model_runner: ModelRunner  # provided by the vLLM worker this class is mixed into

    def rlhf_begin_weight_update(self, keep_vision_tower: bool = False) -> None:
        """Put every layer into layerwise-reload mode (weights now load into buffers, not kernels).
        `keep_vision_tower`: the update does not send the (frozen) vision tower; its layers keep their weights."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if getattr(self, "_rlhf_loaded", None) is not None:
            raise RuntimeError("rlhf_begin_weight_update called twice without rlhf_finish_weight_update")
        initialize_layerwise_reload(self.model_runner.get_model())
        self._rlhf_loaded: set[str] | None = set()
        self._rlhf_keep_vision = keep_vision_tower

    def rlhf_load_weight_bucket(self, named_tensors: NamedTensors) -> int:
        """Load one bucket of (HF name, full tensor) pairs; returns how many tensors were given. In a LoRA
        adapter update the tensors are collected for `rlhf_finish_lora_update` instead."""
        adapter = getattr(self, "_rlhf_adapter", None)
        if adapter is not None:
            adapter.extend((name, t.clone()) for name, t in named_tensors)  # broadcast buffers are reused
            return len(named_tensors)
        loaded = self._rlhf_require_update("rlhf_load_weight_bucket")
        model = cast(LoadsWeights, self.model_runner.get_model())  # every vLLM model class defines load_weights
        with torch.no_grad():
            names = model.load_weights(iter(named_tensors))
        loaded.update(names or ())
        return len(named_tensors)

    def rlhf_finish_weight_update(self) -> int:
        """Process layers still pending, restore the kernel tensors, drop caches; returns parameters loaded."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        loaded = self._rlhf_require_update("rlhf_finish_weight_update")
        runner = self.model_runner
        finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
        _reprocess_tied_modules(runner.get_model())
        _repack_cpu_moe_experts(runner.get_model())
        runner.reset_lora_state()
        runner.reset_encoder_cache()
        runner.reset_mm_cache()
        self._rlhf_loaded = None
        check_every_parameter_loaded(runner.get_model(), loaded, "vLLM engine",
                                     keep_vision_tower=getattr(self, "_rlhf_keep_vision", False))
        return len(loaded)

    def rlhf_begin_lora_update(self) -> None:
        """Start an adapter-only update: the next buckets are LoRA A/B tensors (saved-adapter names)."""
        if getattr(self, "_rlhf_adapter", None) is not None or getattr(self, "_rlhf_loaded", None) is not None:
            raise RuntimeError("rlhf_begin_lora_update called inside another update")
        self._rlhf_adapter: list | None = []

    def rlhf_finish_lora_update(self, path: str, config: dict) -> int:
        """Write the collected adapter to `path` (a peft adapter folder); returns its bytes of tensors."""
        from rlhfkit.rollout.lora_sync import write_adapter_folder

        adapter = getattr(self, "_rlhf_adapter", None)
        if adapter is None:
            raise RuntimeError("rlhf_finish_lora_update called outside a LoRA update: call rlhf_begin_lora_update")
        self._rlhf_adapter = None
        return write_adapter_folder(path, adapter, config)

    def rlhf_join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                               timeout_s: float) -> int:
        """Join the sender's weight group as rank `rank_offset + tp_rank` (replacing any earlier group)."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        rank = rank_offset + get_tensor_model_parallel_rank()
        return self._rlhf_weight_slot().join(host, port, rank, world_size, backend, timeout_s)

    def rlhf_receive_weight_bucket(self, meta: list) -> int:
        """Receive one broadcast bucket (names, shapes, dtypes in `meta`) and load it like `rlhf_load_weight_bucket`."""
        return self.rlhf_load_weight_bucket(self._rlhf_weight_slot().receive(meta))

    def rlhf_leave_weight_group(self) -> None:
        """Drop this worker's side of the weight group (no-op when not in one)."""
        self._rlhf_weight_slot().leave()

    def _rlhf_weight_slot(self) -> WeightGroupSlot:
        """This worker's weight-group membership (the extension has no __init__ of its own: made on first use)."""
        if getattr(self, "_rlhf_slot", None) is None:
            self._rlhf_slot = WeightGroupSlot()
        return self._rlhf_slot

    def _rlhf_require_update(self, caller: str) -> set[str]:
        loaded = getattr(self, "_rlhf_loaded", None)
        if loaded is None:
            raise RuntimeError(f"{caller} called outside a weight update: call rlhf_begin_weight_update first")
        return loaded


def check_every_parameter_loaded(model: torch.nn.Module, loaded: set[str], engine: str,
                                 keep_vision_tower: bool = False) -> None:
    """A sync must write every parameter of the engine's model (tied ones count once): a parameter the trainer's names
    do not reach keeps its old values and the engine samples from a different model than the one trained, silently.
    `keep_vision_tower`: a frozen vision tower is not sent (rlhfkit.models.vision) and is not expected.
    Raises naming the parameters."""
    from rlhfkit.models.vision import is_vision_tower_param

    expected = {name for name, _ in model.named_parameters()
                if not (keep_vision_tower and is_vision_tower_param(name))}
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:6]) + (f", ... ({len(missing) - 6} more)" if len(missing) > 6 else "")
        raise RuntimeError(f"weight sync left {len(missing)} of {len(expected)} {engine} parameters unloaded: "
                           f"{shown}. The trainer's weight names do not cover this model's (renamed or fused "
                           "parameters?); the engine would keep stale weights, so the run stops here.")


def _reprocess_tied_modules(model: torch.nn.Module) -> None:
    """Re-run post-load processing (e.g. CPU GEMM packing) of modules whose weight is shared with another module."""
    owners: dict[int, list[tuple[torch.nn.Module, QuantMethod]]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        method: QuantMethod | None = getattr(module, "quant_method", None)
        if weight is not None and method is not None:
            owners.setdefault(id(weight), []).append((module, method))
    for modules in owners.values():
        if len(modules) > 1:
            for module, method in modules:
                method.process_weights_after_loading(module)


def _repack_cpu_moe_experts(model: torch.nn.Module) -> int:
    """Prepack every CPU fused-MoE layer's reloaded expert weights into its kernel's layout; returns the layers."""
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        on_cpu_kernel = type(experts).__module__.endswith("experts.cpu_moe")
        if experts is not None and on_cpu_kernel and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked
