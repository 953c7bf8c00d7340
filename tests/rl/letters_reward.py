"""A dense rule reward a random-init tiny model can climb: the share of uppercase ASCII letters among the
response's non-space characters (random tokens score about 0.1; tokens such as 'EMS' or 'API' score 1)."""

import string


def reward_func(queries, prompts, labels):
    rewards = []
    for query, prompt in zip(queries, prompts):
        response = query[len(prompt):] if query.startswith(prompt) else query
        chars = [c for c in response if not c.isspace()]
        rewards.append(sum(c in string.ascii_uppercase for c in chars) / len(chars) if chars else 0.0)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
