"""Sequence log-probs of trained and frozen models, shared by the offline methods (DPO, KTO, RM, KD, PRM): batches
on the model's device, maps sharded over the ranks, frozen reference / teacher models, per-sequence sums of
response-token log-probs (padded or packed), samples with several sides (chosen / rejected, completion /
mismatched) collated into one batch, and `--ref_mode precompute`'s reference scores."""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlhfkit.algorithms.preference import sequence_log_probs
from rlhfkit.config.commands import DPOConfig, KTOConfig, TrainingConfig
from rlhfkit.config.validate import need
from rlhfkit.data.collate import collate_packed, collate_padded, is_packed
from rlhfkit.engine.distributed import DistInfo, init_distributed
from rlhfkit.engine.fsdp import shard_model
from rlhfkit.models.context_parallel import data_parallel_coords, ring_group, use_ring_attention
from rlhfkit.models.loading import load_causal_lm
from rlhfkit.models.packed_attention import use_packed_attention
from rlhfkit.trainers.common import target_log_probs

log = logging.getLogger("rlhfkit")

Batch = dict[str, Any]


def to_device(batch: Batch, device: torch.device | None) -> Batch:
    """Tensors of a collated batch on ``device`` (no-op on CPU)."""
    if device is None:
        return batch
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def shard_chunks(n: int, rank: int, world: int, micro: int) -> list[list[int]]:
    """This rank's sample indices (strided) in chunks of at most ``micro``; every rank gets the same number of
    chunks (trailing ones may be empty)."""
    mine = list(range(rank, n, world))
    calls = math.ceil(math.ceil(n / world) / micro)
    return [mine[c * micro:(c + 1) * micro] for c in range(calls)]


def map_sharded(samples: Sequence[Any], micro: int, fn: Callable[[list[Any]], list[Any]],
                dist_info: DistInfo | None = None) -> list[Any]:
    """``fn`` over ``samples`` in chunks of ``micro``, sharded over the ranks, results gathered on every rank.

    Every rank calls ``fn`` the same number of times (a rank with no samples left repeats sample 0 and discards the
    result), so ``fn`` may run FSDP2 forwards, whose all-gathers need every rank.
    """
    if not samples:
        return []
    rank = dist_info.rank if dist_info else (dist.get_rank() if dist.is_initialized() else 0)
    world = dist_info.world_size if dist_info else (dist.get_world_size() if dist.is_initialized() else 1)
    dp_rank, dp_world = data_parallel_coords(rank, world)  # --ring_attn_size: a ring group maps the same chunks
    results: dict[int, Any] = {}
    for idx in shard_chunks(len(samples), dp_rank, dp_world, micro):
        out = fn([samples[i] for i in idx] or [samples[0]])
        results.update(zip(idx, out))
    if world > 1:
        gathered: list[dict[int, Any] | None] = [None] * world
        dist.all_gather_object(gathered, results)
        for part in gathered:
            results.update(part or {})
    return [results[i] for i in range(len(samples))]


def load_frozen_causal_lm(spec: str, cfg: TrainingConfig, dist_info: DistInfo, offload: bool = False) -> nn.Module:
    """A forward-only causal LM (reference or teacher): no grads, eval mode, FSDP2-sharded like the policy."""
    model = load_causal_lm(spec, attn_implementation=cfg.attn_implementation)
    if cfg.packing_samples:  # packed rows attended sample by sample, no [L, L] mask (models/packed_attention.py)
        use_packed_attention(model)
    model.requires_grad_(False)
    model.eval()
    if ring_group() is not None:
        use_ring_attention(model)
    return shard_model(model, zero_stage=3, device=dist_info.device, param_dtype=cfg.param_dtype, cpu_offload=offload)


def sequence_sums(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: (sum of response-token log-probs, number of response tokens), float32 ``[B]`` each; for a
    packed batch (``--packing_samples``), one entry per packed sequence."""
    log_probs, mask = target_log_probs(model, batch)
    mask = mask.to(log_probs.device)
    if is_packed(batch):
        return packed_sequence_sums(log_probs, mask, batch["seq_lens"])
    return sequence_log_probs(log_probs, mask), mask.sum(-1)


def packed_sequence_sums(log_probs: torch.Tensor, mask: torch.Tensor, seq_lens: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the ``[1, total - 1]`` target log-probs of a packed row per sequence: column t predicts token t + 1,
    so shifting by one puts every target under its own sequence (a sequence's first token is never a target,
    which is what keeps predictions across the seam out)."""
    by_target = F.pad(torch.where(mask > 0, log_probs, torch.zeros_like(log_probs)), (1, 0))[0]
    counts = F.pad(mask, (1, 0))[0]
    lens = seq_lens.tolist()
    return (torch.stack([part.sum() for part in by_target.split(lens)]),
            torch.stack([part.sum() for part in counts.split(lens)]))


def collate_sides(samples: Sequence[dict], pad_token_id: int, sides: Sequence[tuple[str, str]],
                  packed: bool = False) -> Batch:
    """Side 0 of every sample, then side 1, ...: one right-padded ``[len(sides) * B, T]`` batch, or with `packed`
    one ``[1, total]`` row of the same sequences in the same order."""
    rows = [{"input_ids": s[ids], "loss_mask": s[mask]} for ids, mask in sides for s in samples]
    return collate_packed(rows) if packed else collate_padded(rows, pad_token_id)


def annotate_reference(cfg: DPOConfig | KTOConfig, samples: list[dict], pad_token_id: int,
                       sides: Sequence[tuple[str, str, str]], what: str = "reference") -> None:
    """``--ref_mode precompute``: score ``samples`` with the reference model once and store, for each side
    ``(ids_key, mask_key, out_key)``, the response log-prob sum in ``sample[out_key]``. The reference is freed after."""
    if not samples:
        return
    dist_info = init_distributed()  # idempotent: the command has initialised the group already
    began = time.perf_counter()
    ref = load_frozen_causal_lm(need(cfg.ref_pretrain or cfg.pretrain, "--pretrain"), cfg, dist_info)
    pairs = [(ids, mask) for ids, mask, _ in sides]

    @torch.no_grad()
    def score(chunk: list[dict], model: nn.Module = ref) -> list[list[float]]:
        batch = to_device(collate_sides(chunk, pad_token_id, pairs), dist_info.device)
        sums, _ = sequence_sums(model, batch)
        per_side = sums.double().cpu().view(len(sides), len(chunk))
        return per_side.t().tolist()

    values = map_sharded(samples, max(1, cfg.micro_train_batch_size), score, dist_info)
    for sample, row in zip(samples, values):
        for (_, _, out), value in zip(sides, row):
            sample[out] = value
    del score, ref  # free the reference before the policy engine is built
    gc.collect()
    log.info("%s log-probs precomputed for %d samples in %.2fs", what, len(samples), time.perf_counter() - began)
