"""Pure helpers of `make bench-peers` (benchmarks/peers.py): steady step times, medians over repeats, ratios and the
printed table. No models, no subprocesses: tests/benchmarks/test_peers_stats.py covers them."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

SIDES = ("trl", "rlhfkit")


def steady(step_seconds: Sequence[float], warmup: int) -> list[float]:
    """The steps after the first `warmup` ones; all of them when fewer would be left (a --quick run)."""
    rest = list(step_seconds[warmup:])
    return rest or list(step_seconds)


def median_or_none(values: Sequence[float | None]) -> float | None:
    """Median of the values that are not None; None when there are none."""
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over repeats of each run's median steady step time, and of each peak memory / stage figure.

    `runs`: one record per repeat of one side of one workload, as written by peers_trl.py / peers_rlhfkit.py
    (`step_median`, `peak_mb`: {process: MB}, optional `stages`: {stage: seconds}, `response_length`)."""
    ok = [r for r in runs if r.get("error") is None and r.get("step_median") is not None]
    out: dict[str, Any] = {"runs": len(runs), "ok": len(ok), "step_median": median_or_none([r["step_median"]
                                                                                            for r in ok])}
    out["step_medians"] = [r["step_median"] for r in ok]
    processes = sorted({p for r in ok for p in r.get("peak_mb", {})})
    out["peak_mb"] = {p: median_or_none([r["peak_mb"].get(p) for r in ok]) for p in processes}
    stages = sorted({s for r in ok for s in r.get("stages", {})})
    if stages:
        out["stages"] = {s: median_or_none([r["stages"].get(s) for r in ok]) for s in stages}
    lengths = [r.get("response_length") for r in ok]
    out["response_length"] = median_or_none(lengths)
    out["errors"] = [r["error"] for r in runs if r.get("error")]
    return out


def compare(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One workload's row: both sides' medians and the speed ratio TRL s/step / rlhfkit s/step (> 1: rlhfkit
    faster)."""
    trl, ours = summary.get("trl", {}), summary.get("rlhfkit", {})
    return {"trl_s": trl.get("step_median"), "rlhfkit_s": ours.get("step_median"),
            "speedup": ratio(trl.get("step_median"), ours.get("step_median"))}


def _num(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _stages(stages: dict[str, float | None] | None) -> str:
    if not stages:
        return "-"
    order = ("generation", "log_probs", "training", "weight_sync")
    return " / ".join(_num(stages.get(s)) for s in order)


COLUMNS = ("workload", "precision", "TRL s/step", "rlhfkit s/step", "TRL/rlhfkit", "peak MB TRL",
           "peak MB rlhfkit trainer / engine", "rlhfkit gen / logp / train / sync", "resp. tokens TRL / rlhfkit")


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    """One list of cells per workload, in COLUMNS order."""
    rows = []
    for name, entry in results["workloads"].items():
        trl, ours = entry["summary"].get("trl", {}), entry["summary"].get("rlhfkit", {})
        row = compare(entry["summary"])
        ours_mb = ours.get("peak_mb", {})
        trl_cell = _num(row["trl_s"]) if trl.get("ok") or not entry.get("trl_missing") else "n/a"
        speed = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        rows.append([name, entry.get("precision", "?"), trl_cell, _num(row["rlhfkit_s"]), speed,
                     _num(trl.get("peak_mb", {}).get("trl"), ".0f"),
                     f"{_num(ours_mb.get('trainer'), '.0f')} / {_num(ours_mb.get('engine'), '.0f')}",
                     _stages(ours.get("stages")),
                     f"{_num(trl.get('response_length'))} / {_num(ours.get('response_length'))}"])
    return rows


def format_table(results: dict[str, Any]) -> str:
    """Markdown table of every workload, headed by the machine line and the repeat count."""
    rows = table_rows(results)
    lines = [f"machine: {results.get('machine_line', '?')}",
             f"repeats: {results.get('repeats', '?')} (alternating TRL / rlhfkit; median over repeats of each "
             f"run's median steady step)", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    notes = [f"- {name}: {note}" for name, entry in results["workloads"].items() for note in entry.get("notes", [])]
    return "\n".join(lines + ([""] + notes if notes else []))


def run_order(workloads: Sequence[str], repeats: int) -> list[tuple[int, str, str]]:
    """(repeat, workload, side) in the order they run: TRL first on even repeats, rlhfkit first on odd ones."""
    order = []
    for r in range(repeats):
        sides = SIDES if r % 2 == 0 else SIDES[::-1]
        order += [(r, w, s) for w in workloads for s in sides]
    return order
