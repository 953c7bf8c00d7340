"""Small inline-SVG line plots for the run report: no plotting library, no network, no JavaScript.

`line_plot` draws one or more series against the step on shared axes with "nice" ticks. Non-finite values
(NaN, +-inf) are skipped and break the line there, so a gap is visible where a value was missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#7f7f7f", "#bcbd22"]

WIDTH, HEIGHT = 640, 280
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 70, 16, 12, 44
MARKER_LIMIT = 60       # draw a dot at every point when a series has at most this many
MAX_POINTS = 2000       # longer series are reduced to per-bucket min/max (the shape survives)


@dataclass
class Series:
    """One line: `points` are (step, value); `band` optional (step, low, high) drawn as a shaded area."""

    name: str
    points: list[tuple[float, float]]
    band: list[tuple[float, float, float]] | None = None
    dashed: bool = False
    color: str | None = None


@dataclass
class Frame:
    """The data-to-pixel mapping of one plot (exposed for tests)."""

    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float
    x_ticks: list[float] = field(default_factory=list)
    y_ticks: list[float] = field(default_factory=list)
    width: int = WIDTH
    height: int = HEIGHT

    @property
    def left(self) -> float:
        return MARGIN_LEFT

    @property
    def right(self) -> float:
        return self.width - MARGIN_RIGHT

    @property
    def top(self) -> float:
        return MARGIN_TOP

    @property
    def bottom(self) -> float:
        return self.height - MARGIN_BOTTOM

    def px(self, x: float) -> float:
        return self.left + (x - self.x_lo) / (self.x_hi - self.x_lo) * (self.right - self.left)

    def py(self, y: float) -> float:
        return self.bottom - (y - self.y_lo) / (self.y_hi - self.y_lo) * (self.bottom - self.top)


def is_finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def finite_points(points: list[tuple[float, float]]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Split into (finite points, skipped points)."""
    kept = [(x, y) for x, y in points if is_finite(x) and is_finite(y)]
    skipped = [(x, y) for x, y in points if not (is_finite(x) and is_finite(y))]
    return kept, skipped


def nice_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Ticks at 1/2/5 x 10^k covering [lo, hi] (about `target` of them)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(1, target)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(lo / step + 1e-9) * step
    last = math.ceil(hi / step - 1e-9) * step
    count = int(round((last - first) / step))
    return [_clean(first + i * step, step) for i in range(count + 1)]


def _clean(value: float, step: float) -> float:
    digits = max(0, -math.floor(math.log10(step)) + 2)
    return round(value, digits)


def format_number(value: float) -> str:
    """Compact label: 0.001, 1.5e-06, 12000, 1.2e+08."""
    if value == 0:
        return "0"
    if abs(value) >= 1e5 or abs(value) < 1e-3:
        return f"{value:.3g}"
    return f"{value:.6g}"


def _downsample(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    if len(points) <= MAX_POINTS:
        return points
    buckets = MAX_POINTS // 2
    size = len(points) / buckets
    out: list[tuple[float, float]] = []
    for b in range(buckets):
        chunk = points[int(b * size):int((b + 1) * size)]
        if not chunk:
            continue
        lo = min(chunk, key=lambda p: p[1])
        hi = max(chunk, key=lambda p: p[1])
        out.extend(sorted({lo, hi}))
    return out


def make_frame(series: list[Series], width: int = WIDTH, height: int = HEIGHT) -> Frame | None:
    """Axes covering every finite point (and band) of every series; None when there is nothing finite."""
    xs: list[float] = []
    ys: list[float] = []
    for s in series:
        kept, _ = finite_points(s.points)
        xs += [x for x, _ in kept]
        ys += [y for _, y in kept]
        for x, lo, hi in s.band or []:
            if is_finite(x) and is_finite(lo) and is_finite(hi):
                xs.append(x)
                ys += [lo, hi]
    if not xs:
        return None
    x_lo, x_hi = min(xs), max(xs)
    if x_lo == x_hi:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    x_ticks = [t for t in nice_ticks(x_lo, x_hi, 6) if x_lo <= t <= x_hi]
    y_ticks = nice_ticks(min(ys), max(ys), 5)
    return Frame(x_lo, x_hi, y_ticks[0], y_ticks[-1], x_ticks, y_ticks, width, height)


def _segments(points: list[tuple[float, float]]) -> list[list[tuple[float, float]]]:
    """Runs of consecutive finite points (a non-finite point ends a run)."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        if is_finite(x) and is_finite(y):
            runs[-1].append((x, y))
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]


def _path(frame: Frame, points: list[tuple[float, float]]) -> str:
    return " ".join(f"{'M' if i == 0 else 'L'}{frame.px(x):.1f},{frame.py(y):.1f}" for i, (x, y) in enumerate(points))


def line_plot(series: list[Series], title: str, x_label: str = "step", y_label: str = "",
              width: int = WIDTH, height: int = HEIGHT) -> str:
    """An `<svg>` element: axes, ticks, grid, axis labels and one `<path class="series" data-metric=...>` per series.

    Returns an SVG with a "no finite values" message when no series has a finite point.
    """
    frame = make_frame(series, width, height)
    out = [f'<svg class="plot" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
           f'aria-label="{escape(title)}"><title>{escape(title)}</title>']
    if frame is None:
        out.append(f'<text class="empty" x="{width / 2:.0f}" y="{height / 2:.0f}" text-anchor="middle">'
                   f'no finite values to plot</text></svg>')
        return "".join(out)
    out.append(_axes(frame, x_label, y_label))
    for i, s in enumerate(series):
        color = s.color or PALETTE[i % len(PALETTE)]
        name = escape(s.name)
        if s.band:
            for band_run in _band_runs(s.band):
                upper = [(x, hi) for x, _, hi in band_run]
                lower = [(x, lo) for x, lo, _ in reversed(band_run)]
                d = _path(frame, upper) + " " + _path(frame, lower).replace("M", "L", 1) + " Z"
                out.append(f'<path class="band" data-metric="{name}" d="{d}" fill="{color}" fill-opacity="0.15" '
                           f'stroke="none"/>')
        runs = [_downsample(r) for r in _segments(s.points)]
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        d = " ".join(_path(frame, r) for r in runs)
        out.append(f'<path class="series" data-metric="{name}" d="{d}" fill="none" stroke="{color}" '
                   f'stroke-width="1.8" stroke-linejoin="round"{dash}/>')
        n_points = sum(len(r) for r in runs)
        for run in runs:
            if n_points <= MARKER_LIMIT or len(run) == 1:
                for x, y in run:
                    out.append(f'<circle class="point" data-metric="{name}" cx="{frame.px(x):.1f}" '
                               f'cy="{frame.py(y):.1f}" r="2.6" fill="{color}"><title>{name} at step '
                               f'{format_number(x)}: {format_number(y)}</title></circle>')
    out.append("</svg>")
    return "".join(out)


def _band_runs(band: list[tuple[float, float, float]]) -> list[list[tuple[float, float, float]]]:
    runs: list[list[tuple[float, float, float]]] = [[]]
    for x, lo, hi in band:
        if is_finite(x) and is_finite(lo) and is_finite(hi):
            runs[-1].append((x, lo, hi))
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if len(r) > 1]


def _axes(frame: Frame, x_label: str, y_label: str) -> str:
    parts = []
    for t in frame.y_ticks:
        y = frame.py(t)
        parts.append(f'<line class="grid" x1="{frame.left}" x2="{frame.right}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'stroke="#e5e5e5"/>')
        parts.append(f'<text class="tick" x="{frame.left - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{format_number(t)}</text>')
    for t in frame.x_ticks:
        x = frame.px(t)
        parts.append(f'<line class="grid" x1="{x:.1f}" x2="{x:.1f}" y1="{frame.top}" y2="{frame.bottom}" '
                     f'stroke="#f0f0f0"/>')
        parts.append(f'<text class="tick" x="{x:.1f}" y="{frame.bottom + 16}" text-anchor="middle">'
                     f'{format_number(t)}</text>')
    parts.append(f'<path class="axis" d="M{frame.left},{frame.top} L{frame.left},{frame.bottom} '
                 f'L{frame.right},{frame.bottom}" fill="none" stroke="#444"/>')
    cx = (frame.left + frame.right) / 2
    parts.append(f'<text class="xlabel" x="{cx:.0f}" y="{frame.height - 6}" text-anchor="middle">'
                 f'{escape(x_label)}</text>')
    cy = (frame.top + frame.bottom) / 2
    parts.append(f'<text class="ylabel" x="14" y="{cy:.0f}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {cy:.0f})">{escape(y_label)}</text>')
    return "".join(parts)
