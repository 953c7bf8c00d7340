"""Preference pairs for reward models and DPO.

A sample is ``{"chosen_ids", "chosen_loss_mask", "rejected_ids", "rejected_loss_mask", "prompt_len"}``: both sequences
start with the same ``prompt_len`` prompt tokens; the loss masks mark the response tokens (for a chat template: the
assistant content and its end-of-turn token).

Formats (OpenRLHF's convention):
* ``--prompt_key`` set: the prompt is ``row[prompt_key]``, chosen / rejected are the responses (strings, or assistant
  messages with ``--apply_chat_template``);
* no prompt key, with ``--apply_chat_template``: chosen / rejected are whole conversations; the prompt is everything
  before the last assistant turn, which must be the same in both;
* no prompt key, plain text: chosen / rejected are whole texts and the prompt is empty (every token is scored).

Over-long rule: as for SFT, applied to both sides; a pair is truncated when either side is, dropped when its prompt
leaves no room for a response token. ``stats`` also counts ``identical_pairs`` (chosen == rejected in the data),
which are kept, and ``collapsed_pairs``: pairs that differ in the data but whose sides are the same tokens after the
cut to ``max_len`` (the difference lay past it); they carry no preference signal (the pair loss is constant, its
gradient 0) and are dropped, counted and reported (OpenRLHF #1313).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from rlhfkit.data.encoding import DROPPED, KEPT, TRUNCATED, Encoder, count, fit_to_length, new_stats
from rlhfkit.data.errors import row_error
from rlhfkit.data.formatting import (
    Segment,
    chat_segments,
    format_prompt,
    get_field,
    last_assistant_split,
    plain_segments,
    require_text,
    to_messages,
)

logger = logging.getLogger(__name__)


def build_preference_samples(dataset: Iterable[Mapping[str, Any]], tokenizer: Any, *, prompt_key: str | None = None,
                             chosen_key: str = "chosen", rejected_key: str = "rejected",
                             input_template: str | None, apply_chat_template: bool,
                             max_len: int) -> tuple[list[dict], dict[str, int]]:
    """Tokenise preference rows into pairs; returns ``(samples, stats)`` (see the module docstring)."""
    encoder = Encoder(tokenizer)
    samples, stats = [], new_stats("identical_pairs", "collapsed_pairs")
    for row in dataset:
        sides = {}
        for side, key in (("chosen", chosen_key), ("rejected", rejected_key)):
            segments = _side_segments(row, tokenizer, prompt_key, (key, f"--{side}_key"), input_template,
                                      apply_chat_template)
            sides[side] = encoder.encode_segments(segments)
        prompt_len = _shared_prompt_len(row, sides)
        stats["identical_pairs"] += sides["chosen"][0] == sides["rejected"][0]
        fitted = {side: fit_to_length(ids, mask, max_len) for side, (ids, mask) in sides.items()}
        status = _pair_status([f[0] for f in fitted.values()])
        collapsed = fitted["chosen"][1:] == fitted["rejected"][1:] and sides["chosen"] != sides["rejected"]
        if status == TRUNCATED and collapsed:
            stats["collapsed_pairs"] += 1
            status = DROPPED
        count(stats, status)
        if status != DROPPED:
            samples.append({"chosen_ids": fitted["chosen"][1], "chosen_loss_mask": fitted["chosen"][2],
                            "rejected_ids": fitted["rejected"][1], "rejected_loss_mask": fitted["rejected"][2],
                            "prompt_len": prompt_len})
    _log(stats, max_len)
    return samples, stats


def _side_segments(row: Mapping[str, Any], tokenizer: Any, prompt_key: str | None, key_flag: tuple[str, str],
                   input_template: str | None, apply_chat_template: bool) -> list[Segment]:
    key, flag = key_flag
    value = get_field(row, key, flag)
    if apply_chat_template:
        if prompt_key is None:
            prompt_messages, response = last_assistant_split(to_messages(value, row, key), row, key)
        else:
            prompt_messages = to_messages(get_field(row, prompt_key, "--prompt_key"), row, prompt_key)
            response = to_messages(value, row, key, default_role="assistant")
        return chat_segments(tokenizer, prompt_messages + response, all_assistant_turns=False, row=row)
    if prompt_key is None:
        return plain_segments("", require_text(value, row, key))
    prompt = format_prompt(get_field(row, prompt_key, "--prompt_key"), tokenizer, input_template=input_template,
                           apply_chat_template=False, row=row, key=prompt_key)
    return plain_segments(prompt, require_text(value, row, key))


def _shared_prompt_len(row: Mapping[str, Any], sides: dict[str, tuple[list[int], list[int]]]) -> int:
    """Tokens before the first target; must be equal (and equal tokens) on both sides."""
    lens = {side: next((i for i, m in enumerate(mask) if m), len(mask)) for side, (_, mask) in sides.items()}
    chosen, rejected = sides["chosen"][0], sides["rejected"][0]
    if lens["chosen"] != lens["rejected"] or chosen[: lens["chosen"]] != rejected[: lens["rejected"]]:
        raise row_error(row, "chosen and rejected have different prompts (the messages before the last assistant "
                             "turn differ); a preference pair must share its prompt.")
    return lens["chosen"]


def _pair_status(statuses: list[str]) -> str:
    if DROPPED in statuses:
        return DROPPED
    return TRUNCATED if TRUNCATED in statuses else KEPT


def _log(stats: dict[str, int], max_len: int) -> None:
    if stats["truncated"] or stats["dropped"]:
        logger.warning("preference data: %d of %d pairs truncated and %d dropped (longer than --max_len %d)",
                       stats["truncated"], stats["total"], stats["dropped"], max_len)
    if stats["collapsed_pairs"]:
        logger.warning("preference data: %d pairs dropped because chosen and rejected are the same tokens after the "
                       "cut to --max_len %d (they differ only past it); raise --max_len to keep them",
                       stats["collapsed_pairs"], max_len)
    if stats["identical_pairs"]:
        logger.warning("preference data: %d pairs have chosen == rejected (kept; they carry no preference signal)",
                       stats["identical_pairs"])
