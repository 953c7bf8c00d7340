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
- ``shared prompts`` (`shared_prompts`): two calls. Each prompt as a causal row; then one block per response whose
  queries are the response's tokens and whose keys are its prompt's and its own (``[r, p + r]`` under the mask cut
  to them). It computes ``p^2 + n r (p + r)`` scores for a prompt with n responses of r tokens, fewer than causal
  rows' ``n (p + r)^2`` and the group block's ``(p + n r)^2``: the demo's micro-batch (4 prompts x 8 samples, 30 +
  16 tokens) attends in 3.9 ms per layer against 6.8 (masked blocks) and 7.4 (causal rows), forward + backward.
  Causal rows still win for long responses (8 x 512), whose causal blocks skip the kernel's upper tiles.

Every layout shows each query exactly the keys it saw under the dense mask, so the outputs and gradients equal the
dense-mask attention's up to float summation order (tests/models/test_packed_attention.py, float64). Which one a row
uses is a cost estimate from the block sizes (`cheapest_layout`), never a measurement: same input, same choice, same
numbers.

How a call's blocks are computed depends on the precision and the machine: on a CPU with native bf16, a bf16 call of
at most `MATMUL_ATTENTION_MAX_SCORES` scores runs as batched matmuls (`attend_in_matmuls`); other half-precision
blocks of at most `FP32_ATTENTION_MAX_WIDTH` tokens go to SDPA upcast to fp32 on a CPU; everything else to SDPA as is.

The layout travels to the attention function as the model call's ``packed_attention`` keyword (transformers passes a
decoder's extra keywords down to its attention, as it does flash attention's ``cu_seq_lens``); the model's attention
implementation is `PACKED_SDPA` (`use_packed_attention`), which is plain SDPA for any call without that keyword.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

PACKED_SDPA = "rlhfkit_packed_sdpa"


@dataclass(frozen=True)
class AttentionBlocks:
    """N blocks attended in one SDPA call.

    queries: [N, Wq] the packed position of each block query (padding repeats a real position; never read);
    keys: [N, Wk] the packed positions of the block's keys and values, or None: the same as the queries;
    mask: [N, 1, Wq, Wk] bool, True = attend, or None: causal within each block (then `keys` is None).
    """

    queries: torch.Tensor
    keys: torch.Tensor | None
    mask: torch.Tensor | None

    @property
    def width(self) -> int:
        return max(self.queries.shape[1], self.keys.shape[1] if self.keys is not None else 0)

    def to(self, device: torch.device | str) -> AttentionBlocks:
        return AttentionBlocks(self.queries.to(device), None if self.keys is None else self.keys.to(device),
                               None if self.mask is None else self.mask.to(device))


@dataclass(frozen=True)
class PackedAttention:
    """A packed row's attention as one or two sets of blocks (`parts`), and where each position's output is:
    source: [L] for each packed position, its row in the parts' outputs flattened ([N * Wq] per part) and concatenated
    in order. `kind`: "causal rows", "masked blocks" or "shared prompts" (module docstring)."""

    parts: tuple[AttentionBlocks, ...]
    source: torch.Tensor
    kind: str

    def to(self, device: torch.device | str) -> PackedAttention:
        return PackedAttention(tuple(part.to(device) for part in self.parts), self.source.to(device), self.kind)


def causal_rows(rows: Sequence[Sequence[int]], length: int) -> PackedAttention:
    """One block per row of packed positions in causal order (a sample's prompt, then its response), attended
    causally. Every position 0..length-1 must be in some row; a position in several rows (a shared prompt: it sees
    the same keys in each) takes its output from the first."""
    blocks, source = _causal_rows(rows, length)
    _check_covered(source)
    return PackedAttention((blocks,), source, "causal rows")


def _causal_rows(rows: Sequence[Sequence[int]], length: int) -> tuple[AttentionBlocks, torch.Tensor]:
    """`causal_rows`' blocks, and its source with -1 where no row holds a position."""
    width = max(len(r) for r in rows)
    index = torch.zeros(len(rows), width, dtype=torch.long)
    source = torch.full((length,), -1, dtype=torch.long)
    for n, row in enumerate(rows):
        positions = torch.tensor(list(row), dtype=torch.long)
        index[n, :len(row)] = positions
        index[n, len(row):] = positions[0]
        unset = source[positions] < 0
        source[positions[unset]] = n * width + torch.arange(len(row))[unset]
    return AttentionBlocks(index, None, None), source


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
    return PackedAttention((AttentionBlocks(index, None, mask[:, None]),), source, "masked blocks")


def shared_prompts(prompts: Sequence[Sequence[int]], responses: Sequence[tuple[int, Sequence[int]]],
                   allowed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], length: int) -> PackedAttention:
    """Two sets of blocks: each prompt as a causal row (its own queries and keys), and each non-empty response as a
    block whose queries are the response's tokens and whose keys are its prompt's tokens then its own, under
    `allowed(query_positions, key_positions)` ([q, k] bool, True = query i may attend key j: the packed row's mask
    cut to those). `responses`: (index of its prompt in `prompts`, packed positions). Each of 0..length-1 must be in
    exactly one prompt or response. A padding query attends to the block's first key only (finite, never read)."""
    prompt_part, source = _causal_rows(prompts, length)
    offset = prompt_part.queries.numel()
    filled = [(g, list(r)) for g, r in responses if len(r)]
    if filled:
        q_width = max(len(r) for _, r in filled)
        k_width = max(len(prompts[g]) + len(r) for g, r in filled)
        queries = torch.zeros(len(filled), q_width, dtype=torch.long)
        keys = torch.zeros(len(filled), k_width, dtype=torch.long)
        mask = torch.zeros(len(filled), q_width, k_width, dtype=torch.bool)
        mask[:, :, 0] = True  # padding queries: the first key
        for n, (g, response) in enumerate(filled):
            q_pos = torch.tensor(response, dtype=torch.long)
            k_pos = torch.tensor(list(prompts[g]) + response, dtype=torch.long)
            queries[n, :len(q_pos)], queries[n, len(q_pos):] = q_pos, q_pos[0]
            keys[n, :len(k_pos)], keys[n, len(k_pos):] = k_pos, k_pos[0]
            mask[n, :len(q_pos)] = False
            mask[n, :len(q_pos), :len(k_pos)] = allowed(q_pos, k_pos)
            if bool((source[q_pos] >= 0).any()):
                raise ValueError("shared_prompts: a packed position is in two blocks")
            source[q_pos] = offset + n * q_width + torch.arange(len(q_pos))
        _check_covered(source)
        return PackedAttention((prompt_part, AttentionBlocks(queries, keys, mask[:, None])), source, "shared prompts")
    _check_covered(source)
    return PackedAttention((prompt_part,), source, "shared prompts")


def _check_covered(source: torch.Tensor) -> None:
    missing = (source < 0).nonzero().flatten()
    if len(missing):
        raise ValueError(f"packed attention: positions {missing[:8].tolist()} are in no block")


# Cost of one layer's attention forward + backward in SDPA: per call, per block and per computed score, fitted to 18
# timings (six packed shapes x three layouts; AMD EPYC Zen 5, 2 threads, bf16 inputs, narrow blocks in fp32, host
# memory retained; benchmarks/packed_attention.py; least squares on relative error, then rounded): with these the
# estimate picks the fastest layout in all six shapes, by a margin of 6% or more, each estimate within 30% of its
# timing. A masked block computes all Wq x Wk scores; a causal one its lower triangle at the kernel's tiles of 512
# keys (`causal_scores`).
CALL_NS, BLOCK_NS, CAUSAL_SCORE_NS, MASKED_SCORE_NS = 0.29e6, 0.08e6, 45.0, 48.0
KEY_TILE = 512


def causal_scores(width: int) -> int:
    """Scores a causal block of `width` tokens computes: each query against every key of the tiles of `KEY_TILE` keys
    up to its own."""
    return sum(min(KEY_TILE, width - start) * min(width, start + KEY_TILE) for start in range(0, width, KEY_TILE))


def causal_rows_cost(rows: int, width: int) -> float:
    return CALL_NS + rows * (BLOCK_NS + CAUSAL_SCORE_NS * causal_scores(width))


def masked_blocks_cost(blocks: int, width: int) -> float:
    return CALL_NS + blocks * (BLOCK_NS + MASKED_SCORE_NS * width * width)


def shared_prompts_cost(prompt_rows: int, prompt_width: int, responses: int, query_width: int,
                        key_width: int) -> float:
    """The prompts as causal rows, and one call over the responses' blocks (`shared_prompts`)."""
    return causal_rows_cost(prompt_rows, prompt_width) + CALL_NS + \
        responses * (BLOCK_NS + MASKED_SCORE_NS * query_width * key_width)


def cheapest_layout(candidates: Sequence[tuple[float, Callable[[], PackedAttention]]]) -> PackedAttention:
    """Build the candidate (estimated cost, builder) whose cost is lowest (the first on a tie); only it is built."""
    return min(candidates, key=lambda candidate: candidate[0])[1]()


def cheaper_layout(rows: Sequence[Sequence[int]], blocks: Sequence[Sequence[int]],
                   allowed: Callable[[torch.Tensor], torch.Tensor], length: int) -> PackedAttention:
    """The same attention as `causal_rows(rows, length)` or as `masked_blocks(blocks, allowed, length)`, whichever
    `causal_rows_cost` / `masked_blocks_cost` rates cheaper from the sizes alone (only the chosen one is built)."""
    return cheapest_layout([
        (causal_rows_cost(len(rows), max(map(len, rows))), lambda: causal_rows(rows, length)),
        (masked_blocks_cost(len(blocks), max(map(len, blocks))), lambda: masked_blocks(blocks, allowed, length))])


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


# Blocks at most this wide attend in float32 when the model computes in bf16/fp16 on a CPU and the blocks do not
# attend in matmuls (`attends_in_matmuls`). SDPA's CPU kernel is slow on narrow half-precision blocks: forward +
# backward of one layer (9 query heads, 3 key heads, 64 dims; AMD EPYC Zen 5, 2 threads;
# `benchmarks/packed_attention.py --widths`, casts included) took 21.1 ms in bf16 and 11.4 ms in fp32 for 32 causal
# rows of 53 tokens, 8.7 and 4.8 ms for 4 masked blocks of 144; even at 256-576 tokens; fp32 1.2x to 1.35x longer
# from 512 on. The upcast is also the more precise attention.
FP32_ATTENTION_MAX_WIDTH = 256

# A bf16 call of at most this many scores (blocks x query heads x query width x key width) attends in batched matmuls
# where the CPU computes bf16 natively (`attends_in_matmuls`, `attend_in_matmuls`). On one layer (forward + backward,
# SmolLM2's 9/3 heads of 64; AMD EPYC Zen 5, 2 threads, `benchmarks/packed_attention.py --widths`) it takes 0.58x to
# 0.78x the time of SDPA's kernel on the same blocks upcast to fp32, from 32 x 20 to 1 x 576 tokens (the demo's 32
# answers of 20 tokens against 56 keys: 1.5-1.6 against 2.6 ms). It keeps the bf16 probabilities for the backward
# (2 bytes a score), which bounds it: 2^22 scores are 8 MiB a layer.
MATMUL_ATTENTION_MAX_SCORES = 2 ** 22


@functools.cache
def _cpu_computes_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), as torch sees it; without them bf16 matmuls are
    emulated, about 100x slower than fp32 (rlhfkit.engine.precision measures the rates)."""
    return any(getattr(torch.cpu, probe, lambda: False)()
               for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def attends_in_matmuls(device: torch.device, dtype: torch.dtype, scores: int) -> bool:
    """Whether a call of `scores` scores in `dtype` attends in bf16 matmuls (`MATMUL_ATTENTION_MAX_SCORES`): bf16 on a
    CPU that computes it natively only."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and scores <= MATMUL_ATTENTION_MAX_SCORES
            and _cpu_computes_bf16())


def attends_in_fp32(device: torch.device, dtype: torch.dtype, width: int) -> bool:
    """Whether blocks of `width` tokens in `dtype` attend in float32 (`FP32_ATTENTION_MAX_WIDTH`): half precision on
    a CPU only; CUDA's kernels are fast in half precision at every width."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and width <= FP32_ATTENTION_MAX_WIDTH


class _AttentionInMatmuls(torch.autograd.Function):
    """o = W v with W = round(P) / sum(round(P)), P = softmax(scale q k^T + bias), for bf16 q [N, H_kv, g * Wq, D]
    (the g query heads of each key-value head stacked), k, v [N, H_kv, Wk, D] and a float32 bias [N, 1, Wq, Wk]
    (0 or -inf).

    The scores and the softmax are float32 (scores rounded to bf16 would be off by up to 0.4% of their size: 0.06 at
    15). The probabilities are rounded to bf16 for the matmul with the values, as GPU flash attention rounds them, and
    the output is divided by the rounded row's own sum, so the weights W sum to one. The backward is flash attention's
    dS = W (dP - sum_j W_j dP_j) with dP = dO v^T in float32 and the row's mean taken from dP itself: a part common
    to all values (large in a first layer) then cancels exactly, as it does in exact arithmetic; the matmuls for dq,
    dk and dv are bf16. Where the weights do not sum to one, or the mean comes from the bf16 output (flash's
    rowsum(dO o)), that part leaks into dq and dk: in SmolLM2-135M's bf16 gradient on one of two real demo batches
    (32 answers), layer 0's q and k projections were then 39-41% off the fp32 model's gradient, against 11-16% here
    and 8-13% for SDPA on the upcast blocks (the rest of the bf16 model's error; whole-gradient cosine 0.996-0.997
    here, 0.997-0.998 upcast). tests/models/test_packed_attention.py has the case in small."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
                scale: float) -> torch.Tensor:
        n, kv_heads, rows, _ = query.shape
        q_width, k_width = bias.shape[-2], bias.shape[-1]
        scores = (query.float() @ key.float().transpose(-1, -2)).view(n, kv_heads, rows // q_width, q_width, k_width)
        probs = torch.softmax(torch.add(bias[:, :, None], scores, alpha=scale), dim=-1)
        rounded = probs.to(query.dtype).view(n, kv_heads, rows, k_width)
        total = rounded.sum(-1, keepdim=True, dtype=torch.float32)
        out = (rounded @ value).float().div_(total)
        ctx.save_for_backward(query, key, value, rounded, total)
        ctx.scale = scale
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, rounded, total = ctx.saved_tensors
        grad = grad_out.float().div_(total)                                   # dO / sum: the weights' gradient scale
        grad_value = rounded.transpose(-1, -2) @ grad.to(value.dtype)
        grad_probs = grad @ value.float().transpose(-1, -2)                   # dP, float32
        # dS = W (dP - sum_j W_j dP_j): the row's weighted mean from dP itself, so the values' common part cancels
        # exactly (flash attention's rowsum(dO o) would read it from the output, rounded to bf16)
        row_mean = (grad_probs * rounded).sum(-1, keepdim=True).div_(total)
        grad_scores = grad_probs.sub_(row_mean).mul_(rounded).mul_(ctx.scale).to(query.dtype)
        return grad_scores @ key, grad_scores.transpose(-1, -2) @ query, grad_value, None, None


def attend_in_matmuls(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """softmax(scale q k^T + mask) v for bf16 query [N, H, Wq, D] and key/value [N, H_kv, Wk, D] (query head h reads
    key-value head h // (H / H_kv), as SDPA's `enable_gqa`) in batched matmuls, one per key-value head over its
    H / H_kv query heads (`_AttentionInMatmuls` says where it rounds); `allowed` [N, 1, Wq, Wk] bool, True = attend,
    or None: causal (Wq == Wk). Every query must see at least one key. Returns [N, H, Wq, D] in bf16."""
    n, heads, q_width, dim = query.shape
    kv_heads, k_width = key.shape[1], key.shape[2]
    if allowed is None:
        allowed = torch.ones(q_width, k_width, dtype=torch.bool, device=query.device).tril()[None, None]
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=query.device).masked_fill_(~allowed, float("-inf"))
    stacked = query.reshape(n, kv_heads, heads // kv_heads * q_width, dim)
    return _AttentionInMatmuls.apply(stacked, key, value, bias, scale).view(n, heads, q_width, dim)


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
    outputs = [_attend_blocks(part, query, key, value, dropout, scaling) for part in packed_attention.parts]
    rows = outputs[0] if len(outputs) == 1 else torch.cat(outputs)                # [sum N * Wq, H, D]
    return rows.index_select(0, packed_attention.source)[None], None              # [1, L, H, D]


def _attend_blocks(blocks: AttentionBlocks, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   dropout: float, scaling: float | None) -> torch.Tensor:
    """One SDPA call over `blocks` of a packed row's query [1, H, L, D] and key/value [1, H_kv, L, D]; the outputs
    [N * Wq, H, D], block by block."""
    def gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [1, h, L, D] -> [N, h, W, D]
        h, d = t.shape[1], t.shape[3]
        return t[0].index_select(1, index.reshape(-1)).view(h, *index.shape, d).transpose(0, 1)

    keys = blocks.queries if blocks.keys is None else blocks.keys
    q, k, v = gather(query, blocks.queries), gather(key, keys), gather(value, keys)
    grouped = q.shape[1] != k.shape[1]
    if grouped and blocks.mask is not None and q.device.type == "cuda":  # CUDA's kernels take grouped heads unmasked
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        grouped = False
    dtype = q.dtype
    if dropout == 0.0 and attends_in_matmuls(q.device, dtype, q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]):
        out = attend_in_matmuls(q, k, v, blocks.mask, q.shape[-1] ** -0.5 if scaling is None else scaling)
        return out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])   # [N * Wq, H, D]
    if attends_in_fp32(q.device, dtype, blocks.width):
        q, k, v = q.float(), k.float(), v.float()
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=blocks.mask, dropout_p=dropout, scale=scaling,
                                         is_causal=blocks.mask is None, enable_gqa=grouped).to(dtype)
    return out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])       # [N * Wq, H, D]


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
