"""Unpaired (KTO) samples: one prompt + response with a desirable / undesirable label.

A sample is ``{"input_ids", "loss_mask", "prompt_len", "label": bool}``; prompt and response are formatted exactly
as for SFT (``--input_key``, ``--output_key``, ``--input_template``, ``--apply_chat_template``).

Labels: ``true`` / ``false`` (JSON booleans), and also the integers 0 and 1 (CSV and parquet exports often store
booleans that way). Anything else -- floats such as 1.0, strings such as "yes" or "true", other integers, nulls --
is an error naming the file, the row and the value: a guessed label would silently flip the training signal.

Over-long rule: as for SFT (truncate when the prompt fits with one response token, else drop and count).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from rlhfkit.data.encoding import DROPPED, Encoder, count, fit_to_length, new_stats
from rlhfkit.data.errors import row_error
from rlhfkit.data.formatting import get_field
from rlhfkit.data.sft import SftFormat, encode_sft_row

logger = logging.getLogger(__name__)


def build_unpaired_samples(dataset: Iterable[Mapping[str, Any]], tokenizer: Any, *, input_key: str,
                           output_key: str | None, label_key: str = "label", input_template: str | None,
                           apply_chat_template: bool, max_len: int) -> tuple[list[dict], dict[str, int]]:
    """Tokenise KTO rows; returns ``(samples, stats)`` with ``stats["desirable"]`` / ``["undesirable"]`` counts."""
    fmt = SftFormat(input_key, output_key, input_template, apply_chat_template)
    fmt.check()
    encoder = Encoder(tokenizer)
    samples, stats = [], new_stats("desirable", "undesirable")
    for row in dataset:
        label = parse_label(get_field(row, label_key, "--label_key"), row, label_key)
        ids, mask = encode_sft_row(row, encoder, fmt)
        status, ids, mask = fit_to_length(ids, mask, max_len)
        count(stats, status)
        if status == DROPPED:
            continue
        stats["desirable" if label else "undesirable"] += 1
        prompt_len = next((i for i, m in enumerate(mask) if m), len(mask))
        samples.append({"input_ids": ids, "loss_mask": mask, "prompt_len": prompt_len, "label": label})
    if stats["truncated"] or stats["dropped"]:
        logger.warning("unpaired data: %d of %d samples truncated and %d dropped (longer than --max_len %d)",
                       stats["truncated"], stats["total"], stats["dropped"], max_len)
    return samples, stats


def parse_label(value: Any, row: Mapping[str, Any], key: str) -> bool:
    """A KTO label as a bool: booleans, or the integers 0 / 1; anything else is an error naming the row."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise row_error(row, f"label key {key!r} must be a boolean (true/false, or the integers 0/1), "
                         f"got {type(value).__name__} {value!r}. Convert the labels to true/false.")
