"""resolve_pretrain / load_* / save_hf / scalar_outputs on the tiny models."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from rlhfkit.models.loading import (
    load_causal_lm,
    load_scalar_model,
    load_tokenizer,
    resolve_pretrain,
    save_hf,
    scalar_outputs,
)


def test_resolve_local_dir_relative_and_absolute(tiny_model_dir, monkeypatch):
    path = Path(tiny_model_dir)
    assert resolve_pretrain(tiny_model_dir) == str(path.resolve())
    monkeypatch.chdir(path.parent)
    assert resolve_pretrain(f"./{path.name}") == str(path.resolve())


@pytest.mark.parametrize("name", ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", "org/model-v1.5"])
def test_hub_names_pass_through(name):
    assert resolve_pretrain(name) == name


@pytest.mark.parametrize("spec", ["/no/such/model_dir", "./no_such_model", "no_such_model.gguf", "a/b/c", "~/nope"])
def test_missing_path_error_names_path_and_forms(spec):
    with pytest.raises(FileNotFoundError) as info:
        resolve_pretrain(spec)
    message = str(info.value)
    assert spec in message
    assert "embedded:smollm2-135m-instruct" in message and ".gguf" in message and "hub name" in message


def test_wrong_kinds_of_path_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        resolve_pretrain(str(tmp_path))
    text_file = tmp_path / "weights.bin"
    text_file.write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_pretrain(str(text_file))
    with pytest.raises(ValueError, match="unknown embedded model"):
        resolve_pretrain("embedded:gpt-5")


def test_load_tokenizer_padding(tiny_model_dir, tmp_path):
    left = load_tokenizer(tiny_model_dir)
    right = load_tokenizer(tiny_model_dir, padding_side="right")
    batch = ["hello there world", "hi"]
    left_ids = left(batch, padding=True, return_tensors="pt")
    right_ids = right(batch, padding=True, return_tensors="pt")
    assert left_ids.attention_mask[1, 0] == 0 and left_ids.attention_mask[1, -1] == 1
    assert right_ids.attention_mask[1, 0] == 1 and right_ids.attention_mask[1, -1] == 0
    assert left_ids.input_ids[1, 0] == left.pad_token_id == left.eos_token_id
    # a tokenizer saved without a pad token gets eos as pad
    raw = AutoTokenizer.from_pretrained(tiny_model_dir)
    raw.pad_token = None
    folder = tmp_path / "no_pad"
    raw.save_pretrained(folder)
    shutil.copy(Path(tiny_model_dir) / "config.json", folder / "config.json")
    assert AutoTokenizer.from_pretrained(folder).pad_token is None
    assert load_tokenizer(str(folder)).pad_token == raw.eos_token


def test_load_causal_lm_dtype_and_attention(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir, dtype=torch.bfloat16, attn_implementation="eager")
    assert model.dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"
    assert model.config.pad_token_id == 2


def test_scalar_head_save_and_reload_identical(tiny_model_dir, tokenizer, tmp_path):
    torch.manual_seed(0)
    model = load_scalar_model(tiny_model_dir)
    assert model.score.weight.shape == (1, 64) and model.config.pad_token_id == tokenizer.pad_token_id
    with pytest.raises(ValueError, match="no scalar head"):
        load_scalar_model(tiny_model_dir, init_from_causal=False)
    out = save_hf(model, tokenizer, tmp_path / "rm", extra_config={"reward_mean": 0.25, "reward_std": 2.0})
    assert (Path(out) / "model.safetensors").is_file() and (Path(out) / "tokenizer.json").is_file()
    config = AutoConfig.from_pretrained(out)
    assert (config.reward_mean, config.reward_std) == (0.25, 2.0)
    reloaded = AutoModelForSequenceClassification.from_pretrained(out)
    again = load_scalar_model(out, init_from_causal=False)
    batch = tokenizer(["The sky is blue.", "No"], padding=True, return_tensors="pt")
    saved = model.state_dict()
    for other in (reloaded, again):
        assert other.state_dict().keys() == saved.keys()
        assert all(torch.equal(value, saved[key]) for key, value in other.state_dict().items())
    with torch.no_grad():
        reference = scalar_outputs(model, batch.input_ids, batch.attention_mask)
        for other in (reloaded, again):  # same weights; kernels may round differently (memory layout), so 1e-6
            last, tokens = scalar_outputs(other, batch.input_ids, batch.attention_mask)
            assert torch.allclose(last, reference[0], rtol=0, atol=1e-6)
            assert torch.allclose(tokens, reference[1], rtol=0, atol=1e-6)
        hf_logits = reloaded(**batch).logits.squeeze(-1)
    assert torch.allclose(hf_logits, reference[0], atol=1e-6)


def test_scalar_outputs_reads_last_real_token(tiny_reward_model_dir):
    model = load_scalar_model(tiny_reward_model_dir)
    a, b = [1, 57, 905, 2], [1, 3000, 2, 2, 77]  # b has the pad id (= eos) inside the text
    pad = 2
    right = torch.tensor([a + [pad], b])
    right_mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[pad] + a, b])
    left_mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        alone_a, tokens_a = scalar_outputs(model, torch.tensor([a]), torch.ones(1, 4, dtype=torch.long))
        alone_b, _ = scalar_outputs(model, torch.tensor([b]), torch.ones(1, 5, dtype=torch.long))
        for ids, mask in ((right, right_mask), (left, left_mask)):
            last, tokens = scalar_outputs(model, ids, mask)
            assert last.shape == (2,) and tokens.shape == (2, 5) and last.dtype == torch.float32
            assert torch.allclose(last, torch.cat([alone_a, alone_b]), atol=1e-5)
        # per-token values are the head on the final hidden states
        hidden = model.model(input_ids=torch.tensor([a])).last_hidden_state
        assert torch.allclose(tokens_a, model.score(hidden).squeeze(-1), atol=1e-6)
    assert len(set(tokens_a[0].tolist())) == 4  # distinct per position: the head really sees each token
    with pytest.raises(ValueError, match="all-zero"):
        scalar_outputs(model, right, torch.tensor([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0]]))
