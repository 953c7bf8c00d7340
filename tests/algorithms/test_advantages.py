"""GAE, REINFORCE++ returns, group baselines and the estimator dispatcher against float64 loop references."""

import math
import statistics

import pytest
import torch

from rlhfkit.algorithms.advantages import (
    compute_advantages_and_returns,
    discounted_returns,
    gae_advantages_and_returns,
    group_mean_baseline,
    group_normalize,
    rloo_advantages,
)

# 8 rows = 2 prompts x 4 samples: all masked, length 1, right padding, a hole, full, left padding.
MASK = torch.tensor(
    [
        [0, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 1],
        [1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 1, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 1, 1, 1, 0, 0],
    ],
    dtype=torch.bool,
)


def data(seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = MASK.shape
    return (
        torch.randn(shape[0], generator=g, dtype=torch.float64) * 3,
        torch.randn(shape, generator=g, dtype=torch.float64),
        torch.randn(shape, generator=g, dtype=torch.float64),
    )


def ref_gae(R, V, M, gamma, lam):
    A, G = [], []
    for r, v, m in zip(R.tolist(), V.tolist(), M.tolist()):
        valid = [t for t, x in enumerate(m) if x]
        a, ret = [0.0] * len(m), [0.0] * len(m)
        last, next_v = 0.0, 0.0
        for t in reversed(valid):
            last = r[t] + gamma * next_v - v[t] + gamma * lam * last
            a[t], ret[t], next_v = last, last + v[t], v[t]
        A.append(a)
        G.append(ret)
    return torch.tensor(A, dtype=torch.float64), torch.tensor(G, dtype=torch.float64)


def ref_gae_classic(R, V, M, gamma, lam):
    """OpenRLHF's recursion over every position with padding zeroed (valid for right-padded masks)."""
    R, V = (R * M).tolist(), (V * M).tolist()
    A = []
    for r, v in zip(R, V):
        T, last, row = len(r), 0.0, [0.0] * len(r)
        for t in reversed(range(T)):
            nv = v[t + 1] if t < T - 1 else 0.0
            last = r[t] + gamma * nv - v[t] + gamma * lam * last
            row[t] = last
        A.append(row)
    return torch.tensor(A, dtype=torch.float64) * M


def ref_returns(R, M, gamma):
    out = []
    for r, m in zip(R.tolist(), M.tolist()):
        row, run = [0.0] * len(m), 0.0
        for t in reversed([t for t, x in enumerate(m) if x]):
            run = r[t] + gamma * run
            row[t] = run
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (1.0, 0.9)])
def test_gae_matches_reference(gamma, lam):
    _, R, V = data(1)
    V = torch.where(MASK, V, torch.full_like(V, float("nan")))
    A, G = gae_advantages_and_returns(R, V, MASK, gamma, lam)
    eA, eG = ref_gae(R, torch.nan_to_num(V), MASK, gamma, lam)
    torch.testing.assert_close(A, eA, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(G, eG, rtol=1e-12, atol=1e-13)


def test_gae_equals_openrlhf_recursion_for_right_padding():
    _, R, V = data(2)
    right_padded = torch.tensor([[1] * k + [0] * (6 - k) for k in (0, 1, 3, 6, 2, 5, 4, 6)], dtype=torch.bool)
    A, _ = gae_advantages_and_returns(R, V, right_padded, 0.95, 0.9)
    torch.testing.assert_close(A, ref_gae_classic(R, V, right_padded, 0.95, 0.9), rtol=1e-12, atol=1e-13)


def test_gae_rejects_mismatched_values():
    with pytest.raises(ValueError, match="same shape"):
        gae_advantages_and_returns(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_discounted_returns(gamma):
    _, R, _ = data(3)
    torch.testing.assert_close(
        discounted_returns(R, MASK, gamma), ref_returns(R, MASK, gamma), rtol=1e-12, atol=1e-13
    )


def test_group_baselines_match_loops():
    r, _, _ = data(4)
    n = 4
    rl = r.tolist()
    mean_b, rloo, norm = [], [], []
    for i, x in enumerate(rl):
        group = rl[(i // n) * n : (i // n + 1) * n]
        mu, sd = statistics.fmean(group), statistics.stdev(group)
        others = [y for j, y in enumerate(group) if j != i % n]
        mean_b.append(x - mu)
        rloo.append(x - math.fsum(others) / len(others))
        norm.append((x - mu) / (sd + 1e-6))
    torch.testing.assert_close(group_mean_baseline(r, n), torch.tensor(mean_b, dtype=torch.float64))
    torch.testing.assert_close(rloo_advantages(r, n), torch.tensor(rloo, dtype=torch.float64))
    torch.testing.assert_close(group_normalize(r, n), torch.tensor(norm, dtype=torch.float64))


@pytest.mark.parametrize("value", [0.1, 0.0, -3.7, 1e6])
def test_constant_group_gives_exactly_zero(value):
    for dtype in (torch.float32, torch.float64):
        r = torch.tensor([value] * 3 + [1.0, 2.0, 4.0], dtype=dtype)
        for fn in (group_mean_baseline, rloo_advantages, group_normalize):
            out = fn(r, 3)
            assert torch.equal(out[:3], torch.zeros(3, dtype=dtype)), (fn.__name__, out)
            assert torch.isfinite(out).all()


def test_group_functions_reject_bad_layouts():
    with pytest.raises(ValueError, match=">= 2"):
        group_normalize(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="whole number of groups"):
        rloo_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match=r"\[batch\]"):
        group_mean_baseline(torch.zeros(4, 2), 2)


def ref_pipeline(est, rewards, M, *, n, values, kl, coef, gamma, lam, clip, std_norm):
    r = [min(max(x, clip[0]), clip[1]) if clip else x for x in rewards.tolist()]
    if est in ("reinforce_baseline", "dr_grpo", "group_norm", "rloo"):
        base = []
        for i, x in enumerate(r):
            group = r[(i // n) * n : (i // n + 1) * n]
            mu = statistics.fmean(group)
            if est == "group_norm":
                sd = statistics.stdev(group)
                base.append(0.0 if sd == 0 else (x - mu) / (sd + 1e-6))
            elif est == "rloo":
                base.append(x - (math.fsum(group) - x) / (n - 1))
            else:
                base.append(x - mu)
        r = base
    R = []
    for b, m in enumerate(M.tolist()):
        valid = [t for t, x in enumerate(m) if x]
        row = [0.0] * len(m)
        for t in valid:
            row[t] = -coef * kl[b, t].item()
        if valid:
            row[valid[-1]] += r[b]
        R.append(row)
    R = torch.tensor(R, dtype=torch.float64)
    if est == "gae":
        A, G = ref_gae(R, values, M, gamma, lam)
    else:
        G = ref_returns(R, M, gamma)
        A = G.clone()
    if est in ("gae", "reinforce", "reinforce_baseline"):
        vals = A[M].tolist()
        mu = math.fsum(vals) / len(vals)
        sd = math.sqrt(math.fsum((v - mu) ** 2 for v in vals) / len(vals)) if std_norm else 1.0
        A = torch.where(M, (A - mu) / sd, torch.zeros_like(A))
    return A, G


@pytest.mark.parametrize("est", ["gae", "reinforce", "reinforce_baseline", "group_norm", "dr_grpo", "rloo"])
@pytest.mark.parametrize("std_norm", [True, False])
def test_dispatcher_matches_reference_pipeline(est, std_norm):
    rewards, kl, values = data(5)
    rewards[0] = 25.0  # clipped
    kw = dict(n=4, values=values, kl=kl, coef=0.05, gamma=0.97, lam=0.9, clip=(-5.0, 5.0), std_norm=std_norm)
    A, G = compute_advantages_and_returns(
        est, rewards, MASK, n_samples_per_prompt=4, values=values, kl=kl, kl_coef=0.05, gamma=0.97, lambd=0.9,
        reward_clip_range=(-5.0, 5.0), std_norm=std_norm,
    )
    eA, eG = ref_pipeline(est, rewards, MASK, **kw)
    torch.testing.assert_close(A, eA, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(G, eG, rtol=1e-10, atol=1e-12)
    assert (A[~MASK] == 0).all() and (G[~MASK] == 0).all()


def test_grpo_defaults_broadcast_the_normalised_reward():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    A, G = compute_advantages_and_returns("group_norm", rewards, MASK, n_samples_per_prompt=4)
    norm = group_normalize(rewards, 4)
    for b in range(8):
        assert torch.equal(A[b][MASK[b]], norm[b].expand(int(MASK[b].sum())))
    assert torch.equal(A[4:], torch.zeros(4, 6))  # the constant group learns nothing


def test_dispatcher_errors():
    r = torch.zeros(8)
    with pytest.raises(ValueError, match="advantage_estimator"):
        compute_advantages_and_returns("ppo", r, MASK)
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages_and_returns("gae", r, MASK)
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        compute_advantages_and_returns("rloo", r, MASK, n_samples_per_prompt=1)
    with pytest.raises(ValueError, match="values has shape"):
        compute_advantages_and_returns("gae", r, MASK, values=torch.zeros(8, 5))
    with pytest.raises(ValueError, match=r"rewards \[batch\]"):
        compute_advantages_and_returns("reinforce", torch.zeros(7), MASK)


def test_dispatcher_float32_and_length_one_responses():
    rewards = torch.tensor([1.0, -1.0, 2.0, 0.0])
    mask = torch.tensor([[1, 0], [1, 0], [1, 0], [1, 0]])
    mu = 0.5  # batch mean of the rewards; population std sqrt(mean of (0.25, 2.25, 2.25, 0.25)) = sqrt(1.25)
    expected = {  # groups (1, -1) and (2, 0): both have mean offset +-1 and sample std sqrt(2)
        "reinforce": [(x - mu) / math.sqrt(1.25) for x in (1.0, -1.0, 2.0, 0.0)],
        "reinforce_baseline": [1.0, -1.0, 1.0, -1.0],  # (r - group mean), whitened: already mean 0, variance 1
        "group_norm": [x / (math.sqrt(2.0) + 1e-6) for x in (1.0, -1.0, 1.0, -1.0)],
        "dr_grpo": [1.0, -1.0, 1.0, -1.0],
        "rloo": [2.0, -2.0, 2.0, -2.0],
    }
    for est, first in expected.items():
        A, G = compute_advantages_and_returns(est, rewards, mask, n_samples_per_prompt=2)
        assert A.dtype == torch.float32
        assert A[:, 0].tolist() == pytest.approx(first, rel=1e-6), est
        assert (A[:, 1] == 0).all()


def test_defaults_gamma_one_and_float64_values_keep_float64():
    """gamma defaults to 1 (GAE with lambd = 1 gives A_t = sum of later rewards + 0 - V_t); float32 rewards with
    float64 values are computed and returned in float64."""
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[0.1, -0.7, 9.0, 1.3], [5.0, 0.3, 2.1, 7.0]], dtype=torch.float32)
    values = torch.tensor([[0.25, 0.5, 3.0, -1.0], [1.0, 0.125, -0.3, 2.0]], dtype=torch.float64)
    r = rewards.double()
    expected_g = [[r[0, 0] + r[0, 1] + r[0, 3], r[0, 1] + r[0, 3], 0.0, r[0, 3]],
                  [0.0, r[1, 1] + r[1, 2], r[1, 2], 0.0]]
    expected_g = torch.tensor([[float(x) for x in row] for row in expected_g], dtype=torch.float64)
    adv, ret = gae_advantages_and_returns(rewards, values, mask)
    assert adv.dtype == torch.float64 and ret.dtype == torch.float64
    torch.testing.assert_close(ret, expected_g, rtol=1e-12, atol=1e-12)  # lambd = gamma = 1: G_t = reward-to-go
    torch.testing.assert_close(adv, torch.where(mask, expected_g - values, torch.zeros(())), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(discounted_returns(r, mask), expected_g, rtol=1e-12, atol=1e-12)


def test_compute_advantages_defaults_and_argument_checks():
    mask = torch.ones(4, 3, dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0, 3.0, 5.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        compute_advantages_and_returns("rloo", rewards, mask)  # default n_samples_per_prompt = 1: no group
    with pytest.raises(ValueError, match="want rewards"):
        compute_advantages_and_returns("reinforce", rewards, mask.unsqueeze(-1))
    with pytest.raises(ValueError, match="kl has shape"):  # checked even when kl_coef = 0 ignores it
        compute_advantages_and_returns("reinforce", rewards, mask, kl=torch.zeros(4, 2))
    # group_eps reaches group_normalize: (r - mean) / (std + eps) with the unbiased std of each pair
    _, ret = compute_advantages_and_returns("group_norm", rewards, mask, n_samples_per_prompt=2, group_eps=1.0)
    s1, s2 = statistics.stdev([1.0, 0.0]), statistics.stdev([3.0, 5.0])
    last = [0.5 / (s1 + 1), -0.5 / (s1 + 1), -1 / (s2 + 1), 1 / (s2 + 1)]
    assert ret[:, 0].tolist() == pytest.approx(last, rel=1e-12)  # gamma = 1: every token holds the sequence reward
