"""Exponential moving average of a trained model's weights (`rlhfkit ppo --enable_ema`, OpenRLHF's EMA actor).

    ema_0 = theta_0 (the weights the run starts from),
    ema_t = beta * ema_{t-1} + (1 - beta) * theta_t   after optimizer step t (beta = --ema_beta),

so ema_T = beta^T theta_0 + (1 - beta) * sum_{t=1..T} beta^(T-t) theta_t. Kept in float32 for every trainable
parameter; with FSDP2 each rank keeps the average of its own shards (a DTensor with the parameter's placement, so
the exact-resume checkpoint reshards it like the model). Frozen parameters are not averaged: they never change, so
their average is themselves. Nothing is gathered except by `full_state` (saving).
"""

from __future__ import annotations

import torch
from torch import nn

from rlhfkit.config.rl_options import EMAOptions


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class EMA:
    """The float32 running average of `model`'s trainable parameters, updated by `update()` after each step."""

    def __init__(self, model: nn.Module, beta: float) -> None:
        if not 0.0 < beta < 1.0:
            raise ValueError(f"EMA beta must be in (0, 1), got {beta}")
        self.beta = beta
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            self.shadow = {name: p.detach().to(torch.float32, copy=True) for name, p in self.params.items()}
        self.updates = 0

    @torch.no_grad()
    def update(self) -> None:
        """ema <- beta * ema + (1 - beta) * theta, on each rank's local shards (no communication)."""
        for name, param in self.params.items():
            shard = _local(self.shadow[name])
            shard.mul_(self.beta).add_(_local(param.detach()).to(torch.float32), alpha=1.0 - self.beta)
        self.updates += 1

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The averages by parameter name (DTensors where the model is sharded): for torch.distributed.checkpoint,
        which loads into them in place."""
        return self.shadow

    @torch.no_grad()
    def full_state(self) -> dict[str, torch.Tensor]:
        """The unsharded averages on CPU, by parameter name (collective where sharded: every rank must call it)."""
        out = {}
        for name, value in self.shadow.items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[name] = full.detach().cpu()
        return out


DEFAULT_EMA_BETA = 0.992  # OpenRLHF's default decay


def resolved_ema_beta(cfg: EMAOptions) -> float | None:
    """The EMA decay a run uses: --ema_beta, or DEFAULT_EMA_BETA, with --enable_ema; None without it."""
    if not cfg.enable_ema:
        return None
    beta = cfg.ema_beta
    return DEFAULT_EMA_BETA if beta is None else float(beta)


def validate_ema(cfg: EMAOptions) -> None:
    """--ema_beta must lie in (0, 1) and goes with --enable_ema (alone it would do nothing)."""
    from rlhfkit.errors import ConfigError

    beta = cfg.ema_beta
    if beta is None:
        return
    if not cfg.enable_ema:
        raise ConfigError(f"--ema_beta {beta} without --enable_ema: there is no EMA to decay; add --enable_ema, or "
                          "drop --ema_beta")
    if not 0.0 < beta < 1.0:
        raise ConfigError(f"--ema_beta {beta} must be in (0, 1): ema = beta * ema + (1 - beta) * weights (OpenRLHF's "
                          f"default {DEFAULT_EMA_BETA})")
