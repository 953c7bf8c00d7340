"""Readers: every file format, save_to_disk folders, provenance, mixing, and clear errors for bad input."""

from __future__ import annotations

import json
from collections import Counter

import datasets
import pandas as pd
import pytest

from rlhfkit.data.errors import where
from rlhfkit.data.readers import blend_datasets, load_dataset_spec
from rlhfkit.errors import DataError

ROWS = [{"input": f"q{i}", "output": f"a{i}"} for i in range(4)]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _check(ds: datasets.Dataset, source: str, lines: list[int | None] | None = None) -> None:
    assert ds["input"] == [r["input"] for r in ROWS]
    assert ds["output"] == [r["output"] for r in ROWS]
    assert ds["_source"] == [source] * len(ROWS)
    assert ds["_row"] == list(range(len(ROWS)))
    assert ds["_line"] == (lines or [None] * len(ROWS))


def test_jsonl_with_blank_lines_keeps_true_line_numbers(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in ROWS[1:]))
    ds = load_dataset_spec(str(path))
    _check(ds, str(path), [1, 3, 4, 5])
    assert where(ds[1]) == f"{path} line 3"


def test_json_array_file(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(ROWS, indent=1))
    ds = load_dataset_spec(str(path))
    _check(ds, str(path))
    assert where(ds[2]) == f"{path} row 2 (0-based)"


def test_parquet_and_csv_files(tmp_path):
    parquet, csv = tmp_path / "a.parquet", tmp_path / "a.csv"
    pd.DataFrame(ROWS).to_parquet(parquet)
    pd.DataFrame(ROWS).to_csv(csv, index=False)
    _check(load_dataset_spec(str(parquet)), str(parquet))
    _check(load_dataset_spec(str(csv)), str(csv))


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    _check(load_dataset_spec(str(tmp_path / "single")), str(tmp_path / "single"))
    test_split = datasets.Dataset.from_list([{"input": "t", "output": "u"}])
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": test_split})
    dd.save_to_disk(str(tmp_path / "dict"))
    _check(load_dataset_spec(str(tmp_path / "dict"), split="train"), str(tmp_path / "dict"))
    assert load_dataset_spec(str(tmp_path / "dict"), split="test")["input"] == ["t"]
    with pytest.raises(DataError, match=r"split 'validation' not found.*\['test', 'train'\]"):
        load_dataset_spec(str(tmp_path / "dict"), split="validation")


def test_folder_of_data_files(tmp_path):
    write_jsonl(tmp_path / "part-0.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "part-1.jsonl", ROWS[2:])
    ds = load_dataset_spec(str(tmp_path))
    assert sorted(ds["input"]) == [r["input"] for r in ROWS] and ds["_row"] == [0, 1, 2, 3]


def test_missing_local_file_names_it(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_dataset_spec(missing)
    with pytest.raises(FileNotFoundError, match=r"data/sub/x"):
        load_dataset_spec("data/sub/x")


def test_unreachable_hub_name_is_a_clear_error(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"'someorg/somedata'.*no local file or folder.*hub"):
        load_dataset_spec("someorg/somedata")


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input": "a"}\n{"input": "b"}\n{"input": "c",\n')
    with pytest.raises(DataError, match=r"bad.jsonl line 3: not valid JSON.*fix or delete that line"):
        load_dataset_spec(str(path))


def test_json_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"input": "a"}\n["b"]\n')
    with pytest.raises(DataError, match=r"list.jsonl line 2: expected a JSON object"):
        load_dataset_spec(str(path))


@pytest.mark.parametrize("name,content", [("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("empty.csv", "input,output\n"),
                                          ("empty.json", "[]")])
def test_empty_dataset_names_the_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError, match=rf"{name}.*empty"):
        load_dataset_spec(str(path))


def test_unknown_extension(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hello\n")
    with pytest.raises(DataError, match=r"a.txt: unknown data file type '.txt'"):
        load_dataset_spec(str(path))


def _two_sources(tmp_path, n_a=50, n_b=20) -> tuple[str, str]:
    a = write_jsonl(tmp_path / "a.jsonl", [{"input": f"a{i}", "output": "x"} for i in range(n_a)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"input": f"b{i}", "output": "y"} for i in range(n_b)])
    return a, b


def test_blend_follows_probabilities_and_is_deterministic(tmp_path):
    a, b = _two_sources(tmp_path)
    ds = blend_datasets(f"{a},{b}", "0.3,0.7", split="train", seed=7, max_samples=2000)
    counts = Counter(ds["_source"])
    assert len(ds) == 2000
    assert abs(counts[b] / 2000 - 0.7) < 0.04
    # every row keeps its provenance, and b's 20 rows were all used (repeated as needed)
    assert all(row["input"] == f"b{row['_row']}" for row in ds if row["_source"] == b)
    assert len({r for r, s in zip(ds["_row"], ds["_source"]) if s == b}) == 20
    again = blend_datasets([a, b], [0.3, 0.7], split="train", seed=7, max_samples=2000)
    assert again["input"] == ds["input"]
    other = blend_datasets([a, b], [0.3, 0.7], split="train", seed=8, max_samples=2000)
    assert other["input"] != ds["input"]


def test_blend_without_probs_concatenates_and_max_samples_cuts(tmp_path):
    a, b = _two_sources(tmp_path, 5, 3)
    ds = blend_datasets([a, b], None, split="train", seed=0, max_samples=None)
    assert ds["input"] == [f"a{i}" for i in range(5)] + [f"b{i}" for i in range(3)]
    assert len(blend_datasets([a, b], None, split="train", seed=0, max_samples=6)) == 6
    assert len(blend_datasets(a, None, split="train", seed=0, max_samples=1e8)) == 5  # the flag's float default


def test_blend_aligns_sources_with_different_columns(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"input": "x", "output": "y"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"input": "z", "label": True}])
    ds = blend_datasets([a, b], None, split="train", seed=0, max_samples=None)
    assert ds["output"] == ["y", None] and ds["label"] == [None, True]


@pytest.mark.parametrize("probs,message", [("0.5", "got 1 probabilities for 2 datasets"),
                                           ("0.5,0.6", "must sum to 1"),
                                           ("0.5,x", "not a list of numbers"),
                                           ([1.5, -0.5], ">= 0")])
def test_bad_probs_name_the_flag(tmp_path, probs, message):
    a, b = _two_sources(tmp_path, 2, 2)
    with pytest.raises(DataError, match=rf"--dataset_probs.*{message}"):
        blend_datasets([a, b], probs, split="train", seed=0, max_samples=None)


def test_mixed_type_column_keeps_original_values(tmp_path):
    # `datasets` alone turns the string "true" into True (and "1" into 1) in a column that mixes types
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"label": True}, {"label": "true"}, {"label": "1"}, {"label": 2.5}])
    assert load_dataset_spec(path)["label"] == [True, "true", "1", 2.5]


def test_prompt_data_flags_are_named(tmp_path):
    a, b = _two_sources(tmp_path, 2, 2)
    with pytest.raises(DataError, match=r"--prompt_data_probs: got 1 probabilities"):
        blend_datasets([a, b], "1.0", split="train", seed=0, flags=("--prompt_data", "--prompt_data_probs"))
