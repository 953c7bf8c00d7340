"""RL prompt samples: chat / plain formatting, token ids, labels, over-long prompts dropped and counted."""

from __future__ import annotations

import json

import pytest

from rlhfkit.data.prompts import build_prompt_samples
from rlhfkit.errors import DataError


def prompts(rows, tokenizer, **kw):
    opts = dict(input_key="question", label_key="answer", input_template=None, apply_chat_template=True,
                prompt_max_len=64)
    opts.update(kw)
    return build_prompt_samples(rows, tokenizer, **opts)


def test_chat_prompt_with_label(tokenizer, load_rows):
    rows = load_rows([{"question": "What is 3+4?", "answer": "7"}])
    (sample,), stats = prompts(rows, tokenizer)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3+4?"}], tokenize=False,
                                             add_generation_prompt=True)
    assert sample["prompt"] == expected
    assert sample["prompt_ids"] == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert sample["label"] == "7"
    assert stats == {"total": 1, "kept": 1, "truncated": 0, "dropped": 0}


def test_plain_template_and_no_label(tokenizer, load_rows):
    rows = load_rows([{"question": "Name a colour."}])
    (sample,), _ = prompts(rows, tokenizer, label_key=None, apply_chat_template=False,
                           input_template="Q: {}\nA: ")
    assert sample["prompt"] == "Q: Name a colour.\nA: " and sample["label"] is None


def test_message_list_prompt(tokenizer, load_rows):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (sample,), _ = prompts(load_rows([{"question": messages, "answer": 1}]), tokenizer)
    assert sample["prompt"] == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert sample["label"] == 1


def test_over_long_prompts_are_dropped_and_counted(tokenizer, load_rows):
    rows = load_rows([{"question": "short", "answer": "a"}, {"question": " cat" * 100, "answer": "b"}])
    samples, stats = prompts(rows, tokenizer, apply_chat_template=False, prompt_max_len=20)
    assert [s["label"] for s in samples] == ["a"]
    assert stats == {"total": 2, "kept": 1, "truncated": 0, "dropped": 1}


def test_missing_label_key(tokenizer, load_rows):
    rows = load_rows([{"question": "q", "solution": "s"}])
    with pytest.raises(DataError, match=r"line 1: missing key 'answer' \(set by --label_key\).*\['question', "
                                        r"'solution'\]"):
        prompts(rows, tokenizer)


def test_ppo_apply_chat_template_formats_the_prompts_of_the_run(tokenizer, tmp_path):
    """ppo's --apply_chat_template, parsed, through the run's prompt loader (rl.setup.load_prompts): the chat
    template's prompt with the generation header; without the flag the question as written."""
    from rlhfkit.config.parse import parse_config
    from rlhfkit.rl.setup import load_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"question": "What is 3+4?", "answer": "7"}) + "\n")
    base = ["--pretrain", "m", "--prompt_data", str(path), "--input_key", "question", "--label_key", "answer"]
    (chat,) = load_prompts(parse_config("ppo", None, base + ["--apply_chat_template"]), tokenizer, str(path), "train")
    (plain,) = load_prompts(parse_config("ppo", None, base), tokenizer, str(path), "train")
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3+4?"}], tokenize=False,
                                             add_generation_prompt=True)
    assert expected != "What is 3+4?"
    assert chat["prompt"] == expected
    assert chat["prompt_ids"] == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert plain["prompt"] == "What is 3+4?"
    assert chat["label"] == plain["label"] == "7"
