"""Context parallel cost in ppo: one actor worker's log-prob pass and policy step (`rlhfkit.rl.worker.ModelWorker`, the
code the Ray actor runs) with --ring_attn_size 2 (2 ranks x 1 thread, each sequence split in two) beside 1 rank (2
threads, the whole sequence), on the same rows (long prompt + response, fp32).

    .venv/bin/python benchmarks/ring_ppo.py [--pretrain DIR] [--rows 2] [--prompt 1536] [--response 512] [--reps 3]

Without --pretrain it builds the tiny test model (rlhfkit.models.tiny). Reports the median of `--reps` repetitions
after a warm-up (the log-prob pass and the policy step), the policy loss of each (they must agree) and each run's
peak resident memory of its largest process (ru_maxrss of each rank). Writes benchmarks/results/ring_ppo.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def child(rank: int, world: int, port: int, model: str, rows: int, prompt: int, response: int, reps: int,
          out: str) -> None:
    import torch

    from rlhfkit.cli.ppo import GROUPS
    from rlhfkit.config.parse import config_to_dict, flags_to_argv, parse_config
    from rlhfkit.rl.experience import build_experience
    from rlhfkit.rl.worker import ModelWorker

    flags = {"pretrain": model, "prompt_data": "p", "remote_rm_url": "builtin:format", "init_kl_coef": 0.0,
             "micro_train_batch_size": rows, "micro_rollout_batch_size": rows, "ring_attn_size": world,
             "param_dtype": "fp32"}
    cfg = {**config_to_dict(parse_config("ppo", GROUPS, flags_to_argv(flags))),
           "torch_threads_per_worker": 2 // world}
    actor = ModelWorker("actor", cfg, rank, world, "127.0.0.1", port)
    actor.init_model(model, True, 100, 1e-6)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 1000, (prompt,), generator=g).tolist() for _ in range(rows)]
    responses = [torch.randint(100, 1000, (response,), generator=g).tolist() for _ in range(rows)]
    exp = build_experience(prompts, responses, [[-1.0] * response] * rows, list(range(rows)), 0)
    exp.advantages = torch.randn(exp.action_mask.shape, generator=g)
    batch = exp.tensors()
    tokens = float(exp.action_mask.sum())
    timings: dict[str, list[float]] = {"log_probs": [], "policy_step": []}
    loss = 0.0
    for rep in range(reps + 1):
        began = time.perf_counter()
        actor.log_probs(batch)
        lp = time.perf_counter() - began
        began = time.perf_counter()
        result = actor.train_policy_step(batch, tokens)
        step = time.perf_counter() - began
        if rep == 0:
            loss = result.get("policy_loss", 0.0) / tokens
            continue
        timings["log_probs"].append(lp)
        timings["policy_step"].append(step)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(f"{out}.{rank}").write_text(json.dumps({"timings": timings, "first_policy_loss": loss, "peak_rss_mib": peak}))


def run(world: int, args: argparse.Namespace, model: str, tmp: str) -> dict:
    from rlhfkit.engine.distributed import free_port

    port = free_port()
    out = f"{tmp}/w{world}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(2 // world)}
    procs = [subprocess.Popen([sys.executable, __file__, "--child", str(rank), str(world), str(port), model,
                               str(args.rows), str(args.prompt), str(args.response), str(args.reps), out], env=env)
             for rank in range(world)]
    if any(p.wait() for p in procs):
        raise SystemExit(f"a world-{world} rank failed")
    ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(world)]
    record = ranks[0]
    record["median_s"] = {k: statistics.median(v) for k, v in record["timings"].items()}
    record["peak_rss_mib"] = max(r["peak_rss_mib"] for r in ranks)  # the largest process of the run
    return record


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        a = sys.argv[2:]
        child(int(a[0]), int(a[1]), int(a[2]), a[3], int(a[4]), int(a[5]), int(a[6]), int(a[7]), a[8])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--pretrain", default=None)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=1536)
    parser.add_argument("--response", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    from machine import machine_line, machine_record

    with tempfile.TemporaryDirectory() as tmp:
        model = args.pretrain
        if model is None:
            from rlhfkit.models.tiny import build_tiny_causal_lm

            model = build_tiny_causal_lm(f"{tmp}/tiny")
        one = run(1, args, model, tmp)
        ring = run(2, args, model, tmp)
    record = {"machine": machine_record("fp32"), "pretrain": args.pretrain or "tiny", "rows": args.rows,
              "prompt": args.prompt, "response": args.response, "one_rank": one, "ring_2": ring}
    print(machine_line(record["machine"]))
    for name, r in (("1 rank x 2 threads", one), ("ring 2 x 1 thread", ring)):
        print(f"{name:20s} log-probs {r['median_s']['log_probs']:.2f} s  policy step "
              f"{r['median_s']['policy_step']:.2f} s  first policy loss {r['first_policy_loss']:.6f}  "
              f"runs {json.dumps(r['timings'])}")
    print(f"peak RSS of the largest process: 1 rank {one['peak_rss_mib']:.0f} MiB, "
          f"ring 2 {ring['peak_rss_mib']:.0f} MiB")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ring_ppo.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
