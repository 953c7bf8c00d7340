"""Images through `rlhfkit ppo` (--image_key): the checks at set-up, the processor's pixel tensors per row of the
experience, the model inputs of a micro-batch and the weight-sync choice for a frozen vision tower.

Token in, token out (`rlhfkit.models.vision`): a prompt's ids hold one unexpanded placeholder per image; the engines
get them with the images (`multi_modal_data`) and return the expanded ids, which every sample keeps as its
`prompt_ids`. The trainer runs those ids with the processor's pixel tensors of the same images.

Pixel tensors per row (`attach_pixels`): `pixel_values` [B, N, C, H, W] and `pixel_attention_mask` [B, N, H, W]
(the Idefics3 / SmolVLM / LLaVA layout: a batch dimension first), N the step's largest image count, rows with
fewer images padded with all-zero images, which those models drop (Idefics3 skips an all-zero image), H and W padded
to the step's largest with the attention mask 0 there (what the processor itself does for a batch). Rows are then
sliced, sorted and cut into micro-batches like every other row tensor. `pixel_inputs` hands a micro-batch's rows to
the model (its largest real image count; none when it has no image). Processors that return a flat patch list
(Qwen2-VL's `image_grid_thw`) are refused: their rows cannot be sliced this way (not needed on this CPU, where
Qwen2-VL does not load: docs/multimodal.md).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.rl_options import VisionOptions
from rlhfkit.config.validate import need
from rlhfkit.errors import ConfigError

log = logging.getLogger("rlhfkit")

ROW_PIXEL_KEYS = ("pixel_values", "pixel_attention_mask")


@lru_cache(maxsize=32)
def is_vision_language(path: str) -> bool:
    """Whether the model folder holds a vision-language model (its config.json has a `vision_config`)."""
    config = os.path.join(path, "config.json") if os.path.isdir(path) else None
    if config is None or not os.path.exists(config):
        return False
    with open(config, encoding="utf-8") as handle:
        return "vision_config" in json.load(handle)


def keeps_vision_tower(cfg: PPOConfig, model_path: str | None = None) -> bool:
    """Whether the weight sync leaves the vision tower out: a vision-language actor with --freeze_vision_tower
    (`model_path`: the run plan's resolved --pretrain, else the flag)."""
    return cfg.freeze_vision_tower and is_vision_language(need(model_path or cfg.pretrain, "--pretrain"))


def validate_vision(cfg: PPOConfig, needs_critic: bool) -> None:
    """Refuse, naming the flag, what images cannot go with (before anything starts)."""
    if not cfg.image_key:
        return
    if cfg.max_images_per_prompt < 1:
        raise ConfigError(f"--max_images_per_prompt {cfg.max_images_per_prompt}: must be >= 1 with --image_key")
    refused = [
        (cfg.packing_samples, "--packing_samples", "packed rows would need the image features scattered per "
                                                   "packed sample; drop --packing_samples"),
        ((cfg.ring_attn_size or 1) > 1, "--ring_attn_size", "ring attention splits the sequence, the image "
                                                           "tokens with it"),
        ((cfg.ds_tensor_parallel_size or 1) > 1, "--ds_tensor_parallel_size",
         "the tensor-parallel plan covers text decoders only"),
        (cfg.agent_func_path, "--agent_func_path", "agent episodes are text-only"),
        (cfg.async_train and cfg.partial_rollout, "--partial_rollout", "resumed chunks do not carry images"),
        (cfg.reward_pretrain, "--reward_pretrain", "reward models read text tokens only; use --remote_rm_url (a "
                                                   "reward_func .py file or builtin:NAME)"),
        (needs_critic, f"--advantage_estimator {cfg.advantage_estimator}", "a critic would need the images too; "
                                                                          "use a critic-free estimator (group_norm)"),
        (cfg.lora_rank > 0, "--lora_rank", "LoRA on a vision-language model is not wired (its target modules "
                                           "would include the vision tower)"),
        (cfg.rollout_backend != "vllm", f"--rollout_backend {cfg.rollout_backend}", "only vLLM engines take images"),
    ]
    for bad, flag, why in refused:
        if bad:
            raise ConfigError(f"{flag} with --image_key is not supported: {why}")


def check_vision_model(cfg: PPOConfig, model_path: str | None = None) -> None:
    """--image_key needs a vision-language --pretrain (checked once --pretrain is resolved to a folder:
    `model_path`, the run plan's; else the flag)."""
    if cfg.image_key and not is_vision_language(model_path or cfg.pretrain):
        raise ConfigError(f"--image_key {cfg.image_key}: --pretrain {cfg.pretrain} is not a vision-language model "
                          "(its config.json has no vision_config); give a vision-language folder or drop --image_key")


def image_column(cfg: PPOConfig, spec: str, model_path: str | None = None) -> Any:
    """The `ImageColumn` of a prompt data spec (relative image paths resolved against a single file's folder; the
    placeholder is the --pretrain processor's)."""
    from rlhfkit.data.prompts import ImageColumn
    from rlhfkit.models.vision import image_placeholder, load_processor

    base = None
    if "," not in spec:
        base = os.path.dirname(os.path.abspath(spec)) if os.path.isfile(spec) else spec if os.path.isdir(spec) \
            else None
    placeholder = image_placeholder(load_processor(need(model_path or cfg.pretrain, "--pretrain")))
    return ImageColumn(need(cfg.image_key, "--image_key"), cfg.max_images_per_prompt, placeholder, base, spec)


@dataclass
class VisionInputs:
    """The driver's processor and the ids that mark images (for the probe of the sync check)."""

    processor: Any
    image_token_id: int
    marker_ids: frozenset[int]

    @classmethod
    def load(cls, path: str) -> VisionInputs:
        from rlhfkit.models.vision import image_placeholder, load_processor

        processor = load_processor(path)
        tokenizer = processor.tokenizer
        image_id = tokenizer.convert_tokens_to_ids(image_placeholder(processor))
        markers = {image_id}
        for name in ("fake_image_token", "global_image_tag", "boi_token", "eoi_token"):
            token = getattr(processor, name, None)
            if isinstance(token, str):
                markers.add(tokenizer.convert_tokens_to_ids(token))
        return cls(processor, int(image_id), frozenset(markers))

    def encode(self, prompt: dict[str, Any]) -> tuple[dict[str, torch.Tensor], int]:
        """One prompt's pixel tensors ([1, n, ...]; {} without images) and the image tokens its expansion holds."""
        images = prompt.get("images") or []
        if not images:
            return {}, 0
        enc = self.processor(text=[prompt["prompt"]], images=[list(images)], return_tensors="pt",
                             add_special_tokens=False)
        if "image_grid_thw" in enc:
            raise ConfigError("--image_key: this processor returns a flat patch list (image_grid_thw, Qwen2-VL "
                              "family), which rlhfkit ppo cannot split by rows yet; use an Idefics3/SmolVLM-style "
                              "model")
        tokens = int((enc["input_ids"][0] == self.image_token_id).sum())
        return {k: enc[k] for k in ROW_PIXEL_KEYS if k in enc}, tokens

    def probe_prompts(self, prompts: list[dict]) -> list[dict]:
        """The prompts without image markers: the sync check's probe is scored as text on both sides."""
        return [{**p, "prompt_ids": [t for t in p["prompt_ids"] if t not in self.marker_ids]} for p in prompts]


def attach_pixels(exp: Any, rollout: Any, vision: VisionInputs) -> None:
    """Set `exp.pixel_values` / `exp.pixel_attention_mask` per row from each sample's prompt images (see the module
    docstring); checks each sample's expanded ids hold one image token per image feature the processor makes."""
    per_prompt: dict[int, tuple[dict[str, torch.Tensor], int]] = {}
    rows = []
    for i, sample in enumerate(rollout.samples):
        k = sample.prompt_index
        if k not in per_prompt:
            per_prompt[k] = vision.encode(rollout.prompts[k])
        pixel, have = per_prompt[k]
        rows.append(pixel)
        want = sample.prompt_ids.count(vision.image_token_id)
        if want != have:
            raise RuntimeError(f"row {i}: the engine's expanded prompt holds {want} image tokens but the processor "
                               f"makes {have} for its images: engine and processor disagree on the expansion")
    if not any(rows):
        return
    exp.pixel_values = _stack([r.get("pixel_values") for r in rows], torch.float32)
    if any("pixel_attention_mask" in r for r in rows):
        exp.pixel_attention_mask = _stack([r.get("pixel_attention_mask") for r in rows], torch.long)


def _stack(parts: list[torch.Tensor | None], dtype: torch.dtype) -> torch.Tensor:
    """[1, n_i, *dims_i] per row (None: no image) -> [B, max n, *max dims], zero-padded."""
    real = [p for p in parts if p is not None]
    lead = real[0].shape[2:-2]
    height = max(p.shape[-2] for p in real)
    width = max(p.shape[-1] for p in real)
    count = max(p.shape[1] for p in real)
    out = torch.zeros((len(parts), count, *lead, height, width), dtype=dtype)
    for i, p in enumerate(parts):
        if p is not None:
            out[i, :p.shape[1], ..., :p.shape[-2], :p.shape[-1]] = p[0].to(dtype)
    return out


def pixel_inputs(mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's image inputs for a micro-batch's rows: up to their largest real image count ({} when none)."""
    values = mb.get("pixel_values")
    if values is None:
        return {}
    real = values.flatten(2).ne(0).any(-1)  # [b, N]: all-zero images are padding
    count = int(real.sum(-1).max())
    if count == 0:
        return {}
    out = {"pixel_values": values[:, :count]}
    if "pixel_attention_mask" in mb:
        out["pixel_attention_mask"] = mb["pixel_attention_mask"][:, :count]
    return out


def load_vlm_for_role(pretrain: str, attn_implementation: str, trainable: bool, cfg: VisionOptions) -> Any:
    """A vision-language model for a worker (fp32 master weights); the actor's vision tower frozen with
    --freeze_vision_tower (no gradient, left out of the optimizer and of the weight sync)."""
    from rlhfkit.models.vision import freeze_vision_tower, load_vlm

    model = load_vlm(pretrain, attn_implementation=attn_implementation)
    if trainable and cfg.freeze_vision_tower:
        log.info("--freeze_vision_tower: %d vision-tower tensors frozen", freeze_vision_tower(model))
    return model
