"""Tensor parallel cost: `rlhfkit sft` step time and peak memory per rank with --ds_tensor_parallel_size N (N ranks x
1 thread, every attention/MLP weight and the vocabulary split N ways) beside 1 rank (2 threads, whole weights), on
the same samples (--pretrain_mode, one sample per step, fp32). SmolLM2-135M has 9 query and 3 key/value heads, so
its tensor-parallel sizes are 1 and 3 (the default here); the tiny test Llama takes 2.

    .venv/bin/python benchmarks/tensor_parallel.py [--pretrain embedded:smollm2-135m-instruct] [--tp 3] [--tokens 256]

Reports the median step time over the steps after the first (warm-up), the first-step loss of each (they must
agree) and each run's peak resident memory of its largest process (ru_maxrss of the children). Writes
benchmarks/results/tensor_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from machine import machine_line, machine_record
from ring_attention import RESULTS, long_rows, run

from rlhfkit.models.loading import load_tokenizer, resolve_pretrain


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrain", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=3, help="ranks per tensor-parallel group (divides the heads)")
    args = parser.parse_args()
    path = resolve_pretrain(args.pretrain)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "long.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in long_rows(args.steps, args.tokens,
                                                                          load_tokenizer(path))))
        flags = {"pretrain": path, "dataset": str(data), "input_key": "input", "pretrain_mode": True,
                 "max_len": args.tokens, "train_batch_size": 1, "micro_train_batch_size": 1, "max_epochs": 1,
                 "learning_rate": 1e-5, "lr_warmup_ratio": 0.0, "param_dtype": "fp32", "save_steps": -1}
        one = run(1, 2, {**flags, "run_dir": f"{tmp}/one", "save_path": f"{tmp}/hf1"})
        tp = run(args.tp, 1, {**flags, "ds_tensor_parallel_size": args.tp, "run_dir": f"{tmp}/tp",
                              "save_path": f"{tmp}/hf2"})
    record = {"machine": machine_record("fp32"), "pretrain": args.pretrain, "tokens": args.tokens,
              "one_rank": one, "tp": tp, "ratio": tp["median_step_seconds"] / one["median_step_seconds"]}
    print(machine_line(record["machine"]))
    for name, r in (("1 rank x 2 threads", one), (f"tp {args.tp} x 1 thread", tp)):
        print(f"{name:20s} median step {r['median_step_seconds']:.2f} s  first loss {r['first_loss']:.5f}  "
              f"steps {[round(s, 2) for s in r['step_seconds']]}  peak RSS (largest process) "
              f"{r['peak_rss_mib_max_child']:.0f} MiB")
    print(f"tp {args.tp} / 1 rank step time: {record['ratio']:.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tensor_parallel.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
