"""Example agent over rlhfkit's OpenAI-compatible endpoint: the model may call a calculator before it answers.

    rlhfkit ppo ... --agent_func_path examples/agents/openai_calculator_agent.py --label_key label \
        --agent_action_max_len 32 --generate_max_len 160      # no --apply_chat_template: the agent builds messages

rlhfkit calls `run_agent(base_url, prompt, label)` once per episode with the episode's own endpoint; any OpenAI
client code works against it. A reply containing `<calc>EXPRESSION</calc>` is a tool call: the agent evaluates the
arithmetic (an AST walk, nothing else is executed), sends the result back as a `tool` message and asks again. A
reply without a call is the final answer: reward 1 when it matches the label, minus TOOL_COST per call.

Keep the history as the endpoint returned it (the assistant `content` verbatim): rlhfkit trains on the sampled
tokens and refuses an episode whose next prompt does not continue the previous prompt and reply (multi-turn drift).
"""

import ast
import operator
import re

from openai import AsyncOpenAI

MAX_CALLS = 3
TOOL_COST = 0.05
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
SYSTEM = ("You can use a calculator: write <calc>EXPRESSION</calc> and stop; the result comes back as a tool "
          "message. Then reply with only the number.")
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression):
    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            return OPS[type(node.op)](walk(node.operand))
        raise ValueError("only numbers and + - * / // % are allowed")

    try:
        return walk(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
        return f"error: {err}"


async def run_agent(base_url, prompt, label):
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    for calls in range(MAX_CALLS + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=32)
        text = reply.choices[0].message.content
        call = CALL.search(text)
        if call is None or calls == MAX_CALLS:
            answer = text.strip().rstrip(".")
            return float(answer == str(label).strip()) - TOOL_COST * calls
        messages += [{"role": "assistant", "content": text},
                     {"role": "tool", "content": str(calculate(call.group(1)))}]
    return 0.0
