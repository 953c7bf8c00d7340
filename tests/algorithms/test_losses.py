"""PPO policy loss, value loss and entropy against float64 loop references."""

import math

import pytest
import torch

from rlhfkit.algorithms.entropy import entropy_from_logits, policy_entropy
from rlhfkit.algorithms.policy_loss import clip_bounds, ppo_policy_loss
from rlhfkit.algorithms.value_loss import value_loss

MASK = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 1], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(MASK.shape, generator=g, dtype=torch.float64) * 2
    new = old + torch.randn(MASK.shape, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(MASK.shape, generator=g, dtype=torch.float64)
    return new, old, adv


def ref_ppo_token(lp, olp, a, lo, hi, c, w=1.0):
    r = math.exp(min(max(lp - olp, -20.0), 20.0))
    s1, s2 = r * a, min(max(r, 1 - lo), 1 + hi) * a
    obj = min(s1, s2)
    if c is not None and a < 0:
        obj = max(obj, c * a)
    return -obj * w


def ref_agg(per_tok, mode):
    rows = [[per_tok[b][t] for t in range(MASK.shape[1]) if MASK[b, t]] for b in range(MASK.shape[0])]
    if mode == "token_mean":
        return math.fsum(v for r in rows for v in r) / sum(len(r) for r in rows)
    means = [math.fsum(r) / len(r) for r in rows if r]
    return math.fsum(means) / len(means)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean"])
@pytest.mark.parametrize("clip", [(0.2, None, None), (0.2, (0.2, 0.28), None), (0.1, (0.15, 0.3), 3.0)])
def test_ppo_loss_matches_reference(mode, clip):
    eps, low_high, dual = clip
    new, old, adv = batch()
    w = torch.rand(MASK.shape, dtype=torch.float64) + 0.5
    lo, hi = low_high or (eps, eps)
    per_tok = [
        [ref_ppo_token(new[b, t].item(), old[b, t].item(), adv[b, t].item(), lo, hi, dual, w[b, t].item())
         for t in range(4)]
        for b in range(5)
    ]
    loss, metrics = ppo_policy_loss(
        new, old, adv, MASK, eps_clip=eps, eps_clip_low_high=low_high, dual_clip=dual, loss_agg_mode=mode,
        is_weights=w,
    )
    assert loss.item() == pytest.approx(ref_agg(per_tok, mode), rel=1e-12)
    ratios = [math.exp(new[b, t].item() - old[b, t].item()) for b in range(5) for t in range(4) if MASK[b, t]]
    clipped = [
        min(max(r, 1 - lo), 1 + hi) * a < r * a
        for r, a in zip(ratios, [adv[b, t].item() for b in range(5) for t in range(4) if MASK[b, t]])
    ]
    assert metrics["clip_frac"].item() == pytest.approx(sum(clipped) / len(clipped))
    assert metrics["ratio_max"].item() == pytest.approx(max(ratios), rel=1e-12)
    assert metrics["ratio_min"].item() == pytest.approx(min(ratios), rel=1e-12)
    assert metrics["ratio_mean"].item() == pytest.approx(math.fsum(ratios) / len(ratios), rel=1e-12)
    kl = [old[b, t].item() - new[b, t].item() for b in range(5) for t in range(4) if MASK[b, t]]
    assert metrics["approx_kl"].item() == pytest.approx(math.fsum(kl) / len(kl), rel=1e-12)


def test_dual_clip_bounds_negative_advantage_loss():
    old = torch.zeros(1, 3, dtype=torch.float64)
    new = torch.tensor([[5.0, 0.1, -5.0]], dtype=torch.float64)
    adv = torch.full((1, 3), -1.0, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = ppo_policy_loss(new, old, adv, mask, dual_clip=3.0, loss_agg_mode="seq_mean_token_sum_norm", )
    expected = (3.0 + math.exp(0.1) + 0.8) / 3  # ratio e^5 capped at c=3, e^0.1 unclipped, e^-5 clipped to 0.8
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert m["dual_clip_frac"].item() == pytest.approx(1 / 3)


def test_ppo_loss_gradient_matches_analytic():
    new, old, adv = batch(1)
    new = new.clone().requires_grad_(True)
    loss, _ = ppo_policy_loss(new, old, adv, MASK, eps_clip_low_high=(0.2, 0.28))
    loss.backward()
    n = int(MASK.sum())
    for b in range(5):
        for t in range(4):
            r = math.exp(new[b, t].item() - old[b, t].item())
            a = adv[b, t].item()
            clipped_branch = min(max(r, 0.8), 1.28) * a < r * a
            expected = 0.0 if (not MASK[b, t] or clipped_branch) else -r * a / n
            assert new.grad[b, t].item() == pytest.approx(expected, rel=1e-10, abs=1e-14)


def test_ppo_loss_extreme_ratios_and_padding_are_finite():
    inf = float("inf")
    old = torch.tensor([[0.0, 0.0, -1e4, 0.0, float("nan")]])
    new = torch.tensor([[-1e4, 1e4, 0.0, -inf, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, -2.0, 0.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = ppo_policy_loss(new, old, adv, mask, dual_clip=3.0)
    loss.backward()
    # log-ratios clamp to (-20, 20, 20, -20): token 0 keeps rho A = e^-20, tokens 1 and 2 (A < 0, rho = e^20) sit at
    # the dual clip c A = -3 and -6, token 3 has A = 0; the NaN padding is masked out
    per_tok = [ref_ppo_token(lp, olp, a, 0.2, 0.2, 3.0) for lp, olp, a in [(-1e4, 0, 1), (1e4, 0, -1), (0, -1e4, -2),
                                                                            (-inf, 0, 0)]]
    assert per_tok == [-math.exp(-20), 3.0, 6.0, 0.0]
    assert loss.item() == pytest.approx(math.fsum(per_tok) / 4, rel=1e-6)
    # every active branch is constant in log pi (clamped ratio, dual clip or A = 0): the gradient is exactly 0
    assert new.grad.tolist() == [[0.0] * 5]
    e20 = math.exp(20)
    expected = {"clip_frac": 0.0, "dual_clip_frac": 0.5, "approx_kl": 0.0, "ratio_mean": (2 * e20 + 2 / e20) / 4,
                "ratio_max": e20, "ratio_min": 1 / e20}
    assert metrics.keys() == expected.keys()
    for k, v in expected.items():
        assert metrics[k].item() == pytest.approx(v, rel=1e-6, abs=1e-12), k


def test_ppo_all_masked_batch():
    new, old, adv = batch(2)
    loss, metrics = ppo_policy_loss(new, old, adv, torch.zeros(MASK.shape, dtype=torch.bool))
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())


def test_clip_bounds_and_validation():
    assert clip_bounds(0.2) == (0.2, 0.2)
    assert clip_bounds(0.2, (0.1, 0.3)) == (0.1, 0.3)
    with pytest.raises(ValueError, match="clip range"):
        clip_bounds(-0.1)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(*batch(), MASK, dual_clip=1.0)


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_reference(clip):
    g = torch.Generator().manual_seed(3)
    v = torch.randn(MASK.shape, generator=g, dtype=torch.float64)
    old = v + torch.randn(MASK.shape, generator=g, dtype=torch.float64) * 0.5
    ret = torch.randn(MASK.shape, generator=g, dtype=torch.float64)
    per_tok, active = [], []
    for b in range(5):
        row = []
        for t in range(4):
            vv, vo, rr = v[b, t].item(), old[b, t].item(), ret[b, t].item()
            un = (vv - rr) ** 2
            if clip is None:
                row.append(un)
                continue
            cl = (vo + min(max(vv - vo, -clip), clip) - rr) ** 2
            row.append(max(un, cl))
            if MASK[b, t]:
                active.append(cl > un)
        per_tok.append(row)
    for mode in ("token_mean", "seq_mean"):
        loss, metrics = value_loss(v, old, ret, MASK, value_clip=clip, loss_agg_mode=mode)
        assert loss.item() == pytest.approx(0.5 * ref_agg(per_tok, mode), rel=1e-12)
    expected_frac = sum(active) / len(active) if active else 0.0
    assert metrics["value_clip_frac"].item() == pytest.approx(expected_frac)
    with pytest.raises(ValueError, match="value_clip"):
        value_loss(v, old, ret, MASK, value_clip=0.0)


def ref_entropy(z):
    mx = max(z)
    ps = [math.exp(x - mx) for x in z]
    s = math.fsum(ps)
    return -math.fsum(p / s * math.log(p / s) for p in ps if p > 0)


def test_entropy_matches_reference_and_aggregates():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 4, 7, generator=g, dtype=torch.float64) * 3
    H = entropy_from_logits(logits)
    for b in range(5):
        for t in range(4):
            assert H[b, t].item() == pytest.approx(ref_entropy(logits[b, t].tolist()), rel=1e-10)
    per_tok = H.tolist()
    assert policy_entropy(logits, MASK).item() == pytest.approx(ref_agg(per_tok, "token_mean"), rel=1e-12)
    assert policy_entropy(logits, MASK, loss_agg_mode="seq_mean").item() == pytest.approx(
        ref_agg(per_tok, "seq_mean"), rel=1e-12
    )


def test_entropy_with_banned_tokens_and_extremes():
    logits = torch.tensor([[[0.0, -float("inf"), 0.0, -float("inf")], [1e4, 0.0, -1e4, 0.0]]], requires_grad=True)
    H = entropy_from_logits(logits)
    assert H[0, 0].item() == pytest.approx(math.log(2), rel=1e-6)
    assert H[0, 1].item() == pytest.approx(0.0, abs=1e-6)
    policy_entropy(logits, torch.ones(1, 2)).backward()
    # dH/dz_i = -p_i (log p_i + H): 0 for banned tokens (p = 0), for a uniform support (log p = -H) and for a
    # one-hot row (p = 1, H = 0 or p = e^-1e4 = 0)
    assert logits.grad.tolist() == [[[0.0] * 4, [0.0] * 4]]
    assert entropy_from_logits(torch.zeros(2, 3, 8, dtype=torch.bfloat16)).dtype == torch.float32


def test_dr_grpo_aggregation_uses_a_constant_normaliser():
    new, old, adv = batch(5)
    per_tok = [[ref_ppo_token(new[b, t].item(), old[b, t].item(), adv[b, t].item(), 0.2, 0.2, None)
                for t in range(4)] for b in range(5)]
    total = math.fsum(per_tok[b][t] for b in range(5) for t in range(4) if MASK[b, t])
    loss, _ = ppo_policy_loss(new, old, adv, MASK, loss_agg_mode="seq_mean_token_sum_norm", max_len=100, num_seqs=8)
    assert loss.item() == pytest.approx(total / (8 * 100), rel=1e-12)
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(5, 4, 3, generator=g, dtype=torch.float64)
    ent = policy_entropy(logits, MASK, loss_agg_mode="token_mean", num_tokens=50)
    assert ent.item() == pytest.approx(entropy_from_logits(logits)[MASK].sum().item() / 50, rel=1e-12)


def test_value_loss_defaults_metrics_token_out_and_batch_counts():
    """The default mode is token_mean, ``token_out`` holds 0.5 (V - G)^2 on valid tokens and 0 elsewhere,
    ``values_mean`` is the masked mean of V, and num_tokens / num_seqs / max_len reach the aggregation."""
    g = torch.Generator().manual_seed(5)
    v = torch.randn(MASK.shape, generator=g, dtype=torch.float64)
    ret = torch.randn(MASK.shape, generator=g, dtype=torch.float64)
    sq = [[(v[b, t].item() - ret[b, t].item()) ** 2 for t in range(4)] for b in range(5)]
    valid = [(b, t) for b in range(5) for t in range(4) if MASK[b, t]]
    out = {}
    loss, metrics = value_loss(v, v, ret, MASK, token_out=out)
    assert loss.item() == pytest.approx(0.5 * ref_agg(sq, "token_mean"), rel=1e-12)
    expected = [[0.5 * sq[b][t] if MASK[b, t] else 0.0 for t in range(4)] for b in range(5)]
    torch.testing.assert_close(out["loss"], torch.tensor(expected, dtype=torch.float64))
    assert metrics["values_mean"].item() == pytest.approx(math.fsum(v[b, t].item() for b, t in valid) / len(valid))
    total = math.fsum(sq[b][t] for b, t in valid)
    assert value_loss(v, v, ret, MASK, num_tokens=40.0)[0].item() == pytest.approx(0.5 * total / 40, rel=1e-12)
    seq = value_loss(v, v, ret, MASK, loss_agg_mode="seq_mean", num_seqs=8.0)[0].item()
    assert seq == pytest.approx(0.5 * ref_agg(sq, "seq_mean") * 4 / 8, rel=1e-12)  # 4 rows have tokens
    drgrpo = value_loss(v, v, ret, MASK, loss_agg_mode="seq_mean_token_sum_norm", num_seqs=2, max_len=10)[0]
    assert drgrpo.item() == pytest.approx(0.5 * total / 20, rel=1e-12)
    # float32 inputs are computed in float32 or wider, and the gradient reaches the values
    v32 = v.float().requires_grad_(True)
    loss32, _ = value_loss(v32, v32.detach(), ret.float(), MASK)
    loss32.backward()
    assert loss32.item() == pytest.approx(loss.item(), rel=1e-5)
    n = len(valid)
    grad = [[(v[b, t].item() - ret[b, t].item()) / n if MASK[b, t] else 0.0 for t in range(4)] for b in range(5)]
    torch.testing.assert_close(v32.grad.double(), torch.tensor(grad, dtype=torch.float64), rtol=1e-5, atol=1e-7)


def test_clip_bounds_default_upper_eps_check_and_log_ratio_clip_reaches_the_ratio():
    assert clip_bounds() == (0.2, 0.2)
    with pytest.raises(ValueError, match="clip range"):
        clip_bounds(0.2, (1.5, 0.3))  # eps_low > 1 would make the lower bound 1 - eps_low negative
    new = torch.tensor([[0.0, -1.0]], dtype=torch.float64)
    old = torch.tensor([[-3.0, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    _, metrics = ppo_policy_loss(new, old, adv, None, log_ratio_clip=1.0)  # log-ratio 3 clamped to 1
    assert metrics["ratio_max"].item() == pytest.approx(math.e, rel=1e-12)
    assert metrics["approx_kl"].item() == pytest.approx(-0.5, rel=1e-12)


def test_ppo_token_out_holds_ratio_and_the_per_token_loss():
    new, old, adv = batch(2)
    out = {}
    loss, _ = ppo_policy_loss(new, old, adv, MASK, token_out=out)
    ratio = [[math.exp(new[b, t].item() - old[b, t].item()) for t in range(4)] for b in range(5)]
    per = [[ref_ppo_token(new[b, t].item(), old[b, t].item(), adv[b, t].item(), 0.2, 0.2, None, 1.0)
            if MASK[b, t] else 0.0 for t in range(4)] for b in range(5)]
    torch.testing.assert_close(out["ratio"], torch.tensor(ratio, dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(out["loss"], torch.tensor(per, dtype=torch.float64), rtol=1e-12, atol=1e-15)
    assert loss.item() == pytest.approx(ref_agg(per, "token_mean"), rel=1e-12)


def test_value_loss_metrics_of_bf16_values_are_float32():
    v = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 5, dtype=torch.bfloat16) * 7
    ret = torch.zeros(MASK.shape)
    loss, metrics = value_loss(v, v, ret, MASK)
    assert loss.dtype == metrics["values_mean"].dtype == torch.float32
    valid = [v[b, t].double().item() for b in range(5) for t in range(4) if MASK[b, t]]
    assert metrics["values_mean"].item() == pytest.approx(math.fsum(valid) / len(valid), rel=1e-6)


def test_ppo_num_tokens_replaces_the_local_count():
    new, old, adv = batch(4)
    per = [[ref_ppo_token(new[b, t].item(), old[b, t].item(), adv[b, t].item(), 0.2, 0.2, None) for t in range(4)]
           for b in range(5)]
    total = math.fsum(per[b][t] for b in range(5) for t in range(4) if MASK[b, t])
    loss, _ = ppo_policy_loss(new, old, adv, MASK, num_tokens=40.0)
    assert loss.item() == pytest.approx(total / 40, rel=1e-12)
