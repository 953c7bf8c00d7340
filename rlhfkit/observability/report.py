"""The run report: one self-contained HTML page (inline SVG plots, inline CSS, no JavaScript, no network), and beside
it the samples page (`samples_page.py`: the per-sample trace of one step; a little inline JavaScript sorts its table).

`write_report(run_dir)` reads `metrics.jsonl` (required), `manifest.json` and `samples.jsonl` (optional) from a run
folder and writes `report.html` beside them. A partial run (a truncated last line, a missing manifest, metrics that
were never logged) gives a page with notes where something is missing; it never fails for that reason.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

from rlhfkit.errors import ReportError
from rlhfkit.observability.runfiles import RunMetrics, _number, read_json, read_metrics, read_samples
from rlhfkit.observability.samples_page import SAMPLES_PAGE, render_samples_page, train_steps
from rlhfkit.observability.summary import flat_zero_metrics, summarize, summary_html
from rlhfkit.observability.svg import PALETTE, Series, format_number, is_finite, line_plot

REPORT_NAME = "report.html"
MAX_TEXT_CHARS = 4000           # longer prompts/responses are cut in the samples table (the rest is counted)


# ----------------------------------------------------------------------------------------------------------------
# Which metric goes in which section and figure


@dataclass
class Section:
    key: str
    title: str
    y_label: str
    match: Callable[[str], bool]


def _leaf(metric: str) -> str:
    return metric.rsplit("/", 1)[-1]


def _prefix(metric: str) -> str:
    return metric.split("/", 1)[0] if "/" in metric else ""


def _has_token(name: str, token: str) -> bool:
    return re.search(rf"(^|[_/]){re.escape(token)}($|[_/])", name) is not None


# Order matters twice: the first matching section takes a metric, and sections appear in this order on the page.
SECTIONS: list[Section] = [
    Section("eval", "Evaluation", "value", lambda m: _prefix(m) == "eval"),
    Section("time", "Time per stage", "seconds", lambda m: _prefix(m) == "time"),
    Section("reward", "Reward", "reward",
            lambda m: _prefix(m) == "reward" or (_prefix(m) == "rollout" and ("reward" in _leaf(m)
                                                                             or "score" in _leaf(m)))),
    Section("kl", "KL divergence", "KL", lambda m: _has_token(_leaf(m), "kl")),
    Section("length", "Response length", "tokens",
            lambda m: "length" in _leaf(m) or "truncated" in _leaf(m)),
    Section("mismatch", "Log-prob mismatch (trainer vs rollout engine)", "value",
            lambda m: "logprob" in _leaf(m) or "is_ratio" in _leaf(m) or "mismatch" in _leaf(m)),
    Section("loss", "Losses", "loss", lambda m: "loss" in _leaf(m)),
    Section("lr", "Learning rate", "learning rate", lambda m: _leaf(m) == "lr" or _leaf(m).endswith("_lr")),
]
PAGE_ORDER = ["reward", "kl", "length", "loss", "time", "mismatch", "eval", "lr"]
EXPECTED = {"reward": "rollout/reward_mean (online RL runs)", "kl": "rollout/kl (online RL runs with a reference)",
            "length": "rollout/response_length_mean (online RL runs)",
            "loss": "train/loss, train/policy_loss, train/critic_loss", "time": "time/* (online RL runs)",
            "mismatch": "rollout/logprob_abs_diff_mean (online RL runs)",
            "eval": "eval/* (runs with an eval set)", "lr": "train/lr"}
_STAT_SUFFIX = re.compile(r"_(mean|max|min|std)$")


def section_of(metric: str) -> str:
    """The section key a metric belongs to: one of SECTIONS, or "other:<prefix>"."""
    for section in SECTIONS:
        if section.match(metric):
            return section.key
    return f"other:{_prefix(metric) or '(no prefix)'}"


@dataclass
class Figure:
    key: str                      # stem shared by its metrics, e.g. "rollout/response_length"
    metrics: list[str]
    band_of: dict[str, str] = field(default_factory=dict)  # mean metric -> its std metric (drawn as +-std)

    def title(self) -> str:
        if self.key == "time":
            return "time per stage (seconds)"
        if len(self.metrics) == 1:
            return self.metrics[0]
        return f"{self.key} ({', '.join(m[len(self.key) + 1:] for m in self.metrics)})"


def group_figures(section_key: str, metrics: list[str]) -> list[Figure]:
    """One figure per stem (x_mean, x_max, x_std share one); all time/* share one figure."""
    if section_key == "time":
        ordered = sorted(metrics, key=lambda m: (m == "time/step", m))
        return [Figure("time", ordered)]
    stems: dict[str, list[str]] = {}
    for m in sorted(metrics):
        stems.setdefault(_STAT_SUFFIX.sub("", m), []).append(m)
    figures = []
    for stem, members in stems.items():
        order = {"_mean": 0, "_min": 2, "_max": 3, "_std": 4}
        members.sort(key=lambda m: order.get(m[len(stem):], 1))
        band_of = {}
        if f"{stem}_mean" in members and f"{stem}_std" in members:
            band_of[f"{stem}_mean"] = f"{stem}_std"
            members.remove(f"{stem}_std")
            members.append(f"{stem}_std")  # still listed (data-metric), drawn as the band
        figures.append(Figure(stem, members, band_of))
    return figures


# ----------------------------------------------------------------------------------------------------------------
# HTML


CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1400px;
padding:16px 24px;color:#222;background:#fff}
h1{font-size:22px;margin:8px 0}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
h3{font-size:15px;margin:16px 0 6px}
table{border-collapse:collapse;margin:6px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;
vertical-align:top}th{background:#f6f6f6}
table.kv th{width:160px}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
pre{background:#f6f6f6;padding:8px;white-space:pre-wrap;word-break:break-word;margin:4px 0}
.figures{display:flex;flex-wrap:wrap;gap:12px}
figure{margin:0;border:1px solid #e3e3e3;border-radius:4px;padding:8px;background:#fff;max-width:660px}
figcaption{font-weight:600;margin-bottom:4px}
svg.plot{display:block;max-width:100%;height:auto;font-size:11px;fill:#333}
svg.plot text.xlabel,svg.plot text.ylabel{font-size:12px;fill:#222}
.legend{list-style:none;padding:0;margin:4px 0 0;display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12px}
.legend span{display:inline-block;width:14px;height:3px;margin-right:5px;vertical-align:middle}
.note{color:#8a5a00;background:#fff8e6;border-left:3px solid #e0a800;padding:4px 8px;margin:4px 0;font-size:13px}
.samples td pre{max-height:320px;overflow:auto;margin:0}
.samples td.num{white-space:nowrap;font-family:ui-monospace,monospace}
nav a{margin-right:12px}
"""


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def _note(text: str) -> str:
    return f'<p class="note">{_e(text)}</p>'


def _kv_table(rows: list[tuple[str, str]], table_id: str) -> str:
    body = "".join(f"<tr><th>{_e(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="kv" id="{table_id}">{body}</table>'


def _header(manifest: dict[str, Any] | None) -> str:
    if manifest is None:
        return ""  # read_json already noted why
    rows: list[tuple[str, str]] = []
    if manifest.get("command"):
        rows.append(("command", f"<code>{_e(manifest['command'])}</code>"))
    rows.append(("git SHA", f"<code>{_e(manifest.get('git_sha') or 'unknown')}</code>"))
    rows.append(("seed", _e(manifest.get("seed", "unknown"))))
    if manifest.get("started"):
        rows.append(("started", _e(manifest["started"])))
    if manifest.get("python"):
        rows.append(("python", _e(manifest["python"])))
    versions = manifest.get("versions")
    if isinstance(versions, dict):
        text = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
        rows.append(("versions", _e(text or "unknown")))
    hardware = manifest.get("hardware")
    if isinstance(hardware, dict):
        parts = []
        for key, value in hardware.items():
            if isinstance(value, list):
                value = ", ".join(map(str, value)) or "none"
            parts.append(f"{key}: {value}")
        rows.append(("hardware", _e("; ".join(parts))))
    elif hardware:
        rows.append(("hardware", _e(hardware)))
    precision = manifest.get("precision")
    if isinstance(precision, dict):
        rows.append(("precision", _e(_precision_line(precision))))
    return _kv_table(rows, "run-info")


def _precision_line(p: dict[str, Any]) -> str:
    """"fp32 (auto: no native bf16 ...); CPU ...; matmul fp32 170, bf16 1.3 GFLOP/s" from the manifest's record."""
    parts = [f"{p.get('dtype', '?')} ({p.get('reason', 'no reason recorded')})",
             f"{p.get('device', '?')}: {p.get('device_name', '?')}, capability {p.get('capability', '?')}"]
    if p.get("fp32_gflops") is not None:
        parts.append(f"measured matmul fp32 {p['fp32_gflops']} GFLOP/s, bf16 {p.get('bf16_gflops')} GFLOP/s")
    return "; ".join(parts)


def _reproduce(manifest: dict[str, Any] | None) -> str:
    out = ['<h2 id="reproduce-section">Reproduce</h2>']
    if not manifest or not manifest.get("command"):
        out.append(_note("no command recorded (manifest.json missing or without 'command')."))
        return "".join(out)
    lines = []
    if manifest.get("git_sha"):
        lines.append(f"git checkout {manifest['git_sha']}")
    lines.append(str(manifest["command"]))
    out.append(f'<pre id="reproduce">{_e(chr(10).join(lines))}</pre>')
    if manifest.get("seed") is not None:
        out.append(f"<p>Same seed ({_e(manifest['seed'])}): runs are reproducible from the seed on CPU.</p>")
    config = manifest.get("config")
    if isinstance(config, dict) and config:
        rows = "".join(f"<tr><th>{_e(k)}</th><td><code>{_e(json.dumps(v))}</code></td></tr>"
                       for k, v in config.items())
        out.append(f'<details><summary>Resolved config ({len(config)} flags)</summary>'
                   f'<table class="kv" id="config">{rows}</table></details>')
    return "".join(out)


def _skipped_note(metrics: RunMetrics, names: list[str]) -> str:
    parts = []
    for name in names:
        bad = metrics.non_finite(name)
        if bad:
            where = ", ".join(f"{'nan' if math.isnan(v) else ('inf' if v > 0 else '-inf')} at step "
                              f"{format_number(x)}" for x, v in bad[:8])
            more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
            parts.append(f"{name}: {len(bad)} non-finite value(s) skipped ({where}{more})")
    return _note("; ".join(parts) + ".") if parts else ""


def _figure(metrics: RunMetrics, fig: Figure, section: str, y_label: str) -> str:
    series = []
    for name in fig.metrics:
        if name in fig.band_of.values():
            continue
        points = metrics.points(name)
        band = None
        if name in fig.band_of:
            std = metrics.series[fig.band_of[name]]
            band = [(x, y - std[x], y + std[x]) for x, y in points if x in std]
        series.append(Series(name, points, band=band, dashed=name == "time/step"))
    title = fig.title()
    svg = line_plot(series, title=title, x_label="step", y_label=_leaf(fig.key) if section == "other" else y_label)
    legend = ""
    if len(series) > 1 or fig.band_of:
        items = []
        for i, s in enumerate(series):
            extra = f" (shaded: +-{_leaf(fig.band_of[s.name])})" if s.name in fig.band_of else ""
            extra += " (dashed: whole step)" if s.dashed else ""
            items.append(f'<li><span style="background:{PALETTE[i % len(PALETTE)]}"></span>{_e(s.name + extra)}</li>')
        legend = f'<ul class="legend">{"".join(items)}</ul>'
    note = _skipped_note(metrics, fig.metrics)
    return (f'<figure id="fig-{_slug(fig.key)}" data-metric="{_e(" ".join(fig.metrics))}" '
            f'data-section="{_e(section)}"><figcaption>{_e(title)}</figcaption>{svg}{legend}{note}</figure>')


def _time_table(metrics: RunMetrics, names: list[str]) -> str:
    stages = [n for n in names if n != "time/step"]
    means = {}
    for n in names:
        values = [v for _, v in metrics.points(n) if is_finite(v)]
        if values:
            means[n] = sum(values) / len(values)
    if not means:
        return ""
    total = means.get("time/step") or sum(means[n] for n in stages if n in means)
    rows = []
    for n in [*stages, "time/step"]:
        if n in means:
            share = f"{100 * means[n] / total:.1f}%" if total and n != "time/step" else ""
            rows.append(f"<tr><td>{_e(_leaf(n))}</td><td class=num>{means[n]:.3f}</td><td class=num>{share}</td></tr>")
    return ('<table id="time-table"><tr><th>stage</th><th>mean seconds per step</th><th>share of step</th></tr>'
            + "".join(rows) + "</table>")


def _plots(metrics: RunMetrics) -> tuple[str, list[tuple[str, str]]]:
    """The sections of plots; a figure whose every metric is 0 at every step is folded into a <details> block."""
    flat = set(flat_zero_metrics(metrics))
    by_section: dict[str, list[str]] = {}
    for name in metrics.series:
        by_section.setdefault(section_of(name), []).append(name)
    titles = {s.key: s for s in SECTIONS}
    others = sorted(k for k in by_section if k.startswith("other:"))
    out, nav, absent = [], [], []
    for key in [*PAGE_ORDER, *others]:
        names = by_section.get(key, [])
        if key.startswith("other:"):
            title, y_label, sect = f"Other metrics: {key.split(':', 1)[1]}", "value", "other"
        else:
            title, y_label, sect = titles[key].title, titles[key].y_label, key
        if not names:
            absent.append(f"{title}: {EXPECTED.get(key, key)}")
            continue
        anchor = f"sec-{_slug(key)}"
        nav.append((anchor, title))
        out.append(f'<section id="{anchor}" data-section="{_e(key)}"><h2>{_e(title)}</h2>')
        if key == "time":
            out.append(_time_table(metrics, group_figures("time", names)[0].metrics))
        figures = group_figures(key, names)
        live = [f for f in figures if not all(m in flat for m in f.metrics)]
        folded = [f for f in figures if f not in live]
        out.append('<div class="figures">')
        out += [_figure(metrics, fig, sect, y_label) for fig in live]
        out.append("</div>")
        if folded:
            listed = ", ".join(m for f in folded for m in f.metrics)
            out.append(f'<details class="flat-zero" data-section="{_e(key)}"><summary>{len(folded)} plot(s) at 0 '
                       f'for every step: {_e(listed)}</summary><div class="figures">'
                       + "".join(_figure(metrics, fig, sect, y_label) for fig in folded) + "</div></details>")
        out.append("</section>")
    if absent:
        out.insert(0, _note("not logged in this run, plots skipped: " + "; ".join(absent) + "."))
    return "".join(out), nav


def _summary(metrics: RunMetrics) -> str:
    rows = []
    for name in sorted(metrics.series):
        points = metrics.points(name)
        finite = [v for _, v in points if is_finite(v)]
        cells = [f"<td>{_e(name)}</td>", f"<td class=num>{len(points)}</td>"]
        if finite:
            first = next(v for _, v in points if is_finite(v))
            last = next(v for _, v in reversed(points) if is_finite(v))
            cells += [f"<td class=num>{format_number(v)}</td>" for v in (first, last, min(finite), max(finite))]
        else:
            cells += ["<td></td>"] * 4
        cells.append(f"<td class=num>{len(points) - len(finite) or ''}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return ('<details><summary>All metrics (first, last, min, max)</summary><table id="metrics-summary">'
            '<tr><th>metric</th><th>points</th><th>first</th><th>last</th><th>min</th><th>max</th>'
            '<th>non-finite</th></tr>' + "".join(rows) + "</table></details>")


def _text_cell(value: Any) -> str:
    if value is None:
        return "<td></td>"
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, indent=1)
    cut = ""
    if len(text) > MAX_TEXT_CHARS:
        cut = f"\n... ({len(text) - MAX_TEXT_CHARS} more characters)"
        text = text[:MAX_TEXT_CHARS]
    return f"<td><pre>{_e(text + cut)}</pre></td>"


def _reward_cell(value: Any) -> str:
    number = _number(value)
    shown = format_number(number) if number is not None and math.isfinite(number) else ("" if value is None
                                                                                         else str(value))
    return f"<td class=num>{_e(shown)}</td>"


def _samples(rows: list[dict[str, Any]]) -> str:
    out = ['<section id="sec-samples"><h2>Sample generations</h2>']
    if not rows:
        out.append(_note("no sample generations recorded (samples.jsonl missing or empty)."))
        return "".join(out) + "</section>"
    by_kind: dict[str, dict[float, list[dict[str, Any]]]] = {}
    for row in rows:
        step = _number(row.get("step"))
        if step is None:
            continue
        by_kind.setdefault(str(row.get("kind", "train")), {}).setdefault(step, []).append(row)
    has_label = any(row.get("label") is not None for row in rows)
    for kind in sorted(by_kind, key=lambda k: (k != "train", k)):
        steps = sorted(by_kind[kind])
        picks = [(steps[0], "first")] + ([(steps[-1], "last")] if len(steps) > 1 else [])
        for step, which in picks:
            table_id = f"samples-{_slug(kind)}-{which}"
            out.append(f"<h3>{_e(kind)} samples, {which} step ({format_number(step)})</h3>")
            head = "<tr><th>prompt</th><th>response</th><th>reward</th>" + ("<th>label</th>" if has_label else "")
            body = []
            for row in by_kind[kind][step]:
                label = _text_cell(row.get("label")) if has_label else ""
                body.append(f"<tr>{_text_cell(row.get('prompt'))}{_text_cell(row.get('response'))}"
                            f"{_reward_cell(row.get('reward'))}{label}</tr>")
            out.append(f'<table class="samples" id="{table_id}" data-kind="{_e(kind)}" '
                       f'data-step="{format_number(step)}">{head}</tr>{"".join(body)}</table>')
    return "".join(out) + "</section>"


def _few_per_step(rows: list[dict[str, Any]], limit: int = 6) -> list[dict[str, Any]]:
    """The main page's samples: of a step's per-sample trace (every sample), the first sample of its first `limit`
    prompts, as before the trace; the samples page shows them all."""
    return [r for r in rows if "sample_index" not in r or (r.get("sample_index") == 0 and
                                                           isinstance(r.get("prompt_index"), int)
                                                           and r["prompt_index"] < limit)]


def render_report(run_dir: str | Path) -> str:
    """The report page as a string (see write_report)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run folder {run_dir} does not exist (or is not a folder); "
                          f"pass the run's --run_dir (it holds metrics.jsonl and manifest.json)")
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ReportError(f"{metrics_path} not found: is {run_dir} a run folder? A run writes metrics.jsonl "
                          f"from its first logged step on")
    metrics = read_metrics(metrics_path)
    notes = list(metrics.notes)
    manifest = read_json(run_dir / "manifest.json", notes)
    samples = read_samples(run_dir / "samples.jsonl", notes)
    if not metrics.series:
        notes.append("metrics.jsonl holds no metrics yet: nothing to plot.")
    plots, nav = _plots(metrics)
    steps = sorted({x for s in metrics.series.values() for x in s})
    command = (manifest or {}).get("command", "")
    name = command.split()[1] if command.startswith("rlhfkit ") and len(command.split()) > 1 else "run"
    title = f"rlhfkit {name} report: {run_dir.resolve().name}"
    span = f"{len(steps)} logged steps ({format_number(steps[0])} to {format_number(steps[-1])})" if steps else \
        "no logged steps"
    links = "".join(f'<a href="#{a}">{_e(t)}</a>' for a, t in
                    [*nav, ("sec-samples", "Samples"), ("reproduce-section", "Reproduce")])
    if train_steps(samples):  # the per-sample trace: its own page (write_report writes it)
        links += f'<a href="{SAMPLES_PAGE}">Samples page</a>'
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body>",
        f"<h1>{_e(title)}</h1>",
        summary_html(summarize(metrics, manifest)),
        f"<p>{_e(span)}, {metrics.rows} rows in metrics.jsonl, {len(metrics.series)} metrics.</p>",
        _header(manifest),
        "".join(_note(n) for n in notes),
        f'<nav><a href="#summary">Summary</a>{links}</nav>',
        plots,
        _summary(metrics),
        _samples(_few_per_step(samples)),
        _reproduce(manifest),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def write_samples_page(run_dir: str | Path, target: Path, step: int | None = None) -> Path | None:
    """The samples page of `step` (default: the last step with a per-sample trace) at `target`; None when
    samples.jsonl holds no trace and no step was asked for. ReportError for a step without samples."""
    samples = read_samples(Path(run_dir) / "samples.jsonl", [])
    if step is None and not train_steps(samples):
        return None
    try:
        page = render_samples_page(samples, step, f"rlhfkit report: {Path(run_dir).resolve().name}")
    except ValueError as err:
        raise ReportError(str(err)) from None
    _write_atomically(target, page)
    return target


def write_report(run_dir: str | Path, output: str | Path | None = None, step: int | None = None) -> Path:
    """Write RUN_DIR/report.html (or `output`) and return its path, and beside it samples.html, the samples page of
    `step` (default: the last step), when samples.jsonl holds the per-sample trace. ReportError if RUN_DIR is not a
    run folder, or `step` has no samples."""
    html_text = render_report(run_dir)
    target = Path(output) if output is not None else Path(run_dir) / REPORT_NAME
    write_samples_page(run_dir, target.with_name(SAMPLES_PAGE), step)
    _write_atomically(target, html_text)
    return target


def _write_atomically(target: Path, html_text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(html_text, encoding="utf-8")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
