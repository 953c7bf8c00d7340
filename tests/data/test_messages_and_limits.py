"""Error messages that name the row, key and flag; the smallest valid limits; the over-length warnings; loaders.

Each check is a documented behaviour of rlhfkit/data (found by mutation testing, docs/mutation.md)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import datasets
import pytest

from rlhfkit.data import readers
from rlhfkit.data.collate import pack_samples, split_by_token_budget
from rlhfkit.data.errors import DataError
from rlhfkit.data.formatting import format_prompt, last_assistant_split, render_chat
from rlhfkit.data.preference import build_preference_samples
from rlhfkit.data.prompts import build_prompt_samples
from rlhfkit.data.readers import load_dataset_spec
from rlhfkit.data.unpaired import build_unpaired_samples, parse_label


def test_a_budget_of_one_token_is_valid():
    samples = [{"input_ids": [1, 2]}, {"input_ids": [3]}, {"input_ids": [4]}]
    assert split_by_token_budget(samples, 1) == [[samples[0]], [samples[1]], [samples[2]]]
    assert pack_samples(samples, 1) == [[samples[0]], [samples[1]], [samples[2]]]
    for fn in (split_by_token_budget, pack_samples):
        with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
            fn(samples, 0)


def test_a_prompt_limit_of_one_token_is_valid(tokenizer, load_rows):
    rows = load_rows([{"input": "a"}, {"input": "a b c d e f"}])
    samples, stats = build_prompt_samples(rows, tokenizer, input_key="input", input_template=None,
                                          apply_chat_template=False, prompt_max_len=1)
    assert [s["prompt"] for s in samples] == ["a"] and stats["dropped"] == 1
    with pytest.raises(DataError, match="--prompt_max_len must be >= 1, got 0"):
        build_prompt_samples(rows, tokenizer, input_key="input", input_template=None, apply_chat_template=False,
                             prompt_max_len=0)


def test_prompt_errors_name_the_file_line_and_key(tokenizer, load_rows):
    rows = load_rows([{"input": "fine"}, {"input": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(DataError, match=r"rows0\.jsonl line 2: key 'input' holds chat messages"):
        build_prompt_samples(rows, tokenizer, input_key="input", input_template=None, apply_chat_template=False,
                             prompt_max_len=64)
    row = {"_source": "p.jsonl", "_line": 4}
    with pytest.raises(DataError, match=r"p\.jsonl line 4: key 'q' must be a string or a non-empty list"):
        format_prompt([], tokenizer, input_template=None, apply_chat_template=True, row=row, key="q")
    with pytest.raises(DataError, match=r"p\.jsonl line 4: key 'q' must be a string, got int"):
        format_prompt(3, tokenizer, input_template=None, apply_chat_template=False, row=row, key="q")
    with pytest.raises(DataError, match=r"p\.jsonl line 4: key 'msgs': the conversation has no assistant message"):
        last_assistant_split([{"role": "user", "content": "hi"}], row, "msgs")
    with pytest.raises(DataError, match="the tokenizer has no chat template; pass --tokenizer_chat_template"):
        render_chat(SimpleNamespace(chat_template=None), [{"role": "user", "content": "hi"}],
                    add_generation_prompt=True, row=row)


def test_preference_errors_name_the_flag_and_key(tokenizer, load_rows):
    opts = dict(input_template=None, max_len=256)
    with pytest.raises(DataError, match=r"missing key 'question' \(set by --prompt_key\)"):
        build_preference_samples(load_rows([{"chosen": "a", "rejected": "b"}]), tokenizer, prompt_key="question",
                                 apply_chat_template=False, **opts)
    bad = load_rows([{"prompt": "p", "chosen": [{"role": "assistant"}], "rejected": "b"}])
    with pytest.raises(DataError, match=r"line 1: key 'chosen' message 0 must be a dict with string 'role'"):
        build_preference_samples(bad, tokenizer, prompt_key="prompt", apply_chat_template=True, **opts)
    chats = load_rows([{"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
                        "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}]}])
    with pytest.raises(DataError, match="a preference pair must share its prompt"):
        build_preference_samples(chats, tokenizer, apply_chat_template=True, **opts)


def test_over_length_warnings(tokenizer, load_rows, caplog):
    long = "word " * 40
    with caplog.at_level(logging.WARNING, logger="rlhfkit.data"):
        build_preference_samples(load_rows([{"prompt": "p", "chosen": long, "rejected": "b"}]), tokenizer,
                                 prompt_key="prompt", input_template="{}", apply_chat_template=False, max_len=20)
        build_unpaired_samples(load_rows([{"input": "q", "output": long, "label": True},
                                          {"input": "q", "output": "ok", "label": False}]), tokenizer,
                               input_key="input", output_key="output", input_template=None,
                               apply_chat_template=False, max_len=20)
    messages = [r.getMessage() for r in caplog.records]
    assert "preference data: 1 of 1 pairs truncated and 0 dropped (longer than --max_len 20)" in messages
    assert "unpaired data: 1 of 2 samples truncated and 0 dropped (longer than --max_len 20)" in messages


def test_kto_chat_template_formats_the_prompt(tokenizer, load_rows):
    (sample,), _ = build_unpaired_samples(load_rows([{"input": "q", "output": "fine", "label": True}]), tokenizer,
                                          input_key="input", output_key="output", input_template=None,
                                          apply_chat_template=True, max_len=256)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False,
                                           add_generation_prompt=True)
    assert tokenizer.decode(sample["input_ids"][: sample["prompt_len"]]) == prompt


@pytest.mark.parametrize(("value", "shown"), [("yes", "str 'yes'"), (2, "int 2"), (0.5, "float 0.5")])
def test_kto_label_error_shows_the_type(value, shown):
    with pytest.raises(DataError, match=f"got {shown}. Convert the labels to true/false"):
        parse_label(value, {"_source": "k.jsonl", "_line": 1}, "label")


def test_json_array_files(tmp_path):
    good = tmp_path / "rows.json"
    good.write_text(json.dumps([{"q": "a", "v": "true"}, {"q": "b", "v": True}]))
    ds = load_dataset_spec(str(good))
    assert [r["v"] for r in ds] == ["true", True]  # the mixed-type column is read back from the JSON array
    broken = tmp_path / "broken.json"
    broken.write_text('[{"q": "a"},\n {"q": }]')
    with pytest.raises(DataError, match=r"broken\.json line 2: not valid JSON .* Fix the file, or write one JSON "):
        load_dataset_spec(str(broken))
    scalars = tmp_path / "scalars.json"
    scalars.write_text('[{"q": "a"}, 7]')
    with pytest.raises(DataError, match="element 1 of the JSON array is a int, not an object"):
        load_dataset_spec(str(scalars))


def test_local_looking_specs_and_hub_names(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError):
        load_dataset_spec("./no_such_folder_for_rlhfkit")
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"q": "a"}])}).save_to_disk(str(saved))
    with pytest.raises(DataError, match=r"split 'test' not found; the folder has splits \['train'\]\. Pick one"):
        load_dataset_spec(str(saved), split="test")
    seen = []

    def fake_load_dataset(name, split):
        seen.append((name, split))
        return datasets.Dataset.from_list([{"q": "hub row"}])

    monkeypatch.setattr(readers.datasets, "load_dataset", fake_load_dataset)
    ds = load_dataset_spec("some-org/some-set", split="validation")
    assert seen == [("some-org/some-set", "validation")] and ds[0]["q"] == "hub row"
