"""PPO step time with four models, per stage, for two placements side by side.

Actor, critic, reference and reward model are all the embedded SmolLM2-135M-Instruct (the reward model is the same
backbone with a fresh `score` head: untrained, which does not change the time; the critic starts from it). Two
layouts, each a fresh run of `rlhfkit ppo` in this process on one local Ray cluster:

  separate   every role in its own placement group, one vLLM engine of its own
  colocated  --colocate_all_models: every model and the engine on the actor's bundle (on CPU without sleep or
             offload: vLLM's sleep mode and the FSDP2 state offload are CUDA-only)

    .venv/bin/python benchmarks/ppo_step.py [--steps 2] [--layouts separate,colocated]

Configuration: 4 prompts x 4 samples, 32 new tokens, GAE, trainers (1 rank each) and vLLM engine at the
precision `auto` picks on this machine, with the IS correction. The first step includes warm-up; with --steps >= 2
the table is the mean of the later steps. Prints a table and writes benchmarks/results/ppo_step.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from machine import machine_line, machine_record

RESULTS = Path(__file__).parent / "results"
MODEL = "embedded:smollm2-135m-instruct"
STAGES = ("generation", "reward", "log_probs", "training", "weight_sync", "step")
LAYOUTS = {"separate": {}, "colocated": {"colocate_all_models": True}}
FLAGS = {"input_key": "input", "apply_chat_template": True, "advantage_estimator": "gae", "n_samples_per_prompt": 4,
         "rollout_batch_size": 4, "train_batch_size": 16, "micro_train_batch_size": 4, "micro_rollout_batch_size": 8,
         "generate_max_len": 32, "prompt_max_len": 128, "actor_learning_rate": 1e-6, "critic_learning_rate": 9e-6,
         "init_kl_coef": 0.01, "enable_vllm_is_correction": True, "vllm_kv_cache_mb": 256,
         "lr_warmup_ratio": 0.0, "seed": 0}


def reward_model(out: Path) -> str:
    """The 135M backbone with a fresh scalar head, saved as a reward-model folder."""
    from rlhfkit.models.loading import load_scalar_model, load_tokenizer, resolve_pretrain, save_hf

    path = resolve_pretrain(MODEL)
    return save_hf(load_scalar_model(path, init_from_causal=True), load_tokenizer(path), str(out))


def run_layout(name: str, steps: int, rm: str, tmp: Path) -> dict:
    from rlhfkit.config.parse import parse_config
    from rlhfkit.data.synthetic import arithmetic_rows, write_jsonl
    from rlhfkit.rl.ppo_trainer import train_ppo

    out = tmp / name
    prompts = write_jsonl(arithmetic_rows(steps * FLAGS["rollout_batch_size"], seed=1), out / "prompts.jsonl")
    flags = {**FLAGS, **LAYOUTS[name], "pretrain": MODEL, "reward_pretrain": rm, "prompt_data": prompts,
             "run_dir": str(out / "run"), "save_path": str(out / "model"), "ckpt_path": str(out / "ckpt")}
    argv: list[str] = []
    for key, value in flags.items():
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    began = time.perf_counter()
    train_ppo(parse_config("ppo", None, argv))
    total = time.perf_counter() - began
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r]
    measured = rows[1:] or rows
    stage = {s: statistics.mean(r[f"time/{s}"] for r in measured) for s in STAGES}
    return {"stage_seconds": stage, "steps": len(rows), "steps_measured": len(measured),
            "first_step_seconds": rows[0]["time/step"], "run_seconds_with_setup": total,
            "setup_seconds": total - sum(r["time/step"] for r in rows),
            "reward_mean": [r["rollout/reward_mean"] for r in rows],
            "critic_loss": [r["train/critic_loss"] for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layouts", default="separate,colocated")
    args = parser.parse_args()
    import ray

    from rlhfkit.launch.ray_cluster import WORKER_ENV

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": WORKER_ENV})
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        rm = reward_model(Path(tmp) / "rm")
        for name in layouts:
            results[name] = run_layout(name, args.steps, rm, Path(tmp))
    ray.shutdown()
    print(f"\nPPO step, 4 x SmolLM2-135M ({FLAGS['rollout_batch_size']} prompts x {FLAGS['n_samples_per_prompt']} "
          f"samples x {FLAGS['generate_max_len']} tokens), seconds per step "
          f"(mean of {results[layouts[0]]['steps_measured']} step(s) after the first)")
    print(f"{'stage':<14}" + "".join(f"{name:>12}" for name in layouts))
    for s in STAGES:
        print(f"{s:<14}" + "".join(f"{results[name]['stage_seconds'][s]:>12.2f}" for name in layouts))
    print(f"{'first step':<14}" + "".join(f"{results[name]['first_step_seconds']:>12.2f}" for name in layouts))
    print(f"{'set-up':<14}" + "".join(f"{results[name]['setup_seconds']:>12.2f}" for name in layouts))
    RESULTS.mkdir(exist_ok=True)
    record = {"model": MODEL, "config": FLAGS, "layouts": results, "machine": machine_record()}
    print(machine_line(record["machine"]))
    (RESULTS / "ppo_step.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {RESULTS / 'ppo_step.json'}")


if __name__ == "__main__":
    main()
