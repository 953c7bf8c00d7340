import pytest

from rlhfkit.config.parse import parse_config
from rlhfkit.config.validate import validate_batch_sizes, validate_common
from rlhfkit.errors import ConfigError

GROUPS = None  # the command's own (SFTConfig.GROUPS)


def test_flags_parse_into_a_flat_config_with_openrlhf_names():
    cfg = parse_config("sft", GROUPS, ["--pretrain", "m", "--adam_betas", "0.8", "0.9", "--apply_chat_template",
                                       "--micro_train_batch_size", "3"])
    assert cfg.pretrain == "m"
    assert cfg.adam_betas == [0.8, 0.9]
    assert cfg.apply_chat_template is True
    assert cfg.micro_train_batch_size == 3
    assert cfg.max_epochs == 2  # sft's own default (COMMAND_DEFAULTS) over the group's


def test_yaml_config_sets_flags_and_the_command_line_wins(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("pretrain: from_yaml\nlearning_rate: 0.001\nmax_len: 64\n")
    cfg = parse_config("sft", GROUPS, ["--config", str(run), "--max_len", "32"])
    assert cfg.pretrain == "from_yaml"
    assert cfg.learning_rate == pytest.approx(0.001)
    assert cfg.max_len == 32


def test_unknown_flag_and_unknown_yaml_key_are_named(tmp_path):
    with pytest.raises(ConfigError, match="--not_a_flag"):
        parse_config("sft", GROUPS, ["--not_a_flag", "1"])
    run = tmp_path / "run.yaml"
    run.write_text("learnin_rate: 0.1\n")
    with pytest.raises(ConfigError, match="learnin_rate"):
        parse_config("sft", GROUPS, ["--config", str(run)])


def test_deepspeed_only_flags_are_rejected_with_a_reason():
    with pytest.raises(ConfigError, match="--zpg is not supported"):
        parse_config("sft", GROUPS, ["--zpg", "2"])
    with pytest.raises(ConfigError, match="--overlap_comm"):
        parse_config("sft", GROUPS, ["--overlap_comm"])


def test_batch_sizes_must_divide_and_accumulation_is_derived():
    cfg = parse_config("sft", GROUPS, ["--train_batch_size", "8", "--micro_train_batch_size", "2"])
    assert validate_batch_sizes(cfg, world_size=2) == 2
    assert validate_batch_sizes(cfg, world_size=1) == 4
    cfg = parse_config("sft", GROUPS, ["--train_batch_size", "6", "--micro_train_batch_size", "4"])
    with pytest.raises(ConfigError, match="--train_batch_size 6 is not a multiple"):
        validate_batch_sizes(cfg, world_size=1)


def test_contradictory_flags_are_reported():
    cfg = parse_config("sft", GROUPS, ["--multiturn", "--pretrain_mode"])
    with pytest.raises(ConfigError, match="--multiturn and --pretrain_mode"):
        validate_common(cfg)
    cfg = parse_config("sft", GROUPS, ["--dataset", "a.jsonl,b.jsonl", "--dataset_probs", "1.0"])
    with pytest.raises(ConfigError, match="--dataset_probs has 1"):
        validate_common(cfg)


def test_flags_to_argv_round_trips_through_the_parser():
    from rlhfkit.config.parse import flags_to_argv

    argv = flags_to_argv({"pretrain": "m", "apply_chat_template": True, "packing_samples": False,
                          "output_key": None, "adam_betas": [0.8, 0.9], "max_len": 64})
    assert argv == ["--pretrain", "m", "--apply_chat_template", "--adam_betas", "0.8", "0.9", "--max_len", "64"]
    cfg = parse_config("sft", GROUPS, argv)
    assert (cfg.pretrain, cfg.apply_chat_template, cfg.packing_samples, cfg.adam_betas, cfg.max_len) == \
        ("m", True, False, [0.8, 0.9], 64)


def _commands_with_groups():
    import importlib

    from rlhfkit.cli.main import COMMANDS
    from tools.gen_docs import module_name

    for command in COMMANDS:
        groups = getattr(importlib.import_module(module_name(command)), "GROUPS", None)
        if groups is not None:
            yield command, groups


def test_every_refusal_reason_names_only_flags_of_its_command(tmp_path):
    """A refusal shown by `rlhfkit COMMAND` suggests only --flags that COMMAND has (#12), on the command line and
    in --config files."""
    import re

    from rlhfkit.config.parse import COMMAND_REJECTED_FLAGS, REJECTED_FLAGS, build_parser, rejection_reason

    seen = set()
    for command, groups in _commands_with_groups():
        seen.add(command)
        flags = {opt for action in build_parser(command, groups)._actions for opt in action.option_strings}
        for name in [*REJECTED_FLAGS, *COMMAND_REJECTED_FLAGS.get(command, {})]:
            reason = rejection_reason(name, command)
            named = set(re.findall(r"--[a-z][a-z0-9_]*", reason))
            assert named <= flags, f"rlhfkit {command} --{name}: the reason names {sorted(named - flags)}: {reason}"
            with pytest.raises(ConfigError) as err:
                parse_config(command, groups, [f"--{name}", "2"])  # not 1: ppo accepts --logging_steps 1
            assert reason in str(err.value)
            config = tmp_path / f"{command}-{name}.yaml"
            config.write_text(f"{name}: 2\n")
            with pytest.raises(ConfigError) as err:
                parse_config(command, groups, ["--config", str(config)])
            assert reason in str(err.value)
    assert {"sft", "rm", "dpo", "kto", "kd", "prm", "ppo", "batch-inference"} <= seen
