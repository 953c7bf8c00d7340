"""The one training loop every offline method (SFT, RM, DPO, KTO, KD, PRM) runs on.

A method plugs in an `OfflineMethod`: how to collate samples, how much each sample weighs in the
normaliser (tokens for SFT, pairs for DPO), and a loss that returns a *sum* over its micro-batch.
The loop divides by the global weight of the whole optimizer step (all-reduced across ranks), so the
loss and the gradients do not depend on how the global batch is split into ranks and micro-batches:

    loss_step = sum_{micro-batches, ranks} loss_sum / sum_{micro-batches, ranks} weight

Read top to bottom: plan -> (resume) -> for each epoch, for each step: micro-batches -> backward ->
optimizer step -> log -> eval (-> the best model, --best_metric_key) -> checkpoint; then save the HF folder.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlhfkit.config.commands import OfflineConfig
from rlhfkit.config.validate import need, validate_batch_sizes
from rlhfkit.engine.best import BestTracker, tracker_for
from rlhfkit.engine.checkpoint import load_checkpoint, save_checkpoint, save_hf_folder
from rlhfkit.engine.distributed import DistInfo, all_reduce_sum, barrier
from rlhfkit.engine.train_engine import TrainEngine
from rlhfkit.errors import ConfigError
from rlhfkit.models.context_parallel import data_parallel_coords
from rlhfkit.models.tensor_parallel import tp_size
from rlhfkit.observability.console import print_derived_table, progress_bar
from rlhfkit.observability.metrics import MetricsLogger, merge_metrics
from rlhfkit.observability.run import record_resume

log = logging.getLogger("rlhfkit")

Sample = dict[str, Any]


@dataclass
class OfflineMethod:
    """What a method contributes to the shared loop."""

    name: str
    collate: Callable[[list[Sample]], dict[str, Any]]
    weight: Callable[[Sample], float]
    loss: Callable[[nn.Module, dict[str, Any]], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    tokens: Callable[[Sample], int]


@dataclass
class StepPlan:
    world_size: int
    accumulation: int
    steps_per_epoch: int
    total_steps: int


def plan_steps(cfg: OfflineConfig, num_samples: int, world_size: int) -> StepPlan:
    """Derive accumulation and step counts; an epoch drops its last incomplete global batch (logged)."""
    accumulation = validate_batch_sizes(cfg, world_size)
    steps_per_epoch = num_samples // cfg.train_batch_size
    if steps_per_epoch == 0:
        raise ConfigError(f"the training set has {num_samples} samples, fewer than --train_batch_size "
                          f"{cfg.train_batch_size}: lower --train_batch_size or add data")
    return StepPlan(world_size, accumulation, steps_per_epoch, steps_per_epoch * cfg.max_epochs)


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The sample order of an epoch: a permutation that depends only on (seed, epoch)."""
    generator = torch.Generator().manual_seed(seed * 1000 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def rank_micro_batches(global_batch: list[int], rank: int, world: int, micro: int) -> list[list[int]]:
    """This rank's share of a global batch (strided), cut into micro-batches."""
    mine = global_batch[rank::world]
    return [mine[i:i + micro] for i in range(0, len(mine), micro)]


def _sum_metrics(into: dict[str, float], new: dict[str, torch.Tensor]) -> None:
    merge_metrics(into, {key: value.detach() for key, value in new.items()})


def _reduce_metrics(sums: dict[str, float], weight: float) -> dict[str, float]:
    keys = sorted(sums)
    if not keys:
        return {}
    totals = all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
    return {k: float(v) / weight for k, v in zip(keys, totals)}


def train_step(engine: TrainEngine, method: OfflineMethod, samples: list[Sample],
               micro_batches: list[list[int]], world: int) -> tuple[dict[str, float], int]:
    """Forward/backward every micro-batch of this rank, then one optimizer step. Returns (metrics, local tokens)."""
    local_weight = sum(method.weight(samples[i]) for mb in micro_batches for i in mb)
    global_weight = float(all_reduce_sum(local_weight))
    if global_weight <= 0:
        raise ValueError(f"a {method.name} step has no training targets (weight 0): every sample in the global "
                         "batch has an empty loss mask. Check --max_len and the data's response fields.")
    sums: dict[str, float] = {}
    tokens = 0
    aux_sum = 0.0
    router = getattr(engine, "aux_loss", None)  # --aux_loss_coef on an MoE model (rlhfkit.models.moe)
    for mb in micro_batches:
        batch = method.collate([samples[i] for i in mb])
        loss_sum, metric_sums = method.loss(engine.model, batch)
        scaled = loss_sum * (world / global_weight)
        aux = router.pop() if router is not None else None
        if aux is not None:  # --aux_loss_coef: the step adds coef x the mean router loss of its micro-batches
            scaled = scaled + engine.aux_loss_coef * aux / len(micro_batches)
            aux_sum += float(aux.detach())
        scaled.backward()
        _sum_metrics(sums, {"loss": loss_sum, **metric_sums})
        tokens += sum(method.tokens(samples[i]) for i in mb)
    metrics = _reduce_metrics(sums, global_weight)
    if router is not None:  # FSDP2 averages gradients over ranks: the term is the mean over every rank
        aux_mean = float(all_reduce_sum(aux_sum / max(1, len(micro_batches)))) / world
        metrics["aux_loss"] = aux_mean
        metrics["loss"] += engine.aux_loss_coef * aux_mean
    metrics["lr"] = engine.lr
    metrics["grad_norm"] = engine.optimizer_step()
    return metrics, tokens


@torch.no_grad()
def evaluate(engine: TrainEngine, method: OfflineMethod, samples: list[Sample], dist_info: DistInfo,
             micro: int) -> dict[str, float]:
    """Global weighted mean of the loss (and method metrics) over the eval set, sharded across ranks."""
    engine.eval()
    dp_rank, dp_world = data_parallel_coords(dist_info.rank, dist_info.world_size)  # a ring group shares samples
    indices = list(range(len(samples)))[dp_rank::dp_world]
    sums: dict[str, float] = {}
    weight = 0.0
    for start in range(0, len(indices), micro):
        chunk = [samples[i] for i in indices[start:start + micro]]
        loss_sum, metric_sums = method.loss(engine.model, method.collate(chunk))
        _sum_metrics(sums, {"loss": loss_sum, **metric_sums})
        weight += sum(method.weight(s) for s in chunk)
    # Every rank must enter the same collectives even with an empty shard.
    total_weight = float(all_reduce_sum(weight))
    engine.train()
    keys = ["loss", *sorted(k for k in sums if k != "loss")] if sums else ["loss"]
    totals = all_reduce_sum(torch.tensor([sums.get(k, 0.0) for k in keys], dtype=torch.float64))
    return {k: float(v) / max(total_weight, 1e-12) for k, v in zip(keys, totals)}


def train_offline(cfg: OfflineConfig, dist_info: DistInfo, engine: TrainEngine, tokenizer: Any, method: OfflineMethod,
                  train_samples: list[Sample], plan: StepPlan, eval_samples: list[Sample] | None = None,
                  data_stats: dict[str, Any] | None = None, extra_config: dict[str, Any] | None = None,
                  ) -> dict[str, Any]:
    """Run the whole training; returns the last train and eval metrics."""
    world = dist_info.world_size
    # --ring_attn_size N (or --ds_tensor_parallel_size N): the N ranks of a group take the same micro-batches (each
    # one chunk of every sequence, or one slice of every weight) and compute the same loss; every sample then weighs
    # N times in train_step's global weight, which cancels the N-fold gradient the replicated loss sends back through
    # the ring's gather (rlhfkit.models.context_parallel), and with tensor parallelism FSDP2's averaging over the dp
    # ranks only (rlhfkit.models.tensor_parallel)
    dp_rank, dp_world = data_parallel_coords(dist_info.rank, world)
    if dist_info.is_main:
        _print_plan(cfg, method, train_samples, plan, data_stats, world, dp_world)
    best = tracker_for(cfg, "eval/loss", bool(eval_samples))  # --best_metric_key
    global_step, start_epoch, start_in_epoch = _resume(cfg, engine, best, dist_info)
    metrics_log = MetricsLogger(need(cfg.run_dir, "--run_dir"), cfg, enabled=dist_info.is_main)
    bar = progress_bar(plan.total_steps, global_step, dist_info.is_main, f"{cfg.command}")
    last: dict[str, Any] = {}
    if eval_samples and global_step == 0:
        before = {f"eval/{k}": v for k, v in evaluate(engine, method, eval_samples, dist_info,
                                                       cfg.micro_train_batch_size).items()}
        metrics_log.log(0, before)
        keep_best(best, engine, tokenizer, 0, before, extra_config, dist_info)
        log.info("step 0 eval (before training): %s", {k: round(v, 4) for k, v in before.items()})
    engine.train()
    for epoch in range(start_epoch, cfg.max_epochs):
        order = epoch_order(len(train_samples), cfg.seed, epoch)
        first = start_in_epoch if epoch == start_epoch else 0
        for step_in_epoch in range(first, plan.steps_per_epoch):
            began = time.perf_counter()
            global_batch = order[step_in_epoch * cfg.train_batch_size:(step_in_epoch + 1) * cfg.train_batch_size]
            micro = rank_micro_batches(global_batch, dp_rank, dp_world, cfg.micro_train_batch_size)
            metrics, tokens = train_step(engine, method, train_samples, micro, world)
            global_step += 1
            seconds = time.perf_counter() - began
            metrics["tokens_per_s"] = float(all_reduce_sum(tokens)) / (world // dp_world) / seconds
            metrics["step_seconds"] = seconds
            metrics["epoch"] = epoch
            if dist_info.device.type == "cuda":  # this rank's peak GPU memory since the run began
                metrics["peak_memory_mb"] = torch.cuda.max_memory_allocated(dist_info.device) / 2**20
            last = {f"train/{k}": v for k, v in metrics.items()}
            if global_step % cfg.logging_steps == 0:
                metrics_log.log(global_step, last)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}",
                            tok_s=f"{metrics['tokens_per_s']:.0f}")
            bar.update(1)
            done_epoch = step_in_epoch + 1 == plan.steps_per_epoch
            if eval_samples and ((cfg.eval_steps > 0 and global_step % cfg.eval_steps == 0)
                                 or (cfg.eval_steps <= 0 and done_epoch)):
                evaluated = evaluate(engine, method, eval_samples, dist_info, cfg.micro_train_batch_size)
                eval_metrics = {f"eval/{k}": v for k, v in evaluated.items()}
                metrics_log.log(global_step, eval_metrics)
                keep_best(best, engine, tokenizer, global_step, eval_metrics, extra_config, dist_info)
                last.update(eval_metrics)
                log.info("step %d eval: %s", global_step, {k: round(v, 4) for k, v in eval_metrics.items()})
            if cfg.save_steps > 0 and global_step % cfg.save_steps == 0:  # after the eval: it holds the best
                next_pos = (epoch + 1, 0) if done_epoch else (epoch, step_in_epoch + 1)
                _checkpoint(cfg, engine, tokenizer, global_step, next_pos, best, extra_config)
    bar.close()
    save_hf_folder(engine.state_model, tokenizer, cfg.save_path, extra_config)
    if dist_info.is_main:
        log.info("saved HF model to %s", cfg.save_path)
    metrics_log.close()
    return last


def _print_plan(cfg: OfflineConfig, method: OfflineMethod, train_samples: list[Sample], plan: StepPlan,
                data_stats: dict[str, Any] | None, world: int, dp_world: int) -> None:
    """The derived-quantities table at the start of the run (rank 0): batches, steps, precision, data statistics and,
    with a ring or tensor-parallel group, the group size x the data-parallel size."""
    tokens_per_step = sum(method.tokens(s) for s in train_samples) / max(1, len(train_samples)) * cfg.train_batch_size
    print_derived_table(f"rlhfkit {cfg.command}", {
        "world size": world, "train samples": len(train_samples), "train batch (global)": cfg.train_batch_size,
        "micro batch (per rank)": cfg.micro_train_batch_size, "accumulation steps": plan.accumulation,
        "steps per epoch": plan.steps_per_epoch, "epochs": cfg.max_epochs, "total steps": plan.total_steps,
        "tokens per step (mean)": int(tokens_per_step),
        "precision": cfg.precision.summary() if cfg.precision is not None else cfg.param_dtype,
        "dropped per epoch (incomplete batch)": len(train_samples) - plan.steps_per_epoch * cfg.train_batch_size,
        **{f"data: {k}": v for k, v in (data_stats or {}).items()},
        **({f"{'tensor parallel' if tp_size() > 1 else 'ring size'} x data parallel": f"{world // dp_world} x "
            f"{dp_world}"} if dp_world < world else {}),
        "run dir": cfg.run_dir})


def _resume(cfg: OfflineConfig, engine: TrainEngine, best: BestTracker | None, dist_info: DistInfo
            ) -> tuple[int, int, int]:
    """--load_checkpoint: restore the newest checkpoint in --ckpt_path (model, optimizer, scheduler, RNG, the best
    evaluation so far); returns (global step, epoch, step in epoch) to go on from, (0, 0, 0) when starting fresh."""
    if not cfg.load_checkpoint:
        return 0, 0, 0
    state = load_checkpoint(cfg.ckpt_path, engine.state_model, engine.optimizer, engine.scheduler, seed=cfg.seed)
    if state is None:
        log.info("--load_checkpoint: no checkpoint in %s, starting fresh", cfg.ckpt_path)
        return 0, 0, 0
    engine.after_load()
    global_step, start_epoch, start_in_epoch = state["step"], state["epoch"], state["step_in_epoch"]
    if best is not None:
        best.load_state(state.get("best_metric"))
    note = record_resume(cfg.run_dir if dist_info.is_main else None, "model", state)
    log.info("resumed from step %d (epoch %d, step %d in epoch; %s)", global_step, start_epoch, start_in_epoch, note)
    return global_step, start_epoch, start_in_epoch


def _checkpoint(cfg: OfflineConfig, engine: TrainEngine, tokenizer: Any, global_step: int, next_pos: tuple[int, int],
                best: BestTracker | None, extra_config: dict[str, Any] | None) -> None:
    """The full-state checkpoint of `global_step` (resuming at `next_pos` = (epoch, step in epoch)), with the best
    evaluation so far; --save_hf_ckpt: also an HF folder beside it."""
    save_checkpoint(cfg.ckpt_path, global_step, engine.state_model, engine.optimizer, engine.scheduler,
                    {"epoch": next_pos[0], "step_in_epoch": next_pos[1],
                     **({"best_metric": best.state()} if best is not None else {})}, cfg.max_ckpt_num)
    if cfg.save_hf_ckpt:
        save_hf_folder(engine.state_model, tokenizer, f"{cfg.ckpt_path}/global_step{global_step}/hf", extra_config)


def keep_best(best: BestTracker | None, engine: TrainEngine, tokenizer: Any, step: int, eval_metrics: dict[str, float],
              extra_config: dict[str, Any] | None, dist_info: DistInfo) -> None:
    """--best_metric_key: a new best evaluation replaces <ckpt_path>/best with this model (collective)."""
    if best is None or not best.improves(step, eval_metrics):
        return
    if dist_info.is_main:
        shutil.rmtree(best.staging, ignore_errors=True)
    barrier()
    save_hf_folder(engine.state_model, tokenizer, best.staging, extra_config)
    if dist_info.is_main:
        best.commit()
