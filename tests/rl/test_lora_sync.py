"""Adapter-only LoRA sync (`ppo --lora_rank R --lora_sync adapter`): the engine serves its base plus the adapter it
was sent, computes the log-probs the LoRA-wrapped trainer computes, and only the adapter's bytes travel."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import torch
from ppo_helpers import run, series

from rlhfkit.data.synthetic import echo_rows, write_jsonl
from rlhfkit.errors import ConfigError
from rlhfkit.rl.setup import lora_engine_rank
from rlhfkit.rl.sync_check import FP32_BOUND
from rlhfkit.rollout.lora_sync import (
    adapter_config,
    adapter_weights,
    engine_max_lora_rank,
    is_adapter_tensor,
    resolve_lora_sync,
)

LORA_RANK = 8


def _cfg(**kw):
    flags = {"lora_sync": "auto", "lora_rank": LORA_RANK, "rollout_backend": "vllm", "load_in_4bit": False, **kw}
    return SimpleNamespace(**flags)


def test_resolve_lora_sync_picks_adapter_only_where_the_engines_serve_the_rank():
    lora8, plain = {"max_lora_rank": 8}, {"max_lora_rank": 0}
    assert resolve_lora_sync(_cfg(), [lora8, lora8])[0] == "adapter"
    mode, reason = resolve_lora_sync(_cfg(), [lora8, plain])
    assert mode == "merged" and "rollout engines [1]" in reason
    assert resolve_lora_sync(_cfg(lora_rank=16), [lora8])[0] == "merged"  # rank over the engine's max
    assert "--load_in_4bit" in resolve_lora_sync(_cfg(load_in_4bit=True), [lora8])[1]
    assert "--rollout_backend hf" in resolve_lora_sync(_cfg(rollout_backend="hf"), [{}])[1]
    assert resolve_lora_sync(_cfg(lora_sync="merged"), [lora8])[0] == "merged"
    with pytest.raises(ConfigError, match="--lora_sync adapter cannot work here: rollout engines \\[0\\]"):
        resolve_lora_sync(_cfg(lora_sync="adapter"), [plain])
    assert [engine_max_lora_rank(r) for r in (1, 2, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]
    with pytest.raises(ConfigError, match="--lora_rank 600"):
        engine_max_lora_rank(600)
    # the engines a run creates get LoRA support exactly when an adapter sync may be used
    assert lora_engine_rank(_cfg()) == 8 and lora_engine_rank(_cfg(lora_rank=12)) == 16
    assert lora_engine_rank(_cfg(lora_sync="merged")) == lora_engine_rank(_cfg(load_in_4bit=True)) == 0
    assert lora_engine_rank(_cfg(lora_rank=0)) == 0


def test_lora_sync_adapter_that_cannot_work_stops_before_ray(tiny_model_dir, tmp_path):
    from rlhfkit.config.parse import flags_to_argv, parse_config
    from rlhfkit.rl.validate import validate_rl

    flags = {"pretrain": tiny_model_dir, "prompt_data": "x.jsonl", "remote_rm_url": "r.py", "lora_sync": "adapter"}
    with pytest.raises(ConfigError, match="--lora_sync adapter cannot work here: --lora_rank is 0"):
        validate_rl(parse_config("ppo", None, flags_to_argv(flags)))
    flags.update(lora_rank=8, rollout_backend="hf")
    with pytest.raises(ConfigError, match="--rollout_backend hf .only vLLM engines serve LoRA"):
        validate_rl(parse_config("ppo", None, flags_to_argv(flags)))
    validate_rl(parse_config("ppo", None, flags_to_argv({**flags, "rollout_backend": "vllm"})))


@pytest.fixture(scope="module")
def lora_engine(ray_cluster, tiny_model_dir):
    """A vLLM engine of its own on the tiny fp32 model with LoRA support (rank 8): the session's engine has none."""
    from rlhfkit.rollout.vllm_engine import create_vllm_engines

    [engine] = create_vllm_engines(1, tiny_model_dir, enforce_eager=True, enable_prefix_caching=True,
                                   max_model_len=256, cpu_kv_cache_bytes=32 * 2**20, dtype="float32", seed=0,
                                   num_cpus_per_engine=0.5, max_lora_rank=engine_max_lora_rank(LORA_RANK))
    yield engine
    ray_cluster.kill(engine)


def _random_adapter(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter_tensor(name):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


@pytest.mark.slow
def test_adapter_sync_matches_the_lora_trainer_and_sends_only_the_adapter(lora_engine, tiny_model_dir, tokenizer):
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.models.logprobs import response_log_probs
    from rlhfkit.models.lora import apply_lora
    from rlhfkit.rollout.types import SamplingConfig
    from rlhfkit.rollout.weight_sync import sync_weights

    model = apply_lora(load_causal_lm(tiny_model_dir), LORA_RANK, lora_alpha=16).eval()
    prompt = tokenizer("Repeat: red cat", add_special_tokens=False)["input_ids"]
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True)
    for seed, transport in ((1, "ray"), (2, "gloo")):  # a second sync replaces the first adapter, over a broadcast
        _random_adapter(model, seed)
        adapter = dict(adapter_weights(model.named_parameters()))
        stats = sync_weights([lora_engine], adapter.items(), transport=transport, lora_config=adapter_config(model))
        assert stats.tensors == len(adapter) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 layers
        assert stats.bytes == sum(t.numel() * t.element_size() for t in adapter.values())
        full = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not is_adapter_tensor(n))
        assert stats.bytes < full / 10
        samples = ray.get(lora_engine.generate.remote([prompt], sampling))
        for sample in samples:  # the engine's log-probs of the tokens it sampled = the LoRA trainer's
            ids = torch.tensor([prompt + sample.response_ids])
            with torch.no_grad():
                want = response_log_probs(model, ids, torch.ones_like(ids))[0, len(prompt) - 1:]
                with model.disable_adapter():
                    base = response_log_probs(model, ids, torch.ones_like(ids))[0, len(prompt) - 1:]
            got = torch.tensor(sample.response_logprobs)
            assert float((got - want).abs().mean()) < FP32_BOUND, (transport, got, want)
            assert float((want - base).abs().mean()) > 1e-2  # the adapter matters: matching the base would fail
    # prefix caching is on: the second adapter's scores are not the first's cached blocks
    [scored] = ray.get(lora_engine.score.remote([prompt], [samples[0].response_ids]))
    assert max(abs(a - b) for a, b in zip(scored, samples[0].response_logprobs)) < 1e-4


@pytest.mark.slow
def test_ppo_lora_run_syncs_the_adapter_only(lora_engine, tiny_model_dir, tmp_path):
    """`ppo --lora_rank 8 --lora_sync adapter` on a LoRA engine: every step's rollouts come from the trained adapter
    (the engine-vs-trainer log-prob diff stays at fp32 noise) and each sync moves the adapter's bytes only."""
    prompts = write_jsonl(echo_rows(8, seed=3), tmp_path / "prompts.jsonl")
    rows = run(tiny_model_dir, prompts, tmp_path, lora_engine, lora_rank=LORA_RANK, lora_alpha=16,
               lora_sync="adapter", rollout_batch_size=4, vllm_sync_backend="gloo")
    assert len(rows) == 2 and all(r["train/grad_norm"] > 0 for r in rows)
    assert max(series(rows, "rollout/logprob_abs_diff_mean")) < 1e-3
    assert max(series(rows, "sync/logprob_diff")) < FP32_BOUND
    # 2 layers x (q, k, v, o, gate, up, down) x r (in + out) fp32 values: the tiny model's shapes
    hidden, inter = 64, 128  # 2 heads of 32 for queries and for keys/values: k and v are hidden wide too
    per_layer = LORA_RANK * (4 * (hidden + hidden) + 3 * (hidden + inter))
    assert series(rows, "sync/bytes") == [2 * per_layer * 4] * 2


def test_cpu_lora_fast_path_equals_vllms_per_token_ops():
    """The single-adapter GEMM path gives what vLLM's reference ops give (and a float64 hand computation), with one
    adapter index for every token and with mixed indices (the fallback)."""
    from vllm.lora.ops.torch_ops import lora_ops

    from rlhfkit.rollout import lora_cpu_ops

    gen = torch.Generator().manual_seed(0)
    x, a = torch.randn(5, 12, generator=gen), torch.randn(2, 1, 4, 12, generator=gen)  # 2 slots of A [r 4, in 12]
    b = torch.randn(2, 1, 9, 4, generator=gen)  # B [out 9, r 4]
    for idx in (torch.ones(5, dtype=torch.long), torch.tensor([0, 1, 1, 0, 1])):
        want = torch.stack([a[i, 0].double() @ x[t].double() for t, i in enumerate(idx.tolist())]) * 0.5
        ours, theirs = torch.zeros(5, 4), torch.zeros(5, 4)
        lora_cpu_ops.bgmv_shrink(x, a, ours, idx, 0.5)
        lora_ops.bgmv_shrink(x, a, theirs, idx, 0.5)
        assert torch.allclose(ours.double(), want, atol=1e-5) and torch.allclose(ours, theirs, atol=1e-5)
        h = torch.randn(5, 4, generator=gen)
        ours, theirs = torch.ones(5, 20), torch.ones(5, 20)
        lora_cpu_ops.bgmv_expand_slice(h, b, ours, idx, 3, 9, add_inputs=True)
        lora_ops.bgmv_expand_slice(h, b, theirs, idx, 3, 9, add_inputs=True)
        assert torch.allclose(ours, theirs, atol=1e-5) and float((ours[:, 3:12] - 1).abs().sum()) > 0
        ours, theirs = torch.zeros(5, 9), torch.zeros(5, 9)
        lora_cpu_ops.bgmv_expand(h, b, ours, idx, add_inputs=False)
        lora_ops.bgmv_expand(h, b, theirs, idx, add_inputs=False)
        assert torch.allclose(ours, theirs, atol=1e-5)
