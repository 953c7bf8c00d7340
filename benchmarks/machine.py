"""What every benchmark records beside its numbers: the CPU (model, torch capability), the measured matmul ceilings
and the precision `auto` picks there, so a figure is never read without the machine it came from."""

from __future__ import annotations

import platform

import torch


def machine_record(param_dtype: str = "auto") -> dict:
    """CPU model and capability, torch version and threads, fp32/bf16 matmul GFLOP/s, what `param_dtype` resolves to."""
    from rlhfkit.engine.precision import resolve_precision

    device = "cuda" if torch.cuda.is_available() else "cpu"
    choice = resolve_precision(param_dtype, device)
    return {"device": device, "device_name": choice.device_name, "capability": choice.capability,
            "native_bf16": choice.native_bf16, "fp32_gflops": choice.fp32_gflops, "bf16_gflops": choice.bf16_gflops,
            "precision": choice.dtype, "precision_reason": choice.reason, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version()}


def machine_line(record: dict) -> str:
    """One line for the top of a benchmark's table."""
    return (f"{record['device_name']} [{record['capability']}], {record['threads']} threads; matmul fp32 "
            f"{record['fp32_gflops']} / bf16 {record['bf16_gflops']} GFLOP/s; precision {record['precision']} "
            f"({record['precision_reason']})")
