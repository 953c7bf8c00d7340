"""apply_lora / merge_lora on the tiny models."""

from __future__ import annotations

import torch

from rlhfkit.models.loading import load_causal_lm, load_scalar_model, scalar_outputs
from rlhfkit.models.lora import apply_lora, merge_lora

IDS = torch.tensor([[1, 57, 905, 330, 12, 2]])


def _perturb_adapters(model) -> None:
    """Give lora_B non-zero values (fresh adapters are a no-op), as a little training would."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def test_apply_lora_trains_only_adapters(tiny_model_dir):
    model = apply_lora(load_causal_lm(tiny_model_dir), lora_rank=4, lora_alpha=8, target_modules=["all-linear"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_merge_lora_causal_matches_adapter_model(tiny_model_dir, tmp_path):
    model = apply_lora(load_causal_lm(tiny_model_dir), lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    _perturb_adapters(model)
    model.save_pretrained(tmp_path / "adapter")
    merged_dir = merge_lora(tiny_model_dir, tmp_path / "adapter", tmp_path / "merged")
    merged = load_causal_lm(merged_dir)
    base = load_causal_lm(tiny_model_dir)
    with torch.no_grad():
        expected = model(IDS).logits
        assert torch.allclose(merged(IDS).logits, expected, atol=1e-5)
        assert not torch.allclose(base(IDS).logits, expected, atol=1e-4)
    assert not any("lora" in k for k in merged.state_dict())


def test_merge_lora_scalar_keeps_trained_head(tiny_reward_model_dir, tmp_path):
    model = apply_lora(load_scalar_model(tiny_reward_model_dir), lora_rank=4)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("score" in n for n in trainable) and not any("score" in n and "lora_" in n for n in trainable)
    _perturb_adapters(model)
    with torch.no_grad():
        model.base_model.model.score.modules_to_save["default"].weight.add_(0.5)
    model.save_pretrained(tmp_path / "adapter")
    merged = load_scalar_model(merge_lora(tiny_reward_model_dir, tmp_path / "adapter", tmp_path / "merged"),
                               init_from_causal=False)
    mask = torch.ones_like(IDS)
    with torch.no_grad():
        expected, _ = scalar_outputs(model, IDS, mask)
        got, _ = scalar_outputs(merged, IDS, mask)
        base, _ = scalar_outputs(load_scalar_model(tiny_reward_model_dir), IDS, mask)
    assert torch.allclose(got, expected, atol=1e-5) and not torch.allclose(base, expected, atol=1e-3)


def test_merged_weights_stream_equals_peft_merge_and_unload(tiny_model_dir):
    """The weights the rollout engines receive from a LoRA actor: base names, W + scaling * B @ A."""
    from rlhfkit.models.lora import merged_weights

    model = apply_lora(load_causal_lm(tiny_model_dir), lora_rank=4, lora_alpha=8, target_modules=["all-linear"])
    _perturb_adapters(model)
    streamed = dict(merged_weights(model, ((n, p.detach()) for n, p in model.named_parameters())))
    reference = dict(model.merge_and_unload().named_parameters())  # peft's own merge (tied weights once)
    assert list(streamed) == list(reference)
    base = dict(load_causal_lm(tiny_model_dir).named_parameters())
    changed = 0
    for name, tensor in streamed.items():
        assert torch.allclose(tensor, reference[name], atol=1e-6), name
        changed += int(not torch.equal(tensor, base[name]))
    assert changed == 7 * 2  # every adapted linear of both layers moved


def test_merged_weights_pass_a_plain_model_through(tiny_model_dir):
    from rlhfkit.models.lora import merged_weights

    model = load_causal_lm(tiny_model_dir)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    assert list(merged_weights(model, iter(named))) == named
