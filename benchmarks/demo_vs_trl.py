"""TRL's GRPOTrainer on exactly the `rlhfkit demo` job, and one evaluator for any model folder (TRL's, rlhfkit's, base).

    # TRL is kept out of .venv: install it into its own folder and put it on PYTHONPATH for the `trl` mode
    .venv/bin/pip install --target /tmp/trl_pkgs --no-deps "trl==1.16.*"
    PYTHONPATH=/tmp/trl_pkgs .venv/bin/python benchmarks/demo_vs_trl.py trl --output_dir /tmp/trl-demo/model
    .venv/bin/python benchmarks/demo_vs_trl.py eval --name base --model embedded:smollm2-135m-instruct
    .venv/bin/python benchmarks/demo_vs_trl.py eval --name trl --model /tmp/trl-demo/model
    .venv/bin/python benchmarks/demo_vs_trl.py eval --name rlhfkit --model runs/demo-<time>/model
    .venv/bin/python benchmarks/demo_vs_trl.py table

`trl`: GRPOTrainer on the demo's 64 train prompts (`arithmetic_rows(64, seed=1)`, chat template), 8 samples per prompt,
4 prompts (32 samples) per optimizer step, 16 steps, 24 new tokens, temperature 0.7, lr 8e-6 (constant by default),
no KL, fp32 on the CPU, seed 42; reward: rlhfkit's `builtin:math` verifier (`math_reward_func`). Everything else is
TRL's default (the loss type used is recorded). Times `trainer.train()` and saves model + tokenizer.

`eval`: `rlhfkit batch-inference` (vLLM engine on Ray) on the demo's 64 held-out prompts (`arithmetic_rows(64,
seed=1000)`), 4 samples per prompt at temperature 0.6, 24 new tokens, fp32, sampling seed 42, scored by
`builtin:math`; accuracy = mean reward over the 256 samples. The same command, seeds and prompts for every model.

Each mode merges its numbers into benchmarks/results/demo_vs_trl.json (with the machine) and prints the table.
Wall times are indicative only when other jobs share the CPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rlhfkit.data.synthetic import arithmetic_rows, write_jsonl
from rlhfkit.engine.precision import cpu_bf16_capability, cpu_model_name
from rlhfkit.models.loading import resolve_pretrain
from rlhfkit.rewards.verifiers import math_reward_func

RESULTS = Path(__file__).parent / "results" / "demo_vs_trl.json"
SYSTEM = "You are a helpful assistant."  # as rlhfkit.cli.demo.SYSTEM
PRETRAIN = "embedded:smollm2-135m-instruct"
TRAIN_PROMPTS, EVAL_PROMPTS = 64, 64
TRL_CONFIG: dict[str, Any] = {
    "per_device_train_batch_size": 32, "num_generations": 8, "max_completion_length": 24, "temperature": 0.7,
    "learning_rate": 8e-6, "lr_scheduler_type": "constant", "warmup_steps": 0, "beta": 0.0, "max_steps": 16,
    "use_cpu": True, "bf16": False, "seed": 42, "report_to": [], "save_strategy": "no", "num_iterations": 1,
    "logging_steps": 1,
}
EVAL_FLAGS: dict[str, Any] = {
    "eval_task": "generate_vllm", "best_of_n": 4, "temperature": 0.6, "max_new_tokens": 24, "prompt_max_len": 128,
    "remote_rm_url": "builtin:math", "input_key": "input", "label_key": "label", "apply_chat_template": True,
    "param_dtype": "fp32", "seed": 42, "enforce_eager": True,
}


def load_results() -> dict[str, Any]:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def save_results(update: dict[str, Any]) -> dict[str, Any]:
    results = load_results()
    capability, native_bf16 = cpu_bf16_capability()
    results["machine"] = {"cpu": cpu_model_name(), "torch_capability": capability, "native_bf16": native_bf16,
                          "torch": torch.__version__, "threads": torch.get_num_threads()}
    for key, entries in update.items():
        results.setdefault(key, {}).update(entries)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    return results


def trl_reward(prompts: list[Any], completions: list[Any], label: list[str], **_: Any) -> list[float]:
    """rlhfkit's builtin:math on TRL's completions (conversational: the assistant message's content)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return math_reward_func(texts, [""] * len(texts), list(label))["rewards"]


def run_trl(args: argparse.Namespace) -> dict[str, Any]:
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rows = arithmetic_rows(TRAIN_PROMPTS, seed=1, system=SYSTEM)
    dataset = Dataset.from_list([{"prompt": r["input"], "label": r["label"]} for r in rows])
    config = {**TRL_CONFIG, "lr_scheduler_type": args.lr_scheduler}
    if args.lr_scheduler == "cosine_with_min_lr":  # what `rlhfkit ppo` uses by default (min_lr_ratio 0.1)
        config["lr_scheduler_kwargs"] = {"min_lr_rate": 0.1}
    grpo_config = GRPOConfig(output_dir=str(Path(args.output_dir).parent / "trainer"),
                             model_init_kwargs={"dtype": torch.float32}, **config)
    trainer = GRPOTrainer(model=resolve_pretrain(args.pretrain), reward_funcs=trl_reward, args=grpo_config,
                          train_dataset=dataset)
    began = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - began
    trainer.save_model(args.output_dir)
    trainer.processing_class.save_pretrained(args.output_dir)
    history = [{k: v for k, v in h.items() if k in ("step", "reward", "reward_std", "learning_rate", "loss",
                                                    "completions/mean_length", "grad_norm")}
               for h in trainer.state.log_history if "reward" in h]
    record = {"trl_version": trl.__version__, "loss_type": grpo_config.loss_type,
              "scale_rewards": grpo_config.scale_rewards,
              "adam_betas": [grpo_config.adam_beta1, grpo_config.adam_beta2],
              "max_grad_norm": grpo_config.max_grad_norm, "weight_decay": grpo_config.weight_decay,
              "epsilon": grpo_config.epsilon, "top_p": grpo_config.top_p, "top_k": grpo_config.top_k,
              "generation_batch_size": grpo_config.generation_batch_size,
              "steps_per_generation": grpo_config.steps_per_generation, "config": config,
              "train_seconds": round(seconds, 1), "model": args.output_dir, "history": history}
    print(f"TRL {trl.__version__} loss_type={grpo_config.loss_type}: {seconds:.1f} s, saved to {args.output_dir}")
    return record


def run_eval(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_pretrain(args.model) if args.model.startswith("embedded:") else args.model
    rlhfkit = Path(sys.executable).parent / "rlhfkit"
    with tempfile.TemporaryDirectory() as tmp:
        data = write_jsonl(arithmetic_rows(EVAL_PROMPTS, seed=1000, system=SYSTEM), Path(tmp) / "eval.jsonl")
        out = Path(tmp) / "out.jsonl"
        flags = {**EVAL_FLAGS, "pretrain": model, "dataset": data, "output_path": str(out)}
        argv = [str(rlhfkit), "batch-inference"]
        for key, value in flags.items():
            argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
        began = time.perf_counter()
        subprocess.run(argv, check=True)
        seconds = time.perf_counter() - began
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        if args.rows_out:
            Path(args.rows_out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.rows_out).write_text(out.read_text())
    rewards = [float(r["reward"]) for r in rows]
    by_prompt: dict[int, list[float]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_index"], []).append(float(r["reward"]))
    record = {"model": model, "accuracy": round(sum(rewards) / len(rewards), 4), "samples": len(rewards),
              "prompts": len(by_prompt), "pass@4": round(sum(max(v) for v in by_prompt.values()) / len(by_prompt), 4),
              "eval_seconds": round(seconds, 1), "examples": [r["output"] for r in rows[:4]]}
    print(f"{args.name}: accuracy {record['accuracy']:.4f} over {len(rewards)} samples")
    return record


def table(results: dict[str, Any]) -> str:
    machine = results.get("machine", {})
    lines = [f"machine: {machine.get('cpu')} [{machine.get('torch_capability')}], torch {machine.get('torch')}",
             "held-out accuracy: 64 prompts x 4 samples, temperature 0.6, 24 new tokens, builtin:math "
             "(rlhfkit batch-inference)", f"{'model':<24} {'accuracy':>9} {'pass@4':>7} {'train s':>8}"]
    for name, entry in results.get("eval", {}).items():
        train = results.get("trl", {}).get(name, {}).get("train_seconds", "")
        lines.append(f"{name:<24} {entry['accuracy']:>9.4f} {entry['pass@4']:>7.4f} {train!s:>8}")
    for name, entry in results.get("trl", {}).items():
        lines.append(f"{name}: TRL {entry['trl_version']}, loss_type {entry['loss_type']}, "
                     f"lr_scheduler {entry['config']['lr_scheduler_type']}, train {entry['train_seconds']} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    trl_p = sub.add_parser("trl", help="train TRL GRPOTrainer on the demo job")
    trl_p.add_argument("--pretrain", default=PRETRAIN)
    trl_p.add_argument("--output_dir", default="/tmp/trl-demo/model")
    trl_p.add_argument("--lr_scheduler", default="constant", choices=["constant", "cosine_with_min_lr"])
    trl_p.add_argument("--name", default="trl", help="key of this run in the results")
    eval_p = sub.add_parser("eval", help="held-out accuracy of a model folder (or embedded:...)")
    eval_p.add_argument("--model", required=True)
    eval_p.add_argument("--name", required=True, help="key of this model in the results")
    eval_p.add_argument("--rows_out", default=None, help="also keep the scored rows (.jsonl) here")
    sub.add_parser("table", help="print the table from the results file")
    args = parser.parse_args(argv)
    if args.mode == "trl":
        results = save_results({"trl": {args.name: run_trl(args)}})
    elif args.mode == "eval":
        results = save_results({"eval": {args.name: run_eval(args)}})
    else:
        results = load_results()
    print(table(results))


if __name__ == "__main__":
    main()
