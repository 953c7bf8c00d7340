"""TrainEngine: one FSDP2-sharded model with its optimizer (AdamW, or Muon with AdamW) and lr schedule.

Used by every trainer (offline loop, PPO actor and critic). It does not know about data or losses.
"""

from __future__ import annotations

import math
from typing import Any, Protocol, cast

import torch
from torch import nn

from rlhfkit.config.optim_options import SharedOptimFlags, optim_settings
from rlhfkit.engine.adamw_round import adamw_step_and_round, fuses_adamw_and_rounding
from rlhfkit.engine.distributed import DistInfo
from rlhfkit.engine.ema import EMA
from rlhfkit.engine.fsdp import compute_dtype, shard_model
from rlhfkit.engine.host_memory import retain_freed_host_memory
from rlhfkit.engine.master_weights import MasterWeights
from rlhfkit.engine.optim import build_scheduler, make_optimizer, takes_grad_scale
from rlhfkit.models.context_parallel import ring_group, use_ring_attention
from rlhfkit.models.loading import is_4bit


class TrainEngineFlags(SharedOptimFlags, Protocol):
    """What TrainEngine reads of a training command's config (every training command has these flags; ppo's
    workers also the role's optimiser group, read by `optim_settings`). Structural, so `engine/` imports no
    command class (tests/test_layering.py)."""

    gradient_checkpointing: bool
    gradient_checkpointing_use_reentrant: bool
    zero_stage: int
    param_dtype: str
    adam_offload: bool
    master_weights_rounding: str
    seed: int
    aux_loss_coef: float


class TrainEngine:
    """Owns model, optimizer and scheduler (and with `ema_beta` the weights' moving average, `rlhfkit.engine.ema`);
    exposes backward / step / lr."""

    def __init__(self, model: nn.Module, cfg: TrainEngineFlags, dist_info: DistInfo, total_steps: int,
                 learning_rate: float | None = None, role: str | None = None, ema_beta: float | None = None) -> None:
        """`role`: 'actor' or 'critic' in ppo, whose --<role>_* optimiser flags override the shared ones;
        `learning_rate`: AdamW's peak lr (default --learning_rate); `ema_beta`: keep the weights' moving average."""
        self.dist = dist_info
        self.cfg = cfg
        if torch.device(dist_info.device).type == "cpu":
            retain_freed_host_memory()  # each step's tensors reuse the last step's memory (rlhfkit.engine.host_memory)
        if cfg.gradient_checkpointing:
            hf: Any = model  # a transformers model: these are its methods, not nn.Module's
            hf.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": cfg.gradient_checkpointing_use_reentrant})
            hf.config.use_cache = False
        if ring_group() is not None:  # --ring_attn_size > 1: sequences split over the ring group
            use_ring_attention(model)
        self.model = shard_model(model, zero_stage=cfg.zero_stage, device=dist_info.device,
                                 param_dtype=cfg.param_dtype, cpu_offload=cfg.adam_offload, trainable=True)
        # One rank in half precision (shard_model left the module plain and fp32): compute on a half-precision copy,
        # step fp32 masters (rlhfkit.engine.master_weights). `state_model` is what holds the weights the optimizer,
        # checkpoints, the EMA and the saved HF folder see: the masters there, else the model itself.
        self.master: MasterWeights | None = None
        dtype = compute_dtype(cfg.param_dtype, dist_info.device)
        if dtype != torch.float32 and not is_fsdp(self.model) and not is_4bit(self.model):
            self.master = MasterWeights(self.model, dtype, rounding=cfg.master_weights_rounding, seed=cfg.seed)
        self.state_model = self.master.masters if self.master is not None else self.model
        self.aux_loss_coef = float(cfg.aux_loss_coef or 0.0)
        self.aux_loss = _router_aux_loss(self.model, self.aux_loss_coef)
        self.settings = optim_settings(cfg, role, learning_rate)
        self.optimizer = make_optimizer(self.state_model, self.settings)
        # fused AdamW over stochastically rounded masters on a CPU: the step and the rounding in one pass
        self.steps_and_rounds = fuses_adamw_and_rounding(self.optimizer, self.master)
        self.scheduler = build_scheduler(self.optimizer, total_steps=total_steps,
                                         warmup_ratio=self.settings.lr_warmup_ratio,
                                         schedule=self.settings.lr_scheduler, min_lr_ratio=self.settings.min_lr_ratio)
        # ema_beta (ppo --enable_ema): the float32 moving average of the weights, updated after every step
        self.ema = EMA(self.state_model, ema_beta) if ema_beta is not None else None

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()

    def optimizer_step(self, report: dict[str, float] | None = None) -> float:
        """Clip (if --max_norm, or ppo's --<role>_max_norm, > 0), step, schedule, zero grads; return the pre-clip
        global grad norm.

        `report` (a dict, for --debug_dump_steps; None costs nothing): filled with `lr` (the one this step uses),
        `grad_norm_after_clip`, and the size of the update over all parameters, `update_max_abs` (max |delta|) and
        `update_norm` (||delta||_2), global over the ranks."""
        weights = self.state_model
        if self.master is not None:
            self.master.masters_with_grads()
        params = [p for p in weights.parameters() if p.grad is not None]
        grads = cast(list[torch.Tensor], [p.grad for p in params])
        before = [_local(p).detach().clone() for p in weights.parameters()] if report is not None else None
        unscale: torch.Tensor | None = None  # the clip's 1 / coefficient, applied inside the fused AdamW kernel
        if self.settings.max_norm > 0 and takes_grad_scale(self.optimizer):
            norm = torch.nn.utils.get_total_norm(grads)
            unscale = clip_divisor(_full(norm), self.settings.max_norm)
        elif self.settings.max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.settings.max_norm)
        else:
            norm = torch.nn.utils.get_total_norm(grads)
        value = float(_full(norm))
        if not math.isfinite(value):
            raise FloatingPointError(f"gradient norm is {value} at lr {self.lr:.3g}: the loss diverged. "
                                     "Lower --learning_rate or check the data for empty targets.")
        if report is not None:
            report["lr"] = self.lr
            report["grad_norm_after_clip"] = value / float(unscale) if unscale is not None else \
                float(_full(torch.nn.utils.get_total_norm(grads)))
        step = self.scheduler.last_epoch + 1
        if self.steps_and_rounds:
            assert self.master is not None and isinstance(self.optimizer, torch.optim.AdamW)  # steps_and_rounds
            adamw_step_and_round(self.optimizer, self.master, step, grad_scale=unscale)
            # the step torch's wrapped optimizer.step() would record: else the scheduler warns in every run's log
            # that it stepped before the optimizer
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
        elif unscale is None:
            self.optimizer.step()
        else:
            self.optimizer.grad_scale = unscale  # type: ignore[attr-defined]  # read by torch's fused Adam(W) step
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale  # type: ignore[attr-defined]
        if self.master is not None and not self.steps_and_rounds:
            self.master.sync_to_model(step=step)
        if self.ema is not None:
            self.ema.update()
        if before is not None and report is not None:  # (before is set exactly when report is)
            report.update(_update_size(before, [_local(p).detach() for p in weights.parameters()]))
        self.scheduler.step()
        if self.master is not None:
            self.master.end_step()  # the masters keep their gradient buffers (rlhfkit.engine.master_weights)
        else:
            self.optimizer.zero_grad(set_to_none=True)
        return value


    def after_load(self) -> None:
        """After a checkpoint wrote the weights (into `state_model`): round them into the compute copy."""
        if self.master is not None:
            self.master.sync_to_model(step=self.scheduler.last_epoch, trainable_only=False)


def is_fsdp(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _router_aux_loss(model: nn.Module, coef: float) -> Any:
    """--aux_loss_coef > 0: the hooks that capture each training forward's router load-balancing loss (MoE only)."""
    from rlhfkit.errors import ConfigError
    from rlhfkit.models.moe import RouterAuxLoss, is_moe

    if coef < 0:
        raise ConfigError(f"--aux_loss_coef must be >= 0, got {coef}")
    if coef == 0:
        return None
    if not is_moe(model):
        raise ConfigError(f"--aux_loss_coef {coef}: the model is not a mixture of experts (no router), so there is no "
                          "load-balancing loss to add; drop the flag")
    return RouterAuxLoss(model)


def clip_divisor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """1 / clip_grad_norm_'s coefficient, min(1, max_norm / (norm + 1e-6)): the gradients divided by it are the
    clipped gradients. Clipping folded into the fused optimizer step this way saves clip_grad_norm_'s pass over every
    gradient (135M fp32 gradients, AMD EPYC Zen 5, 2 threads: the clip 0.034-0.041 -> 0.021 s a step)."""
    return (1.0 / torch.clamp(max_norm / (norm.float() + 1e-6), max=1.0)).float()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _update_size(before: list[torch.Tensor], after: list[torch.Tensor]) -> dict[str, float]:
    """max |after - before| and ||after - before||_2 over every parameter shard, reduced over the ranks."""
    import torch.distributed as dist

    device = after[0].device
    top = torch.zeros((), dtype=torch.float64, device=device)
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for old, new in zip(before, after):
        if new.numel():
            delta = (new - old).abs_()  # exact in the parameters' dtype for nearby values (Sterbenz)
            top = torch.maximum(top, delta.amax().double())
            squares += torch.linalg.vector_norm(delta, dtype=torch.float64).square()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        dist.all_reduce(squares)
    return {"update_max_abs": float(top), "update_norm": float(squares.sqrt())}
