"""Process-reward (PRM) samples: a text whose steps end with a placeholder token, and one label per step.

Row format (OpenRLHF's ``train_prm``): ``row[--input_key]`` is the text, each step followed by the placeholder
(``--placeholder_token``, e.g. ``"§"`` or Math-Shepherd's ``"ки"`` where the tokenizer has it as one token);
``row[--label_key]`` is a list with one label per placeholder:

* hard labels: reward-token strings (e.g. ``"+"`` / ``"-"``, members of ``--reward_tokens`` when given), or booleans
  (true = ``reward_tokens[0]``, false = ``reward_tokens[1]``; the integers 0 / 1 count as booleans);
* soft labels: floats in [0, 1], the probability that the step is good (needs exactly two ``--reward_tokens``).

A dataset uses one kind throughout. The text is split on the placeholder string and the pieces are tokenised one by
one, so every placeholder becomes exactly one placeholder token whatever its neighbours are (BPE would otherwise
merge it into them). A sample is ``{"input_ids", "labels", "num_steps"}``: ``labels`` has one entry per token, the
target at the placeholder positions (a reward token id for hard labels, a probability for soft ones) and
``IGNORE`` (-100) elsewhere.

Over-long rule: the text is cut at ``--max_len``; steps whose placeholder falls beyond the cut lose their labels
(counted in ``stats["steps_cut"]``); a sample left with no placeholder is dropped (counted).
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rlhfkit.data.encoding import DROPPED, KEPT, TRUNCATED, Encoder, count, new_stats
from rlhfkit.data.errors import row_error
from rlhfkit.data.formatting import apply_input_template, get_field, require_text
from rlhfkit.errors import DataError

logger = logging.getLogger(__name__)

IGNORE = -100
HARD, SOFT = "hard", "soft"


def single_token_id(tokenizer: Any, text: str, flag: str) -> int:
    """The id of a token given as text; an error when the tokenizer splits it into several tokens."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(ids) != 1:
        raise DataError(f"{flag} {text!r} is {len(ids)} tokens for this tokenizer ({ids}); it must be exactly one "
                        "token. Pick another marker (e.g. '§' for SmolLM2) or add it to the tokenizer.")
    return ids[0]


class ProcessLabels:
    """The PRM label conventions of one run: placeholder id, reward token ids, and the label kind (fixed by the first
    row)."""

    def __init__(self, tokenizer: Any, placeholder_token: str, reward_tokens: Sequence[str] | None) -> None:
        if not placeholder_token:
            raise DataError("--placeholder_token is required for PRM data (the marker that ends each step)")
        self.tokenizer = tokenizer
        self.placeholder = placeholder_token
        self.placeholder_id = single_token_id(tokenizer, placeholder_token, "--placeholder_token")
        if self.placeholder_id == tokenizer.pad_token_id:
            raise DataError(f"--placeholder_token {placeholder_token!r} is the pad token; pick another marker")
        self.reward_tokens = list(reward_tokens) if reward_tokens else None
        self.reward_ids = [single_token_id(tokenizer, t, "--reward_tokens") for t in self.reward_tokens] \
            if self.reward_tokens else None
        if self.reward_ids is not None and len(set(self.reward_ids)) != len(self.reward_ids):
            raise DataError(f"--reward_tokens {self.reward_tokens} repeat a token")
        self.kind: str | None = None

    def targets(self, labels: Any, row: Mapping[str, Any], key: str) -> list[float] | list[int]:
        """One target per step: reward token ids (hard) or probabilities of a good step (soft)."""
        if isinstance(labels, np.ndarray):
            labels = labels.tolist()
        if isinstance(labels, (str, bytes)) or not isinstance(labels, Sequence) or not labels:
            raise row_error(row, f"label key {key!r} must be a non-empty list with one label per step, got {labels!r}")
        kinds = {self._kind(v, row, key) for v in labels}
        if len(kinds) != 1:
            raise row_error(row, f"label key {key!r} mixes hard labels (tokens or booleans) and soft ones "
                                 f"(probabilities): {labels!r}")
        kind = kinds.pop()
        if self.kind is None:
            self.kind = kind
        elif kind != self.kind:
            raise row_error(row, f"label key {key!r} has {kind} labels but earlier rows have {self.kind} labels; "
                                 "use one kind for the whole dataset")
        return [self._target(v, row, key) for v in labels]

    def is_good(self, target: float | int) -> bool:
        """A step counted as good in the stats: the first reward token, or a probability >= 0.5."""
        if self.kind == SOFT:
            return float(target) >= 0.5
        return self.reward_ids is not None and target == self.reward_ids[0]

    def _kind(self, value: Any, row: Mapping[str, Any], key: str) -> str:
        if isinstance(value, (str, bool, np.bool_)) or (isinstance(value, numbers.Integral) and value in (0, 1)):
            return HARD
        if isinstance(value, numbers.Real):
            return SOFT
        raise row_error(row, f"label key {key!r}: {value!r} is neither a reward token, a boolean nor a probability")

    def _target(self, value: Any, row: Mapping[str, Any], key: str) -> float | int:
        if isinstance(value, str):
            if self.reward_tokens is not None and value not in self.reward_tokens:
                raise row_error(row, f"step label {value!r} is not one of --reward_tokens {self.reward_tokens}")
            ids = list(self.tokenizer(value, add_special_tokens=False)["input_ids"])
            if len(ids) != 1:
                raise row_error(row, f"step label {value!r} is {len(ids)} tokens; a hard label must be one token")
            return ids[0]
        if isinstance(value, (bool, np.bool_)) or (isinstance(value, numbers.Integral) and value in (0, 1)):
            if self.reward_ids is None or len(self.reward_ids) != 2:
                raise row_error(row, "boolean step labels need exactly two --reward_tokens (good, bad)")
            return self.reward_ids[0] if bool(value) else self.reward_ids[1]
        if self.reward_ids is None or len(self.reward_ids) != 2:
            raise row_error(row, "soft (probability) step labels need exactly two --reward_tokens (good, bad)")
        if not 0.0 <= float(value) <= 1.0:
            raise row_error(row, f"soft step label {value!r} must be a probability in [0, 1]")
        return float(value)


def encode_steps(encoder: Encoder, pieces: Sequence[str], placeholder_id: int,
                 row: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of a text split on its placeholder (``pieces``): each piece tokenised alone, one placeholder token
    between consecutive pieces, the tokenizer's leading special tokens once in front."""
    ids = list(encoder.prefix_ids)
    for k, piece in enumerate(pieces):
        piece_ids = encoder.ids(piece)
        if placeholder_id in piece_ids:
            message = "the placeholder token appears inside a step's text (merged by the tokenizer)"
            raise row_error(row, message) if row is not None else DataError(message)
        ids += piece_ids
        if k < len(pieces) - 1:
            ids.append(placeholder_id)
    return ids


def build_process_samples(dataset: Iterable[Mapping[str, Any]], tokenizer: Any, *, input_key: str, label_key: str,
                          placeholder_token: str, reward_tokens: Sequence[str] | None, input_template: str | None,
                          max_len: int) -> tuple[list[dict], dict[str, Any]]:
    """Tokenise PRM rows; returns ``(samples, stats)`` with ``steps``, ``good_steps`` and ``steps_cut`` counts and
    ``label_kind`` (see the module docstring)."""
    if max_len < 1:
        raise DataError(f"--max_len must be >= 1, got {max_len}.")
    conv = ProcessLabels(tokenizer, placeholder_token, reward_tokens)
    encoder = Encoder(tokenizer)
    samples: list[dict] = []
    stats: dict[str, Any] = new_stats("steps", "good_steps", "steps_cut")
    for row in dataset:
        text = apply_input_template(require_text(get_field(row, input_key, "--input_key"), row, input_key),
                                    input_template)
        pieces = text.split(conv.placeholder)
        targets = conv.targets(get_field(row, label_key, "--label_key"), row, label_key)
        if len(pieces) - 1 != len(targets):
            raise row_error(row, f"the text has {len(pieces) - 1} step placeholders {conv.placeholder!r} but "
                                 f"{len(targets)} labels in key {label_key!r}; give one label per step")
        ids = encode_steps(encoder, pieces, conv.placeholder_id, row)
        steps = iter(targets)
        labels = [next(steps) if i == conv.placeholder_id else IGNORE for i in ids]
        status = KEPT
        if len(ids) > max_len:
            status = TRUNCATED
            stats["steps_cut"] += sum(1 for i in ids[max_len:] if i == conv.placeholder_id)
            ids, labels = ids[:max_len], labels[:max_len]
            if conv.placeholder_id not in ids:
                status = DROPPED
        count(stats, status)
        if status == DROPPED:
            continue
        kept = [t for i, t in zip(ids, labels) if i == conv.placeholder_id]
        stats["steps"] += len(kept)
        stats["good_steps"] += sum(1 for t in kept if conv.is_good(t))
        samples.append({"input_ids": ids, "labels": labels, "num_steps": len(kept)})
    stats["label_kind"] = conv.kind or HARD
    if stats["truncated"] or stats["dropped"]:
        logger.warning("process data: %d of %d samples truncated (%d steps cut) and %d dropped (longer than "
                       "--max_len %d)", stats["truncated"], stats["total"], stats["steps_cut"], stats["dropped"],
                       max_len)
    return samples, stats
