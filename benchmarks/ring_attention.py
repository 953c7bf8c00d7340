"""Context parallel cost: `rlhfkit sft` step time with --ring_attn_size 2 (2 ranks x 1 thread, each sequence split
in two) beside 1 rank (2 threads, the whole sequence), on the same ~2k-token samples (--pretrain_mode, one sample
per step, fp32).

    .venv/bin/python benchmarks/ring_attention.py [--pretrain embedded:smollm2-135m-instruct] [--tokens 2048]

Reports the median step time over the steps after the first (warm-up), the first-step loss of each (they must
agree) and each run's peak resident memory per rank (ru_maxrss of the children). Writes
benchmarks/results/ring_attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import machine_line, machine_record

from rlhfkit.config.parse import flags_to_argv
from rlhfkit.models.loading import load_tokenizer, resolve_pretrain

RESULTS = Path(__file__).parent / "results"
# a fresh wrapper per run: its children's ru_maxrss is the largest process of that run only
_PEAK = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
         "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
         "sys.exit(code)")
WORDS = ("alpha beta gamma delta river stone light cloud paper green quick model token ring attention "
         "sequence parallel chunk rank gather window").split()


def long_rows(n: int, tokens: int, tokenizer, seed: int = 0) -> list[dict]:
    """``n`` texts of about ``tokens`` tokens (random words), for --pretrain_mode."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(tokens))
        ids = tokenizer(text).input_ids[:tokens - 2]
        rows.append({"input": tokenizer.decode(ids)})
    return rows


def run(nproc: int, threads: int, flags: dict) -> dict:
    cmd = [sys.executable, "-c", _PEAK, sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "rlhfkit.cli.sft", *flags_to_argv(flags)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])
    peak_kib = int(done.stderr.rsplit("PEAK_RSS_KIB ", 1)[1].split()[0])
    rows = [json.loads(line) for line in (Path(flags["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    return {"ranks": nproc, "threads_per_rank": threads, "first_loss": steps[0]["train/loss"],
            "step_seconds": [r["train/step_seconds"] for r in steps],
            "median_step_seconds": statistics.median(r["train/step_seconds"] for r in steps[1:]),
            "peak_rss_mib_max_child": peak_kib / 1024}


def one_rank_against_parallel(args: argparse.Namespace, label: str, nproc: int, parallel_flags: dict,
                               result_name: str) -> None:
    """Run `rlhfkit sft` on the long rows twice (1 rank x 2 threads, then `nproc` ranks x 1 thread with
    `parallel_flags`), print both and write benchmarks/results/<result_name>.json."""
    path = resolve_pretrain(args.pretrain)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "long.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in long_rows(args.steps, args.tokens,
                                                                          load_tokenizer(path))))
        flags = {"pretrain": path, "dataset": str(data), "input_key": "input", "pretrain_mode": True,
                 "max_len": args.tokens, "train_batch_size": 1, "micro_train_batch_size": 1, "max_epochs": 1,
                 "learning_rate": 1e-5, "lr_warmup_ratio": 0.0, "param_dtype": "fp32", "save_steps": -1}
        one = run(1, 2, {**flags, "run_dir": f"{tmp}/one", "save_path": f"{tmp}/hf1"})
        other = run(nproc, 1, {**flags, **parallel_flags, "run_dir": f"{tmp}/other", "save_path": f"{tmp}/hf2"})
    record = {"machine": machine_record("fp32"), "pretrain": args.pretrain, "tokens": args.tokens,
              "one_rank": one, result_name: other,
              "ratio": other["median_step_seconds"] / one["median_step_seconds"]}
    print(machine_line(record["machine"]))
    for name, r in (("1 rank x 2 threads", one), (f"{label} x 1 thread", other)):
        print(f"{name:20s} median step {r['median_step_seconds']:.2f} s  first loss {r['first_loss']:.5f}  "
              f"steps {[round(s, 2) for s in r['step_seconds']]}  peak RSS (largest process) "
              f"{r['peak_rss_mib_max_child']:.0f} MiB")
    print(f"{label} / 1 rank step time: {record['ratio']:.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{result_name}.json").write_text(json.dumps(record, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrain", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    one_rank_against_parallel(parser.parse_args(), "ring 2", 2, {"ring_attn_size": 2}, "ring_attention")


if __name__ == "__main__":
    main()
