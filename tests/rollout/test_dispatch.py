"""Prompt balancing across engine actors: contiguous shards, results in the original order, seeds by global index."""

from __future__ import annotations

import ray

from rlhfkit.rollout import generate_on_engines
from rlhfkit.rollout.types import SamplingConfig


def test_two_engines_results_in_order(rollout_vllm_engine, rollout_hf_engine, rollout_prompts):
    cfg = SamplingConfig(temperature=0, max_new_tokens=6, n=2)
    samples = generate_on_engines([rollout_vllm_engine, rollout_hf_engine], rollout_prompts, cfg)
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(i, j) for i in range(5) for j in range(2)]
    assert [s.prompt_ids for s in samples] == [p for p in rollout_prompts for _ in range(2)]
    # prompts 0-2 went to the vLLM engine, 3-4 to the HF engine
    vllm_part = ray.get(rollout_vllm_engine.generate.remote(rollout_prompts[:3], cfg))
    hf_part = ray.get(rollout_hf_engine.generate.remote(rollout_prompts[3:], cfg))
    assert [s.response_ids for s in samples] == [s.response_ids for s in vllm_part + hf_part]


def test_seeded_samples_do_not_depend_on_sharding(rollout_vllm_engine, rollout_prompts):
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=6, n=2, seed=11)
    whole = ray.get(rollout_vllm_engine.generate.remote(rollout_prompts, cfg))
    sharded = generate_on_engines([rollout_vllm_engine] * 3, rollout_prompts, cfg)
    assert [(s.prompt_index, s.response_ids) for s in sharded] == [(s.prompt_index, s.response_ids) for s in whole]
