"""Collation: padded and packed batches, packed logits == unpacked logits, dynamic batching and packing."""

from __future__ import annotations

import pytest
import torch
import transformers

from rlhfkit.data.collate import (
    block_causal_mask,
    collate_packed,
    collate_padded,
    model_inputs,
    pack_samples,
    split_by_token_budget,
    unpack,
)

SAMPLES = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
           {"input_ids": [8, 9], "loss_mask": [1, 1]},
           {"input_ids": [10, 11, 12, 13], "loss_mask": [0, 0, 1, 1]}]


def test_collate_padded_right_pads():
    batch = collate_padded(SAMPLES, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [10, 11, 12, 13]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    # the first token of a sample is never a target (nothing predicts it)
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 1, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 0], [0, 1, 2, 3]]
    assert batch["seq_lens"].tolist() == [3, 2, 4]


def test_collate_packed_restarts_positions():
    batch = collate_packed(SAMPLES, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 1, 0, 0, 1, 1]]
    assert batch["seq_lens"].tolist() == [3, 2, 4] and batch["cu_seqlens"].tolist() == [0, 3, 5, 9]
    assert "attention_mask" not in batch


def test_collate_other_keys_for_preference_samples():
    pair = {"chosen_ids": [1, 2, 3], "chosen_loss_mask": [0, 1, 1]}
    batch = collate_padded([pair], pad_token_id=0, keys=("chosen_ids", "chosen_loss_mask"))
    assert batch["input_ids"].tolist() == [[1, 2, 3]] and batch["loss_mask"].tolist() == [[0, 1, 1]]


def test_block_causal_mask():
    allowed = block_causal_mask(torch.tensor([2, 1]))[0, 0] == 0
    assert allowed.tolist() == [[True, False, False], [True, True, False], [False, False, True]]


def _tiny_llama(vocab_size: int, attn: str) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                                      intermediate_size=128, num_hidden_layers=2, vocab_size=vocab_size)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("explicit_mask", [False, True])
def test_packed_logits_equal_unpacked(tokenizer, attn, explicit_mask):
    from rlhfkit.data.sft import build_sft_samples

    rows = [{"input": q, "output": a} for q, a in [("Hi", "Hello there, friend."), ("2+2?", "4"),
                                                     ("Name three colours please", "red, green and blue")]]
    samples, _ = build_sft_samples(rows, tokenizer, input_key="input", output_key="output",
                                   input_template="User: {}\nAssistant: ", apply_chat_template=False, max_len=64)
    model = _tiny_llama(len(tokenizer), attn)
    assert model.config._attn_implementation == attn
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s["input_ids"]])).logits[0] for s in samples]
        packed = collate_packed(samples)
        packed_logits = unpack(model(**model_inputs(packed, explicit_mask=explicit_mask)).logits, packed["seq_lens"])
        padded = collate_padded(samples, pad_token_id=tokenizer.pad_token_id)
        padded_logits = model(**model_inputs(padded)).logits
    for i, ref in enumerate(alone):
        torch.testing.assert_close(packed_logits[i], ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(padded_logits[i, : len(ref)], ref, atol=1e-5, rtol=0)


def test_packing_without_model_inputs_would_leak_across_samples():
    """Guards the reason for use_cache=False: with a cache transformers does not detect packed sequences."""
    model = _tiny_llama(32, "sdpa")
    packed = collate_packed(SAMPLES)
    with torch.no_grad():
        leaky = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits
        exact = model(**model_inputs(packed)).logits
        second = model(input_ids=torch.tensor([SAMPLES[1]["input_ids"]])).logits
    torch.testing.assert_close(exact[0, 3:5], second[0], atol=1e-5, rtol=0)
    assert (leaky[0, 3:5] - second[0]).abs().max() > 1e-3


def test_split_by_token_budget_is_greedy_and_order_preserving():
    samples = [{"input_ids": [0] * n} for n in (3, 4, 2, 9, 1, 1)]
    batches = split_by_token_budget(samples, max_tokens=7)
    assert [[len(s["input_ids"]) for s in b] for b in batches] == [[3, 4], [2], [9], [1, 1]]
    assert [s for b in batches for s in b] == samples  # nothing dropped, order kept
    pairs = [{"chosen_ids": [0] * 3, "rejected_ids": [0] * 2}] * 3
    assert [len(b) for b in split_by_token_budget(pairs, max_tokens=10)] == [2, 1]


def test_pack_samples_first_fit_decreasing():
    samples = [{"input_ids": [i] * n} for i, n in enumerate((5, 3, 6, 2, 4, 12))]
    rows = pack_samples(samples, max_tokens=10)
    lengths = [[len(s["input_ids"]) for s in r] for r in rows]
    assert lengths == [[5, 3, 2], [6, 4], [12]]
    assert sorted(s["input_ids"][0] for r in rows for s in r) == list(range(6))  # every sample once
    assert all(sum(row) <= 10 for row in lengths[:2])
