"""Metric sinks: metrics.jsonl (always), TensorBoard (--use_tensorboard), W&B (--use_wandb)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlhfkit.config.commands import CommandConfig
from rlhfkit.config.options import LoggingOptions

# The suffix convention of every metric reduced over micro-batches, ranks or updates: a key ending in one of these
# keeps the extreme value; every other key is a (weighted) sum that its owner divides into a mean.
EXTREMA = ("_max", "_min")


def is_extremum(key: str) -> bool:
    """Whether `key` names a maximum or minimum (kept as is, never summed or divided)."""
    return key.endswith(EXTREMA)


def merge_metrics(into: dict[str, float], new: Mapping[str, Any], weight: float = 1.0) -> dict[str, float]:
    """Fold `new` into the running `into` by the suffix convention: `*_max` keeps the largest value, `*_min` the
    smallest, every other key adds `value * weight` (a token-weighted sum, or a plain sum with weight 1).
    Values may be floats or 0-d tensors. Returns `into`."""
    for key, value in new.items():
        value = float(value)
        if key.endswith("_max"):
            into[key] = max(into.get(key, float("-inf")), value)
        elif key.endswith("_min"):
            into[key] = min(into.get(key, float("inf")), value)
        else:
            into[key] = into.get(key, 0.0) + value * weight
    return into


class MetricsLogger:
    """Writes one JSON object per logged step; mirrors scalars to TensorBoard and W&B when asked. Rank 0 only."""

    def __init__(self, run_dir: str | Path, cfg: LoggingOptions, enabled: bool = True) -> None:
        self.enabled = enabled
        self.tb = None
        self.wandb_run = None
        if not enabled:
            return
        self.path = Path(run_dir) / "metrics.jsonl"
        self.file = self.path.open("a", buffering=1)
        if cfg.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(Path(cfg.use_tensorboard) / Path(run_dir).name))
        if cfg.use_wandb:
            self.wandb_run = _start_wandb(cfg, run_dir)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        scalars = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _start_wandb(cfg: LoggingOptions, run_dir: str | Path) -> Any:
    import wandb

    key = cfg.use_wandb
    if key in ("offline", "online"):
        os.environ["WANDB_MODE"] = key
    elif key not in ("1", "true", "True"):
        wandb.login(key=key)
    return wandb.init(project=cfg.wandb_project, entity=cfg.wandb_org, group=cfg.wandb_group,
                      name=cfg.wandb_run_name or Path(run_dir).name, dir=str(run_dir), config=_wandb_config(cfg))


def _wandb_config(cfg: LoggingOptions) -> dict[str, Any]:
    """The run's flags for W&B's run config (with `command` for a command's config)."""
    values = vars(cfg).copy()
    if isinstance(cfg, CommandConfig):
        values["command"] = cfg.command
    return values
