"""OpenRLHF's seed-era flat names that were unknown (#28): `--max_new_tokens` and `--freeze_visual_encoder` (ppo),
`--dataloader_num_workers` (the training commands), with the meaning the dotted dialect gives them; ppo's total
budget `--max_len` / `--data.max_len` as OpenRLHF 0.11 bounds a rollout; the engines' device check reporting every
problem at once; the VLM example's `--` pass-through."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
from openrlhf_scripts import script_argv

from rlhfkit.config import dialect
from rlhfkit.config.parse import config_to_dict, parse_config
from rlhfkit.config.rl_options import context_len, prompt_bound
from rlhfkit.config.validate import check_loader_workers
from rlhfkit.errors import ConfigError
from rlhfkit.launch import preflight
from rlhfkit.launch.engine_spec import sampling_config

REPO = Path(__file__).resolve().parents[2]
PLACEHOLDERS = {"MODEL": "tiny-model", "REWARD_MODEL": "tiny-rm", "DATA": "data.jsonl", "EVAL_DATA": "eval.jsonl",
                "REWARD_FUNC": "reward_func.py", "AGENT_FUNC": "agent_func.py", "OUT": "out"}


def test_max_new_tokens_is_generate_max_len():
    flat = parse_config("ppo", None, ["--max_new_tokens", "7"])
    assert flat.generate_max_len == 7
    assert config_to_dict(flat) == config_to_dict(parse_config("ppo", None, ["--rollout.max_new_tokens", "7"]))
    assert sampling_config(flat, seed=1).max_new_tokens == 7
    from rlhfkit.launch.engine_spec import vllm_engine_spec

    assert vllm_engine_spec(flat, dtype="fp32", seed=1).max_model_len == flat.prompt_max_len + 7


def test_freeze_visual_encoder_is_freeze_vision_tower(tmp_path):
    assert parse_config("ppo", None, []).freeze_vision_tower is True
    off = parse_config("ppo", None, ["--no-freeze_visual_encoder"])
    assert off.freeze_vision_tower is False
    assert parse_config("ppo", None, ["--no-freeze_visual_encoder", "--freeze_visual_encoder"]).freeze_vision_tower
    run = tmp_path / "run.yaml"
    run.write_text("actor: {freeze_visual_encoder: false}\n")
    assert config_to_dict(off) == config_to_dict(parse_config("ppo", None, ["--config", str(run)]))


@pytest.mark.parametrize("command", ["sft", "rm", "dpo", "ppo"])
def test_dataloader_num_workers_is_accepted_and_changes_nothing(command, caplog):
    base = parse_config(command, None, [])
    four = parse_config(command, None, ["--dataloader_num_workers", "4"])
    assert (base.dataloader_num_workers, four.dataloader_num_workers) == (0, 4)
    assert config_to_dict(four) == config_to_dict(parse_config(command, None, ["--data.dataloader_num_workers=4"]))
    with caplog.at_level(logging.INFO, logger="rlhfkit.config.validate"):
        check_loader_workers(base)
        assert "changes nothing" not in caplog.text
        check_loader_workers(four)
    assert "--dataloader_num_workers 4 changes nothing" in caplog.text
    with pytest.raises(ConfigError, match="--dataloader_num_workers -1 must be >= 0"):
        check_loader_workers(parse_config(command, None, ["--dataloader_num_workers", "-1"]))
    # the other fields are untouched: nothing downstream reads a worker count
    assert {k: v for k, v in config_to_dict(four).items() if k != "dataloader_num_workers"} == \
        {k: v for k, v in config_to_dict(base).items() if k != "dataloader_num_workers"}


def test_max_len_bounds_prompt_plus_response_per_prompt():
    # OpenRLHF 0.11: data.max_len is prompt + response; rollout.max_new_tokens unset: max_len - prompt length each
    cfg = parse_config("ppo", None, ["--data.max_len", "64"])
    assert (cfg.max_len, cfg.prompt_max_len, cfg.generate_max_len) == (64, 63, 63)
    assert config_to_dict(cfg) == config_to_dict(parse_config("ppo", None, ["--max_len", "64"]))
    sampling = sampling_config(cfg, seed=1)
    assert [sampling.new_tokens(n) for n in (1, 10, 40, 63)] == [63, 54, 24, 1]
    assert (prompt_bound(cfg.prompt_max_len, cfg.max_len), context_len(63, 63, 64), context_len(8, 8, 0)) == \
        (63, 64, 16)
    # with rollout.max_new_tokens N OpenRLHF keeps N and cuts the prompt to max_len - N: rlhfkit drops a longer one
    cfg = parse_config("ppo", None, ["--data.max_len", "9216", "--rollout.max_new_tokens", "8192"])
    assert (cfg.max_len, cfg.prompt_max_len, cfg.generate_max_len) == (9216, 1024, 8192)
    assert sampling_config(cfg, seed=1).new_tokens(1000) == 8192
    # all three given: prompts <= --prompt_max_len, each response <= min(--generate_max_len, max_len - p)
    cfg = parse_config("ppo", None, ["--max_len", "64", "--prompt_max_len", "50", "--max_new_tokens", "30"])
    assert (cfg.max_len, cfg.prompt_max_len, cfg.generate_max_len) == (64, 50, 30)
    assert [sampling_config(cfg, seed=1).new_tokens(n) for n in (20, 40)] == [30, 24]
    assert dialect.budget_flags("data.max_len", 300, {"prompt_max_len": 100}) == \
        {"max_len": 300, "generate_max_len": 299}
    with pytest.raises(ConfigError, match="--data.max_len 64 leaves no room beside --generate_max_len 64"):
        parse_config("ppo", None, ["--data.max_len", "64", "--generate_max_len", "64"])
    with pytest.raises(ConfigError, match="at least 2 tokens"):
        parse_config("ppo", None, ["--data.max_len", "1"])
    # no --max_len: every prompt gets --generate_max_len, as before
    assert sampling_config(parse_config("ppo", None, []), seed=1).new_tokens(1000) == 1024
    # the vLLM request of each prompt asks for its own share
    from rlhfkit.launch.engine_spec import vllm_engine_spec
    from rlhfkit.rollout.vllm_engine import _sampling_params

    assert _sampling_params(sampling, 5, 40).max_tokens == 24
    assert vllm_engine_spec(parse_config("ppo", None, ["--max_len", "64"]), dtype="fp32", seed=1).max_model_len == 64


@pytest.mark.parametrize("name", ["train_ppo_ray_hybrid_engine.sh", "train_dapo_ray_hybrid_engine.sh"])
def test_the_0_11_scripts_with_data_max_len_64_keep_their_40_token_prompts(name, tokenizer, tmp_path):
    from rlhfkit.rl.setup import load_prompts

    data = tmp_path / "prompts.jsonl"
    words = ["red", "blue", "green", "cat", "dog", "tree", "sun", "moon"]
    data.write_text("".join(json.dumps({"context_messages": [{"role": "user", "content": f"Repeat: {a} {b}"}]}) + "\n"
                            for a in words[:4] for b in words[4:]))
    _, argv = script_argv(name, **{**PLACEHOLDERS, "DATA": str(data)})
    argv[argv.index("--data.max_len") + 1] = "64"
    argv[argv.index("--data.max_samples") + 1] = "16"
    cfg = parse_config("ppo", None, argv)
    assert (cfg.max_len, cfg.prompt_max_len, cfg.generate_max_len) == (64, 63, 63)
    prompts = load_prompts(cfg, tokenizer, str(data), cfg.prompt_split)
    lengths = [len(p["prompt_ids"]) for p in prompts]
    assert len(prompts) == 16 and 30 <= min(lengths) and max(lengths) <= 50  # all kept (half of 64 dropped them all)
    sampling = sampling_config(cfg, seed=1)
    assert [sampling.new_tokens(n) for n in lengths] == [64 - n for n in lengths]  # up to ~24 new tokens each


def test_the_engine_device_check_names_every_problem_at_once(monkeypatch):
    monkeypatch.setattr(preflight, "local_gpu_count", lambda: 0)
    monkeypatch.setattr(preflight.os, "cpu_count", lambda: 2)
    with pytest.raises(ConfigError) as err:
        preflight.check_engine_devices(64, 2)
    message = str(err.value)
    assert "--vllm_tensor_parallel_size 2: tensor parallelism needs GPUs" in message
    assert "--vllm_num_engines 64: this host has no GPU and 2 CPU cores" in message
    with pytest.raises(ConfigError, match="^--vllm_num_engines 3: this host"):  # one problem: only it
        preflight.check_engine_devices(3, 1)


def test_the_vlm_example_passes_the_flags_after_the_separator_on():
    spec = importlib.util.spec_from_file_location("ppo_colours", REPO / "examples" / "vlm" / "ppo_colours.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args, extra = example.parse_args(["--out", "o", "--", "--vllm_num_engines", "1", "--temperature", "0.5"])
    assert (args.out, extra) == ("o", ["--vllm_num_engines", "1", "--temperature", "0.5"])
    assert parse_config("ppo", None, extra).temperature == 0.5  # before: "unknown flag(s) for 'rlhfkit ppo': --"
    assert example.parse_args(["--temperature", "0.5"])[1] == ["--temperature", "0.5"]


def test_lora_merge_model_path_is_pretrain():
    from rlhfkit.cli import lora_merge

    parser = lora_merge.build_parser()
    rest = ["--lora_path", "l", "--output_path", "o"]
    assert vars(parser.parse_args(["--model_path", "base", *rest])) == \
        vars(parser.parse_args(["--pretrain", "base", *rest]))
    assert parser.parse_args(["--model_path", "base", *rest]).pretrain == "base"
