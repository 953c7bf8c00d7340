"""Reading a run folder: metrics.jsonl (per metric, step -> value), manifest.json, samples.jsonl; tolerant of a partial
run (a truncated last line, a missing manifest), noting what it skipped. Shared by the report, its summary, `rlhfkit
runs` and `rlhfkit compare`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunMetrics:
    """Per metric: step -> value (the last row wins for a repeated step). Non-finite values are kept as floats."""

    series: dict[str, dict[float, float]] = field(default_factory=dict)
    rows: int = 0
    notes: list[str] = field(default_factory=list)

    def points(self, metric: str) -> list[tuple[float, float]]:
        return sorted(self.series.get(metric, {}).items())

    def non_finite(self, metric: str) -> list[tuple[float, float]]:
        return [(x, y) for x, y in self.points(metric) if not math.isfinite(y)]


def _number(value: Any) -> float | None:
    """A metric value as float: numbers, and the strings "nan"/"inf"/"-inf" MetricsLogger writes; else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def read_metrics(path: Path) -> RunMetrics:
    """Parse metrics.jsonl; bad lines (e.g. the last line of a run killed mid-write) are skipped and noted."""
    out = RunMetrics()
    bad_lines: list[int] = []
    repeated: set[float] = set()
    ignored: set[str] = set()
    with path.open(encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad_lines.append(line_no)
                continue
            if not isinstance(row, dict):
                bad_lines.append(line_no)
                continue
            out.rows += 1
            step = _number(row.get("step"))
            if step is None or not math.isfinite(step):
                step = float(out.rows)
            for key, raw in row.items():
                if key == "step":
                    continue
                value = _number(raw)
                if value is None:
                    ignored.add(key)
                    continue
                per_step = out.series.setdefault(key, {})
                if step in per_step:
                    repeated.add(step)
                per_step[step] = value
    if bad_lines:
        shown = ", ".join(map(str, bad_lines[:10])) + (" ..." if len(bad_lines) > 10 else "")
        out.notes.append(f"{path.name}: skipped {len(bad_lines)} line(s) that are not JSON objects "
                         f"(line {shown}); a run stopped while writing leaves a partial last line.")
    if repeated:
        out.notes.append(f"{path.name}: {len(repeated)} step(s) logged more than once for the same metric "
                         f"(a resumed run?); the last value is plotted.")
    if ignored:
        out.notes.append(f"{path.name}: non-numeric values not plotted: {', '.join(sorted(ignored))}.")
    return out


def read_json(path: Path, notes: list[str]) -> dict[str, Any] | None:
    if not path.is_file():
        notes.append(f"no {path.name} in the run folder: the command, versions and hardware are unknown.")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as err:
        notes.append(f"{path.name} is not valid JSON ({err}); skipped.")
        return None
    if not isinstance(data, dict):
        notes.append(f"{path.name} is not a JSON object; skipped.")
        return None
    return data


def read_samples(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    if not path.is_file():
        notes.append(f"no {path.name} in the run folder: no sample generations to show.")
        return []
    rows, bad = [], 0
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1
                continue
            if isinstance(row, dict):
                rows.append(row)
            else:
                bad += 1
    if bad:
        notes.append(f"{path.name}: skipped {bad} line(s) that are not JSON objects.")
    return rows
