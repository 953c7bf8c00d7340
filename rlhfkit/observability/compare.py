"""`rlhfkit compare RUN_A RUN_B`: one self-contained HTML page overlaying the two runs' curves, one plot per metric
they both logged (the report's SVG plotting, rlhfkit.observability.svg), in the report's section order, with each
run's summary above and the metrics only one of them logged listed at the end."""

from __future__ import annotations

import os
from html import escape
from pathlib import Path

from rlhfkit.errors import ReportError
from rlhfkit.observability.report import CSS, PAGE_ORDER, SECTIONS, section_of
from rlhfkit.observability.runfiles import RunMetrics, read_json, read_metrics
from rlhfkit.observability.summary import outcome_line, perf_line, summarize, time_line, what_ran
from rlhfkit.observability.svg import PALETTE, Series, line_plot

COMPARE_NAME = "compare.html"


def _load(run_dir: Path) -> tuple[RunMetrics, dict | None]:
    if not (run_dir / "metrics.jsonl").is_file():
        raise ReportError(f"{run_dir / 'metrics.jsonl'} not found: is {run_dir} a run folder? (`rlhfkit runs` lists "
                          "them)")
    return read_metrics(run_dir / "metrics.jsonl"), read_json(run_dir / "manifest.json", [])


def labels(a: Path, b: Path) -> tuple[str, str]:
    """The runs' names on the page: their folder names, prefixed A/B (the names may be equal)."""
    return f"A: {a.resolve().name}", f"B: {b.resolve().name}"


def shared_metrics(a: RunMetrics, b: RunMetrics) -> list[str]:
    """Metrics both runs logged, in the report's section order (then by name)."""
    order = {key: i for i, key in enumerate(PAGE_ORDER)}
    common = set(a.series) & set(b.series)
    return sorted(common, key=lambda m: (order.get(section_of(m), len(order)), section_of(m), m))


def render_compare(run_a: str | Path, run_b: str | Path) -> str:
    a_dir, b_dir = Path(run_a), Path(run_b)
    (a, a_manifest), (b, b_manifest) = _load(a_dir), _load(b_dir)
    label_a, label_b = labels(a_dir, b_dir)
    titles = {s.key: s.title for s in SECTIONS}
    rows = []
    for label, run_dir, metrics, manifest in ((label_a, a_dir, a, a_manifest), (label_b, b_dir, b, b_manifest)):
        s = summarize(metrics, manifest)
        facts = [what_ran(s) + f"; {s.steps} logged steps", outcome_line(s), time_line(s), perf_line(s)]
        rows.append(f'<tr data-run="{escape(label)}"><th>{escape(label)}</th><td><code>{escape(str(run_dir))}</code>'
                    "<br>" + "<br>".join(escape(f) for f in facts if f) + "</td></tr>")
    figures, section = [], None
    for metric in shared_metrics(a, b):
        key = section_of(metric)
        if key != section:
            if section is not None:
                figures.append("</div>")
            title = titles.get(key, f"Other metrics: {key.split(':', 1)[-1]}")
            figures.append(f'<h2 data-section="{escape(key)}">{escape(title)}</h2><div class="figures">')
            section = key
        series = [Series(label_a, a.points(metric), color=PALETTE[0]),
                  Series(label_b, b.points(metric), color=PALETTE[1])]
        legend = "".join(f'<li><span style="background:{s.color}"></span>{escape(s.name)}</li>' for s in series)
        figures.append(f'<figure data-metric="{escape(metric)}"><figcaption>{escape(metric)}</figcaption>'
                       f'{line_plot(series, title=metric, y_label=metric.rsplit("/", 1)[-1])}'
                       f'<ul class="legend">{legend}</ul></figure>')
    if section is not None:
        figures.append("</div>")
    else:
        figures.append('<p class="note">the two runs share no metric: nothing to overlay.</p>')
    only = []
    for label, mine, other in ((label_a, a, b), (label_b, b, a)):
        names = sorted(set(mine.series) - set(other.series))
        if names:
            only.append(f'<li data-only="{escape(label)}">only in {escape(label)} ({len(names)}): '
                        f'{escape(", ".join(names))}</li>')
    title = f"rlhfkit compare: {label_a} vs {label_b}"
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             '<meta name="viewport" content="width=device-width, initial-scale=1">',
             f"<title>{escape(title)}</title><style>{CSS}</style></head><body>", f"<h1>{escape(title)}</h1>",
             f'<table class="kv" id="runs">{"".join(rows)}</table>', *figures]
    if only:
        parts.append(f'<h2>Not shared</h2><ul id="not-shared">{"".join(only)}</ul>')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_compare(run_a: str | Path, run_b: str | Path, output: str | Path | None = None) -> Path:
    """Write the page to `output` (default ./compare.html) and return its path; ReportError for a non-run folder."""
    html_text = render_compare(run_a, run_b)
    target = Path(output) if output is not None else Path(COMPARE_NAME)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    tmp.write_text(html_text, encoding="utf-8")
    os.replace(tmp, target)
    return target
