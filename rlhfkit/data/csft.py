"""Conditional SFT (`rlhfkit sft --csft_keys`, `rlhfkit batch-inference --enable_csft`): attribute values such as a
reward score, put before the prompt as a condition the model learns to follow."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from rlhfkit.data.formatting import get_field, require_text, to_messages


def csft_prompt(values: Mapping[str, Any]) -> str:
    """Conditional SFT's condition text: one ``<key>: value`` line per attribute, numbers with two decimals
    (``<rm_score>: 5.00``, the format of OpenRLHF's ``--csft_prompt``). Use the same text at generation time."""
    def fmt(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, numbers.Real) and not isinstance(v, bool) else str(v)
    return "\n".join(f"<{key}>: {fmt(value)}" for key, value in values.items())


def condition_row(row: Mapping[str, Any], keys: list[str], input_key: str, chat: bool) -> dict[str, Any]:
    """``--csft_keys``: the row with its attribute values put before the prompt: a system message (merged into an
    existing one) with a chat template, else a first line of the prompt text."""
    condition = csft_prompt({k: get_field(row, k, "--csft_keys") for k in keys})
    value = get_field(row, input_key, "--input_key")
    if not chat:
        return {**row, input_key: condition + "\n" + require_text(value, row, input_key)}
    messages = to_messages(value, row, input_key)
    if messages[0]["role"] == "system":
        messages = [{**messages[0], "content": condition + "\n" + messages[0]["content"]}, *messages[1:]]
    else:
        messages = [{"role": "system", "content": condition}, *messages]
    return {**row, input_key: messages}
