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

from ring_attention import one_rank_against_parallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrain", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=3, help="ranks per tensor-parallel group (divides the heads)")
    args = parser.parse_args()
    one_rank_against_parallel(args, f"tp {args.tp}", args.tp, {"ds_tensor_parallel_size": args.tp},
                              "tensor_parallel")


if __name__ == "__main__":
    main()
