"""SFT samples: ``{"input_ids": [...], "loss_mask": [...]}`` with the loss on the response tokens.

* plain text: ``input_template(input)`` is the prompt, ``output`` + eos the target;
* ``--apply_chat_template``: input (string or messages) + output (string or messages) rendered by the chat template;
  without ``--output_key`` the input is a whole conversation and its last assistant turn is the target. The target
  is the assistant content plus its end-of-turn token, never the role header;
* ``--multiturn``: every assistant turn is a target;
* ``--pretrain_mode``: every token is a target (the input template is not used).

Over-long rule: a sample longer than ``--max_len`` is truncated on the right when its prompt fits with at least one
response token, otherwise it is dropped; ``stats`` counts ``total``, ``kept``, ``truncated`` and ``dropped``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlhfkit.data.encoding import DROPPED, Encoder, count, fit_to_length, new_stats
from rlhfkit.data.formatting import (
    PROMPT,
    TARGET,
    Segment,
    apply_input_template,
    chat_segments,
    get_field,
    plain_segments,
    render_chat,
    require_text,
    to_messages,
)
from rlhfkit.errors import DataError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SftFormat:
    """How a row becomes prompt + response (the SFT data flags)."""

    input_key: str = "input"
    output_key: str | None = None
    input_template: str | None = None
    apply_chat_template: bool = False
    multiturn: bool = False
    pretrain_mode: bool = False

    def check(self) -> None:
        """Reject flag combinations that cannot work, before reading any row."""
        if self.multiturn and not self.apply_chat_template:
            raise DataError("--multiturn needs --apply_chat_template (turns are found through the chat template).")
        if self.output_key is None and not (self.apply_chat_template or self.pretrain_mode):
            raise DataError("--output_key is required, unless --apply_chat_template is set (the input is then a whole "
                            "conversation) or --pretrain_mode is set.")


def build_sft_samples(dataset: Iterable[Mapping[str, Any]], tokenizer: Any, *, input_key: str,
                      output_key: str | None, input_template: str | None, apply_chat_template: bool, max_len: int,
                      multiturn: bool = False, pretrain_mode: bool = False) -> tuple[list[dict], dict[str, int]]:
    """Tokenise rows into SFT samples; returns ``(samples, stats)`` (see the module docstring)."""
    fmt = SftFormat(input_key, output_key, input_template, apply_chat_template, multiturn, pretrain_mode)
    fmt.check()
    encoder = Encoder(tokenizer)
    samples, stats = [], new_stats()
    for row in dataset:
        ids, mask = encode_sft_row(row, encoder, fmt)
        status, ids, mask = fit_to_length(ids, mask, max_len)
        count(stats, status)
        if status != DROPPED:
            samples.append({"input_ids": ids, "loss_mask": mask})
    _log_stats("sft", stats, max_len)
    return samples, stats


def encode_sft_row(row: Mapping[str, Any], encoder: Encoder, fmt: SftFormat) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of one row, before the over-long rule."""
    segments = sft_segments(row, encoder.tokenizer, fmt)
    return encoder.encode_segments(segments, all_targets=fmt.pretrain_mode)


def sft_segments(row: Mapping[str, Any], tokenizer: Any, fmt: SftFormat) -> list[Segment]:
    """The prompt / target segments of one row."""
    value = get_field(row, fmt.input_key, "--input_key")
    if fmt.apply_chat_template:
        messages = to_messages(value, row, fmt.input_key)
        if fmt.output_key is not None:
            output = get_field(row, fmt.output_key, "--output_key")
            messages += to_messages(output, row, fmt.output_key, default_role="assistant")
        if fmt.pretrain_mode:
            return [(render_chat(tokenizer, messages, add_generation_prompt=False, row=row), PROMPT)]
        return chat_segments(tokenizer, messages, all_assistant_turns=fmt.multiturn, row=row)
    text = require_text(value, row, fmt.input_key)
    if fmt.pretrain_mode:
        response = require_text(get_field(row, fmt.output_key, "--output_key"), row, fmt.output_key) \
            if fmt.output_key else ""
        return [(text + response, TARGET)]
    assert fmt.output_key is not None  # SftFormat refuses a plain input without --output_key
    response = require_text(get_field(row, fmt.output_key, "--output_key"), row, fmt.output_key)
    return plain_segments(apply_input_template(text, fmt.input_template), response)


def _log_stats(kind: str, stats: dict[str, int], max_len: int) -> None:
    if stats["truncated"] or stats["dropped"]:
        logger.warning("%s data: %d of %d samples truncated and %d dropped (longer than --max_len %d)",
                       kind, stats["truncated"], stats["total"], stats["dropped"], max_len)
