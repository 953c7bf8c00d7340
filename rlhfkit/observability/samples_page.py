"""The report's samples page, `samples.html` beside `report.html`: the per-sample trace (`samples.jsonl`, written by
`rlhfkit.observability.trace`) of one step as a table sortable by every column (a few lines of inline JavaScript:
click a header; no external assets, it renders offline), and for the selected sample (click a row; the first one
at first) its response tokens coloured by advantage and by engine-vs-trainer log-prob mismatch.
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

SAMPLES_PAGE = "samples.html"
MAX_CELL_CHARS = 200  # prompt and response cells are cut (the token view shows the whole response)

# (header, key, tooltip)
COLUMNS = [
    ("row", None, "row of the step's training batch"),
    ("prompt", "prompt_index", "prompt index within the step"),
    ("sample", "sample_index", "sample index within its prompt's group"),
    ("reward", "reward", "training reward"),
    ("score", "score", "task score"),
    ("advantage", "advantage", "mean advantage over the sample's trained tokens"),
    ("adv first", "advantage_first", "advantage of its first trained token"),
    ("loss weight", "loss_weight", "its share of the policy loss's denominator, summed over optimizer steps"),
    ("version", "policy_version", "optimizer step whose weights generated it (its oldest token's, partial rollouts)"),
    ("stale", "staleness", "policy versions between its oldest token and the trainer of its step"),
    ("mismatch mean", "logprob_abs_diff_mean", "mean |rollout - trainer log-prob| over its trained tokens"),
    ("mismatch max", "logprob_abs_diff_max", "max |rollout - trainer log-prob| over its trained tokens"),
    ("length", "response_length", "response tokens"),
    ("trained", "trained_tokens", "response tokens in the loss"),
    ("turns", "turns", "agent turns"),
    ("finish", "finish_reason", "stop or length"),
]

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1600px;
padding:16px 24px;color:#222;background:#fff}
h1{font-size:22px;margin:8px 0}h2{font-size:18px;margin:24px 0 8px}
table{border-collapse:collapse;font-size:12px}th,td{border:1px solid #ddd;padding:3px 6px;text-align:left;
vertical-align:top}th{background:#f4f4f4;cursor:pointer;user-select:none;position:sticky;top:0}
td.num{text-align:right;font-variant-numeric:tabular-nums}tr.sample:hover{background:#f0f6ff;cursor:pointer}
tr.selected{background:#dde9ff}.note{color:#8a5a00;background:#fff6e0;padding:6px 10px;border-radius:4px}
.tok{white-space:pre-wrap;font:12px/1.9 ui-monospace,Menlo,Consolas,monospace;border:1px solid #ddd;padding:6px}
.tok span{border-radius:2px}.legend{color:#555;font-size:12px}pre{margin:0;white-space:pre-wrap}
"""

SCRIPT = """
function sortBy(th){const t=document.getElementById('samples-table'),i=th.cellIndex,
asc=th.dataset.dir!=='asc';th.dataset.dir=asc?'asc':'desc';
const rows=Array.from(t.tBodies[0].rows);
const key=r=>{const c=r.cells[i],v=c.dataset.v;if(v===undefined)return c.textContent;
return v===''?NaN:parseFloat(v)};
rows.sort((a,b)=>{let x=key(a),y=key(b);if(typeof x==='number'&&typeof y==='number'){
if(isNaN(x))return 1;if(isNaN(y))return -1;return asc?x-y:y-x}
x=String(x);y=String(y);return asc?x.localeCompare(y):y.localeCompare(x)});
rows.forEach(r=>t.tBodies[0].appendChild(r))}
function pick(tr){document.querySelectorAll('tr.selected').forEach(r=>r.classList.remove('selected'));
tr.classList.add('selected');document.querySelectorAll('div.sample-tokens').forEach(d=>d.hidden=true);
document.getElementById('tokens-'+tr.dataset.row).hidden=false}
"""


def _e(value: Any) -> str:
    return escape(str(value), quote=True)


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _cell(value: Any) -> str:
    number = _num(value)
    if number is not None:
        return f'<td class=num data-v="{number!r}">{_e(_fmt(number))}</td>'
    if value is None:
        return '<td class=num data-v=""></td>'
    return f"<td>{_e(value)}</td>"


def _text(value: Any) -> str:
    text = "" if value is None else str(value)
    cut = f" ... (+{len(text) - MAX_CELL_CHARS} chars)" if len(text) > MAX_CELL_CHARS else ""
    return f"<td><pre>{_e(text[:MAX_CELL_CHARS] + cut)}</pre></td>"


def _colour(value: float | None, scale: float, signed: bool) -> str:
    """Background colour: green for positive, red for negative (signed) or orange (unsigned), alpha by |value|."""
    if value is None or scale <= 0:
        return "background:#eee"  # not trained (environment tokens) or no value
    alpha = min(1.0, abs(value) / scale) * 0.85
    rgb = ("34,160,60" if value >= 0 else "215,48,39") if signed else "240,120,0"
    return f"background:rgba({rgb},{alpha:.3f})"


def _scale(rows: list[dict[str, Any]], key: str) -> float:
    values = [abs(v) for r in rows for v in (r.get(key) or []) if _num(v) is not None]
    return max(values, default=0.0)


def _token_line(tokens: list[str], values: list[Any] | None, scale: float, signed: bool, what: str) -> str:
    if values is None:
        return f'<p class="note">no {_e(what)} recorded for this sample.</p>'
    spans = []
    for token, value in zip(tokens, values):
        number = _num(value)
        tip = f"{what} {_fmt(number)}" if number is not None else "not trained"
        spans.append(f'<span style="{_colour(number, scale, signed)}" title="{_e(tip)}">{_e(token)}</span>')
    return f'<div class="tok">{"".join(spans)}</div>'


def _tokens(row: dict[str, Any], i: int, adv_scale: float, diff_scale: float) -> str:
    tokens = row.get("tokens") or []
    head = (f"<h2>row {i}: prompt {_e(row.get('prompt_index'))}, sample {_e(row.get('sample_index'))}, "
            f"reward {_e(row.get('reward'))}, advantage {_e(row.get('advantage'))}</h2>")
    prompt = f"<p><b>prompt</b></p><pre>{_e(row.get('prompt') or '')}</pre>"
    return (f'<div class="sample-tokens" id="tokens-{i}"{"" if i == 0 else " hidden"}>{head}{prompt}'
            f"<p><b>response tokens coloured by advantage</b> <span class=legend>(green positive, red negative, "
            f"full colour at |advantage| = {_fmt(adv_scale)}; grey: not trained)</span></p>"
            f"{_token_line(tokens, row.get('token_advantages'), adv_scale, True, 'advantage')}"
            f"<p><b>response tokens coloured by log-prob mismatch</b> <span class=legend>(|rollout - trainer "
            f"log-prob|, full colour at {_fmt(diff_scale)}; grey: not trained)</span></p>"
            f"{_token_line(tokens, row.get('token_logprob_abs_diff'), diff_scale, False, 'mismatch')}</div>")


def train_steps(samples: list[dict[str, Any]]) -> list[int]:
    """The steps that have per-sample trace rows (kind train, with a sample_index)."""
    return sorted({int(r["step"]) for r in samples if _is_trace(r)})


def _is_trace(row: dict[str, Any]) -> bool:
    return row.get("kind", "train") == "train" and "sample_index" in row and _num(row.get("step")) is not None


def render_samples_page(samples: list[dict[str, Any]], step: int | None, title: str) -> str:
    """The page for `step` (None: the last step with trace rows). ValueError if `step` has no trace rows."""
    steps = train_steps(samples)
    if step is None and steps:
        step = steps[-1]
    if step is not None and step not in steps:
        raise ValueError(f"--step {step}: samples.jsonl has no samples of that step (steps with samples: "
                         f"{_ranges(steps) or 'none'})")
    rows = [r for r in samples if _is_trace(r) and int(r["step"]) == step]
    components = sorted({k for r in rows for k in (r.get("reward_components") or {})})
    head = "".join(f'<th title="{_e(tip)}" onclick="sortBy(this)">{_e(name)}</th>' for name, _, tip in COLUMNS)
    head += "".join(f'<th title="reward component" onclick="sortBy(this)">{_e(c)}</th>' for c in components)
    head += '<th onclick="sortBy(this)">prompt text</th><th onclick="sortBy(this)">response</th>'
    body = []
    for i, row in enumerate(rows):
        cells = "".join(_cell(i) if key is None else _cell(row.get(key)) for _, key, _ in COLUMNS)
        cells += "".join(_cell((row.get("reward_components") or {}).get(c)) for c in components)
        cells += _text(row.get("prompt")) + _text(row.get("response"))
        selected = " selected" if i == 0 else ""
        body.append(f'<tr class="sample{selected}" data-row="{i}" onclick="pick(this)">{cells}</tr>')
    adv_scale, diff_scale = _scale(rows, "token_advantages"), _scale(rows, "token_logprob_abs_diff")
    other = f"steps with samples: {_ranges(steps)}; another step: <code>rlhfkit report RUN_DIR --step N</code>" \
        if steps else ""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{_e(title)}: samples of step {_e(step)}</title><style>{CSS}</style>"
             f"<script>{SCRIPT}</script></head><body>",
             f"<h1>{_e(title)}: samples of step {_e(step)}</h1>",
             '<p><a href="report.html">back to the report</a>. ' + other + "</p>"]
    if not rows:
        parts.append('<p class="note">no per-sample trace in samples.jsonl (runs before the trace, or an offline '
                     "trainer).</p></body></html>")
        return "\n".join(parts) + "\n"
    parts += [f"<p>{len(rows)} samples. Click a column header to sort, a row to show its tokens below.</p>",
              f'<table id="samples-table" data-step="{_e(step)}"><thead><tr>{head}</tr></thead>'
              f"<tbody>{''.join(body)}</tbody></table>",
              *(_tokens(row, i, adv_scale, diff_scale) for i, row in enumerate(rows)),
              "</body></html>"]
    return "\n".join(parts) + "\n"


def _ranges(steps: list[int]) -> str:
    out, start = [], None
    for k, s in enumerate(steps):
        if start is None:
            start = s
        if k + 1 == len(steps) or steps[k + 1] != s + 1:
            out.append(str(start) if start == s else f"{start}-{s}")
            start = None
    return ", ".join(out)
