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
update on in expectation. The draws come from a generator seeded by (`seed`, optimizer step), so a run and its
resume round identically. Frozen parameters are always rounded to nearest (they were cast once at the start).

FSDP2's `MixedPrecisionPolicy` computes the same arithmetic, but on one rank it pays per layer and per micro-batch:
a gather and a cast of every fp32 weight in every forward (and again in backward under zero stage 3) and a reduce of
every gradient. Here the cast happens once per optimizer step. Measured in `benchmarks/train_step.py` (docs/
benchmarks.md; AMD EPYC Zen 5 with native bf16, one sitting, alternating, medians of 5): the demo's policy step
4.03 s with FSDP2's policy, 3.41 s with this (fp32: 6.93 s).
Only floating-point *parameters* are cast, as FSDP2 does: buffers (a rotary embedding's `inv_freq`) stay fp32.
"""

from __future__ import annotations

import copy
from typing import Any

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


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator, out: torch.Tensor | None = None,
                             scratch: RoundingScratch | None = None) -> torch.Tensor:
    """`x` (fp32) rounded to bf16 up or down at random, up with probability (x - lower) / (upper - lower), where lower
    and upper are the bf16 neighbours around x in magnitude: add 16 uniform random low bits to the fp32 bit
    pattern, then drop the low 16 bits (truncation toward zero). Unbiased: E[result] = x. Finite inputs only.
    `out`: a contiguous bf16 tensor of x's shape to write into (returned); `scratch`: buffers to reuse.

    Cost: the random bits are most of it, so each draw of the generator (64 bits, full range) serves four
    elements, 16 bits each; and the work runs a chunk of `scratch.chunk` elements at a time, so its five passes
    stay in cache. 135M weights: 0.12 s, against 0.31 s for one 16-bit draw per element over whole tensors and
    0.02 s for a plain cast (AMD EPYC Zen 5, 2 threads; docs/engine.md)."""
    bits = x.detach().to(torch.float32).contiguous().view(-1).view(torch.int32)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if not out.is_contiguous() or out.dtype != torch.bfloat16 or out.shape != x.shape:
        raise ValueError(f"stochastic_round_to_bf16: out must be a contiguous bf16 tensor of shape {tuple(x.shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    flat = out.view(-1)
    scratch = scratch or RoundingScratch(x.device, min(ROUNDING_CHUNK, max(bits.numel(), 4)))
    for start in range(0, bits.numel(), scratch.chunk):
        size = min(scratch.chunk, bits.numel() - start)
        draws = scratch.draws[: (size + 3) // 4].random_(-(1 << 63), None, generator=generator)
        noise = scratch.noise[:size]
        noise.copy_(draws.view(torch.int16)[:size])  # sign-extended: the low 16 bits are the draw's
        noise.bitwise_and_(0xFFFF).add_(bits[start:start + size]).bitwise_and_(-65536)  # the cast below is exact
        flat[start:start + size].copy_(noise.view(torch.float32))
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
        generator = torch.Generator(device).manual_seed(self.seed * 1_000_003 + step) if self.stochastic else None
        for param, master in self.pairs:
            if generator is not None and param.requires_grad:
                stochastic_round_to_bf16(master, generator, out=param.data, scratch=self._scratch())
            elif param.requires_grad or not trainable_only:
                param.copy_(master)

    def _scratch(self) -> RoundingScratch:
        """Stochastic rounding's buffers, made once (12 MiB)."""
        if self.scratch is None:
            self.scratch = RoundingScratch(self.pairs[0][1].device)
        return self.scratch
