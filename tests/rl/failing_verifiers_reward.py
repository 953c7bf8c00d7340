"""Reward for the per-sample failure test: the built-in verifiers meet what breaks them. Sample 0 of each prompt's
group answers with a 5,000-digit number (builtin:math's verifier), sample 1 is a program that prints bytes that
are not UTF-8 (builtin:code's runner); the others get the uppercase share of the response."""

import string

from rlhfkit.rewards.code import make_code_reward_func
from rlhfkit.rewards.verifiers import math_reward_func

HUGE = "7" * 5000
NOT_UTF8 = "```python\nimport sys\nsys.stdout.buffer.write(b'3\\xff\\xfe\\n')\n```"
code_reward = make_code_reward_func(timeout=20, workers=2)


def reward_func(queries, prompts, labels):
    rewards, reasons = [], []
    for i, (query, prompt) in enumerate(zip(queries, prompts)):
        if i % 8 == 0:
            out = math_reward_func([prompt + HUGE], [prompt], ["4"])
        elif i % 8 == 1:
            out = code_reward([prompt + NOT_UTF8], [prompt], [{"inputs": [""], "outputs": ["3"]}])
        else:
            chars = [c for c in query[len(prompt):] if not c.isspace()]
            out = {"rewards": [sum(c in string.ascii_uppercase for c in chars) / len(chars) if chars else 0.0],
                   "extra_logs": {"reward_failure": [""]}}
        rewards += out["rewards"]
        reasons += out["extra_logs"]["reward_failure"]
    return {"rewards": rewards, "extra_logs": {"reward_failure": reasons}}
