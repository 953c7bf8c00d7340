"""The inline-SVG line plot: scaling into the plot area, NaN/inf skipped, ticks, escaping, long series."""

from __future__ import annotations

import math
import re

from rlhfkit.observability import svg
from rlhfkit.observability.svg import Series, finite_points, line_plot, make_frame, nice_ticks


def _paths(text: str) -> dict[str, str]:
    """data-metric -> d of each series path."""
    return {m: d for m, d in re.findall(r'<path class="series" data-metric="([^"]*)" d="([^"]*)"', text)}


def _coords(d: str) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in re.findall(r"[ML](-?[\d.]+),(-?[\d.]+)", d)]


def _viewbox(text: str) -> tuple[float, float]:
    _, _, w, h = map(float, re.search(r'viewBox="([^"]+)"', text).group(1).split())
    return w, h


def test_points_are_scaled_into_the_plot_area():
    points = [(0, -3.0), (5, 10.0), (10, 2.5), (20, 7.25)]
    text = line_plot([Series("m", points)], title="t", y_label="v")
    w, h = _viewbox(text)
    coords = _coords(_paths(text)["m"])
    assert len(coords) == len(points)
    left, right = svg.MARGIN_LEFT, w - svg.MARGIN_RIGHT
    top, bottom = svg.MARGIN_TOP, h - svg.MARGIN_BOTTOM
    for x, y in coords:
        assert left - 1e-6 <= x <= right + 1e-6 and top - 1e-6 <= y <= bottom + 1e-6
    # x spans the whole width (domain = data range); larger values are higher on the page (smaller pixel y)
    assert coords[0][0] == left and coords[-1][0] == right
    xs = [x for x, _ in coords]
    assert xs == sorted(xs)
    by_value = [c for _, c in sorted(zip([p[1] for p in points], coords))]
    assert [y for _, y in by_value] == sorted((y for _, y in by_value), reverse=True)
    # the mapping is linear in the value
    frame = make_frame([Series("m", points)])
    for (sx, sy), (px, py) in zip(points, coords):
        assert math.isclose(frame.px(sx), px, abs_tol=0.06) and math.isclose(frame.py(sy), py, abs_tol=0.06)
    assert frame.y_lo <= -3.0 and frame.y_hi >= 10.0


def test_non_finite_values_are_skipped_and_break_the_line():
    points = [(1, 1.0), (2, float("nan")), (3, 3.0), (4, float("inf")), (5, 5.0), (6, 6.0)]
    kept, skipped = finite_points(points)
    assert [p[0] for p in kept] == [1, 3, 5, 6] and [p[0] for p in skipped] == [2, 4]
    text = line_plot([Series("m", points)], title="t")
    d = _paths(text)["m"]
    assert len(_coords(d)) == 4
    assert d.count("M") == 3                     # three runs: [1], [3], [5, 6]
    assert "nan" not in text.lower() and "inf" not in text.lower()
    # the y axis is scaled to the finite values only
    frame = make_frame([Series("m", points)])
    assert frame.y_hi < 100 and frame.y_lo >= 0


def test_all_non_finite_or_empty_gives_a_message_not_an_error():
    for points in ([], [(1, float("nan")), (2, float("-inf"))]):
        text = line_plot([Series("m", points)], title="t")
        assert "no finite values" in text and text.startswith("<svg") and text.endswith("</svg>")


def test_constant_and_single_point_series():
    text = line_plot([Series("c", [(1, 5.0), (2, 5.0), (3, 5.0)])], title="t")
    coords = _coords(_paths(text)["c"])
    assert len({y for _, y in coords}) == 1 and all(math.isfinite(v) for c in coords for v in c)
    one = line_plot([Series("one", [(7, 0.25)])], title="t")
    assert "<circle" in one and len(_coords(_paths(one)["one"])) == 1


def test_nice_ticks_cover_the_range_with_round_steps():
    for lo, hi in [(0, 1), (-3, 10), (0.0012, 0.0049), (1e6, 3.3e8), (5, 5), (-2, -1)]:
        ticks = nice_ticks(lo, hi)
        assert ticks[0] <= min(lo, hi) and ticks[-1] >= max(lo, hi)
        assert 2 <= len(ticks) <= 12
        steps = {round(b - a, 12) for a, b in zip(ticks, ticks[1:])}
        step = ticks[1] - ticks[0]
        mantissa = step / 10 ** math.floor(math.log10(step))
        assert any(math.isclose(mantissa, m) for m in (1, 2, 2.5, 5)), (lo, hi, ticks)
        assert max(steps) - min(steps) <= step * 1e-6


def test_text_is_escaped():
    text = line_plot([Series('a"<b>&', [(0, 1.0), (1, 2.0)])], title="<script>x</script>", x_label="<i>", y_label="&")
    assert "<script>" not in text and "&lt;script&gt;" in text
    assert 'data-metric="a&quot;&lt;b&gt;&amp;"' in text
    assert "<i>" not in text and "&amp;</text>" in text


def test_long_series_are_reduced_but_keep_extremes():
    n = 20_000
    points = [(i, math.sin(i / 300) + (5.0 if i == 12_345 else 0.0)) for i in range(n)]
    text = line_plot([Series("long", points)], title="t")
    coords = _coords(_paths(text)["long"])
    assert len(coords) <= svg.MAX_POINTS
    frame = make_frame([Series("long", points)])
    assert min(y for _, y in coords) == round(frame.py(max(p[1] for p in points)), 1)
    assert "<circle" not in text                 # no markers on long series


def test_band_and_several_series():
    a = Series("mean", [(0, 1.0), (1, 2.0), (2, 3.0)], band=[(0, 0.5, 1.5), (1, 1.5, 2.5), (2, 2.5, 3.5)])
    b = Series("other", [(0, 0.0), (2, 4.0)], dashed=True)
    text = line_plot([a, b], title="t")
    assert set(_paths(text)) == {"mean", "other"}
    assert 'class="band" data-metric="mean"' in text and "stroke-dasharray" in text
    frame = make_frame([a, b])
    assert frame.y_lo <= 0.0 and frame.y_hi >= 4.0
