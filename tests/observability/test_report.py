"""The run report page: content, self-containment, escaping, partial runs and errors (no browser needed)."""

from __future__ import annotations

import json
import math
import re

import pytest

from rlhfkit.cli.report import main as report_main
from rlhfkit.errors import ReportError
from rlhfkit.observability.report import REPORT_NAME, read_metrics, section_of, write_report


@pytest.fixture
def full_report(tmp_path, run_kit):
    run = run_kit.make_run(tmp_path / "run")
    path = write_report(run)
    return path, path.read_text(encoding="utf-8")


def test_report_has_every_plot_header_samples_and_reproduce(full_report, run_kit):
    path, text = full_report
    assert path.name == REPORT_NAME and path.parent.name == "run"
    page = run_kit.parse_html(text)
    metrics = page.figure_metrics()
    missing = [m for m in run_kit.EXPECTED_METRICS if m not in metrics]
    assert not missing, f"no figure for {missing}"
    for fig in page.find("figure"):
        assert fig["id"].startswith("fig-") and fig["data-metric"]
    assert len(page.find("figcaption")) == len(page.find("figure")) == len(page.find("svg"))
    series = {a["data-metric"] for a in page.find("path") if a.get("class") == "series"}
    assert set(run_kit.EXPECTED_METRICS) <= series
    # axis labels on every plot
    assert text.count('class="xlabel"') == text.count('class="ylabel"') == len(page.find("svg"))
    # every per-stage time in one figure, with a mean-seconds table
    time_fig = next(f for f in page.find("figure") if f["id"] == "fig-time")
    assert {f"time/{s}" for s in run_kit.TIME_STAGES} <= set(time_fig["data-metric"].split())
    assert 'id="time-table"' in text
    # header from the manifest, and the reproduce command with the SHA
    body = " ".join(page.text)
    for fact in ("0123456789abcdef0123456789abcdef01234567", "torch 2.13.0", "cpu_count: 2", "seed"):
        assert fact in body
    reproduce = re.search(r'<pre id="reproduce">(.*?)</pre>', text, re.S).group(1)
    assert reproduce.startswith("git checkout 0123456789abcdef")
    assert "rlhfkit ppo --pretrain embedded:smollm2-135m-instruct --seed 7" in reproduce
    assert "&lt;b&gt;{}&lt;/b&gt;" in reproduce           # the manifest command is escaped too
    # samples: first and last train step, first and last eval step
    tables = {a["id"]: a for a in page.find("table") if a.get("class") == "samples"}
    assert set(tables) == {"samples-train-first", "samples-train-last", "samples-eval-first", "samples-eval-last"}
    assert tables["samples-train-first"]["data-step"] == "1"
    assert tables["samples-train-last"]["data-step"] == str(run_kit.STEPS)
    assert tables["samples-eval-first"]["data-step"] == "0"
    assert "(step 6)" not in body                         # a middle step is not shown


def test_report_is_self_contained_and_escaped(full_report, run_kit):
    _, text = full_report
    assert "<script" not in text.lower()                  # no JS at all: the sample's <script> is escaped
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in text
    assert "&lt;b&gt;bold&lt;/b&gt; &amp; more" in text
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I), "external URL in the page"
    assert "<link" not in text and "@import" not in text and "url(" not in text
    for tag in ("img", "iframe", "object", "embed"):
        assert f"<{tag}" not in text
    hrefs = re.findall(r'href="([^"]*)"', text)
    assert hrefs and all(h.startswith("#") for h in hrefs)


def test_non_finite_values_are_noted_and_eval_step_zero_is_plotted(full_report, run_kit):
    _, text = full_report
    page = run_kit.parse_html(text)
    notes = [t for t in page.text if "non-finite" in t]
    assert any("rollout/kl: 1 non-finite value(s) skipped (nan at step 5)" in n for n in notes)
    assert any("train/policy_loss: 1 non-finite value(s) skipped (inf at step 6)" in n for n in notes)
    assert "nan" not in re.search(r'data-metric="rollout/kl" d="([^"]*)"', text).group(1).lower()
    # eval/* rows at step 0 and every 4 steps: points at those steps only
    eval_loss = re.search(r'<figure id="fig-eval-loss".*?</figure>', text, re.S).group(0)
    steps = re.findall(r"eval/loss at step (\d+):", eval_loss)
    assert steps == ["0", "4", "8", "12"]
    # the truncated last line is reported, not fatal
    assert "skipped 1 line(s) that are not JSON objects (line" in text


def test_partial_run_without_manifest_samples_or_most_metrics(tmp_path, run_kit):
    run = tmp_path / "partial"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/loss": 3.0}) + "\n" + '{"step": 1, "tr')
    text = write_report(run).read_text()
    page = run_kit.parse_html(text)
    assert page.figure_metrics() == {"eval/loss"}
    body = " ".join(page.text)
    assert "no manifest.json" in body and "no samples.jsonl" in body
    assert "not logged in this run, plots skipped: Reward: rollout/reward_mean" in body
    assert "no command recorded" in body
    # an empty metrics file (the run died before its first step) still renders
    (run / "metrics.jsonl").write_text("")
    assert "holds no metrics yet" in write_report(run).read_text()


def test_resumed_run_keeps_the_last_value_per_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "train/loss": 5.0}, {"step": 2, "train/loss": 4.0},
            {"step": 2, "train/loss": 3.5}, {"step": 3, "train/loss": "nan", "train/note": "hello"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    metrics = read_metrics(path)
    points = metrics.points("train/loss")
    assert points[:2] == [(1.0, 5.0), (2.0, 3.5)] and math.isnan(points[2][1])
    assert any("more than once" in n for n in metrics.notes)
    assert any("non-numeric" in n and "train/note" in n for n in metrics.notes)


def test_metric_sections():
    assert section_of("rollout/reward_mean") == "reward" and section_of("reward/format") == "reward"
    assert section_of("rollout/kl") == "kl" and section_of("train/approx_kl") == "kl"
    assert section_of("rollout/response_length_max") == "length"
    assert section_of("train/policy_loss") == "loss" and section_of("train/loss") == "loss"
    assert section_of("time/weight_sync") == "time"
    assert section_of("rollout/logprob_abs_diff_mean") == "mismatch" and section_of("rollout/is_ratio_mean") \
        == "mismatch"
    assert section_of("eval/reward_mean") == "eval" and section_of("eval/loss") == "eval"
    assert section_of("train/lr") == "lr" and section_of("train/critic_lr") == "lr"
    assert section_of("train/grad_norm") == "other:train" and section_of("sync/bytes") == "other:sync"


def test_missing_run_dir_or_metrics_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "nope"
    with pytest.raises(ReportError, match=re.escape(str(missing))):
        write_report(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ReportError, match=re.escape(str(empty / "metrics.jsonl"))):
        write_report(empty)
    with pytest.raises(SystemExit) as exc:
        report_main([str(missing)])
    assert exc.value.code == 2
    assert f"rlhfkit report: error: run folder {missing} does not exist" in capsys.readouterr().err


def test_cli_writes_the_page_and_honours_output(tmp_path, run_kit, capsys):
    from rlhfkit.cli.main import COMMANDS
    from rlhfkit.cli.main import main as rlhfkit_main

    assert "report" in COMMANDS
    run = run_kit.make_run(tmp_path / "run", partial_last_line=False)
    rlhfkit_main(["report", str(run)])
    assert capsys.readouterr().out.strip() == str(run / REPORT_NAME)
    assert (run / REPORT_NAME).stat().st_size > 10_000
    out = tmp_path / "elsewhere" / "r.html"
    assert report_main([str(run), "--output", str(out)]) == out and out.is_file()
    assert not list(run.glob(".*.tmp"))
