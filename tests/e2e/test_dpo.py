"""End-to-end `rlhfkit dpo` on a tiny model: the implicit reward margin grows and the chosen answers' log-probs
rise relative to the rejected ones, on held-out pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhfkit.cli.dpo import main as dpo_main
from rlhfkit.config.parse import flags_to_argv
from rlhfkit.data.synthetic import preference_rows, write_jsonl

pytestmark = pytest.mark.slow


def argv(**flags) -> list[str]:
    return flags_to_argv(flags)


def evals(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/loss" in r]


def test_dpo_widens_the_margin_and_raises_chosen_over_rejected(tiny_model_dir, tmp_path):
    train = write_jsonl(preference_rows(64, seed=1), tmp_path / "train.jsonl")
    held_out = write_jsonl(preference_rows(24, seed=2), tmp_path / "eval.jsonl")
    result = dpo_main(argv(pretrain=tiny_model_dir, dataset=train, eval_dataset=held_out, prompt_key="prompt",
                           max_len=48, train_batch_size=8, micro_train_batch_size=8, max_epochs=1,
                           learning_rate=1e-2, lr_warmup_ratio=0, beta=0.1, seed=3,
                           run_dir=tmp_path / "run", save_path=tmp_path / "hf"))
    before, after = evals(tmp_path / "run")[0], evals(tmp_path / "run")[-1]
    assert before["step"] == 0 and after["step"] == 8
    assert before["eval/reward_margin"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 0
    assert after["eval/reward_margin"] > 1.0, after
    assert after["eval/reward_accuracy"] >= 0.9, after
    gap = lambda r: r["eval/chosen_logps"] - r["eval/rejected_logps"]  # noqa: E731
    assert gap(after) > gap(before) + 10.0, (before, after)
    assert after["eval/loss"] < 0.5 * before["eval/loss"]
    assert result["train/reward_margin"] > 0
    assert (tmp_path / "hf" / "config.json").is_file()


def test_packed_dpo_run_reproduces_the_padded_run(tiny_model_dir, tmp_path):
    """--packing_samples changes how a micro-batch is laid out, not what is learned: the loss curves agree."""
    train = write_jsonl(preference_rows(16, seed=1), tmp_path / "train.jsonl")
    curves = []
    for packed in (False, True):
        run_dir = tmp_path / f"run_{packed}"
        dpo_main(argv(pretrain=tiny_model_dir, dataset=train, prompt_key="prompt", max_len=48, train_batch_size=4,
                      micro_train_batch_size=2, max_epochs=1, learning_rate=1e-2, lr_warmup_ratio=0, beta=0.1,
                      seed=3, packing_samples=packed, run_dir=run_dir, save_path=tmp_path / f"hf_{packed}"))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        curves.append([r["train/loss"] for r in rows if "train/loss" in r])
    assert len(curves[0]) == 4 and curves[0][-1] != curves[0][0]
    assert curves[1] == pytest.approx(curves[0], abs=1e-4)
