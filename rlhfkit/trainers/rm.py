"""Bradley-Terry reward model on preference pairs.

    loss = mean over pairs of -log sigmoid(r(x, y_c) - r(x, y_r) - margin)      (--loss sigmoid; logexp is equal)

``r`` is the scalar ``score`` head (`AutoModelForSequenceClassification`, num_labels 1) read at the last real token
of each sequence (`rlhfkit.models.loading.scalar_outputs`). The math is
`rlhfkit.algorithms.preference.reward_model_loss`; a pair weighs 1 in the loop's normaliser. After training, the
trained model scores every chosen and rejected sequence of the training set and the mean and standard deviation of
those rewards are written into the saved ``config.json`` as ``reward_mean`` / ``reward_std`` (read by
``--normalize_reward`` in `rlhfkit ppo` and `rlhfkit serve-rm`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlhfkit.algorithms.preference import reward_model_loss
from rlhfkit.config.commands import RMConfig, TrainingConfig
from rlhfkit.config.validate import need
from rlhfkit.data.collate import is_packed, model_inputs
from rlhfkit.data.errors import row_error
from rlhfkit.data.formatting import get_field
from rlhfkit.engine.distributed import DistInfo, barrier
from rlhfkit.engine.train_engine import TrainEngine
from rlhfkit.errors import ConfigError
from rlhfkit.models.loading import head_values, load_scalar_model, scalar_outputs
from rlhfkit.models.lora import apply_lora
from rlhfkit.models.packed_attention import use_packed_attention
from rlhfkit.trainers.loop import OfflineMethod
from rlhfkit.trainers.pairs import PAIR_SIDES, preference_samples
from rlhfkit.trainers.sequence_logps import collate_sides, map_sharded, model_device, to_device

log = logging.getLogger("rlhfkit")


def rm_samples(cfg: RMConfig, tokenizer: Any, rows: Any) -> tuple[list[dict], dict[str, Any]]:
    """Preference pairs; with ``--margin_loss`` each pair also carries ``margin`` (``--margin_key`` of its row)."""
    if not cfg.margin_loss:
        return preference_samples(cfg, tokenizer, rows)
    samples: list[dict] = []
    stats: dict[str, Any] = {}
    for row in rows:  # one row at a time, so each kept pair can be matched with its row's margin
        got, row_stats = preference_samples(cfg, tokenizer, [row])
        for key, value in row_stats.items():
            stats[key] = stats.get(key, 0) + value
        if got:
            got[0]["margin"] = _margin(row, cfg.margin_key)
            samples += got
    return samples, stats


def _margin(row: Any, key: str) -> float:
    value = get_field(row, key, "--margin_key")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise row_error(row, f"--margin_loss: key {key!r} must be a finite number, got {value!r}")
    return float(value)


def collate_rm(samples: Sequence[dict], pad_token_id: int, packed: bool = False) -> dict[str, Any]:
    """``[2B, T]``: chosen rows then rejected rows (packed: one row of them in that order); ``margin [B]`` when
    the samples carry one."""
    batch = collate_sides(samples, pad_token_id, PAIR_SIDES, packed)
    if all("margin" in s for s in samples):
        batch["margin"] = torch.tensor([s["margin"] for s in samples], dtype=torch.float32)
    return batch


def pair_rewards(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen rewards [B], rejected rewards [B]) of a `collate_rm` batch, float32: the head at each sequence's
    last token (in a packed row, at the end of each packed sequence)."""
    if is_packed(batch):
        last = head_values(model, **model_inputs(batch, model=model))[0, batch["cu_seqlens"][1:].long() - 1]
    else:
        last, _ = scalar_outputs(model, batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    n = last.shape[0] // 2
    return last[:n], last[n:]


def rm_batch_loss(model: nn.Module, batch: dict[str, Any], *, loss_type: str = "sigmoid",
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over the micro-batch's pairs of the pairwise loss, and metric sums (accuracy, rewards, margin)."""
    batch = to_device(batch, model_device(model))
    chosen, rejected = pair_rewards(model, batch)
    loss = reward_model_loss(chosen, rejected, loss=loss_type, margin=batch.get("margin"), reduction="sum")
    c, r = chosen.detach(), rejected.detach()
    return loss, {"accuracy": (c > r).float().sum(), "chosen_reward": c.sum(), "rejected_reward": r.sum(),
                  "reward_margin": (c - r).sum()}


def rm_method(cfg: RMConfig, tokenizer: Any, dist_info: DistInfo) -> OfflineMethod:
    pad_id = tokenizer.pad_token_id
    return OfflineMethod(name="rm", collate=lambda samples: collate_rm(samples, pad_id, cfg.packing_samples),
                         weight=lambda s: 1.0,
                         loss=lambda model, batch: rm_batch_loss(model, batch, loss_type=cfg.loss),
                         tokens=lambda s: len(s["chosen_ids"]) + len(s["rejected_ids"]))


def validate_rm(cfg: RMConfig) -> None:
    """Refuse what rm cannot do: a pairwise loss outside float32 (`pair_rewards` casts the head's values)."""
    if not cfg.compute_fp32_loss:
        raise ConfigError("--no-compute_fp32_loss: rlhfkit computes the reward-model loss in float32 always (the "
                          "head's values are cast before the pairwise loss); drop the flag")


def load_reward_model(cfg: TrainingConfig, dist_info: DistInfo) -> nn.Module:
    """The model with a ``score`` head: a reward-model checkpoint keeps its head, a causal LM gets a fresh one."""
    from rlhfkit.engine.fsdp import compute_dtype

    model = load_scalar_model(need(cfg.pretrain, "--pretrain"), attn_implementation=cfg.attn_implementation,
                              load_in_4bit=cfg.load_in_4bit,
                              compute_dtype=compute_dtype(cfg.param_dtype, dist_info.device))
    if cfg.packing_samples:  # packed rows attended sample by sample, no [L, L] mask (models/packed_attention.py)
        use_packed_attention(model)
    if cfg.lora_rank > 0:
        return apply_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.target_modules, cfg.lora_dropout)
    return model


@torch.no_grad()
def reward_statistics(model: nn.Module, samples: list[dict], pad_token_id: int, micro: int,
                      dist_info: DistInfo | None = None) -> tuple[float, float]:
    """Mean and (population) standard deviation of the rewards of every chosen and rejected sequence of
    ``samples``, sharded over the ranks (collective)."""
    device = model_device(model)

    def score(chunk: list[dict]) -> list[tuple[float, float]]:
        chosen, rejected = pair_rewards(model, to_device(collate_rm(chunk, pad_token_id), device))
        return list(zip(chosen.double().cpu().tolist(), rejected.double().cpu().tolist()))

    rewards = torch.tensor([r for pair in map_sharded(samples, micro, score, dist_info) for r in pair],
                           dtype=torch.float64)
    if rewards.numel() == 0:
        return 0.0, 1.0
    return float(rewards.mean()), float(rewards.std(unbiased=False))


class RewardNormalisation:
    """Stores the training samples (``extra_config`` hook, before training) and, after training, writes the trained
    model's reward mean/std on them into ``<save_path>/config.json``."""

    def __init__(self) -> None:
        self.train_samples: list[dict] = []
        self.stats: dict[str, float] = {}

    def remember(self, train_samples: list[dict]) -> dict[str, Any]:
        self.train_samples = train_samples
        return {}

    def after_training(self, cfg: RMConfig, engine: TrainEngine, tokenizer: Any, result: dict[str, Any]) -> None:
        engine.eval()
        mean, std = reward_statistics(engine.model, self.train_samples, tokenizer.pad_token_id,
                                      cfg.micro_train_batch_size, engine.dist)
        self.stats = {"reward_mean": mean, "reward_std": std if std > 0 else 1.0}
        result.update({f"train/{k}": v for k, v in self.stats.items()})
        if engine.dist.is_main:
            path = Path(cfg.save_path) / "config.json"
            if path.is_file():
                config = json.loads(path.read_text())
                config.update(self.stats)
                path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            else:  # a LoRA adapter folder has no config.json of its own
                path = Path(cfg.save_path) / "reward_normalization.json"
                path.write_text(json.dumps(self.stats, indent=2) + "\n")
            log.info("reward statistics of the training set written to %s: %s", path, self.stats)
        barrier()
