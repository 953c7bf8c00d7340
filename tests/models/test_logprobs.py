"""log_probs_from_logits / entropy_from_logits against float64 loops; response_log_probs on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.models.loading import load_causal_lm
from rlhfkit.models.logprobs import entropy_from_logits, log_probs_from_logits, response_log_probs


def _reference(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 log-prob and entropy, one position at a time, straight from the definitions."""
    batch, length, vocab = logits.shape
    log_probs = torch.zeros(batch, length, dtype=torch.float64)
    entropy = torch.zeros(batch, length, dtype=torch.float64)
    for b in range(batch):
        for t in range(length):
            z = [float(x) for x in logits[b, t].double()]
            top = max(z)
            norm = top + math.log(sum(math.exp(v - top) for v in z))
            log_probs[b, t] = z[int(labels[b, t])] - norm
            entropy[b, t] = -sum(math.exp(v - norm) * (v - norm) for v in z)
    return log_probs, entropy


@pytest.mark.parametrize("chunk_rows", [1, 2, 4])
def test_log_probs_and_entropy_match_float64_loops(chunk_rows):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 11, generator=generator) * 6  # peaky: exercises the max-subtraction
    labels = torch.randint(0, 11, (5, 7), generator=generator)
    ref_lp, ref_h = _reference(logits, labels)
    lp = log_probs_from_logits(logits, labels, chunk_rows=chunk_rows)
    h = entropy_from_logits(logits, chunk_rows=chunk_rows)
    assert lp.dtype == h.dtype == torch.float32 and lp.shape == h.shape == (5, 7)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5) and torch.allclose(h.double(), ref_h, atol=1e-5)
    assert bool((lp <= 0).all()) and bool((h >= 0).all()) and bool((h <= math.log(11) + 1e-5).all())


def test_bf16_logits_are_upcast_and_gradients_flow():
    logits = (torch.randn(2, 3, 50) * 3).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 50, (2, 3))
    lp = log_probs_from_logits(logits, labels)
    ref_lp, _ = _reference(logits.detach().float(), labels)
    assert lp.dtype == torch.float32 and torch.allclose(lp.double(), ref_lp, atol=1e-5)
    lp.sum().backward()
    expected = torch.nn.functional.one_hot(labels, 50).float() - torch.softmax(logits.detach().float(), -1)
    assert torch.allclose(logits.grad.float(), expected, atol=1e-2)


def test_ignore_index_and_bad_labels():
    logits = torch.randn(1, 3, 5)
    lp = log_probs_from_logits(logits, torch.tensor([[1, -100, 4]]))
    assert lp[0, 1] == 0.0 and lp[0, 0] < 0 and lp[0, 2] < 0
    with pytest.raises(ValueError, match="outside"):
        log_probs_from_logits(logits, torch.tensor([[1, 5, 0]]))
    with pytest.raises(ValueError, match="disagree"):
        log_probs_from_logits(logits, torch.tensor([[1, 2]]))


def test_response_log_probs_shapes_temperature_and_left_padding(tiny_model_dir):
    model = load_causal_lm(tiny_model_dir)
    seq = torch.tensor([[1, 57, 905, 330, 12, 2]])
    ones = torch.ones_like(seq)
    with torch.no_grad():
        lp = response_log_probs(model, seq, ones)
        logits = model(seq).logits[:, :-1].double()
        manual = torch.log_softmax(logits, -1).gather(-1, seq[:, 1:, None]).squeeze(-1)
        assert lp.shape == (1, 5) and torch.allclose(lp.double(), manual, atol=1e-5)
        hot, entropy = response_log_probs(model, seq, ones, temperature=0.5, return_entropy=True)
        manual_hot = torch.log_softmax(logits / 0.5, -1)
        assert torch.allclose(hot.double(), manual_hot.gather(-1, seq[:, 1:, None]).squeeze(-1), atol=1e-5)
        assert torch.allclose(entropy.double(), -(manual_hot.exp() * manual_hot).sum(-1), atol=1e-4)
        assert not torch.allclose(hot, lp, atol=1e-3)
        # the same sequence left-padded in a batch gives the same log-probs on its real tokens
        padded = torch.cat([torch.full((1, 3), 2), seq], dim=1)
        batch = torch.cat([padded, torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 12]])])
        mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9])
        batched = response_log_probs(model, batch, mask)
    assert batched.shape == (2, 8)
    assert torch.allclose(batched[0, 3:], lp[0], atol=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        response_log_probs(model, seq, ones, temperature=0.0)
