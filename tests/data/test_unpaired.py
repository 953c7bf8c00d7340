"""KTO samples: labels must be booleans (or the integers 0/1); anything else is an error naming the row."""

from __future__ import annotations

import pytest

from rlhfkit.data.unpaired import build_unpaired_samples
from rlhfkit.errors import DataError


def kto(rows, tokenizer, **kw):
    opts = dict(input_key="input", output_key="output", input_template="User: {}\nAssistant: ",
                apply_chat_template=False, max_len=128)
    opts.update(kw)
    return build_unpaired_samples(rows, tokenizer, **opts)


def test_boolean_and_01_labels(tokenizer, load_rows, spans):
    rows = load_rows([{"input": "q", "output": "good", "label": True},
                      {"input": "q", "output": "bad", "label": False}])
    samples, stats = kto(rows, tokenizer)
    assert [s["label"] for s in samples] == [True, False]
    assert stats["desirable"] == 1 and stats["undesirable"] == 1
    s = samples[0]
    assert spans(tokenizer, s["input_ids"], s["loss_mask"]) == ["good" + tokenizer.eos_token]
    assert tokenizer.decode(s["input_ids"][: s["prompt_len"]]) == "User: q\nAssistant: "
    ints = load_rows([{"input": "q", "output": "a", "label": 1}, {"input": "q", "output": "b", "label": 0}])
    assert [s["label"] for s in kto(ints, tokenizer)[0]] == [True, False]


@pytest.mark.parametrize("value", ["yes", "true", 1.0, 2])
def test_non_boolean_label_names_file_row_and_value(tokenizer, load_rows, value):
    rows = load_rows([{"input": "q", "output": "a", "label": True}, {"input": "q", "output": "a", "label": value}])
    with pytest.raises(DataError, match=rf"rows0.jsonl line 2: label key 'label' must be a boolean.*{value!r}"):
        kto(rows, tokenizer)


def test_chat_template_kto(tokenizer, load_rows, spans):
    rows = load_rows([{"input": "q", "output": "fine", "label": True}])
    (sample,), _ = kto(rows, tokenizer, apply_chat_template=True)
    assert spans(tokenizer, sample["input_ids"], sample["loss_mask"]) == ["fine<|im_end|>"]
