"""The summary of a run, from its metrics.jsonl and manifest.json: what ran (command, model, estimator), the outcome
(the eval metric before -> after, the reward or loss first -> last), the time per step and its split by stage
(time/*), generation tokens/s (perf/generation_tokens_per_s) and MFU (perf/mfu_*).

It opens report.html (`summary_html`), closes the console output of `rlhfkit ppo` and the offline commands
(`summary_lines`), and gives `rlhfkit runs` its outcome line (`outcome_line`).
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from rlhfkit.observability.runfiles import RunMetrics, read_json, read_metrics
from rlhfkit.observability.svg import format_number

# The eval metric the outcome names: the first of these the run logged, else the first eval/* by name.
EVAL_PREFERENCE = ("eval/pass@1", "eval/accuracy", "eval/acc", "eval/reward_mean", "eval/score_mean", "eval/loss")
# The training signal of the outcome: the reward of an online run, else the training loss.
TRAIN_PREFERENCE = ("rollout/reward_mean", "train/loss")


@dataclass
class Change:
    metric: str
    first: float
    last: float
    first_step: float
    last_step: float

    def text(self) -> str:
        return f"{self.metric} {format_number(self.first)} -> {format_number(self.last)} " \
               f"(step {format_number(self.first_step)} -> {format_number(self.last_step)})"


@dataclass
class RunSummary:
    command: str | None = None
    model: str | None = None
    estimator: str | None = None
    steps: int = 0                                     # distinct logged steps
    last_step: float | None = None
    eval: Change | None = None
    train: Change | None = None
    step_seconds: float | None = None                  # mean of time/step
    stages: list[tuple[str, float, float | None]] = field(default_factory=list)  # (stage, mean s, share of step)
    tokens_per_s: float | None = None                  # mean of perf/generation_tokens_per_s
    mfu: dict[str, float] = field(default_factory=dict)  # perf/mfu_<stage> -> mean
    flat_zero: list[str] = field(default_factory=list)  # metrics that are 0 at every logged step


def finite_points(metrics: RunMetrics, name: str) -> list[tuple[float, float]]:
    return [(x, y) for x, y in metrics.points(name) if math.isfinite(y)]


def mean_of(metrics: RunMetrics, name: str) -> float | None:
    values = [y for _, y in finite_points(metrics, name)]
    return sum(values) / len(values) if values else None


def change_of(metrics: RunMetrics, name: str) -> Change | None:
    points = finite_points(metrics, name)
    if not points:
        return None
    return Change(name, points[0][1], points[-1][1], points[0][0], points[-1][0])


def flat_zero_metrics(metrics: RunMetrics) -> list[str]:
    """Metrics logged at least once whose every value is exactly 0."""
    return sorted(name for name, per_step in metrics.series.items() if per_step and
                  all(v == 0 for v in per_step.values()))


def command_name(command: str) -> str | None:
    """"ppo" from "rlhfkit ppo ..." or "torchrun ... -m rlhfkit.cli.sft ..."."""
    words = shlex.split(command) if command else []
    for i, word in enumerate(words):
        if word == "rlhfkit" and i + 1 < len(words):
            return words[i + 1]
        if word.startswith("rlhfkit.cli."):
            return word[len("rlhfkit.cli."):].replace("_", "-")
    return None


def summarize(metrics: RunMetrics, manifest: dict[str, Any] | None) -> RunSummary:
    manifest = manifest or {}
    config: dict[str, Any] = manifest["config"] if isinstance(manifest.get("config"), dict) else {}
    s = RunSummary(command=command_name(str(manifest.get("command") or "")), model=config.get("pretrain"),
                   estimator=config.get("advantage_estimator"))
    steps = sorted({x for per_step in metrics.series.values() for x in per_step})
    s.steps, s.last_step = len(steps), (steps[-1] if steps else None)
    evals = [m for m in EVAL_PREFERENCE if finite_points(metrics, m)] or \
        sorted(m for m in metrics.series if m.startswith("eval/") and finite_points(metrics, m))
    s.eval = change_of(metrics, evals[0]) if evals else None
    trains = [m for m in TRAIN_PREFERENCE if finite_points(metrics, m)]
    s.train = change_of(metrics, trains[0]) if trains else None
    s.step_seconds = mean_of(metrics, "time/step")
    for name in sorted(m for m in metrics.series if m.startswith("time/") and m != "time/step"):
        seconds = mean_of(metrics, name)
        if seconds is not None:
            share = seconds / s.step_seconds if s.step_seconds else None
            s.stages.append((name[len("time/"):], seconds, share))
    s.tokens_per_s = mean_of(metrics, "perf/generation_tokens_per_s")
    for name in sorted(m for m in metrics.series if m.startswith("perf/mfu_")):
        value = mean_of(metrics, name)
        if value is not None:
            s.mfu[name] = value
    s.flat_zero = flat_zero_metrics(metrics)
    return s


def summarize_run(run_dir: str | Path) -> RunSummary:
    """The summary of a run folder (metrics.jsonl required; a missing manifest leaves what ran unknown)."""
    run_dir = Path(run_dir)
    return summarize(read_metrics(run_dir / "metrics.jsonl"), read_json(run_dir / "manifest.json", []))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def what_ran(s: RunSummary) -> str:
    parts = [f"rlhfkit {s.command}" if s.command else "unknown command"]
    if s.model:
        parts.append(f"model {s.model}")
    if s.estimator:
        parts.append(f"estimator {s.estimator}")
    return ", ".join(parts)


def outcome_line(s: RunSummary) -> str:
    parts = [c.text() for c in (s.eval, s.train) if c is not None]
    return "; ".join(parts) if parts else "no eval, reward or loss logged"


def time_line(s: RunSummary) -> str | None:
    if s.step_seconds is None and not s.stages:
        return None
    head = f"{s.step_seconds:.3g} s per step" if s.step_seconds is not None else "time per stage"
    split = ", ".join(f"{stage} {seconds:.3g} s" + (f" ({_pct(share)})" if share is not None else "")
                      for stage, seconds, share in s.stages)
    return head + (f": {split}" if split else "")


def perf_line(s: RunSummary) -> str | None:
    parts = []
    if s.tokens_per_s is not None:
        parts.append(f"generation {format_number(s.tokens_per_s)} tokens/s")
    parts += [f"MFU {name[len('perf/mfu_'):]} {_pct(value)}" for name, value in s.mfu.items()]
    return ", ".join(parts) or None


def summary_lines(s: RunSummary) -> list[str]:
    """A few console lines (the same facts as the report's summary)."""
    lines = [f"ran:     {what_ran(s)}; {s.steps} logged steps", f"outcome: {outcome_line(s)}"]
    if (line := time_line(s)) is not None:
        lines.append(f"time:    {line}")
    if (line := perf_line(s)) is not None:
        lines.append(f"speed:   {line}")
    return lines


def summary_html(s: RunSummary) -> str:
    rows = [("what ran", what_ran(s) + f"; {s.steps} logged steps"), ("outcome", outcome_line(s))]
    if (line := time_line(s)) is not None:
        rows.append(("time", line))
    if (line := perf_line(s)) is not None:
        rows.append(("speed", line))
    if s.flat_zero:
        rows.append(("flat at zero", f"{len(s.flat_zero)} metric(s), folded under their sections"))
    body = "".join(f'<tr data-row="{escape(k)}"><th>{escape(k)}</th><td>{escape(v)}</td></tr>' for k, v in rows)
    return f'<section id="summary"><h2>Summary</h2><table class="kv" id="summary-table">{body}</table></section>'
