"""Shared helpers of the online RL tests: one short `rlhfkit ppo` run on the session's engine, and metric series.

Importable by name from any test (pytest puts tests/rl on the path, see pyproject.toml)."""

from __future__ import annotations

import json
from pathlib import Path

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.config.rl_options import RL_GROUPS
from rlhfkit.rl.ppo_trainer import train_ppo

HERE = Path(__file__).parent


def run(model: str, prompts: str, out: Path, engine, **overrides) -> list[dict]:
    flags = {"pretrain": model, "prompt_data": prompts, "input_key": "input", "label_key": "label",
             "apply_chat_template": True, "remote_rm_url": str(HERE / "letters_reward.py"),
             "advantage_estimator": "group_norm", "n_samples_per_prompt": 8, "rollout_batch_size": 4,
             "train_batch_size": 32, "micro_train_batch_size": 16, "micro_rollout_batch_size": 16,
             "generate_max_len": 8, "prompt_max_len": 128, "actor_learning_rate": 3e-2, "lr_warmup_ratio": 0.0,
             "init_kl_coef": 0.0, "num_episodes": 1, "seed": 5, "run_dir": str(out / "run"),
             "save_path": str(out / "hf"), "ckpt_path": str(out / "ckpt"), **overrides}
    cfg = parse_config("ppo", RL_GROUPS, flags_to_argv(flags))
    train_ppo(cfg, engines=[engine])
    return [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]


def series(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]
