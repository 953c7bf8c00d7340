"""Tiny test models: shape, tokenizer, determinism."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from rlhfkit.models.tiny import build_tiny_causal_lm


def test_tiny_causal_lm_shape_and_tokenizer(tiny_model_dir, tokenizer):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 2)
    assert config.head_dim == 32 and config.intermediate_size == 128 and config.tie_word_embeddings
    assert config.vocab_size == len(tokenizer) == 49152
    assert (Path(tiny_model_dir) / "model.safetensors").is_file()
    assert tokenizer.pad_token == "<|im_end|>" and tokenizer.padding_side == "left"
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.dtype == torch.float32


def test_tiny_is_deterministic_from_seed(tmp_path, tiny_model_dir):
    again = load_file(Path(build_tiny_causal_lm(str(tmp_path / "a"))) / "model.safetensors")
    first = load_file(Path(tiny_model_dir) / "model.safetensors")
    other = load_file(Path(build_tiny_causal_lm(str(tmp_path / "b"), seed=1)) / "model.safetensors")
    assert again.keys() == first.keys()
    assert all(torch.equal(again[k], first[k]) for k in first)
    assert not torch.equal(other["model.embed_tokens.weight"], first["model.embed_tokens.weight"])
