"""The rlhfkit side of `make bench-peers` (benchmarks/peers.py): one run of one workload, in .venv.

    .venv/bin/python benchmarks/peers_rlhfkit.py SPEC.json RESULT.json

Runs the rlhfkit command in this process (`rlhfkit ppo` for grpo/ppo, `rlhfkit sft`, `rlhfkit dpo`) with the flags
of `flags_for(spec)`, then reads the run's metrics.jsonl: `time/step` and its stages for online runs,
`train/step_seconds` for offline ones; the first `warmup` steps are dropped. Peak memory: this process (getrusage;
the offline trainer itself, the Ray driver for online runs) and, for online runs, every Ray actor named in the
run's manifest.json `placement` (trainer ranks, vLLM engine), read from /proc/<pid>/status VmHWM by a thread that
polls while the run goes on (the actors are gone when it ends).
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

STAGES = ("generation", "reward", "log_probs", "training", "weight_sync")
ONLINE = ("grpo", "ppo")


def flags_for(spec: dict[str, Any], run: Path) -> dict[str, Any]:
    """The command's flags for this workload (same data, batch shape, lr and precision as the TRL side)."""
    common = {"pretrain": spec["model"], "run_dir": str(run / "run"), "save_path": str(run / "model"),
              "ckpt_path": str(run / "ckpt"), "param_dtype": spec["precision"], "seed": spec["seed"],
              "lr_scheduler": "constant", "lr_warmup_ratio": 0.0, "micro_train_batch_size": spec["micro"],
              "train_batch_size": spec["batch"],
              # padding-free rows, a group's prompt computed once: the same losses and gradients as padded rows
              # (tests/rl/test_packing.py, tests/trainers/test_method_losses.py), fewer tokens through the model
              "packing_samples": True}
    if spec["kind"] in ONLINE:
        online = {**common, "prompt_data": spec["data"], "input_key": "input", "apply_chat_template": True,
                  "n_samples_per_prompt": spec["samples"], "rollout_batch_size": spec["prompts"],
                  "micro_rollout_batch_size": spec["batch"] // 2, "generate_max_len": spec["new_tokens"],
                  "prompt_max_len": 256, "temperature": 1.0, "actor_learning_rate": spec["lr"],
                  "max_samples": spec["steps"] * spec["prompts"], "enforce_eager": True,
                  "vllm_kv_cache_mb": spec["kv_cache_mb"], "enable_vllm_is_correction": True}
        if spec.get("min_new_tokens"):
            online["generate_min_len"] = spec["min_new_tokens"]
        if spec["kind"] == "grpo":
            return {**online, "advantage_estimator": "group_norm", "init_kl_coef": 0.0, "label_key": "label",
                    "remote_rm_url": "builtin:math"}
        return {**online, "advantage_estimator": "gae", "reward_pretrain": spec["reward_model"],
                "init_kl_coef": spec["kl_coef"], "critic_learning_rate": spec["lr"], "lambd": spec["lam"]}
    offline = {**common, "dataset": spec["data"], "apply_chat_template": True, "max_len": spec["max_len"],
               "learning_rate": spec["lr"], "max_epochs": 1, "max_samples": spec["steps"] * spec["batch"]}
    if spec["kind"] == "sft":
        return {**offline, "input_key": "input", "output_key": "output"}
    return {**offline, "prompt_key": "prompt", "chosen_key": "chosen", "rejected_key": "rejected",
            "beta": spec["beta"]}


def argv_of(flags: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for key, value in flags.items():
        argv += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return argv


def vm_hwm_mb(pid: int) -> float | None:
    """Peak resident set (VmHWM) of a live process, MB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def process_label(entry: dict[str, Any]) -> str:
    """'trainer' for the actor's rank 0, 'engine' for engine 0, else role[rank] (critic, ref, reward, ...)."""
    role, rank = entry.get("role", "?"), entry.get("rank", entry.get("engine", 0))
    if role == "actor" and rank == 0:
        return "trainer"
    if role == "engine" and rank == 0:
        return "engine"
    return f"{role}{rank}"


class PeakSampler(threading.Thread):
    """Polls the run's manifest.json placement and each Ray actor's VmHWM every `period` seconds."""

    def __init__(self, manifest: Path, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.manifest, self.period = manifest, period
        self.peaks: dict[str, float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.period):
            self.sample()

    def sample(self) -> None:
        try:
            placement = json.loads(self.manifest.read_text()).get("placement", [])
        except (OSError, ValueError):
            return
        for entry in placement:
            peak = vm_hwm_mb(int(entry.get("pid", 0)))
            label = process_label(entry)
            if peak is not None and peak > self.peaks.get(label, 0.0):
                self.peaks[label] = peak


def run_command(spec: dict[str, Any], run: Path) -> None:
    argv = argv_of(flags_for(spec, run))
    if spec["kind"] in ONLINE:
        from rlhfkit.cli.ppo import main
    elif spec["kind"] == "sft":
        from rlhfkit.cli.sft import main
    else:
        from rlhfkit.cli.dpo import main
    main(argv)


def read_steps(run_dir: Path, online: bool) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    key = "time/step" if online else "train/step_seconds"
    return [r for r in rows if key in r]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    run = Path(spec["work"])
    online = spec["kind"] in ONLINE
    sampler = PeakSampler(run / "run" / "manifest.json")
    sampler.start()
    try:
        run_command(spec, run)
    finally:
        sampler.done.set()
        sampler.join()
    rows = read_steps(run / "run", online)
    key = "time/step" if online else "train/step_seconds"
    seconds = [r[key] for r in rows]
    steady = rows[spec["warmup"]:] or rows
    result: dict[str, Any] = {"error": None, "step_seconds": seconds,
                              "step_median": statistics.median(r[key] for r in steady)}
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["peak_mb"] = {**sampler.peaks, ("driver" if online else "trainer"): own}
    if online:
        result["stages"] = {s: statistics.median(r.get(f"time/{s}", 0.0) for r in steady) for s in STAGES}
        lengths = [r["rollout/response_length_mean"] for r in steady if "rollout/response_length_mean" in r]
        result["response_length"] = statistics.mean(lengths) if lengths else None
    manifest = json.loads((run / "run" / "manifest.json").read_text())
    result["precision"] = manifest.get("precision", {})
    result["flags"] = flags_for(spec, run)
    return result


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    try:
        result = run(spec)
    except BaseException:  # SystemExit from argparse included: the harness records it and goes on
        result = {"error": traceback.format_exc(limit=8), "step_median": None}
    Path(sys.argv[2]).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
