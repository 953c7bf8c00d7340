"""Measure `rlhfkit dpo --ref_mode precompute` against `--ref_mode live` (the numbers in docs/methods.md).

    .venv/bin/python examples/dpo_ref_modes.py --pretrain embedded:smollm2-135m-instruct --pairs 32 --max_len 64
    .venv/bin/python examples/dpo_ref_modes.py --tiny            # a random-init tiny model (2 layers, hidden 64)

    .venv/bin/python examples/dpo_ref_modes.py --inprocess ...   # compute only, both modes in one process

Each mode runs as its own process (`--repeats` times, alternating, so background load hits both alike) on the same
synthetic pairs for `--epochs` epochs. Reported per run: the whole command's wall time, the reference precompute time
(from the run log), the summed optimizer-step time, the CPU time of the process (steadier than wall time on a shared
machine) and the final train loss (the two modes must agree).

`--inprocess` times only the work that differs, in one process, alternating the two modes `--repeats` times and
keeping the fastest of each (the least disturbed by other load): one epoch of training micro-steps (forward +
backward) with the reference forward inside each step (live) or with precomputed reference log-probs, plus the
one-off precompute pass over the data. Model loading is left out (each mode loads the reference once).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _children_cpu() -> float:
    """CPU seconds (user + system) used by finished child processes: less sensitive to other load than wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(mode: str, args: argparse.Namespace, model: str, data: str, root: Path, k: int) -> dict:
    run = root / f"{mode}-{k}"
    cmd = [sys.executable, "-m", "rlhfkit.cli.dpo", "--pretrain", model, "--dataset", data, "--prompt_key", "prompt",
           "--apply_chat_template", "--max_len", str(args.max_len), "--train_batch_size", str(args.batch),
           "--micro_train_batch_size", str(args.micro), "--max_epochs", str(args.epochs),
           "--learning_rate", "1e-6", "--ref_mode", mode, "--run_dir", str(run), "--save_path", str(run / "hf"),
           "--seed", "1"]
    began, cpu_before = time.perf_counter(), _children_cpu()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    wall, cpu = time.perf_counter() - began, _children_cpu() - cpu_before
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/step_seconds" in r]
    found = re.findall(r"log-probs precomputed for \d+ samples in ([0-9.]+)s", (run / "train.log").read_text())
    return {"mode": mode, "wall_s": wall, "cpu_s": cpu, "precompute_s": sum(map(float, found)),
            "steps_s": sum(r["train/step_seconds"] for r in train), "steps": len(train),
            "final_loss": train[-1]["train/loss"]}


def inprocess(args: argparse.Namespace, model_spec: str, rows: list[dict]) -> None:
    import torch

    from rlhfkit.models.loading import load_causal_lm, load_tokenizer
    from rlhfkit.trainers.dpo import collate_pairs, dpo_batch_loss
    from rlhfkit.trainers.pairs import preference_samples
    from rlhfkit.trainers.sequence_logps import sequence_sums

    tokenizer = load_tokenizer(model_spec)
    policy, ref = load_causal_lm(model_spec), load_causal_lm(model_spec).requires_grad_(False).eval()
    cfg = argparse.Namespace(prompt_key="prompt", chosen_key="chosen", rejected_key="rejected", input_template=None,
                             apply_chat_template=True, max_len=args.max_len)
    samples, _ = preference_samples(cfg, tokenizer, rows)
    chunks = [samples[i:i + args.micro] for i in range(0, len(samples), args.micro)]
    pad = tokenizer.pad_token_id

    def precompute() -> None:
        with torch.no_grad():
            for chunk in chunks:
                sums, _ = sequence_sums(ref, collate_pairs(chunk, pad))
                n = len(chunk)
                for s_, c, r in zip(chunk, sums[:n].tolist(), sums[n:].tolist()):
                    s_["ref_chosen_logp"], s_["ref_rejected_logp"] = c, r

    def epoch(live: bool) -> None:
        for chunk in chunks:
            loss, _ = dpo_batch_loss(policy, collate_pairs(chunk, pad), beta=0.1, ref_model=ref if live else None)
            loss.backward()
        policy.zero_grad(set_to_none=True)

    timings: dict[str, list[float]] = {"precompute pass": [], "epoch, precomputed ref": [], "epoch, live ref": []}
    for _ in range(args.repeats):
        for name, work in (("precompute pass", precompute), ("epoch, precomputed ref", lambda: epoch(False)),
                           ("epoch, live ref", lambda: epoch(True))):
            began = time.perf_counter()
            work()
            timings[name].append(time.perf_counter() - began)
    best = {k: min(v) for k, v in timings.items()}
    print(f"model={model_spec} pairs={len(samples)} max_len={args.max_len} micro={args.micro} "
          f"threads={torch.get_num_threads()} repeats={args.repeats} (fastest of each)")
    for name, value in best.items():
        print(f"  {name:<24} {value:7.2f}s   all: {[round(v, 2) for v in timings[name]]}")
    for epochs in (1, 2, 3):
        pre = best["precompute pass"] + epochs * best["epoch, precomputed ref"]
        live = epochs * best["epoch, live ref"]
        print(f"  {epochs} epoch(s): precompute {pre:7.2f}s   live {live:7.2f}s   live/precompute {live / pre:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrain", default="embedded:smollm2-135m-instruct")
    parser.add_argument("--tiny", action="store_true", help="use a freshly built tiny random-init model")
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--max_len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--inprocess", action="store_true", help="time the differing compute only, in this process")
    args = parser.parse_args()
    from rlhfkit.data.synthetic import preference_rows, write_jsonl

    if args.inprocess:
        with tempfile.TemporaryDirectory() as tmp:
            spec = args.pretrain
            if args.tiny:
                from rlhfkit.models.tiny import build_tiny_causal_lm

                spec = build_tiny_causal_lm(str(Path(tmp) / "tiny"))
            inprocess(args, spec, preference_rows(args.pairs, seed=1))
        return

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.pretrain
        if args.tiny:
            from rlhfkit.models.tiny import build_tiny_causal_lm

            model = build_tiny_causal_lm(str(root / "tiny"))
        data = write_jsonl(preference_rows(args.pairs, seed=1), root / "pairs.jsonl")
        results = [run_once(mode, args, model, data, root, k) for k in range(args.repeats)
                   for mode in ("precompute", "live")]
    print(f"model={model} pairs={args.pairs} max_len={args.max_len} batch={args.batch} micro={args.micro} "
          f"epochs={args.epochs}")
    for r in results:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    for mode in ("precompute", "live"):
        mine = [r for r in results if r["mode"] == mode]
        summary = {key: (min(r[key] for r in mine), statistics.median(r[key] for r in mine))
                   for key in ("wall_s", "cpu_s", "precompute_s", "steps_s")}
        print(f"{mode:>10}: " + ", ".join(f"{key} min {lo:.1f} median {mid:.1f}" for key, (lo, mid) in summary.items()))

if __name__ == "__main__":
    main()
