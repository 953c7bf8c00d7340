"""FSDP2 wrapping: `fully_shard` on every decoder layer, then on the root.

--zero_stage 3 -> reshard_after_forward=True (params re-gathered in backward, least memory, ZeRO-3).
--zero_stage 2 -> reshard_after_forward=False (gathered params kept from forward to backward, ZeRO-2-like).
--adam_offload -> CPUOffloadPolicy (CUDA only). bf16 -> MixedPrecisionPolicy(param bf16, reduce fp32).
--ds_tensor_parallel_size N -> the tensor-parallel plan on the "tp" dimension of the ("dp", "tp") mesh first
(rlhfkit.models.tensor_parallel), then fully_shard on the "dp" dimension (a 2-D mesh: FSDP2 x TP).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from rlhfkit.engine.precision import TORCH_DTYPES, auto_torch_dtype
from rlhfkit.models.tensor_parallel import parallelize, tp_group


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: modules whose class is in the model's `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    base = getattr(model, "base_model", model)
    names |= set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"cannot find decoder layers to shard in {type(model).__name__}: "
                         f"its _no_split_modules is {sorted(names)}")
    return layers


def compute_dtype(param_dtype: str, device: torch.device) -> torch.dtype:
    """auto: bf16 where `device` computes it natively, fp32 elsewhere (`rlhfkit.engine.precision`)."""
    if param_dtype == "auto":
        return auto_torch_dtype(device)
    return TORCH_DTYPES[param_dtype]


def shard_model(model: nn.Module, *, zero_stage: int, device: torch.device, param_dtype: str = "auto",
                cpu_offload: bool = False, trainable: bool = False) -> nn.Module:
    """Apply FSDP2 in place and return the model (master weights stay fp32; compute in the chosen dtype).

    A single rank with nothing to shard (no offload, no tensor parallelism) keeps the plain module: FSDP2's
    per-layer gather/reduce copies cost 15-20% of an SFT step on a CPU (benchmarks/sft.py), and in half precision
    its cast of every fp32 weight in every forward (and gradient in every backward) about 30% of a policy step
    (benchmarks/train_step.py). There a frozen model (`trainable=False`) is simply cast to the compute dtype, and a
    trainable one stays fp32 for `TrainEngine`, which keeps the fp32 masters apart and computes on a half-precision
    copy (`rlhfkit.engine.master_weights`). Everything downstream (optimizer, clipping, checkpoints) treats all alike.
    """
    dtype = compute_dtype(param_dtype, device)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    from rlhfkit.models.loading import is_4bit

    if is_4bit(model):  # --load_in_4bit: FSDP2 cannot shard bitsandbytes' packed Params4bit (see docs/models.md)
        if world > 1:
            from rlhfkit.errors import ConfigError

            raise ConfigError(f"--load_in_4bit trains on one rank only ({world} here): FSDP2 cannot shard "
                              "bitsandbytes 4-bit weights; run one process, or drop --load_in_4bit")
        return model  # bitsandbytes placed it; the 4-bit layers compute in the dtype they were loaded with
    tp = tp_group()
    if tp is not None:  # --ds_tensor_parallel_size: split over the "tp" mesh dimension, FSDP2 over "dp"
        model.to(device)
        parallelize(model, tp)
        world //= tp.size
    if world == 1 and not cpu_offload and (tp is None or dtype == torch.float32):
        from rlhfkit.engine.master_weights import cast_parameters

        model.to(device)
        return model if trainable or dtype == torch.float32 else cast_parameters(model, dtype)
    kwargs: dict = {"reshard_after_forward": zero_stage == 3}
    if dtype != torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if cpu_offload and device.type == "cuda":
        kwargs["offload_policy"] = CPUOffloadPolicy()
    if not (cpu_offload and device.type == "cuda"):
        model.to(device)
    if tp is not None:
        kwargs["mesh"] = tp.dp_mesh
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
