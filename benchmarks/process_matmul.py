"""Does a Ray model worker compute as fast as a plain process? Matmul GFLOP/s, the AMX permission, the threads and the
allocator, measured in this process and in a Ray actor started as rlhfkit starts its model workers.

    .venv/bin/python benchmarks/process_matmul.py [--reps 5]

Why: on an Intel Xeon with AMX (2026-11-28) the demo's actor trained at about 1.7x the time per token of the same step
in one process (`benchmarks/train_step.py`), and its vLLM engine generated slower than Zen 5's. One candidate that a
plain process cannot show: Linux grants AMX to a process only on request (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, which
oneDNN makes on first use), and refuses it when a thread's alternate signal stack is too small for the AMX state;
bf16 matmuls then fall back to AVX512 at a fraction of the rate. This script reads, per process: the matmul rates of
the shapes a training step runs (SmolLM2-135M: 576 hidden, 1536 MLP, 600 packed tokens) and of the precision probe's
square, fp32 and (where native) bf16; whether AMX tile data is permitted (`ARCH_GET_XCOMP_PERM`, after the bf16
matmuls); torch's thread count, `OMP_NUM_THREADS`, `LD_PRELOAD` and whether tcmalloc or jemalloc is mapped.
The two processes take turns (one measurement each, alternating, `--reps` times; medians). Writes
benchmarks/results/process_matmul.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from machine import machine_line, machine_record

RESULTS = Path(__file__).parent / "results"
# (rows, inner, columns): the step's matmuls at the demo's size, and the probe's square
SHAPES = {"qkv 600x576x576": (600, 576, 576), "mlp 600x576x1536": (600, 576, 1536),
          "mlp-down 600x1536x576": (600, 1536, 576), "square 1024": (1024, 1024, 1024)}
ARCH_GET_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1022, 18, 158


def amx_permitted() -> bool | None:
    """Whether this process may use AMX tile data (Linux x86-64); None where that cannot be asked."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return None
    features = ctypes.c_uint64(0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(features)) != 0:
        return None
    return bool(features.value >> XFEATURE_XTILEDATA & 1)


def rate(shape: tuple[int, int, int], dtype: torch.dtype, seconds: float = 0.3) -> float:
    """The best GFLOP/s of one matmul of `shape` over about `seconds` (after an untimed call)."""
    m, k, n = shape
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    best, began = 0.0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * m * k * n / (time.perf_counter() - start) / 1e9)
    return best


def measure(dtypes: list[str]) -> dict[str, Any]:
    """This process's rates per dtype and shape, and its settings."""
    out: dict[str, Any] = {"pid": os.getpid(), "threads": torch.get_num_threads(),
                           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                           "LD_PRELOAD": os.environ.get("LD_PRELOAD", "")}
    out["rates"] = {dtype: {name: round(rate(shape, getattr(torch, dtype)), 1) for name, shape in SHAPES.items()}
                    for dtype in dtypes}
    out["amx_permitted"] = amx_permitted()  # after the bf16 matmuls, which make oneDNN ask for it
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    out["allocator"] = next((name for name in ("tcmalloc", "jemalloc") if name in maps), "libc")
    return out


class Worker:
    """A Ray actor that computes as a model worker does: a fraction of a CPU from Ray, then torch's threads set to
    the node's cores (`rlhfkit.engine.cpu_threads`, as `rlhfkit.rl.worker.ModelWorker` does)."""

    def __init__(self) -> None:
        from rlhfkit.engine.cpu_threads import set_cpu_threads

        set_cpu_threads(0, 1)

    def measure(self, dtypes: list[str]) -> dict[str, Any]:
        return measure(dtypes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    import ray

    from rlhfkit.engine.cpu_threads import set_cpu_threads

    record = machine_record()
    print(machine_line(record))
    dtypes = ["float32"] + (["bfloat16"] if record["native_bf16"] else [])
    set_cpu_threads(0, 1)
    temp = tempfile.mkdtemp(prefix="rk-ray-matmul-", dir="/tmp")
    ray.init(num_cpus=os.cpu_count(), _temp_dir=temp, include_dashboard=False, log_to_driver=False)
    try:
        worker: Any = ray.remote(Worker).options(num_cpus=0.25).remote()
        runs: dict[str, list[dict[str, Any]]] = {"process": [], "ray worker": []}
        for _ in range(args.reps):  # alternating
            runs["process"].append(measure(dtypes))
            runs["ray worker"].append(ray.get(worker.measure.remote(dtypes)))
    finally:
        ray.shutdown()
    rows = []
    for where, results in runs.items():
        last = results[-1]
        medians = {dtype: {name: statistics.median(r["rates"][dtype][name] for r in results) for name in SHAPES}
                   for dtype in dtypes}
        rows.append({"where": where, **{k: last[k] for k in ("threads", "OMP_NUM_THREADS", "LD_PRELOAD",
                                                             "allocator", "amx_permitted")}, "median_gflops": medians})
        print(f"\n{where}: {last['threads']} torch threads, OMP_NUM_THREADS={last['OMP_NUM_THREADS']}, allocator "
              f"{last['allocator']}, LD_PRELOAD={last['LD_PRELOAD'] or '-'}, AMX permitted: {last['amx_permitted']}")
        for dtype in dtypes:
            print(f"  {dtype:9s} " + "  ".join(f"{name} {value:7.1f}" for name, value in medians[dtype].items()))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "process_matmul.json").write_text(json.dumps({"machine": record, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
