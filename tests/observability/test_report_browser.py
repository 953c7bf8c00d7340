"""Render the run report in headless Chromium: the DOM after rendering has every plot, and a screenshot is a
real picture (not blank). Skipped, with the reason, when no Chromium binary is installed."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from rlhfkit.observability.report import write_report

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars"]
WINDOW = (1200, 2000)


def find_browser() -> str | None:
    explicit = os.environ.get("RLHFKIT_CHROMIUM")
    if explicit:  # a path that does not exist counts as no browser (and names itself in the skip reason)
        return explicit if shutil.which(explicit) else None
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, run_kit):
    browser = find_browser()
    if browser is None:
        pytest.skip("no Chromium binary (looked for chromium, chromium-browser, google-chrome; or set "
                    "RLHFKIT_CHROMIUM): install it with `apt-get install -y chromium` to run the browser test")
    root = tmp_path_factory.mktemp("browser")
    report = write_report(run_kit.make_run(root / "run"))
    url = report.resolve().as_uri()

    def run(*extra: str) -> subprocess.CompletedProcess:
        profile = root / f"profile-{len(list(root.glob('profile-*')))}"
        cmd = [browser, *FLAGS, f"--user-data-dir={profile}", *extra, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=90, cwd=root)

    dom = run("--dump-dom")
    assert dom.returncode == 0 and "<figure" in dom.stdout, f"chromium --dump-dom failed: {dom.stderr[-2000:]}"
    png = root / "report.png"
    shot = run(f"--screenshot={png}", f"--window-size={WINDOW[0]},{WINDOW[1]}")
    assert shot.returncode == 0 and png.is_file(), f"chromium --screenshot failed: {shot.stderr[-2000:]}"
    return dom.stdout, png


def test_dom_after_rendering_has_every_plot(rendered, run_kit):
    dom, _ = rendered
    page = run_kit.parse_html(dom)
    figures = page.find("figure")
    metrics = page.figure_metrics()
    missing = [m for m in run_kit.EXPECTED_METRICS if m not in metrics]
    assert not missing, f"rendered DOM has no figure for {missing}"
    assert len(page.find("svg")) == len(figures) >= 10
    drawn = {a["data-metric"] for a in page.find("path") if a.get("class") == "series" and a.get("d")}
    assert set(run_kit.EXPECTED_METRICS) <= drawn
    assert page.find("table")                      # header, samples, time table survive rendering
    assert "&lt;script&gt;" in dom and "<script>alert" not in dom


def _png_rows(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and the (still filtered) scanlines of an 8-bit non-interlaced PNG, with zlib only."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and interlace == 0, header
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[colour]
    raw = zlib.decompress(idat)
    stride = 1 + width * channels
    assert len(raw) == stride * height
    return width, height, [raw[i * stride:(i + 1) * stride] for i in range(height)]


def test_screenshot_is_a_real_picture(rendered):
    _, png = rendered
    assert png.stat().st_size > 30_000, f"screenshot suspiciously small: {png.stat().st_size} bytes"
    width, height, rows = _png_rows(png)
    assert (width, height) == WINDOW
    # a blank or single-colour page compresses to a handful of distinct scanlines and byte values
    assert len(set(rows)) > 200, "screenshot looks blank (too few distinct rows)"
    assert len(set(b"".join(rows))) > 64, "screenshot looks blank (too few distinct byte values)"
