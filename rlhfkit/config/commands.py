"""One static, typed configuration class per command (#12): what `parse_config` returns.

Each class inherits the command's option groups (`rlhfkit.config.*_options`) in the order the command lists them,
so a flag declared in several groups takes its type, default and help from the FIRST group that declares it (a
command's own group first: `RMOptions.learning_rate` 9e-6 over `TrainOptions.learning_rate` 5e-6), exactly as the
parser (`rlhfkit.config.parse.build_parser`, the same `GROUPS`) and the generated docs do.
`tests/config/test_commands.py` checks every class against that rule, field by field.

Because a command's class IS an instance of each of its groups, a consumer can ask for only the group it reads
(`def f(cfg: TrainOptions)` accepts `SFTConfig` and `PPOConfig`), and mypy follows every `cfg.flag` read:

- `TrainingConfig`: what every training command shares (model, engine, checkpoints, logging): the engine's helpers.
- `OfflineConfig`: `TrainingConfig` + `DataOptions`: the shared loop of sft, rm, dpo, kto, kd and prm.
- one class per command: `SFTConfig`, `RMConfig`, `DPOConfig`, `KTOConfig`, `KDConfig`, `PRMConfig`, `PPOConfig`,
  `BatchInferenceConfig`, `ServeRMConfig`; `CONFIG_CLASSES` maps the command name to it.

Besides the flags (dataclass fields), an instance carries `command` (class constant), `argv` (the arguments it was
parsed from) and `precision` (set by `rlhfkit.engine.precision.apply_precision`); none of them is a flag, so
`config_to_dict` leaves them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol

from rlhfkit.config.inference_options import InferenceDataOptions, InferenceModelOptions, InferenceOptions
from rlhfkit.config.method_options import DPOOptions, KDOptions, KTOOptions, PRMOptions, RMOptions
from rlhfkit.config.optim_options import RoleOptimOptions
from rlhfkit.config.options import (
    CheckpointOptions,
    DataOptions,
    LoggingOptions,
    ModelOptions,
    RemoteRewardOptions,
    SFTOptions,
    TrainOptions,
)
from rlhfkit.config.rl_options import (
    PlacementOptions,
    PromptDataOptions,
    RewardOptions,
    RLAlgorithmOptions,
    RolloutOptions,
    VisionOptions,
)
from rlhfkit.config.serve_options import ServeRMOptions


class PrecisionRecord(Protocol):
    """What `apply_precision` keeps on the config (`rlhfkit.engine.precision.Precision`)."""

    @property
    def device(self) -> str: ...

    def ceiling_gflops(self) -> float | None: ...

    def as_dict(self) -> dict[str, Any]: ...

    def summary(self) -> str: ...


class CommandConfig:
    """The non-flag attributes every command's config has. Not a dataclass: nothing here is a flag."""

    command: ClassVar[str] = ""
    GROUPS: ClassVar[tuple[type, ...]] = ()   # the option groups, in the command's order (parser, docs, precedence)
    argv: Sequence[str] = ()                  # the arguments parse_config read (after dialect rewriting)
    precision: PrecisionRecord | None = None  # set by rlhfkit.engine.precision.apply_precision

    @classmethod
    def flag_names(cls) -> list[str]:
        """Every flag of the command, in --help order (group by group, first declaration wins)."""
        names: dict[str, None] = {}
        for group in cls.GROUPS:
            names.update(dict.fromkeys(f.name for f in fields(group)))
        return list(names)


_COMMON_TRAIN = (ModelOptions, DataOptions, TrainOptions, CheckpointOptions, LoggingOptions)


@dataclass
class TrainingConfig(ModelOptions, TrainOptions, CheckpointOptions, LoggingOptions, CommandConfig):
    """The groups every training command (sft, rm, dpo, kto, kd, prm, ppo) has."""


@dataclass
class OfflineConfig(DataOptions, TrainingConfig):
    """The groups of the offline training commands (sft, rm, dpo, kto, kd, prm): the shared loop reads these."""


@dataclass
class SFTConfig(SFTOptions, OfflineConfig):
    command: ClassVar[str] = "sft"
    GROUPS: ClassVar[tuple[type, ...]] = (SFTOptions, *_COMMON_TRAIN)


@dataclass
class RMConfig(RMOptions, OfflineConfig):
    command: ClassVar[str] = "rm"
    GROUPS: ClassVar[tuple[type, ...]] = (RMOptions, *_COMMON_TRAIN)


@dataclass
class DPOConfig(DPOOptions, OfflineConfig):
    command: ClassVar[str] = "dpo"
    GROUPS: ClassVar[tuple[type, ...]] = (DPOOptions, *_COMMON_TRAIN)


@dataclass
class KTOConfig(KTOOptions, OfflineConfig):
    command: ClassVar[str] = "kto"
    GROUPS: ClassVar[tuple[type, ...]] = (KTOOptions, *_COMMON_TRAIN)


@dataclass
class KDConfig(KDOptions, OfflineConfig):
    command: ClassVar[str] = "kd"
    GROUPS: ClassVar[tuple[type, ...]] = (KDOptions, *_COMMON_TRAIN)


@dataclass
class PRMConfig(PRMOptions, OfflineConfig):
    command: ClassVar[str] = "prm"
    GROUPS: ClassVar[tuple[type, ...]] = (PRMOptions, *_COMMON_TRAIN)


@dataclass
class PPOConfig(PlacementOptions, RolloutOptions, RLAlgorithmOptions, RewardOptions, RemoteRewardOptions,
                PromptDataOptions, VisionOptions, RoleOptimOptions, TrainingConfig):
    command: ClassVar[str] = "ppo"
    GROUPS: ClassVar[tuple[type, ...]] = (
        PlacementOptions, RolloutOptions, RLAlgorithmOptions, RewardOptions, RemoteRewardOptions, PromptDataOptions,
        VisionOptions, ModelOptions, TrainOptions, RoleOptimOptions, CheckpointOptions, LoggingOptions)


@dataclass
class BatchInferenceConfig(InferenceModelOptions, InferenceDataOptions, InferenceOptions, RemoteRewardOptions,
                           CommandConfig):
    command: ClassVar[str] = "batch-inference"
    GROUPS: ClassVar[tuple[type, ...]] = (InferenceModelOptions, InferenceDataOptions, InferenceOptions,
                                          RemoteRewardOptions)


@dataclass
class ServeRMConfig(ServeRMOptions, CommandConfig):
    command: ClassVar[str] = "serve-rm"
    GROUPS: ClassVar[tuple[type, ...]] = (ServeRMOptions,)


CONFIG_CLASSES: dict[str, type[CommandConfig]] = {
    cls.command: cls for cls in (SFTConfig, RMConfig, DPOConfig, KTOConfig, KDConfig, PRMConfig, PPOConfig,
                                 BatchInferenceConfig, ServeRMConfig)}
