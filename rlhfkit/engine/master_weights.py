"""Half-precision compute weights with fp32 master weights, for a model that trains on one rank.

The model's parameters are cast to the compute dtype once and stay there: every forward and backward runs on them
without a cast. The fp32 masters live in a structural copy of the model (`masters`, same parameter names and ties),
which is what the optimizer steps, the checkpoints save and load, the EMA follows and the HF folder is written from,
so resume stays exact and updates far below the half precision's resolution still accumulate:

    backward:            each parameter's gradient (compute dtype) is added to its master's fp32 `.grad` as soon
                         as it is accumulated (a post-accumulate hook), so micro-batches sum in fp32
    optimizer step:      on the masters (clip, AdamW, ...): `masters_with_grads()` first (a master no micro-batch
                         reached has no gradient, as with set_to_none), `end_step()` after, instead of zero_grad
    sync_to_model():     param = round_to_dtype(master), after every step and every checkpoint load (a CPU step
                         of torch's fused AdamW with stochastic rounding does both in one pass instead:
                         rlhfkit.engine.adamw_round)

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
import functools
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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


ROUNDING_CHUNK = 1 << 20  # elements per pass of the torch source: its working set (12 MiB) stays in cache
PARALLEL_MIN = 1 << 16  # tensors at least this large are rounded by every thread, in contiguous parts


class RoundingScratch:
    """What `stochastic_round_to_bf16` reuses across calls on one device: the torch source's buffers (12 MiB at the
    default chunk), made on first use, and the counter source's threads (`threads`, default torch's intra-op count)."""

    def __init__(self, device: torch.device | str, chunk: int = ROUNDING_CHUNK, threads: int | None = None) -> None:
        self.device, self.chunk = torch.device(device), chunk
        self.threads = max(1, threads or torch.get_num_threads())
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pool: ThreadPoolExecutor | None = None

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(draws, noise): int64 scratch for 64-bit draws (a quarter of a chunk) and the chunk's int32 words."""
        if self._buffers is None:
            self._buffers = (torch.empty((self.chunk + 3) // 4, dtype=torch.int64, device=self.device),
                             torch.empty(self.chunk, dtype=torch.int32, device=self.device))
        return self._buffers

    def run(self, calls: Sequence[Callable[[], None]]) -> None:
        """Run `calls` at once, at most one per thread: the first on the calling thread, the others on the pool's
        (the kernels release the GIL); return when all are done."""
        if self._pool is None and len(calls) > 1:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="stochastic-rounding")
        pending = [self._pool.submit(call) for call in calls[1:]] if self._pool is not None else []
        if calls:
            calls[0]()
        for done in pending:
            done.result()


RANDOM_BITS_SOURCES = ("counter", "torch")
# SplitMix64's increment (the golden ratio) and its two multipliers: the counter stream's constants, for every kernel
# that computes its words (here and rlhfkit.engine.adamw_round)
_SPLITMIX64 = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


class RandomBits:
    """A stream of uniform random 16-bit words for stochastic rounding, seeded by non-negative integers; each call
    of `stochastic_round_to_bf16` takes the next `x.numel()` words of it, in order.

    `source` "counter" (the default on a CPU): word p of the stream is the top 16 bits of SplitMix64's output for the
    state `key + p * 0x9E3779B97F4A7C15` (`key` from the seed), computed where it is used, fused with the rounding
    into one pass over the weights (a numba kernel, every thread on its own part): no stored draws, and the words
    do not depend on how the work is split. 135M weights in 0.032-0.037 s per optimizer step against 0.082-0.087 s
    for numpy's SFC64 draws added in three passes (AMD EPYC Zen 5, 2 threads). "torch" (the default elsewhere): a
    torch generator on the device (Philox on CUDA), four words from each 64-bit draw."""

    def __init__(self, seed: Sequence[int], device: torch.device | str, source: str | None = None) -> None:
        self.device = torch.device(device)
        self.source = source or ("counter" if self.device.type == "cpu" else "torch")
        if self.source not in RANDOM_BITS_SOURCES:
            raise ValueError(f"source must be one of {RANDOM_BITS_SOURCES}, not {self.source!r}")
        if self.source == "counter" and self.device.type != "cpu":
            raise ValueError(f"the counter source computes its words on a CPU, not on {self.device}")
        words = [int(k) % (1 << 64) for k in seed]
        state = int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0])
        self.key, self.position = state, 0  # the counter source: the stream's key and the next word's index
        self.generator = None
        if self.source == "torch":
            self.generator = torch.Generator(self.device).manual_seed(state >> 1)

    def round_into(self, pattern: torch.Tensor, halves: torch.Tensor, scratch: RoundingScratch) -> None:
        """halves[i] = high 16 bits of (pattern[i] + the stream's next word), for flat int32 `pattern` (fp32 bit
        patterns) and int16 `halves` (the bf16 result's bits)."""
        size = pattern.numel()
        if self.source == "counter":
            _counter_round(pattern, halves, self.key, self.position, scratch)
            self.position += size
            return
        draws, noise = scratch.buffers()
        for start in range(0, size, scratch.chunk):
            part = min(scratch.chunk, size - start)
            bits = draws[: (part + 3) // 4].random_(-(1 << 63), None, generator=self.generator)
            words = noise[:part].copy_(bits.view(torch.int16)[:part]).bitwise_and_(0xFFFF)  # the low 16, unsigned
            halves[start:start + part].copy_(words.add_(pattern[start:start + part]).view(torch.int16)[_HIGH_HALF::2])


_HIGH_HALF = 1 if sys.byteorder == "little" else 0  # which int16 of an int32 holds its high 16 bits


def _counter_round(pattern: torch.Tensor, halves: torch.Tensor, key: int, position: int,
                   scratch: RoundingScratch) -> None:
    """The counter source's rounding (`RandomBits`), split over `scratch.threads` threads for large tensors."""
    kernel = _counter_kernel()
    source = pattern.numpy().view(np.uint32)
    target = halves.numpy().view(np.uint16)
    size, parts = source.size, scratch.threads if source.size >= PARALLEL_MIN else 1
    bounds = [size * i // parts for i in range(parts + 1)]
    work: list[tuple[Any, ...]] = [(source[a:b], target[a:b], np.uint64(key), np.uint64(position + a))
                                   for a, b in zip(bounds, bounds[1:])]
    scratch.run([functools.partial(kernel, *args) for args in work])


@functools.cache
def _counter_kernel() -> Any:
    """The compiled kernel (numba; cached on disk, so a new process loads it instead of compiling)."""
    try:
        import numba
    except ImportError as err:  # a dependency of rlhfkit (pyproject.toml)
        raise ImportError("stochastic rounding on a CPU needs numba (pip install numba), or pass "
                          "--master_weights_rounding nearest") from err
    golden, mix1, mix2 = (np.uint64(c) for c in _SPLITMIX64)

    @numba.njit(nogil=True, cache=True, error_model="numpy")
    def counter_round(source: Any, target: Any, key: Any, first: Any) -> None:  # pragma: no cover (compiled)
        size, i = np.uint64(source.size), np.uint64(0)
        while i < size:  # an unsigned index: no negative-index wraparound, so LLVM vectorizes the loop
            z = key + (first + i) * golden
            z = (z ^ (z >> np.uint64(30))) * mix1
            z = (z ^ (z >> np.uint64(27))) * mix2  # SplitMix64's last step (z ^= z >> 31) keeps the top 16 bits
            target[i] = np.uint16((source[i] + np.uint32(z >> np.uint64(48))) >> np.uint32(16))
            i += np.uint64(1)

    return counter_round


def stochastic_round_to_bf16(x: torch.Tensor, bits: RandomBits, out: torch.Tensor | None = None,
                             scratch: RoundingScratch | None = None) -> torch.Tensor:
    """`x` (fp32) rounded to bf16 up or down at random, up with probability (x - lower) / (upper - lower), where lower
    and upper are the bf16 neighbours around x in magnitude: add 16 uniform random low bits (`bits`) to the fp32 bit
    pattern, then keep the high 16 bits (truncation toward zero: a bf16 is the high half of the fp32 it rounds to).
    Unbiased: E[result] = x. Finite inputs only. `out`: a contiguous bf16 tensor of x's shape to write into
    (returned); `scratch`: what to reuse across calls (`RoundingScratch`).

    Cost, 135M weights (AMD EPYC Zen 5, 2 threads; docs/engine.md): 0.032-0.037 s with the counter source (one fused
    pass; the kernel alone 0.023 s on one thread), against 0.082-0.094 s for numpy's SFC64 draws in three passes,
    0.12-0.15 s for torch's CPU generator and five passes, 0.31 s for one 16-bit draw per element over whole tensors;
    a plain cast is 0.016 s."""
    pattern = x.detach().to(torch.float32).contiguous().view(-1).view(torch.int32)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if not out.is_contiguous() or out.dtype != torch.bfloat16 or out.shape != x.shape:
        raise ValueError(f"stochastic_round_to_bf16: out must be a contiguous bf16 tensor of shape {tuple(x.shape)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    scratch = scratch or RoundingScratch(x.device, min(ROUNDING_CHUNK, max(pattern.numel(), 4)))
    bits.round_into(pattern, out.view(-1).view(torch.int16), scratch)
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
                stochastic_round_to_bf16(master, bits, out=param.data, scratch=self.rounding_scratch())
            elif param.requires_grad or not trainable_only:
                param.copy_(master)

    def rounding_scratch(self) -> RoundingScratch:
        """Stochastic rounding's buffers, made once (12 MiB)."""
        if self.scratch is None:
            self.scratch = RoundingScratch(self.pairs[0][1].device)
        return self.scratch
