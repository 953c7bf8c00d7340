"""Error messages that name the row, key and flag; the smallest valid limits; the over-length warnings; loaders.

Each check is a documented behaviour of rlhfkit/data (found by mutation testing, docs/mutation.md)."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import datasets
import pytest
import torch

from rlhfkit.data import readers
from rlhfkit.data.collate import pack_samples, split_by_token_budget
from rlhfkit.data.formatting import format_prompt, last_assistant_split, render_chat
from rlhfkit.data.preference import build_preference_samples
from rlhfkit.data.prompts import build_prompt_samples
from rlhfkit.data.readers import load_dataset_spec
from rlhfkit.data.unpaired import build_unpaired_samples, parse_label
from rlhfkit.errors import DataError


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
    with pytest.raises(DataError, match=r"turn differ\); a preference pair must share its prompt\.$"):
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


def test_packed_rows_take_one_token_samples_and_give_int32_cu_seqlens():
    from rlhfkit.data.collate import collate_packed, model_inputs

    batch = collate_packed([{"input_ids": [5], "loss_mask": [1]}, {"input_ids": [6, 7], "loss_mask": [0, 1]}])
    assert batch["input_ids"].tolist() == [[5, 6, 7]] and batch["position_ids"].tolist() == [[0, 0, 1]]
    assert batch["cu_seqlens"].tolist() == [0, 1, 3] and batch["cu_seqlens"].dtype == torch.int32  # flash-attn
    with pytest.raises(ValueError, match="collate_packed: empty sample"):
        collate_packed([{"input_ids": [], "loss_mask": []}])
    assert "attention_mask" not in model_inputs(batch)  # the default: position_ids carry the sample boundaries
    mask = model_inputs(batch, explicit_mask=True)["attention_mask"]
    allowed = (mask[0, 0] == 0).tolist()
    assert allowed == [[True, False, False], [False, True, False], [False, True, True]]


def test_encoder_segment_rules(tokenizer):
    from rlhfkit.data.encoding import Encoder, fit_to_length
    from rlhfkit.data.formatting import PROMPT, TURN

    enc = Encoder(tokenizer)
    eos = tokenizer.eos_token_id
    ids, mask = enc.encode_segments([("Hello", PROMPT), (" there", TURN)])  # a final turn without special token
    assert ids == enc.prefix_ids + enc.ids("Hello") + enc.ids(" there") + [eos]
    assert mask == [0] * (len(enc.prefix_ids) + len(enc.ids("Hello"))) + [1] * (len(enc.ids(" there")) + 1)
    ids, mask = enc.encode_segments([("Hello there", PROMPT)])  # no target at all: nothing is cut
    assert ids == enc.prefix_ids + enc.ids("Hello there") and set(mask) == {0}
    assert fit_to_length([1, 2], [0, 1], 1) == ("dropped", [], [])  # max_len 1 is valid (no room for the target)
    assert fit_to_length([7], [1], 1) == ("kept", [7], [1])
    with pytest.raises(ValueError, match="max_len"):
        fit_to_length([7], [1], 0)


def test_data_keys_and_message_checks():
    from rlhfkit.data.errors import data_keys
    from rlhfkit.data.formatting import to_messages

    assert data_keys({"_source": "f", "q": 1, "_row": 0, "a": 2, "_line": 3}) == ["q", "a"]
    with pytest.raises(DataError, match="line 2: key 'm' message 0 must be a dict with string 'role'"):
        to_messages([{"content": "no role"}], {"_source": "f.jsonl", "_line": 2}, "m")


def test_reader_errors_name_the_file(tmp_path):
    odd = tmp_path / "rows.xml"
    odd.write_text("<rows/>")
    with pytest.raises(DataError, match=r"unknown data file type '\.xml'; use one of .* or a save_to_disk folder\."):
        load_dataset_spec(str(odd))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"q": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin\.jsonl: not UTF-8 text .* Save the file as UTF-8"):
        load_dataset_spec(str(latin))
    folder = tmp_path / "plain_folder"
    folder.mkdir()
    (folder / "notes.txt").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DataError, match=r"plain_folder: could not be read \("):
        load_dataset_spec(str(folder))


def test_mixing_probabilities_and_blend_defaults(tmp_path, caplog):
    from rlhfkit.data.readers import _draw_indices, blend_datasets, parse_probs

    assert parse_probs("0.25, 0.75", 2) == [0.25, 0.75]
    with pytest.raises(DataError, match=r"--dataset_probs: got 1 probabilities for 2 datasets"):
        parse_probs([1.0], 2)
    with pytest.raises(DataError, match=r"--dataset_probs: .*empty"):
        parse_probs("0.5,,0.5", 3)
    with pytest.raises(DataError, match="must sum to 1"):
        parse_probs([0.5, 0.6], 2)
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"q": str(i)} for i in range(5)])}).save_to_disk(
        str(saved))
    other = tmp_path / "b.jsonl"
    other.write_text("".join(json.dumps({"q": f"b{i}"}) + "\n" for i in range(3)))
    with caplog.at_level(logging.INFO, logger="rlhfkit.data"):
        ds = blend_datasets([str(saved), str(other)], max_samples=4)  # the "train" split by default
        blend_datasets([str(saved), str(other)], [0.5, 0.5], max_samples=6, seed=1)
    assert [r["q"] for r in ds] == ["0", "1", "2", "3"]
    messages = [r.getMessage() for r in caplog.records]
    assert "--max_samples 4: keeping the first 4 of 8 rows" in messages
    assert any(m.startswith(f"dataset {saved}: 5 rows, ") and m.endswith(" distinct)") for m in messages)
    idx = _draw_indices([5, 3], [0.5, 0.5], 6, seed=1)
    assert idx.dtype.kind == "i" and set(idx.tolist()) <= set(range(8))


def test_sft_messages_modes_and_warning(tokenizer, load_rows, caplog):
    from rlhfkit.data.sft import SftFormat, build_sft_samples

    with pytest.raises(DataError, match="^--output_key is required, unless --apply_chat_template is set"):
        SftFormat("input", None).check()
    opts = dict(input_key="input", output_key="output", input_template=None, apply_chat_template=False, max_len=64)
    with pytest.raises(DataError, match=r"line 1: missing key 'output' \(set by --output_key\)"):
        build_sft_samples(load_rows([{"input": "q", "answer": "a"}]), tokenizer, **opts)
    with pytest.raises(DataError, match=r"line 1: key 'output' must be a string"):
        build_sft_samples(load_rows([{"input": "q", "output": 3}]), tokenizer, **opts)
    with pytest.raises(DataError, match=r"line 1: key 'output' must be a string"):
        build_sft_samples(load_rows([{"input": "q", "output": 3}]), tokenizer, **{**opts, "input_template": None},
                          pretrain_mode=True)
    with pytest.raises(DataError, match=r"line 1: key 'output' message 0 must be a dict"):
        build_sft_samples(load_rows([{"input": "q", "output": [{"role": 1}]}]), tokenizer,
                          **{**opts, "apply_chat_template": True})
    (s,), _ = build_sft_samples(load_rows([{"input": "q", "output": "a"}]), tokenizer, **opts, pretrain_mode=True)
    assert set(s["loss_mask"]) == {1}  # pretraining: every token is a target
    with caplog.at_level(logging.WARNING, logger="rlhfkit.data"):
        build_sft_samples(load_rows([{"input": "q", "output": "word " * 40}]), tokenizer, **{**opts, "max_len": 20})
    assert "sft data: 1 of 1 samples truncated and 0 dropped (longer than --max_len 20)" in [
        r.getMessage() for r in caplog.records]
