"""AdamW and stochastic rounding in one pass over the weights (fp32 masters on a CPU, bf16 compute weights).

After torch's fused AdamW has stepped the fp32 masters, `MasterWeights.sync_to_model` reads every master again to
round it into the bf16 weight the forward uses: a second pass over 540 MB for 135M weights. Here each weight's update
and its rounding are one loop (a numba kernel over pieces of 1M weights, each thread on a contiguous run of pieces):
the master is read once, updated, and its stochastic rounding written with the counter stream's word at the very
position `sync_to_model` would give it (`rlhfkit.engine.master_weights.RandomBits`), so the bf16 weights are those
of an AdamW step followed by the rounding. The optimizer stays a `torch.optim.AdamW`: its parameter groups (lr from
the schedule, weight decay per group) are read at every step and its state (`step`, `exp_avg`, `exp_avg_sq`) is
torch's, so checkpoints, resume and every other path are unchanged.

AdamW, as torch.optim.AdamW computes it (float32 arithmetic; the scalars computed in float64, then float32):

    g = grad / grad_scale                     (grad_scale: the folded clip's divisor, `clip_divisor`; else 1)
    p = p * (1 - lr * weight_decay)
    m = m + (1 - beta1) * (g - m)
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

It agrees with torch's fused AdamW to float32 rounding (tests/engine/test_adamw_round.py). Used where the optimizer
is torch's fused AdamW without amsgrad or maximize and the masters round stochastically from the counter source
(`fuses_adamw_and_rounding`); anything else steps and rounds in two passes as before.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlhfkit.engine.master_weights import _SPLITMIX64, RandomBits, RoundingScratch, stochastic_round_to_bf16
from rlhfkit.engine.optim import takes_grad_scale

if TYPE_CHECKING:
    from rlhfkit.engine.master_weights import MasterWeights


def fuses_adamw_and_rounding(optimizer: torch.optim.Optimizer, master: MasterWeights | None) -> bool:
    """Whether `adamw_step_and_round` can stand for `optimizer.step()` then `master.sync_to_model`: torch's fused
    AdamW (no amsgrad, maximize, capturable or differentiable) over fp32 masters on a CPU that round stochastically
    with the counter source."""
    if master is None or not master.stochastic or not takes_grad_scale(optimizer) or not master.pairs:
        return False
    if master.pairs[0][1].device.type != "cpu":  # on a CPU the rounding draws from the counter source
        return False
    return all(not group.get("amsgrad") and not group.get("maximize") and not group.get("capturable")
               and not group.get("differentiable")
               and all(p.dtype == torch.float32 and p.is_contiguous() for p in group["params"])
               for group in optimizer.param_groups)


PIECE = 1 << 20  # elements per kernel call: the step's work is cut into pieces of at most this many


@torch.no_grad()
def adamw_step_and_round(optimizer: torch.optim.AdamW, master: MasterWeights, step: int,
                         grad_scale: torch.Tensor | None = None) -> None:
    """One AdamW step of the masters with their stochastic rounding into the compute weights, in one pass
    (module docstring); the same as `optimizer.step()` (its `grad_scale` attribute set to `grad_scale`) then
    `master.sync_to_model(step)`. A master without a gradient this step is only rounded, as there (by
    `stochastic_round_to_bf16`, at its place in the stream). The work of the others is cut
    into pieces of at most `PIECE` weights, and each of the scratch's threads takes a contiguous run of pieces of
    about equal size: one hand-off per thread and step, however many tensors the model has."""
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    bits = RandomBits((master.seed, step), "cpu")
    scale = np.float32(1.0 if grad_scale is None else float(grad_scale))
    adamw = _adamw_round_kernel()
    pieces: list[tuple[Any, tuple[Any, ...], int]] = []  # (kernel, its arguments, weights)
    position = 0
    for param, weight in master.pairs:
        if not param.requires_grad:
            continue
        group = group_of.get(id(weight))
        if group is None or weight.grad is None:  # only rounded, with its words of the stream, as sync_to_model does
            bits.position = position
            stochastic_round_to_bf16(weight, bits, out=param.data, scratch=master.rounding_scratch())
        else:
            target = param.data.view(-1).view(torch.int16).numpy().view(np.uint16)
            state = optimizer.state[weight]
            if not state:  # as torch's AdamW starts a parameter's state
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
            state["step"] += 1
            t = float(state["step"])
            lr, (beta1, beta2) = float(group["lr"]), group["betas"]
            scalars = (np.float32(1.0 - lr * group["weight_decay"]), np.float32(1.0 - beta1), np.float32(beta2),
                       np.float32(1.0 - beta2), np.float32(lr / (1.0 - beta1 ** t)),
                       np.float32((1.0 - beta2 ** t) ** 0.5), np.float32(group["eps"]), scale)
            arrays = [x.detach().view(-1).numpy() for x in (weight, weight.grad, state["exp_avg"],
                                                             state["exp_avg_sq"])] + [target]
            for lo in range(0, target.size, PIECE):
                hi = min(lo + PIECE, target.size)
                pieces.append((adamw, (*(a[lo:hi] for a in arrays), *scalars, np.uint64(bits.key),
                                       np.uint64(position + lo)), hi - lo))
        position += weight.numel()
    _run_balanced(pieces, master.rounding_scratch())


def _run_balanced(pieces: list[tuple[Any, tuple[Any, ...], int]], scratch: RoundingScratch) -> None:
    """Run the pieces, cut into `scratch.threads` contiguous runs of about equal weight counts, one per thread
    (`RoundingScratch.run`)."""
    total = sum(size for _, _, size in pieces)
    runs: list[list[tuple[Any, tuple[Any, ...], int]]] = [[] for _ in range(scratch.threads)]
    done = 0
    for piece in pieces:
        runs[min(done * scratch.threads // max(total, 1), scratch.threads - 1)].append(piece)
        done += piece[2]

    def run(batch: list[tuple[Any, tuple[Any, ...], int]]) -> None:
        for kernel, args, _ in batch:
            kernel(*args)
    scratch.run([functools.partial(run, batch) for batch in runs if batch])


@functools.cache
def _adamw_round_kernel() -> Any:
    """The compiled kernel (numba; cached on disk). `bits_of` reinterprets a float32 as its uint32 bit pattern (an
    LLVM bitcast, so the loop still vectorizes)."""
    try:
        import numba
        from llvmlite import ir
        from numba.core import types
        from numba.extending import intrinsic
    except ImportError as err:  # a dependency of rlhfkit (pyproject.toml)
        raise ImportError("stochastic rounding on a CPU needs numba (pip install numba), or pass "
                          "--master_weights_rounding nearest") from err

    @intrinsic
    def bits_of(typingctx: Any, value: Any) -> Any:  # pragma: no cover (compiled)
        if value != types.float32:
            return None

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(types.float32), codegen

    golden, mix1, mix2 = (np.uint64(c) for c in _SPLITMIX64)

    @numba.njit(nogil=True, cache=True, error_model="numpy")
    def adamw_round(param: Any, grad: Any, exp_avg: Any, exp_avg_sq: Any, target: Any, decay: Any, one_minus_beta1: Any,
                    beta2: Any, one_minus_beta2: Any, step_size: Any, correction2_sqrt: Any, eps: Any, grad_scale: Any,
                    key: Any, first: Any) -> None:  # pragma: no cover (compiled)
        size, i = np.uint64(param.size), np.uint64(0)
        while i < size:  # an unsigned index, as in the rounding kernel: the loop vectorizes
            g = grad[i] / grad_scale
            m = exp_avg[i]
            m = m + one_minus_beta1 * (g - m)
            v = beta2 * exp_avg_sq[i] + one_minus_beta2 * (g * g)
            p = param[i] * decay - step_size * (m / (np.sqrt(v) / correction2_sqrt + eps))
            param[i], exp_avg[i], exp_avg_sq[i] = p, m, v
            z = key + (first + i) * golden  # the counter stream's word for this weight (master_weights.RandomBits)
            z = (z ^ (z >> np.uint64(30))) * mix1
            z = (z ^ (z >> np.uint64(27))) * mix2
            target[i] = np.uint16((bits_of(p) + np.uint32(z >> np.uint64(48))) >> np.uint32(16))
            i += np.uint64(1)

    return adamw_round
