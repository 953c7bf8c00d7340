"""Flags that tell the truth: no prefix abbreviations (`--lora_r` must not set `--lora_rank`), and a KL loss with
no reference model is refused before anything starts."""

from __future__ import annotations

import importlib

import pytest

from rlhfkit.cli.docs import module_name
from rlhfkit.config.parse import parse_config
from rlhfkit.errors import ConfigError
from rlhfkit.rl.validate import validate_rl

PPO = ["--pretrain", "m", "--prompt_data", "p", "--remote_rm_url", "builtin:format"]


@pytest.mark.parametrize(("command", "argv"), [
    ("sft", ["--pretrain", "m", "--dataset", "d", "--lora_r", "8"]),
    ("ppo", [*PPO, "--lora_r", "8"]),
    ("ppo", [*PPO, "--init_kl", "0.1"]),
])
def test_a_prefix_of_a_flag_is_an_unknown_flag(command, argv):
    groups = importlib.import_module(module_name(command)).GROUPS
    with pytest.raises(ConfigError, match=f"unknown flag\\(s\\) for 'rlhfkit {command}': {argv[-2]} {argv[-1]}"):
        parse_config(command, groups, argv)
    full = [*argv[:-2], "--lora_rank" if argv[-2] == "--lora_r" else "--init_kl_coef", argv[-1]]
    assert parse_config(command, groups, full) is not None  # the whole name still works


def test_the_kl_loss_without_a_reference_is_refused():
    with pytest.raises(ConfigError, match=r"--use_kl_loss .* --init_kl_coef is 0\.0 \(no reference model is loaded\): "
                                          r"set --init_kl_coef > 0, or drop --use_kl_loss"):
        validate_rl(parse_config("ppo", None, [*PPO, "--use_kl_loss", "--init_kl_coef", "0"]))
    validate_rl(parse_config("ppo", None, [*PPO, "--use_kl_loss", "--init_kl_coef", "0.01"]))
