"""Adapter-only LoRA sync (`rlhfkit ppo --lora_rank R --lora_sync adapter`): the engines serve the frozen base model
with vLLM's LoRA support and each sync sends only the adapter matrices.

With LoRA the actor's base weights never change, and the engines loaded the same base from --pretrain, so all an
engine needs after a training step is the adapter: for every adapted linear layer the pair (A [r, in], B [out, r]),
which vLLM applies as ``y = W x + scaling * B (A x)`` with ``scaling = lora_alpha / r`` (peft's formula;
``lora_alpha / sqrt(r)`` under rsLoRA). Bytes per sync are ``sum over adapted layers of r * (in + out) * itemsize``
instead of every parameter of the model.

How it travels: the same buckets and transports as the merged sync (`--vllm_sync_backend ray|gloo|nccl`), framed by
`begin_lora_update` / `finish_lora_update` instead of `begin_weight_update` / `finish_weight_update`. Each engine
worker collects the tensors, writes them as a peft adapter folder (``adapter_model.safetensors`` +
``adapter_config.json``, what vLLM 0.32 loads LoRA from: a `LoRARequest` names a path), and the engine registers
it as a new `LoRARequest` with the next integer id, loads it at once (an invalid adapter fails the sync, not a later
generate), drops the previous adapter and its folder, and passes the current request with every generate and score.
A new id per sync also keeps prefix-cache blocks apart (vLLM hashes the LoRA id into every block).

Names: peft's (``base_model.model.<module>.lora_A.weight``, the adapter name dropped), as `save_pretrained` writes
them and vLLM parses them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhfkit.errors import ConfigError
from rlhfkit.rollout.engine_api import RolloutEngine
from rlhfkit.rollout.remote import RemoteActors

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's allowed --max_lora_rank values
LORA_SYNC_MODES = ("auto", "adapter", "merged")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def engine_max_lora_rank(lora_rank: int) -> int:
    """The smallest rank vLLM accepts as `max_lora_rank` that holds an adapter of `lora_rank`."""
    for rank in VLLM_LORA_RANKS:
        if rank >= lora_rank:
            return rank
    raise ConfigError(f"--lora_rank {lora_rank}: vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}; use "
                      "--lora_sync merged to send merged weights instead")


def is_adapter_tensor(name: str) -> bool:
    """A LoRA A or B matrix of a peft model (``...q_proj.lora_A.default.weight``)."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_name(name: str, adapter: str = "default") -> str:
    """peft parameter name -> the name in a saved adapter: ``...lora_A.default.weight`` -> ``...lora_A.weight``."""
    return name.replace(f".lora_A.{adapter}.", ".lora_A.").replace(f".lora_B.{adapter}.", ".lora_B.")


def adapter_weights(named: Iterable[tuple[str, torch.Tensor]], adapter: str = "default"
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """The LoRA A/B tensors of a peft model's (name, tensor) stream, under their saved-adapter names."""
    for name, tensor in named:
        if is_adapter_tensor(name):
            yield adapter_name(name, adapter), tensor


def adapter_config(model: torch.nn.Module) -> dict[str, Any]:
    """The active adapter's peft config as JSON-ready dict (what ``adapter_config.json`` holds)."""
    from peft import PeftModel

    peft_model = getattr(model, "module", model)  # an FSDP-wrapped model's own module
    if not isinstance(peft_model, PeftModel):
        raise TypeError(f"adapter_config needs a peft model (--lora_rank > 0), got {type(peft_model).__name__}")
    config = peft_model.peft_config[peft_model.active_adapter].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def write_adapter_folder(path: str, named: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any]) -> int:
    """Write a peft adapter folder vLLM can load; returns its bytes of tensors. Each file is written aside and
    renamed into place, so workers of one engine writing the same folder never expose a half-written file."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {name: t.detach().contiguous().clone() for name, t in named}
    if not tensors:
        raise RuntimeError("a LoRA adapter sync arrived without any lora_A / lora_B tensors")
    tag = f".{os.getpid()}.tmp"
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS + tag))
    with open(os.path.join(path, ADAPTER_CONFIG + tag), "w") as f:
        json.dump(config, f)
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        os.replace(os.path.join(path, name + tag), os.path.join(path, name))
    return sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass(frozen=True)
class LoraSyncSpec:
    """What the adapter-or-merged choice reads of the run's flags (`rlhfkit.launch.engine_spec.lora_sync_spec`):
    --lora_rank, --rollout_backend, --load_in_4bit and --lora_sync (auto, adapter, merged)."""

    lora_rank: int
    rollout_backend: str
    load_in_4bit: bool
    lora_sync: str


def adapter_sync_blocker(cfg: LoraSyncSpec) -> str | None:
    """Why the run's flags rule out adapter sync (None: they do not): no LoRA, the HF backend, a 4-bit base."""
    if cfg.lora_rank <= 0:
        return "--lora_rank is 0 (no adapter: the full weights train)"
    if cfg.rollout_backend != "vllm":
        return f"--rollout_backend {cfg.rollout_backend} (only vLLM engines serve LoRA adapters)"
    if cfg.load_in_4bit:
        return ("--load_in_4bit (the trainer's base is the NF4-dequantized one, the engines' the full-precision "
                "--pretrain: only a merged sync sends the trainer's base)")
    if cfg.lora_rank > VLLM_LORA_RANKS[-1]:
        return f"--lora_rank {cfg.lora_rank} is over vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}"
    return None


def resolve_lora_sync(cfg: LoraSyncSpec, engine_infos: list[dict[str, Any]]) -> tuple[str, str]:
    """(mode, reason): "adapter" or "merged" for `--lora_sync` (auto, adapter, merged) given the engines'
    `weight_sync_info()`. auto = adapter where every engine serves LoRA of this rank, else merged with the reason;
    an explicit adapter that cannot work is a ConfigError naming why."""
    requested = cfg.lora_sync
    if requested not in LORA_SYNC_MODES:
        raise ConfigError(f"--lora_sync {requested!r}: expected one of {LORA_SYNC_MODES}")
    if requested == "merged":
        return "merged", "--lora_sync merged"
    blocker = adapter_sync_blocker(cfg)
    if blocker is None:
        short = [k for k, info in enumerate(engine_infos) if info.get("max_lora_rank", 0) < cfg.lora_rank]
        if short:
            blocker = (f"rollout engines {short} do not serve LoRA adapters of rank {cfg.lora_rank} (started "
                       "without enable_lora, or with a smaller max_lora_rank)")
    if blocker is None:
        return "adapter", f"--lora_sync {requested}: the engines serve the base model plus the adapter"
    if requested == "adapter":
        raise ConfigError(f"--lora_sync adapter cannot work here: {blocker}. Use --lora_sync merged (or auto)")
    return "merged", f"--lora_sync auto chose merged: {blocker}"


def begin_update(engines: Sequence[Any], lora_config: dict[str, Any] | None, timeout_s: float | None = None,
                 keep_vision_tower: bool = False) -> None:
    """Put every engine in update mode: full weights (`lora_config` None) or a LoRA adapter. `keep_vision_tower`:
    full weights without the frozen vision tower (vLLM engines; rlhfkit.models.vision)."""
    actors = RemoteActors(engines, role="engine", timeout_s=timeout_s)
    if lora_config is not None:
        actors.call(RolloutEngine.begin_lora_update)
    elif keep_vision_tower:  # vLLM engines only take the argument
        actors.call(RolloutEngine.begin_weight_update, True)
    else:
        actors.call(RolloutEngine.begin_weight_update)


def finish_update(engines: Sequence[Any], lora_config: dict[str, Any] | None, timeout_s: float | None = None) -> None:
    """End the update `begin_update` started (an adapter update hands the engines its peft config)."""
    actors = RemoteActors(engines, role="engine", timeout_s=timeout_s)
    if lora_config is None:
        actors.call(RolloutEngine.finish_weight_update)
    else:
        actors.call(RolloutEngine.finish_lora_update, lora_config)
