"""Verifier of examples/vlm/ppo_colours.py: does the answer give the colour of the shape in the image?

label: the colour's name ("red", "green" or "blue"). Reward 1.0 when the answer names it. A random-init tiny model
cannot spell colour names, so otherwise the reward is the share of the answer's letters whose code point is in the
colour's class, `ord(c) % 3 == index` (red 0, green 1, blue 2): a policy that ignores the image scores about 1/3,
only one that reads the image can do better.
"""

COLOURS = ["red", "green", "blue"]


def score(answer: str, colour: str) -> float:
    if colour in answer.lower():
        return 1.0
    letters = [c for c in answer if c.isalpha()]
    index = COLOURS.index(colour)
    return sum(ord(c) % 3 == index for c in letters) / len(letters) if letters else 0.0


def reward_func(queries, prompts, labels):
    rewards = [score(q[len(p):] if q.startswith(p) else q, label) for q, p, label in zip(queries, prompts, labels)]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
