"""`rlhfkit runs` and `rlhfkit compare` on two small run folders written here (metrics.jsonl + manifest.json)."""

from __future__ import annotations

import json
import re

import pytest

from rlhfkit.cli.main import main as cli


def _write_run(run_dir, command, started, rewards, extra=None, manifest=True):
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "eval/pass@1": 0.25}]
    rows += [{"step": i + 1, "rollout/reward_mean": r, "train/loss": 1.0 / (i + 1), "time/step": 2.0,
              "time/generation": 1.5, **(extra or {})} for i, r in enumerate(rewards)]
    rows.append({"step": len(rewards), "eval/pass@1": 0.5})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if manifest:
        (run_dir / "manifest.json").write_text(json.dumps({
            "command": f"rlhfkit {command} --pretrain tiny --advantage_estimator group_norm", "started": started,
            "config": {"pretrain": "tiny", "advantage_estimator": "group_norm"}}))
    return run_dir


@pytest.fixture
def two_runs(tmp_path):
    root = tmp_path / "runs"
    a = _write_run(root / "ppo-a", "ppo", "2026-01-02T10:00:00", [0.1, 0.3, 0.4], {"rollout/kl": 0.01})
    b = _write_run(root / "sweep" / "ppo-b", "ppo", "2026-01-01T09:00:00", [0.2, 0.2], {"perf/mfu_training": 0.1})
    (root / "not-a-run").mkdir()
    return root, a, b


def test_runs_lists_command_date_steps_and_outcome_oldest_first(two_runs, capsys):
    runs_dir, a, b = two_runs  # RUNS_DIR (runs_dir) given
    cli(["runs", str(runs_dir)])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["run", "command", "started", "steps", "outcome"]
    assert [line.split()[0] for line in out[1:]] == [str(b), str(a)]  # oldest first, nested folder found
    assert out[1].split()[1:4] == ["ppo", "2026-01-01T09:00:00", "3"]
    assert out[1].endswith("eval/pass@1 0.25 -> 0.5 (step 0 -> 2); rollout/reward_mean 0.2 -> 0.2 (step 1 -> 2)")
    assert "rollout/reward_mean 0.1 -> 0.4 (step 1 -> 3)" in out[2] and out[2].split()[3] == "4"


def test_runs_default_dir_without_manifest_and_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        cli(["runs"])  # runs_dir defaults to ./runs, missing here
    assert exit_info.value.code == 2 and "runs does not exist" in capsys.readouterr().err
    _write_run(tmp_path / "runs" / "bare", "sft", "", [0.5], manifest=False)
    cli(["runs"])
    line = capsys.readouterr().out.splitlines()[1]
    assert line.split()[:2] == ["runs/bare", "?"] and re.search(r"\d{4}-\d\d-\d\dT", line)  # the file's time
    (tmp_path / "empty").mkdir()
    cli(["runs", "empty"])
    assert capsys.readouterr().out.startswith("no run folders")


def test_compare_overlays_the_shared_metrics_of_two_runs(two_runs, tmp_path, capsys, run_kit):
    _, run_a, run_b = two_runs
    out = tmp_path / "cmp" / "page.html"
    cli(["compare", str(run_a), str(run_b), "--output", str(out)])
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    html = run_kit.parse_html(page)
    assert [f["data-metric"] for f in html.find("figure")] == [
        "rollout/reward_mean", "train/loss", "time/generation", "time/step", "eval/pass@1"]
    # each figure draws both runs: one series path per run, with the run's label
    paths = [p["data-metric"] for p in html.find("path") if "series" in p.get("class", "")]
    assert paths == ["A: ppo-a", "B: ppo-b"] * 5
    assert {r["data-run"] for r in html.find("tr")} == {"A: ppo-a", "B: ppo-b"}
    only = {li["data-only"]: li for li in html.find("li") if "data-only" in li}
    assert set(only) == {"A: ppo-a", "B: ppo-b"}
    assert "only in A: ppo-a (1): rollout/kl" in page and "only in B: ppo-b (1): perf/mfu_training" in page
    assert "<script" not in page and "http" not in page  # self-contained
    # the summaries of both runs head the page
    assert "rollout/reward_mean 0.1 -&gt; 0.4" in page and "MFU training 10.0%" in page


def test_compare_default_output_and_a_folder_that_is_not_a_run(two_runs, tmp_path, monkeypatch, capsys):
    _, run_a, run_b = two_runs
    monkeypatch.chdir(tmp_path)
    cli(["compare", str(run_a), str(run_b)])
    assert (tmp_path / "compare.html").is_file()  # no --output: ./compare.html
    with pytest.raises(SystemExit) as exit_info:
        cli(["compare", str(run_a), str(tmp_path)])  # run_b is not a run folder
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("rlhfkit compare: error: ") and "metrics.jsonl not found" in err
