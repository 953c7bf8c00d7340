"""Partial rollouts (`rlhfkit.rollout.partial`): generation in chunks, resumed token in, token out, with new weights
loaded between two chunks; each token keeps the log-prob and the policy version of the weights that drew it."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from rlhfkit.models.loading import load_causal_lm
from rlhfkit.rollout import generate_on_engines
from rlhfkit.rollout.partial import generate_in_chunks
from rlhfkit.rollout.types import SamplingConfig
from rlhfkit.rollout.weight_sync import named_weights_for_sync, sync_weights

LOGPROB_TOL = 1e-4  # fp32 tiny model: engine vs trainer log-probs differ by ~1e-6 (tests/rollout/test_engines.py)


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_chunked_generation_equals_one_call_and_records_each_chunks_version(rollout_vllm_engine, rollout_prompts,
                                                                            tiny_model_dir, tiny_model_weights,
                                                                            trainer_logprobs):
    greedy = SamplingConfig(temperature=0, max_new_tokens=8, n=2)
    whole = generate_on_engines([rollout_vllm_engine], rollout_prompts, greedy)
    calls: list[int] = []

    @contextmanager
    def counting(chunk: int):
        calls.append(chunk)
        yield len(calls) - 1  # the "policy version": one per chunk

    chunked = generate_in_chunks([rollout_vllm_engine], rollout_prompts, greedy, 3, counting)
    assert calls == [0, 1, 2]  # 3 + 3 + 2 tokens
    assert [(s.prompt_index, s.sample_index, s.prompt_ids) for s in chunked] == \
        [(s.prompt_index, s.sample_index, s.prompt_ids) for s in whole]
    for a, b in zip(chunked, whole):  # greedy: resuming from prompt + partial tokens changes nothing
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
        assert _max_abs_diff(a.response_logprobs, b.response_logprobs) < LOGPROB_TOL
        assert a.extra["policy_versions"] == [0, 0, 0, 1, 1, 1, 2, 2][:len(a.response_ids)]

    # new weights between chunk 0 and chunk 1: each chunk's log-probs are those of the weights that sampled it
    perturbed = load_causal_lm(tiny_model_dir).eval()
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(1234)
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.05)

    @contextmanager
    def swapping(chunk: int):
        if chunk == 1:
            sync_weights([rollout_vllm_engine], named_weights_for_sync(perturbed))
        yield chunk

    one = SamplingConfig(temperature=0, max_new_tokens=6, n=1)
    try:
        mixed = generate_in_chunks([rollout_vllm_engine], rollout_prompts[:3], one, 3, swapping)
    finally:
        sync_weights([rollout_vllm_engine], tiny_model_weights)
    original = load_causal_lm(tiny_model_dir).eval()
    for s in mixed:
        assert s.extra["policy_versions"] == [0, 0, 0, 1, 1, 1]
        old = trainer_logprobs(original, s.prompt_ids, s.response_ids)
        new = trainer_logprobs(perturbed, s.prompt_ids, s.response_ids)
        assert _max_abs_diff(s.response_logprobs[:3], old[:3]) < LOGPROB_TOL
        assert _max_abs_diff(s.response_logprobs[3:], new[3:]) < LOGPROB_TOL
        assert _max_abs_diff(old[3:], new[3:]) > 100 * LOGPROB_TOL  # the swap mattered
