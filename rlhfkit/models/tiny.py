"""Tiny random-init models for tests and demos: real tokenizer and chat template, toy-sized weights.

They are Llama-family models shaped like SmolLM2 (tied embeddings, same vocabulary) but with 2 layers
and hidden size 64, so every loader path (``from_pretrained``, vLLM, FSDP2) is the real one and runs in
seconds. Attention uses 2 heads of size 32: vLLM's CPU attention rejects head_dim 16.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rlhfkit.models.loading import resolve_pretrain, save_hf

TOKENIZER_SOURCE = "embedded:smollm2-135m-instruct"
HEAD_DIM = 32


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's tokenizer and chat template (from the cached embedded conversion)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrain(TOKENIZER_SOURCE), local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        raise RuntimeError(f"the tokenizer of {TOKENIZER_SOURCE} lost its chat template; delete the rlhfkit cache")
    return tokenizer


def tiny_config(tokenizer: PreTrainedTokenizerBase, *, num_layers: int = 2, hidden: int = 64,
                num_labels: int | None = None) -> LlamaConfig:
    """A SmolLM2-shaped Llama config shrunk to ``num_layers`` x ``hidden`` (heads of size 32, MLP 2x hidden)."""
    if hidden % HEAD_DIM:
        raise ValueError(f"hidden={hidden} must be a multiple of the head size {HEAD_DIM}")
    heads = hidden // HEAD_DIM
    # rope_theta: transformers 5 reads it into rope_parameters (its type stubs no longer list it)
    extra: dict[str, Any] = {"rope_theta": 100000.0}
    if num_labels is not None:
        extra["num_labels"] = num_labels
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


def _build(model_cls: type[PreTrainedModel], out_dir: str, *, seed: int, num_layers: int, hidden: int,
           num_labels: int | None, tokenizer: PreTrainedTokenizerBase | None = None) -> str:
    tokenizer = tokenizer if tokenizer is not None else tiny_tokenizer()
    config = tiny_config(tokenizer, num_layers=num_layers, hidden=hidden, num_labels=num_labels)
    with torch.random.fork_rng(devices=[]):  # deterministic from the seed, global RNG left untouched
        torch.manual_seed(seed)
        model: Any = model_cls(config)
        model = model.to(torch.float32)
    model.eval()
    return save_hf(model, tokenizer, os.fspath(out_dir))


def build_tiny_causal_lm(out_dir: str, *, seed: int = 0, num_layers: int = 2, hidden: int = 64,
                         tokenizer: PreTrainedTokenizerBase | None = None) -> str:
    """Write a random-init tiny ``LlamaForCausalLM`` (fp32 safetensors + SmolLM2 tokenizer) to ``out_dir``.

    Deterministic from ``seed``. Returns ``out_dir``. The first call on a machine converts the embedded
    SmolLM2 GGUF (for its tokenizer); later calls take about a second. ``tokenizer``: use this one instead (a machine
    without the embedded model, e.g. the GPU check's, which carries SmolLM2's tokenizer files).
    """
    return _build(LlamaForCausalLM, out_dir, seed=seed, num_layers=num_layers, hidden=hidden, num_labels=None,
                  tokenizer=tokenizer)


def build_tiny_scalar_model(out_dir: str, *, seed: int = 0, num_layers: int = 2, hidden: int = 64,
                            tokenizer: PreTrainedTokenizerBase | None = None) -> str:
    """Like :func:`build_tiny_causal_lm` but a ``LlamaForSequenceClassification`` with a 1-output ``score`` head."""
    return _build(LlamaForSequenceClassification, out_dir, seed=seed, num_layers=num_layers, hidden=hidden,
                  num_labels=1, tokenizer=tokenizer)


def build_tiny_moe_causal_lm(out_dir: str, *, seed: int = 0, num_experts: int = 4) -> str:
    """A random-init tiny mixture-of-experts ``Qwen3MoeForCausalLM`` (2 layers, hidden 64, ``num_experts`` experts of
    width 32, top-2 routing, tied embeddings, SmolLM2 tokenizer) in ``out_dir``: what vLLM-CPU serves through its
    fused-MoE kernel, and transformers 5 trains with fused expert weights (``mlp.experts.gate_up_proj``)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = tiny_tokenizer()
    shape: dict[str, Any] = {"head_dim": HEAD_DIM}  # read by Qwen3MoeConfig, not in its type stubs
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                            num_experts=num_experts, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                            max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = Qwen3MoeForCausalLM(config)
        model = model.to(torch.float32)
    model.eval()
    return save_hf(model, tokenizer, os.fspath(out_dir))
