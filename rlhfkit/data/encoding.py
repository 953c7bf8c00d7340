"""Token-level helpers shared by the sample builders: consistent tokenisation, loss masks, the over-long rule.

Segments are tokenised one by one (``add_special_tokens=False``) and concatenated; the tokenizer's leading special
tokens (e.g. a BOS for Llama-style tokenizers) are put once in front unless the text already starts with them.
So a sample's prompt tokens equal the prompt tokenised alone, and the loss-mask boundary is exact by construction.
"""

from __future__ import annotations

from typing import Any

from rlhfkit.data.formatting import PROMPT, TARGET, TURN, Segment
from rlhfkit.errors import DataError

KEPT, TRUNCATED, DROPPED = "kept", "truncated", "dropped"


class Encoder:
    """Tokenises text and segments for one tokenizer (caches its special-token facts)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.prefix_ids = _leading_special_ids(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special_ids = set(tokenizer.all_special_ids) | {i for i, t in added.items() if getattr(t, "special", 0)}

    def ids(self, text: str) -> list[int]:
        """Token ids of ``text`` without any special tokens added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a whole text (a prompt), with the tokenizer's leading special tokens once."""
        return self._with_prefix(self.ids(text), None)[0]

    def encode_segments(self, segments: list[Segment], *, all_targets: bool = False) -> tuple[list[int], list[int]]:
        """``(input_ids, loss_mask)`` for segments; see `rlhfkit.data.formatting` for the segment kinds.

        A plain ``target`` gets eos appended (unless it already ends with it); a final chat ``turn`` with no special
        token gets eos appended, so the end of the response is always learned. Tokens after the last target are cut.
        With ``all_targets`` (pretraining) every token is a target.
        """
        ids: list[int] = []
        mask: list[int] = []
        for text, kind in segments:
            seg_ids, seg_mask = self._segment(text, kind)
            ids += seg_ids
            mask += seg_mask
        if segments and segments[-1][1] == TURN and not any(i in self.special_ids for i in self.ids(segments[-1][0])):
            ids, mask = ids + [self._eos()], mask + [1]
        ids, prefixed_mask = self._with_prefix(ids, mask)
        assert prefixed_mask is not None  # a mask in, a mask out
        mask = prefixed_mask
        if all_targets:
            return ids, [1] * len(ids)
        last = max((i for i, m in enumerate(mask) if m), default=len(mask) - 1)
        return ids[: last + 1], mask[: last + 1]

    def _segment(self, text: str, kind: str) -> tuple[list[int], list[int]]:
        seg = self.ids(text)
        if kind == PROMPT:
            return seg, [0] * len(seg)
        if kind == TARGET:
            if not seg or seg[-1] != self._eos():
                seg = seg + [self._eos()]
            return seg, [1] * len(seg)
        if kind == TURN:
            end = next((k for k, i in enumerate(seg) if i in self.special_ids), len(seg) - 1)
            return seg, [1] * (end + 1) + [0] * (len(seg) - end - 1)
        raise ValueError(f"unknown segment kind {kind!r}")

    def _with_prefix(self, ids: list[int], mask: list[int] | None) -> tuple[list[int], list[int] | None]:
        p = self.prefix_ids
        if not p or ids[: len(p)] == p:
            return ids, mask
        return p + ids, (None if mask is None else [0] * len(p) + mask)

    def _eos(self) -> int:
        if self.eos_id is None:
            raise DataError("the tokenizer has no eos token, so the end of a response cannot be marked; "
                            "use a tokenizer with an eos token.")
        return self.eos_id


def _leading_special_ids(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts in front of any text with ``add_special_tokens=True`` (e.g. ``[bos]``), or []."""
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    for start in range(len(full) - len(plain) + 1):
        if full[start: start + len(plain)] == plain:
            return full[:start]
    return []


def fit_to_length(ids: list[int], mask: list[int], max_len: int) -> tuple[str, list[int], list[int]]:
    """The over-long rule: ``(status, ids, mask)`` with status ``kept``, ``truncated`` or ``dropped``.

    A sample longer than ``max_len`` is cut on the right when its prompt (the tokens before the first target) leaves
    room for at least one target token; otherwise it is dropped (empty lists are returned).
    """
    if max_len < 1:
        raise DataError(f"--max_len must be >= 1, got {max_len}.")
    if len(ids) <= max_len:
        return KEPT, ids, mask
    first_target = next((i for i, m in enumerate(mask) if m), len(mask))
    if first_target < max_len:
        return TRUNCATED, ids[:max_len], mask[:max_len]
    return DROPPED, [], []


def new_stats(*extra: str) -> dict[str, int]:
    """A stats dict: ``total`` rows seen, ``kept`` samples (including truncated ones), ``truncated``, ``dropped``."""
    return dict.fromkeys(("total", KEPT, TRUNCATED, DROPPED, *extra), 0)


def count(stats: dict[str, int], status: str) -> None:
    """Record one row's outcome."""
    stats["total"] += 1
    stats[DROPPED if status == DROPPED else KEPT] += 1
    if status == TRUNCATED:
        stats[TRUNCATED] += 1
