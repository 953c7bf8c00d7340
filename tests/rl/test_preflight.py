"""Configuration errors of `rlhfkit ppo` raised before Ray or any engine starts (rlhfkit/launch/preflight.py): the
context length against the model's max_position_embeddings, engines x TP against the host's devices, the KV cache
against host RAM, and reward / agent .py files that do not import. The CLI tests make `start_ray` fail loudly, so a
check that came too late would show."""

from __future__ import annotations

import pytest

import rlhfkit.launch.preflight as preflight
import rlhfkit.launch.ray_cluster as ray_cluster
import rlhfkit.rl.setup as setup
from rlhfkit.cli.main import main as cli
from rlhfkit.cli.ppo import GROUPS
from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.errors import ConfigError


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    """A config.json only (max_position_embeddings 256): the checks read the config, never the weights."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("cfg_only")
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=256, vocab_size=100).save_pretrained(path)
    return str(path)


@pytest.fixture
def no_ray(monkeypatch):
    def refuse(cfg):
        raise AssertionError("Ray was started before the configuration error")

    monkeypatch.setattr(setup, "start_ray", refuse)        # ppo (imported into rl.setup)
    monkeypatch.setattr(ray_cluster, "start_ray", refuse)  # batch-inference (imported when it starts engines)


def _cfg(model: str, tmp_path, **flags):
    base = {"pretrain": model, "prompt_data": str(tmp_path / "prompts.jsonl"), "remote_rm_url": "builtin:exact",
            "prompt_max_len": 64, "generate_max_len": 64, "run_dir": str(tmp_path / "run")}
    return parse_config("ppo", GROUPS, flags_to_argv({**base, **flags}))


def _cli_error(capsys, model, tmp_path, **flags) -> str:
    base = {"pretrain": model, "prompt_data": str(tmp_path / "prompts.jsonl"), "remote_rm_url": "builtin:exact",
            "prompt_max_len": 64, "generate_max_len": 64, "run_dir": str(tmp_path / "run")}
    with pytest.raises(SystemExit) as exit_info:
        cli(["ppo", *flags_to_argv({**base, **flags})])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("rlhfkit ppo: error: ") and "Traceback" not in err
    return err


def test_prompt_max_len_plus_generate_max_len_beyond_the_model_is_refused_before_ray(small_model, tmp_path, capsys,
                                                                                     no_ray):
    err = _cli_error(capsys, small_model, tmp_path, prompt_max_len=100, generate_max_len=200)
    assert "--prompt_max_len 100 + --generate_max_len 200 = 300" in err
    assert f"the model {small_model} has max_position_embeddings 256" in err
    assert "(e.g. --generate_max_len 156 with this --prompt_max_len)" in err  # the fix that fits
    err = _cli_error(capsys, small_model, tmp_path, prompt_max_len=200, generate_max_len=100)
    assert "(e.g. --prompt_max_len 128 --generate_max_len 128)" in err
    assert not (tmp_path / "run").exists()  # nothing was written either
    preflight.check_context_length(small_model, 200, 56)  # fits


def test_engines_times_tensor_parallel_size_against_the_hosts_devices(small_model, tmp_path, monkeypatch, capsys,
                                                                      no_ray):
    monkeypatch.setattr(preflight, "local_gpu_count", lambda: 4)
    err = _cli_error(capsys, small_model, tmp_path, vllm_num_engines=3, vllm_tensor_parallel_size=2)
    assert "--vllm_num_engines 3 x --vllm_tensor_parallel_size 2 = 6 GPUs, but this host has 4" in err
    preflight.check_engine_devices(2, 2)

    monkeypatch.setattr(preflight, "local_gpu_count", lambda: 0)
    with pytest.raises(ConfigError, match="--vllm_tensor_parallel_size 2: tensor parallelism needs GPUs"):
        preflight.check_engine_devices(1, 2)
    monkeypatch.setattr(preflight.os, "cpu_count", lambda: 2)
    with pytest.raises(ConfigError, match="--vllm_num_engines 3: this host has no GPU and 2 CPU cores"):
        preflight.check_engine_devices(3, 1)
    # joining a cluster (--ray_address): its devices are not this host's, so no host check
    preflight.preflight(_cfg(small_model, tmp_path, vllm_num_engines=3, ray_address="10.0.0.1:6379"))


def test_vllm_kv_cache_mb_times_engines_against_host_ram(small_model, tmp_path, monkeypatch, capsys, no_ray):
    monkeypatch.setattr(preflight, "local_gpu_count", lambda: 0)
    monkeypatch.setattr(preflight, "available_ram_mb", lambda: 1000)
    err = _cli_error(capsys, small_model, tmp_path, vllm_kv_cache_mb=600, vllm_num_engines=2)
    assert "--vllm_kv_cache_mb 600 x --vllm_num_engines 2 = 1200 MiB of KV cache, but this host has 1000 MiB" in err
    preflight.check_kv_cache_memory(400, 2)
    monkeypatch.undo()  # the real reader (psutil or /proc/meminfo) gives a number here
    assert preflight.available_ram_mb() > 0


def test_remote_rm_url_file_with_a_syntax_error_names_the_file_and_line(small_model, tmp_path, capsys, no_ray):
    bad = tmp_path / "reward.py"
    bad.write_text("def reward_func(queries, prompts, labels):\n    return {'rewards': [1.0 for q in queries]\n")
    err = _cli_error(capsys, small_model, tmp_path, remote_rm_url=str(bad))
    assert f"--remote_rm_url {bad}: syntax error at line 2" in err


def test_remote_rm_url_file_without_reward_func_or_raising_at_import(small_model, tmp_path, capsys, no_ray):
    none = tmp_path / "none.py"
    none.write_text("def reward(queries, prompts, labels):\n    return {}\n")
    err = _cli_error(capsys, small_model, tmp_path, remote_rm_url=f"builtin:exact,{none}")
    assert f"--remote_rm_url {none}: defines no reward_func" in err
    raising = tmp_path / "raising.py"
    raising.write_text("import json\n\nTABLE = json.loads('{oops')\n")
    err = _cli_error(capsys, small_model, tmp_path, remote_rm_url=str(raising))
    assert f"--remote_rm_url {raising}: importing it raised JSONDecodeError" in err and "at line 3" in err


def test_agent_func_path_that_does_not_import_or_lacks_the_class(small_model, tmp_path, capsys, no_ray):
    agent = tmp_path / "agent.py"
    agent.write_text("class AgentInstance:\n    def step(self, states)\n        return states\n")
    err = _cli_error(capsys, small_model, tmp_path, remote_rm_url=None, agent_func_path=str(agent))
    assert f"--agent_func_path {agent}: syntax error at line 2" in err
    agent.write_text("class Agent:\n    pass\n")
    err = _cli_error(capsys, small_model, tmp_path, remote_rm_url=None, agent_func_path=str(agent))
    assert f"--agent_func_path {agent}: defines no AgentInstance" in err


def test_batch_inference_checks_its_context_engines_and_reward_file_before_ray(small_model, tmp_path, monkeypatch,
                                                                              capsys, no_ray):
    base = ["batch-inference", "--pretrain", small_model, "--dataset", str(tmp_path / "d.jsonl"), "--output_path",
            str(tmp_path / "out.jsonl"), "--eval_task", "generate_vllm", "--prompt_max_len", "100"]
    with pytest.raises(SystemExit):
        cli([*base, "--max_new_tokens", "200"])
    err = capsys.readouterr().err
    assert "--prompt_max_len 100 + --max_new_tokens 200 = 300 tokens" in err and "max_position_embeddings 256" in err
    monkeypatch.setattr(preflight, "local_gpu_count", lambda: 1)
    with pytest.raises(SystemExit):
        cli([*base, "--max_new_tokens", "20", "--tp_size", "2"])
    assert "--vllm_num_engines 1 x --tp_size 2 = 2 GPUs, but this host has 1" in capsys.readouterr().err
    bad = tmp_path / "score.py"
    bad.write_text("def reward_func(queries, prompts, labels:\n    pass\n")
    with pytest.raises(SystemExit):
        cli([*base, "--max_new_tokens", "20", "--remote_rm_url", str(bad)])
    assert f"--remote_rm_url {bad}: syntax error at line 1" in capsys.readouterr().err
