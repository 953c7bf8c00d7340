"""Example tool-use environment: the model may call a calculator before it answers.

    rlhfkit ppo ... --agent_func_path examples/agents/calculator_env.py --label_key label --agent_action_max_len 48

An action containing `<calc>EXPRESSION</calc>` is a tool call: the environment evaluates the arithmetic (+ - * /
// % ** and parentheses on numbers; nothing else is executed) and answers with `<result>VALUE</result>` as the
next user turn. An action without a tool call is the final answer, checked against the label: reward 1 or 0. At
most MAX_CALLS tool calls; each costs a little reward (TOOL_COST), so the policy learns to call only when it helps.
"""

import ast
import operator
import re

from rlhfkit.rewards.verifiers import extract_answer, math_equal

MAX_CALLS = 3
TOOL_COST = 0.05
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
       ast.UAdd: operator.pos}


def calculate(expression):
    """Evaluate plain arithmetic safely (an AST walk, no eval); returns the value or an error string."""
    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.operand))
        raise ValueError("only numbers and + - * / // % ** are allowed")

    try:
        return walk(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
        return f"error: {err}"


def user_turn(text, states):
    """A ChatML user turn; the end-of-turn marker first when the action was cut before it wrote one."""
    end = "" if states.get("finish_reason") == "stop" else "<|im_end|>"
    return f"{end}\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


class AgentInstance:
    def __init__(self):
        self.calls = 0

    def step(self, states):
        call = CALL.search(states["action_text"])
        if call is not None and self.calls < MAX_CALLS:
            self.calls += 1
            return {"rewards": 0.0, "scores": 0.0, "done": False,
                    "environment_feedback": user_turn(f"<result>{calculate(call.group(1))}</result>", states),
                    "extra_logs": {"tool_calls": float(self.calls)}}
        correct = math_equal(extract_answer(CALL.sub("", states["action_text"])), states["label"])
        reward = float(correct) - TOOL_COST * self.calls
        return {"rewards": reward, "scores": float(correct), "done": True, "environment_feedback": "",
                "extra_logs": {"tool_calls": float(self.calls), "solved": float(correct)}}
