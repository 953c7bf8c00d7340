"""The TRL side of `make bench-peers` (benchmarks/peers.py): one run of one workload, in .venv-peers.

    .venv-peers/bin/python benchmarks/peers_trl.py SPEC.json RESULT.json

SPEC is written by peers.py (model folder, data file, batch shape, lr, steps, precision). Every optimizer step is
timed by a TrainerCallback (on_step_begin -> on_step_end); the result holds those times, the steady median (the
first `warmup` steps dropped), the process's peak RSS (getrusage: TRL runs in this one process) and, for GRPO, the
mean completion length. The repo is on PYTHONPATH only for rlhfkit's pure reward (`math_reward_func`).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

COMMON: dict[str, Any] = {"use_cpu": True, "fp16": False, "report_to": [], "save_strategy": "no",
                          "logging_steps": 1, "lr_scheduler_type": "constant", "warmup_steps": 0,
                          "adam_beta1": 0.9, "adam_beta2": 0.95, "weight_decay": 0.0, "max_grad_norm": 1.0,
                          "dataloader_num_workers": 0}

RECORDED = ("learning_rate", "per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "max_steps",
            "lr_scheduler_type", "adam_beta2", "loss_type", "beta", "num_generations", "max_completion_length",
            "temperature", "max_length", "precompute_ref_log_probs", "steps_per_generation", "num_iterations")


class StepClock(TrainerCallback):
    """Wall time of every optimizer step (generation included for GRPO: it happens inside the step)."""

    def __init__(self) -> None:
        self.began = 0.0
        self.seconds: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.began = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seconds.append(time.perf_counter() - self.began)


def read_rows(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def math_reward(prompts: list[Any], completions: list[Any], label: list[str], **_: Any) -> list[float]:
    """rlhfkit's builtin:math on TRL's completions (conversational: the assistant message's content)."""
    from rlhfkit.rewards.verifiers import math_reward_func

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return math_reward_func(texts, [""] * len(texts), list(label))["rewards"]


def base_args(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    return {**COMMON, "use_cpu": spec.get("device", "cpu") == "cpu",  # benchmarks/gpu_check.py: "cuda"
            "output_dir": str(work / "trl-out"), "learning_rate": spec["lr"], "max_steps": spec["steps"],
            "seed": spec["seed"], "bf16": spec["precision"] == "bf16",
            "per_device_train_batch_size": spec["micro"],
            "gradient_accumulation_steps": spec["batch"] // spec["micro"]}


def grpo_trainer(spec: dict[str, Any], work: Path) -> Any:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rows = read_rows(spec["data"])
    data = Dataset.from_list([{"prompt": r["input"], "label": r["label"]} for r in rows])
    config = GRPOConfig(**base_args(spec, work), num_generations=spec["samples"],
                        max_completion_length=spec["new_tokens"], temperature=1.0, top_p=1.0, beta=0.0,
                        generation_kwargs={"min_new_tokens": spec["min_new_tokens"]}
                        if spec.get("min_new_tokens") else None,
                        num_iterations=1, model_init_kwargs={"dtype": torch.float32})
    return GRPOTrainer(model=spec["model"], reward_funcs=math_reward, args=config, train_dataset=data)


def sft_trainer(spec: dict[str, Any], work: Path) -> Any:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    rows = read_rows(spec["data"])
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["input"]}],
                               "completion": [{"role": "assistant", "content": r["output"]}]} for r in rows])
    config = SFTConfig(**base_args(spec, work), max_length=spec["max_len"], packing=False,
                       model_init_kwargs={"dtype": torch.float32})
    return SFTTrainer(model=spec["model"], args=config, train_dataset=data)


def dpo_trainer(spec: dict[str, Any], work: Path) -> Any:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    rows = read_rows(spec["data"])
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}],
                               "chosen": [{"role": "assistant", "content": r["chosen"]}],
                               "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows])
    config = DPOConfig(**base_args(spec, work), max_length=spec["max_len"], beta=spec["beta"],
                       precompute_ref_log_probs=True, model_init_kwargs={"dtype": torch.float32})
    return DPOTrainer(model=spec["model"], args=config, train_dataset=data)


TRAINERS = {"grpo": grpo_trainer, "sft": sft_trainer, "dpo": dpo_trainer}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import transformers
    import trl

    if spec["kind"] not in TRAINERS:
        return {"error": None, "missing": f"TRL {trl.__version__} has no trainer for {spec['kind']!r}",
                "step_median": None}
    torch.manual_seed(spec["seed"])
    work = Path(spec["work"])
    trainer = TRAINERS[spec["kind"]](spec, work)
    clock = StepClock()
    trainer.add_callback(clock)
    began = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - began
    steady = clock.seconds[spec["warmup"]:] or clock.seconds
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"error": None, "step_seconds": clock.seconds, "step_median": statistics.median(steady),
            "train_seconds": total, "response_length": statistics.mean(lengths[spec["warmup"]:] or lengths)
            if lengths else None, "peak_mb": {"trl": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
            "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
            "threads": torch.get_num_threads(), "dtype": str(next(trainer.model.parameters()).dtype),
            "config": {k: getattr(trainer.args, k, None) for k in RECORDED}}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        result = run(spec)
    except Exception:  # the harness records the failure and goes on with the next run
        result = {"error": traceback.format_exc(limit=8), "step_median": None}
    Path(sys.argv[2]).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
