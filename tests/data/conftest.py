"""Helpers for the data tests: rows read from real files (so provenance is real) and decoding of masked tokens."""

from __future__ import annotations

import json

import pytest

from rlhfkit.data.readers import load_dataset_spec


@pytest.fixture
def load_rows(tmp_path):
    """Write rows to a .jsonl file and read them back with the real reader (adds _source/_row/_line)."""
    counter = iter(range(1000))

    def _load(rows: list[dict]):
        path = tmp_path / f"rows{next(counter)}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return load_dataset_spec(str(path))

    return _load


def target_spans(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded text of each contiguous run of loss-mask-1 tokens."""
    spans, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return [tokenizer.decode(s) for s in spans]


@pytest.fixture
def spans():
    return target_spans
