"""End-to-end `rlhfkit rm` on a tiny model with a chat template: held-out accuracy, the saved `score` head and the
training set's reward statistics in config.json, identical pairs counted and reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhfkit.cli.rm import main as rm_main
from rlhfkit.config.parse import flags_to_argv
from rlhfkit.data.synthetic import preference_rows, write_jsonl

pytestmark = pytest.mark.slow


def argv(**flags) -> list[str]:
    return flags_to_argv(flags)


def evals(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/loss" in r]


def test_reward_model_learns_pairs_and_saves_its_statistics(tiny_model_dir, tmp_path):
    rows = preference_rows(64, seed=1)
    rows[5]["rejected"] = rows[5]["chosen"]  # an identical pair: kept, counted, reported
    train = write_jsonl(rows, tmp_path / "train.jsonl")
    held_out = write_jsonl(preference_rows(32, seed=2), tmp_path / "eval.jsonl")
    result = rm_main(argv(pretrain=tiny_model_dir, dataset=train, eval_dataset=held_out, prompt_key="prompt",
                          apply_chat_template=True, max_len=64, train_batch_size=8, micro_train_batch_size=8,
                          learning_rate=1e-2, lr_warmup_ratio=0, seed=3, run_dir=tmp_path / "run",
                          save_path=tmp_path / "hf"))
    before, after = evals(tmp_path / "run")[0], evals(tmp_path / "run")[-1]
    assert after["step"] == 8
    assert after["eval/accuracy"] >= 0.9, (before, after)
    assert after["eval/loss"] < before["eval/loss"]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "'identical_pairs': 1" in log and "1 pairs have chosen == rejected" in log

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhfkit.models.loading import scalar_outputs
    from rlhfkit.rewards.reward_model import reward_stats

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert isinstance(model.score, torch.nn.Linear) and model.config.num_labels == 1
    mean, std = reward_stats(model.config, str(tmp_path / "hf"))
    assert (mean, std) == (result["train/reward_mean"], result["train/reward_std"]) and std > 0
    # The statistics are those of the trained model's rewards on the training set (chosen and rejected sides).
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    texts = [tok.apply_chat_template([{"role": "user", "content": row["prompt"]},
                                      {"role": "assistant", "content": row[side]}], tokenize=False).rstrip("\n")
             for row in rows for side in ("chosen", "rejected")]
    tok.padding_side = "right"
    enc = tok(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        rewards = scalar_outputs(model, enc.input_ids, enc.attention_mask)[0]
    rewards_t = rewards.double()
    assert mean == pytest.approx(float(rewards_t.mean()), abs=1e-4)
    assert std == pytest.approx(float(rewards_t.std(unbiased=False)), abs=1e-4)
