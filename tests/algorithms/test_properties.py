"""Property tests (hypothesis) for the invariants the estimators and losses must keep."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlhfkit.algorithms.advantages import (
    compute_advantages_and_returns,
    gae_advantages_and_returns,
    group_mean_baseline,
    group_normalize,
    rloo_advantages,
)
from rlhfkit.algorithms.kl import compute_kl
from rlhfkit.algorithms.normalize import aggregate_loss, masked_whiten
from rlhfkit.algorithms.policy_loss import ppo_policy_loss
from rlhfkit.algorithms.rewards import shape_rewards

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None)
floats = st.floats(-100, 100, allow_nan=False, allow_infinity=False)


@st.composite
def token_batch(draw, max_b=5, max_t=7):
    b = draw(st.integers(1, max_b))
    t = draw(st.integers(1, max_t))
    mask = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b)))
    x = torch.tensor(draw(st.lists(st.lists(floats, min_size=t, max_size=t), min_size=b, max_size=b)),
                     dtype=torch.float64)
    y = torch.tensor(draw(st.lists(st.lists(floats, min_size=t, max_size=t), min_size=b, max_size=b)),
                     dtype=torch.float64)
    return x, y, mask


@st.composite
def grouped_rewards(draw):
    n = draw(st.integers(2, 6))
    groups = draw(st.integers(1, 4))
    values = draw(st.lists(st.sampled_from([0.0, 1.0, -1.0, 0.5]) | floats, min_size=n * groups,
                           max_size=n * groups))
    return torch.tensor(values, dtype=torch.float64), n


@SETTINGS
@given(token_batch())
def test_gae_with_unit_gamma_lambda_is_reward_to_go_minus_values(batch):
    rewards, values, mask = batch
    adv, returns = gae_advantages_and_returns(rewards, values, mask, gamma=1.0, lambd=1.0)
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[b, t]:
                assert adv[b, t] == 0 and returns[b, t] == 0
                continue
            to_go = math.fsum(rewards[b, s].item() for s in range(t, mask.shape[1]) if mask[b, s])
            assert math.isclose(adv[b, t].item(), to_go - values[b, t].item(), rel_tol=1e-9, abs_tol=1e-9)
            assert math.isclose(returns[b, t].item(), to_go, rel_tol=1e-9, abs_tol=1e-9)


@SETTINGS
@given(grouped_rewards())
def test_rloo_baseline_excludes_the_sample_itself(data):
    rewards, n = data
    baseline = rewards - rloo_advantages(rewards, n)
    for i in range(rewards.shape[0]):
        g = i // n
        others = [rewards[j].item() for j in range(g * n, (g + 1) * n) if j != i]
        assert math.isclose(baseline[i].item(), math.fsum(others) / (n - 1), rel_tol=1e-9, abs_tol=1e-9)
        bumped = rewards.clone()
        bumped[i] += 17.0  # the sample's own reward does not move its baseline
        assert math.isclose((bumped - rloo_advantages(bumped, n))[i].item(), baseline[i].item(), abs_tol=1e-9)


@SETTINGS
@given(grouped_rewards())
def test_group_advantages_have_zero_mean_per_group(data):
    rewards, n = data
    for fn in (group_normalize, group_mean_baseline, rloo_advantages):
        adv = fn(rewards, n).view(-1, n)
        scale = max(1.0, rewards.abs().max().item())
        assert torch.all(adv.mean(dim=-1).abs() <= 1e-9 * scale), fn.__name__
    std = group_normalize(rewards, n).view(-1, n).std(dim=-1)
    groups = rewards.view(-1, n)
    for g in range(groups.shape[0]):
        if groups[g].std().item() > 1e-3:  # away from the eps-dominated regime the group std is 1
            assert math.isclose(std[g].item(), 1.0, rel_tol=1e-3)


@SETTINGS
@given(token_batch(), st.floats(0.0, 0.5), st.floats(0.0, 0.5), st.one_of(st.none(), st.floats(1.01, 10.0)),
       st.sampled_from(["token_mean", "seq_mean", "seq_mean_token_sum_norm"]))
def test_clipped_loss_equals_unclipped_at_ratio_one(batch, low, high, dual, mode):
    log_probs, adv, mask = batch
    log_probs = -log_probs.abs()
    lp = log_probs.clone().requires_grad_(True)
    loss, metrics = ppo_policy_loss(lp, log_probs, adv, mask, eps_clip_low_high=(low, high), dual_clip=dual,
                                    loss_agg_mode=mode)
    unclipped = aggregate_loss(-adv, mask, mode)
    assert math.isclose(loss.item(), unclipped.item(), rel_tol=1e-12, abs_tol=1e-12)
    assert metrics["clip_frac"].item() == 0.0
    loss.backward()
    lp2 = log_probs.clone().requires_grad_(True)
    aggregate_loss(-(lp2 - log_probs).exp() * adv, mask, mode).backward()
    torch.testing.assert_close(lp.grad, lp2.grad, rtol=1e-12, atol=1e-12)


@SETTINGS
@given(token_batch())
def test_k2_k3_nonnegative_and_finite(batch):
    a, b, mask = batch
    for est in ("k2", "k3"):
        kl = compute_kl(a * 10, b * 10, mask, est)
        assert torch.isfinite(kl).all() and (kl >= 0).all()


@SETTINGS
@given(token_batch())
def test_whitened_values_have_zero_mean_unit_variance(batch):
    x, _, mask = batch
    out = masked_whiten(x, mask)
    vals = out[mask]
    if vals.numel() > 1 and x[mask].std(unbiased=False) > 1e-3:
        assert abs(vals.mean().item()) < 1e-9
        assert math.isclose(vals.var(unbiased=False).item(), 1.0, rel_tol=1e-9)


@SETTINGS
@given(token_batch(), st.floats(0.0, 1.0))
def test_shaped_rewards_sum_to_reward_minus_kl_penalty(batch, coef):
    kl, _, mask = batch
    rewards = kl[:, 0] * 0.37
    shaped = shape_rewards(rewards, mask, kl, coef)
    for b in range(mask.shape[0]):
        if mask[b].any():
            expected = rewards[b].item() - coef * math.fsum(kl[b, t].item() for t in range(mask.shape[1]) if mask[b, t])
            assert math.isclose(shaped[b].sum().item(), expected, rel_tol=1e-9, abs_tol=1e-9)
        else:
            assert torch.equal(shaped[b], torch.zeros_like(shaped[b]))


@SETTINGS
@given(token_batch(), st.sampled_from(["gae", "reinforce", "reinforce_baseline", "group_norm", "dr_grpo", "rloo"]))
def test_padding_columns_do_not_change_advantages(batch, est):
    values, kl, mask = batch
    if est in ("reinforce_baseline", "group_norm", "dr_grpo", "rloo"):
        values, kl, mask = (torch.cat([x, x]) for x in (values, kl, mask))
    rewards = values[:, 0].clone()
    kw = dict(n_samples_per_prompt=2 if est not in ("gae", "reinforce") else 1, values=values, kl=kl * 0.01,
              kl_coef=0.1, gamma=0.9, lambd=0.8)
    adv, ret = compute_advantages_and_returns(est, rewards, mask, **kw)
    pad = lambda x: torch.cat([x, torch.full((x.shape[0], 3), float("nan"), dtype=x.dtype)], dim=1)  # noqa: E731
    pmask = torch.cat([mask, torch.zeros(mask.shape[0], 3, dtype=torch.bool)], dim=1)
    kw.update(values=pad(values), kl=pad(kl * 0.01))
    adv2, ret2 = compute_advantages_and_returns(est, rewards, pmask, **kw)
    torch.testing.assert_close(adv2[:, : mask.shape[1]], adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret2[:, : mask.shape[1]], ret, rtol=1e-12, atol=1e-12)
    assert (adv2[:, mask.shape[1]:] == 0).all()
