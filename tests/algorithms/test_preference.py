"""Reward-model pairwise losses, DPO / IPO / cDPO, KTO and vanilla KTO against float64 scalar references."""

import math

import pytest
import torch

from rlhfkit.algorithms.preference import (
    dpo_loss,
    kto_loss,
    kto_reference_kl,
    logexp_loss,
    pairwise_loss,
    reward_model_loss,
    sequence_log_probs,
    vanilla_kto_loss,
)


def log_sigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_pairwise_and_logexp_losses():
    c = torch.tensor([1.0, -2.0, 30.0, 0.0], dtype=torch.float64)
    r = torch.tensor([0.0, 1.0, -30.0, 0.0], dtype=torch.float64)
    margin = torch.tensor([0.5, 0.0, 1.0, 2.0], dtype=torch.float64)
    for m in (None, margin):
        mm = [0.0] * 4 if m is None else m.tolist()
        per = [-log_sigmoid(a - b - k) for a, b, k in zip(c.tolist(), r.tolist(), mm)]
        logexp = [math.log1p(math.exp(b - a + k)) for a, b, k in zip(c.tolist(), r.tolist(), mm)]
        assert pairwise_loss(c, r, m).item() == pytest.approx(math.fsum(per) / 4, rel=1e-12)
        assert logexp_loss(c, r, m).item() == pytest.approx(math.fsum(logexp) / 4, rel=1e-12)
        torch.testing.assert_close(pairwise_loss(c, r, m, "none"), torch.tensor(per, dtype=torch.float64))
        assert reward_model_loss(c, r, "logexp", m, "sum").item() == pytest.approx(math.fsum(logexp), rel=1e-12)
        assert reward_model_loss(c, r, margin=m).item() == pytest.approx(math.fsum(per) / 4, rel=1e-12)  # sigmoid
        assert reward_model_loss(c, r, "sigmoid", m, "sum").item() == pytest.approx(math.fsum(per), rel=1e-12)
    assert pairwise_loss(c, r, 0.5).item() == pytest.approx(pairwise_loss(c, r, torch.full_like(c, 0.5)).item())
    assert logexp_loss(c, r, 0.5).item() == pytest.approx(logexp_loss(c, r, torch.full_like(c, 0.5)).item())
    with pytest.raises(ValueError, match="--loss"):
        reward_model_loss(c, r, "hinge")
    with pytest.raises(ValueError, match="reduction"):
        pairwise_loss(c, r, reduction="max")


def test_pairwise_loss_extremes_are_finite():
    c = torch.tensor([1e4, -1e4], requires_grad=True)
    r = torch.tensor([-1e4, 1e4])
    for fn in (pairwise_loss, logexp_loss):
        loss = fn(c, r)
        loss.backward()
        assert loss.item() == pytest.approx(1e4, rel=1e-6)  # (0 + 2e4) / 2
        assert c.grad.tolist() == [0.0, -0.5]  # -(1 - sigmoid(c - r)) / 2: 0 at +2e4, the limit -1/2 at -2e4
        c.grad = None


def logps(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [-torch.rand(6, generator=g, dtype=torch.float64) * 20 for _ in range(4)]


@pytest.mark.parametrize("beta,ls,ipo", [(0.1, 0.0, False), (0.5, 0.2, False), (0.1, 0.0, True), (2.0, 0.0, False)])
def test_dpo_family_matches_reference(beta, ls, ipo):
    pc, pr, rc, rr = logps()
    per = []
    for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist()):
        h = (a - b) - (c - d)
        if ipo:
            per.append((h - 1 / (2 * beta)) ** 2)
        else:
            per.append(-(1 - ls) * log_sigmoid(beta * h) - ls * log_sigmoid(-beta * h))
    loss, cr, rj = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=ls, ipo=ipo)
    assert loss.item() == pytest.approx(math.fsum(per) / 6, rel=1e-12)
    torch.testing.assert_close(cr, beta * (pc - rc))
    torch.testing.assert_close(rj, beta * (pr - rr))


def test_dpo_gradient_and_validation():
    pc, pr, rc, rr = logps(1)
    pc = pc.clone().requires_grad_(True)
    loss, cr, _ = dpo_loss(pc, pr, rc, rr, beta=0.1, reduction="sum")
    loss.backward()
    h = (pc - pr - rc + rr).detach()
    torch.testing.assert_close(pc.grad, -0.1 * (1 - torch.sigmoid(0.1 * h)))
    assert not cr.requires_grad
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(pc, pr, rc, rr, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(pc, pr, rc, rr, label_smoothing=0.5)


def test_sequence_log_probs():
    x = torch.tensor([[-1.0, -2.0, float("nan")], [-3.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert sequence_log_probs(x, mask).tolist() == [-3.0, -3.0, 0.0]
    assert sequence_log_probs(x, mask, average=True).tolist() == [-1.5, -3.0, 0.0]


def test_kto_matches_paper_formula():
    g = torch.Generator().manual_seed(2)
    pol, ref, pol_kl, ref_kl = (-torch.rand(6, generator=g, dtype=torch.float64) * 10 for _ in range(4))
    desirable = torch.tensor([True, False, True, True, False, False])
    beta, ld, lu = 0.3, 1.0, 1.33
    z = max(0.0, math.fsum(a - b for a, b in zip(pol_kl.tolist(), ref_kl.tolist())) / 6)
    per = []
    for p, r, d in zip(pol.tolist(), ref.tolist(), desirable.tolist()):
        lr = p - r
        per.append(ld * (1 - sigmoid(beta * (lr - z))) if d else lu * (1 - sigmoid(beta * (z - lr))))
    loss, rewards, zz = kto_loss(
        pol, ref, desirable, pol_kl, ref_kl, beta=beta, desirable_loss_weight=ld, undesirable_loss_weight=lu
    )
    assert zz.item() == pytest.approx(z, rel=1e-12, abs=1e-15)
    assert loss.item() == pytest.approx(math.fsum(per) / 6, rel=1e-12)
    torch.testing.assert_close(rewards, beta * (pol - ref))


@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_kto_refuses_non_positive_beta(beta):
    """beta = 0 makes every KTO loss the constant lambda / 2 (no gradient), beta < 0 rewards the wrong answers."""
    x = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="--beta must be > 0"):
        kto_loss(x, x, torch.tensor([1, 0]), x, x, beta=beta)
    loss, _, _ = kto_loss(x, x, torch.tensor([1, 0]), x, x, beta=1e-9)  # any positive beta is accepted
    assert loss.item() == pytest.approx(0.5)


def test_kto_reference_point_is_clamped_and_detached():
    pol = torch.tensor([-5.0, -5.0], requires_grad=True)
    z = kto_reference_kl(pol, torch.tensor([-1.0, -2.0]))
    assert z.item() == 0.0 and not z.requires_grad
    loss, _, _ = kto_loss(pol, torch.tensor([-1.0, -1.0]), torch.tensor([1, 0]), pol, torch.zeros(2))
    loss.backward()
    # z = 0, r = (-4, -4): desirable row l = 1 - sigmoid(0.1 r), undesirable row l = 1 - sigmoid(-0.1 r); mean of 2
    s = sigmoid(-0.4)
    assert loss.item() == pytest.approx(((1 - s) + s) / 2, rel=1e-6)
    assert pol.grad.tolist() == pytest.approx([-0.1 * s * (1 - s) / 2, 0.1 * s * (1 - s) / 2], rel=1e-5)
    only_undesirable, _, _ = kto_loss(pol, pol.detach(), torch.zeros(2, dtype=torch.bool), pol, pol.detach())
    assert only_undesirable.item() == pytest.approx(0.5)


def test_vanilla_kto_matches_openrlhf_formula_float64():
    """OpenRLHF's VanillaKTOLoss (<= 0.9.5): in-batch reference points, each side judged against the other's."""
    g = torch.Generator().manual_seed(5)
    pc, rc = (-torch.rand(4, generator=g, dtype=torch.float64) * 8 for _ in range(2))
    pr, rr = (-torch.rand(3, generator=g, dtype=torch.float64) * 8 for _ in range(2))
    pc = pc - 3.0  # a clearly negative chosen mean log-ratio: KL_c clamps to 0 on one side at least sometimes
    beta = 0.7
    rc_list = [a - b for a, b in zip(pc.tolist(), rc.tolist())]
    rr_list = [a - b for a, b in zip(pr.tolist(), rr.tolist())]
    kl_c = max(0.0, math.fsum(rc_list) / len(rc_list))
    kl_r = max(0.0, math.fsum(rr_list) / len(rr_list))
    per = [1 - sigmoid(beta * (x - kl_r)) for x in rc_list] + [1 - sigmoid(beta * (kl_c - x)) for x in rr_list]
    loss, cr, rj = vanilla_kto_loss(pc, pr, rc, rr, beta=beta)
    assert loss.item() == pytest.approx(math.fsum(per) / len(per), rel=1e-12)
    assert cr.tolist() == pytest.approx([beta * x for x in rc_list], rel=1e-12)
    assert rj.tolist() == pytest.approx([beta * x for x in rr_list], rel=1e-12)
    per_row, _, _ = vanilla_kto_loss(pc, pr, rc, rr, beta=beta, reduction="none")
    assert per_row.tolist() == pytest.approx(per, rel=1e-12)


def test_vanilla_kto_reference_points_carry_gradient_and_clamp():
    """As OpenRLHF's code: KL_c / KL_r are not detached, so a chosen log-prob also moves the rejected rows' loss;
    a negative mean clamps to 0 (no gradient through it)."""
    pc = torch.tensor([0.5, 1.5], dtype=torch.float64, requires_grad=True)
    pr = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    zero2, zero1 = torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    loss, _, _ = vanilla_kto_loss(pc, pr, zero2, zero1, beta=1.0)
    loss.backward()
    # KL_c = 1.0 (mean of 0.5, 1.5), KL_r = max(0, -2) = 0; rows: 1 - s(0.5), 1 - s(1.5), 1 - s(1 + 2)
    s = sigmoid
    assert loss.item() == pytest.approx(((1 - s(0.5)) + (1 - s(1.5)) + (1 - s(3.0))) / 3, rel=1e-12)
    ds = lambda x: s(x) * (1 - s(x))  # noqa: E731
    # d/d pc_i: -ds(pc_i) / 3 from its own row, -ds(3) * (1/2) / 3 through KL_c in the rejected row
    assert pc.grad.tolist() == pytest.approx([-(ds(0.5) + ds(3.0) / 2) / 3, -(ds(1.5) + ds(3.0) / 2) / 3], rel=1e-12)
    assert pr.grad.tolist() == pytest.approx([ds(3.0) / 3], rel=1e-12)  # KL_r clamped: only its own row


def test_vanilla_kto_refuses_bad_input():
    x = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="--beta must be > 0"):
        vanilla_kto_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="at least one chosen and one rejected"):
        vanilla_kto_loss(x, x[:0], x, x[:0])

def test_dpo_extreme_log_ratios_reach_their_limits():
    """Rows h = +1e4, -1e4 and -inf (a chosen response the policy cannot emit), fed for real: each row's loss,
    gradient and implicit reward equal the closed form, or its limit at h = -inf."""
    inf = float("inf")
    pc = torch.tensor([0.0, -1e4, -inf], requires_grad=True)
    pr = torch.tensor([-1e4, 0.0, 0.0])
    ref = torch.zeros(3)
    hs = [1e4, -1e4, -inf]
    beta = 0.1

    def softplus(x):  # -log sigmoid(-x), float64, with its limits at +-inf
        return x if x == inf else (0.0 if x == -inf else max(x, 0.0) + math.log1p(math.exp(-abs(x))))

    def sig(x):
        return math.exp(-softplus(-x))

    expected = {
        # -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h); d/d pc = -beta ((1 - eps) - sigmoid(beta h))
        "dpo": ({}, [softplus(-beta * h) for h in hs], [-beta * (1 - sig(beta * h)) for h in hs]),
        "cdpo": ({"label_smoothing": 0.1}, [0.9 * softplus(-beta * h) + 0.1 * softplus(beta * h) for h in hs],
                 [-beta * (0.9 - sig(beta * h)) for h in hs]),
        # (h - 1 / (2 beta))^2; d/d pc = 2 (h - 1 / (2 beta)), -inf in the limit
        "ipo": ({"ipo": True}, [(h - 5.0) ** 2 for h in hs], [2 * (h - 5.0) for h in hs]),
    }
    for name, (kw, per_row, grad) in expected.items():
        assert per_row[2] == inf
        per, cr, rr = dpo_loss(pc, pr, ref, ref, reduction="none", **kw)
        torch.testing.assert_close(per.detach(), torch.tensor(per_row), rtol=1e-6, atol=1e-6, msg=name)
        loss, _, _ = dpo_loss(pc, pr, ref, ref, **kw)
        assert loss.item() == inf, name  # the mean of a row at its +inf limit
        per.sum().backward()
        torch.testing.assert_close(pc.grad, torch.tensor(grad), rtol=1e-6, atol=1e-6, msg=name)
        assert cr.tolist() == [0.0, -1000.0, -inf] and rr.tolist() == [-1000.0, 0.0, 0.0]
        pc.grad = None
    finite, _, _ = dpo_loss(pc[:2], pr[:2], ref[:2], ref[:2])  # the two finite extremes alone: (0 + 1000) / 2
    assert finite.item() == pytest.approx(500.0, rel=1e-6)


def test_half_precision_inputs_are_computed_in_float32():
    """bf16 log-probs / rewards are upcast before the arithmetic: the result is float32 and as accurate as
    float32 on the (exactly representable) bf16 values, checked against float64."""
    c = torch.tensor([1.5, -2.25, 0.75], dtype=torch.bfloat16)
    r = torch.tensor([0.5, 1.0, 0.625], dtype=torch.bfloat16)
    out = pairwise_loss(c, r, reduction="none")
    assert out.dtype == torch.float32
    ref = [-log_sigmoid(a - b) for a, b in zip(c.double().tolist(), r.double().tolist())]
    assert out.tolist() == pytest.approx(ref, rel=1e-6)
    x = torch.tensor([[-0.1, -2.5, -7.0]], dtype=torch.bfloat16)
    seq = sequence_log_probs(x, None)
    assert seq.dtype == torch.float32 and seq.item() == pytest.approx(math.fsum(x.double()[0].tolist()), rel=1e-6)
