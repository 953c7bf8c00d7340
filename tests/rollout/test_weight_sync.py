"""Weight-sync conformance: after syncing perturbed trainer weights, the engines' log-probs are the trainer's.

Both engines (vLLM and HF) share the session, so every test here puts the original weights back on teardown
(through `sync_weights` itself: that restore is checked too).
"""

from __future__ import annotations

import pytest
import ray
import torch

from rlhfkit.rollout.types import SamplingConfig
from rlhfkit.rollout.weight_sync import named_weights_for_sync, sync_weights

LOGPROB_TOL = 1e-4  # fp32 tiny model: measured differences are ~1e-6
SMALL_BUCKET = 64 * 2**10  # 64 KiB: splits the tiny model (12.3 MiB) into many buckets, some mid-layer


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


@pytest.fixture
def engines(rollout_vllm_engine, rollout_hf_engine, tiny_model_dir):
    """Both engine actors; their original weights are synced back (and checked) after the test."""
    from rlhfkit.models.loading import load_causal_lm

    pair = [rollout_vllm_engine, rollout_hf_engine]
    probe = ([[1, 2, 3, 4, 5]], [[6, 7, 8, 9]])
    before = [ray.get(e.score.remote(*probe)) for e in pair]
    yield pair
    original = load_causal_lm(tiny_model_dir)
    sync_weights(pair, named_weights_for_sync(original), bucket_bytes=SMALL_BUCKET)
    after = [ray.get(e.score.remote(*probe)) for e in pair]
    for b, a in zip(before, after):
        assert _max_abs_diff(b[0], a[0]) < 1e-6, "restoring the original weights did not restore the log-probs"


def _perturb(model: torch.nn.Module, scale: float = 0.05) -> None:
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(1234)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def test_sync_makes_engine_logprobs_match_trainer(engines, tiny_model_dir, rollout_prompts, trainer_logprobs):
    from rlhfkit.models.loading import load_causal_lm

    vllm_engine = engines[0]
    long_prompt = [t for p in rollout_prompts for t in p]  # ~190 tokens: several full KV blocks get prefix-cached
    greedy = SamplingConfig(temperature=0, max_new_tokens=8)
    old = ray.get(vllm_engine.generate.remote([long_prompt] + rollout_prompts[:2], greedy))
    prompts, responses = [s.prompt_ids for s in old], [s.response_ids for s in old]
    old_scores = ray.get(vllm_engine.score.remote(prompts, responses))

    trainer = load_causal_lm(tiny_model_dir).eval()
    _perturb(trainer)
    stats = sync_weights(engines, named_weights_for_sync(trainer), bucket_bytes=SMALL_BUCKET)
    n_params = sum(1 for _ in trainer.parameters())
    assert stats.seconds > 0 and stats.buckets > 1 and stats.tensors == n_params
    assert stats.bytes == sum(p.numel() * p.element_size() for p in trainer.parameters())

    expected = [trainer_logprobs(trainer, p, r) for p, r in zip(prompts, responses)]
    for engine in engines:
        scores = ray.get(engine.score.remote(prompts, responses))
        for got, want, was in zip(scores, expected, old_scores):
            assert _max_abs_diff(got, want) < LOGPROB_TOL
            assert _max_abs_diff(got, was) > 100 * LOGPROB_TOL, "the sync did not change the engine's weights"
    # sampling log-probs after the sync (the long prompt's cached prefix must have been dropped)
    for s in ray.get(vllm_engine.generate.remote([long_prompt] + rollout_prompts[:2], greedy)):
        assert _max_abs_diff(s.response_logprobs, trainer_logprobs(trainer, s.prompt_ids, s.response_ids)) < LOGPROB_TOL


def test_sync_after_an_sgd_step(engines, tiny_model_dir, rollout_prompts, trainer_logprobs):
    """The RL case: one optimizer step on the trainer, then sync; one big bucket this time."""
    from rlhfkit.models.loading import load_causal_lm

    response = [11, 22, 33, 44, 55]
    [old] = ray.get(engines[0].score.remote([rollout_prompts[1]], [response]))
    trainer = load_causal_lm(tiny_model_dir)
    ids = torch.tensor([rollout_prompts[0]])
    loss = trainer(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.optim.SGD(trainer.parameters(), lr=50.0).step()
    trainer.eval()
    stats = sync_weights(engines, named_weights_for_sync(trainer))
    assert stats.buckets == 1
    want = trainer_logprobs(trainer, rollout_prompts[1], response)
    assert _max_abs_diff(want, old) > 100 * LOGPROB_TOL, "the SGD step should move the log-probs"

    for engine in engines:
        [got] = ray.get(engine.score.remote([rollout_prompts[1]], [response]))
        assert _max_abs_diff(got, want) < LOGPROB_TOL
