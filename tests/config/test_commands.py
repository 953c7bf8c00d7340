"""The static per-command config classes (rlhfkit.config.commands, #12) against the rule the parser and the docs
follow: every field of every group of the command, the FIRST group that declares a name deciding its type, default
and help. The reference below rebuilds that rule independently (the flat dynamic class parse_config used to make)."""

from __future__ import annotations

import dataclasses
import importlib
import typing

import pytest

from rlhfkit.cli.docs import module_name
from rlhfkit.config.commands import CONFIG_CLASSES, OfflineConfig, PPOConfig, SFTConfig, TrainingConfig
from rlhfkit.config.options import TrainOptions
from rlhfkit.config.parse import config_to_dict, make_config_class, parse_config


def first_definitions(groups: list[type]) -> dict[str, tuple[typing.Any, dataclasses.Field]]:
    out: dict[str, tuple[typing.Any, dataclasses.Field]] = {}
    for group in groups:
        hints = typing.get_type_hints(group)
        for f in dataclasses.fields(group):
            out.setdefault(f.name, (hints[f.name], f))
    return out


def default_of(f: dataclasses.Field) -> typing.Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@pytest.mark.parametrize("command", sorted(CONFIG_CLASSES))
def test_each_command_class_has_exactly_its_groups_fields_first_definition_wins(command):
    cls = CONFIG_CLASSES[command]
    groups = importlib.import_module(module_name(command)).GROUPS
    assert tuple(groups) == cls.GROUPS and make_config_class(command, groups) is cls
    want = first_definitions(list(groups))
    hints = typing.get_type_hints(cls)
    got = {f.name: f for f in dataclasses.fields(cls)}
    assert set(got) == set(want)
    for name, (tp, ref) in want.items():
        assert hints[name] == tp, name
        assert default_of(got[name]) == default_of(ref), name
        assert got[name].metadata == ref.metadata, name
    assert cls.flag_names() == list(want)  # --help order: config.json and the manifest keep their key order


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
    assert PPOConfig().max_epochs == 1 and SFTConfig().max_epochs == 2  # the command's own group first
    with pytest.raises(TypeError, match="differ from SFTConfig.GROUPS"):
        parse_config("sft", [TrainOptions], [])
