"""Example multi-turn environment: answer, hear whether it was right, try again (at most 3 attempts).

    rlhfkit ppo ... --agent_func_path examples/agents/retry_env.py --label_key label --agent_action_max_len 24

One `AgentInstance` per episode. After every answer, `step` checks it against the label with rlhfkit's math
verifier: right -> done with reward 1 / attempt (1, 0.5, 0.33: getting it right early pays more); wrong -> the
feedback below becomes the next user turn (ChatML, the template of SmolLM2 and Qwen: write your model's own), and
after the last attempt the episode ends with reward 0. The feedback tokens are context for the next answer and
never trained on. `reset` is optional; `step` may be sync or async (async steps of a batch run concurrently).
"""

from rlhfkit.rewards.verifiers import extract_answer, math_equal

MAX_ATTEMPTS = 3
RETRY = "\n<|im_start|>user\nThat is not right. Try again: reply with only the number.<|im_end|>\n" \
        "<|im_start|>assistant\n"


def end_of_turn(states):
    """The end-of-turn marker when the action was cut before it wrote one (ChatML)."""
    return "" if states.get("finish_reason") == "stop" else "<|im_end|>"


class AgentInstance:
    def __init__(self):
        self.attempts = 0

    async def reset(self, states):
        return {"observation": states["observation"]}  # keep the prompt as it is

    async def step(self, states):
        self.attempts += 1
        correct = math_equal(extract_answer(states["action_text"]), states["label"])
        done = correct or self.attempts >= MAX_ATTEMPTS
        reward = 1.0 / self.attempts if correct else 0.0
        return {
            "rewards": reward,                      # the last step's reward is the episode's reward
            "scores": float(correct),               # pass@k and dynamic filtering use scores
            "environment_feedback": "" if done else end_of_turn(states) + RETRY,
            "done": done,
            "extra_logs": {"attempts": float(self.attempts), "solved": float(correct)},
        }
