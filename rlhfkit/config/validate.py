"""Checks across flags: each error names the flags involved and what to do."""

from __future__ import annotations

import logging
from typing import TypeVar

from rlhfkit.config.commands import CommandConfig, OfflineConfig, SFTConfig
from rlhfkit.config.optim_options import validate_optim
from rlhfkit.config.options import TrainOptions
from rlhfkit.errors import ConfigError

T = TypeVar("T")
log = logging.getLogger(__name__)


def need(value: T | None, flag: str) -> T:
    """`value` of the optional `flag` where the run needs it (checked up front by `require` / the command's validate:
    this narrows the type and fails loudly if a path skipped that check)."""
    if value is None:
        raise ConfigError(f"{flag} is required here")
    return value


def require(cfg: CommandConfig, *names: str) -> None:
    """Raise when a required flag is unset; TypeError for a name that is not one of the command's flags."""
    values = vars(cfg)
    for name in names:
        if name not in type(cfg).flag_names():
            raise TypeError(f"require: 'rlhfkit {cfg.command}' has no flag --{name}")
        if values[name] in (None, ""):
            raise ConfigError(f"--{name} is required for 'rlhfkit {cfg.command}'")


def validate_batch_sizes(cfg: TrainOptions, world_size: int) -> int:
    """Return gradient accumulation steps = train_batch_size / (micro_train_batch_size * world_size)."""
    per_step = cfg.micro_train_batch_size * world_size
    if cfg.micro_train_batch_size < 1 or cfg.train_batch_size < 1:
        raise ConfigError("--train_batch_size and --micro_train_batch_size must be positive")
    if cfg.train_batch_size % per_step:
        raise ConfigError(
            f"--train_batch_size {cfg.train_batch_size} is not a multiple of --micro_train_batch_size "
            f"{cfg.micro_train_batch_size} x world size {world_size} = {per_step}; "
            f"pick a train_batch_size divisible by {per_step}")
    return cfg.train_batch_size // per_step


def check_loader_workers(cfg: TrainOptions) -> None:
    """--dataloader_num_workers (OpenRLHF's --data.dataloader_num_workers): accepted so that launch scripts port,
    said to change nothing when it is not 0 (rlhfkit tokenizes the data up front in the training process and cuts
    batches from those tensors: no loader workers), refused when negative. Every training command calls it."""
    if cfg.dataloader_num_workers < 0:
        raise ConfigError(f"--dataloader_num_workers {cfg.dataloader_num_workers} must be >= 0")
    if cfg.dataloader_num_workers:
        log.info("--dataloader_num_workers %d changes nothing: rlhfkit tokenizes the data once, up front, in the "
                 "training process and cuts batches from those tensors (there are no loader workers)",
                 cfg.dataloader_num_workers)


def validate_common(cfg: OfflineConfig) -> None:
    """Contradictions every training command shares."""
    check_loader_workers(cfg)
    if cfg.dataset_probs and cfg.dataset:
        n_data, n_probs = len(cfg.dataset.split(",")), len(str(cfg.dataset_probs).split(","))
        if n_data != n_probs:
            raise ConfigError(f"--dataset has {n_data} entries but --dataset_probs has {n_probs}; give one each")
    if isinstance(cfg, SFTConfig) and cfg.multiturn and cfg.pretrain_mode:  # only sft has --multiturn
        raise ConfigError("--multiturn and --pretrain_mode contradict: pretrain_mode trains on all tokens already")
    if cfg.load_checkpoint and cfg.save_steps == -1 and not cfg.ckpt_path:
        raise ConfigError("--load_checkpoint needs --ckpt_path")
    if not 0.0 <= cfg.lr_warmup_ratio <= 1.0:
        raise ConfigError(f"--lr_warmup_ratio {cfg.lr_warmup_ratio} must lie in [0, 1]")
    validate_optim(cfg)
    if cfg.lora_rank < 0:
        raise ConfigError("--lora_rank must be >= 0")
    if cfg.load_in_4bit and cfg.lora_rank <= 0:
        raise ConfigError("--load_in_4bit needs --lora_rank > 0: 4-bit base weights cannot be trained, only LoRA "
                          "adapters on them (QLoRA)")
