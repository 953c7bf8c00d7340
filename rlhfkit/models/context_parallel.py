"""Context parallelism (`--ring_attn_size N`): each sequence of a micro-batch is split across the N ranks of a
ring group, each rank running the model on one contiguous chunk of the (padded or packed) row.

Variant: all-gather of keys and values (the "llama3" context-parallel scheme, which ring-flash-attn's llama3
varlen path implements): in every attention layer each rank all-gathers the keys and values of its group and
attends its own queries (global positions ``[s, s + C)``, ``C = T / N``) to every key of the row under a boolean
mask built from *global* positions:

    allowed(i, j) = j <= i  and  key j is real (padded batch: attention_mask[j] = 1)
                            and  same sequence (packed row: seg(i) = seg(j), seg from the position restarts)
                    or  i = j                                    (keeps fully masked padding rows finite)

so every real query sees exactly the keys the unsharded forward shows it, and the output equals the unsharded one
up to float rounding. Rotary embeddings use the global ``position_ids`` (the chunk's slice of them).

Gradients: the all-gather's backward sums the gradient of the gathered tensor over the group and keeps this rank's
slice (an all-reduce, then a slice: gloo has no reduce-scatter), so a key's gradient collects the contributions of
every rank's queries.

Cost per layer and rank (T tokens, KV heads ``H_kv`` of size d, bytes b): forward all-gathers ``2 T H_kv d b``
(receives ``(N-1)/N`` of it), backward all-reduces the same volume; the attention scores are ``C x T`` instead of
``T x T``; activations outside attention are ``1/N`` of the unsharded ones, but the gathered keys/values (``2 T H_kv
d`` per layer) are kept for backward, as in the llama3 scheme. A true ring (P2P + online softmax) would keep
``O(C)`` keys instead; not implemented. ``--ring_head_stride s``: keys/values are gathered and attended ``s`` KV
heads at a time (ring-flash-attn's ``heads_k_stride``): same result, smaller transient buffers, more messages.

Loss convention (rlhfkit.trainers): the per-token outputs of a chunk (log-probs, values) are all-gathered along the
sequence (`gather_sequence`), so every rank of a ring group holds the whole micro-batch's outputs and computes the
same loss; the training loop counts every sample once per ring rank in its normaliser, which cancels the N-fold
gradient that the replicated loss sends back through the gather (docs/parallelism.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

RING_ATTENTION = "rlhfkit_ring"


@dataclass(frozen=True)
class RingGroup:
    """This rank's ring-attention group: ``size`` consecutive global ranks; ``rank`` is this rank's index in it."""

    group: Any
    rank: int
    size: int
    head_stride: int = 1


_RING: RingGroup | None = None


def ring_group() -> RingGroup | None:
    """The active ring group, or None when context parallelism is off (``--ring_attn_size 1``)."""
    return _RING


def setup_ring_attention(ring_size: int, head_stride: int = 1) -> RingGroup | None:
    """Create the ring groups (collective: every rank calls it) and register the attention function.

    Global ranks ``[k N, (k + 1) N)`` form ring group k (data-parallel rank k). Returns None for ``ring_size`` 1."""
    global _RING
    from rlhfkit.errors import ConfigError

    if ring_size < 1 or head_stride < 1:
        raise ConfigError(f"--ring_attn_size ({ring_size}) and --ring_head_stride ({head_stride}) must be >= 1")
    _RING = None
    if ring_size == 1:
        if head_stride != 1:
            raise ConfigError(f"--ring_head_stride {head_stride} acts only with --ring_attn_size > 1: set both or "
                              "drop --ring_head_stride")
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % ring_size:
        raise ConfigError(f"--ring_attn_size {ring_size} must divide the world size {world} (world = data parallel "
                          f"x ring size): launch a multiple of {ring_size} processes or change --ring_attn_size")
    rank = dist.get_rank()
    mine = None
    for start in range(0, world, ring_size):
        group = dist.new_group(list(range(start, start + ring_size)))
        if start <= rank < start + ring_size:
            mine = group
    register_ring_attention()
    _RING = RingGroup(group=mine, rank=rank % ring_size, size=ring_size, head_stride=head_stride)
    return _RING


def teardown_ring_attention() -> None:
    global _RING
    _RING = None


def data_parallel_coords(rank: int, world: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel world size): ranks of one ring group, or of one tensor-parallel group
    (rlhfkit.models.tensor_parallel), share a data-parallel rank."""
    from rlhfkit.models.tensor_parallel import tp_size

    size = (_RING.size if _RING is not None else 1) * tp_size()
    return rank // size, world // size


def register_ring_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(RING_ATTENTION, ring_attention_forward)


def use_ring_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` (a transformers model, possibly PEFT-wrapped) to the ring attention function."""
    hf: Any = model  # a transformers model: get_base_model (PEFT) and config are not nn.Module's
    inner: Any = hf.get_base_model() if hasattr(hf, "get_base_model") else hf
    heads = getattr(inner.config, "num_key_value_heads", None) or inner.config.num_attention_heads
    if _RING is not None and heads % _RING.head_stride:
        from rlhfkit.errors import ConfigError

        raise ConfigError(f"--ring_head_stride {_RING.head_stride} must divide the model's number of key/value "
                          f"heads ({heads})")
    inner.set_attn_implementation(RING_ATTENTION)


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` over a group; backward: all-reduce the gradient and keep this rank's slice."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, dim: int, group: Any, rank: int, size: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.rank, ctx.size = dim, group, rank, size
        parts = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None


def gather_along(tensor: torch.Tensor, dim: int, ring: RingGroup) -> torch.Tensor:
    """Autograd-aware all-gather of equal chunks along ``dim`` over the ring group (concatenated in rank order)."""
    return _GatherSequence.apply(tensor, dim, ring.group, ring.rank, ring.size)


def sum_over_ring(tensor: torch.Tensor, ring: RingGroup) -> torch.Tensor:
    """The sum of `tensor` over the ring group's ranks, on every rank (autograd: the gather's backward, so each rank's
    part gets the group's summed upstream gradient, the N-fold one of the loss convention above)."""
    return gather_along(tensor[None], 0, ring).sum(0)


def ring_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: local queries ``[B, H, C, d]``, local keys/values ``[B, H_kv, C, d]``;
    ``attention_mask`` is the ``[B, 1, C, T]`` boolean mask of `shard_forward_kwargs` (True = attend). Returns
    ``([B, C, H, d], None)``."""
    ring = _RING
    if ring is None or attention_mask is None or attention_mask.dtype != torch.bool:
        raise RuntimeError("the rlhfkit_ring attention runs only inside a --ring_attn_size > 1 forward whose inputs "
                           "went through rlhfkit.models.context_parallel.shard_forward_kwargs")
    groups = query.shape[1] // key.shape[1]
    stride = ring.head_stride
    outputs = []
    for h in range(0, key.shape[1], stride):
        k = gather_along(key[:, h:h + stride], 2, ring)
        v = gather_along(value[:, h:h + stride], 2, ring)
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        q = query[:, h * groups:(h + stride) * groups]
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=scaling,
                                                      dropout_p=dropout if module.training else 0.0))
    out = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
    return out.transpose(1, 2).contiguous(), None


def padded_length(length: int, ring: RingGroup) -> int:
    """The row length rounded up to a multiple of the ring size (the extra tokens are padding nobody attends)."""
    return -(-length // ring.size) * ring.size


def ring_mask(position_ids: torch.Tensor, attention_mask: torch.Tensor | None, start: int, chunk: int
              ) -> torch.Tensor:
    """``[B, 1, chunk, T]`` boolean mask of the queries ``[start, start + chunk)`` over all T keys (module docstring):
    causal by global index, keys restricted to real tokens (padded batch) or to the query's own sequence (packed
    row, ``attention_mask`` None; a sequence starts wherever the position does not follow the previous one)."""
    total = position_ids.shape[1]
    device = position_ids.device
    queries = torch.arange(start, start + chunk, device=device)
    keys = torch.arange(total, device=device)
    allowed = (keys[None, :] <= queries[:, None])[None]  # [1, C, T]
    if attention_mask is not None:
        allowed = allowed & attention_mask.bool()[:, None, :]
    else:
        step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
        segment = (step != 1).cumsum(-1)  # [B, T]
        allowed = allowed & (segment[:, start:start + chunk, None] == segment[:, None, :])
    allowed = allowed | (queries[:, None] == keys[None, :])[None]
    return allowed[:, None]


def block_ring_mask(mask: torch.Tensor, start: int, chunk: int, total: int) -> torch.Tensor:
    """``[B, 1, chunk, total]`` boolean rows ``[start, start + chunk)`` of a full 4-D ``[B, 1, T, T]`` mask (boolean:
    True = attend; floating: additive, 0 = attend), such as ppo's packed rows whose responses share one prompt
    (rlhfkit.rl.packing); the ``total - T`` padding keys are attended by nobody, and every query sees itself."""
    allowed = mask if mask.dtype == torch.bool else mask == 0
    extra = total - allowed.shape[-1]
    allowed = F.pad(allowed, (0, extra, 0, extra), value=False)[:, :, start:start + chunk]
    queries = torch.arange(start, start + chunk, device=mask.device)
    return allowed | (queries[:, None] == torch.arange(total, device=mask.device)[None, :])


def shard_forward_kwargs(kwargs: dict[str, Any], ring: RingGroup) -> dict[str, Any]:
    """This rank's share of a forward: ``input_ids`` / ``position_ids`` cut to its chunk of the row (padded to a
    multiple of the ring size), ``attention_mask`` replaced by the chunk's `ring_mask` (a 2-D padding mask or none)
    or by the chunk's rows of a 4-D block mask (`block_ring_mask`)."""
    ids, positions, mask = kwargs["input_ids"], kwargs["position_ids"], kwargs.get("attention_mask")
    if mask is not None and mask.dim() not in (2, 4):
        raise ValueError("context parallel forwards take a 2-D attention_mask (padded batch), a 4-D block mask "
                         "[B, 1, T, T], or none (packed row)")
    if mask is not None and mask.dim() == 4:
        total = padded_length(ids.shape[1], ring)
        chunk = total // ring.size
        start = ring.rank * chunk
        extra = total - ids.shape[1]
        ids, positions = F.pad(ids, (0, extra)), F.pad(positions, (0, extra))
        local = {k: v for k, v in kwargs.items() if k not in ("input_ids", "position_ids", "attention_mask")}
        local.update(input_ids=ids[:, start:start + chunk], position_ids=positions[:, start:start + chunk],
                     attention_mask=block_ring_mask(mask, start, chunk, total), use_cache=False)
        return local
    extra = padded_length(ids.shape[1], ring) - ids.shape[1]
    if extra:
        ids, positions = F.pad(ids, (0, extra)), F.pad(positions, (0, extra))
        mask = F.pad(mask, (0, extra)) if mask is not None else None
        if mask is None:  # a packed row: each padding token is a sequence of its own (position 0)
            positions[:, -extra:] = 0
    chunk = ids.shape[1] // ring.size
    start = ring.rank * chunk
    local = {k: v for k, v in kwargs.items() if k not in ("input_ids", "position_ids", "attention_mask")}
    local.update(input_ids=ids[:, start:start + chunk], position_ids=positions[:, start:start + chunk],
                 attention_mask=ring_mask(positions, mask, start, chunk), use_cache=False)
    return local


def local_slice(tensor: torch.Tensor, ring: RingGroup, pad_value: int | float = 0) -> torch.Tensor:
    """This rank's chunk (dim 1) of a full-length ``[B, T, ...]`` tensor, padded like `shard_forward_kwargs`."""
    extra = padded_length(tensor.shape[1], ring) - tensor.shape[1]
    if extra:
        tensor = torch.cat([tensor, tensor.new_full((tensor.shape[0], extra, *tensor.shape[2:]), pad_value)], 1)
    chunk = tensor.shape[1] // ring.size
    return tensor[:, ring.rank * chunk:(ring.rank + 1) * chunk]


def gather_sequence(local: torch.Tensor, length: int, ring: RingGroup) -> torch.Tensor:
    """``[B, C, ...]`` per-token outputs of every rank's chunk -> ``[B, length, ...]`` on every rank (autograd)."""
    return gather_along(local, 1, ring)[:, :length]
