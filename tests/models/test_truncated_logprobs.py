"""Log-probs of the top-k / top-p truncated, renormalised distribution (`SamplingTruncation`, `nucleus_log_norm`):
against hand computations in float64, against vLLM's own top-k/top-p masking, and their gradients."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.models.logprobs import SamplingTruncation, log_probs_from_logits, nucleus_log_norm


def _logits(*probs: float) -> torch.Tensor:
    """One row of logits whose softmax is `probs`."""
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float32)


def _lp(logits: torch.Tensor, label: int, top_k: int = 0, top_p: float = 1.0) -> float:
    return float(log_probs_from_logits(logits, torch.tensor([label]), truncation=SamplingTruncation(top_k, top_p))[0])


@pytest.mark.parametrize(("probs", "top_k", "top_p", "label", "expected"), [
    # top-p: the smallest most-likely set reaching p: {0.5, 0.3} (0.5 < 0.7 <= 0.8)
    ((0.5, 0.3, 0.15, 0.05), 0, 0.7, 0, 0.5 / 0.8),
    ((0.5, 0.3, 0.15, 0.05), 0, 0.7, 1, 0.3 / 0.8),
    # a sampled token outside the set joins it (the engine kept it; only the trainer's numerics could differ)
    ((0.5, 0.3, 0.15, 0.05), 0, 0.7, 3, 0.05 / 0.85),
    # top-k keeps every token tied with the k-th largest (vLLM masks values below it): 3 tokens for k = 2
    ((0.4, 0.2, 0.2, 0.2), 2, 1.0, 1, 0.2 / 1.0),
    ((0.5, 0.2, 0.2, 0.1), 2, 1.0, 2, 0.2 / 0.9),
    # top-p ties straddling the cut: one of the two 0.2s is kept (which one depends on the sort), the normaliser
    # is 0.4 + 0.2 either way, and a sampled tied token counts as the kept one
    ((0.4, 0.2, 0.2, 0.2), 0, 0.5, 1, 0.2 / 0.6),
    ((0.4, 0.2, 0.2, 0.2), 0, 0.5, 3, 0.2 / 0.6),
    # top-k, then top-p on the renormalised rest: [0.5, 0.2] -> [5/7, 2/7], 5/7 >= 0.7 keeps only the first
    # (top-p first, on the whole distribution, would keep {0.5, 0.2}: log(0.5 / 0.7))
    ((0.5, 0.2, 0.15, 0.15), 2, 0.7, 0, 1.0),
    # top-p 1 and top-k >= V cut nothing
    ((0.5, 0.2, 0.15, 0.15), 4, 1.0, 2, 0.15),
    # the most likely token is always kept
    ((0.9, 0.05, 0.05), 0, 0.01, 0, 1.0),
])
def test_hand_computed_cases(probs, top_k, top_p, label, expected):
    assert _lp(_logits(*probs), label, top_k, top_p) == pytest.approx(math.log(expected), abs=1e-6)


def _float64_reference(z: torch.Tensor, label: int, top_k: int, top_p: float) -> tuple[float, float]:
    """log p of `label` and the smallest |mass above - top_p| margin, straight from the definitions in float64: keep
    the tokens whose logit is >= the k-th largest, renormalise, then keep a token iff the mass of the tokens ranked
    above it is < top_p (descending order), renormalise; the sampled token joins the set."""
    values = [float(v) for v in z.double()]
    order = sorted(range(len(values)), key=lambda i: -values[i])
    keep = set(order)
    if top_k:
        kth = values[order[min(top_k, len(values)) - 1]]
        keep = {i for i in order if values[i] >= kth}
    top = max(values)
    mass = {i: math.exp(values[i] - top) for i in keep}
    total = sum(mass.values())
    margin = math.inf
    if top_p < 1:
        above, nucleus = 0.0, set()
        for i in (i for i in order if i in keep):
            margin = min(margin, abs(above - top_p))
            if above < top_p:
                nucleus.add(i)
            above += mass[i] / total
        keep = nucleus
    keep.add(label)
    norm = top + math.log(sum(math.exp(values[i] - top) for i in keep))
    return values[label] - norm, margin


@pytest.mark.parametrize(("top_k", "top_p", "temperature"), [(0, 0.9, 1.0), (20, 1.0, 1.0), (20, 0.9, 0.7),
                                                             (5, 0.5, 1.3), (0, 0.3, 0.6)])
def test_random_rows_match_the_float64_definition(top_k, top_p, temperature):
    generator = torch.Generator().manual_seed(top_k + int(100 * top_p))
    logits = torch.randn(3, 10, 97, generator=generator) * 2.5
    labels = torch.randint(0, 97, (3, 10), generator=generator)
    z = logits / temperature  # temperature first, then top-k, then top-p (vLLM's order)
    got = log_probs_from_logits(z, labels, truncation=SamplingTruncation(top_k, top_p), chunk_rows=2)
    checked = 0
    for b in range(3):
        for t in range(10):
            expected, margin = _float64_reference(z[b, t], int(labels[b, t]), top_k, top_p)
            if margin < 1e-4:  # float32 cannot tell which side of top_p this row's cut falls
                continue
            assert float(got[b, t]) == pytest.approx(expected, abs=2e-5), (b, t)
            checked += 1
    assert checked >= 25
    untruncated = log_probs_from_logits(z, labels)
    assert float((got - untruncated).abs().mean()) > 0.05  # the truncation matters for these rows


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (20, 1.0), (20, 0.9), (3, 0.5)])
def test_kept_set_is_vllms(top_k, top_p):
    """The set whose log-sum-exp is taken is the one vLLM's own CPU path (`apply_top_k_top_p_pytorch`) keeps, and
    every kept token's log-prob is vLLM's processed log-prob."""
    vllm_ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    generator = torch.Generator().manual_seed(11)
    z = torch.randn(64, 4096, generator=generator) * 3
    k = torch.full((64,), top_k, dtype=torch.int32) if top_k else None
    p = torch.full((64,), top_p, dtype=torch.float32) if top_p < 1 else None
    processed = vllm_ops.apply_top_k_top_p_pytorch(z.clone(), k, p, allow_cpu_sync=True).log_softmax(-1)
    kept = processed > -math.inf
    log_norm, cut = nucleus_log_norm(z, SamplingTruncation(top_k, top_p), chunk_rows=16)
    assert torch.equal(z >= cut.unsqueeze(-1), kept)
    assert float(((z - log_norm.unsqueeze(-1))[kept] - processed[kept]).abs().max()) < 1e-5


def test_gradients_reach_the_kept_logits_only():
    """d log p_N(y) / dz = onehot(y) - softmax over N (0 outside N): the float64 derivative of the masked form."""
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 50, generator=generator) * 2).requires_grad_()
    labels = torch.tensor([0, 5, 9, 49])
    truncation = SamplingTruncation(top_k=10, top_p=0.8)
    log_probs_from_logits(logits, labels, truncation=truncation).sum().backward()
    assert logits.grad is not None
    log_norm, cut = nucleus_log_norm(logits.detach(), truncation)
    kept = (logits.detach() >= cut.unsqueeze(-1)) | torch.nn.functional.one_hot(labels, 50).bool()
    z64 = logits.detach().double().masked_fill(~kept, -math.inf)
    expected = torch.nn.functional.one_hot(labels, 50).double() - torch.softmax(z64, dim=-1)
    assert torch.allclose(logits.grad.double(), expected, atol=1e-6)
    assert bool((logits.grad[~kept] == 0).all()) and bool((~kept).any())


def test_inactive_truncation_is_the_whole_softmax():
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 6, 40, generator=generator)
    labels = torch.randint(0, 40, (2, 6), generator=generator)
    plain = log_probs_from_logits(logits, labels)
    assert torch.equal(log_probs_from_logits(logits, labels, truncation=SamplingTruncation()), plain)
    assert torch.equal(log_probs_from_logits(logits, labels, truncation=SamplingTruncation(top_k=40)), plain)
    with pytest.raises(ValueError, match="top_p"):
        SamplingTruncation(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingTruncation(top_k=-1)
