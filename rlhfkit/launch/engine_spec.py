"""The command's edge for the rollout engines: what `rollout/` builds its engines, sampling and LoRA sync from, made
here from the command's config, so that `rollout/` reads no command class (tests/test_layering.py). ppo (`rl/`) and
batch-inference (`inference/`) share these builders: the same flags give the same engines."""

from __future__ import annotations

from collections.abc import Sequence

from rlhfkit.config.commands import BatchInferenceConfig, PPOConfig
from rlhfkit.config.rl_options import context_len
from rlhfkit.rollout.lora_sync import LoraSyncSpec
from rlhfkit.rollout.types import SamplingConfig
from rlhfkit.rollout.vllm_engine import ENGINE_DTYPES, VLLMEngineSpec


def vllm_engine_spec(opts: PPOConfig | BatchInferenceConfig, *, dtype: str, seed: int) -> VLLMEngineSpec:
    """The engines of `ppo` (its rollout group: `--vllm_tensor_parallel_size ... --generate_max_len`) or
    `batch-inference` (`--tp_size ... --max_new_tokens`): `--vllm_gpu_memory_utilization --vllm_kv_cache_mb
    --enforce_eager --enable_prefix_caching --prompt_max_len` are common (ppo's context is at most `--max_len`).
    `dtype`: the engine's dtype flag value (`ENGINE_DTYPES` key: ppo's `--vllm_dtype`, batch-inference's
    `--param_dtype`, resolved); `seed`: `--seed` (engine k gets `seed + k`)."""
    if isinstance(opts, PPOConfig):
        tensor_parallel_size = opts.vllm_tensor_parallel_size
        max_model_len = context_len(opts.prompt_max_len, opts.generate_max_len, opts.max_len)
    else:
        tensor_parallel_size, max_model_len = opts.tp_size, opts.prompt_max_len + opts.max_new_tokens
    return VLLMEngineSpec(tensor_parallel_size=tensor_parallel_size,
                          gpu_memory_utilization=opts.vllm_gpu_memory_utilization,
                          cpu_kv_cache_bytes=opts.vllm_kv_cache_mb * 2**20, enforce_eager=opts.enforce_eager,
                          enable_prefix_caching=opts.enable_prefix_caching, max_model_len=max_model_len,
                          dtype=ENGINE_DTYPES[dtype], seed=seed)


def sampling_config(opts: PPOConfig | BatchInferenceConfig, seed: int | None,
                    stop_token_ids: Sequence[int] = ()) -> SamplingConfig:
    """The sampling flags of either command: ppo's rollout group (`--temperature --top_p --top_k --generate_max_len
    --n_samples_per_prompt`) or batch-inference's (`--temperature`, 0 with `--greedy_sampling`, `--top_p --top_k
    --max_new_tokens --best_of_n`). `seed`: `--seed`, declared in another group by each command (ppo: TrainOptions,
    batch-inference: InferenceModelOptions)."""
    max_len, min_new_tokens = None, 0
    if isinstance(opts, PPOConfig):
        temperature, max_new_tokens, n = opts.temperature, opts.generate_max_len, opts.n_samples_per_prompt
        max_len, min_new_tokens = opts.max_len or None, opts.generate_min_len
    else:
        temperature = 0.0 if opts.greedy_sampling else opts.temperature
        max_new_tokens, n = opts.max_new_tokens, opts.best_of_n
    return SamplingConfig(temperature=temperature, top_p=opts.top_p, max_new_tokens=max_new_tokens, n=n, seed=seed,
                          stop_token_ids=tuple(stop_token_ids), max_len=max_len, top_k=opts.top_k,
                          min_new_tokens=min_new_tokens)


def lora_sync_spec(cfg: PPOConfig) -> LoraSyncSpec:
    """What `rlhfkit.rollout.lora_sync` decides adapter-or-merged sync from."""
    return LoraSyncSpec(lora_rank=cfg.lora_rank, rollout_backend=cfg.rollout_backend, load_in_4bit=cfg.load_in_4bit,
                        lora_sync=cfg.lora_sync)
