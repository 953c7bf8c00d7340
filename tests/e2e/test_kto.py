"""End-to-end `rlhfkit kto` on a tiny model: desirable completions gain implicit reward and log-probability
relative to undesirable ones, on held-out data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhfkit.cli.kto import main as kto_main
from rlhfkit.config.parse import flags_to_argv
from rlhfkit.data.synthetic import unpaired_rows, write_jsonl

pytestmark = pytest.mark.slow


def argv(**flags) -> list[str]:
    return flags_to_argv(flags)


def evals(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/loss" in r]


def test_kto_separates_desirable_from_undesirable(tiny_model_dir, tmp_path):
    train = write_jsonl(unpaired_rows(64, seed=1), tmp_path / "train.jsonl")
    held_out = write_jsonl(unpaired_rows(24, seed=2), tmp_path / "eval.jsonl")
    kto_main(argv(pretrain=tiny_model_dir, dataset=train, eval_dataset=held_out, output_key="output", max_len=48,
                  train_batch_size=8, micro_train_batch_size=8, learning_rate=1e-2, lr_warmup_ratio=0, beta=0.1,
                  desirable_loss_weight=1.0, undesirable_loss_weight=1.0, seed=3, run_dir=tmp_path / "run",
                  save_path=tmp_path / "hf"))
    before, after = evals(tmp_path / "run")[0], evals(tmp_path / "run")[-1]
    assert after["step"] == 8
    assert before["eval/signed_reward"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 0
    # signed_* = mean over samples of (+1 desirable, -1 undesirable) x value: the desirable-minus-undesirable gap
    assert after["eval/signed_reward"] > 0.2, after
    assert after["eval/signed_logps"] > before["eval/signed_logps"] + 2.0, (before, after)
    assert after["eval/loss"] < before["eval/loss"]
    assert after["eval/kl"] >= 0.0
