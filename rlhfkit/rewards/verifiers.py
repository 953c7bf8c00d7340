"""Built-in verifiable rewards, selected by name: ``--remote_rm_url builtin:math`` (``format``, ``exact``, ``code``).

Each built-in is a ``reward_func(queries, prompts, labels)`` of the user-file shape, so it runs under the same
timeout, validation and error policy (:class:`rlhfkit.rewards.reward_func.RewardFuncSource`). The response is
``query[len(prompt):]`` when the query starts with its prompt, else the whole query
(:func:`rlhfkit.rewards.base.response_of`).

* ``math``: the answer is the content of the last ``\\boxed{...}`` (nested braces allowed), else the last number in
  the response. Numbers may be integers, decimals, ``a/b`` or ``\\frac{a}{b}``, with a sign, ``$`` and thousands
  commas; they are compared exactly as fractions (relative tolerance 1e-9 for float labels). A label may be a
  number or a string (a number, ``\\boxed{..}``, or GSM8K's ``... #### 42``); non-numeric answers are compared
  as text (whitespace removed, case folded). Reward 1.0 / 0.0; no answer -> 0.0. A None label is an error.
  A number too long for Python's integer conversion (over ``sys.get_int_max_str_digits()``, 4,300 digits by
  default) in the answer or the label fails that sample alone: reward 0 and ``extra_logs["reward_failure"]``
  ``number_too_long`` (another arithmetic error: ``unparseable_number``).
* ``format``: 1.0 when the response matches ``<think>...</think><answer>...</answer>`` (whitespace around allowed),
  or a user regex (``format_pattern``, matched with ``re.search`` and ``re.DOTALL``; anchor it with ``^...$``).
* ``exact``: 1.0 when the stripped response equals the stripped label.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from rlhfkit.rewards.base import response_of

DEFAULT_FORMAT = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
REL_TOL = 1e-9
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC = r"\\[dt]?frac\s*\{\s*-?\d+\s*\}\s*\{\s*-?\d+\s*\}"
_PLAIN = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|\.\d+"
_NUMBER = re.compile(rf"-?\$?-?(?:{_FRAC}|{_PLAIN})")
_FRAC_PARTS = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
_DECIMAL = re.compile(r"^[+-]?(?:\d+(?:\.\d*)?|\.\d+)$")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent or unclosed."""
    matches = list(_BOXED.finditer(text))
    for match in reversed(matches):
        depth, start = 1, match.end()
        for pos in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[pos], 0)
            if depth == 0:
                return text[start:pos]
    return None


def extract_final_number(text: str) -> str | None:
    """The last number in ``text`` (integer, decimal, ``a/b``, ``\\frac{a}{b}``, with sign / ``$`` / commas)."""
    found = _NUMBER.findall(text.replace("\u2212", "-"))
    return found[-1] if found else None


def extract_answer(response: str) -> str | None:
    """The last boxed answer, else the final number, else None."""
    boxed = extract_boxed(response)
    return boxed if boxed is not None else extract_final_number(response)


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact fraction (``"1,234"``, ``"$-3.5"``, ``"3/4"``, ``"\\frac{1}{2}"``, ``"50%"``), or None."""
    s = text.strip().replace("\u2212", "-")
    for junk in ("$", ",", " ", "\\!", "\\,", "\\;", "\\ ", "\\%", "%", "\\left", "\\right"):
        s = s.replace(junk, "")
    s = s.rstrip(".")
    if s.startswith("+"):
        s = s[1:]
    frac = _FRAC_PARTS.match(s)
    if frac:
        sign, num, den = frac.groups()
        return None if int(den) == 0 else Fraction(int(num), int(den)) * (-1 if sign else 1)
    if "/" in s:
        num, _, den = s.partition("/")
        a, b = parse_number(num), parse_number(den)
        return None if a is None or b is None or b == 0 else a / b
    return Fraction(s) if _DECIMAL.match(s) else None


def label_answer(label: Any) -> str:
    """The answer part of a label: the last ``\\boxed{}`` content, else the text after GSM8K's ``####``, else all."""
    text = repr(label) if isinstance(label, float) else str(label)
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    return text.rsplit("####", 1)[1] if "####" in text else text


def _normalize_text(text: str) -> str:
    return re.sub(r"\s+", "", str(text)).strip("$.").lower()


def math_equal(answer: str | None, label: Any) -> bool:
    """True when an extracted ``answer`` equals ``label`` numerically (or as normalised text if not a number)."""
    if answer is None:
        return False
    target_text = label_answer(label)
    value, target = parse_number(answer), (None if isinstance(label, bool) else parse_number(target_text))
    if value is not None and target is not None:
        return value == target or abs(value - target) <= REL_TOL * max(abs(value), abs(target))
    if value is None and target is None:
        return _normalize_text(answer) == _normalize_text(target_text)
    return False


_DIGIT_RUN = re.compile(r"\d+")


def _too_long(*texts: Any) -> bool:
    """Whether a text holds a digit run over Python's int-string conversion limit (0: no limit)."""
    limit = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0
    return bool(limit) and any(len(run) > limit for t in texts for run in _DIGIT_RUN.findall(str(t)))


def math_verdict(answer: str | None, label: Any) -> tuple[float, str]:
    """(reward, failure reason) of one sample: ``math_equal`` as 1.0 / 0.0 with ``""``, or 0.0 with
    ``number_too_long`` / ``unparseable_number`` when comparing the numbers fails."""
    try:
        return float(math_equal(answer, label)), ""
    except (ValueError, ArithmeticError):
        return 0.0, "number_too_long" if _too_long(answer, label_answer(label)) else "unparseable_number"


def _require_labels(labels: list[Any] | None, n: int, name: str) -> list[Any]:
    if labels is None or any(label is None for label in labels):
        index = 0 if labels is None else next(i for i, label in enumerate(labels) if label is None)
        raise ValueError(f"{name} needs a label for every sample (set --label_key); sample {index} has none")
    if len(labels) != n:
        raise ValueError(f"{name}: {n} queries but {len(labels)} labels")
    return labels


def math_reward_func(queries: list[str], prompts: list[str], labels: list[Any]) -> dict[str, Any]:
    """1.0 when the response's answer (last boxed, else final number) equals the label, else 0.0."""
    labels = _require_labels(labels, len(queries), "builtin:math")
    answers = [extract_answer(response_of(q, p)) for q, p in zip(queries, prompts)]
    verdicts = [math_verdict(a, label) for a, label in zip(answers, labels)]
    rewards = [reward for reward, _ in verdicts]
    return {"rewards": rewards, "scores": rewards,
            "extra_logs": {"math_has_answer": [float(a is not None) for a in answers],
                           "reward_failure": [reason for _, reason in verdicts]}}


def make_format_reward_func(pattern: str | None = None) -> Callable[..., dict[str, Any]]:
    """A reward_func giving 1.0 when the response matches ``pattern`` (default: think/answer tags)."""
    try:
        regex = re.compile(pattern or DEFAULT_FORMAT, re.DOTALL)
    except re.error as err:
        raise ValueError(f"builtin:format: invalid regular expression {pattern!r}: {err}") from err

    def format_reward_func(queries: list[str], prompts: list[str], labels: list[Any]) -> dict[str, Any]:
        rewards = [float(regex.search(response_of(q, p)) is not None) for q, p in zip(queries, prompts)]
        return {"rewards": rewards, "scores": rewards}

    return format_reward_func


def exact_reward_func(queries: list[str], prompts: list[str], labels: list[Any]) -> dict[str, Any]:
    """1.0 when the stripped response equals the stripped label."""
    labels = _require_labels(labels, len(queries), "builtin:exact")
    rewards = [float(response_of(q, p).strip() == str(label).strip()) for q, p, label in zip(queries, prompts, labels)]
    return {"rewards": rewards, "scores": rewards}


BUILTINS: dict[str, str] = {
    "math": "last \\boxed{} or final number == label (exact fractions)",
    "format": "response matches <think>...</think><answer>...</answer> (or --reward_format_pattern)",
    "exact": "stripped response == stripped label",
    "code": "the response's Python program passes the label's tests in a sandbox (rewards/code.py, sandbox.py)",
}


def get_builtin(name: str, *, format_pattern: str | None = None, program_timeout: float | None = None,
                code_sandbox: str = "auto", code_limits: Any = None) -> Callable[..., dict[str, Any]]:
    """The reward_func of a built-in verifier by name; a clear error listing the names otherwise.
    ``program_timeout``: seconds each program of ``builtin:code`` may run (None: its default);
    ``code_sandbox`` / ``code_limits``: its sandbox mode and :class:`rlhfkit.rewards.sandbox.SandboxLimits`."""
    if name == "math":
        return math_reward_func
    if name == "format":
        return make_format_reward_func(format_pattern)
    if name == "exact":
        return exact_reward_func
    if name == "code":
        from rlhfkit.rewards.code import make_code_reward_func

        return make_code_reward_func(timeout=5.0 if program_timeout is None else program_timeout, sandbox=code_sandbox,
                                     limits=code_limits)
    known = ", ".join(f"builtin:{k} ({v})" for k, v in BUILTINS.items())
    raise ValueError(f"unknown built-in reward 'builtin:{name}'; known: {known}")
