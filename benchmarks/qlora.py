"""QLoRA cost on this machine: one LoRA training step (forward, backward, AdamW) of SmolLM2-135M-Instruct with the base
in bitsandbytes NF4 (`--load_in_4bit`) vs fp32 (or bf16), and the memory the model takes.

    .venv/bin/python benchmarks/qlora.py                  # fp32 and nf4, each in its own process
    .venv/bin/python benchmarks/qlora.py --one bf16       # one configuration (bf16: only on a native-bf16 CPU;
                                                          # an AVX2 CPU emulates it, 100x slower)

Batch 4 x 128 tokens, LoRA rank 8 on all linear layers, 2 warm-up steps then the median of 5. `weights_mb`: bytes of
the model's parameters and buffers; `peak_rss_mb`: the process's peak resident memory (ru_maxrss; includes the
Python/torch runtime, about 500 MB). Wall times are indicative only when other jobs share the CPU.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def one(kind: str) -> dict:
    import torch

    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.models.lora import apply_lora

    torch.manual_seed(0)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    began = time.perf_counter()
    model = load_causal_lm("embedded:smollm2-135m-instruct", dtype=dtype, load_in_4bit=kind == "nf4",
                           compute_dtype=dtype)
    load_s = time.perf_counter() - began
    model = apply_lora(model, 8, 16)
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(100, 40000, (4, 128))
    times = []
    for _ in range(7):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return {"kind": kind, "step_s": round(statistics.median(times[2:]), 3), "load_s": round(load_s, 2),
            "weights_mb": round(weights / 2**20, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", choices=["fp32", "bf16", "nf4"])
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    for kind in ("fp32", "nf4"):
        done = subprocess.run([sys.executable, __file__, "--one", kind], capture_output=True, text=True, check=True)
        print(done.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
