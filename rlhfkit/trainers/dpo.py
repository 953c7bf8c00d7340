"""DPO, IPO and cDPO on preference pairs.

With ``h = (log pi(y_c|x) - log pi(y_r|x)) - (log pi_ref(y_c|x) - log pi_ref(y_r|x))`` (sums over response tokens):

    DPO  : -log sigmoid(beta h)                                   (per pair; mean over the global batch)
    cDPO : -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)          (--label_smoothing eps)
    IPO  : (h - 1 / (2 beta))^2 with length-averaged log-probs                 (--ipo)
    + nll_loss_coef * (-mean_t log pi(y_c,t | ...))                           (--nll_loss_coef)

The math is `rlhfkit.algorithms.preference.dpo_loss`; this module only feeds it. A pair weighs 1 in the loop's
normaliser. The reference log-probs come from one of two places (``--ref_mode``):

* ``precompute`` (default): before the policy engine is built, the reference model scores every pair of the training
  (and eval) set once, the sums are stored in the samples and the reference is freed;
* ``live``: the reference (FSDP2-sharded, frozen) runs beside the policy on every micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from rlhfkit.algorithms.preference import dpo_loss
from rlhfkit.config.commands import DPOConfig
from rlhfkit.config.validate import need
from rlhfkit.engine.distributed import DistInfo
from rlhfkit.trainers.loop import OfflineMethod
from rlhfkit.trainers.pairs import PAIR_SIDES, preference_samples
from rlhfkit.trainers.sequence_logps import (
    Batch,
    annotate_reference,
    collate_sides,
    load_frozen_causal_lm,
    model_device,
    sequence_sums,
    to_device,
)

REF_KEYS = ("ref_chosen_logp", "ref_rejected_logp")


def dpo_samples(cfg: DPOConfig, tokenizer: Any, rows: Any) -> tuple[list[dict], dict[str, Any]]:
    samples, stats = preference_samples(cfg, tokenizer, rows)
    if cfg.ref_mode == "precompute":
        annotate_reference(cfg, samples, tokenizer.pad_token_id,
                           [(*PAIR_SIDES[0], REF_KEYS[0]), (*PAIR_SIDES[1], REF_KEYS[1])])
    return samples, stats


def collate_pairs(samples: Sequence[dict], pad_token_id: int, packed: bool = False) -> Batch:
    """``[2B, T]``: the B chosen sequences, then the B rejected ones (packed: one row of them in that order);
    ``ref_logps [2B]`` when precomputed."""
    batch = collate_sides(samples, pad_token_id, PAIR_SIDES, packed)
    if all(REF_KEYS[0] in s for s in samples):
        batch["ref_logps"] = torch.tensor([s[k] for k in REF_KEYS for s in samples], dtype=torch.float32)
    return batch


def dpo_batch_loss(model: nn.Module, batch: Batch, *, beta: float, label_smoothing: float = 0.0, ipo: bool = False,
                   nll_loss_coef: float = 0.0, ref_model: nn.Module | None = None,
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over the micro-batch's pairs of the DPO/IPO/cDPO loss (+ NLL term), and metric sums."""
    batch = to_device(batch, model_device(model))
    logps, counts = sequence_sums(model, batch)
    if ref_model is not None:
        with torch.no_grad():
            ref_logps, _ = sequence_sums(ref_model, batch)
    elif "ref_logps" in batch:
        ref_logps = batch["ref_logps"].to(logps.device)
    else:
        raise ValueError("DPO batch has no reference log-probs: use --ref_mode live or precompute them")
    n = logps.shape[0] // 2
    if ipo:
        policy, ref = logps / counts.clamp(min=1), ref_logps / counts.clamp(min=1)
    else:
        policy, ref = logps, ref_logps
    loss, chosen_rewards, rejected_rewards = dpo_loss(policy[:n], policy[n:], ref[:n], ref[n:], beta=beta,
                                                      label_smoothing=label_smoothing, ipo=ipo, reduction="sum")
    nll = -(logps[:n] / counts[:n].clamp(min=1)).sum()
    if nll_loss_coef > 0:
        loss = loss + nll_loss_coef * nll
    metrics = {"chosen_reward": chosen_rewards.sum(), "rejected_reward": rejected_rewards.sum(),
               "reward_margin": (chosen_rewards - rejected_rewards).sum(),
               "reward_accuracy": (chosen_rewards > rejected_rewards).float().sum(),
               "chosen_logps": logps[:n].detach().sum(), "rejected_logps": logps[n:].detach().sum(),
               "nll": nll.detach()}
    return loss, metrics


def dpo_method(cfg: DPOConfig, tokenizer: Any, dist_info: DistInfo) -> OfflineMethod:
    ref_model = None
    if cfg.ref_mode == "live":
        ref_model = load_frozen_causal_lm(need(cfg.ref_pretrain or cfg.pretrain, "--pretrain"), cfg, dist_info,
                                          offload=cfg.ref_offload)
    pad_id = tokenizer.pad_token_id

    def loss(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return dpo_batch_loss(model, batch, beta=cfg.beta, label_smoothing=cfg.label_smoothing, ipo=cfg.ipo,
                              nll_loss_coef=cfg.nll_loss_coef, ref_model=ref_model)

    return OfflineMethod(name="dpo", collate=lambda samples: collate_pairs(samples, pad_id, cfg.packing_samples),
                         weight=lambda s: 1.0,
                         loss=loss, tokens=lambda s: len(s["chosen_ids"]) + len(s["rejected_ids"]))


def validate_dpo(cfg: DPOConfig) -> None:
    from rlhfkit.errors import ConfigError

    if cfg.beta <= 0:
        raise ConfigError(f"--beta must be > 0, got {cfg.beta}")
    if not 0.0 <= cfg.label_smoothing < 0.5:
        raise ConfigError(f"--label_smoothing must lie in [0, 0.5), got {cfg.label_smoothing}")
    if cfg.ipo and cfg.label_smoothing:
        raise ConfigError("--ipo and --label_smoothing contradict: cDPO smoothing applies to the DPO loss only")
    if cfg.nll_loss_coef < 0:
        raise ConfigError(f"--nll_loss_coef must be >= 0, got {cfg.nll_loss_coef}")
