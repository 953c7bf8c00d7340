"""Typed option groups -> one argparse parser -> the command's typed config.

Every command declares its option groups (dataclasses in `options.py`). Their fields become `--flags`
(OpenRLHF's names), `--config run.yaml` sets any of them, and `validate` checks contradictions.
The result is an instance of the command's static class (`rlhfkit.config.commands`: `SFTConfig`, `PPOConfig`, ...),
flat, so code reads `cfg.pretrain` as OpenRLHF reads `args.pretrain`, and typed, so mypy checks that read.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast, overload

import yaml

import rlhfkit.config.dialect as dialect
from rlhfkit.config.commands import CONFIG_CLASSES, CommandConfig
from rlhfkit.errors import ConfigError

# DeepSpeed internals that have no meaning under FSDP2: rejected with a reason instead of silently ignored.
REJECTED_FLAGS: dict[str, str] = {
    "zpg": "ZeRO++ partition groups are DeepSpeed-only; FSDP2 shards over the whole data-parallel group",
    "overlap_comm": "FSDP2 always overlaps communication with compute; drop the flag",
    "use_ds_universal_ckpt": "rlhfkit checkpoints are torch.distributed.checkpoint folders, already reshardable",
    "local_rank": "torchrun and Ray set LOCAL_RANK in the environment; drop the flag",
    "deepcompile": "DeepSpeed's compiler is not used; drop the flag",
    "disable_ds_ckpt": "there is no DeepSpeed checkpoint; use --save_steps -1 to skip full-state checkpoints",
    "use_ms": "ModelScope downloads are not supported; pass a local folder or a hub name",
    "use_liger_kernel": "Liger kernels are not integrated; drop the flag",
    "grad_accum_dtype": "gradients accumulate in the parameter dtype (fp32 master weights); drop the flag",
    "max_ckpt_mem": "use --max_ckpt_num to bound checkpoint count",
}

# A command's own reason for a flag of REJECTED_FLAGS whose general reason names a flag that command does not have
# (--fsdp_enable_offload is ppo's; batch-inference trains nothing and saves no checkpoint). command -> flag -> reason.
_OFFLINE_SLEEP = ("only ppo has phases (generation, then training) to put trainer state to sleep between; to keep "
                  "parameters, gradients and optimizer state in host RAM use --adam_offload")
_NO_CHECKPOINTS = "batch-inference trains nothing and writes no checkpoint; drop the flag"
REJECTED_FLAG_REASONS: dict[str, dict[str, str]] = {
    "batch-inference": {"disable_ds_ckpt": _NO_CHECKPOINTS, "max_ckpt_mem": _NO_CHECKPOINTS},
    "serve-rm": {flag: _NO_CHECKPOINTS.replace("batch-inference", "serve-rm")
                 for flag in ("disable_ds_ckpt", "max_ckpt_mem")},
}
# --deepspeed_enable_sleep: ppo maps it to --fsdp_enable_offload (rlhfkit.config.dialect); the others refuse it.
_SLEEP_REFUSED: dict[str, str] = {
    **{command: _OFFLINE_SLEEP for command in ("sft", "rm", "dpo", "kto", "kd", "prm")},
    "batch-inference": "batch-inference trains nothing: there is no trainer state to put to sleep; drop the flag "
                       "(the engines free their memory when the command ends)",
}


def rejection_reason(name: str, command: str = "") -> str | None:
    """Why `rlhfkit command` refuses --name (a DeepSpeed flag, or one of COMMAND_REJECTED_FLAGS); None if it
    does not."""
    if name in REJECTED_FLAGS:
        return REJECTED_FLAG_REASONS.get(command, {}).get(name, REJECTED_FLAGS[name])
    return COMMAND_REJECTED_FLAGS.get(command, {}).get(name)

_RING_FLAGS = ("ring_attn_size", "ring_head_stride")
_TP_FLAGS = ("ds_tensor_parallel_size", "tp_size")
_NO_TP = ("tensor parallel training is implemented for sft, rm, dpo and kto, not for {command}: {why}; drop the flag "
          "(data parallelism with FSDP2 shards the weights over the ranks)")
_NO_TP_WHY = {"ppo": "the actor, critic and reference Ray workers build no tensor-parallel mesh and the weight sync "
                     "to vLLM expects whole tensors",
              "kd": "the teacher is a second model not checked against the tensor-parallel plan",
              "prm": "the process reward path has not been verified under tensor parallelism"}
_NO_RING_WHY = {"prm": "the step placeholders"}
_NO_RING = ("context parallel (ring attention) is implemented for sft, rm, dpo, kto, kd and ppo, not for {command}: "
            "{why}; drop the flag and fit each sequence on one rank (e.g. with --gradient_checkpointing)")

_PAIR_KEYS = ("{command} reads chosen/rejected pairs, not input/output rows (OpenRLHF's train_{command} has no such "
              "flag): name the row keys with --prompt_key, --chosen_key and --rejected_key")

# Flags a command's shared option groups declare but that command does not act on: refused when given (on the
# command line or in --config) instead of silently ignored. command -> flag -> reason.
COMMAND_REJECTED_FLAGS: dict[str, dict[str, str]] = {
    "ppo": {
        "learning_rate": "ppo trains two models: use --actor_learning_rate and --critic_learning_rate",
        "logging_steps": dialect.PPO_LOGGING,
        "full_determinism": "not implemented for the Ray workers of ppo; drop the flag (runs are seeded by --seed)",
    },
    **{command: {"deepspeed_enable_sleep": reason} for command, reason in _SLEEP_REFUSED.items()
       if command not in _NO_RING_WHY},
    **{command: {"deepspeed_enable_sleep": _SLEEP_REFUSED[command],
                 **{flag: _NO_RING.format(command=command, why=f"{what} read full-vocabulary logits at every position, "
                                          "which the context-parallel path does not gather (docs/parallelism.md)")
                    for flag in _RING_FLAGS}}
       for command, what in _NO_RING_WHY.items()},
}
for _command, _why in _NO_TP_WHY.items():
    COMMAND_REJECTED_FLAGS.setdefault(_command, {}).update(
        {flag: _NO_TP.format(command=_command, why=_why) for flag in _TP_FLAGS})
COMMAND_REJECTED_FLAGS["batch-inference"]["ds_tensor_parallel_size"] = (
    "batch-inference trains nothing; the tensor parallelism of its vLLM engines is --tp_size")
COMMAND_REJECTED_FLAGS["serve-rm"] = {
    "load_in_4bit": "4-bit loading is not supported; serve the model in bf16/fp16/fp32",
    "packing_samples": "serve-rm scores padded micro-batches; drop the flag",
}
for _command in ("rm", "dpo"):
    COMMAND_REJECTED_FLAGS[_command].update({flag: _PAIR_KEYS.format(command=_command)
                                             for flag in ("input_key", "output_key")})


def _flag_type(tp: Any) -> tuple[Any, str | None]:
    """Return (scalar type, nargs) for a field annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _flag_type(args[0])
    if origin in (list, tuple):
        inner = typing.get_args(tp)[0]
        return inner, "+"
    return tp, None


def _resolve_hints(groups: list[type]) -> dict[str, Any]:
    hints: dict[str, Any] = {}
    for group in groups:
        hints.update(typing.get_type_hints(group))
    return hints


def build_parser(command: str, groups: list[type], description: str = "") -> argparse.ArgumentParser:
    """One parser from the option groups; each group is an argparse argument group named after its docstring. A flag
    takes the command's default, help and choices from the command's class (rlhfkit.config.commands, which applies
    COMMAND_DEFAULTS and the fields' `command_help`), its type from its group."""
    parser = argparse.ArgumentParser(allow_abbrev=False, prog=f"rlhfkit {command}", description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", type=str, default=None, help="YAML file of flag: value pairs (CLI flags win)")
    seen: set[str] = set()
    hints = _resolve_hints(groups)
    cls = CONFIG_CLASSES.get(command)
    own = {f.name: f for f in dataclasses.fields(cls)} if cls is not None else {}  # type: ignore[arg-type]
    for group in groups:
        title = (group.__doc__ or group.__name__).strip().splitlines()[0]
        arg_group = parser.add_argument_group(title)
        for f in dataclasses.fields(group):
            if f.name in seen:
                raise TypeError(f"--{f.name} is declared in two option groups of 'rlhfkit {command}': declare each "
                                "flag once (per-command defaults: rlhfkit.config.commands.COMMAND_DEFAULTS)")
            seen.add(f.name)
            _add_field(arg_group, own.get(f.name, f), hints[f.name])  # the command's default, help and choices
    return parser


def _add_field(arg_group: Any, f: dataclasses.Field, tp: Any) -> None:
    help_text = f.metadata.get("help", "")
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        raise TypeError(f"option --{f.name} has no default: declare it with opt(default, help)")
    scalar, nargs = _flag_type(tp)
    flag = f"--{f.name}"
    if scalar is bool:
        arg_group.add_argument(flag, *f.metadata.get("aliases", ()), action=argparse.BooleanOptionalAction,
                               default=default, help=help_text)
        return
    kwargs: dict[str, Any] = {"type": scalar, "default": default, "help": help_text}
    if nargs:
        kwargs["nargs"] = nargs
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
    arg_group.add_argument(flag, *f.metadata.get("aliases", ()), **kwargs)


_Groups = Sequence[type] | None
_Argv = Sequence[str] | None


def make_config_class(command: str, groups: _Groups = None) -> type[CommandConfig]:
    """The static config class of `command` (rlhfkit.config.commands); TypeError when `groups` (None: the class's
    own) are not its groups (a command's flags and their precedence are declared once, there)."""
    cls = CONFIG_CLASSES.get(command)
    if cls is None:
        raise TypeError(f"no config class for command {command!r}: add one to rlhfkit.config.commands")
    if groups is not None and tuple(groups) != cls.GROUPS:
        raise TypeError(f"{command}: option groups {[g.__name__ for g in groups]} differ from "
                        f"{cls.__name__}.GROUPS {[g.__name__ for g in cls.GROUPS]}")
    return cls


def _load_yaml(path: str, parser: argparse.ArgumentParser, command: str = "") -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: no such file")
    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag: value, got {type(data).__name__}")
    known = {a.dest for a in parser._actions}
    aliases = {o[2:]: a.dest for a in parser._actions for o in a.option_strings if o.startswith("--")}
    out = {}
    data = dialect.rewrite_mapping(command, data, parser, lambda name: rejection_reason(name, command),
                                   f"--config {path}")  # OpenRLHF's names (nested or dotted) -> rlhfkit's
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        _reject_if_deepspeed(name, source=f"--config {path}", command=command)
        name = aliases.get(name, name)  # --tp_size -> ds_tensor_parallel_size
        if name not in known:
            raise ConfigError(f"--config {path}: unknown key '{key}'; run with --help for the flags it takes.")
        out[name] = value
    return out


def _reject_if_deepspeed(name: str, source: str, command: str = "") -> None:
    if name in REJECTED_FLAGS:
        raise ConfigError(f"{source}: --{name} is not supported: {rejection_reason(name, command)}")
    reason = COMMAND_REJECTED_FLAGS.get(command, {}).get(name)
    if reason:
        raise ConfigError(f"{source}: --{name} is not supported by 'rlhfkit {command}': {reason}")


_Config = TypeVar("_Config", bound=CommandConfig)


@overload
def parse_config(command: type[_Config], groups: _Groups = None, argv: _Argv = None,
                 description: str = "") -> _Config: ...
@overload
def parse_config(command: str, groups: _Groups = None, argv: _Argv = None,
                 description: str = "") -> CommandConfig: ...


def parse_config(command: type[_Config] | str, groups: _Groups = None, argv: _Argv = None,
                 description: str = "") -> _Config | CommandConfig:
    """Parse argv (and --config YAML) into the command's typed config: `command` is its class (rlhfkit.config.commands;
    the result is typed as that class) or its name (CONFIG_CLASSES; typed CommandConfig); `groups`: None or that
    class's GROUPS. ConfigError on unknown/rejected flags."""
    cls = make_config_class(command if isinstance(command, str) else command.command, groups)
    name = cls.command
    parser = build_parser(name, list(cls.GROUPS), description)
    args = dialect.rewrite_argv(name, list(sys.argv[1:] if argv is None else argv), parser,
                                lambda flag: rejection_reason(flag, name))
    for token in args:
        if token.startswith("--"):
            _reject_if_deepspeed(token[2:].split("=")[0], source="command line", command=name)
    pre, _ = parser.parse_known_args(args)
    if pre.config:
        values = _load_yaml(pre.config, parser, name)
        for flag in values:
            _reject_if_deepspeed(flag, source=f"--config {pre.config}", command=name)
        parser.set_defaults(**values)
    ns, unknown = parser.parse_known_args(args)
    if unknown:
        raise ConfigError(f"unknown flag(s) for 'rlhfkit {name}': {' '.join(unknown)}. "
                          f"Run 'rlhfkit {name} --help' for the list.")
    values = vars(ns)
    values.pop("config")
    cfg = cast(Callable[..., CommandConfig], cls)(**values)  # a dataclass of exactly these fields
    cfg.argv = args
    return cfg


def config_to_dict(cfg: object) -> dict[str, Any]:
    """The resolved flags as a plain dict (for manifests and checkpoints), in --help order for a command's config;
    any other dataclass (an option group): its fields."""
    if isinstance(cfg, CommandConfig):
        return {name: vars(cfg)[name] for name in cfg.flag_names()}
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"config_to_dict takes a config dataclass, not {type(cfg).__name__}")
    return {f.name: vars(cfg)[f.name] for f in dataclasses.fields(cfg)}


def flags_to_argv(flags: dict[str, Any]) -> list[str]:
    """{"pretrain": "m", "apply_chat_template": True, "adam_betas": [0.9, 0.95]} -> CLI arguments.

    True gives a bare switch; False and None are left out; lists become several values.
    """
    argv: list[str] = []
    for key, value in flags.items():
        if value is True:
            argv.append(f"--{key}")
        elif isinstance(value, (list, tuple)):
            argv += [f"--{key}", *map(str, value)]
        elif value is not None and value is not False:
            argv += [f"--{key}", str(value)]
    return argv
