"""A test environment: two turns. After the first action it asks again; the episode's reward is the share of
uppercase ASCII letters among both actions' characters (dense: GRPO on a tiny model can climb it). Every call is
recorded in CALLS so the tests can check what the environment saw."""

import string

CALLS: list[tuple[str, dict]] = []
FEEDBACK = "<|im_end|>\n<|im_start|>user\nAgain, louder.<|im_end|>\n<|im_start|>assistant\n"


def upper_share(texts):
    chars = [c for t in texts for c in t if not c.isspace()]
    return sum(c in string.ascii_uppercase for c in chars) / len(chars) if chars else 0.0


class AgentInstance:
    def __init__(self):
        self.actions = []

    async def reset(self, states):
        CALLS.append(("reset", dict(states)))
        return {"observation": states["observation"]}

    async def step(self, states):
        CALLS.append(("step", dict(states)))
        self.actions.append(states["action_text"])
        share = upper_share(self.actions)
        done = states["turn"] >= 1
        return {"rewards": share, "scores": share, "environment_feedback": "" if done else FEEDBACK, "done": done,
                "extra_logs": {"upper_share": share, "turn": float(states["turn"])}}
