"""Prompt samples for online RL: ``{"prompt": str, "prompt_ids": list[int], "label": Any}`` (+ ``"images"``).

The prompt is ``--input_key`` formatted by the chat template (with the generation prompt) or by ``--input_template``;
``prompt_ids`` are its tokens (the rollout engines take token ids in). ``label`` is ``row[--label_key]`` (e.g. the
reference answer a verifier checks) or None without a label key.

Images (``--image_key``, `ImageColumn`): the row's images decoded to RGB PIL images under ``"images"``
(`rlhfkit.data.images.row_images`: paths, base64, data URLs; an unreadable image or more than
``--max_images_per_prompt`` is a ConfigError naming the file, the row and the key). The prompt text holds one image
placeholder (``<image>``) per image: a prompt without any gets them in front of its (first user) text; message
contents given as parts (``[{"type": "image"}, {"type": "text", "text": ...}]``) become the placeholder and the text.
``prompt_ids`` then hold the *unexpanded* placeholders; the engine expands them (`rlhfkit.models.vision`).

Over-long rule: a prompt with more than ``--prompt_max_len`` tokens is dropped (a cut prompt would ask a different
question); ``stats`` counts ``total``, ``kept`` and ``dropped`` (``truncated`` is always 0).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlhfkit.data.encoding import DROPPED, KEPT, Encoder, count, new_stats
from rlhfkit.data.formatting import format_prompt, get_field
from rlhfkit.data.images import row_images
from rlhfkit.errors import ConfigError, DataError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageColumn:
    """Where a prompt row's images are (``--image_key``) and how its text marks them."""

    key: str
    max_images: int = 1
    placeholder: str = "<image>"
    base_dir: str | None = None  # relative image paths are resolved against it (the data file's folder)
    source: str = "prompt data"  # the data file(s), named in errors

    def images(self, row: Mapping[str, Any], index: int) -> list[Any]:
        """The row's decoded images; a bad one raises ConfigError naming the file, the row and the key."""
        try:
            return row_images(dict(row), index, self.key, self.max_images, self.base_dir)
        except ConfigError as err:
            raise ConfigError(f"{self.source}: {err}") from None

    def with_placeholders(self, value: Any, n_images: int) -> Any:
        """The prompt value with its image parts as placeholders, and `n_images` placeholders in front of the first
        user text when it has none."""
        value = _flatten_parts(value, self.placeholder)
        if n_images == 0 or self.placeholder in str(value):
            return value
        marks = self.placeholder * n_images
        if isinstance(value, str):
            return marks + value
        if isinstance(value, list):
            out, done = [], False
            for m in value:
                user_text = isinstance(m, Mapping) and m.get("role") == "user" and isinstance(m.get("content"), str)
                if not done and user_text:
                    m, done = {**m, "content": marks + m["content"]}, True
                out.append(m)
            return out
        return value


def _flatten_parts(value: Any, placeholder: str) -> Any:
    """OpenAI-style content parts -> one string per message (image parts -> the placeholder)."""
    if not isinstance(value, list):
        return value
    out = []
    for m in value:
        content = m.get("content") if isinstance(m, Mapping) else None
        if isinstance(content, list):
            text = "".join(placeholder if isinstance(p, Mapping) and p.get("type") in ("image", "image_url")
                           else str(p.get("text", "")) if isinstance(p, Mapping) else str(p) for p in content)
            m = {**m, "content": text}
        out.append(m)
    return out


def build_prompt_samples(dataset: Iterable[Mapping[str, Any]], tokenizer: Any, *, input_key: str,
                         label_key: str | None = None, input_template: str | None,
                         apply_chat_template: bool, prompt_max_len: int,
                         images: ImageColumn | None = None) -> tuple[list[dict], dict[str, int]]:
    """Format and tokenise RL prompts; returns ``(samples, stats)`` (see the module docstring)."""
    if prompt_max_len < 1:
        raise DataError(f"--prompt_max_len must be >= 1, got {prompt_max_len}.")
    encoder = Encoder(tokenizer)
    samples, stats = [], new_stats()
    for index, row in enumerate(dataset):
        value = get_field(row, input_key, "--input_key")
        pictures = images.images(row, index) if images is not None else []
        if images is not None:
            value = images.with_placeholders(value, len(pictures))
        prompt = format_prompt(value, tokenizer, input_template=input_template,
                               apply_chat_template=apply_chat_template, row=row, key=input_key)
        if images is not None and prompt.count(images.placeholder) != len(pictures):
            raise ConfigError(f"{images.source}: row {index}: the prompt holds {prompt.count(images.placeholder)} "
                              f"{images.placeholder!r} placeholders but {images.key!r} has {len(pictures)} images; "
                              "give one placeholder per image (or none: they are then put in front)")
        label = get_field(row, label_key, "--label_key") if label_key else None
        prompt_ids = encoder.encode_text(prompt)
        status = DROPPED if len(prompt_ids) > prompt_max_len else KEPT
        count(stats, status)
        if status == KEPT:
            sample = {"prompt": prompt, "prompt_ids": prompt_ids, "label": label}
            if images is not None:
                sample["images"] = pictures
            samples.append(sample)
    if stats["dropped"]:
        logger.warning("prompt data: %d of %d prompts dropped (longer than --prompt_max_len %d)",
                       stats["dropped"], stats["total"], prompt_max_len)
    return samples, stats
