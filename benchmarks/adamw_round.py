"""The optimizer step of a bf16 model with fp32 masters on a CPU, two ways: torch's fused AdamW then
`MasterWeights.sync_to_model` (two passes over the weights), and `rlhfkit.engine.adamw_round.adamw_step_and_round`
(one pass). SmolLM2-135M (the embedded model), stochastic rounding, a clip divisor as the engine folds it, random
gradients; alternating, medians after two warm-up rounds. Writes benchmarks/results/adamw_round.json.

    .venv/bin/python benchmarks/adamw_round.py [--rounds 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from machine import machine_line, machine_record

from rlhfkit.engine.adamw_round import adamw_step_and_round
from rlhfkit.engine.host_memory import retain_freed_host_memory
from rlhfkit.engine.master_weights import MasterWeights
from rlhfkit.engine.optim import build_optimizer
from rlhfkit.models.loading import load_causal_lm, resolve_pretrain

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    retain_freed_host_memory()  # as rlhfkit's CPU processes run (rlhfkit.engine.host_memory)
    record = machine_record()
    print(machine_line(record))
    model = load_causal_lm(resolve_pretrain("embedded:smollm2-135m-instruct"))
    master = MasterWeights(model, torch.bfloat16, rounding="stochastic", seed=1)
    optimizer = build_optimizer(master.masters, 8e-6, (0.9, 0.95), 0.0)
    for param in master.masters.parameters():
        param.grad = torch.randn_like(param) * 1e-3
    divisor = torch.tensor(1.3)

    def two_passes(step: int) -> None:
        optimizer.grad_scale = divisor  # type: ignore[attr-defined]  # as TrainEngine folds the clip
        optimizer.step()
        del optimizer.grad_scale  # type: ignore[attr-defined]
        master.sync_to_model(step)

    def one_pass(step: int) -> None:
        adamw_step_and_round(optimizer, master, step, grad_scale=divisor)

    times: dict[str, list[float]] = {"two passes": [], "one pass": []}
    step = 0
    for _ in range(args.rounds):
        for name, fn in (("two passes", two_passes), ("one pass", one_pass)):
            step += 1
            began = time.perf_counter()
            fn(step)
            times[name].append(time.perf_counter() - began)
    seconds = {name: round(statistics.median(t[2:]), 4) for name, t in times.items()}
    print(f"{sum(p.numel() for p in master.masters.parameters()) / 1e6:.0f}M weights: two passes "
          f"{seconds['two passes']:.4f} s, one pass {seconds['one pass']:.4f} s "
          f"({seconds['one pass'] / seconds['two passes']:.2f}x)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "adamw_round.json").write_text(json.dumps({"machine": record, "seconds": seconds}, indent=1))


if __name__ == "__main__":
    main()
