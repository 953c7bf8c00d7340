"""The pure logic of `make bench-peers` (#11): steady steps, medians over repeats, ratios, run order, the table,
and the rlhfkit side's flags and process labels. No model runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


stats = _load("peers_stats")
side = _load("peers_rlhfkit")


def test_steady_drops_the_warmup_steps_but_never_everything():
    assert stats.steady([9.0, 2.0, 3.0], warmup=1) == [2.0, 3.0]
    assert stats.steady([9.0], warmup=1) == [9.0]  # a --quick run keeps its only step
    assert stats.steady([9.0, 2.0], warmup=0) == [9.0, 2.0]


def test_median_and_ratio_skip_missing_values():
    assert stats.median_or_none([3.0, None, 1.0, 2.0]) == 2.0
    assert stats.median_or_none([None]) is None
    assert stats.ratio(30.0, 10.0) == 3.0
    assert stats.ratio(None, 10.0) is None and stats.ratio(30.0, 0.0) is None


def _run(median: float, trainer: float, error: str | None = None) -> dict:
    return {"step_median": median, "peak_mb": {"trainer": trainer}, "stages": {"generation": median / 2},
            "response_length": 32.0, "error": error}


def test_summary_is_the_median_over_repeats_of_each_runs_median_and_ignores_failed_runs():
    runs = [_run(10.0, 100.0), _run(14.0, 300.0), _run(11.0, 200.0), _run(99.0, 999.0, error="boom")]
    s = stats.summarize_runs(runs)
    assert s["step_median"] == 11.0
    assert s["step_medians"] == [10.0, 14.0, 11.0]
    assert s["peak_mb"] == {"trainer": 200.0}
    assert s["stages"] == {"generation": 5.5}
    assert (s["runs"], s["ok"], s["errors"]) == (4, 3, ["boom"])


def test_compare_gives_trl_time_over_rlhfkit_time():
    row = stats.compare({"trl": {"step_median": 36.0}, "rlhfkit": {"step_median": 16.0}})
    assert row == {"trl_s": 36.0, "rlhfkit_s": 16.0, "speedup": pytest.approx(2.25)}
    assert stats.compare({"rlhfkit": {"step_median": 16.0}})["speedup"] is None


def test_run_order_alternates_which_side_goes_first():
    order = stats.run_order(["grpo", "sft"], repeats=2)
    assert order == [(0, "grpo", "trl"), (0, "grpo", "rlhfkit"), (0, "sft", "trl"), (0, "sft", "rlhfkit"),
                     (1, "grpo", "rlhfkit"), (1, "grpo", "trl"), (1, "sft", "rlhfkit"), (1, "sft", "trl")]


def test_table_has_one_row_per_workload_with_ratio_memory_stages_and_na_for_a_missing_trl_trainer():
    results = {"machine_line": "test CPU", "repeats": 2, "workloads": {
        "grpo": {"precision": "fp32", "summary": {
            "trl": {"ok": 2, "step_median": 36.0, "peak_mb": {"trl": 2700.4}, "response_length": 20.0},
            "rlhfkit": {"ok": 2, "step_median": 16.0, "peak_mb": {"trainer": 3300.0, "engine": 2100.0},
                        "stages": {"generation": 4.2, "log_probs": 0.0, "training": 10.8, "weight_sync": 1.3},
                        "response_length": 19.5}}},
        "ppo": {"precision": "fp32", "trl_missing": True, "notes": ["trl: TRL 1.16.0 has no trainer for 'ppo'"],
                "summary": {"trl": {"ok": 0, "step_median": None, "peak_mb": {}},
                            "rlhfkit": {"ok": 2, "step_median": 40.0, "peak_mb": {"trainer": 3000.0}}}}}}
    text = stats.format_table(results)
    lines = text.splitlines()
    assert lines[0] == "machine: test CPU"
    grpo = next(line for line in lines if line.startswith("| grpo"))
    assert grpo == ("| grpo | fp32 | 36.0 | 16.0 | 2.25x | 2700 | 3300 / 2100 | 4.2 / 0.0 / 10.8 / 1.3 "
                    "| 20.0 / 19.5 |")
    ppo = next(line for line in lines if line.startswith("| ppo"))
    assert ppo == "| ppo | fp32 | n/a | 40.0 | - | - | 3000 / - | - | - / - |"
    assert "- ppo: trl: TRL 1.16.0 has no trainer for 'ppo'" in lines


def test_rlhfkit_flags_match_the_workload_and_force_the_precision(tmp_path):
    spec = {"kind": "grpo", "model": "/m", "data": "/d.jsonl", "precision": "fp32", "seed": 42, "micro": 8,
            "batch": 32, "prompts": 8, "samples": 4, "new_tokens": 128, "lr": 1e-6, "steps": 4,
            "kv_cache_mb": 1024}
    flags = side.flags_for(spec, tmp_path)
    assert flags["param_dtype"] == "fp32" and flags["init_kl_coef"] == 0.0
    assert (flags["rollout_batch_size"], flags["n_samples_per_prompt"], flags["train_batch_size"]) == (8, 4, 32)
    assert flags["generate_max_len"] == 128 and flags["max_samples"] == 32
    assert flags["remote_rm_url"] == "builtin:math" and flags["advantage_estimator"] == "group_norm"
    argv = side.argv_of({"apply_chat_template": True, "seed": 42})
    assert argv == ["--apply_chat_template", "--seed", "42"]


def test_process_labels_name_the_trainer_and_the_engine():
    assert side.process_label({"role": "actor", "rank": 0, "pid": 1}) == "trainer"
    assert side.process_label({"role": "engine", "engine": 0, "pid": 2}) == "engine"
    assert side.process_label({"role": "critic", "rank": 0, "pid": 3}) == "critic0"
