"""Weight sync seconds, Ray object store vs gloo broadcast, for the embedded SmolLM2-135M-Instruct into one vLLM
engine at the precision `auto` picks on this machine (the trainer's fp32 master weights cast to it before they
are sent: 538 MB in fp32, half in bf16).

Two senders, each transport timed `--repeats` times after one warm-up sync:
- driver: this process holds the full model and syncs it (`sync_weights` / `WeightBroadcaster.sync`): the
  transport alone.
- actor: the RL loop's path, `push_actor_weights` from a 1-rank FSDP2 actor group (`ray`: rank 0 returns its state
  dict to the driver, which buckets it into the object store; `gloo`: rank 0 broadcasts each bucket itself).

    .venv/bin/python benchmarks/weight_sync.py [--repeats 3] [--bucket_mb 64]

Prints a table and writes benchmarks/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from machine import machine_line, machine_record

from rlhfkit.rl.worker import ModelWorker

RESULTS = Path(__file__).parent / "results"
MODEL = "embedded:smollm2-135m-instruct"
TRANSPORTS = ("ray", "gloo")


def time_driver(engines: list[Any], path: str, bucket_bytes: int, repeats: int) -> dict[str, list[float]]:
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.rollout.weight_broadcast import WeightBroadcaster
    from rlhfkit.rollout.weight_sync import named_weights_for_sync, sync_weights

    model = load_causal_lm(path)
    broadcaster = WeightBroadcaster(engines, "gloo")
    syncs = {"ray": lambda: sync_weights(engines, named_weights_for_sync(model), bucket_bytes=bucket_bytes),
             "gloo": lambda: broadcaster.sync(named_weights_for_sync(model), bucket_bytes)}
    seconds = {name: [fn().seconds for _ in range(repeats + 1)][1:] for name, fn in syncs.items()}
    broadcaster.close()
    return seconds


def time_actor(engines: list[Any], path: str, bucket_mb: int, repeats: int) -> dict[str, list[float]]:
    import time

    from rlhfkit.config.parse import parse_config
    from rlhfkit.rl.group import ModelGroup, make_placement_group
    from rlhfkit.rl.weight_push import push_actor_weights

    cfg = parse_config("ppo", None, ["--pretrain", path, "--prompt_data", "unused", "--remote_rm_url", "x"])
    actor = ModelGroup("actor", cfg, make_placement_group(1, 1, 0.25), 1)  # the typed config, as rl/setup.py
    actor.call(ModelWorker.init_model, path, False)
    seconds: dict[str, list[float]] = {}
    for transport in TRANSPORTS:
        run_cfg = SimpleNamespace(weight_sync_bucket_mb=bucket_mb)
        plan = SimpleNamespace(transport=transport, adapter_sync=False, model_path=None)
        times = []
        for _ in range(repeats + 1):
            began = time.perf_counter()  # SyncStats of the ray path miss the gather and the hop to the driver
            push_actor_weights(actor, engines, run_cfg, plan)
            times.append(time.perf_counter() - began)
        seconds[transport] = times[1:]
    actor.shutdown()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket_mb", type=int, default=64)
    args = parser.parse_args()
    import ray

    from rlhfkit.launch.ray_cluster import WORKER_ENV
    from rlhfkit.models.loading import resolve_pretrain
    from rlhfkit.rollout.vllm_engine import create_vllm_engines

    path = resolve_pretrain(MODEL)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": WORKER_ENV})
    machine = machine_record()
    engine_dtype = "bfloat16" if machine["precision"] == "bf16" else "float32"  # what auto gives a run here
    engines = create_vllm_engines(1, path, dtype=engine_dtype, max_model_len=512, cpu_kv_cache_bytes=256 << 20)
    result: dict[str, Any] = {"machine": machine, "model": MODEL, "engines": 1, "engine_dtype": engine_dtype,
                              "bucket_mb": args.bucket_mb, "repeats": args.repeats}
    result["driver"] = time_driver(engines, path, args.bucket_mb << 20, args.repeats)
    result["actor"] = time_actor(engines, path, args.bucket_mb, args.repeats)
    ray.shutdown()
    print(machine_line(machine))
    print(f"\nweight sync, {MODEL}, fp32 weights -> 1 {engine_dtype} vLLM engine, {args.bucket_mb} MiB buckets "
          f"(s, mean of {args.repeats})")
    print(f"{'sender':<8} {'ray':>8} {'gloo':>8} {'gloo/ray':>9}")
    for sender in ("driver", "actor"):
        means = {t: statistics.mean(result[sender][t]) for t in TRANSPORTS}
        result[f"{sender}_mean_s"] = means
        print(f"{sender:<8} {means['ray']:>8.2f} {means['gloo']:>8.2f} {means['gloo'] / means['ray']:>9.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "weight_sync.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
