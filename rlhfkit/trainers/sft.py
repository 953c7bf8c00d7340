"""SFT: next-token cross-entropy on the target tokens (response, every assistant turn, or all tokens).

    loss = - sum_{t in targets} log p(x_t | x_<t)  /  |targets|    (over the whole global batch)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rlhfkit.config.commands import SFTConfig, TrainingConfig
from rlhfkit.config.options import TrainOptions
from rlhfkit.config.validate import need
from rlhfkit.data.collate import collate_packed, collate_padded
from rlhfkit.data.csft import condition_row
from rlhfkit.data.sft import build_sft_samples
from rlhfkit.engine.distributed import DistInfo
from rlhfkit.engine.fsdp import compute_dtype
from rlhfkit.models.loading import load_causal_lm
from rlhfkit.models.lora import apply_lora
from rlhfkit.models.packed_attention import use_packed_attention
from rlhfkit.trainers.common import target_log_probs
from rlhfkit.trainers.loop import OfflineMethod


def sft_samples(cfg: SFTConfig, tokenizer: Any, rows: Any) -> tuple[list[dict], dict[str, Any]]:
    if cfg.csft_keys:
        rows = (condition_row(row, cfg.csft_keys, cfg.input_key, cfg.apply_chat_template) for row in rows)
    return build_sft_samples(rows, tokenizer, input_key=cfg.input_key, output_key=cfg.output_key,
                             input_template=cfg.input_template, apply_chat_template=cfg.apply_chat_template,
                             max_len=cfg.max_len, multiturn=cfg.multiturn, pretrain_mode=cfg.pretrain_mode)


def target_count(sample: dict[str, Any]) -> float:
    """Number of predicted target tokens (the first token is never predicted)."""
    return float(sum(sample["loss_mask"][1:]))


def sft_loss(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum of target-token NLL over the micro-batch (the loop divides by the global target count)."""
    log_probs, mask = target_log_probs(model, batch)
    return -(log_probs * mask).sum(), {}


def collate_for(cfg: TrainOptions, tokenizer: Any) -> Callable[[list[dict]], dict[str, Any]]:
    pad_id = tokenizer.pad_token_id
    if cfg.packing_samples:
        return lambda samples: collate_packed(samples, pad_token_id=pad_id)
    return lambda samples: collate_padded(samples, pad_token_id=pad_id)


def sft_method(cfg: SFTConfig, tokenizer: Any, dist_info: DistInfo) -> OfflineMethod:
    return OfflineMethod(name="sft", collate=collate_for(cfg, tokenizer), weight=target_count, loss=sft_loss,
                         tokens=lambda s: len(s["input_ids"]))


def load_policy(cfg: TrainingConfig, dist_info: DistInfo) -> nn.Module:
    model = load_causal_lm(need(cfg.pretrain, "--pretrain"), attn_implementation=cfg.attn_implementation,
                           load_in_4bit=cfg.load_in_4bit,
                           compute_dtype=compute_dtype(cfg.param_dtype, dist_info.device))
    if cfg.packing_samples:  # packed rows attended sample by sample, no [L, L] mask (models/packed_attention.py)
        use_packed_attention(model)
    if cfg.lora_rank > 0:
        return apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.target_modules, cfg.lora_dropout)
    return model
