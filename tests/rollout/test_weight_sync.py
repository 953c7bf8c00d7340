"""Weight-sync conformance: after syncing perturbed trainer weights, the engines' log-probs are the trainer's.

Over both transports: the Ray object store (`sync_weights`) and the torch.distributed broadcast (gloo here; nccl
on GPU, skipped without CUDA). Both engines (vLLM and HF) share the session, so every test here puts the original
weights back on teardown (through `sync_weights` itself: that restore is checked too).
"""

from __future__ import annotations

import pytest
import ray
import torch

from rlhfkit.rollout.types import SamplingConfig
from rlhfkit.rollout.weight_broadcast import WeightBroadcaster, pack_bucket, unpack_bucket
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


@pytest.fixture
def sender(engines, request):
    """`sync(named_tensors, bucket_bytes)` over the transport named by the test's `transport` parameter; gloo
    goes through one `WeightBroadcaster` (closed after the test)."""
    transport = request.getfixturevalue("transport")
    if transport == "ray":
        yield lambda named, bucket_bytes=SMALL_BUCKET: sync_weights(engines, named, bucket_bytes=bucket_bytes)
        return
    broadcaster = WeightBroadcaster(engines, transport)
    yield broadcaster.sync
    broadcaster.close()


@pytest.mark.parametrize("transport", ["ray", "gloo"])
def test_sync_makes_engine_logprobs_match_trainer(transport, engines, sender, tiny_model_dir, rollout_prompts,
                                                  trainer_logprobs):
    from rlhfkit.models.loading import load_causal_lm

    vllm_engine = engines[0]
    long_prompt = [t for p in rollout_prompts for t in p]  # ~190 tokens: several full KV blocks get prefix-cached
    greedy = SamplingConfig(temperature=0, max_new_tokens=8)
    old = ray.get(vllm_engine.generate.remote([long_prompt] + rollout_prompts[:2], greedy))
    prompts, responses = [s.prompt_ids for s in old], [s.response_ids for s in old]
    old_scores = ray.get(vllm_engine.score.remote(prompts, responses))

    trainer = load_causal_lm(tiny_model_dir).eval()
    _perturb(trainer)
    stats = sender(named_weights_for_sync(trainer), SMALL_BUCKET)
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


@pytest.mark.parametrize("transport", ["ray", "gloo"])
def test_sync_after_an_sgd_step(transport, engines, sender, tiny_model_dir, rollout_prompts, trainer_logprobs):
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
    stats = sender(named_weights_for_sync(trainer), 64 * 2**20)
    assert stats.buckets == 1
    want = trainer_logprobs(trainer, rollout_prompts[1], response)
    assert _max_abs_diff(want, old) > 100 * LOGPROB_TOL, "the SGD step should move the log-probs"

    for engine in engines:
        [got] = ray.get(engine.score.remote([rollout_prompts[1]], [response]))
        assert _max_abs_diff(got, want) < LOGPROB_TOL


def test_broadcast_group_is_reused_across_syncs(engines, tiny_model_dir, rollout_prompts, trainer_logprobs):
    """The RL case over gloo: one group, a sync every step (here: perturbed weights, then the originals)."""
    from rlhfkit.models.loading import load_causal_lm

    prompt, response = rollout_prompts[2], [7, 8, 9, 10]
    original = load_causal_lm(tiny_model_dir).eval()
    perturbed = load_causal_lm(tiny_model_dir).eval()
    _perturb(perturbed, scale=0.1)
    broadcaster = WeightBroadcaster(engines, "gloo")
    group = broadcaster.group
    try:
        for model in (perturbed, original, perturbed):
            stats = broadcaster.sync(named_weights_for_sync(model), bucket_bytes=SMALL_BUCKET)
            assert stats.buckets > 1 and broadcaster.group is group
            want = trainer_logprobs(model, prompt, response)
            for engine in engines:
                [got] = ray.get(engine.score.remote([prompt], [response]))
                assert _max_abs_diff(got, want) < LOGPROB_TOL
    finally:
        broadcaster.close()
    with pytest.raises(RuntimeError, match="after close"):
        broadcaster.sync(named_weights_for_sync(original))


def test_one_shot_broadcast_through_sync_weights(engines, tiny_model_dir, rollout_prompts, trainer_logprobs):
    """`sync_weights(..., transport="gloo")` builds a group for one sync and closes it."""
    from rlhfkit.models.loading import load_causal_lm

    trainer = load_causal_lm(tiny_model_dir).eval()
    _perturb(trainer)
    stats = sync_weights(engines, named_weights_for_sync(trainer), bucket_bytes=SMALL_BUCKET, transport="gloo")
    assert stats.tensors == sum(1 for _ in trainer.parameters())
    want = trainer_logprobs(trainer, rollout_prompts[0], [5, 6, 7])
    for engine in engines:
        [got] = ray.get(engine.score.remote([rollout_prompts[0]], [[5, 6, 7]]))
        assert _max_abs_diff(got, want) < LOGPROB_TOL


def test_broadcast_rejects_bad_backends(rollout_hf_engine):
    with pytest.raises(ValueError, match="unknown weight broadcast backend 'mpi'.*--vllm_sync_backend ray"):
        WeightBroadcaster([rollout_hf_engine], "mpi")
    with pytest.raises(ValueError, match="unknown weight sync transport 'tcp'"):
        sync_weights([rollout_hf_engine], [], transport="tcp")
    with pytest.raises(ValueError, match="at least one engine"):
        WeightBroadcaster([], "gloo")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--vllm_sync_backend nccl.*needs CUDA.*use gloo"):
            WeightBroadcaster([rollout_hf_engine], "nccl")


def test_pack_and_unpack_round_trip_mixed_dtypes():
    bucket = [("a", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)), ("c", torch.randn(2, 3).bfloat16()),
              ("d", torch.tensor(1.5)), ("e", torch.zeros(0, 4)), ("f", torch.randn(5).half())]
    meta, buffer = pack_bucket(bucket, torch.device("cpu"))
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    assert [m[0] for m in meta] == list("abcdef")
    for (name, want), (got_name, got) in zip(bucket, unpack_bucket(meta, buffer.clone())):
        assert name == got_name and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 GPUs (NCCL cannot connect two processes on one GPU)")
def test_nccl_broadcast_from_a_gpu_actor(rollout_vllm_engine, tiny_model_dir, rollout_prompts, trainer_logprobs):
    """The GPU transport: a sender on its own GPU (a Ray actor) broadcasts over NCCL into the vLLM engine."""
    from rlhfkit.models.loading import load_causal_lm

    @ray.remote(num_gpus=1)
    class GpuSender:
        def sync(self, engines: list, named: list) -> list:
            from rlhfkit.rollout.weight_broadcast import WeightBroadcaster

            on_gpu = [(name, tensor.cuda()) for name, tensor in named]
            broadcaster = WeightBroadcaster(engines, "nccl")
            try:
                return [broadcaster.sync(on_gpu, SMALL_BUCKET) for _ in range(2)]  # the second reuses the group
            finally:
                broadcaster.close()

    engine = rollout_vllm_engine
    trainer = load_causal_lm(tiny_model_dir).eval()
    _perturb(trainer)
    stats = ray.get(GpuSender.remote().sync.remote([engine], list(named_weights_for_sync(trainer))))
    assert all(s.buckets > 1 for s in stats)
    [got] = ray.get(engine.score.remote([rollout_prompts[0]], [[5, 6, 7]]))
    assert _max_abs_diff(got, trainer_logprobs(trainer, rollout_prompts[0], [5, 6, 7])) < 1e-2  # TF32 on GPU
    sync_weights([engine], named_weights_for_sync(load_causal_lm(tiny_model_dir)))


@pytest.mark.parametrize("transport", ["ray", "gloo"])
def test_a_sync_that_misses_a_parameter_stops_naming_it(engines, sender, tiny_model_dir, transport):
    """Every engine parameter must be written by a sync: one the trainer's names do not reach would keep stale
    values and the engine would sample from another model, silently."""
    from rlhfkit.models.loading import load_causal_lm

    named = [(n, t) for n, t in named_weights_for_sync(load_causal_lm(tiny_model_dir))
             if n != "model.layers.1.post_attention_layernorm.weight"]
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        sender(named)
    message = str(err.value)
    assert "weight sync left 1 of" in message and "model.layers.1.post_attention_layernorm.weight" in message
    assert "parameters unloaded" in message
