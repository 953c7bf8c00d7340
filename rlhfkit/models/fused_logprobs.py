"""Log-probs of chosen tokens and entropies of ``softmax(logits / temperature)``, fused and chunked.

For logits ``x`` (rows ``[R, V]``, any float dtype) and ``z = x / T`` computed in float32 a few rows at a time:

    lse_r = logsumexp_v z_rv,      log p(y | r) = z_ry - lse_r,      H_r = lse_r - sum_v p_rv z_rv,   p = exp(z - lse)

Autograd through the plain formula keeps whole ``[R, V]`` float32 tensors (the upcast logits, the temperature
quotient, the softmax) alive from the forward to the backward and allocates several more in the backward. This
`torch.autograd.Function` keeps only the input logits (which the model produced anyway) and ``[R]``-sized statistics
(``lse_r`` and ``S_r = sum_v p_rv z_rv``), and recomputes each chunk's softmax in the backward:

    dL/dz_rv = -c_r p_rv + sum_{pairs (r, y = v)} g_lp  -  g_H_r p_rv (z_rv - S_r),     dL/dx = dL/dz / T

where ``c_r`` is the sum of the log-prob gradients ``g_lp`` of every (row, label) pair read at row ``r`` (a packed
row's shared prompt position serves several responses) and ``g_H_r`` is the entropy's gradient. (``dH/dz_k =
p_k - d/dz_k sum_v p_v z_v = p_k - (p_k + p_k z_k - p_k S) = -p_k (z_k - S)``.) Results are float32 (log-prob
differences feed ``exp(log p - log p_old)``; bf16 would round them to ~3 digits; float64 for float64 logits); the
gradient has the logits' dtype. Only one chunk of ``[rows, V]`` float32 temporaries exists at a time, in the forward
and in the backward; the one ``[R, V]`` tensor the backward allocates is the gradient itself. ``-inf`` logits
(banned tokens) have ``p = 0`` and add nothing to ``S`` or to the gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

# float32 elements per chunk: 2 MiB on a CPU (stays in cache across the passes over a chunk), more on a GPU (fewer
# kernel launches). Forward + backward with the entropy over 388 rows of SmolLM2's 49,152 bf16 logits (AMD EPYC Zen 5,
# 2 threads): 37 ms in chunks of 2 MiB, 55 ms in chunks of 4 MiB; 57-90 ms before the forward shared one exp between
# the log-normaliser and the entropy.
_CHUNK_ELEMENTS = {"cpu": 1 << 19}
_CHUNK_ELEMENTS_DEFAULT = 1 << 24


def default_chunk_rows(vocab: int, device: torch.device) -> int:
    """Rows of ``[rows, vocab]`` float32 computed at a time on `device`."""
    return max(1, _CHUNK_ELEMENTS.get(device.type, _CHUNK_ELEMENTS_DEFAULT) // max(vocab, 1))


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 logits (the results' dtype)."""
    return torch.promote_types(logits.dtype, torch.float32)


class _ChunkBuffers:
    """Float32 buffers of one chunk (``[chunk_rows, V]`` each), allocated once per pass and reused by every chunk
    instead of fresh temporaries per chunk, whose page faults cost more than the arithmetic on a CPU. Forward +
    backward with the entropy over 484 rows of 49,152 bf16 logits (AMD EPYC Zen 5, native bf16, 2 threads, medians
    of 10, alternating): 72.5 ms with fresh temporaries, 60.3 ms with these under glibc's default malloc; 42 ms either
    way once `rlhfkit.engine.host_memory` keeps freed memory in the process (as rlhfkit's CPU processes do)."""

    def __init__(self, logits: torch.Tensor, chunk_rows: int) -> None:
        rows = min(chunk_rows, logits.shape[0])
        shape = (rows, logits.shape[1])
        self.floats = [torch.empty(shape, dtype=compute_dtype(logits), device=logits.device) for _ in range(2)]
        self.mask = torch.empty(shape, dtype=torch.bool, device=logits.device)

    def tempered(self, logits: torch.Tensor, start: int, stop: int, temperature: float, own: bool) -> torch.Tensor:
        """``logits[start:stop] / temperature`` in the compute dtype (the same values as upcasting everything first):
        in the first buffer, or with `own` False a view of `logits` where that needs no arithmetic (the caller then
        only reads it)."""
        chunk = logits[start:stop]
        if not own and temperature == 1.0 and chunk.dtype == self.floats[0].dtype:
            return chunk
        z = self.floats[0][: stop - start].copy_(chunk)
        return z.div_(temperature) if temperature != 1.0 else z

    def second(self, rows: int) -> torch.Tensor:
        return self.floats[1][:rows]


def _finite_(z: torch.Tensor) -> torch.Tensor:
    """``z`` with ``-inf`` raised to the dtype's lowest finite value, in place: ``e * z`` for ``0 <= e <= 1`` is then 0
    where a banned token has ``e = 0`` (not ``0 * -inf = nan``), and every finite logit is unchanged."""
    return z.clamp_(min=torch.finfo(z.dtype).min)


def _finite(z: torch.Tensor, p: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``z`` with 0 where ``p == 0``, in place (a banned token's term is then 0 whatever it is multiplied by); `mask`:
    a bool buffer of z's shape."""
    return torch.where(torch.gt(p, 0, out=mask), z, torch.zeros((), dtype=z.dtype, device=z.device), out=z)


class _LogProbsAndEntropy(torch.autograd.Function):
    """(log p of each (row, label) pair [M], entropy of each row [R] or nothing), see the module docstring."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor, temperature: float,
                with_entropy: bool, chunk_rows: int) -> Any:
        num_rows, dtype = logits.shape[0], compute_dtype(logits)
        lse = torch.empty(num_rows, dtype=dtype, device=logits.device)
        mean_z = torch.empty(num_rows, dtype=dtype, device=logits.device) if with_entropy else None
        buffers = _ChunkBuffers(logits, chunk_rows)
        for start in range(0, num_rows, chunk_rows):
            stop = min(start + chunk_rows, num_rows)
            z = buffers.tempered(logits, start, stop, temperature, own=mean_z is not None)
            if mean_z is None:
                lse[start:stop] = torch.logsumexp(z, dim=-1)
                continue
            # one exp for both: e = exp(z - max), lse = max + log sum e, S = sum e z / sum e
            top = z.amax(-1, keepdim=True).clamp_(min=torch.finfo(dtype).min)  # a row of -inf stays finite here
            e = torch.sub(z, top, out=buffers.second(stop - start)).exp_()
            total = e.sum(-1)
            lse[start:stop] = top.squeeze(-1) + total.log()
            mean_z[start:stop] = (e.mul_(_finite_(z))).sum(-1) / total
        picked = logits[rows, labels].to(dtype)
        if temperature != 1.0:
            picked = picked / temperature
        log_probs = picked - lse[rows]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, rows, labels, lse, mean_z)
        ctx.temperature, ctx.chunk_rows = temperature, chunk_rows
        if mean_z is None:
            return log_probs
        return log_probs, lse - mean_z

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        logits, rows, labels, lse, mean_z = ctx.saved_tensors
        grad_lp = grads[0]
        grad_h = grads[1] if len(grads) > 1 else None
        if grad_lp is None and grad_h is None:
            return None, None, None, None, None, None
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows
        num_rows, dtype = logits.shape[0], compute_dtype(logits)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        # c_r: the summed log-prob gradients of the pairs read at row r; the pairs sorted by row so each chunk finds
        # its own with two binary searches.
        coef = None
        if grad_lp is not None:
            grad_lp = grad_lp.to(dtype)
            coef = torch.zeros(num_rows, dtype=dtype, device=logits.device).index_add_(0, rows, grad_lp)
            order = torch.argsort(rows, stable=True)
            sorted_rows, sorted_labels, sorted_grads = rows[order], labels[order], grad_lp[order]
            starts = torch.arange(0, num_rows, chunk_rows, device=rows.device)
            bounds = torch.searchsorted(sorted_rows, torch.cat([starts, starts.new_tensor([num_rows])])).tolist()
        buffers = _ChunkBuffers(logits, chunk_rows)
        for k, start in enumerate(range(0, num_rows, chunk_rows)):
            stop = min(start + chunk_rows, num_rows)
            z = buffers.tempered(logits, start, stop, temperature, own=grad_h is not None)
            p = torch.sub(z, lse[start:stop, None], out=buffers.second(stop - start)).exp_()
            if grad_h is not None:  # -(c_r + g_H_r (z - S_r)), built in z's own memory
                assert mean_z is not None  # saved whenever the entropy is an output
                scale = _finite(z, p, buffers.mask[: stop - start]).sub_(mean_z[start:stop, None])
                scale.mul_(grad_h[start:stop, None].to(dtype).neg())
                if coef is not None:
                    scale.sub_(coef[start:stop, None])
                g = p.mul_(scale)
            else:
                assert coef is not None
                g = p.mul_(coef[start:stop, None].neg())
            if coef is not None:
                lo, hi = bounds[k], bounds[k + 1]
                g.index_put_((sorted_rows[lo:hi] - start, sorted_labels[lo:hi]), sorted_grads[lo:hi], accumulate=True)
            if temperature != 1.0:
                g.div_(temperature)
            grad[start:stop] = g
        return grad, None, None, None, None, None


def pair_log_probs_and_entropy(logits: torch.Tensor, rows: torch.Tensor, labels: torch.Tensor, *,
                               temperature: float = 1.0, with_entropy: bool = False, chunk_rows: int | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits[r] / T)[y]`` for each pair ``(r, y)`` of `rows` and `labels` ([M] each), float32 [M], and
    with `with_entropy` the entropy ``H_r`` of every row of `logits` ([R, V]), float32 [R] (differentiable; detach it
    where it is only a metric). One pass over the logits in chunks of `chunk_rows` rows (default: a few MiB of
    float32); gradients per the module docstring."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got {tuple(logits.shape)}")
    if rows.shape != labels.shape or rows.dim() != 1:
        raise ValueError(f"rows {tuple(rows.shape)} and labels {tuple(labels.shape)} must be equal 1-D shapes")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    num_rows, vocab = logits.shape
    if rows.numel():
        bad = (labels < 0) | (labels >= vocab) | (rows < 0) | (rows >= num_rows)
        if bool(bad.any()):
            raise ValueError(f"(row, label) pairs outside [0, {num_rows}) x [0, {vocab}): "
                             f"{torch.stack([rows[bad], labels[bad]], -1)[:8].tolist()}")
    chunk = chunk_rows if chunk_rows is not None else default_chunk_rows(vocab, logits.device)
    out = _LogProbsAndEntropy.apply(logits, rows.long(), labels.long(), float(temperature), with_entropy, chunk)
    if with_entropy:
        return out[0], out[1]
    return out, None


def token_log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                                with_entropy: bool = False, ignore_index: int = -100, chunk_rows: int | None = None,
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(logits / T)[..., label]`` float32 of shape ``labels.shape`` (``logits``: ``labels.shape + [V]``),
    0.0 where the label is `ignore_index`; with `with_entropy` the entropy of every position (ignored ones included),
    float32 of the same shape. Contiguous logits are read in place (no copy); see `pair_log_probs_and_entropy`."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    vocab = logits.shape[-1]
    flat_labels = labels.reshape(-1)
    kept = (flat_labels != ignore_index).nonzero().squeeze(-1)
    picked, entropy = pair_log_probs_and_entropy(logits.reshape(-1, vocab), kept, flat_labels[kept],
                                                 temperature=temperature, with_entropy=with_entropy,
                                                 chunk_rows=chunk_rows)
    log_probs = torch.zeros(flat_labels.shape, dtype=picked.dtype, device=logits.device).index_put(
        (kept,), picked).reshape(labels.shape)
    return log_probs, (entropy.reshape(labels.shape) if entropy is not None else None)
