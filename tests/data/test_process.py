"""PRM samples (data/process.py): one placeholder token per step, its target at that position, -100 elsewhere;
hard (token / boolean) and soft (probability) labels, the over-long rule, and errors that name the row."""

from __future__ import annotations

import numpy as np
import pytest

from rlhfkit.data.encoding import Encoder
from rlhfkit.data.process import IGNORE, ProcessLabels, build_process_samples, encode_steps, single_token_id
from rlhfkit.errors import DataError

MARK = "§"


def prm(rows, tokenizer, **kw):
    opts = dict(input_key="input", label_key="label", placeholder_token=MARK, reward_tokens=["+", "-"],
                input_template=None, max_len=256)
    opts.update(kw)
    return build_process_samples(rows, tokenizer, **opts)


def one_id(tokenizer, text):
    (i,) = tokenizer(text, add_special_tokens=False)["input_ids"]
    return i


def test_hard_token_labels_sit_on_the_placeholders(tokenizer, load_rows):
    rows = load_rows([{"input": f"a is right{MARK}\nb is wrong{MARK}", "label": ["+", "-"]},
                      {"input": f"c is true{MARK}", "label": ["+"]}])
    samples, stats = prm(rows, tokenizer)
    mark, good, bad = one_id(tokenizer, MARK), one_id(tokenizer, "+"), one_id(tokenizer, "-")
    s = samples[0]
    assert s["input_ids"].count(mark) == 2 and s["num_steps"] == 2
    assert [t for i, t in zip(s["input_ids"], s["labels"]) if i == mark] == [good, bad]
    assert all(t == IGNORE for i, t in zip(s["input_ids"], s["labels"]) if i != mark)
    assert tokenizer.decode(s["input_ids"]).endswith(f"a is right{MARK}\nb is wrong{MARK}")
    assert (stats["steps"], stats["good_steps"], stats["steps_cut"], stats["label_kind"]) == (3, 2, 0, "hard")
    assert (stats["total"], stats["kept"], stats["truncated"], stats["dropped"]) == (2, 2, 0, 0)


def test_boolean_and_01_labels_map_to_the_two_reward_tokens(tokenizer, load_rows):
    rows = load_rows([{"input": f"x{MARK} y{MARK} z{MARK} w{MARK}", "label": [True, False, 1, 0]}])
    (s,), stats = prm(rows, tokenizer, reward_tokens=["+", "-"])
    good, bad, mark = one_id(tokenizer, "+"), one_id(tokenizer, "-"), one_id(tokenizer, MARK)
    assert [t for i, t in zip(s["input_ids"], s["labels"]) if i == mark] == [good, bad, good, bad]
    assert stats["good_steps"] == 2 and stats["label_kind"] == "hard"
    with pytest.raises(DataError, match="boolean step labels need exactly two --reward_tokens"):
        prm(load_rows([{"input": f"x{MARK}", "label": [True]}]), tokenizer, reward_tokens=None)


def test_soft_labels_are_probabilities_and_half_counts_as_good(tokenizer, load_rows):
    rows = load_rows([{"input": f"x{MARK} y{MARK} z{MARK}", "label": [0.5, 0.25, 1.0]}])
    (s,), stats = prm(rows, tokenizer)
    mark = one_id(tokenizer, MARK)
    assert [t for i, t in zip(s["input_ids"], s["labels"]) if i == mark] == [0.5, 0.25, 1.0]
    assert stats["label_kind"] == "soft" and stats["good_steps"] == 2 and stats["steps"] == 3
    arr = load_rows([{"input": f"x{MARK}", "label": [0.75]}])[0]
    arr = {**arr, "label": np.array([0.75])}  # numpy arrays (parquet columns) are accepted
    assert prm([arr], tokenizer)[0][0]["num_steps"] == 1
    for bad in (-0.1, 1.5, 2):
        with pytest.raises(DataError, match=r"line 1: soft step label .* must be a probability in \[0, 1\]"):
            prm(load_rows([{"input": f"x{MARK}", "label": [bad]}]), tokenizer)
    with pytest.raises(DataError, match="soft .* need exactly two --reward_tokens"):
        prm(load_rows([{"input": f"x{MARK}", "label": [0.5]}]), tokenizer, reward_tokens=["+"])


def test_label_kinds_must_not_mix(tokenizer, load_rows):
    with pytest.raises(DataError, match="line 1: label key 'label' mixes hard labels"):
        prm(load_rows([{"input": f"x{MARK} y{MARK}", "label": ["+", 0.5]}]), tokenizer)
    rows = load_rows([{"input": f"x{MARK}", "label": ["+"]}, {"input": f"y{MARK}", "label": [0.5]}])
    with pytest.raises(DataError, match="line 2: label key 'label' has soft labels but earlier rows have hard labels; "
                                        "use one kind for the whole dataset$"):
        prm(rows, tokenizer)
    with pytest.raises(DataError, match="neither a reward token, a boolean nor a probability"):
        prm(load_rows([{"input": f"x{MARK}", "label": [None]}]), tokenizer)


@pytest.mark.parametrize("labels", ["+", [], {"a": 1}])
def test_labels_must_be_a_non_empty_list(tokenizer, load_rows, labels):
    with pytest.raises(DataError, match="line 1: label key 'label' must be a non-empty list"):
        prm(load_rows([{"input": f"x{MARK}", "label": labels}]), tokenizer)


def test_one_label_per_step_and_token_labels_checked(tokenizer, load_rows):
    with pytest.raises(DataError, match="the text has 2 step placeholders '§' but 1 labels in key 'label'"):
        prm(load_rows([{"input": f"x{MARK} y{MARK}", "label": ["+"]}]), tokenizer)
    with pytest.raises(DataError, match=r"step label 'ok' is not one of --reward_tokens \['\+', '-'\]"):
        prm(load_rows([{"input": f"x{MARK}", "label": ["ok"]}]), tokenizer)
    with pytest.raises(DataError, match="step label 'hello world' is 2 tokens"):
        prm(load_rows([{"input": f"x{MARK}", "label": ["hello world"]}]), tokenizer, reward_tokens=None)
    # without --reward_tokens any one-token string is a label, and no step counts as good
    (s,), stats = prm(load_rows([{"input": f"x{MARK}", "label": ["+"]}]), tokenizer, reward_tokens=None)
    assert s["num_steps"] == 1 and stats["good_steps"] == 0


def test_over_long_texts_cut_steps_and_drop_samples_without_a_placeholder(tokenizer, load_rows):
    text = f"one two{MARK} three four five six seven eight{MARK} nine{MARK}"
    full, _ = prm(load_rows([{"input": text, "label": ["+", "-", "+"]}]), tokenizer)
    ids = full[0]["input_ids"]
    mark = one_id(tokenizer, MARK)
    first = ids.index(mark)
    samples, stats = prm(load_rows([{"input": text, "label": ["+", "-", "+"]}]), tokenizer, max_len=first + 1)
    assert samples[0]["input_ids"] == ids[: first + 1] and samples[0]["num_steps"] == 1
    assert (stats["truncated"], stats["steps_cut"], stats["steps"], stats["kept"]) == (1, 2, 1, 1)  # kept counts it
    samples, stats = prm(load_rows([{"input": text, "label": ["+", "-", "+"]}]), tokenizer, max_len=first)
    assert samples == [] and (stats["dropped"], stats["steps_cut"], stats["steps"], stats["kept"]) == (1, 3, 0, 0)
    kept, stats = prm(load_rows([{"input": text, "label": ["+", "-", "+"]}]), tokenizer, max_len=len(ids))
    assert kept[0]["input_ids"] == ids and stats["kept"] == 1 and stats["truncated"] == 0
    with pytest.raises(DataError, match="--max_len must be >= 1, got 0"):
        prm([], tokenizer, max_len=0)


def test_input_template_is_applied_before_splitting(tokenizer, load_rows):
    (s,), _ = prm(load_rows([{"input": f"x{MARK}", "label": ["+"]}]), tokenizer, input_template="Q: {}")
    assert tokenizer.decode(s["input_ids"]).endswith(f"Q: x{MARK}")


def test_placeholder_and_reward_token_checks(tokenizer):
    with pytest.raises(DataError, match="--placeholder_token is required"):
        ProcessLabels(tokenizer, "", ["+", "-"])
    with pytest.raises(DataError, match="--placeholder_token 'hello world' is 2 tokens"):
        ProcessLabels(tokenizer, "hello world", ["+", "-"])
    with pytest.raises(DataError, match="is the pad token"):
        ProcessLabels(tokenizer, tokenizer.pad_token, ["+", "-"])
    with pytest.raises(DataError, match=r"--reward_tokens \['\+', '\+'\] repeat a token"):
        ProcessLabels(tokenizer, MARK, ["+", "+"])
    conv = ProcessLabels(tokenizer, MARK, ["+", "-"])
    assert conv.placeholder_id == one_id(tokenizer, MARK) and conv.kind is None
    assert conv.reward_ids == [one_id(tokenizer, "+"), one_id(tokenizer, "-")]
    assert ProcessLabels(tokenizer, MARK, None).reward_ids is None
    assert single_token_id(tokenizer, "+", "--flag") == one_id(tokenizer, "+")
    with pytest.raises(DataError, match="--flag 'hello world' is 2 tokens"):
        single_token_id(tokenizer, "hello world", "--flag")


def test_encode_steps_puts_one_placeholder_between_pieces(tokenizer):
    enc = Encoder(tokenizer)
    mark = one_id(tokenizer, MARK)
    ids = encode_steps(enc, ["ab", " cd", ""], mark)
    assert ids == list(enc.prefix_ids) + enc.ids("ab") + [mark] + enc.ids(" cd") + [mark]
    with pytest.raises(DataError, match="placeholder token appears inside a step"):
        encode_steps(enc, [f"a{MARK}b"], mark)
    with pytest.raises(DataError, match="line 3: the placeholder token appears"):
        encode_steps(enc, [f"a{MARK}b"], mark, {"_source": "f.jsonl", "_line": 3})


def test_steps_cut_add_up_over_rows_and_a_one_token_limit_is_valid(tokenizer, load_rows):
    text = f"one two{MARK} three four five six seven eight{MARK} nine{MARK}"
    rows = load_rows([{"input": text, "label": ["+", "-", "+"]}] * 2)
    samples, stats = prm(rows, tokenizer, max_len=1)  # valid; every sample loses all its steps
    assert samples == [] and stats["dropped"] == 2 and stats["steps_cut"] == 6
    with pytest.raises(DataError, match=r"missing key 'label' \(set by --label_key\)"):
        prm(load_rows([{"input": f"x{MARK}", "steps": ["+"]}]), tokenizer)
