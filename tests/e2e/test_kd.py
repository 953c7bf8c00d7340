"""End-to-end `rlhfkit kd` on tiny models: the student's KL to the teacher on held-out responses falls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhfkit.cli.kd import main as kd_main
from rlhfkit.config.parse import flags_to_argv
from rlhfkit.data.synthetic import echo_rows, write_jsonl

pytestmark = pytest.mark.slow


def argv(**flags) -> list[str]:
    return flags_to_argv(flags)


def evals(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/loss" in r]


@pytest.fixture
def sharp_teacher(tmp_path) -> str:
    """Another random tiny model with its final norm scaled up: a confident teacher whose token distributions
    differ clearly from the student's (near-uniform at init)."""
    from rlhfkit.models.loading import load_causal_lm, load_tokenizer
    from rlhfkit.models.tiny import build_tiny_causal_lm

    seed1 = build_tiny_causal_lm(str(tmp_path / "seed1"), seed=1)
    model = load_causal_lm(seed1)
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)
    out = tmp_path / "teacher"
    model.save_pretrained(out)
    load_tokenizer(seed1).save_pretrained(out)
    return str(out)


def test_student_kl_to_teacher_falls(tiny_model_dir, sharp_teacher, tmp_path):
    train = write_jsonl(echo_rows(64, seed=1), tmp_path / "train.jsonl")
    held_out = write_jsonl(echo_rows(16, seed=2), tmp_path / "eval.jsonl")
    kd_main(argv(pretrain=tiny_model_dir, teacher_model=sharp_teacher, dataset=train, eval_dataset=held_out,
                 output_key="output", max_len=48, train_batch_size=8, micro_train_batch_size=8, learning_rate=1e-2,
                 lr_warmup_ratio=0, kd_coef=0.9, seed=3, run_dir=tmp_path / "run", save_path=tmp_path / "hf"))
    before, after = evals(tmp_path / "run")[0], evals(tmp_path / "run")[-1]
    assert after["step"] == 8
    assert after["eval/kd_kl"] < 0.8 * before["eval/kd_kl"], (before, after)
    assert after["eval/loss"] == pytest.approx(0.1 * after["eval/nll"] + 0.9 * after["eval/kd_kl"], rel=1e-5)
