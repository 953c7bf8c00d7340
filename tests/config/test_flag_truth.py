"""Flags that tell the truth: no prefix abbreviations (`--lora_r` must not set `--lora_rank`), and a KL loss with
no reference model is refused before anything starts; a negative --top_k is refused and top-k/top-p sampling with
the whole-softmax trainer log-probs (--logprobs_truncation off) is warned about."""

from __future__ import annotations

import importlib

import pytest

from rlhfkit.config.parse import parse_config
from rlhfkit.errors import ConfigError
from rlhfkit.rl.validate import validate_rl
from tools.gen_docs import module_name

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


def test_a_negative_top_k_is_refused_and_the_biased_log_probs_are_warned_about(caplog):
    with pytest.raises(ConfigError, match=r"--top_k -1: .* \(0: off\)"):
        validate_rl(parse_config("ppo", None, [*PPO, "--top_k", "-1"]))
    with caplog.at_level("WARNING", logger="rlhfkit"):
        validate_rl(parse_config("ppo", None, [*PPO, "--top_p", "0.9"]))  # auto: the trainer truncates too
        assert "--logprobs_truncation off" not in caplog.text
        validate_rl(parse_config("ppo", None, [*PPO, "--top_p", "0.9", "--logprobs_truncation", "off"]))
    assert "--top_p 0.9 / --top_k 0 with --logprobs_truncation off" in caplog.text
