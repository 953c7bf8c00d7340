"""The static per-command config classes (rlhfkit.config.commands, #12): every flag is declared in exactly one option
group, and a command's class has exactly its groups' fields, each with the group's type and default unless
COMMAND_DEFAULTS names the flag for that command (then that value), and the group's help unless the field gives the
command its own (`command_help`). The parser (build_parser) and the docs read the class, so they follow."""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from collections import defaultdict

import pytest

from rlhfkit.config.commands import (
    COMMAND_DEFAULTS,
    CONFIG_CLASSES,
    CommandConfig,
    OfflineConfig,
    PPOConfig,
    SFTConfig,
    TrainingConfig,
    command_class,
)
from rlhfkit.config.optim_options import ROLE_SETTINGS, ActorOptimOptions, CriticOptimOptions
from rlhfkit.config.options import TrainOptions
from rlhfkit.config.parse import build_parser, config_to_dict, make_config_class, parse_config
from tools.gen_docs import module_name

ALL_GROUPS = sorted({g for cls in CONFIG_CLASSES.values() for g in cls.GROUPS}, key=lambda g: g.__name__)


def default_of(f: dataclasses.Field) -> typing.Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def test_every_flag_is_declared_in_exactly_one_option_group():
    declared: dict[str, list[str]] = defaultdict(list)
    for group in ALL_GROUPS:
        for f in dataclasses.fields(group):
            declared[f.name].append(group.__name__)
    twice = {name: groups for name, groups in declared.items() if len(groups) > 1}
    assert not twice, f"flags declared in several groups: {twice}"
    assert all(not dataclasses.is_dataclass(base) for group in ALL_GROUPS for base in group.__mro__[1:])


@pytest.mark.parametrize("command", sorted(CONFIG_CLASSES))
def test_each_command_class_has_its_groups_fields_with_the_group_default_unless_the_table_overrides(command):
    cls = CONFIG_CLASSES[command]
    groups = importlib.import_module(module_name(command)).GROUPS
    assert tuple(groups) == cls.GROUPS and make_config_class(command, groups) is cls
    overrides = COMMAND_DEFAULTS.get(command, {})
    hints = typing.get_type_hints(cls)
    got = {f.name: f for f in dataclasses.fields(cls)}
    want = [f.name for group in cls.GROUPS for f in dataclasses.fields(group)]
    assert set(got) == set(want) and len(want) == len(set(want))
    for group in cls.GROUPS:
        group_hints = typing.get_type_hints(group)
        for ref in dataclasses.fields(group):
            mine = got[ref.name]
            assert hints[ref.name] == group_hints[ref.name], ref.name
            assert default_of(mine) == overrides.get(ref.name, default_of(ref)), ref.name
            help_text = ref.metadata.get("command_help", {}).get(command, ref.metadata["help"])
            choices = ref.metadata.get("command_choices", {}).get(command, ref.metadata.get("choices"))
            assert (mine.metadata["help"], mine.metadata.get("choices")) == (help_text, choices), ref.name
    assert cls.flag_names() == want  # --help order: config.json and the manifest keep their key order


@pytest.mark.parametrize("command", sorted(CONFIG_CLASSES))
def test_the_parser_takes_each_flags_default_help_and_choices_from_the_command_class(command):
    cls = CONFIG_CLASSES[command]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    actions = {a.dest: a for a in build_parser(command, list(cls.GROUPS))._actions if a.dest in fields}
    assert set(actions) == set(fields)
    for name, action in actions.items():
        assert action.default == default_of(fields[name]) and action.help == fields[name].metadata["help"], name
        if "choices" in fields[name].metadata:
            assert action.choices == fields[name].metadata["choices"], name


def _is_of_type(value: typing.Any, tp: typing.Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_is_of_type(value, arg) for arg in typing.get_args(tp))
    if origin is list:
        return isinstance(value, list) and all(_is_of_type(v, typing.get_args(tp)[0]) for v in value)
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp) and not (tp is int and isinstance(value, bool))


def test_command_defaults_names_only_the_commands_flags_with_values_of_their_type_that_differ():
    assert set(COMMAND_DEFAULTS) <= set(CONFIG_CLASSES)
    for command, defaults in COMMAND_DEFAULTS.items():
        cls = CONFIG_CLASSES[command]
        hints = typing.get_type_hints(cls)
        groups = {f.name: f for group in cls.GROUPS for f in dataclasses.fields(group)}
        for name, value in defaults.items():
            assert name in groups, f"COMMAND_DEFAULTS[{command!r}] names --{name}, not a flag of {command}"
            assert _is_of_type(value, hints[name]), (command, name, value, hints[name])
            assert value != default_of(groups[name]), f"{command} --{name}: same as the group's default; drop it"
            meta = groups[name].metadata
            if "choices" in meta:
                assert value in meta.get("command_choices", {}).get(command, meta["choices"]), (command, name)


def test_command_help_and_choices_name_only_commands_that_have_the_flag():
    for group in ALL_GROUPS:
        for f in dataclasses.fields(group):
            for key in ("command_help", "command_choices"):
                for command in f.metadata.get(key, {}):
                    assert f.name in CONFIG_CLASSES[command].flag_names(), (group.__name__, f.name, key, command)


@pytest.mark.parametrize("command", sorted(CONFIG_CLASSES))
def test_parse_config_returns_the_command_class_with_argv_and_flat_dict(command):
    cfg = parse_config(command, None, [])
    assert type(cfg) is CONFIG_CLASSES[command] and cfg.command == command and list(cfg.argv) == []
    flags = config_to_dict(cfg)
    assert list(flags) == cfg.flag_names() and "argv" not in flags and "precision" not in flags


def test_a_command_config_is_each_of_its_groups_and_mismatched_groups_are_refused():
    sft = parse_config("sft", None, ["--learning_rate", "1e-4", "--max_epochs", "3"])
    assert isinstance(sft, SFTConfig) and isinstance(sft, OfflineConfig) and isinstance(sft, TrainOptions)
    assert (sft.learning_rate, sft.max_epochs) == (1e-4, 3)
    assert isinstance(PPOConfig(), TrainingConfig) and not isinstance(PPOConfig(), OfflineConfig)
    assert PPOConfig().max_epochs == 1 and SFTConfig().max_epochs == 2  # COMMAND_DEFAULTS["sft"]
    assert TrainOptions().max_epochs == 1  # the group keeps its own default
    with pytest.raises(TypeError, match="differ from SFTConfig.GROUPS"):
        parse_config("sft", [TrainOptions], [])


def test_a_command_class_lists_its_groups_once_as_its_bases_and_parse_config_takes_the_class():
    for cls in CONFIG_CLASSES.values():
        assert cls.__bases__ == (*cls.GROUPS, CommandConfig)  # GROUPS (--help order) is derived from the bases
    cfg = parse_config(PPOConfig, None, ["--eps_clip", "0.3"])
    assert type(cfg) is PPOConfig and cfg.eps_clip == 0.3 and cfg.command == "ppo"
    assert config_to_dict(cfg) == config_to_dict(parse_config("ppo", None, ["--eps_clip", "0.3"]))
    with pytest.raises(TypeError, match="bases of a command's class"):
        @command_class("sft")
        class NotACommand(TrainOptions):  # no CommandConfig base
            pass


def test_the_per_role_optimiser_group_is_one_declaration_instantiated_per_role():
    for role, group in (("actor", ActorOptimOptions), ("critic", CriticOptimOptions)):
        fields = {f.name: f for f in dataclasses.fields(group)}
        assert list(fields) == [f"{role}_learning_rate", *(f"{role}_{flag}" for flag in ROLE_SETTINGS)]
        for flag in ROLE_SETTINGS:
            f = fields[f"{role}_{flag}"]
            assert f.default is None and f.metadata["help"].endswith(f"(unset: --{flag})")
            assert "command_help" not in f.metadata  # one help per flag
    assert (PPOConfig().actor_learning_rate, PPOConfig().critic_learning_rate) == (1e-6, 9e-6)
    flat = parse_config(PPOConfig, None, ["--critic_adam_betas", "0.8", "0.9", "--actor_learning_rate", "2e-6"])
    dotted = parse_config(PPOConfig, None, ["--critic.adam.betas", "0.8", "0.9", "--actor.adam.lr", "2e-6"])
    assert flat.critic_adam_betas == dotted.critic_adam_betas == [0.8, 0.9]
    assert flat.actor_learning_rate == dotted.actor_learning_rate == 2e-6
    assert flat.actor_adam_betas is None  # unset: inherits --adam_betas
