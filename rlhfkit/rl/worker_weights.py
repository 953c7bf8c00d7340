"""What a model worker hands the rollout engines and moves between phases (rlhfkit.rl.worker): its full parameters,
gathered one at a time from the FSDP2 shards (a collective every rank takes part in), LoRA adapters merged or alone,
in the engines' dtype; and its optimizer state moved to host RAM and back."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, cast

import torch


def full_named_parameters(model: torch.nn.Module, only: Callable[[str], bool] | None = None,
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per parameter (those whose name passes `only`), tied ones once; gathering a sharded
    (DTensor) one is a collective, so every rank must consume this to the end. CPU-offloaded shards visit the mesh's
    device for the gather."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        if only is not None and not only(name):
            continue
        tensor = param.detach()
        quant_state: Any = getattr(param, "quant_state", None)
        if quant_state is not None:  # --load_in_4bit: the engines get dequantized weights
            import bitsandbytes.functional as bnb_functional

            data = param.data
            if getattr(quant_state, "packing_format_for_cpu", False):  # bitsandbytes' CPU layout: back to its own
                data, quant_state = bnb_functional._convert_weight_packed_for_cpu_inverse(data, quant_state)
            tensor = bnb_functional.dequantize_4bit(data, quant_state).to(torch.float32)
        elif isinstance(tensor, DTensor):
            if tensor.device.type != tensor.device_mesh.device_type:
                tensor = tensor.to(tensor.device_mesh.device_type)
            tensor = cast(DTensor, tensor).full_tensor()
        yield name, tensor


def weights_for_engines(model: torch.nn.Module, dtype: torch.dtype | None = None, adapter: bool = False,
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """What the rollout engines load: full parameters under HF names, LoRA adapters merged into their layers, floating
    tensors in the engines' `dtype` (None: as they are). `adapter`: only the LoRA A/B tensors, under their
    saved-adapter names (only those are gathered)."""
    from rlhfkit.models.lora import merged_weights
    from rlhfkit.rollout.lora_sync import adapter_weights, is_adapter_tensor

    if adapter:
        named = adapter_weights(full_named_parameters(model, is_adapter_tensor))
    else:
        named = merged_weights(model, full_named_parameters(model))
    for name, tensor in named:
        yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def engine_dtype(vllm_dtype: str) -> torch.dtype | None:
    """The rollout engines' dtype (--vllm_dtype, resolved by the driver): weights travel in it, so a bf16 engine
    gets half the bytes and no side casts when trainer and engine agree."""
    from rlhfkit.engine.precision import TORCH_DTYPES

    return TORCH_DTYPES.get(vllm_dtype or "")


def drain(named: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Take part in every gather of `full_named_parameters` (ranks other than 0 keep nothing)."""
    for _ in named:
        pass


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)
