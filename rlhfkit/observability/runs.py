"""`rlhfkit runs`: the run folders under a directory (default ./runs), one line each: command, date, logged steps and
the outcome line of the run's summary (rlhfkit.observability.summary)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rlhfkit.observability.runfiles import read_json, read_metrics
from rlhfkit.observability.summary import outcome_line, summarize

MAX_DEPTH = 2  # runs/<name>/ and runs/<group>/<name>/ (e.g. a sweep's folders)


@dataclass
class RunRow:
    path: Path
    command: str      # "ppo", or "?" without a manifest
    date: str         # the manifest's "started", else the time metrics.jsonl was last written
    steps: int        # distinct logged steps
    outcome: str


def find_run_dirs(root: Path, depth: int = MAX_DEPTH) -> list[Path]:
    """Folders holding a metrics.jsonl: `root` itself, or below it down to `depth` levels."""
    if (root / "metrics.jsonl").is_file():
        return [root]
    if depth == 0 or not root.is_dir():
        return []
    found: list[Path] = []
    for child in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        found += find_run_dirs(child, depth - 1)
    return found


def run_row(run_dir: Path) -> RunRow:
    metrics = read_metrics(run_dir / "metrics.jsonl")
    manifest = read_json(run_dir / "manifest.json", [])
    s = summarize(metrics, manifest)
    started = (manifest or {}).get("started")
    if not isinstance(started, str) or not started:
        started = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime((run_dir / "metrics.jsonl").stat().st_mtime))
    return RunRow(run_dir, s.command or "?", started, s.steps, outcome_line(s))


def list_runs(root: str | Path) -> list[RunRow]:
    """Every run under `root`, oldest first. FileNotFoundError when `root` does not exist."""
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist: pass the folder your runs write to (--run_dir's parent; "
                                "the default is ./runs)")
    return sorted((run_row(d) for d in find_run_dirs(root)), key=lambda r: (r.date, str(r.path)))


def format_runs(rows: list[RunRow], root: str | Path) -> str:
    if not rows:
        return f"no run folders (with a metrics.jsonl) under {root}"
    names = [str(r.path) for r in rows]
    width = max(len(n) for n in names)
    cmd = max(len(r.command) for r in rows)
    lines = [f"{'run':<{width}}  {'command':<{cmd}}  {'started':<19}  {'steps':>5}  outcome"]
    lines += [f"{n:<{width}}  {r.command:<{cmd}}  {r.date[:19]:<19}  {r.steps:>5}  {r.outcome}"
              for n, r in zip(names, rows)]
    return "\n".join(lines)
