"""QLoRA (--load_in_4bit --lora_rank): the base loads in bitsandbytes NF4, the adapters train, the saved adapter loads
with peft onto the 4-bit base and reproduces the trained model's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhfkit.config.parse import flags_to_argv
from rlhfkit.data.synthetic import echo_rows, write_jsonl
from rlhfkit.errors import ConfigError

pytestmark = pytest.mark.slow


def test_sft_load_in_4bit_trains_lora_on_an_nf4_base_and_the_adapter_reloads(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.cli.sft import main as sft_main
    from rlhfkit.models.loading import one_4bit_path, quantization_kwargs
    from rlhfkit.trainers import loop

    data = write_jsonl(echo_rows(32, seed=3), tmp_path / "train.jsonl")
    ids = AutoTokenizer.from_pretrained(tiny_model_dir)("Repeat: cat dog", return_tensors="pt").input_ids
    seen = {}
    save = loop.save_hf_folder

    def logits_then_save(model, tokenizer, out_dir, *args, **kwargs):  # the trained model's own forward
        layer = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
        seen["base_layer"] = type(layer).__name__
        seen["trainable"] = sorted({n.split(".")[-2] for n, p in model.named_parameters() if p.requires_grad})
        model.eval()
        with torch.no_grad():
            seen["logits"] = model(input_ids=ids).logits.float().clone()
        return save(model, tokenizer, out_dir, *args, **kwargs)

    monkeypatch.setattr(loop, "save_hf_folder", logits_then_save)
    flags = {"pretrain": tiny_model_dir, "dataset": data, "input_key": "input", "output_key": "output",
             "apply_chat_template": True, "max_len": 64, "train_batch_size": 8, "micro_train_batch_size": 8,
             "max_epochs": 2, "learning_rate": 1e-2, "lr_warmup_ratio": 0.0, "param_dtype": "fp32", "seed": 3,
             "load_in_4bit": True, "lora_rank": 8, "lora_alpha": 16,
             "run_dir": str(tmp_path / "run"), "save_path": str(tmp_path / "adapter")}
    sft_main(flags_to_argv(flags))
    assert seen["base_layer"] == "Linear4bit"
    assert seen["trainable"] == ["default"]  # only lora_A.default / lora_B.default
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses[-1] < losses[0] - 0.05, losses
    saved = Path(tmp_path / "adapter")
    assert (saved / "adapter_config.json").is_file() and (saved / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                **quantization_kwargs(True, torch.float32))
    one_4bit_path(base)  # as rlhfkit loads 4-bit models: the training arithmetic in eval too (AVX512-BF16 CPUs)
    reloaded = PeftModel.from_pretrained(base, saved).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=ids).logits
    torch.testing.assert_close(logits, seen["logits"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="--load_in_4bit needs --lora_rank"):
        sft_main(flags_to_argv({**flags, "lora_rank": 0, "run_dir": str(tmp_path / "run2")}))
