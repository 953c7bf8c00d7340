"""Built-in verifiers against hand cases."""

from __future__ import annotations

from fractions import Fraction

import pytest

from rlhfkit.errors import RewardFuncError
from rlhfkit.rewards.base import response_of
from rlhfkit.rewards.reward_func import RewardFuncSource
from rlhfkit.rewards.verifiers import (
    extract_answer,
    extract_boxed,
    get_builtin,
    make_format_reward_func,
    math_equal,
    parse_number,
)


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{\frac{1}{2}} done", r"\frac{1}{2}"),
    (r"first \boxed{3} then \boxed{x^{2}+{1}}", r"x^{2}+{1}"),
    (r"unclosed \boxed{3", None),
    ("no box", None),
])
def test_extract_boxed_nested(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("response, expected", [
    ("3 apples and 4 pears, total 7.", "7"),
    ("it costs $1,234.50 in all", "$1,234.50"),
    ("the result is -12", "-12"),
    ("half is 1/2", "1/2"),
    ("nothing numeric here", None),
    (r"answer \boxed{42} (checked with 41)", "42"),
])
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize("text, value", [
    ("1,234", Fraction(1234)), ("$-3.5", Fraction(-7, 2)), ("3/4", Fraction(3, 4)),
    (r"\frac{1}{2}", Fraction(1, 2)), (r"-\dfrac{2}{4}", Fraction(-1, 2)), ("0.25", Fraction(1, 4)),
    ("+5", Fraction(5)), ("x+1", None), ("1/0", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("answer, label, ok", [
    ("0.5", "1/2", True), (r"\frac{1}{2}", 0.5, True), ("1,000", 1000, True), ("-3", "-3", True),
    ("-3", 3, False), ("42", "#### 42", True), ("7", r"\boxed{7}", True), ("x + 1", "x+1", True),
    ("7", "8", False), (None, 7, False), ("0.3333", "1/3", False),
])
def test_math_equal(answer, label, ok):
    assert math_equal(answer, label) is ok


def test_math_reward_func_on_batch():
    prompts = ["What is 6*7? The number 99 is not it.", "Half of 1?", "Neg?", "Fraction?", "Nothing?"]
    responses = [r" Surely \boxed{42}.", " It is 0.5", " Result: -4", r" \boxed{\frac{3}{6}}", " I don't know"]
    queries = [p + r for p, r in zip(prompts, responses)]
    out = get_builtin("math")(queries, prompts, [42, "1/2", -4, 0.5, 3])
    assert out["rewards"] == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert out["extra_logs"]["math_has_answer"] == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_prompt_number_is_not_the_answer():
    prompt = "Compute 2+3. Put the answer after 'A:'. A:"
    assert get_builtin("math")([prompt + " no idea"], [prompt], ["3"])["rewards"] == [0.0]
    assert response_of("abc tail", "abc") == " tail" and response_of("other", "abc") == "other"


def test_math_without_labels_is_an_error_naming_the_sample():
    src = RewardFuncSource(get_builtin("math"), "builtin:math")
    with pytest.raises(RewardFuncError, match=r"builtin:math.*sample 1.*--label_key"):
        src(["a 1", "b 2"], ["a", "b"], [1, None])


def test_format_and_exact():
    fmt = get_builtin("format")
    queries = ["P<think>hm</think> <answer>4</answer>", "P<answer>4</answer>",
               "P <think>a\nb</think>\n<answer>x</answer>\n"]
    assert fmt(queries, ["P"] * 3, None)["rewards"] == [1.0, 0.0, 1.0]
    custom = make_format_reward_func(r"^\s*Answer: \d+\s*$")
    assert custom(["P Answer: 12", "P Answer: twelve"], ["P", "P"], None)["rewards"] == [1.0, 0.0]
    with pytest.raises(ValueError, match="invalid regular expression"):
        make_format_reward_func("(")
    exact = get_builtin("exact")
    assert exact(["Q: Paris ", "Q: paris"], ["Q:", "Q:"], ["Paris", "Paris"])["rewards"] == [1.0, 0.0]
    with pytest.raises(ValueError, match="builtin:nope"):
        get_builtin("nope")
