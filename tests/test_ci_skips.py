"""CI cannot go green without its checks: under `CI`, a skip other than a GPU-only one is a failure."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pytest(test: str, **env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, **env})


@pytest.mark.slow
def test_a_browser_test_that_cannot_render_fails_under_ci():
    done = _pytest("tests/observability/test_report_browser.py", CI="true", RLHFKIT_CHROMIUM="/nonexistent/chromium")
    assert done.returncode == 1, done.stdout[-2000:]
    assert "skipped in CI, where only GPU-only tests may skip: " in done.stdout
    assert "no Chromium binary" in done.stdout


@pytest.mark.slow
def test_gpu_only_skips_stay_skips_under_ci():
    done = _pytest("tests/engine/test_gpu.py", CI="true")
    if "passed" in done.stdout.splitlines()[-1]:
        pytest.skip("this machine has CUDA: the GPU tests ran")  # the CI guard allows this skip (it names CUDA)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "skipped" in done.stdout.splitlines()[-1]
