"""`make bench-peers`: TRL and rlhfkit on the same workloads in one sitting, alternating, repeated (issue #11).

    make bench-peers                                   # every workload, the defaults below
    make bench-peers ARGS="--workloads grpo,sft --repeats 3"
    .venv/bin/python benchmarks/peers.py --trl_python .venv-peers/bin/python --quick --workloads sft

Each run is its own subprocess: TRL in .venv-peers (benchmarks/peers_trl.py), rlhfkit in .venv
(benchmarks/peers_rlhfkit.py), on the same data files, model folder (the embedded SmolLM2-135M-Instruct), batch
shape, lr and precision (what `--param_dtype auto` picks on this machine, forced on both sides). For every repeat
and workload both sides run back to back, TRL first on even repeats and rlhfkit first on odd ones. Per run: the
median step time after the warm-up step(s); per workload: the median of those over repeats, the speed ratio
TRL s/step / rlhfkit s/step (> 1: rlhfkit is faster), peak memory per process and rlhfkit's stage split.
Workloads (docs/benchmarks.md says what each configures on both sides): grpo, len-32, len-128, len-512
(`sweep` = the three), forced-256, forced-512 (`forced` = the two: every response exactly that long on both sides),
sft, dpo, ppo (rlhfkit only: TRL 1.16 has no PPOTrainer).
Prints a table and writes benchmarks/results/peers.json (rewritten after every run, so a stopped sitting keeps
what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import machine_line, machine_record
from peers_stats import compare, format_table, run_order, summarize_runs

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results" / "peers.json"
MODEL = "embedded:smollm2-135m-instruct"
SYSTEM = "You are a helpful assistant."  # as rlhfkit.cli.demo.SYSTEM: replaces the long default system prompt
STORY = ("Write a long, detailed story about {topic} in which someone collects {a} apples and then {b} more. "
         "Describe every place they visit. End with the total number of apples.")
TOPICS = ["a lighthouse keeper", "a lost robot", "a mountain village", "a travelling circus", "a deep-sea diver",
          "an old library", "a desert caravan", "a space station"]
GRPO = {"kind": "grpo", "prompts": 8, "samples": 4, "batch": 32, "micro": 8, "lr": 1e-6, "kv_cache_mb": 1024}
WORKLOADS: dict[str, dict[str, Any]] = {
    "grpo": {**GRPO, "data": "arithmetic", "new_tokens": 32, "timed": 2},
    "len-32": {**GRPO, "data": "story", "new_tokens": 32, "timed": 2},
    "len-128": {**GRPO, "data": "story", "new_tokens": 128, "timed": 1},
    "len-512": {**GRPO, "data": "story", "new_tokens": 512, "timed": 1, "warmup": 0, "kv_cache_mb": 2048},
    # the paper's regime: every response exactly this long on both sides (EOS masked until then: rlhfkit
    # --generate_min_len, TRL generation_kwargs min_new_tokens), so both generate the same number of tokens
    "forced-256": {**GRPO, "data": "story", "new_tokens": 256, "min_new_tokens": 256, "timed": 2,
                   "kv_cache_mb": 2048},
    "forced-512": {**GRPO, "data": "story", "new_tokens": 512, "min_new_tokens": 512, "timed": 1, "warmup": 1,
                   "kv_cache_mb": 2048},
    "sft": {"kind": "sft", "data": "sft", "batch": 8, "micro": 8, "max_len": 128, "lr": 1e-5, "timed": 3},
    "dpo": {"kind": "dpo", "data": "dpo", "batch": 8, "micro": 8, "max_len": 128, "lr": 1e-6, "beta": 0.1,
            "timed": 3},
    "ppo": {"kind": "ppo", "data": "arithmetic", "prompts": 16, "samples": 1, "batch": 16, "micro": 8,
            "new_tokens": 32, "lr": 1e-6, "kl_coef": 0.01, "lam": 0.95, "kv_cache_mb": 1024, "timed": 1},
}
ALIASES = {"sweep": ["len-32", "len-128", "len-512"], "forced": ["forced-256", "forced-512"]}
QUICK_TOKENS = {"len-32": 16, "len-128": 32, "len-512": 64, "forced-256": 32, "forced-512": 64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="grpo,sweep,sft,dpo,ppo",
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (sweep = len-32,len-128,len-512; "
                             "forced = forced-256,forced-512)")
    parser.add_argument("--repeats", type=int, default=2, help="sittings of every workload on both sides")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per run (default per workload: grpo, len-32 2; sft, dpo 3; len-128, "
                             "len-512, ppo 1)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="steps run first and dropped from the medians (default 1; len-512 0: its one step "
                             "includes the warm-up on both sides)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 1 repeat, no warm-up, 1 step, sweep at 16/32/64 tokens")
    parser.add_argument("--trl_python", default=str(REPO / ".venv-peers" / "bin" / "python"))
    parser.add_argument("--rlhfkit_python", default=sys.executable)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output", default=str(RESULTS))
    parser.add_argument("--work_dir", default=None,
                        help="keep every run's folder (spec, log.txt, run dir) here; default: a temporary folder")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.warmup, args.steps = 1, 0, 1
    return args


def expand(names: str) -> list[str]:
    out: list[str] = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        for item in ALIASES.get(name, [name]):
            if item not in WORKLOADS:
                raise SystemExit(f"unknown workload {item!r}: choose from {', '.join([*WORKLOADS, *ALIASES])}")
            if item not in out:
                out.append(item)
    return out


def story_rows(n: int, seed: int) -> list[dict[str, Any]]:
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        text = STORY.format(topic=rng.choice(TOPICS), a=a, b=b)
        rows.append({"input": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
                     "label": str(a + b)})
    return rows


def sft_rows(n: int, seed: int) -> list[dict[str, str]]:
    """Arithmetic questions answered by counting up: 20-60 response tokens, under 128 with the chat template."""
    from rlhfkit.data.synthetic import arithmetic_rows

    rows = []
    for row in arithmetic_rows(n, seed=seed, low=1, high=12):
        a, b = (int(x) for x in row["input"].split("What is ")[1].split("?")[0].split(" + "))
        counting = ", ".join(str(a + k) for k in range(1, b + 1))
        rows.append({"input": row["input"], "output": f"Start at {a} and count up {b}: {counting}. "
                                                      f"So {a} + {b} = {a + b}."})
    return rows


def write_data(kind: str, count: int, folder: Path, seed: int) -> str:
    from rlhfkit.data.synthetic import arithmetic_rows, preference_rows, write_jsonl

    makers = {"arithmetic": lambda: arithmetic_rows(count, seed=seed, system=SYSTEM),
              "story": lambda: story_rows(count, seed), "sft": lambda: sft_rows(count, seed),
              "dpo": lambda: preference_rows(count, seed)}
    return write_jsonl(makers[kind](), folder / f"{kind}-{count}.jsonl")


def reward_model(folder: Path) -> str:
    """The 135M backbone with a fresh scalar head (both sides' PPO reward model and critic init)."""
    from rlhfkit.models.loading import load_scalar_model, load_tokenizer, resolve_pretrain, save_hf

    path = resolve_pretrain(MODEL)
    return save_hf(load_scalar_model(path, init_from_causal=True), load_tokenizer(path), str(folder / "rm"))


def build_specs(args: argparse.Namespace, names: list[str], work: Path, precision: str) -> dict[str, dict]:
    from rlhfkit.models.loading import resolve_pretrain

    model = resolve_pretrain(MODEL)
    specs = {}
    for name in names:
        w = dict(WORKLOADS[name])
        timed = args.steps if args.steps is not None else w.pop("timed")
        warmup = args.warmup if args.warmup is not None else w.pop("warmup", 1)
        w.pop("timed", None)
        w.pop("warmup", None)
        if args.quick and name in QUICK_TOKENS:
            w["new_tokens"] = QUICK_TOKENS[name]
            if "min_new_tokens" in w:
                w["min_new_tokens"] = w["new_tokens"]
            w["note"] = f"--quick: {w['new_tokens']} new tokens at most, not {name.split('-')[-1]}"
        steps = warmup + timed
        count = steps * (w.get("prompts") or w["batch"])
        spec = {**w, "name": name, "model": model, "steps": steps, "warmup": warmup, "seed": args.seed,
                "precision": precision, "data": write_data(w["data"], count, work / "data", args.seed)}
        if w["kind"] == "ppo":
            spec["reward_model"] = reward_model(work)
        specs[name] = spec
    return specs


def launch(side: str, spec: dict[str, Any], args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One run in its own subprocess; its result file, plus the wall time the subprocess took."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "work": str(folder)}
    (folder / "spec.json").write_text(json.dumps(spec, indent=2))
    python, script = ((args.trl_python, "peers_trl.py") if side == "trl"
                      else (args.rlhfkit_python, "peers_rlhfkit.py"))
    python = os.path.abspath(python) if os.sep in python else python  # the run's cwd is its folder (not a symlink
    # resolve: a venv's python must stay the venv's)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if side == "trl":  # rlhfkit's pure reward only; rlhfkit itself is not installed there
        env["PYTHONPATH"] = str(REPO)
    began = time.perf_counter()
    with open(folder / "log.txt", "w") as log:
        proc = subprocess.run([python, str(HERE / script), str(folder / "spec.json"), str(folder / "result.json")],
                              stdout=log, stderr=subprocess.STDOUT, cwd=str(folder), env=env, check=False)
    wall = time.perf_counter() - began
    path = folder / "result.json"
    result = json.loads(path.read_text()) if path.exists() else {
        "error": f"exit code {proc.returncode}, no result", "step_median": None}
    if result.get("error"):
        result["log_tail"] = (folder / "log.txt").read_text(errors="replace")[-3000:]
    for heavy in ("model", "ckpt", "trl-out"):  # saved weights: 0.5 GB a run
        shutil.rmtree(folder / heavy, ignore_errors=True)
    return {**result, "wall_seconds": wall, "returncode": proc.returncode, "folder": str(folder)}


def notes_for(name: str, runs: dict[str, list[dict]]) -> list[str]:
    notes = [f"{side}: {r['missing']}" for side in runs for r in runs[side][:1] if r.get("missing")]
    for side, items in runs.items():
        notes += [f"{side} failed: {str(r['error']).strip().splitlines()[-1]}" for r in items if r.get("error")]
    return notes


def record(results: dict[str, Any], name: str, spec: dict[str, Any], side: str, run: dict[str, Any]) -> None:
    entry = results["workloads"].setdefault(name, {"precision": spec["precision"], "spec": spec,
                                                   "runs": {"trl": [], "rlhfkit": []}})
    entry["runs"][side].append(run)
    entry["trl_missing"] = any(r.get("missing") for r in entry["runs"]["trl"])
    entry["summary"] = {s: summarize_runs(entry["runs"][s]) for s in entry["runs"]}
    entry["row"] = compare(entry["summary"])
    entry["notes"] = ([spec["note"]] if spec.get("note") else []) + notes_for(name, entry["runs"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    names = expand(args.workloads)
    machine = machine_record()
    print(machine_line(machine), flush=True)
    results: dict[str, Any] = {"machine": machine, "machine_line": machine_line(machine),
                               "precision": machine["precision"], "repeats": args.repeats,
                               "quick": args.quick, "workloads": {}, "order": []}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as scratch:
        tmp = args.work_dir or scratch
        specs = build_specs(args, names, Path(tmp), machine["precision"])
        for repeat, name, side in run_order(names, args.repeats):
            print(f"[{time.perf_counter() - began:6.0f} s] repeat {repeat + 1}/{args.repeats} {name}: {side}",
                  flush=True)
            run = launch(side, specs[name], args, Path(tmp) / f"r{repeat}-{name}-{side}")
            print(f"    {run.get('step_median') or '-'} s/step ({run['wall_seconds']:.0f} s wall)"
                  + (f" FAILED: {str(run['error']).strip().splitlines()[-1]}" if run.get("error") else ""),
                  flush=True)
            results["order"].append([repeat, name, side])
            record(results, name, specs[name], side, run)
            results["wall_seconds"] = time.perf_counter() - began
            out.write_text(json.dumps(results, indent=2, default=str))
    print("\n" + format_table(results))
    print(f"\n{results['wall_seconds']:.0f} s in all; wrote {out}")


if __name__ == "__main__":
    main()
