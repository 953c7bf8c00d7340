"""QLoRA on CPUs with AVX512-BF16/AMX: bitsandbytes 0.50 repacks a 4-bit layer's weights into a CPU layout at its
first no-grad eval forward and computes it with a bf16 kernel from then on. rlhfkit keeps one arithmetic (the
training forward's: dequantize, then a matmul in the compute dtype) and dequantizes the repacked layout correctly
for the weight sync (`rlhfkit.models.loading.one_4bit_path`, `rlhfkit.rl.worker_weights`). On an AVX2 CPU
bitsandbytes never repacks, so the first test holds trivially there; the second forces the repacking anywhere."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")


def _qlora(tiny_model_dir):
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.models.lora import apply_lora

    model = apply_lora(load_causal_lm(tiny_model_dir, load_in_4bit=True), 8, 16, None, 0.0)
    torch.manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # as after training: the adapters change the model
            param.data.normal_(0, 0.05)
    return model.eval()


def _engine_view_log_probs(tiny_model_dir, model, ids):
    """What an fp32 engine computes from the weights the sync sends (dequantized base, adapters merged)."""
    from rlhfkit.models.loading import load_causal_lm
    from rlhfkit.rl.worker_weights import weights_for_engines

    engine = load_causal_lm(tiny_model_dir)
    engine.load_state_dict(dict(weights_for_engines(model, torch.float32)), strict=False)
    with torch.no_grad():
        return torch.log_softmax(engine.eval()(input_ids=ids).logits.float(), -1)


def test_the_trainer_eval_forward_and_the_synced_weights_compute_one_model(tiny_model_dir):
    model = _qlora(tiny_model_dir)
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        trainer = torch.log_softmax(model(input_ids=ids).logits.float(), -1)  # an eval forward (may repack)
    engine = _engine_view_log_probs(tiny_model_dir, model, ids)
    assert (trainer - engine).abs().max().item() < 1e-4  # was 0.9-1.0 on AVX512-BF16 CPUs


def test_a_repacked_layer_is_dequantized_from_its_own_layout(tiny_model_dir):
    import bitsandbytes.functional as bnb_functional

    model = _qlora(tiny_model_dir)
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(1))
    before = _engine_view_log_probs(tiny_model_dir, model, ids)
    layer = next(m for n, m in model.named_modules() if n.endswith("layers.0.self_attn.q_proj.base_layer"))
    layer.weight.data, layer.weight.quant_state = bnb_functional._convert_weight_packed_for_cpu(
        layer.weight.data, layer.weight.quant_state)  # what bitsandbytes does on an AVX512-BF16 CPU
    assert layer.weight.quant_state.packing_format_for_cpu
    after = _engine_view_log_probs(tiny_model_dir, model, ids)
    assert (after - before).abs().max().item() < 1e-4  # the inverse keeps the scales to ~1e-5; unfixed: ~1
