"""Reward model source on the tiny scalar model: last-token values equal HF's sequence-classification output."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from rlhfkit.models.loading import load_scalar_model
from rlhfkit.rewards.reward_model import RewardModelSource
from rlhfkit.rewards.sources import CombinedSource

QUERIES = ["<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello there!<|im_end|>",
           "short", "a somewhat longer query with many more words in it than the others",
           "ends with eos already<|im_end|><|im_end|>", "2 + 2 = 4"]


@pytest.fixture(scope="module")
def rm(tiny_reward_model_dir):
    return RewardModelSource(tiny_reward_model_dir, micro_batch_size=2, device="cpu")


@pytest.fixture(scope="module")
def hf_reference(tiny_reward_model_dir, rm):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir, dtype=torch.float32).eval()
    model.config.pad_token_id = None  # one unpadded sequence per call: HF pools at its last token

    @torch.no_grad()
    def score(query: str, max_len: int = 10_000) -> float:
        ids = torch.tensor([rm.encode(query)[-max_len:]])
        return float(model(input_ids=ids).logits[0, 0])

    return score


def test_matches_hf_last_token_outputs(rm, hf_reference):
    out = rm(QUERIES, [""] * len(QUERIES), None)
    expected = torch.tensor([hf_reference(q) for q in QUERIES])
    assert out.rewards.dtype == torch.float32 and out.rewards.shape == (len(QUERIES),)
    assert torch.isfinite(out.rewards).all()
    torch.testing.assert_close(out.rewards, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.scores, out.rewards)
    assert out.extra_logs["rm_truncated"].tolist() == [0.0] * len(QUERIES)


def test_eos_is_appended_once(rm):
    eos = rm.tokenizer.eos_token_id
    assert rm.encode("abc")[-1] == eos and rm.encode("abc" + rm.tokenizer.eos_token * 2) == rm.encode("abc")


def test_truncation_keeps_the_end(tiny_reward_model_dir, rm, hf_reference):
    short = RewardModelSource(tiny_reward_model_dir, model=rm.model, tokenizer=rm.tokenizer, max_len=4,
                              micro_batch_size=None)
    out = short(QUERIES[:3])
    assert out.extra_logs["rm_truncated"].tolist() == [1.0, 0.0, 1.0]
    expected = torch.tensor([hf_reference(q, max_len=4) for q in QUERIES[:3]])
    torch.testing.assert_close(out.rewards, expected, atol=1e-5, rtol=1e-5)


def test_normalize_reward_reads_config_stats(tiny_reward_model_dir, rm, caplog):
    model = load_scalar_model(tiny_reward_model_dir)
    model.config.reward_mean, model.config.reward_std = 0.5, 2.0
    normed = RewardModelSource("rm", model=model, tokenizer=rm.tokenizer, normalize_reward=True)
    torch.testing.assert_close(normed(QUERIES).rewards, (rm(QUERIES).rewards - 0.5) / 2.0, atol=1e-5, rtol=1e-5)
    del model.config.reward_mean
    with caplog.at_level(logging.WARNING):
        plain = RewardModelSource("rm", model=model, tokenizer=rm.tokenizer, normalize_reward=True)
    assert "no reward_mean/reward_std" in caplog.text and (plain.mean, plain.std) == (0.0, 1.0)


def test_two_reward_models_combined(rm):
    single = rm(QUERIES).rewards
    out = CombinedSource([rm, rm], "sum")(QUERIES, None, None)
    torch.testing.assert_close(out.rewards, 2 * single)
    torch.testing.assert_close(CombinedSource([rm, rm])(QUERIES).rewards, single)
    assert {f"{rm.name}/reward", f"{rm.name}#2/reward"} <= set(out.extra_logs)
