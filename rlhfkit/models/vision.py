"""Vision-language models: loading, the processor's inputs, the trainer's log-probs, a frozen vision tower.

Token in, token out holds for images too: the processor's chat-formatted text is tokenised *without* expanding the
image placeholder (`prompt_ids`, one `<image>` per image); vLLM expands each placeholder from the image it is given
(`multi_modal_data`) and returns the expanded ids, which equal the processor's `input_ids` (checked in
tests/models/test_vision.py). The trainer runs the same expanded ids with the processor's pixel tensors
(`pixel_values`, and `pixel_attention_mask` where the family has one).

The vision tower is every parameter under a module named like `vision_model`, `vision_tower` or `visual`
(Idefics3/SmolVLM, LLaVA, Qwen2-VL); the connector/projector and the language model are not part of it.
With `--freeze_vision_tower` those parameters do not train and are not sent at weight sync.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

VISION_TOWER_PATTERN = re.compile(r"(^|\.)(vision_model|vision_tower|visual)\.")


def is_vision_tower_param(name: str) -> bool:
    """True for a parameter of the vision encoder (not the connector, not the language model)."""
    return VISION_TOWER_PATTERN.search(name) is not None


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """Set `requires_grad=False` on every vision-tower parameter; returns how many tensors were frozen.

    Raises ValueError when the model has no vision tower (a text-only model with --freeze_vision_tower).
    """
    frozen = 0
    for name, param in model.named_parameters():
        if is_vision_tower_param(name):
            param.requires_grad_(False)
            frozen += 1
    if not frozen:
        raise ValueError(f"{type(model).__name__} has no vision tower parameter (names matching "
                         f"{VISION_TOWER_PATTERN.pattern!r})")
    return frozen


def without_vision_tower(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The weight-sync stream minus the vision tower (frozen: the engines already hold it)."""
    return ((name, tensor) for name, tensor in named if not is_vision_tower_param(name))


def load_vlm(path: str, *, dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa") -> Any:
    """A vision-language model (`AutoModelForImageTextToText`) from a local folder; `config.pad_token_id` set."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                        local_files_only=True)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = getattr(model.config.get_text_config(), "pad_token_id", None)
    return model


def load_processor(path: str) -> Any:
    """The model folder's HF processor (image processor + tokenizer + chat template)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path, local_files_only=True)


@dataclass
class VisionPrompt:
    """One prompt with images: what vLLM takes (`prompt_ids`, `images`) and what the trainer takes (`input_ids`,
    the expanded ids, and `pixel` tensors for this prompt alone)."""

    prompt_ids: list[int]
    input_ids: list[int]
    images: list[Any]
    pixel: dict[str, torch.Tensor]


PIXEL_KEYS = ("pixel_values", "pixel_attention_mask", "image_grid_thw", "image_sizes")


def vision_prompt(processor: Any, text: str, images: Sequence[Any]) -> VisionPrompt:
    """Tokenise `text` (already chat-formatted, one image placeholder per image) for vLLM and for the trainer."""
    tokenizer = processor.tokenizer
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not images:
        return VisionPrompt(prompt_ids, list(prompt_ids), [], {})
    enc = processor(text=[text], images=[list(images)], return_tensors="pt", add_special_tokens=False)
    pixel = {key: enc[key] for key in PIXEL_KEYS if key in enc}
    return VisionPrompt(prompt_ids, enc["input_ids"][0].tolist(), list(images), pixel)


def image_placeholder(processor: Any) -> str:
    """The text a chat message carries per image (`<image>` for Idefics3/LLaVA)."""
    return str(getattr(processor, "image_token", "<image>"))


def vlm_response_log_probs(model: Any, input_ids: Sequence[int], response_ids: Sequence[int],
                           pixel: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits_t / T)[response_t] of each response token given the expanded prompt and its images, [R].

    The same quantity the rollout engine reports as sampling log-probs (see rlhfkit/rollout/types.py).
    """
    seq = torch.tensor([list(input_ids) + list(response_ids)])
    width = len(response_ids)
    logits = model(input_ids=seq, attention_mask=torch.ones_like(seq), **pixel, logits_to_keep=width + 1).logits
    logits = logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(list(response_ids))[:, None])[:, 0]
