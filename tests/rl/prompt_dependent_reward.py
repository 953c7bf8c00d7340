"""Reward for option tests: every sample of a prompt that mentions "red" gets 1 (an all-equal group, no learning
signal); other prompts get the uppercase share of the response. With FAIL_ON_RED set, those samples raise."""

import os
import string


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt in zip(queries, prompts):
        if "red" in prompt:
            if os.environ.get("FAIL_ON_RED"):
                raise ValueError("cannot score red")
            rewards.append(1.0)
            continue
        chars = [c for c in query[len(prompt):] if not c.isspace()]
        rewards.append(sum(c in string.ascii_uppercase for c in chars) / len(chars) if chars else 0.0)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
