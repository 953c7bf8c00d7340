"""GSPO, seq-mask-tis, the adaptive KL controller, the length penalties (DAPO overlong, ProRL stop-properly) and the
importance-weighted (unbiased) k3 KL loss against float64 references written from their formulas (docs/algorithms.md),
not by calling the function under test."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.algorithms import (
    POLICY_LOSS_TYPES,
    AdaptiveKLController,
    FixedKLController,
    importance_weights,
    kl_loss,
    length_penalties,
    overlong_penalty,
    ppo_policy_loss,
    stop_properly_penalty,
)
from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.rl.policy_step import policy_loss

D = torch.float64


def _batch(seed: int = 0, rows: int = 5, width: int = 7):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(rows, width, generator=g, dtype=D) * 2
    old = lp + torch.randn(rows, width, generator=g, dtype=D) * 0.1
    mask = torch.ones(rows, width, dtype=torch.bool)
    mask[1, 5:] = False          # right padding
    mask[2, 2] = False           # a hole (an environment token)
    mask[3, 1:] = False          # a one-token response
    adv = torch.randn(rows, 1, generator=g, dtype=D).expand(rows, width).clone()
    adv[4] = torch.randn(width, generator=g, dtype=D)  # token-level advantages on one row
    lp[1, 5:] = float("nan")     # masked positions are never read
    old[1, 5:] = float("inf")
    return lp, old, adv, mask


# ------------------------------------------------------------------------------------------------------------ GSPO
def _gspo_seq_objective(lp, old, adv, mask, low, high):
    """The sequence-level GSPO loss: mean_i mean_{t in y_i} -min(s_i A_t, clip(s_i) A_t), s_i a differentiable
    exp(mean_t (log pi - log pi_old)), over the rows with a token."""
    rows = []
    for i in range(lp.shape[0]):
        m = mask[i]
        if not m.any():
            continue
        s = torch.exp((lp[i][m] - old[i][m]).mean())
        a = adv[i][m]
        rows.append((-torch.minimum(s * a, s.clamp(1 - low, 1 + high) * a)).mean())
    return torch.stack(rows).mean()


def test_gspo_value_per_token_loss_and_gradient():
    assert POLICY_LOSS_TYPES == ("ppo", "gspo", "cispo")
    lp, old, adv, mask = _batch()
    low, high = 0.03, 0.04
    x = lp.clone().requires_grad_(True)
    # the policy step's loss (rlhfkit.rl.policy_step.policy_loss) under ppo's parsed --policy_loss_type gspo
    flags = {"pretrain": "m", "prompt_data": "p", "remote_rm_url": "builtin:format", "policy_loss_type": "gspo",
             "eps_clip_low_high": [low, high]}
    cfg = parse_config("ppo", None, flags_to_argv(flags))
    step = policy_loss(cfg, {"action_mask": mask, "advantages": adv}, x, torch.zeros_like(x), old, {},
                       num_tokens=float(mask.sum()), num_seqs=float(lp.shape[0]), kl_coef=0.0, with_tokens=True)
    loss, out, metrics = step.loss, step.token_out, step.metrics
    assert out is not None
    x_ref = torch.where(mask, lp, torch.zeros((), dtype=D)).clone().requires_grad_(True)
    ref = _gspo_seq_objective(x_ref, torch.where(mask, old, torch.zeros((), dtype=D)), adv, mask, low, high)
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-12, abs=1e-14)
    loss.backward()
    ref.backward()
    assert torch.isfinite(x.grad).all()
    # rows 0-3 carry one advantage per sequence: the token form's gradient is the sequence objective's
    torch.testing.assert_close(torch.where(mask, x.grad, 0.0)[:4], torch.where(mask, x_ref.grad, 0.0)[:4],
                               rtol=1e-10, atol=1e-12)
    # every row (row 4 has token-level advantages, where GSPO-token differs from the sequence objective): the
    # gradient of -min(s_{i,t} A_t, clip(s_{i,t}) A_t) with d s_{i,t} / d log pi_j = s_i 1[j = t] is
    # -s_i A_t / |y_i| / B where the unclipped term is the minimum, else 0
    want = torch.zeros_like(lp)
    rows = lp.shape[0]
    for i in range(rows):
        m = mask[i]
        s = math.exp(float((lp[i][m] - old[i][m]).mean()))
        for t in range(lp.shape[1]):
            if m[t]:
                a = float(adv[i, t])
                active = s * a <= min(max(s, 1 - low), 1 + high) * a
                want[i, t] = -s * a / int(m.sum()) / rows if active else 0.0
    torch.testing.assert_close(torch.where(mask, x.grad, 0.0), want, rtol=1e-10, atol=1e-14)
    assert not torch.allclose(x.grad[4], x_ref.grad[4])
    # the logged ratio is s_i on every token of row i; the per-token loss is the sequence-clipped surrogate
    for i in range(lp.shape[0]):
        m = mask[i]
        s = math.exp(float((lp[i][m] - old[i][m]).mean()))
        torch.testing.assert_close(out["ratio"][i][m], torch.full((int(m.sum()),), s, dtype=D))
        a = adv[i][m]
        want = -torch.minimum(s * a, min(max(s, 1 - low), 1 + high) * a)
        torch.testing.assert_close(out["loss"][i][m], want)
        assert (out["loss"][i][~m] == 0).all()
    assert 0 < float(metrics["clip_frac"]) < 1  # some rows are clipped as a whole, some not


def test_gspo_clips_whole_sequences_and_differs_from_ppo():
    """A row whose sequence ratio is outside the range with A > 0 gets no gradient on any token, although some of
    its token ratios are inside it (the token-level loss would move those)."""
    lp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], dtype=D)
    old = torch.tensor([[-1.5, -1.5, -0.98], [-1.0, -1.01, -0.99]], dtype=D)  # row 0: s = exp(0.34) > 1.2
    adv = torch.ones(2, 3, dtype=D)
    mask = torch.ones(2, 3, dtype=torch.bool)
    x = lp.clone().requires_grad_(True)
    ppo_policy_loss(x, old, adv, mask, eps_clip=0.2, loss_agg_mode="seq_mean", policy_loss_type="gspo")[0].backward()
    assert (x.grad[0] == 0).all()
    s1 = math.exp(float((lp[1] - old[1]).mean()))
    torch.testing.assert_close(x.grad[1], torch.full((3,), -s1 / 3 / 2, dtype=D))  # d(-s A)/d lp_t = -s / |y| / B
    y = lp.clone().requires_grad_(True)
    ppo_policy_loss(y, old, adv, mask, eps_clip=0.2, loss_agg_mode="seq_mean")[0].backward()
    assert y.grad[0, 2] != 0  # token-level PPO still moves the token whose own ratio is inside
    with pytest.raises(ValueError, match="--policy_loss_type"):
        ppo_policy_loss(lp, old, adv, mask, policy_loss_type="gpso")


def test_gspo_sequence_exponent_is_bounded_so_loss_and_gradient_stay_finite():
    """OpenRLHF #1293: its GSPO branch exponentiated an unclamped mean log-ratio, so a sequence with a large one gave
    ratio inf and NaN gradients for the whole batch. rlhfkit's sequence log-ratio is the mean of token log-ratios
    clamped to +-20 (and clamped again): s = e^20 at most, loss and gradient finite, the clipped row has gradient 0."""
    lp = torch.tensor([[0.0, 0.0], [-1.0, -1.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[-1e4, -1e4], [-1.0, -1.0]], dtype=D)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=D)
    loss, metrics = ppo_policy_loss(lp, old, adv, None, policy_loss_type="gspo", loss_agg_mode="seq_mean")
    loss.backward()
    assert math.isfinite(float(loss.detach())) and torch.isfinite(lp.grad).all()
    assert float(metrics["ratio_max"]) == pytest.approx(math.exp(20.0), rel=1e-12)
    assert lp.grad[0].tolist() == [0.0, 0.0]  # A > 0 and s > 1 + eps: the clipped branch, no gradient
    assert float(loss.detach()) == pytest.approx((-1.2 + 1.0) / 2, rel=1e-12)  # rows: -1.2 x 1, -(1 x -1)


# ---------------------------------------------------------------------------------------------------- seq-mask-tis
def test_seq_mask_tis_masks_whole_sequences_by_their_geometric_mean():
    old = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=D)
    rollout = torch.tensor([[-0.5, 0.3, 0.1, 9.0],   # mean log w = 0.0333 (pad holds 9): kept, w_0 = e^0.5 > high
                            [-1.2, -1.2, 0.0, 0.0],   # mean log w = 0.6 -> W = 1.82 > 1.6: dropped
                            [0.1, 0.2, 0.3, 0.4]], dtype=D)  # W = exp(-0.25) = 0.78: kept
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    low, high = 0.5, 1.6
    w, metrics = importance_weights(old, rollout, mask, correction_type="seq-mask-tis", low=low, high=high)
    want = torch.zeros(3, 4, dtype=D)
    for i in range(3):
        lw = [float(old[i, t] - rollout[i, t]) for t in range(4) if mask[i, t]]
        geo = math.exp(sum(lw) / len(lw))
        for t in range(4):
            if mask[i, t] and low <= geo <= high:  # a kept row's token weights clamped (OpenRLHF #1298)
                want[i, t] = min(max(math.exp(float(old[i, t] - rollout[i, t])), low), high)
    torch.testing.assert_close(w, want)
    assert float(w[0, 0]) == high  # e^0.5 = 1.65 > high: clamped
    assert (w[1] == 0).all() and (w[2] > 0).all()
    assert float(metrics["is_truncated_frac"]) == pytest.approx(4 / 11)
    icepop, _ = importance_weights(old, rollout, mask, correction_type="icepop", low=low, high=high)
    assert float(icepop[0, 0]) == 0 and float(icepop[1, 2]) == 1  # token-level icepop decides token by token


# ---------------------------------------------------------------------------------------------------- adaptive KL
def test_adaptive_kl_controller_follows_ziegler_update():
    """--kl_target, --kl_horizon: beta <- beta (1 + clip(KL / target - 1, +-0.2) n / horizon)."""
    ctl = AdaptiveKLController(0.1, kl_target=6.0, kl_horizon=10000)
    beta = 0.1
    for kl, n in [(0.0, 512), (6.0, 512), (12.0, 1024), (7.2, 256), (3.0, 64)]:
        ctl.update(kl, n)
        e = min(max(kl / 6.0 - 1, -0.2), 0.2)
        beta *= 1 + e * n / 10000
        assert ctl.value == pytest.approx(beta, rel=1e-15)
    assert ctl.value != pytest.approx(0.1)
    again = AdaptiveKLController(0.5, 6.0, 10000)
    again.load_state_dict(ctl.state_dict())
    assert again.value == ctl.value
    fixed = FixedKLController(0.1)
    fixed.update(100.0, 512)
    assert fixed.value == 0.1
    with pytest.raises(ValueError, match="--kl_target"):
        AdaptiveKLController(0.1, 0.0, 10000)


# ------------------------------------------------------------------------------------------------ length penalties
def test_overlong_penalty_ramps_over_the_buffer():
    """--overlong_buffer_len 4 before --generate_max_len 16, --overlong_penalty_factor 0.5:
    -min(max(|y| - 12, 0), 4) / 4 x 0.5."""
    lengths = torch.tensor([0, 10, 12, 13, 15, 16, 20])
    got = overlong_penalty(lengths, max_new_tokens=16, buffer_len=4, penalty_factor=0.5)
    want = [-min(max(n - 12, 0), 4) / 4 * 0.5 for n in lengths.tolist()]
    torch.testing.assert_close(got, torch.tensor(want, dtype=D))
    assert want == [0.0, 0.0, 0.0, -0.125, -0.375, -0.5, -0.5]
    with pytest.raises(ValueError, match="--overlong_buffer_len"):
        overlong_penalty(lengths, 16, 17)


def test_stop_properly_penalty_scales_or_replaces_truncated_rewards():
    """--stop_properly_penalty_coef c: truncated rewards become c r (0 <= c <= 1) or c (c < 0)."""
    r = torch.tensor([1.0, -0.4, 0.6, 2.0], dtype=D)
    cut = torch.tensor([1.0, 1.0, 0.0, 0.0])
    torch.testing.assert_close(stop_properly_penalty(r, cut, 0.25), torch.tensor([0.25, -0.1, 0.6, 2.0], dtype=D))
    torch.testing.assert_close(stop_properly_penalty(r, cut, -0.5), torch.tensor([-0.5, -0.5, 0.6, 2.0], dtype=D))
    torch.testing.assert_close(stop_properly_penalty(r, cut, 1.0), r)
    with pytest.raises(ValueError, match="--stop_properly_penalty_coef"):
        stop_properly_penalty(r, cut, 1.5)


def test_length_penalties_apply_overlong_then_stop_properly():
    r = torch.tensor([1.0, 1.0, 0.5, 0.0], dtype=torch.float32)
    lengths = torch.tensor([8, 5, 7, 2])
    cut = torch.tensor([1.0, 0.0, 0.0, 0.0])
    out, metrics = length_penalties(r, lengths, cut, 8, overlong_buffer_len=4, overlong_penalty_factor=1.0,
                                    stop_properly_penalty_coef=0.5)
    want = []
    for ri, n, c in zip(r.tolist(), lengths.tolist(), cut.tolist()):
        x = ri - min(max(n - 4, 0), 4) / 4
        want.append(x * 0.5 if c else x)
    assert want == [0.0, 0.75, -0.25, 0.0]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor(want, dtype=torch.float32))
    assert metrics == pytest.approx({"overlong_penalized_frac": 0.75, "overlong_penalty_mean": -(1 + 0.25 + 0.75) / 4,
                                     "stop_properly_penalized_frac": 0.25,
                                     "length_penalty_mean": sum(w - x for w, x in zip(want, r.tolist())) / 4})
    same, none = length_penalties(r, lengths, cut, 8)
    assert same.tolist() == r.tolist() and none == {}


# -------------------------------------------------------------------------------------------------- unbiased k3 KL
def test_unbiased_kl_loss_value_and_gradient():
    """--use_unbiased_kl: agg_t(rho_t k3(r_t)) with a differentiable rho = pi / pi_old: value rho k3, gradient
    rho_t r_t / N per token (token mean), the unbiased gradient of KL(pi || pi_ref) from samples of pi_old."""
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(3, 5, generator=g, dtype=D)
    ref = lp + torch.randn(3, 5, generator=g, dtype=D) * 0.3
    old = lp + torch.randn(3, 5, generator=g, dtype=D) * 0.1
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[0, 3:] = False
    n = int(mask.sum())
    x = lp.clone().requires_grad_(True)
    loss = kl_loss(x, ref, mask, "k3", old_log_probs=old)
    r = lp - ref
    rho = torch.exp(lp - old)
    k3 = torch.exp(-r) - 1 + r
    assert float(loss.detach()) == pytest.approx(float((rho * k3)[mask].sum() / n), rel=1e-12)
    loss.backward()
    torch.testing.assert_close(x.grad, torch.where(mask, rho * r / n, 0.0), rtol=1e-10, atol=1e-14)
    # on-policy (old = pi): the value is the plain k3 loss, the gradient r / N instead of (1 - exp(-r)) / N
    y = lp.clone().requires_grad_(True)
    on = kl_loss(y, ref, mask, "k3", old_log_probs=lp)
    plain = kl_loss(lp.clone().requires_grad_(True), ref, mask, "k3")
    assert float(on.detach()) == pytest.approx(float(plain.detach()), rel=1e-12)
    on.backward()
    torch.testing.assert_close(y.grad, torch.where(mask, r / n, 0.0), rtol=1e-10, atol=1e-14)
    z = lp.clone().requires_grad_(True)
    kl_loss(z, ref, mask, "k3").backward()
    torch.testing.assert_close(z.grad, torch.where(mask, -torch.expm1(-r) / n, 0.0), rtol=1e-10, atol=1e-14)
