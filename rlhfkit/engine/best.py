"""--best_metric_key: keep the model of the evaluation at which an eval metric was best (OpenRLHF's
`--ckpt.best_metric_key`).

After every evaluation (step 0 included: the model the run started from is a candidate too), when the metric beats
the best so far, the model is written to `<ckpt_path>/best/` as an HF folder (what `--save_path` gets; with ppo's
`--enable_ema`, the EMA) with `best_metric.json` = {"key", "value", "step", "higher_is_better"} beside it. The
folder is written as `best.tmp` and renamed when complete. The best value so far is part of the resume checkpoint's
trainer state, so a resumed run replaces the folder exactly when the uninterrupted run would.

Direction: a key containing "loss" is better lower, any other (pass@k, reward, accuracy) higher. OpenRLHF tracks
pass@1 and always maximises; it has no loss metric to track.
Values: a metric name as logged (`eval/pass@1`), `auto` (or OpenRLHF's empty string: ppo `eval/pass@1`, the
offline commands `eval/loss`), `none` or unset: off.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from rlhfkit.config.options import CheckpointOptions
from rlhfkit.errors import ConfigError

log = logging.getLogger("rlhfkit")
BEST_DIR = "best"
RECORD = "best_metric.json"


def resolve_key(requested: str | None, default: str) -> str | None:
    """The metric --best_metric_key names: None for unset / 'none', `default` for 'auto' or ''."""
    if requested is None or requested.lower() == "none":
        return None
    return default if requested in ("", "auto") else requested


def tracker_for(cfg: CheckpointOptions, default_key: str, has_eval: bool) -> BestTracker | None:
    """The run's tracker (None without --best_metric_key); refused without evaluation data."""
    key = resolve_key(cfg.best_metric_key, default_key)
    if key is None:
        return None
    if not has_eval:
        raise ConfigError(f"--best_metric_key {cfg.best_metric_key!r} keeps the model of the best evaluation, but "
                          "this run evaluates nothing: add --eval_dataset, or drop --best_metric_key")
    return BestTracker(key, cfg.ckpt_path)


def check_key(key: str, available: list[str]) -> None:
    """ConfigError naming the flag, the key and the metrics there are, when `key` is not one of them."""
    if key not in available:
        raise ConfigError(f"--best_metric_key {key!r} is not an eval metric of this run; the evaluation gives: "
                          f"{', '.join(sorted(available))}")


class BestTracker:
    """The best value of one eval metric so far, and the folder that holds its model."""

    def __init__(self, key: str, ckpt_path: str | Path) -> None:
        self.key = key
        self.higher_is_better = "loss" not in key.lower()
        self.folder = Path(ckpt_path) / BEST_DIR
        self.value: float | None = None
        self.step: int | None = None

    @property
    def staging(self) -> Path:
        """Where the caller writes the HF folder of a new best before `commit` renames it."""
        return self.folder.with_suffix(".tmp")

    def improves(self, step: int, metrics: dict[str, float]) -> bool:
        """Whether this evaluation beats the best so far (strictly); if so it becomes the best. Every rank calls it
        with the same (all-reduced) metrics, so they agree."""
        check_key(self.key, list(metrics))
        value = float(metrics[self.key])
        if self.value is not None and not (value > self.value if self.higher_is_better else value < self.value):
            return False
        self.value, self.step = value, step
        return True

    def commit(self) -> None:
        """`staging` (written by the caller) with its best_metric.json becomes `folder` (rank 0 only)."""
        (self.staging / RECORD).write_text(json.dumps(self.state(), indent=2))
        shutil.rmtree(self.folder, ignore_errors=True)
        self.staging.rename(self.folder)
        log.info("new best %s = %.6g at step %d: model in %s", self.key, self.value, self.step, self.folder)

    def state(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "step": self.step, "higher_is_better": self.higher_is_better}

    def load_state(self, state: dict[str, Any] | None) -> None:
        """Resume: the best so far from a checkpoint's trainer state (ignored when it tracked another key)."""
        if state and state.get("key") == self.key and state.get("value") is not None:
            self.value, self.step = float(state["value"]), int(state["step"])
