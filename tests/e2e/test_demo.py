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
    assert "the same held-out questions before (step 0) and after (step 2):" in out
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    evals = {step: [s["prompt"] for s in samples if s["kind"] == "eval" and s["step"] == step] for step in (0, 2)}
    assert evals[0] == evals[2] and len(evals[0]) == 4  # every held-out prompt (up to 16), the same at both
    assert "precision: fp32 (auto pinned to fp32 by RLHFKIT_AUTO_DTYPE)" in out  # the suite's pin (conftest.py)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/score_mean" in r] == [0, 2]
    assert (run_dir / "report.html").stat().st_size > 10_000
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["command"].startswith("rlhfkit ppo") and "builtin:math" in manifest["command"]
    assert (run_dir / "model" / "config.json").exists()


def row(prompt: str, reward: float) -> dict:
    return {"prompt": f"What is {prompt}?", "response": f"answer to {prompt}", "reward": reward}


def test_the_examples_show_the_same_prompts_fixed_first_then_still_wrong_then_the_rest():
    from rlhfkit.cli.demo import choose_examples

    before = [row("1+1", 1), row("2+2", 0), row("3+3", 0), row("4+4", 0), row("5+5", 1), row("6+6", 0)]
    after = [row("6+6", 1), row("5+5", 0), row("4+4", 0), row("3+3", 1), row("2+2", 1), row("1+1", 1)]
    chosen = choose_examples(before, after)
    assert [(label, old["prompt"]) for label, old, _ in chosen] == [
        ("fixed", "What is 6+6?"), ("fixed", "What is 3+3?"), ("still wrong", "What is 4+4?"),
        ("kept right", "What is 1+1?")]
    assert all(old["prompt"] == new["prompt"] and old["reward"] == before_reward(before, old["prompt"])
               for _, old, new in chosen)
    only_broken = choose_examples([row("1+1", 1)], [row("1+1", 0)])
    assert [(label, new["reward"]) for label, _, new in only_broken] == [("broken", 0)]
    assert choose_examples([row("1+1", 1)], [row("9+9", 1)]) == []  # no prompt evaluated at both steps


def before_reward(rows: list[dict], prompt: str) -> float:
    return next(r["reward"] for r in rows if r["prompt"] == prompt)


def test_the_real_demo_at_auto_precision_unpinned(ray_cluster, tmp_path, capsys, monkeypatch):
    """What a fresh clone's `make demo` runs, shortened: the embedded SmolLM2-135M at `auto` precision without the
    suite's fp32 pin, so a native-bf16 CPU runs bf16 (engine and trainer, the sync check on at its default bound)
    and an AVX2 CPU fp32. The driver resolves auto (workers get the resolved dtype)."""
    from rlhfkit.engine.precision import resolve_precision

    monkeypatch.delenv("RLHFKIT_AUTO_DTYPE")
    expected = resolve_precision("auto", "cpu")
    run_dir = demo_main(["--steps", "3", "--eval_prompts", "8", "--run_dir", str(tmp_path / "demo")])
    out = capsys.readouterr().out
    assert f"precision: {expected.dtype} (auto: " in out, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/step" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(0 <= r["sync/logprob_diff"] <= r["sync/logprob_bound"] for r in steps), steps
    if expected.dtype == "bf16":  # the check bites: bf16 noise is measured, well under the bound
        assert all(r["sync/logprob_diff"] > 0 for r in steps)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["precision"]["dtype"] == expected.dtype
