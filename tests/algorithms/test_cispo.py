"""CISPO (--policy_loss_type cispo, MiniMax-M1): value and gradient against a float64 hand computation with ratios
far outside the clip range, so the clip is active on both sides."""

import math

import pytest
import torch

from rlhfkit.algorithms.policy_loss import ppo_policy_loss
from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.rl.policy_step import policy_loss

D = torch.float64


def _ppo_cfg(**flags):
    base = {"pretrain": "m", "prompt_data": "p", "remote_rm_url": "builtin:format"}
    return parse_config("ppo", None, flags_to_argv({**base, **flags}))


def test_cispo_value_and_gradient_match_the_formula_with_the_clip_active():
    """l_t = -clip(rho_t, 1 - lo, 1 + hi) A_t log pi_t, token mean; d/d log pi_t = -clip(rho_t) A_t / N. The loss is
    the policy step's (rlhfkit.rl.policy_step.policy_loss) under ppo's parsed --policy_loss_type cispo."""
    lp = [[-0.3, -2.0, -1.0, -0.7], [-4.0, -0.1, -1.5, float("-inf")]]
    old = [[-1.8, -0.5, -1.05, -0.7], [-1.0, -3.0, -1.2, -2.0]]  # log rho = 1.5, -1.5, 0.05, 0; -3, 2.9, -0.3
    adv = [[1.0, -2.0, 0.5, 3.0], [-1.0, 2.0, 0.25, 9.0]]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    lo, hi = 0.2, 0.28
    log_probs = torch.tensor(lp, dtype=D, requires_grad=True)
    cfg = _ppo_cfg(policy_loss_type="cispo", eps_clip_low_high=[lo, hi])
    n = 7
    mb = {"action_mask": mask, "advantages": torch.tensor(adv, dtype=D)}
    out = policy_loss(cfg, mb, log_probs, torch.zeros_like(log_probs), torch.tensor(old, dtype=D), {}, num_tokens=n,
                      num_seqs=None, kl_coef=0.0)
    loss, metrics = out.loss, out.metrics
    loss.backward()
    terms, grads, clipped, ratios = [], [[0.0] * 4 for _ in range(2)], 0, []
    for b in range(2):
        for t in range(4):
            if not mask[b, t]:
                continue
            rho = math.exp(lp[b][t] - old[b][t])
            w = min(max(rho, 1 - lo), 1 + hi)
            clipped += not (1 - lo <= rho <= 1 + hi)
            terms.append(-w * adv[b][t] * lp[b][t])
            grads[b][t] = -w * adv[b][t] / n
            ratios.append(rho)
    assert float(loss.detach()) == pytest.approx(math.fsum(terms) / n, rel=1e-12)
    torch.testing.assert_close(log_probs.grad, torch.tensor(grads, dtype=D), rtol=1e-12, atol=0)
    assert clipped == 5 and float(metrics["clip_frac"]) == pytest.approx(5 / 7)
    assert float(metrics["ratio_max"]) == pytest.approx(max(ratios), rel=1e-12)
    assert float(metrics["dual_clip_frac"]) == 0.0


def test_cispo_keeps_the_gradient_of_tokens_ppo_clips_out():
    """A token with rho = e^1.5 and A > 0 gets no gradient from PPO's clipped surrogate; CISPO gives it
    -(1 + hi) A / N, and its loss value differs from PPO's."""
    lp = torch.tensor([[-0.5, -1.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[-2.0, -1.0]], dtype=D)
    adv = torch.tensor([[1.0, 1.0]], dtype=D)
    ppo, _ = ppo_policy_loss(lp, old, adv, None, eps_clip=0.2)
    (g_ppo,) = torch.autograd.grad(ppo, lp)
    cispo, _ = ppo_policy_loss(lp, old, adv, None, eps_clip=0.2, policy_loss_type="cispo")
    (g_cispo,) = torch.autograd.grad(cispo, lp)
    assert float(g_ppo[0, 0]) == 0.0
    assert float(g_cispo[0, 0]) == pytest.approx(-1.2 / 2, rel=1e-12)
    assert float(g_cispo[0, 1]) == pytest.approx(-1.0 / 2, rel=1e-12)  # rho = 1: plain REINFORCE
    assert float(cispo.detach()) == pytest.approx(-(1.2 * -0.5 + 1.0 * -1.0) / 2, rel=1e-12)
    assert float(cispo.detach()) != pytest.approx(float(ppo.detach()))


def test_cispo_refuses_dual_clip_and_takes_off_policy_weights():
    lp = torch.tensor([[-1.0, -2.0]], dtype=D)
    with pytest.raises(ValueError, match="--dual_clip"):
        ppo_policy_loss(lp, lp, torch.ones_like(lp), None, dual_clip=3.0, policy_loss_type="cispo")
    w = torch.tensor([[0.5, 2.0]], dtype=D)
    loss, _ = ppo_policy_loss(lp, lp, torch.ones_like(lp), None, is_weights=w, policy_loss_type="cispo")
    assert float(loss) == pytest.approx(-(0.5 * -1.0 + 2.0 * -2.0) / 2, rel=1e-12)
