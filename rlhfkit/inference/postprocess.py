"""Turn scored generations `{"input", "output", "reward", ...}` into training data (`--post_processor`).

* `rs` (rejection sampling / best-of-n): per input, the output with the highest reward -> an SFT row
  `{"input", "output", "reward"}` (train with `rlhfkit sft --input_key input --output_key output`).
* `csft` (conditional SFT): every row, with `rm_score` = the reward standardised over the file,
  `(r - mean) / std` (population std), rounded to 2 decimals (train with `rlhfkit sft --csft_keys rm_score`, then
  generate with a high score in the prompt).
* `iter_dpo`: per input with at least two outputs, `chosen` = the highest-reward output, `rejected` = the lowest
  -> `{"prompt", "chosen", "rejected", "chosen_reward", "rejected_reward"}` (train with `rlhfkit dpo --prompt_key
  prompt`). An input whose outputs all have the same reward gives no preference and is skipped; the count is
  returned (and printed), never silently lost.

Ties inside a group go to the earliest output (stable). Inputs keep their first-seen order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

POST_PROCESSORS = ("rs", "csft", "iter_dpo")


def group_by_input(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["input"], []).append(row)
    return groups


def rejection_sampling(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Best output per input: `argmax_j reward_j` (first on ties)."""
    out = []
    for prompt, group in group_by_input(rows).items():
        best = max(group, key=lambda r: r["reward"])  # max() keeps the first maximal element
        out.append({"input": prompt, "output": best["output"], "reward": best["reward"]})
    return out, {"inputs": len(out), "rows": len(out)}


def conditional_sft(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Every row with `rm_score = round((r - mean(r)) / std(r), 2)` (std = 1 when all rewards are equal)."""
    rewards = [float(r["reward"]) for r in rows]
    mean = math.fsum(rewards) / len(rewards)
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in rewards) / len(rewards)) or 1.0
    out = [{**r, "rm_score": round((float(r["reward"]) - mean) / std, 2)} for r in rows]
    return out, {"inputs": len(group_by_input(rows)), "rows": len(out)}


def iterative_dpo_pairs(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Per input: chosen = argmax reward, rejected = argmin reward; inputs with one output or all-equal rewards
    are skipped and counted."""
    out, single, tied = [], 0, 0
    groups = group_by_input(rows)
    for prompt, group in groups.items():
        if len(group) < 2:
            single += 1
            continue
        best = max(group, key=lambda r: r["reward"])
        worst = min(group, key=lambda r: r["reward"])
        if best["reward"] == worst["reward"]:
            tied += 1
            continue
        out.append({"prompt": prompt, "chosen": best["output"], "rejected": worst["output"],
                    "chosen_reward": best["reward"], "rejected_reward": worst["reward"]})
    return out, {"inputs": len(groups), "rows": len(out), "skipped_single_output": single,
                 "skipped_all_equal": tied}


def get_post_processor(name: str) -> Callable[[list[dict[str, Any]]], tuple[list[dict[str, Any]], dict[str, int]]]:
    table = {"rs": rejection_sampling, "csft": conditional_sft, "iter_dpo": iterative_dpo_pairs}
    if name not in table:
        raise ValueError(f"--post_processor {name!r}: expected one of {', '.join(POST_PROCESSORS)}")
    return table[name]
