"""Methods Molt / OpenRLHF expose, against float64 references written here from their definitions:
FlashREINFORCE's batch-mean baseline (--advantage_estimator flash_reinforce), the divergence gates of the IS
correction (--is_correction_gating binary_kl|tv) and vanilla KTO on a labelled batch (kto --vanilla_loss)."""

import math

import pytest
import torch

from rlhfkit.algorithms.advantages import batch_mean_baseline, compute_advantages_and_returns
from rlhfkit.algorithms.offpolicy import importance_weights, sampled_token_divergence
from rlhfkit.algorithms.preference import vanilla_kto_labelled_loss

D = torch.float64


def test_flash_reinforce_is_reward_minus_the_batch_mean_without_whitening():
    """--advantage_estimator flash_reinforce: A = r - mean over the batch (+ the KL reward-to-go), never whitened."""
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5, -2.0]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 0, 1], [1, 1, 0]],
                        dtype=torch.bool)
    kl = torch.tensor([[0.1 * (i + j) for j in range(3)] for i in range(7)], dtype=D)
    mean = math.fsum(rewards) / len(rewards)
    adv, ret = compute_advantages_and_returns("flash_reinforce", torch.tensor(rewards, dtype=D), mask,
                                              n_samples_per_prompt=1, kl=kl, kl_coef=0.05)
    for i in range(7):
        valid = [t for t in range(3) if mask[i, t]]
        for t in range(3):
            if not mask[i, t]:
                assert adv[i, t] == 0 and ret[i, t] == 0
                continue
            # undiscounted reward-to-go: (r_i - mean) on the last valid token, -0.05 kl on every valid token
            expected = (rewards[i] - mean) * 1.0 - 0.05 * math.fsum(float(kl[i, s]) for s in valid if s >= t)
            assert float(adv[i, t]) == pytest.approx(expected, abs=1e-12)
            assert float(ret[i, t]) == pytest.approx(expected, abs=1e-12)
    # no whitening: without KL the advantages are exactly r - mean on every valid token, whatever std_norm says
    for std_norm in (True, False):
        plain, _ = compute_advantages_and_returns("flash_reinforce", torch.tensor(rewards, dtype=D), mask,
                                                  std_norm=std_norm)
        for i in range(7):
            assert torch.all(plain[i][mask[i]] == torch.tensor(rewards[i] - mean, dtype=D))


def test_flash_reinforce_constant_batch_gives_zero_and_takes_no_groups():
    assert torch.equal(batch_mean_baseline(torch.ones(5, dtype=D)), torch.zeros(5, dtype=D))
    # one sample per prompt is its regime: no group size needed, an odd batch is fine
    out = batch_mean_baseline(torch.tensor([3.0, 0.0, 0.0], dtype=D))
    assert out.tolist() == pytest.approx([2.0, -1.0, -1.0])
    with pytest.raises(ValueError, match="sequence rewards"):
        batch_mean_baseline(torch.zeros(2, 2))


def _bernoulli_kl(p, q):
    p, q = min(max(p, 1e-6), 1 - 1e-6), min(max(q, 1e-6), 1 - 1e-6)
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


# probabilities of the sampled token: trainer (old) and rollout engine
P_TRAIN = [[0.5, 0.9, 0.2, 0.7], [0.3, 0.3, 0.01, 0.6], [0.99, 0.5, 0.5, 0.4]]
P_ROLL = [[0.5, 0.7, 0.25, 0.2], [0.3, 0.32, 0.05, 0.9], [0.999, 0.45, 0.9, 0.4]]
G_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)


def _gate_reference(gating, level, delta):
    div = [[(_bernoulli_kl(r, t) if gating == "binary_kl" else abs(r - t)) for t, r in zip(tr, ro)]
           for tr, ro in zip(P_TRAIN, P_ROLL)]
    out = []
    for b in range(3):
        valid = [t for t in range(4) if G_MASK[b, t]]
        row_mean = math.fsum(div[b][t] for t in valid) / len(valid)
        out.append([0.0 if not G_MASK[b, t] or (div[b][t] if level == "token" else row_mean) > delta
                    else P_TRAIN[b][t] / P_ROLL[b][t] for t in range(4)])
    return div, torch.tensor(out, dtype=D)


@pytest.mark.parametrize("gating", ["binary_kl", "tv"])
@pytest.mark.parametrize("level", ["token", "seq"])
def test_divergence_gates_match_the_float64_formula(gating, level):
    """--is_correction_gating binary_kl|tv at token and seq level: the weights of the written formula."""
    old, rollout = torch.tensor(P_TRAIN, dtype=D).log(), torch.tensor(P_ROLL, dtype=D).log()
    delta = 0.02 if gating == "binary_kl" else (0.1 if level == "token" else 0.085)
    div, expected = _gate_reference(gating, level, delta)
    got_div = sampled_token_divergence(gating, old, rollout)
    assert torch.allclose(got_div, torch.tensor(div, dtype=D), rtol=1e-10, atol=1e-12)
    weights, metrics = importance_weights(old, rollout, G_MASK, level=level, mode="mask", low=0.0, high=delta,
                                          gating=gating)
    assert torch.allclose(weights, expected, rtol=1e-10, atol=0)
    dropped = sum(1 for b in range(3) for t in range(4) if G_MASK[b, t] and expected[b, t] == 0)
    assert 0 < dropped < int(G_MASK.sum())  # the gate both keeps and drops here
    assert float(metrics["is_truncated_frac"]) == pytest.approx(dropped / int(G_MASK.sum()))


def test_divergence_gates_refuse_cells_and_bands_they_cannot_use():
    old = torch.zeros(1, 2, dtype=D)
    with pytest.raises(ValueError, match="mode mask at level token or seq"):
        importance_weights(old, old, None, level="token", mode="clip", low=0.0, high=0.1, gating="tv")
    with pytest.raises(ValueError, match="mode mask at level token or seq"):
        importance_weights(old, old, None, level="geo", mode="mask", low=0.0, high=0.1, gating="binary_kl")
    with pytest.raises(ValueError, match="--vllm_is_truncated_threshold 0 DELTA"):
        importance_weights(old, old, None, correction_type="icepop", low=0.5, high=5.0, gating="tv")
    with pytest.raises(ValueError, match="--is_correction_gating"):
        importance_weights(old, old, None, correction_type="icepop", low=0.0, high=5.0, gating="hellinger")


def test_vanilla_kto_on_a_labelled_batch_matches_the_formula_and_carries_gradient():
    """kto --vanilla_loss's loss: value, reference points and gradient (through them) of the written formula."""
    r_pol = [-3.0, -1.0, -2.5, -4.0, -0.5]
    r_ref = [-3.5, -1.2, -2.0, -3.0, -1.5]
    label = [True, False, True, False, True]
    beta = 0.7
    r = [a - b for a, b in zip(r_pol, r_ref)]
    kl_d = max(0.0, math.fsum(x for x, d in zip(r, label) if d) / 3)
    kl_u = max(0.0, math.fsum(x for x, d in zip(r, label) if not d) / 2)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = [1 - sig(beta * (x - kl_u)) if d else 1 - sig(beta * (kl_d - x)) for x, d in zip(r, label)]
    pol = torch.tensor(r_pol, dtype=D, requires_grad=True)
    loss, rewards, points = vanilla_kto_labelled_loss(pol, torch.tensor(r_ref, dtype=D), torch.tensor(label),
                                                      beta=beta, reduction="sum")
    assert float(loss.detach()) == pytest.approx(math.fsum(expected), rel=1e-12)
    assert points.tolist() == pytest.approx([kl_d, kl_u], abs=1e-12)
    assert rewards.tolist() == pytest.approx([beta * x for x in r])
    assert kl_d > 0 and kl_u == 0  # one point active, one clamped
    loss.backward()
    # d/d pol_i: the own term, plus (desirable side) the undesirable rows' dependence through KL_D = mean_D r
    s = [sig(beta * (x - kl_u)) if d else sig(beta * (kl_d - x)) for x, d in zip(r, label)]
    through_kl_d = math.fsum(-beta * s[j] * (1 - s[j]) for j in range(5) if not label[j]) / 3
    grad = [(-beta * s[i] * (1 - s[i]) + through_kl_d) if label[i] else beta * s[i] * (1 - s[i]) for i in range(5)]
    assert pol.grad.tolist() == pytest.approx(grad, rel=1e-10)


def test_vanilla_kto_one_sided_batch_uses_reference_point_zero():
    pol, ref = torch.tensor([-1.0, -2.0], dtype=D), torch.tensor([-2.0, -2.5], dtype=D)
    loss, _, points = vanilla_kto_labelled_loss(pol, ref, torch.tensor([True, True]), beta=1.0, reduction="none")
    assert points.tolist() == [pytest.approx(0.75), 0.0]
    assert loss.tolist() == pytest.approx([1 - 1 / (1 + math.exp(-1.0)), 1 - 1 / (1 + math.exp(-0.5))])
    with pytest.raises(ValueError, match="--beta"):
        vanilla_kto_labelled_loss(pol, ref, torch.tensor([True, False]), beta=0.0)
