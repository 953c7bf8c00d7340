"""Conditional SFT (`rlhfkit sft --csft_keys`): the quality score in the system prompt steers the generated answer."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.cli.sft import main as sft_main
from rlhfkit.data.csft import condition_row, csft_prompt
from rlhfkit.data.synthetic import conditioned_rows, write_jsonl

pytestmark = pytest.mark.slow


def test_condition_row_formats():
    row = {"input": "Describe the sky.", "rm_score": 5, "style": "short"}
    assert csft_prompt({"rm_score": 5.0}) == "<rm_score>: 5.00"
    assert condition_row(row, ["rm_score", "style"], "input", chat=False)["input"] == \
        "<rm_score>: 5.00\n<style>: short\nDescribe the sky."
    chat = condition_row(row, ["rm_score"], "input", chat=True)["input"]
    assert chat == [{"role": "system", "content": "<rm_score>: 5.00"}, {"role": "user", "content": "Describe the sky."}]
    merged = condition_row({"input": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
                            "rm_score": 1.5}, ["rm_score"], "input", chat=True)["input"]
    assert merged[0] == {"role": "system", "content": "<rm_score>: 1.50\nBe kind."} and len(merged) == 2


def test_the_condition_steers_the_output(tiny_model_dir, tmp_path):
    train = write_jsonl(conditioned_rows(64, seed=1), tmp_path / "train.jsonl")
    sft_main(["--pretrain", tiny_model_dir, "--dataset", train, "--input_key", "input", "--output_key", "output",
              "--csft_keys", "rm_score", "--apply_chat_template", "--max_len", "64", "--train_batch_size", "8",
              "--micro_train_batch_size", "8", "--max_epochs", "4", "--learning_rate", "5e-3",
              "--lr_scheduler", "constant", "--lr_warmup_ratio", "0", "--seed", "3",
              "--run_dir", str(tmp_path / "run"), "--save_path", str(tmp_path / "hf")])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    first_words = {}
    for score in (5.0, 0.0):
        for topic in ("sky", "river", "hill"):  # prompts of the training distribution, answers not memorised per row
            messages = [{"role": "system", "content": csft_prompt({"rm_score": score})},
                        {"role": "user", "content": f"Describe the {topic}."}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            with torch.no_grad():
                out = model.generate(**ids, max_new_tokens=3, do_sample=False)
            text = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
            first_words[(score, topic)] = text.split()[0] if text.split() else ""
    assert all(first_words[(5.0, t)] == "great" for t in ("sky", "river", "hill")), first_words
    assert all(first_words[(0.0, t)] == "poor" for t in ("sky", "river", "hill")), first_words
