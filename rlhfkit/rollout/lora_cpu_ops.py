"""A single-adapter fast path for vLLM 0.32's CPU LoRA ops (`--lora_sync adapter` on CPU engines).

vLLM's CPU backend applies LoRA through `PunicaWrapperCPU`, whose torch reference ops (`bgmv_shrink`,
`bgmv_expand`, `bgmv_expand_slice` in `vllm.lora.ops.torch_ops.lora_ops`) compute, for every token b,

    out[b, o] = sum_i x[b, i] * W[idx[b], o, i]

by gathering a copy of the adapter matrix per token (`W[idx]`, [tokens, out, in]) and an einsum. rlhfkit's engines
serve one adapter at a time (`max_loras=1`, every request carries it), so every token has the same index and the
same sum is one GEMM, ``out = x @ W[idx[0]].T``; the per-token path made generation ~3.4x slower (docs/models.md).
`install()` swaps in versions of the three ops that take the GEMM when all indices agree and otherwise fall back to
the per-token computation, with the same outputs written the same way (the same math; only the summation order
of floats may differ).
"""

from __future__ import annotations

import torch

_INSTALLED = False


def lora_matmul(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype
                ) -> torch.Tensor:
    """out[b] = W[indices[b]] @ x[b] for stacked adapter weights W ([slots, out, in] or [slots, 1, out, in])."""
    inputs = inputs.to(dtype=dtype)
    if indices.numel() > 0 and bool((indices == indices[0]).all()):
        weight = weights[indices[0]].to(dtype=dtype)
        if weight.dim() == 3:
            weight = weight.squeeze(0)
        return inputs @ weight.t()
    selected = weights[indices].to(dtype=dtype)
    if selected.dim() == 4:
        selected = selected.squeeze(dim=1)
    return torch.einsum("bi, boi -> bo", inputs, selected)


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    outputs = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    outputs = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = output_tensor.shape[0]
    if outputs.shape[0] == 1 and output_tensor.shape[0] != 1:
        limit = 1
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    outputs = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs[:]


def install() -> None:
    """Replace the three ops where vLLM's CPU LoRA path looks them up (the ops module, whose sgmv_* call them, and
    the CPU Punica wrapper, which imported them by name). Idempotent."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    ops = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}
    for module in (lora_ops, punica_cpu):
        for name, op in ops.items():  # a module attribute replaced by name: vLLM's callers look it up there
            setattr(module, name, op)
    _INSTALLED = True
