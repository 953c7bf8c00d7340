"""Checks of an online run's configuration that need the model's config, the host or the user's files, made before Ray
or any engine starts: each failure is a ConfigError naming the flags, what was found and the fix (docs/errors.md).

- `--prompt_max_len + --generate_max_len` against the model's `max_position_embeddings` (read with AutoConfig);
- `--vllm_num_engines x --vllm_tensor_parallel_size` (batch-inference: `--tp_size`) against the GPUs (or, without
  GPUs, the CPU cores) of this host;
- `--vllm_kv_cache_mb x --vllm_num_engines` against the host's available RAM (CPU engines);
- the `.py` files of `--remote_rm_url` / `--reward_pretrain` and `--agent_func_path` import, and define what they must.

The host checks are skipped when the run joins a cluster (`--ray_address` / RAY_ADDRESS: its resources are not this
host's) or reuses engines it is given. `rlhfkit batch-inference` runs the same checks (`preflight_batch_inference`;
`--max_new_tokens` is its generation length, `--tp_size` its tensor parallelism).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlhfkit.config.commands import BatchInferenceConfig, PPOConfig
from rlhfkit.config.rl_options import context_len
from rlhfkit.config.validate import need
from rlhfkit.errors import ConfigError
from rlhfkit.userfiles import import_user_file

POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def preflight(cfg: PPOConfig, engines: list[Any] | None = None) -> None:
    """`rlhfkit ppo`: every check below, in the order a user would want to hear about them."""
    check_user_files(cfg.reward_pretrain, cfg.remote_rm_url, cfg.agent_func_path)
    check_context_length(need(cfg.pretrain, "--pretrain"), cfg.prompt_max_len,
                         context_len(cfg.prompt_max_len, cfg.generate_max_len, cfg.max_len) - cfg.prompt_max_len)
    if engines is None and not _joins_cluster(cfg.ray_address) and cfg.rollout_backend == "vllm":
        check_engine_devices(cfg.vllm_num_engines, cfg.vllm_tensor_parallel_size)
        check_kv_cache_memory(cfg.vllm_kv_cache_mb, cfg.vllm_num_engines)


def preflight_batch_inference(cfg: BatchInferenceConfig, engines: list[Any] | None = None) -> None:
    """`rlhfkit batch-inference`: its reward files; with --eval_task generate_vllm the context and the host."""
    check_user_files(cfg.reward_pretrain, cfg.remote_rm_url)
    if cfg.eval_task != "generate_vllm":
        return
    check_context_length(need(cfg.pretrain, "--pretrain"), cfg.prompt_max_len, cfg.max_new_tokens,
                         "--max_new_tokens")
    if engines is None and not _joins_cluster(cfg.ray_address):
        check_engine_devices(cfg.vllm_num_engines, cfg.tp_size, "--tp_size")
        check_kv_cache_memory(cfg.vllm_kv_cache_mb, cfg.vllm_num_engines)


def _joins_cluster(ray_address: str | None) -> bool:
    return bool(ray_address or os.environ.get("RAY_ADDRESS"))


# ---------------------------------------------------------------------------------------------------------------
# the model's context


def model_position_limit(pretrain: str) -> int | None:
    """The model's maximum positions from its config.json (None when it declares none)."""
    from transformers import AutoConfig

    from rlhfkit.models.loading import resolve_pretrain

    try:
        config = AutoConfig.from_pretrained(resolve_pretrain(pretrain))
    except (OSError, ValueError) as err:
        raise ConfigError(f"--pretrain {pretrain}: cannot read its config ({err})") from None
    config = getattr(config, "text_config", None) or config
    for key in POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context_length(pretrain: str, prompt_max_len: int, new_tokens: int,
                         new_flag: str = "--generate_max_len") -> None:
    limit = model_position_limit(pretrain)
    total = prompt_max_len + new_tokens
    if limit is not None and total > limit:
        if prompt_max_len < limit // 2:
            fix = f"{new_flag} {limit - prompt_max_len} with this --prompt_max_len"
        else:
            fix = f"--prompt_max_len {limit // 2} {new_flag} {limit - limit // 2}"
        raise ConfigError(f"--prompt_max_len {prompt_max_len} + {new_flag} {new_tokens} = "
                          f"{total} tokens, but the model {pretrain} has max_position_embeddings {limit}: the "
                          f"rollout engines refuse a context longer than the model's. Lower them so that the sum is "
                          f"<= {limit} (e.g. {fix})")


# ---------------------------------------------------------------------------------------------------------------
# the host: devices and memory


def local_gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def available_ram_mb() -> int | None:
    """MiB of RAM available to new processes (psutil, else /proc/meminfo's MemAvailable); None when unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available // 2**20)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def check_engine_devices(engines: int, tp: int, tp_flag: str = "--vllm_tensor_parallel_size") -> None:
    if engines < 1 or tp < 1:
        raise ConfigError(f"--vllm_num_engines {engines} and {tp_flag} {tp} must both be >= 1")
    gpus = local_gpu_count()
    if gpus:
        if engines * tp > gpus:
            raise ConfigError(f"--vllm_num_engines {engines} x {tp_flag} {tp} = {engines * tp} "
                              f"GPUs, but this host has {gpus}: lower one of the two (each engine shard takes a "
                              f"whole GPU), or join a larger cluster with --ray_address")
        return
    cores = os.cpu_count() or 1
    problems = []  # every problem in one message: fixing one must not lead into the next
    if tp != 1:
        problems.append(f"{tp_flag} {tp}: tensor parallelism needs GPUs and this host has none; use {tp_flag} 1 "
                        "(CPU engines run one process each)")
    if engines > cores:
        problems.append(f"--vllm_num_engines {engines}: this host has no GPU and {cores} CPU cores; each CPU engine "
                        f"needs at least one core. Use --vllm_num_engines {cores} or fewer")
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else
                          "two problems with the engines: " + "; and ".join(f"({k}) {p}"
                                                                            for k, p in enumerate(problems, 1)))


def check_kv_cache_memory(kv_cache_mb: int, engines: int) -> None:
    if local_gpu_count():
        return  # on GPUs the KV cache is --vllm_gpu_memory_utilization of the device, not host RAM
    need = kv_cache_mb * engines
    have = available_ram_mb()
    if have is not None and need > have:
        per_engine = max(1, have // max(1, engines) // 2)
        raise ConfigError(f"--vllm_kv_cache_mb {kv_cache_mb} x --vllm_num_engines {engines} = "
                          f"{need} MiB of KV cache, but this host has {have} MiB of RAM available (before the models "
                          f"are loaded): lower --vllm_kv_cache_mb (e.g. {per_engine}) or --vllm_num_engines")


# ---------------------------------------------------------------------------------------------------------------
# the user's Python files


def check_user_files(reward_pretrain: str | None, remote_rm_url: str | None, agent_func_path: str | None = None
                     ) -> None:
    """The reward files (of --reward_pretrain, --remote_rm_url) import and define `reward_func`; the agent file
    (--agent_func_path, ppo's) loads as `rlhfkit ppo` will load it."""
    from rlhfkit.agents.environment import load_agent
    from rlhfkit.rewards.reward_func import FILE_SHAPE, FUNC_NAME
    from rlhfkit.rewards.sources import spec_kind, split_specs

    for flag, specs in (("--reward_pretrain", reward_pretrain), ("--remote_rm_url", remote_rm_url)):
        for spec in split_specs(specs):
            if spec_kind(spec) == "file":
                import_user_file(spec, flag, FUNC_NAME, FILE_SHAPE, keep=False)
    if agent_func_path:
        load_agent(agent_func_path)
