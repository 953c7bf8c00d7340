"""End-to-end `rlhfkit prm` on a tiny model: step accuracy on held-out processes above chance, and inference
returns one score per step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhfkit.cli.prm import main as prm_main
from rlhfkit.config.parse import flags_to_argv
from rlhfkit.data.synthetic import process_rows, write_jsonl

pytestmark = pytest.mark.slow


def argv(**flags) -> list[str]:
    return flags_to_argv(flags)


def evals(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/loss" in r]


def test_prm_classifies_steps_above_chance(tiny_model_dir, tmp_path):
    train = write_jsonl(process_rows(64, seed=1, steps=(1, 3)), tmp_path / "train.jsonl")
    held_rows = process_rows(32, seed=2, steps=(1, 3))
    held_out = write_jsonl(held_rows, tmp_path / "eval.jsonl")
    prm_main(argv(pretrain=tiny_model_dir, dataset=train, eval_dataset=held_out, placeholder_token="§",
                  reward_tokens=["+", "-"], max_len=96, train_batch_size=8, micro_train_batch_size=8,
                  learning_rate=4e-3, lr_warmup_ratio=0, max_epochs=2, seed=3, run_dir=tmp_path / "run",
                  save_path=tmp_path / "hf"))
    before, after = evals(tmp_path / "run")[0], evals(tmp_path / "run")[-1]
    assert after["step"] == 16
    assert after["eval/accuracy"] >= 0.7, (before, after)  # chance: 0.5 (balanced labels)
    assert after["eval/loss"] < before["eval/loss"]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.trainers.prm import prm_step_scores

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    texts = [r["input"] for r in held_rows]
    scores = prm_step_scores(model, tok, texts, placeholder_token="§", reward_tokens=["+", "-"])
    assert [len(s) for s in scores] == [len(r["label"]) for r in held_rows]
    assert all(0.0 <= p <= 1.0 for s in scores for p in s)
    hits = [(p >= 0.5) == (y == "+") for s, r in zip(scores, held_rows) for p, y in zip(s, r["label"])]
    assert sum(hits) / len(hits) == pytest.approx(after["eval/accuracy"], abs=1e-6)
