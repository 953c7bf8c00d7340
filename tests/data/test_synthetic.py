"""The synthetic tasks (data/synthetic.py) of the demo, examples and tests: each row carries the signal it claims."""

from __future__ import annotations

import json
import re

from rlhfkit.data.synthetic import (
    BAD_MARKS,
    DISPREFERRED_WORDS,
    GOOD_MARKS,
    PREFERRED_WORDS,
    TOPICS,
    arithmetic_rows,
    conditioned_rows,
    echo_rows,
    preference_rows,
    process_rows,
    unpaired_rows,
    write_jsonl,
)


def test_arithmetic_rows_answer_the_question_in_range():
    rows = arithmetic_rows(50, seed=1, low=3, high=9)
    assert len(rows) == 50
    pairs = set()
    for row in rows:
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\? Reply with only the number\.", row["input"]).groups())
        assert 3 <= a <= 9 and 3 <= b <= 9
        assert row["output"] == row["label"] == str(a + b)
        pairs.add((a, b))
    assert {a for a, _ in pairs} | {b for _, b in pairs} == set(range(3, 10))  # low and high are both reachable
    assert arithmetic_rows(50, seed=1, low=3, high=9) == rows and arithmetic_rows(50, seed=2, low=3, high=9) != rows
    default = arithmetic_rows(200, seed=0)
    assert {int(x) for r in default for x in re.findall(r"\d+", r["input"])} == set(range(0, 21))  # 0..20
    chat = arithmetic_rows(2, seed=1, system="Be brief.")
    plain = arithmetic_rows(2, seed=1)
    system, user = {"role": "system", "content": "Be brief."}, {"role": "user", "content": plain[0]["input"]}
    assert chat[0]["input"] == [system, user]
    assert chat[0]["output"] == plain[0]["output"]


def test_echo_rows_repeat_two_distinct_words():
    rows = echo_rows(30, seed=4)
    assert len(rows) == 30 and echo_rows(30, seed=4) == rows and echo_rows(30, seed=5) != rows
    for row in rows:
        words = row["output"].split(" ")
        assert len(words) == 2 and words[0] != words[1] and all(w.isalpha() and w.islower() for w in words)
        assert row["input"] == "Repeat: " + row["output"] and row["label"] == row["output"]


def test_write_jsonl_creates_parents_and_round_trips(tmp_path):
    rows = [{"a": 1, "b": "x"}, {"a": 2, "b": [1, 2]}]
    path = write_jsonl(rows, tmp_path / "deep" / "dir" / "rows.jsonl")
    assert path == str(tmp_path / "deep" / "dir" / "rows.jsonl")
    text = (tmp_path / "deep" / "dir" / "rows.jsonl").read_text()
    assert text.endswith("\n") and [json.loads(line) for line in text.splitlines()] == rows


def test_preference_and_unpaired_rows_separate_the_word_sets():
    pairs = preference_rows(20, seed=3)
    assert len(pairs) == 20 and preference_rows(20, seed=3) == pairs and preference_rows(20, seed=4) != pairs
    for row in pairs:
        topic = re.fullmatch(r"Name three things of the (\w+)\.", row["prompt"]).group(1)
        assert topic in TOPICS
        chosen, rejected = row["chosen"].split(" "), row["rejected"].split(" ")
        assert len(set(chosen)) == 3 and set(chosen) <= set(PREFERRED_WORDS)
        assert len(set(rejected)) == 3 and set(rejected) <= set(DISPREFERRED_WORDS)
    rows = unpaired_rows(9, seed=3)
    assert [r["label"] for r in rows] == [True, False] * 4 + [True]
    for row in rows:
        words = set(row["output"].split(" "))
        assert len(words) == 3 and words <= set(PREFERRED_WORDS if row["label"] else DISPREFERRED_WORDS)
        assert re.fullmatch(r"Name three things of the (\w+)\.", row["input"]).group(1) in TOPICS
    assert unpaired_rows(9, seed=4) != rows


def test_process_rows_label_each_step_by_its_mark():
    rows = process_rows(40, seed=2)
    assert len(rows) == 40 and process_rows(40, seed=2) == rows
    counts = set()
    for row in rows:
        steps = row["input"].split("\n")
        counts.add(len(steps))
        assert len(steps) == len(row["label"])
        for step, label in zip(steps, row["label"]):
            words, mark = re.fullmatch(r"(\w+ \w+) is (\w+)§", step).groups()
            assert set(words.split(" ")) <= set(PREFERRED_WORDS + DISPREFERRED_WORDS) and len(set(words.split())) == 2
            assert label == ("+" if mark in GOOD_MARKS else "-") and mark in GOOD_MARKS + BAD_MARKS
    assert counts == {2, 3, 4}  # the default steps=(2, 4), both ends included
    labels = [x for r in rows for x in r["label"]]
    assert 0.3 < labels.count("+") / len(labels) < 0.7  # balanced
    other = process_rows(5, seed=2, placeholder="ки", steps=(1, 1))
    assert all(len(r["label"]) == 1 and r["input"].endswith("ки") for r in other)


def test_conditioned_rows_pair_scores_with_answer_quality():
    rows = conditioned_rows(6, seed=1)
    assert [r["rm_score"] for r in rows] == [5.0, 0.0] * 3
    for row in rows:
        topic = re.fullmatch(r"Describe the (\w+)\.", row["input"]).group(1)
        assert topic in TOPICS
        assert row["output"] == f"{'great' if row['rm_score'] == 5.0 else 'poor'} {topic}"
    assert conditioned_rows(6, seed=2) != rows
    assert [r["score"] for r in conditioned_rows(2, seed=1, key="score")] == [5.0, 0.0]
