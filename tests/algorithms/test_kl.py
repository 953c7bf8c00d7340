"""KL estimators against float64 loop references; extreme log-ratios reach their clipped values."""

import math

import pytest
import torch

from rlhfkit.algorithms.kl import compute_kl, kl_loss


def ref_kl(lp, rp, mask, estimator, ratio_clip=20.0, kl_clip=10.0):
    out = []
    for row_a, row_b, row_m in zip(lp.tolist(), rp.tolist(), mask.tolist()):
        row = []
        for a, b, m in zip(row_a, row_b, row_m):
            if not m:
                row.append(0.0)
                continue
            r = min(max(a - b, -ratio_clip), ratio_clip)
            k = {"k1": r, "k2": r * r / 2, "k3": math.exp(-r) - 1 + r}[estimator]
            row.append(k if kl_clip is None else min(max(k, -kl_clip), kl_clip))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    rp = -torch.rand(4, 6, generator=g, dtype=torch.float64) * 3
    mask = torch.tensor([[0] * 6, [1] + [0] * 5, [1, 1, 1, 1, 0, 0], [1, 1, 0, 1, 1, 1]])
    return lp, rp, mask


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_reference(estimator):
    lp, rp, mask = batch()
    out = compute_kl(lp, rp, mask, estimator)
    torch.testing.assert_close(out, ref_kl(lp, rp, mask, estimator), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_without_output_clip(estimator):
    lp = torch.tensor([[0.0, -30.0, -1.0]], dtype=torch.float64)
    rp = torch.tensor([[-12.0, 0.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    out = compute_kl(lp, rp, mask, estimator, kl_clip=None)
    torch.testing.assert_close(out, ref_kl(lp, rp, mask, estimator, kl_clip=None), rtol=1e-12, atol=0)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_extreme_log_ratios_are_finite(estimator, dtype):
    inf = float("inf")
    lp = torch.tensor([[0.0, -1e4, -inf, 0.0, -60000.0]]).to(dtype)
    rp = torch.tensor([[-1e4, 0.0, 0.0, -inf, 0.0]]).to(dtype)
    # the log-ratios (+1e4, -1e4, -inf, +inf, -6e4) clamp to +-20: k1 = +-20, k2 = 200, k3(+20) = e^-20 + 19,
    # k3(-20) = e^20 - 21; then +-10 with the output clip
    r = [20.0, -20.0, -20.0, 20.0, -20.0]
    k = {"k1": r, "k2": [200.0] * 5, "k3": [math.exp(-x) - 1 + x for x in r]}[estimator]
    for kl_clip in (10.0, None):
        out = compute_kl(lp, rp, torch.ones(1, 5), estimator, kl_clip=kl_clip)
        assert out.dtype == torch.float32
        expected = k if kl_clip is None else [min(max(v, -kl_clip), kl_clip) for v in k]
        assert out[0].tolist() == pytest.approx(expected, rel=1e-6), out


def test_k3_is_nonnegative_and_zero_at_equal_logprobs():
    lp, rp, mask = batch(1)
    assert (compute_kl(lp, rp, mask, "k3") >= 0).all()
    assert torch.equal(compute_kl(lp, lp, mask, "k3"), torch.zeros_like(lp))


def test_masked_positions_are_zero_even_with_nan_padding():
    lp, rp, mask = batch(2)
    lp = torch.where(mask.bool(), lp, torch.full_like(lp, float("nan")))
    out = compute_kl(lp, rp, mask, "k3")
    assert torch.isfinite(out).all() and (out[~mask.bool()] == 0).all()


def test_unknown_estimator_and_shape_mismatch_raise():
    with pytest.raises(ValueError, match="kl_estimator"):
        compute_kl(torch.zeros(1, 2), torch.zeros(1, 2), None, "k4")
    with pytest.raises(ValueError, match="shapes differ"):
        compute_kl(torch.zeros(1, 2), torch.zeros(1, 3), None, "k1")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_loss_value_and_gradient(estimator):
    lp, rp, mask = batch(3)
    lp = lp.clone().requires_grad_(True)
    loss = kl_loss(lp, rp, mask, estimator)
    ref = ref_kl(lp.detach(), rp, mask, estimator)
    n = int(mask.sum())
    assert loss.item() == pytest.approx(ref.sum().item() / n, rel=1e-12)
    loss.backward()
    for b in range(4):
        for t in range(6):
            r = lp[b, t].item() - rp[b, t].item()
            d = {"k1": 1.0, "k2": r, "k3": 1 - math.exp(-r)}[estimator] / n if mask[b, t] else 0.0
            assert lp.grad[b, t].item() == pytest.approx(d, rel=1e-10, abs=1e-14)


def test_kl_loss_seq_mean():
    lp, rp, mask = batch(4)
    ref = ref_kl(lp, rp, mask, "k2")
    rows = [ref[b, mask[b].bool()].tolist() for b in range(4)]
    expected = math.fsum(math.fsum(r) / len(r) for r in rows if r) / sum(1 for r in rows if r)
    assert kl_loss(lp, rp, mask, "k2", loss_agg_mode="seq_mean").item() == pytest.approx(expected, rel=1e-12)


def test_kl_defaults_are_k1_for_the_penalty_and_k3_clipped_at_10_for_the_loss():
    """compute_kl defaults to k1 (the reward penalty), kl_loss to k3 with the estimate clamped to +-10."""
    lp, rp, mask = batch(1)
    torch.testing.assert_close(compute_kl(lp, rp, mask), ref_kl(lp, rp, mask, "k1"))
    lp = lp.clone()
    lp[3, 0] = rp[3, 0] - 15.0  # k3 = e^15 - 16, far above the clamp
    k3 = ref_kl(lp, rp, mask, "k3")
    assert k3[3, 0].item() == 10.0
    valid = [(b, t) for b in range(4) for t in range(6) if mask[b, t]]
    expected = math.fsum(k3[b, t].item() for b, t in valid) / len(valid)
    assert kl_loss(lp, rp, mask).item() == pytest.approx(expected, rel=1e-12)
    # Dr. GRPO's constant length reaches the aggregation: sum / (rows * max_len)
    total = math.fsum(k3[b, t].item() for b, t in valid)
    drgrpo = kl_loss(lp, rp, mask, loss_agg_mode="seq_mean_token_sum_norm", num_seqs=2, max_len=10)
    assert drgrpo.item() == pytest.approx(total / 20, rel=1e-12)


def test_log_ratio_default_clamp_is_20():
    from rlhfkit.algorithms.kl import log_ratio

    a = torch.tensor([0.0, 0.0, -1.0], dtype=torch.float64)
    b = torch.tensor([-30.0, 25.0, -3.5], dtype=torch.float64)
    assert log_ratio(a, b).tolist() == [20.0, -20.0, 2.5]


def test_unbiased_kl_weights_use_the_given_log_ratio_clip():
    """With old_log_probs (``--use_unbiased_kl``) each token's k3 is weighted by rho = exp(clamp(log pi - log pi_old,
    -c, c)); the clamp uses the caller's log_ratio_clip."""
    lp = torch.tensor([[0.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-0.5, -1.0]], dtype=torch.float64)
    old = torch.tensor([[-3.0, -1.0]], dtype=torch.float64)  # log-ratio 3 on the first token
    k3 = math.exp(-0.5) - 1 + 0.5
    got = kl_loss(lp, ref, None, old_log_probs=old, log_ratio_clip=1.0).item()
    assert got == pytest.approx(math.e * k3 / 2, rel=1e-12)  # rho = e^1 (clamped), second token k3 = 0


def test_unbiased_kl_gradient_has_the_sign_of_the_log_ratio_where_the_kl_clamp_is_active():
    """Far-off tokens (k3 over kl_clip = 10): the gradient stays rho r, from a float64 hand computation. Minimal
    case, on-policy: log pi = -5, log pi_ref = -1: r = -4, gradient -4 (the old product rho * clamp(k3) gave +10, so
    descent pushed the token further below the reference)."""
    lp = torch.tensor([[-5.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0]], dtype=torch.float64)
    loss = kl_loss(lp, ref, None, "k3", old_log_probs=lp.detach())
    assert loss.item() == pytest.approx(10.0)  # the value is still the clamped estimate
    loss.backward()
    assert lp.grad.item() == pytest.approx(-4.0, rel=1e-12)
    # a batch with log-ratios up to +-40: every token's gradient has the sign of its log-ratio (r clamped at 20),
    # and the importance weight is capped at 10
    g = torch.Generator().manual_seed(0)
    pi = -torch.rand(8, 48, generator=g, dtype=torch.float64) * 3
    ref = pi + (torch.rand(8, 48, generator=g, dtype=torch.float64) * 80 - 40)
    old = pi + torch.randn(8, 48, generator=g, dtype=torch.float64) * 3
    x = pi.clone().requires_grad_(True)
    kl_loss(x, ref, None, "k3", old_log_probs=old).backward()  # token mean over 384 tokens
    r = (pi - ref).clamp(-20, 20)
    rho = torch.exp((pi - old).clamp(-20, 20)).clamp(max=10)
    torch.testing.assert_close(x.grad, rho * r / r.numel(), rtol=1e-12, atol=0)
    assert bool((torch.sign(x.grad) == torch.sign(r)).all())


@pytest.mark.parametrize("estimator", ["k1", "k2"])
def test_unbiased_kl_is_refused_for_k1_and_k2(estimator):
    lp = torch.zeros(1, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="k3 only"):
        kl_loss(lp, lp - 1, None, estimator, old_log_probs=lp)
