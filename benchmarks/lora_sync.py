"""LoRA weight sync, adapter-only vs merged (`ppo --lora_rank 8 --lora_sync adapter|merged`), for the embedded
SmolLM2-135M-Instruct with rank 8 on q/k/v/o, along the RL loop's path (`push_actor_weights` from a 1-rank FSDP2
LoRA actor), over both transports; plus what serving the adapter costs the engine at generation time.

Two vLLM engines at the precision `auto` picks here: a plain one (merged syncs) and one started with LoRA support
(`max_lora_rank` 8; adapter syncs). Each (mode, transport) is timed `--repeats` times after one warm-up sync
(wall seconds of `push_actor_weights`: the actor's gather, the hop, the engine's load). Generation: the same
prompts on both engines (the LoRA one with its adapter active; 8 sequences of 32 prompt + 32 new tokens),
`--repeats` alternating rounds after a warm-up one.

    .venv/bin/python benchmarks/lora_sync.py [--repeats 3]

Prints a table and writes benchmarks/results/lora_sync.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from machine import machine_line, machine_record

from rlhfkit.rl.worker import ModelWorker

RESULTS = Path(__file__).parent / "results"
MODEL = "embedded:smollm2-135m-instruct"
TRANSPORTS = ("ray", "gloo")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
RANK = 8
GEN_PROMPTS, GEN_SAMPLES, GEN_TOKENS = 4, 2, 32  # 8 sequences of 32 prompt + 32 new tokens


def lora_actor(path: str) -> Any:
    from rlhfkit.config.parse import parse_config
    from rlhfkit.rl.group import ModelGroup, make_placement_group

    cfg = parse_config("ppo", None, ["--pretrain", path, "--prompt_data", "unused", "--remote_rm_url", "x",
                                          "--lora_rank", str(RANK), "--target_modules", *TARGETS])
    actor = ModelGroup("actor", cfg, make_placement_group(1, 1, 0.25), 1)  # the typed config, as rl/setup.py
    actor.call(ModelWorker.init_model, path, True)
    return actor


def time_syncs(actor: Any, engines: dict[str, list[Any]], repeats: int) -> dict[str, Any]:
    from rlhfkit.rl.weight_push import push_actor_weights

    out: dict[str, Any] = {}
    for mode in ("merged", "adapter"):
        for transport in TRANSPORTS:
            cfg = SimpleNamespace(weight_sync_bucket_mb=64)
            plan = SimpleNamespace(transport=transport, adapter_sync=mode == "adapter", model_path=None)
            times, sent = [], 0
            for _ in range(repeats + 1):
                began = time.perf_counter()
                sent = push_actor_weights(actor, engines[mode], cfg, plan).bytes
                times.append(time.perf_counter() - began)
            out[f"{mode}/{transport}"] = {"bytes": sent, "seconds": times[1:]}
            print(f"sync {mode}/{transport}: {sent} bytes, {[round(t, 2) for t in times[1:]]} s", flush=True)
    return out


def time_generation(engines: dict[str, list[Any]], repeats: int) -> dict[str, list[float]]:
    import ray

    from rlhfkit.rollout.types import SamplingConfig

    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 4 for _ in range(GEN_PROMPTS)]
    sampling = SamplingConfig(n=GEN_SAMPLES, max_new_tokens=GEN_TOKENS, ignore_eos=True, seed=0)
    seconds: dict[str, list[float]] = {"merged": [], "adapter": []}
    for _ in range(repeats + 1):
        for mode in seconds:
            began = time.perf_counter()
            ray.get(engines[mode][0].generate.remote(prompts, sampling))
            seconds[mode].append(time.perf_counter() - began)
            print(f"generation {mode}: {seconds[mode][-1]:.2f} s", flush=True)
    return {mode: times[1:] for mode, times in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ray_temp_dir", default=None, help="Ray's temp folder (default: Ray's own)")
    args = parser.parse_args()
    import ray

    from rlhfkit.launch.ray_cluster import WORKER_ENV
    from rlhfkit.models.loading import resolve_pretrain
    from rlhfkit.rollout.vllm_engine import create_vllm_engines

    path = resolve_pretrain(MODEL)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": WORKER_ENV}, _temp_dir=args.ray_temp_dir)
    machine = machine_record()
    dtype = "bfloat16" if machine["precision"] == "bf16" else "float32"  # what auto gives a run here
    options = {"dtype": dtype, "max_model_len": 512, "cpu_kv_cache_bytes": 256 << 20}
    engines = {"merged": create_vllm_engines(1, path, **options),
               "adapter": create_vllm_engines(1, path, max_lora_rank=RANK, seed=42, **options)}
    actor = lora_actor(path)
    result: dict[str, Any] = {"machine": machine, "model": MODEL, "engine_dtype": dtype, "lora_rank": RANK,
                              "target_modules": TARGETS, "repeats": args.repeats}
    result["sync"] = time_syncs(actor, engines, args.repeats)
    result["generation_s"] = time_generation(engines, args.repeats)
    actor.shutdown()
    ray.shutdown()
    print(machine_line(machine))
    print(f"\nLoRA sync, {MODEL}, rank {RANK} on {'/'.join(TARGETS)}, 1 {dtype} vLLM engine "
          f"(s per sync: median of {args.repeats})")
    print(f"{'mode/transport':<16} {'MB sent':>9} {'s/sync':>8}")
    for key, row in result["sync"].items():
        row["median_s"] = statistics.median(row["seconds"])
        print(f"{key:<16} {row['bytes'] / 1e6:>9.2f} {row['median_s']:>8.2f}")
    gen = {mode: statistics.median(times) for mode, times in result["generation_s"].items()}
    print(f"\ngeneration, {GEN_PROMPTS} prompts x {GEN_SAMPLES} samples x {GEN_TOKENS} tokens (s, median): "
          f"plain engine {gen['merged']:.2f}, LoRA engine {gen['adapter']:.2f} ({gen['adapter'] / gen['merged']:.2f}x)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lora_sync.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
