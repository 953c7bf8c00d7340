"""The `make demo` job end to end on the tiny model (the real one runs on the embedded 135M model)."""

from __future__ import annotations

import json

import pytest

from rlhfkit.cli.demo import main as demo_main

pytestmark = pytest.mark.slow


def test_demo_runs_grpo_and_prints_before_after(tiny_model_dir, ray_cluster, tmp_path, capsys):
    run_dir = demo_main(["--pretrain", tiny_model_dir, "--steps", "2", "--eval_prompts", "4",
                         "--run_dir", str(tmp_path / "demo")])
    out = capsys.readouterr().out
    assert "before:" in out and "after:" in out and "What is" in out
    assert "precision: fp32 (auto pinned to fp32 by RLHFKIT_AUTO_DTYPE)" in out  # the suite's pin (conftest.py)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/score_mean" in r] == [0, 2]
    assert (run_dir / "report.html").stat().st_size > 10_000
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["command"].startswith("rlhfkit ppo") and "builtin:math" in manifest["command"]
    assert (run_dir / "model" / "config.json").exists()
