"""Attention over a packed row without an ``L x L`` mask: the row's attention runs as a batch of short blocks.

A packed row (`rlhfkit.rl.packing`: each prompt once, then every response to it) was attended with one dense
``[L, L]`` additive mask. SDPA's CPU kernel (and CUDA's memory-efficient one) then computes every query against every
key of the row, visible or not: for a GRPO micro-batch of 8 responses of 512 tokens (L = 4,216) that is 17.8M scores
per head and layer, 7x what the samples need, and the attention took 76% of the training pass (AMD EPYC Zen 5,
bf16; docs/benchmarks.md "Packed attention").

Here the same attention is computed block by block, in one SDPA call per layer:

- ``causal rows`` (`causal_rows`): block n is one sample's tokens in causal order (its prompt, then its response),
  attended with ``is_causal`` (no mask): exactly the keys the sample's padded row shows it. A prompt shared by
  several samples is gathered into each of their blocks (its keys and values are computed once, by the packed
  linear layers; the gather's backward sums their gradients); its own outputs are read from its first block.
- ``masked blocks`` (`masked_blocks`): block g is one prompt group (a prompt and all its responses) with the group's
  ``[W, W]`` boolean mask: the packed row's mask cut to the group. Cheaper than causal rows where a long prompt is
  shared by short responses (the rows would repeat its ``p^2`` self-attention).

Either way every query sees exactly the keys it saw under the dense mask, so the outputs and gradients equal the
dense-mask attention's up to float summation order (tests/models/test_packed_attention.py, float64). Which of the
two a row uses is a cost estimate from the block sizes (`cheaper_layout`), never a measurement: same input, same
choice, same numbers.

The layout travels to the attention function as the model call's ``packed_attention`` keyword (transformers passes a
decoder's extra keywords down to its attention, as it does flash attention's ``cu_seq_lens``); the model's attention
implementation is `PACKED_SDPA` (`use_packed_attention`), which is plain SDPA for any call without that keyword.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

PACKED_SDPA = "rlhfkit_packed_sdpa"


@dataclass(frozen=True)
class PackedAttention:
    """A packed row's attention as N blocks of width W.

    index: [N, W] the packed position of each block token (padding repeats the block's first position);
    mask: [N, 1, W, W] bool, True = attend (masked blocks), or None: causal within each block (causal rows);
    source: [L] for each packed position, the flat block position (n * W + j) whose output it takes.
    """

    index: torch.Tensor
    mask: torch.Tensor | None
    source: torch.Tensor

    @property
    def kind(self) -> str:
        return "causal rows" if self.mask is None else "masked blocks"

    def to(self, device: torch.device | str) -> PackedAttention:
        return PackedAttention(self.index.to(device), None if self.mask is None else self.mask.to(device),
                               self.source.to(device))


def causal_rows(rows: Sequence[Sequence[int]], length: int) -> PackedAttention:
    """One block per row of packed positions in causal order (a sample's prompt, then its response), attended
    causally. Every position 0..length-1 must be in some row; a position in several rows (a shared prompt: it sees
    the same keys in each) takes its output from the first."""
    width = max(len(r) for r in rows)
    index = torch.zeros(len(rows), width, dtype=torch.long)
    source = torch.full((length,), -1, dtype=torch.long)
    for n, row in enumerate(rows):
        positions = torch.tensor(list(row), dtype=torch.long)
        index[n, :len(row)] = positions
        index[n, len(row):] = positions[0]
        unset = source[positions] < 0
        source[positions[unset]] = n * width + torch.arange(len(row))[unset]
    _check_covered(source)
    return PackedAttention(index=index, mask=None, source=source)


def masked_blocks(blocks: Sequence[Sequence[int]], allowed: Callable[[torch.Tensor], torch.Tensor],
                  length: int) -> PackedAttention:
    """One block per group of packed positions (each of 0..length-1 in exactly one block), attended under
    `allowed(positions)` ([k, k] bool, True = query i may attend key j: the packed row's mask cut to the block). A
    padding query attends to itself only (finite, and its output is never read)."""
    width = max(len(b) for b in blocks)
    index = torch.zeros(len(blocks), width, dtype=torch.long)
    mask = torch.eye(width, dtype=torch.bool).repeat(len(blocks), 1, 1)
    source = torch.full((length,), -1, dtype=torch.long)
    for n, block in enumerate(blocks):
        positions = torch.tensor(list(block), dtype=torch.long)
        k = len(block)
        index[n, :k] = positions
        index[n, k:] = positions[0]
        mask[n, :k, :k] = allowed(positions)
        if bool((source[positions] >= 0).any()):
            raise ValueError("masked_blocks: a packed position is in two blocks")
        source[positions] = n * width + torch.arange(k)
    _check_covered(source)
    return PackedAttention(index=index, mask=mask[:, None], source=source)


def _check_covered(source: torch.Tensor) -> None:
    missing = (source < 0).nonzero().flatten()
    if len(missing):
        raise ValueError(f"packed attention: positions {missing[:8].tolist()} are in no block")


# Cost of one layer's attention forward + backward in SDPA, in ns, measured on AMD EPYC Zen 5 (2 threads, bf16;
# benchmarks/packed_attention.py): per block call overhead and per computed score. A masked block computes all W^2
# scores; a causal row about the same (the CPU kernel skips little of the upper triangle at these widths).
ROW_OVERHEAD_NS, ROW_SCORE_NS = 0.9e6, 40.0
BLOCK_OVERHEAD_NS, BLOCK_SCORE_NS = 1.6e6, 36.0


def causal_rows_cost(rows: int, width: int) -> float:
    return rows * (ROW_OVERHEAD_NS + ROW_SCORE_NS * width * width)


def masked_blocks_cost(blocks: int, width: int) -> float:
    return BLOCK_OVERHEAD_NS + blocks * BLOCK_SCORE_NS * width * width


def cheaper_layout(rows: Sequence[Sequence[int]], blocks: Sequence[Sequence[int]],
                   allowed: Callable[[torch.Tensor], torch.Tensor], length: int) -> PackedAttention:
    """The same attention as `causal_rows(rows, length)` or as `masked_blocks(blocks, allowed, length)`, whichever
    `causal_rows_cost` / `masked_blocks_cost` rates cheaper from the sizes alone (only the chosen one is built)."""
    if causal_rows_cost(len(rows), max(map(len, rows))) <= masked_blocks_cost(len(blocks), max(map(len, blocks))):
        return causal_rows(rows, length)
    return masked_blocks(blocks, allowed, length)


def same_sample_causal(owner: torch.Tensor) -> torch.Tensor:
    """``[k, k]`` bool, True where query i may attend key j of a row of whole samples back to back: j <= i in the same
    sample (`owner`: the sample of each position, ascending). Also the dense mask of such a row
    (`rlhfkit.data.collate.block_causal_mask`)."""
    return (owner[:, None] == owner[None, :]) & torch.ones(len(owner), len(owner), dtype=torch.bool).tril()


def sample_blocks(lengths: Sequence[int]) -> PackedAttention:
    """The layout of a row of whole samples packed back to back (the offline trainers' --packing_samples,
    `rlhfkit.data.collate.collate_packed`): one causal row per sample, or the whole row as one block under its
    block-diagonal causal mask (`cheaper_layout`)."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    rows = [range(start, start + n) for start, n in zip(starts, lengths)]
    total = sum(lengths)
    sample_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return cheaper_layout(rows, [range(total)], lambda positions: same_sample_causal(sample_of[positions]), total)


# Blocks at most this wide attend in float32 when the model computes in bf16/fp16 on a CPU. SDPA's CPU kernel is
# slow on narrow half-precision blocks: forward + backward of one layer (9 query heads, 3 key heads, 64 dims; AMD EPYC
# Zen 5, 2 threads; `benchmarks/packed_attention.py --widths`, casts included) took 21.1 ms in bf16 and 11.4 ms in
# fp32 for 32 causal rows of 53 tokens, 8.7 and 4.8 ms for 4 masked blocks of 144; even at 256-576 tokens; fp32 1.2x
# to 1.35x longer from 512 on. The upcast is also the more precise attention.
FP32_ATTENTION_MAX_WIDTH = 256


def attends_in_fp32(device: torch.device, dtype: torch.dtype, width: int) -> bool:
    """Whether blocks of `width` tokens in `dtype` attend in float32 (`FP32_ATTENTION_MAX_WIDTH`): half precision on
    a CPU only; CUDA's kernels are fast in half precision at every width."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and width <= FP32_ATTENTION_MAX_WIDTH


def packed_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        packed_attention: PackedAttention | None = None, **kwargs: Any,
                        ) -> tuple[torch.Tensor, None]:
    """transformers attention function (`PACKED_SDPA`): query [1, H, L, D], key/value [1, H_kv, L, D] of a packed
    row, attended block by block per `packed_attention`; returns [1, L, H, D]. Without `packed_attention`: SDPA as
    transformers runs it (any batch, any mask)."""
    if packed_attention is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    layout = packed_attention
    blocks, width = layout.index.shape
    flat = layout.index.reshape(-1)

    def gather(t: torch.Tensor) -> torch.Tensor:  # [1, h, L, D] -> [N, h, W, D]
        h, d = t.shape[1], t.shape[3]
        return t[0].index_select(1, flat).view(h, blocks, width, d).transpose(0, 1)

    q, k, v = gather(query), gather(key), gather(value)
    grouped = q.shape[1] != k.shape[1]
    if grouped and layout.mask is not None and q.device.type == "cuda":  # CUDA's kernels take grouped heads unmasked
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        grouped = False
    dtype = q.dtype
    if attends_in_fp32(q.device, dtype, width):
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.mask, dropout_p=dropout, scale=scaling,
                                         is_causal=layout.mask is None, enable_gqa=grouped).to(dtype)
    heads, dim = out.shape[1], out.shape[3]
    rows = out.transpose(1, 2).reshape(blocks * width, heads, dim)         # [N * W, H, D]
    return rows.index_select(0, layout.source)[None], None                  # [1, L, H, D]


def register_packed_attention() -> None:
    """Make `PACKED_SDPA` known to transformers (idempotent): the attention function above, and SDPA's mask
    builder for the calls that go without a layout."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch a model that attends with SDPA to `PACKED_SDPA` (identical for calls without a packed layout); True if
    it now uses it. A model on another attention implementation is left as it is (packed rows then go with the
    dense mask, `rlhfkit.rl.packing`)."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current == PACKED_SDPA:
        return True
    if current != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    register_packed_attention()
    hf: Any = model  # a transformers model: set_attn_implementation is its method, not nn.Module's
    hf.set_attn_implementation(PACKED_SDPA)
    return True


def uses_packed_attention(model: torch.nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == PACKED_SDPA
