"""The run summary (rlhfkit/observability/summary.py): its numbers equal those computed here from metrics.jsonl and
manifest.json independently; the report opens with it and folds flat-zero plots away; the console lines of
`rlhfkit ppo` and the offline commands carry the same facts."""

from __future__ import annotations

import json

from rlhfkit.observability.report import render_report
from rlhfkit.observability.summary import command_name, summarize_run, summary_lines


def _with_perf(run_dir):
    """Add perf/* and a flat-zero diagnostic to the conftest run (its last line is partial: rewrite it whole)."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    for row in rows:
        if "train/loss" in row:
            row.update({"perf/generation_tokens_per_s": 100.0 + row["step"], "perf/mfu_training": 0.01 * row["step"],
                        "rollout/truncated_ratio": 0.0, "train/dynamic_filter_dropped": 0})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _independent(rows, name):
    points = sorted((r["step"], float(r[name])) for r in rows if name in r)
    return points


def test_summary_numbers_equal_those_computed_from_the_files(tmp_path, run_kit):
    run = run_kit.make_run(tmp_path / "run")
    rows = _with_perf(run)
    manifest = json.loads((run / "manifest.json").read_text())
    s = summarize_run(run)
    assert s.command == "ppo" and s.model == manifest["config"]["pretrain"] and s.estimator is None
    assert s.steps == len({r["step"] for r in rows})
    reward = _independent(rows, "rollout/reward_mean")
    assert (s.train.metric, s.train.first, s.train.last) == ("rollout/reward_mean", reward[0][1], reward[-1][1])
    evals = _independent(rows, "eval/reward_mean")
    assert (s.eval.metric, s.eval.first, s.eval.last) == ("eval/reward_mean", evals[0][1], evals[-1][1])
    assert (s.eval.first_step, s.eval.last_step) == (0, run_kit.STEPS)
    step_times = [t for _, t in _independent(rows, "time/step")]
    assert s.step_seconds == sum(step_times) / len(step_times)
    stages = {stage: seconds for stage, seconds, _ in s.stages}
    for stage in run_kit.TIME_STAGES:
        values = [t for _, t in _independent(rows, f"time/{stage}")]
        assert stages[stage] == sum(values) / len(values)
    shares = {stage: share for stage, _, share in s.stages}
    assert abs(shares["generation"] - 3.0 / 7.0) < 1e-12
    tps = [v for _, v in _independent(rows, "perf/generation_tokens_per_s")]
    assert s.tokens_per_s == sum(tps) / len(tps)
    mfu = [v for _, v in _independent(rows, "perf/mfu_training")]
    assert s.mfu == {"perf/mfu_training": sum(mfu) / len(mfu)}
    assert s.flat_zero == ["rollout/truncated_ratio", "train/dynamic_filter_dropped"]
    lines = summary_lines(s)
    assert lines[0].startswith("ran:     rlhfkit ppo, model embedded:smollm2-135m-instruct")
    assert "eval/reward_mean 0.1 -> 0.7 (step 0 -> 12)" in lines[1] and "rollout/reward_mean 0.05 -> 0.6" in lines[1]
    assert lines[2].startswith("time:    7 s per step: generation 3 s (42.9%)")
    assert lines[3] == "speed:   generation 106.5 tokens/s, MFU training 6.5%"


def test_report_opens_with_the_summary_and_folds_flat_zero_plots(tmp_path, run_kit):
    run = run_kit.make_run(tmp_path / "run")
    _with_perf(run)
    page = render_report(run)
    assert page.index('id="summary"') < page.index('id="run-info"') < page.index('id="sec-reward"')
    html = run_kit.parse_html(page)
    rows = {a["data-row"] for a in html.find("tr") if "data-row" in a}
    assert rows == {"what ran", "outcome", "time", "speed", "flat at zero"}
    folded = html.find("details")
    flat = [d for d in folded if "flat-zero" in d.get("class", "")]
    assert {d["data-section"] for d in flat} == {"length", "other:train"}
    # the folded figures are inside their <details> (after it opens, before the next section)
    length = page[page.index('id="sec-length"'):]
    length = length[:length.index("</section>")]
    assert length.index("<details") < length.index('data-metric="rollout/truncated_ratio"')
    assert length.index('data-metric="rollout/response_length') < length.index("<details")


def test_summary_of_an_offline_run_and_the_command_name_forms(tmp_path):
    run = tmp_path / "sft"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "eval/loss": 3.0}, {"step": 1, "train/loss": 2.5}, {"step": 2, "train/loss": 2.0,
                                                                        "eval/loss": 2.2}]))
    (run / "manifest.json").write_text(json.dumps({"command": "torchrun --nproc_per_node 2 -m rlhfkit.cli.sft "
                                                              "--pretrain m", "config": {"pretrain": "m"}}))
    s = summarize_run(run)
    assert s.command == "sft" and s.eval.text() == "eval/loss 3 -> 2.2 (step 0 -> 2)"
    assert s.train.text() == "train/loss 2.5 -> 2 (step 1 -> 2)"
    assert summary_lines(s) == ["ran:     rlhfkit sft, model m; 3 logged steps",
                                "outcome: eval/loss 3 -> 2.2 (step 0 -> 2); train/loss 2.5 -> 2 (step 1 -> 2)"]
    assert command_name("rlhfkit batch-inference --x 1") == "batch-inference" and command_name("") is None
