"""Precision on this machine: fp32 and bf16 matmul rates at 1 and all threads, and the embedded SmolLM2-135M's
forward and backward at both precisions, with the dtype `--param_dtype auto` picks here and why.

    .venv/bin/python benchmarks/precision.py [--batch 8] [--tokens 64]

A bf16 backward on a CPU without native bf16 takes minutes (emulated bf16, ~1 GFLOP/s): it is estimated from the
forward and the matmul rates instead of run, and marked so. Prints a table, writes benchmarks/results/precision.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from machine import machine_line, machine_record

from rlhfkit.engine.precision import measure_matmul_gflops

RESULTS = Path(__file__).parent / "results"


def model_seconds(dtype: torch.dtype, batch: int, tokens: int, backward: bool) -> tuple[float, float | None]:
    """(forward s, backward s) of the 135M at `dtype` (autocast over fp32 weights, as the trainer's mixed precision)."""
    from rlhfkit.models.loading import load_causal_lm, resolve_pretrain

    model = load_causal_lm(resolve_pretrain("embedded:smollm2-135m-instruct"))
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens))
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        model(input_ids=ids[:1, :8]).logits.sum().backward()  # warm-up
        model.zero_grad()
        began = time.perf_counter()
        loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        forward = time.perf_counter() - began
    if not backward:
        return forward, None
    began = time.perf_counter()
    loss.backward()
    return forward, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    machine = machine_record()
    threads = torch.get_num_threads()
    rates = {}
    for n in sorted({1, threads}):
        torch.set_num_threads(n)
        rates[n] = {name: round(measure_matmul_gflops(dtype, size=1024), 2)
                    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    torch.set_num_threads(threads)
    native = machine["native_bf16"]
    model = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        forward, backward = model_seconds(dtype, args.batch, args.tokens, backward=native or name == "fp32")
        estimated = backward is None
        if estimated:  # backward ~ 2x the forward's FLOPs at the same (emulated) rate
            backward = 2 * forward
        model[name] = {"forward_s": round(forward, 3), "backward_s": round(backward, 3),
                       "backward_estimated": estimated}
    print(machine_line(machine))
    print("\nmatmul 1024x1024 (GFLOP/s)\nthreads     fp32      bf16")
    for n, r in rates.items():
        print(f"{n:<7} {r['fp32']:>8.1f} {r['bf16']:>9.1f}")
    print(f"\nSmolLM2-135M, {args.batch} x {args.tokens} tokens, {threads} threads (s)\ndtype   forward  backward")
    for name, r in model.items():
        note = "  (estimated: 2 x forward; not run)" if r["backward_estimated"] else ""
        print(f"{name:<6} {r['forward_s']:>8.2f} {r['backward_s']:>9.2f}{note}")
    record = {"machine": machine, "matmul_1024_gflops": rates, "model_135m": model, "batch": args.batch,
              "tokens": args.tokens}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "precision.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {RESULTS / 'precision.json'}")


if __name__ == "__main__":
    main()
