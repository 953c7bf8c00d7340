"""Pieces every offline method shares: the per-token log-probs of a batch, and the command scaffold
(distributed init -> run folder -> tokenizer -> data -> plan -> model -> engine -> loop)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from rlhfkit.config.commands import OfflineConfig, TrainingConfig
from rlhfkit.config.options import SeedOptions
from rlhfkit.config.validate import need, require, validate_common
from rlhfkit.data.collate import model_inputs
from rlhfkit.data.readers import blend_datasets
from rlhfkit.engine.distributed import DistInfo, init_distributed, shutdown_distributed
from rlhfkit.engine.precision import Precision, apply_precision
from rlhfkit.engine.train_engine import TrainEngine
from rlhfkit.errors import ConfigError
from rlhfkit.models.context_parallel import (
    data_parallel_coords,
    gather_sequence,
    local_slice,
    ring_group,
    setup_ring_attention,
    shard_forward_kwargs,
    teardown_ring_attention,
)
from rlhfkit.models.loading import load_tokenizer
from rlhfkit.models.logprobs import log_probs_from_logits
from rlhfkit.models.tensor_parallel import TP_FLAG, setup_tensor_parallel, teardown_tensor_parallel
from rlhfkit.observability.report import write_report
from rlhfkit.observability.run import prepare_run_dir, resolve_run_dir
from rlhfkit.observability.summary import summarize_run, summary_lines
from rlhfkit.trainers.loop import OfflineMethod, plan_steps, train_offline

log = logging.getLogger("rlhfkit")
C = TypeVar("C", bound=OfflineConfig)  # the command's config (SFTConfig, RMConfig, ...)


def target_log_probs(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(x_t | x_<t) for t >= 1 and the matching loss mask, both [B, T-1] (float32), on the model's device.

    With --ring_attn_size N each rank of a ring group runs the model on its chunk of the sequence and the chunks'
    log-probs are all-gathered, so every rank returns the whole [B, T-1] (rlhfkit.models.context_parallel)."""
    device = next(model.parameters()).device
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    ring = ring_group()
    if ring is not None:  # --ring_attn_size: this rank's chunk, its next tokens, gathered over the ring group
        ids = batch["input_ids"]
        logits = model(**shard_forward_kwargs(model_inputs(batch), ring)).logits
        labels = local_slice(F.pad(ids[:, 1:], (0, 1)), ring)  # the token after each position of the chunk
        log_probs = gather_sequence(log_probs_from_logits(logits.float(), labels), ids.shape[1] - 1, ring)
        return log_probs, batch["loss_mask"][:, 1:].to(log_probs.dtype)
    logits = model(**model_inputs(batch, model=model)).logits[:, :-1]
    log_probs = log_probs_from_logits(logits.float(), batch["input_ids"][:, 1:])
    return log_probs, batch["loss_mask"][:, 1:].to(log_probs.dtype)


def load_split(cfg: SeedOptions, spec: str | None, split: str, probs: str | None = None,
               max_samples: int | None = None):
    """Read (and mix) the datasets named by a comma-separated flag value; None when the flag is unset."""
    if not spec:
        return None
    return blend_datasets(spec, probs, split=split, seed=cfg.seed, max_samples=max_samples)


def resolved_copy(cfg: C, precision: Precision, run_dir: Path) -> C:
    """A copy of the user's config with --param_dtype and --run_dir resolved and the precision decision kept, which
    the offline engine, loop and manifest read; the user's object stays as given."""
    out = copy.copy(cfg)
    out.param_dtype = precision.dtype
    out.run_dir = str(run_dir)
    out.precision = precision
    return out


def run_offline_command(
    cfg: C,
    build_samples: Callable[[C, Any, Any], tuple[list[dict], dict[str, Any]]],
    build_method: Callable[[C, Any, DistInfo], OfflineMethod],
    load_model: Callable[[C, DistInfo], nn.Module],
    extra_config: Callable[[list[dict]], dict[str, Any]] | None = None,
    after_training: Callable[[C, TrainEngine, Any, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The scaffold of every offline command; the method supplies samples, loss and model."""
    require(cfg, "pretrain", "dataset")
    validate_common(cfg)
    dist_info = init_distributed()
    try:
        setup_context_parallel(cfg)
        setup_tp(cfg, dist_info)
        torch.manual_seed(cfg.seed)
        if cfg.full_determinism:
            torch.use_deterministic_algorithms(True)
        cfg = resolved_copy(cfg, apply_precision(cfg, dist_info.device.type), resolve_run_dir(cfg))
        run_dir = prepare_run_dir(cfg, dist_info.is_main, dist_info.world_size, run_dir=Path(need(cfg.run_dir,
                                                                                                  "--run_dir")))
        tokenizer = load_tokenizer(need(cfg.pretrain, "--pretrain"), use_fast=not cfg.disable_fast_tokenizer)
        if cfg.tokenizer_chat_template:
            tokenizer.chat_template = cfg.tokenizer_chat_template
        train_rows = load_split(cfg, cfg.dataset, cfg.dataset_split, cfg.dataset_probs, cfg.max_samples)
        train_samples, stats = build_samples(cfg, tokenizer, train_rows)
        log.info("training data: %s", stats)
        eval_samples = None
        if cfg.eval_dataset:
            eval_samples, eval_stats = build_samples(cfg, tokenizer, load_split(cfg, cfg.eval_dataset, cfg.eval_split))
            log.info("eval data: %s", eval_stats)
        plan = plan_steps(cfg, len(train_samples), data_parallel_coords(dist_info.rank, dist_info.world_size)[1])
        engine = TrainEngine(load_model(cfg, dist_info), cfg, dist_info, plan.total_steps)
        method = build_method(cfg, tokenizer, dist_info)
        result = train_offline(cfg, dist_info, engine, tokenizer, method, train_samples, plan, eval_samples,
                               data_stats=stats, extra_config=extra_config(train_samples) if extra_config else None)
        if after_training is not None:
            after_training(cfg, engine, tokenizer, result)
        if dist_info.is_main:
            log.info("report: %s", write_report(run_dir))
            print("\n".join(summary_lines(summarize_run(run_dir))), flush=True)
        return result
    finally:
        teardown_ring_attention()
        teardown_tensor_parallel()
        shutdown_distributed()


def setup_context_parallel(cfg: TrainingConfig) -> None:
    """--ring_attn_size / --ring_head_stride: the ring groups (rlhfkit.models.context_parallel); refuses the flags
    that do not compose with it."""
    size = cfg.ring_attn_size
    if size > 1 and cfg.aux_loss_coef:
        raise ConfigError(f"--aux_loss_coef with --ring_attn_size {size}: the router loss would be computed on each "
                          "rank's chunk of the sequence, not on the whole sequence; use one of the two")
    ring = setup_ring_attention(size, cfg.ring_head_stride)
    if ring is not None:
        log.info("context parallel: ring groups of %d ranks (all-gather attention, head stride %d)", ring.size,
                 ring.head_stride)


def setup_tp(cfg: TrainingConfig, dist_info: DistInfo) -> None:
    """--ds_tensor_parallel_size (alias --tp_size): the ("dp", "tp") device mesh (rlhfkit.models.tensor_parallel);
    refuses the flags that do not compose with it."""
    size = cfg.ds_tensor_parallel_size
    if size > 1 and cfg.ring_attn_size > 1:
        raise ConfigError(f"{TP_FLAG} {size} with --ring_attn_size {cfg.ring_attn_size}: tensor and context "
                          "parallelism do not compose yet (the ring attention gathers whole key/value heads); "
                          "use one of the two")
    if size > 1 and cfg.lora_rank > 0:
        raise ConfigError(f"{TP_FLAG} {size} with --lora_rank {cfg.lora_rank}: the LoRA adapters wrap the linear "
                          "layers that the tensor-parallel plan splits, which is not implemented; drop one of the two")
    group = setup_tensor_parallel(size, dist_info.device.type)
    if group is not None:
        log.info("tensor parallel: %d ranks per group, %d data-parallel groups", group.size,
                 dist_info.world_size // group.size)
