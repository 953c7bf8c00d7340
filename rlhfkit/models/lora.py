"""LoRA adapters through peft: wrap a model for training, merge an adapter back into full weights."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from transformers import PreTrainedModel

from rlhfkit.models.loading import (
    VALUE_HEAD,
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    resolve_pretrain,
    save_hf,
)


def apply_lora(
    model: PreTrainedModel,
    lora_rank: int,
    lora_alpha: int = 16,
    target_modules: str | list[str] = "all-linear",
    lora_dropout: float = 0.0,
) -> PeftModel:
    """Wrap ``model`` with LoRA adapters (``--lora_rank``, ``--lora_alpha``, ``--target_modules``, ``--lora_dropout``).

    ``target_modules="all-linear"`` adapts every linear layer except the output layer. For a model with a
    scalar ``score`` head (reward model, critic) the head is trained in full and saved with the adapter
    (peft's ``modules_to_save``); it never gets a LoRA of its own.
    """
    if lora_rank <= 0:
        raise ValueError(f"lora_rank must be > 0 to apply LoRA, got {lora_rank}")
    if isinstance(target_modules, (list, tuple)) and list(target_modules) == ["all-linear"]:
        target_modules = "all-linear"  # argparse nargs=* gives a list
    scalar = isinstance(getattr(model, VALUE_HEAD, None), torch.nn.Linear)
    config = LoraConfig(
        r=lora_rank,
        lora_alpha=lora_alpha,
        target_modules=target_modules,
        exclude_modules=[VALUE_HEAD] if scalar else None,
        lora_dropout=lora_dropout,
        bias="none",
        task_type=TaskType.SEQ_CLS if scalar else TaskType.CAUSAL_LM,
        modules_to_save=[VALUE_HEAD] if scalar else None,
    )
    return get_peft_model(model, config)


def merge_lora(
    base_spec: str,
    adapter_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Merge a LoRA adapter folder into its base model and write a plain HF folder (for ``rlhfkit lora-merge``).

    The adapter's ``task_type`` decides whether the base loads as a causal LM or a scalar (``score``) model.
    The tokenizer comes from the adapter folder if it has one, else from the base. Returns ``out_dir``.
    """
    adapter_dir = Path(adapter_dir)
    config_file = adapter_dir / "adapter_config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: {str(adapter_dir)!r} is not a peft adapter folder")
    task_type = json.loads(config_file.read_text()).get("task_type")
    if task_type == TaskType.SEQ_CLS:
        base = load_scalar_model(base_spec, dtype=dtype)
    else:
        base = load_causal_lm(base_spec, dtype=dtype)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    has_tokenizer = (adapter_dir / "tokenizer_config.json").is_file()
    if has_tokenizer:  # an adapter folder has no config.json, so it is read directly, not as a model spec
        from transformers import AutoTokenizer

        tokenizer: Any = AutoTokenizer.from_pretrained(str(adapter_dir))
    else:
        tokenizer = load_tokenizer(resolve_pretrain(base_spec))
    return save_hf(merged, tokenizer, out_dir)


def merged_weights(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn a LoRA model's (peft name, full tensor) stream into the base model's HF names and merged weights.

    For every adapted linear layer: ``W' = W + scaling * (B @ A)`` (``scaling = lora_alpha / r``), named as the
    base layer's weight; the adapter matrices themselves are not yielded. Other parameters pass through renamed
    (``base_model.model.`` and ``.base_layer`` dropped). A model without LoRA passes through unchanged. This is
    what the rollout engines load: they keep serving plain base-model weights.

    ``named`` is consumed in order (`named_parameters()` order: a layer's base weight comes before its A and B)
    and only one layer's tensors are held at a time.
    """
    if not isinstance(getattr(model, "module", model), PeftModel):
        yield from named
        return
    from peft.tuners.lora import LoraLayer

    peft_model = getattr(model, "module", model)
    adapter = peft_model.active_adapter
    scalings = {f"{name}.": module.scaling[adapter] for name, module in peft_model.named_modules()
                if isinstance(module, LoraLayer) and adapter in module.scaling}
    held: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        layer, part = _lora_part(name)
        if layer not in scalings or part == "base_layer.bias":
            yield _base_name(name), tensor
            continue
        held[part.split(".")[0]] = tensor
        if len(held) == 3:
            base, a, b = held.pop("base_layer"), held.pop("lora_A"), held.pop("lora_B")
            merged = base.float() + scalings[layer] * (b.float() @ a.float())
            yield _base_name(layer + "base_layer.weight"), merged.to(base.dtype)
    if held:
        raise RuntimeError(f"LoRA weight stream ended inside a layer (have {sorted(held)}): parameters out of order")


def _lora_part(name: str) -> tuple[str, str]:
    """("...q_proj.", "lora_A.default.weight") for a LoRA layer's parameter, ("", name) otherwise."""
    for marker in (".base_layer.", ".lora_A.", ".lora_B."):
        if marker in name:
            layer, rest = name.split(marker, 1)
            return layer + ".", marker[1:] + rest
    return "", name


def _base_name(name: str) -> str:
    """peft name -> base name: ``base_model.model.x.q_proj.base_layer.weight`` -> ``x.q_proj.weight``."""
    if name.startswith("base_model.model."):
        name = name[len("base_model.model."):]
    return name.replace(".base_layer.", ".")
