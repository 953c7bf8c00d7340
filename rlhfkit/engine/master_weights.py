"""Half-precision compute weights with fp32 master weights, for a model that trains on one rank.

The model's parameters are cast to the compute dtype once and stay there: every forward and backward runs on them
without a cast. The fp32 masters live in a structural copy of the model (`masters`, same parameter names and ties),
which is what the optimizer steps, the checkpoints save and load, the EMA follows and the HF folder is written from,
so resume stays exact and updates far below the half precision's resolution still accumulate:

    backward:            each parameter's gradient (compute dtype) is added to its master's fp32 `.grad` as soon
                         as it is accumulated (a post-accumulate hook), so micro-batches sum in fp32
    optimizer step:      on the masters (clip, AdamW, ...): `masters_with_grads()` first (a master no micro-batch
                         reached has no gradient, as with set_to_none), `end_step()` after, instead of zero_grad
    sync_to_model():     param = round_to_dtype(master), after every step and every checkpoint load

On a CPU the masters' fp32 gradient buffers are allocated once and kept across steps: a step's first micro-batch
copies into them, the next ones add. (Freed and allocated again every step, as zero_grad(set_to_none=True) does, each
step page-faulted 540 MB of fresh memory for 135M weights: 0.17 s of a 1.4 s demo training stage, py-spy on the
worker.) On a GPU they are freed after each step as before: the caching allocator hands the memory back without
that cost, and a colocated engine may need it between steps.

Rounding (`rounding`): "nearest" is what a cast does. "stochastic" (bf16 only) rounds each trainable weight up
with probability equal to its distance to the lower bf16 neighbour over the spacing, so E[param] = master. Why it
matters: a fine-tuning update is far below bf16's resolution (an Adam step of lr 8e-6 against a spacing of 2.4e-4
near |w| = 0.05), and the base weights were bf16 to begin with, so round-to-nearest hands the forward (and the
rollout engines, which load these parameters) the *base* weight until a master has drifted half a spacing away: for
most weights, every update of a short run is invisible to the policy that samples. Stochastic rounding passes each
update on in expectation. The draws come from a stream seeded by (`seed`, optimizer step) (`RandomBits`), so a run
and its resume round identically. Frozen parameters are always rounded to nearest (they were cast once at the start).

FSDP2's `MixedPrecisionPolicy` computes the same arithmetic, but on one rank it pays per layer and per micro-batch:
a gather and a cast of every fp32 weight in every forward (and again in backward under zero stage 3) and a reduce of
every gradient. Here the cast happens once per optimizer step. Measured in `benchmarks/train_step.py` (docs/
benchmarks.md; AMD EPYC Zen 5 with native bf16, one sitting, alternating, medians of 5): the demo's policy step
4.03 s with FSDP2's policy, 3.41 s with this (fp32: 6.93 s).
Only floating-point *parameters* are cast, as FSDP2 does: buffers (a rotary embedding's `inv_freq`) stay fp32.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every floating-point parameter of `model` to `dtype` in place (buffers untouched; ties kept)."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
    return model


ROUNDING_CHUNK = 1 << 20  # elements per pass: the passes' working set (12 MiB) stays in cache


class RoundingScratch:
    """Buffers for `stochastic_round_to_bf16` on one device, reused across calls (12 MiB at the default chunk)."""

    def __init__(self, device: torch.device | str, chunk: int = ROUNDING_CHUNK) -> None:
        self.chunk = chunk
        self.draws = torch.empty((chunk + 3) // 4, dtype=torch.int64, device=device)  # 64 random bits each
        self.noise = torch.empty(chunk, dtype=torch.int32, device=device)


RANDOM_BITS_SOURCES = ("numpy", "torch")


class RandomBits:
    """Uniform random 16-bit words for stochastic rounding, from a stream seeded by non-negative integers. Each
    64-bit draw serves four words. `source` "numpy" (the default on a CPU): numpy's SFC64, whose raw draws are 2x
    faster than torch's CPU generator (mt19937): 135M weights' worth in 0.045 s against 0.09 s (AMD EPYC Zen 5);
    "torch" (the default elsewhere): a torch generator on the device (Philox on CUDA)."""

    def __init__(self, seed: Sequence[int], device: torch.device | str, source: str | None = None) -> None:
        self.device = torch.device(device)
        self.source = source or ("numpy" if self.device.type == "cpu" else "torch")
        if self.source not in RANDOM_BITS_SOURCES:
            raise ValueError(f"source must be one of {RANDOM_BITS_SOURCES}, not {self.source!r}")
        if self.source == "numpy" and self.device.type != "cpu":
            raise ValueError(f"numpy's random bits are for a CPU, not {self.device}")
        words = [int(k) % (1 << 64) for k in seed]
        self.bit_generator = np.random.SFC64(np.random.SeedSequence(words)) if self.source == "numpy" else None
        self.generator = None
        if self.source == "torch":
            self.generator = torch.Generator(self.device).manual_seed(
                int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0]) >> 1)

    def words_into(self, noise: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
        """Fill `noise` (int32) with words in [0, 65536); `draws` (int64, at least a quarter of noise's length) is
        scratch for the torch source."""
        size = noise.numel()
        if self.bit_generator is not None:
            raw = self.bit_generator.random_raw((size + 3) // 4).view(np.uint16)[:size]
            return noise.copy_(torch.from_numpy(raw))  # zero-extended: uint16 -> int32
        part = draws[: (size + 3) // 4].random_(-(1 << 63), None, generator=self.generator)
        return noise.copy_(part.view(torch.int16)[:size]).bitwise_and_(0xFFFF)  # sign-extended, then the low 16


_HIGH_HALF = 1 if sys.byteorder == "little" else 0  # which int16 of an int32 holds its high 16 bits


def stochastic_round_to_bf16(x: torch.Tensor, bits: RandomBits, out: torch.Tensor | None = None,
                             scratch: RoundingScratch | None = None) -> torch.Tensor:
    """`x` (fp32) rounded to bf16 up or down at random, up with probability (x - lower) / (upper - lower), where lower
    and upper are the bf16 neighbours around x in magnitude: add 16 uniform random low bits (`bits`) to the fp32 bit
    pattern, then keep the high 16 bits (truncation toward zero: a bf16 is the high half of the fp32 it rounds to).
    Unbiased: E[result] = x. Finite inputs only. `out`: a contiguous bf16 tensor of x's shape to write into
    (returned); `scratch`: buffers to reuse.

    Cost: the random bits are most of it; the work runs a chunk of `scratch.chunk` elements at a time, so its three
    passes (the words, their sum with the bit patterns, the high halves) stay in cache. 135M weights: 0.086-0.094 s,
    against 0.12-0.15 s with torch's CPU generator and five passes, 0.31 s with one 16-bit draw per element over
    whole tensors, 0.02 s for a plain cast (AMD EPYC Zen 5, 2 threads; docs/engine.md)."""
    pattern = x.detach().to(torch.float32).contiguous().view(-1).view(torch.int32)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if not out.is_contiguous() or out.dtype != torch.bfloat16 or out.shape != x.shape:
        raise ValueError(f"stochastic_round_to_bf16: out must be a contiguous bf16 tensor of shape {tuple(x.shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    halves = out.view(-1).view(torch.int16)
    scratch = scratch or RoundingScratch(x.device, min(ROUNDING_CHUNK, max(pattern.numel(), 4)))
    for start in range(0, pattern.numel(), scratch.chunk):
        size = min(scratch.chunk, pattern.numel() - start)
        noise = bits.words_into(scratch.noise[:size], scratch.draws).add_(pattern[start:start + size])
        halves[start:start + size].copy_(noise.view(torch.int16)[_HIGH_HALF::2])
    return out


ROUNDINGS = ("nearest", "stochastic")


class MasterWeights:
    """fp32 masters (`masters`, a copy of the model) of a model whose parameters compute in `dtype`."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, rounding: str = "nearest", seed: int = 0) -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, not {rounding!r}")
        self.stochastic = rounding == "stochastic" and dtype == torch.bfloat16
        self.seed = seed
        self.scratch: RoundingScratch | None = None
        self.masters = copy.deepcopy(model)  # fp32: the same names, the same ties
        cast_parameters(model, dtype)
        self.pairs = list(zip(model.parameters(), self.masters.parameters(), strict=True))
        self.kept: dict[nn.Parameter, torch.Tensor] = {}  # each master's fp32 gradient buffer, once allocated
        self.written: set[nn.Parameter] = set()  # the masters a micro-batch of this step has reached
        self.keep_buffers = self.pairs[0][1].device.type == "cpu" if self.pairs else False
        for param, master in self.pairs:
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._to_master(master))

    def _to_master(self, master: nn.Parameter) -> Any:
        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            if master in self.written:
                assert master.grad is not None  # written this step
                master.grad.add_(param.grad)
            else:
                buffer = self.kept.get(master)
                if buffer is None:
                    buffer = self.kept[master] = param.grad.float()
                else:
                    buffer.copy_(param.grad)
                master.grad = buffer
                self.written.add(master)
            param.grad = None
        return hook

    def masters_with_grads(self) -> None:
        """Before the optimizer step: a master that no micro-batch of this step reached has no gradient (its kept
        buffer holds an earlier step's), so the optimizer skips it as it would after zero_grad(set_to_none=True)."""
        for master in self.kept:
            if master not in self.written:
                master.grad = None

    def end_step(self) -> None:
        """After the optimizer step (in place of zero_grad): on a CPU the next backward copies into the kept buffers;
        elsewhere the gradients are freed (zero_grad(set_to_none=True))."""
        self.written.clear()
        if not self.keep_buffers:
            for master in self.kept:
                master.grad = None
            self.kept.clear()

    @torch.no_grad()
    def sync_to_model(self, step: int, trainable_only: bool = True) -> None:
        """Round the masters into the compute parameters: the trainable ones after optimizer step `step` (the count
        of steps taken, which seeds stochastic rounding), all of them after a checkpoint load
        (`trainable_only=False`)."""
        device = self.pairs[0][1].device  # the draws are made where the weights live (a CUDA generator on a GPU)
        bits = RandomBits((self.seed, step), device) if self.stochastic else None
        for param, master in self.pairs:
            if bits is not None and param.requires_grad:
                stochastic_round_to_bf16(master, bits, out=param.data, scratch=self._scratch())
            elif param.requires_grad or not trainable_only:
                param.copy_(master)

    def _scratch(self) -> RoundingScratch:
        """Stochastic rounding's buffers, made once (12 MiB)."""
        if self.scratch is None:
            self.scratch = RoundingScratch(self.pairs[0][1].device)
        return self.scratch
