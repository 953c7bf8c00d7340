"""Fixtures for the models tests: a tiny GGUF file (small vocabulary, so parsing it is quick)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from rlhfkit.models.loading import embedded_gguf_path
from rlhfkit.models.tiny import tiny_config, tiny_tokenizer

TINY_GGUF_VOCAB = 1024  # SmolLM2's first 1024 tokens: its specials, the 256 byte symbols and the first merges
_COPIED_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                "tokenizer.ggml.add_bos_token", "tokenizer.chat_template")


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py); transformers undoes it when loading GGUF."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def _gguf_names(num_layers: int) -> dict[str, str]:
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for layer in range(num_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{layer}.{hf}.weight"] = f"blk.{layer}.{gg}.weight"
    return names


def write_tiny_gguf(model: LlamaForCausalLM, out_file: Path, source) -> Path:
    """Write ``model`` as an F32 llama GGUF whose tokenizer is SmolLM2's (``source``, a GGUFReader) cut to size."""
    import gguf

    config = model.config
    vocab = config.vocab_size
    tokens = source.fields["tokenizer.ggml.tokens"].contents()[:vocab]
    kept = set(tokens)
    merges = [m for m in source.fields["tokenizer.ggml.merges"].contents()
              if all(part in kept for part in m.split(" ")) and m.replace(" ", "") in kept]
    writer = gguf.GGUFWriter(str(out_file), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(vocab)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_token_list(tokens)
    writer.add_token_types(source.fields["tokenizer.ggml.token_type"].contents()[:vocab])
    writer.add_token_merges(merges)
    for key in _COPIED_KEYS:
        field = source.fields[key]
        writer.add_key_value(key, field.contents(), gguf.GGUFValueType(field.types[0]))
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for hf_name, gguf_name in _gguf_names(config.num_hidden_layers).items():
        tensor = state[hf_name]
        if gguf_name.endswith("attn_q.weight"):
            tensor = _llama_cpp_permute(tensor, config.num_attention_heads)
        elif gguf_name.endswith("attn_k.weight"):
            tensor = _llama_cpp_permute(tensor, config.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(tensor, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_file


@pytest.fixture(scope="session")
def embedded_reader():
    """A GGUFReader on the embedded SmolLM2 file (parsing its metadata takes seconds: do it once)."""
    from gguf import GGUFReader

    return GGUFReader(str(embedded_gguf_path("smollm2-135m-instruct")))


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, embedded_reader) -> tuple[Path, LlamaForCausalLM]:
    """A tiny F32 GGUF (vocabulary 1024) and the in-memory model it was written from."""
    config = tiny_config(tiny_tokenizer())
    config.vocab_size = TINY_GGUF_VOCAB
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = write_tiny_gguf(model, tmp_path_factory.mktemp("tiny_gguf") / "tiny-llama.F32.gguf",
                           embedded_reader)
    return path, model
