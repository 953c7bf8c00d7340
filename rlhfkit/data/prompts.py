"""Prompt samples for online RL: ``{"prompt": str, "prompt_ids": list[int], "label": Any}``.

The prompt is ``--input_key`` formatted by the chat template (with the generation prompt) or by ``--input_template``;
``prompt_ids`` are its tokens (the rollout engines take token ids in). ``label`` is ``row[--label_key]`` (e.g. the
reference answer a verifier checks) or None without a label key.

Over-long rule: a prompt with more than ``--prompt_max_len`` tokens is dropped (a cut prompt would ask a different
question); ``stats`` counts ``total``, ``kept`` and ``dropped`` (``truncated`` is always 0).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from rlhfkit.data.encoding import DROPPED, KEPT, Encoder, count, new_stats
from rlhfkit.data.formatting import format_prompt, get_field
from rlhfkit.errors import DataError

logger = logging.getLogger(__name__)


def build_prompt_samples(dataset: Iterable[Mapping[str, Any]], tokenizer: Any, *, input_key: str,
                         label_key: str | None = None, input_template: str | None,
                         apply_chat_template: bool, prompt_max_len: int) -> tuple[list[dict], dict[str, int]]:
    """Format and tokenise RL prompts; returns ``(samples, stats)`` (see the module docstring)."""
    if prompt_max_len < 1:
        raise DataError(f"--prompt_max_len must be >= 1, got {prompt_max_len}.")
    encoder = Encoder(tokenizer)
    samples, stats = [], new_stats()
    for row in dataset:
        value = get_field(row, input_key, "--input_key")
        prompt = format_prompt(value, tokenizer, input_template=input_template,
                               apply_chat_template=apply_chat_template, row=row, key=input_key)
        label = get_field(row, label_key, "--label_key") if label_key else None
        prompt_ids = encoder.encode_text(prompt)
        status = DROPPED if len(prompt_ids) > prompt_max_len else KEPT
        count(stats, status)
        if status == KEPT:
            samples.append({"prompt": prompt, "prompt_ids": prompt_ids, "label": label})
    if stats["dropped"]:
        logger.warning("prompt data: %d of %d prompts dropped (longer than --prompt_max_len %d)",
                       stats["dropped"], stats["total"], prompt_max_len)
    return samples, stats
