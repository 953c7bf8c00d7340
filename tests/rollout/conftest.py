"""Rollout fixtures: ONE vLLM engine actor (and one HF engine actor) for the whole test session.

Self-contained so they can move verbatim into `tests/conftest.py` for the RL tests to reuse. Tests that change
an engine's weights must put the original weights back before they finish (see `restore_engine_weights`).
"""

from __future__ import annotations

import time

import pytest

ROLLOUT_MAX_MODEL_LEN = 512
ROLLOUT_KV_CACHE_BYTES = 64 * 2**20  # the tiny model needs 1 KiB of KV per token: ~64k tokens


@pytest.fixture(scope="session")
def rollout_vllm_engine(ray_cluster, tiny_model_dir):
    """A `VLLMEngine` Ray actor on the tiny fp32 model (prefix caching on, eager, seed 0)."""
    from rlhfkit.rollout.vllm_engine import create_vllm_engines

    start = time.perf_counter()
    [engine] = create_vllm_engines(
        1,
        tiny_model_dir,
        enforce_eager=True,
        enable_prefix_caching=True,
        max_model_len=ROLLOUT_MAX_MODEL_LEN,
        cpu_kv_cache_bytes=ROLLOUT_KV_CACHE_BYTES,
        dtype="float32",
        seed=0,
        num_cpus_per_engine=0.5,
    )
    print(f"\n[rollout] vLLM engine actor ready in {time.perf_counter() - start:.1f} s")
    yield engine
    ray_cluster.kill(engine)


@pytest.fixture(scope="session")
def rollout_hf_engine(ray_cluster, tiny_model_dir):
    """An `HFEngine` Ray actor on the tiny fp32 model (the `--rollout_backend hf` fallback)."""
    from rlhfkit.rollout.hf_engine import create_hf_engines

    [engine] = create_hf_engines(1, tiny_model_dir, dtype="float32", num_cpus_per_engine=0.5)
    yield engine
    ray_cluster.kill(engine)


QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Say hello.", "Count to three.", "Why is the sky blue?"]


@pytest.fixture(scope="session")
def rollout_prompts(tokenizer) -> list[list[int]]:
    """Token ids of five single-turn chat prompts (generation prompt appended), as the RL loop builds them."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="session")
def trainer_logprobs():
    """`fn(model, prompt, response, temperature=1.0) -> list[float]`: the trainer's `response_log_probs` reference."""
    import torch

    from rlhfkit.models.logprobs import response_log_probs

    def fn(model, prompt: list[int], response: list[int], temperature: float = 1.0) -> list[float]:
        ids = torch.tensor([list(prompt) + list(response)])
        with torch.no_grad():
            logp = response_log_probs(model, ids, torch.ones_like(ids), temperature=temperature)
        return logp[0, len(prompt) - 1:].tolist()

    return fn
