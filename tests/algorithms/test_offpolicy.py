"""Truncated IS / ICEPOP weights and the rollout-vs-trainer log-prob mismatch metrics."""

import math

import pytest
import torch

from rlhfkit.algorithms.offpolicy import importance_weights, logprob_mismatch
from rlhfkit.algorithms.policy_loss import ppo_policy_loss

MASK = torch.tensor([[0, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 1, 0]], dtype=torch.bool)


def batch():
    train = torch.tensor(
        [[-1.0, -2.0, -0.5, -1.0, -3.0], [-1.0, 0, 0, 0, 0], [-1.0, -2.0, -0.5, -1.0, -3.0], [-0.1, -5.0, 0, -2, 0]],
        dtype=torch.float64,
    )
    rollout = train + torch.tensor(
        [[0.0] * 5, [0.3, 0, 0, 0, 0], [0.0, -1.0, 1.0, 0.5, -3.0], [2.0, -0.2, 0, 0.69, 0]], dtype=torch.float64
    )
    return train, rollout


@pytest.mark.parametrize("kind", ["tis", "icepop"])
def test_importance_weights_match_reference(kind):
    train, rollout = batch()
    w, metrics = importance_weights(train, rollout, MASK, correction_type=kind, low=0.5, high=2.0)
    expected, outside, kept = [], [], []
    for b in range(4):
        row = []
        for t in range(5):
            if not MASK[b, t]:
                row.append(0.0)
                continue
            x = math.exp(train[b, t].item() - rollout[b, t].item())
            inside = 0.5 <= x <= 2.0
            v = min(max(x, 0.5), 2.0) if kind == "tis" else (x if inside else 0.0)
            row.append(v)
            outside.append(not inside)
            kept.append(v)
        expected.append(row)
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    assert metrics["is_truncated_frac"].item() == pytest.approx(sum(outside) / len(outside))
    assert metrics["is_weight_mean"].item() == pytest.approx(math.fsum(kept) / len(kept), rel=1e-12)


def test_weights_are_detached_and_extremes_finite():
    train = torch.tensor([[0.0, -1e4, -float("inf"), 0.0]], requires_grad=True)
    rollout = torch.tensor([[-1e4, 0.0, 0.0, -float("inf")]])
    # log-ratios (1e4, -1e4, -inf, +inf) clamp to +-20, so w = (e^20, e^-20, e^-20, e^20): all outside (0.5, 5)
    expected = {"tis": [5.0, 0.5, 0.5, 5.0], "icepop": [0.0] * 4}
    for kind, weights in expected.items():
        w, metrics = importance_weights(train, rollout, torch.ones(1, 4), correction_type=kind)
        assert not w.requires_grad and w.tolist() == [weights]
        assert metrics["is_weight_mean"].item() == math.fsum(weights) / 4
        assert metrics["is_truncated_frac"].item() == 1.0


def test_weights_feed_the_policy_loss():
    train, rollout = batch()
    adv = torch.ones_like(train)
    w, _ = importance_weights(train, rollout, MASK, correction_type="icepop", low=0.5, high=2.0)
    weighted, _ = ppo_policy_loss(train, train, adv, MASK, is_weights=w)
    n = int(MASK.sum())
    assert weighted.item() == pytest.approx(-w.sum().item() / n, rel=1e-12)


def test_importance_weights_validation():
    train, rollout = batch()
    with pytest.raises(ValueError, match="correction_type"):
        importance_weights(train, rollout, MASK, correction_type="seq")
    with pytest.raises(ValueError, match="threshold"):
        importance_weights(train, rollout, MASK, low=2.0, high=1.0)


def test_logprob_mismatch_matches_reference():
    train, rollout = batch()
    train = torch.where(MASK, train, torch.full_like(train, float("nan")))
    d = [train[b, t].item() - rollout[b, t].item() for b in range(4) for t in range(5) if MASK[b, t]]
    m = logprob_mismatch(train, rollout, MASK)
    assert m["logprob_abs_diff_mean"].item() == pytest.approx(math.fsum(abs(x) for x in d) / len(d), rel=1e-12)
    assert m["logprob_abs_diff_max"].item() == pytest.approx(max(abs(x) for x in d), rel=1e-12)
    assert m["is_ratio_mean"].item() == pytest.approx(math.fsum(math.exp(x) for x in d) / len(d), rel=1e-12)
    k3 = math.fsum(math.exp(x) - 1 - x for x in d) / len(d)
    assert m["rollout_kl_k3"].item() == pytest.approx(k3, rel=1e-12)


def test_logprob_mismatch_identical_and_empty():
    train, _ = batch()
    m = logprob_mismatch(train, train, MASK)
    assert m["logprob_abs_diff_mean"].item() == 0.0 and m["is_ratio_mean"].item() == 1.0
    empty = logprob_mismatch(train, train, torch.zeros_like(MASK))
    assert all(v.item() == 0.0 for v in empty.values())


def test_log_ratios_are_clamped_at_20_by_default():
    """``d = log pi_train - log pi_rollout`` is clamped to +-20 before exp (the documented default)."""
    train = torch.tensor([[0.0, 0.0, -3.0]], dtype=torch.float64)
    rollout = torch.tensor([[-25.0, 30.0, -3.5]], dtype=torch.float64)
    m = logprob_mismatch(train, rollout, None)
    clamped = [20.0, -20.0, 0.5]
    assert m["logprob_abs_diff_max"].item() == 20.0
    assert m["logprob_abs_diff_mean"].item() == pytest.approx(40.5 / 3, rel=1e-12)
    assert m["is_ratio_mean"].item() == pytest.approx(math.fsum(math.exp(x) for x in clamped) / 3, rel=1e-12)
    w, metrics = importance_weights(train, rollout, None, low=0.0, high=1e12)
    assert w[0].tolist() == pytest.approx([math.exp(x) for x in clamped], rel=1e-12)
    assert metrics["is_truncated_frac"].item() == 0.0


def test_equal_truncation_bounds_are_allowed():
    """low == high is a valid range (0 <= low <= high): tis then sets every valid weight to that value."""
    train = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    rollout = torch.tensor([[-1.5, -1.0, -0.5]], dtype=torch.float64)
    w, _ = importance_weights(train, rollout, torch.tensor([[1, 1, 0]]), low=2.0, high=2.0)
    assert w.tolist() == [[2.0, 2.0, 0.0]]
