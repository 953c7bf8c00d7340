"""One static, typed configuration class per command (#12): what `parse_config` returns.

A command's class is declared once: its bases ARE its option groups (`rlhfkit.config.*_options`), in --help order,
then `CommandConfig`; `command_class` derives `GROUPS` from them, so the dataclass, the parser
(`rlhfkit.config.parse.build_parser`) and the generated docs read the one list. Every flag is declared in exactly ONE
group, with one type, one default and one help: where commands share flags they share a small group (the vLLM engines
and sampling of ppo and batch-inference, the reward sources of ppo, batch-inference and serve-rm, the preference keys
of rm and dpo, the reference model of dpo, kto and ppo, ...). A command whose default differs is named in ONE table,
`COMMAND_DEFAULTS` (rm: --learning_rate 9e-6 where the group says 5e-6); a command for which the flag means something
else has its own help in the field's `command_help` (and narrower choices in `command_choices`). `command_class`
applies both when the class is created. `tests/config/test_commands.py` checks that no flag is declared twice and
every class against its groups and the table, field by field.

Because a command's class IS an instance of each of its groups, a consumer can ask for only the group it reads
(`def f(cfg: TrainOptions)` accepts `SFTConfig` and `PPOConfig`), and mypy follows every `cfg.flag` read:

- one class per command: `SFTConfig`, `RMConfig`, `DPOConfig`, `KTOConfig`, `KDConfig`, `PRMConfig`, `PPOConfig`,
  `BatchInferenceConfig`, `ServeRMConfig`; `CONFIG_CLASSES` maps the command name to it.
- `OfflineConfig`: the union of the offline training commands' classes (sft, rm, dpo, kto, kd, prm): their shared
  loop reads it; `TrainingConfig`: that and `PPOConfig`, every training command (model, engine, checkpoints,
  logging). mypy checks a read against every member.

Besides the flags (dataclass fields), an instance carries `command` (class constant), `argv` (the arguments it was
parsed from) and `precision` (set by `rlhfkit.engine.precision.apply_precision`); none of them is a flag, so
`config_to_dict` leaves them out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Protocol, TypeAlias, TypeVar, get_type_hints

from rlhfkit.config.engine_options import RayOptions, SamplingOptions, VLLMEngineOptions
from rlhfkit.config.inference_options import InferenceOptions
from rlhfkit.config.method_options import (
    DPOOptions,
    KDOptions,
    KTOOptions,
    PreferenceKeyOptions,
    PRMOptions,
    ReferenceLogpOptions,
    RefPretrainOptions,
    RMOptions,
    TeacherModelOptions,
)
from rlhfkit.config.optim_options import ActorOptimOptions, CriticOptimOptions
from rlhfkit.config.options import (
    AttentionOptions,
    CheckpointOptions,
    DataOptions,
    EvalDataOptions,
    InputOptions,
    LabelKeyOptions,
    LoggingOptions,
    MaxLenOptions,
    ModelLoadOptions,
    ModelOptions,
    PretrainModeOptions,
    PretrainOptions,
    RemoteRewardOptions,
    SeedOptions,
    SFTOptions,
    TrainOptions,
)
from rlhfkit.config.reward_options import RewardCombineOptions, RewardSourceOptions, ValueHeadOptions
from rlhfkit.config.rl_options import (
    AdvantageOptions,
    AsyncOptions,
    DynamicBatchOptions,
    EMAOptions,
    ISCorrectionOptions,
    KLOptions,
    PlacementOptions,
    PolicyLossOptions,
    PromptDataOptions,
    RewardOptions,
    RolloutOptions,
    RunModeOptions,
    VisionOptions,
)
from rlhfkit.config.serve_options import ServeRMOptions

_TEMPLATE = "User: {}\nAssistant: "

# Each command's defaults that differ from the one declaration of the flag (its option group's default); nothing
# else sets a per-command default. `command_class` applies the table when the command's class is created, and
# tests/config/test_commands.py checks that every entry names a flag of the command, with a value of its type,
# different from the group's default.
COMMAND_DEFAULTS: dict[str, dict[str, Any]] = {
    "sft": {"max_epochs": 2, "input_template": _TEMPLATE},
    "rm": {"learning_rate": 9e-6, "micro_train_batch_size": 1, "max_len": 512},
    "dpo": {"learning_rate": 1e-5, "max_len": 512},
    "kto": {"learning_rate": 1e-5, "beta": 0.01, "label_key": "label", "input_template": _TEMPLATE},
    "kd": {"output_key": "output", "input_template": _TEMPLATE},
    "prm": {"learning_rate": 1e-6, "micro_train_batch_size": 1, "label_key": "label"},
    "ppo": {"micro_train_batch_size": 4, "max_samples": 100_000_000, "max_len": 0},
    "batch-inference": {"seed": 1234, "max_samples": 100_000_000, "output_key": "output", "rollout_batch_size": 2048},
    "serve-rm": {"param_dtype": "fp32"},
}


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
        """Every flag of the command, in --help order (group by group; each flag is declared in one group)."""
        return [f.name for group in cls.GROUPS for f in fields(group)]


_C = TypeVar("_C", bound=type)


def command_field(command: str, f: Field, default: Any = MISSING) -> Field:
    """`f` (a group's field) as `command` has it: `default` (COMMAND_DEFAULTS; MISSING: the group's), the field's
    `command_help` / `command_choices` entry for the command as its help / choices, the rest of its metadata."""
    metadata = dict(f.metadata)
    metadata["help"] = metadata.get("command_help", {}).get(command, metadata.get("help", ""))
    if command in metadata.get("command_choices", {}):
        metadata["choices"] = metadata["command_choices"][command]
    if default is MISSING:
        if f.default_factory is not MISSING:
            return field(default_factory=f.default_factory, metadata=metadata)  # type: ignore[arg-type]
        return field(default=f.default, metadata=metadata)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)  # type: ignore[arg-type,return-value]
    return field(default=default, metadata=metadata)


def _is_own(command: str, f: Field) -> bool:
    return any(command in f.metadata.get(key, {}) for key in ("command_help", "command_choices"))


def command_class(command: str) -> Callable[[_C], _C]:
    """Class decorator (under @dataclass) of a command's config class, whose bases ARE its option groups, in --help
    order (then CommandConfig): the one declaration the dataclass, the parser and the docs read. Sets `command` and
    `GROUPS` (those bases) and re-declares, with the group's type, each field whose default COMMAND_DEFAULTS[command]
    sets or whose help / choices the field gives per command. mypy sees the group's declaration."""

    def decorate(cls: _C) -> _C:
        groups = tuple(base for base in cls.__bases__ if base is not CommandConfig)
        if CommandConfig not in cls.__bases__ or not all(is_dataclass(g) for g in groups):
            raise TypeError(f"{cls.__name__}: the bases of a command's class are its option groups, then "
                            "CommandConfig")
        cls.command = command  # type: ignore[attr-defined]
        cls.GROUPS = groups  # type: ignore[attr-defined]
        defaults = COMMAND_DEFAULTS.get(command, {})
        annotations = cls.__dict__.get("__annotations__", {})
        cls.__annotations__ = annotations
        done: set[str] = set()
        for group in groups:
            hints = get_type_hints(group)
            for f in fields(group):
                if f.name in defaults or _is_own(command, f):
                    annotations[f.name] = hints[f.name]
                    setattr(cls, f.name, command_field(command, f, defaults.get(f.name, MISSING)))
                    done.add(f.name)
        if set(defaults) - done:
            raise TypeError(f"COMMAND_DEFAULTS[{command!r}] names flags {sorted(set(defaults) - done)} that "
                            f"'rlhfkit {command}' does not have")
        return cls

    return decorate


# Each class's bases are its option groups in --help order, then CommandConfig; nothing else lists them.
@dataclass
@command_class("sft")
class SFTConfig(SFTOptions, PretrainModeOptions, PretrainOptions, SeedOptions, ModelLoadOptions, AttentionOptions,
                ModelOptions, DataOptions, InputOptions, MaxLenOptions, EvalDataOptions, TrainOptions,
                CheckpointOptions, LoggingOptions, CommandConfig):
    """rlhfkit sft"""


@dataclass
@command_class("rm")
class RMConfig(RMOptions, PreferenceKeyOptions, ValueHeadOptions, PretrainOptions, SeedOptions, ModelLoadOptions,
               AttentionOptions, ModelOptions, DataOptions, InputOptions, MaxLenOptions, EvalDataOptions, TrainOptions,
               CheckpointOptions, LoggingOptions, CommandConfig):
    """rlhfkit rm"""


@dataclass
@command_class("dpo")
class DPOConfig(DPOOptions, ReferenceLogpOptions, RefPretrainOptions, PreferenceKeyOptions, PretrainOptions,
                SeedOptions, ModelLoadOptions, AttentionOptions, ModelOptions, DataOptions, InputOptions,
                MaxLenOptions, EvalDataOptions, TrainOptions, CheckpointOptions, LoggingOptions, CommandConfig):
    """rlhfkit dpo"""


@dataclass
@command_class("kto")
class KTOConfig(KTOOptions, ReferenceLogpOptions, RefPretrainOptions, LabelKeyOptions, PretrainOptions, SeedOptions,
                ModelLoadOptions, AttentionOptions, ModelOptions, DataOptions, InputOptions, MaxLenOptions,
                EvalDataOptions, TrainOptions, CheckpointOptions, LoggingOptions, CommandConfig):
    """rlhfkit kto"""


@dataclass
@command_class("kd")
class KDConfig(TeacherModelOptions, KDOptions, PretrainModeOptions, PretrainOptions, SeedOptions, ModelLoadOptions,
               AttentionOptions, ModelOptions, DataOptions, InputOptions, MaxLenOptions, EvalDataOptions,
               TrainOptions, CheckpointOptions, LoggingOptions, CommandConfig):
    """rlhfkit kd"""


@dataclass
@command_class("prm")
class PRMConfig(PRMOptions, LabelKeyOptions, PretrainOptions, SeedOptions, ModelLoadOptions, AttentionOptions,
                ModelOptions, DataOptions, InputOptions, MaxLenOptions, EvalDataOptions, TrainOptions,
                CheckpointOptions, LoggingOptions, CommandConfig):
    """rlhfkit prm"""


@dataclass
@command_class("ppo")
class PPOConfig(PlacementOptions, RayOptions, RolloutOptions, VLLMEngineOptions, SamplingOptions, AdvantageOptions,
                PolicyLossOptions, KLOptions, ISCorrectionOptions, DynamicBatchOptions, AsyncOptions, EMAOptions,
                RunModeOptions, RewardOptions, RewardSourceOptions, RewardCombineOptions, ValueHeadOptions,
                RefPretrainOptions, TeacherModelOptions, RemoteRewardOptions, PromptDataOptions, InputOptions,
                MaxLenOptions, LabelKeyOptions, EvalDataOptions, VisionOptions, PretrainOptions, SeedOptions,
                ModelLoadOptions, AttentionOptions, ModelOptions, TrainOptions, ActorOptimOptions, CriticOptimOptions,
                CheckpointOptions, LoggingOptions, CommandConfig):
    """rlhfkit ppo"""


@dataclass
@command_class("batch-inference")
class BatchInferenceConfig(PretrainOptions, SeedOptions, ModelLoadOptions, DataOptions, InputOptions,
                           LabelKeyOptions, MaxLenOptions, InferenceOptions, SamplingOptions, RewardSourceOptions,
                           VLLMEngineOptions, RayOptions, RemoteRewardOptions, CommandConfig):
    """rlhfkit batch-inference"""


@dataclass
@command_class("serve-rm")
class ServeRMConfig(ServeRMOptions, RewardSourceOptions, RewardCombineOptions, ModelLoadOptions, AttentionOptions,
                    MaxLenOptions, ValueHeadOptions, CommandConfig):
    """rlhfkit serve-rm"""


# What the offline training commands share (their loop reads these), and every training command: unions of the
# command classes, so a consumer typed with one accepts each member and mypy checks each read against all of them.
OfflineConfig: TypeAlias = SFTConfig | RMConfig | DPOConfig | KTOConfig | KDConfig | PRMConfig
TrainingConfig: TypeAlias = OfflineConfig | PPOConfig

CONFIG_CLASSES: dict[str, type[CommandConfig]] = {
    cls.command: cls for cls in (SFTConfig, RMConfig, DPOConfig, KTOConfig, KDConfig, PRMConfig, PPOConfig,
                                 BatchInferenceConfig, ServeRMConfig)}
