"""TrainEngine: one FSDP2-sharded model with its AdamW optimizer and lr schedule.

Used by every trainer (offline loop, PPO actor and critic). It does not know about data or losses.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rlhfkit.engine.distributed import DistInfo
from rlhfkit.engine.fsdp import shard_model
from rlhfkit.engine.optim import build_optimizer, build_scheduler


class TrainEngine:
    """Owns model, optimizer and scheduler; exposes backward / step / lr."""

    def __init__(self, model: nn.Module, cfg: Any, dist_info: DistInfo, total_steps: int,
                 learning_rate: float | None = None) -> None:
        self.dist = dist_info
        self.cfg = cfg
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": cfg.gradient_checkpointing_use_reentrant})
            model.config.use_cache = False
        self.model = shard_model(model, zero_stage=cfg.zero_stage, device=dist_info.device,
                                 param_dtype=cfg.param_dtype, cpu_offload=cfg.adam_offload)
        lr = cfg.learning_rate if learning_rate is None else learning_rate
        self.optimizer = build_optimizer(self.model, lr, cfg.adam_betas, cfg.l2)
        self.scheduler = build_scheduler(self.optimizer, total_steps=total_steps, warmup_ratio=cfg.lr_warmup_ratio,
                                         schedule=cfg.lr_scheduler, min_lr_ratio=cfg.min_lr_ratio)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def optimizer_step(self) -> float:
        """Clip (if --max_norm > 0), step, schedule, zero grads; return the pre-clip global grad norm."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.cfg.max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(value):
            raise FloatingPointError(f"gradient norm is {value} at lr {self.lr:.3g}: the loss diverged. "
                                     "Lower --learning_rate or check the data for empty targets.")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return value
