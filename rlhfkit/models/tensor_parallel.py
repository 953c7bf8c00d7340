"""Tensor parallelism for training (`--ds_tensor_parallel_size N`, alias `--tp_size` on the training commands):
DTensor tensor parallel for the Llama/Qwen family on a 2-D device mesh ``("dp", "tp")``, FSDP2 sharding the
``dp`` dimension (rlhfkit.engine.fsdp).

Rank layout: global ranks ``[k N, (k + 1) N)`` form tensor-parallel group k (data-parallel rank k), as the ring
groups of rlhfkit.models.context_parallel do; the N ranks of a group take the same micro-batches.

Plan (Megatron-style, `torch.distributed.tensor.parallel`), per decoder layer:

    q_proj, k_proj, v_proj, gate_proj, up_proj : ColwiseParallel  (output features, i.e. whole heads, split)
    o_proj, down_proj                          : RowwiseParallel  (input features split; output all-reduced)

so each rank holds ``H / N`` query heads and ``H_kv / N`` key/value heads (N must divide both) and runs the
unchanged transformers attention on them (its shapes are ``-1`` heads). Embedding and LM head are split by
vocabulary: ``embed_tokens`` RowwiseParallel (each rank looks up its vocabulary rows; the partial sums are
all-reduced), ``lm_head`` ColwiseParallel with a replicated output (the full ``[B, T, V]`` logits are all-gathered
on every rank, so the log-prob and loss code is unchanged; a vocabulary-parallel loss is not implemented). Tied
embeddings stay tied (both are ``Shard(0)`` of the same ``[V, H]`` weight). Every other parameter (RMSNorms, the
``score`` head of reward models) is a replicated DTensor on the tp mesh whose module converts its inputs to
replicated DTensors and its outputs back to plain tensors.

Per layer and rank, forward: 2 all-reduces of ``[B, T, hidden]`` (after o_proj and down_proj); backward: the
matching all-reduces of the input gradients of q/k/v and gate/up. Embedding: 1 all-reduce forward; LM head: one
all-gather of the logits forward.

Gradients: every rank of a group computes the same loss; a split weight receives its own slice of the gradient,
a replicated one the same full gradient on every rank, so no extra normalisation is needed beyond counting each
sample once per rank of the group in the loop's global weight (the loop scales by ``world / weight``, which with
a weight counted N times is ``dp / W``, and FSDP2 averages over the dp ranks only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

TP_FLAG = "--ds_tensor_parallel_size"
# model types whose decoder layers have the Llama layout (q/k/v/o_proj, gate/up/down_proj) and -1-head reshapes
TP_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_LAYER_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
               "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
               "mlp.down_proj": "rowwise"}


@dataclass(frozen=True)
class TPGroup:
    """This rank's place on the ``("dp", "tp")`` mesh: ``size`` ranks per tensor-parallel group."""

    mesh: Any  # the 2-D DeviceMesh
    rank: int
    size: int

    @property
    def tp_mesh(self) -> Any:
        return self.mesh["tp"]

    @property
    def dp_mesh(self) -> Any:
        return self.mesh["dp"]


_TP: TPGroup | None = None


def tp_group() -> TPGroup | None:
    """The active tensor-parallel group, or None when tensor parallelism is off (size 1)."""
    return _TP


def tp_size() -> int:
    return _TP.size if _TP is not None else 1


def setup_tensor_parallel(size: int, device_type: str = "cpu") -> TPGroup | None:
    """Build the ``("dp", "tp")`` device mesh (collective: every rank calls it). Returns None for size 1."""
    global _TP
    from rlhfkit.errors import ConfigError

    _TP = None
    if size < 1:
        raise ConfigError(f"{TP_FLAG} must be >= 1, got {size}")
    if size == 1:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % size:
        raise ConfigError(f"{TP_FLAG} {size} must divide the world size {world} (world = data parallel x tensor "
                          f"parallel): launch a multiple of {size} processes or change {TP_FLAG}")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world // size, size), mesh_dim_names=("dp", "tp"))
    _TP = TPGroup(mesh=mesh, rank=dist.get_rank() % size, size=size)
    return _TP


def teardown_tensor_parallel() -> None:
    global _TP
    _TP = None


def check_model(model: Any, size: int) -> None:
    """Refuse models the plan does not cover and head counts that ``size`` does not divide (ConfigError)."""
    from rlhfkit.errors import ConfigError

    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in TP_MODEL_TYPES:
        raise ConfigError(f"{TP_FLAG} {size}: tensor parallelism covers the Llama/Qwen family "
                          f"({', '.join(TP_MODEL_TYPES)}), not model_type {kind!r}; use {TP_FLAG} 1")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                        ("intermediate_size", config.intermediate_size)):
        if count % size:
            raise ConfigError(f"{TP_FLAG} {size} must divide the model's {name} ({count}): each rank holds "
                              f"{name} / {size}; pick a divisor of {count}")
    if config.vocab_size % size:
        raise ConfigError(f"{TP_FLAG} {size} must divide the model's vocab_size ({config.vocab_size}): the embedding "
                          "and LM head are split by vocabulary")


def parallelize(model: Any, group: TPGroup) -> nn.Module:
    """Apply the tensor-parallel plan (module docstring) in place on the ``tp`` mesh; returns the model."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_model(model, group.size)
    mesh = group.tp_mesh
    backbone: Any = model.base_model  # LlamaModel / Qwen2Model (the causal LM's .model, the classifier's .model)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in backbone.layers:
        parallelize_module(layer, mesh, {name: styles[kind]() for name, kind in _LAYER_PLAN.items()})
    tied = getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head")
    parallelize_module(backbone, mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate())})
    if hasattr(model, "lm_head"):
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
        if tied:
            model.lm_head.weight = backbone.embed_tokens.weight
    replicate_rest(model, mesh)
    return model


def replicate_rest(model: nn.Module, mesh: Any) -> None:
    """Every module that still has plain parameters (norms, the score head): parameters become replicated
    DTensors; its tensor inputs are wrapped as replicated DTensors and its outputs unwrapped to plain tensors."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def partition(_name: str, module: nn.Module, device_mesh: Any) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                replicated = DTensor.from_local(param.data, device_mesh, [Replicate()], run_check=False)
                module.register_parameter(pname, nn.Parameter(replicated, requires_grad=param.requires_grad))

    def wrap(_module: nn.Module, inputs: tuple, device_mesh: Any) -> tuple:
        return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def unwrap(_module: nn.Module, outputs: Any, _mesh: Any) -> Any:
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, mesh, partition, wrap, unwrap)  # type: ignore[arg-type]
