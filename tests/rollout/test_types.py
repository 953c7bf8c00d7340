"""Unit tests of the backend-neutral pieces: sampling config, sample records, sharding, bucketing (no Ray)."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.config.parse import parse_config
from rlhfkit.launch.engine_spec import sampling_config
from rlhfkit.rollout.buckets import iter_buckets
from rlhfkit.rollout.dispatch import shard_bounds
from rlhfkit.rollout.types import RolloutSample, SamplingConfig
from rlhfkit.rollout.weight_sync import named_weights_for_sync


def test_sampling_config_from_flags():  # ppo's rollout group
    from rlhfkit.models.logprobs import SamplingTruncation

    opts = parse_config("ppo", None, ["--temperature", "0.7", "--top_p", "0.9", "--generate_max_len", "33",
                                      "--n_samples_per_prompt", "4", "--top_k", "20"])
    cfg = sampling_config(opts, seed=5, stop_token_ids=[2])
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens, cfg.n, cfg.seed) == (0.7, 0.9, 20, 33, 4, 5)
    assert cfg.stop_token_ids == (2,)
    assert cfg.truncation == SamplingTruncation(top_k=20, top_p=0.9)
    plain = sampling_config(parse_config("ppo", None, []), seed=5)
    assert (plain.top_k, plain.top_p, plain.truncation) == (0, 1.0, None)  # the defaults cut nothing
    greedy = SamplingConfig(temperature=0.0, top_k=20, top_p=0.9)
    assert greedy.truncation is None  # vLLM's greedy path takes the argmax of the whole distribution
    with pytest.raises(ValueError, match="top_k"):
        SamplingConfig(top_k=-1)


def test_sampling_config_from_the_batch_inference_flags():
    opts = parse_config("batch-inference", None, ["--temperature", "0.7", "--top_p", "0.8", "--max_new_tokens", "21",
                                                  "--best_of_n", "3", "--top_k", "7"])
    cfg = sampling_config(opts, None)
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.max_new_tokens, cfg.n, cfg.seed) == (0.7, 0.8, 7, 21, 3, None)
    greedy_flags = parse_config("batch-inference", None, ["--temperature", "0.7", "--greedy_sampling"])
    greedy = sampling_config(greedy_flags, 1)
    assert greedy.temperature == 0.0 and greedy.greedy


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"max_new_tokens": 0}, {"n": 0}]
)
def test_sampling_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match="SamplingConfig"):
        SamplingConfig(**kwargs)


def test_seeds_follow_global_prompt_index():
    cfg = SamplingConfig(n=3, seed=100)
    assert [cfg.sample_seed(1, j) for j in range(3)] == [103, 104, 105]
    shard = cfg.shifted(1)
    assert shard.sample_seed(0, 2) == cfg.sample_seed(1, 2)
    assert SamplingConfig(n=3).sample_seed(1, 1) is None


def test_rollout_sample_checks_lengths():
    with pytest.raises(ValueError, match="log-probs"):
        RolloutSample(0, 0, [1], [2, 3], [-1.0], "length")


def test_shard_bounds_contiguous_and_even():
    assert shard_bounds(5, 2) == [(0, 3), (3, 5)]
    assert shard_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError):
        shard_bounds(3, 0)


def test_iter_buckets_bounds_size_and_keeps_order():
    tensors = [(f"t{i}", torch.zeros(10)) for i in range(5)]  # 40 bytes each
    buckets = list(iter_buckets(tensors, bucket_bytes=100))
    assert [[n for n, _ in b] for b in buckets] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    big = list(iter_buckets([("big", torch.zeros(100))], bucket_bytes=16))
    assert len(big) == 1 and big[0][0][0] == "big"


def test_named_weights_skip_tied_duplicates():
    emb = torch.nn.Embedding(4, 2)
    model = torch.nn.ModuleDict({"embed": emb, "head": torch.nn.Linear(2, 4, bias=False)})
    model["head"].weight = emb.weight
    assert [n for n, _ in named_weights_for_sync(model)] == ["embed.weight"]


def test_engine_options_from_either_commands_flags():
    from rlhfkit.launch.engine_spec import vllm_engine_spec

    common = ["--vllm_gpu_memory_utilization", "0.9", "--vllm_kv_cache_mb", "128", "--enforce_eager",
              "--prompt_max_len", "100"]
    rollout = parse_config("ppo", None, [*common, "--vllm_tensor_parallel_size", "2", "--generate_max_len", "28"])
    inference = parse_config("batch-inference", None, [*common, "--tp_size", "2", "--max_new_tokens", "28"])
    opts = vllm_engine_spec(rollout, dtype="fp32", seed=3).kwargs()
    assert opts == vllm_engine_spec(inference, dtype="fp32", seed=3).kwargs()  # one builder, the same engines
    assert opts["cpu_kv_cache_bytes"] == 128 * 2**20 and opts["max_model_len"] == 128
    assert opts["tensor_parallel_size"] == 2 and opts["dtype"] == "float32" and opts["seed"] == 3
