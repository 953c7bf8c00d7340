"""Example reward file: `rlhfkit ppo ... --remote_rm_url examples/reward_funcs/math_reward.py --label_key answer`.

OpenRLHF's shape: `reward_func(queries, prompts, labels)` gets a batch (query = prompt + response text, the prompt
alone, the `--label_key` values) and returns a dict with `rewards` (one number per sample, used for training),
optional `scores` (used for dynamic filtering; defaults to `rewards`) and optional `extra_logs` (per-sample values
logged as metrics). Raising, returning NaN or the wrong length stops the run with an error naming the sample
(or, with `--reward_error_policy zero`, scores that sample 0 and counts it). Only the standard library is used here;
`rlhfkit.rewards.verifiers` has a fuller answer extractor (`builtin:math`).
"""

import re
from fractions import Fraction

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def to_number(text):
    """'1,234' / '-3.5' / '3/4' -> Fraction, else None."""
    text = text.replace(",", "").replace("$", "").strip()
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def answer_of(response):
    """The last \\boxed{...} (without nested braces in this short example), else the last number."""
    boxed = BOXED.findall(response)
    if boxed:
        return boxed[-1]
    numbers = NUMBER.findall(response)
    return numbers[-1] if numbers else None


def reward_func(queries, prompts, labels):
    rewards, correct, formatted = [], [], []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if query.startswith(prompt) else query
        answer = answer_of(response)
        ok = answer is not None and to_number(answer) is not None and to_number(answer) == to_number(str(label))
        fmt = FORMAT.match(response) is not None
        correct.append(float(ok))
        formatted.append(float(fmt))
        rewards.append(float(ok) + 0.1 * float(fmt))  # accuracy plus a small format bonus
    return {"rewards": rewards, "scores": correct, "extra_logs": {"accuracy": correct, "format_ok": formatted}}
