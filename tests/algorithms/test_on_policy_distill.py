"""On-policy distillation's signal (`--advantage_estimator on_policy_distill`) against a float64 hand computation
from logits: each sampled token's advantage is kl_coef x (log softmax(teacher)[y] - log softmax(student)[y]), plus
reward_weight x the (group-baselined) task reward, 0 at masked positions; and the full-vocabulary reverse KL."""

from __future__ import annotations

import math

import pytest
import torch

from rlhfkit.algorithms.advantages import compute_advantages_and_returns, on_policy_distill_advantages
from rlhfkit.algorithms.kl import full_reverse_kl


def _log_softmax_by_hand(row: list[float]) -> list[float]:
    top = max(row)
    log_z = top + math.log(sum(math.exp(v - top) for v in row))
    return [v - log_z for v in row]


def _sampled_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(y_t) per position, by hand in Python floats (no torch softmax)."""
    out = [[_log_softmax_by_hand(logits[b, t].tolist())[int(tokens[b, t])] for t in range(tokens.shape[1])]
           for b in range(tokens.shape[0])]
    return torch.tensor(out, dtype=torch.float64)


@pytest.fixture
def case():
    g = torch.Generator().manual_seed(7)
    student_logits = torch.randn(4, 5, 11, generator=g, dtype=torch.float64)
    teacher_logits = 3.0 * torch.randn(4, 5, 11, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 11, (4, 5), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    return student_logits, teacher_logits, tokens, mask


def test_the_advantage_is_the_negative_sampled_reverse_kl(case):
    student_logits, teacher_logits, tokens, mask = case
    s = torch.log_softmax(student_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    t = torch.log_softmax(teacher_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    got = on_policy_distill_advantages(s, t, mask, kl_coef=0.5)
    s_hand, t_hand = _sampled_log_probs(student_logits, tokens), _sampled_log_probs(teacher_logits, tokens)
    for b in range(4):
        for k in range(5):
            want = 0.5 * (t_hand[b, k] - s_hand[b, k]) if mask[b, k] else 0.0
            assert float(got[b, k]) == pytest.approx(float(want), abs=1e-12)
    assert got.dtype == torch.float64
    assert (got[mask] != 0).all()  # the reference is not trivially zero


def test_the_task_reward_is_added_with_a_group_mean_baseline(case):
    student_logits, teacher_logits, tokens, mask = case
    s = _sampled_log_probs(student_logits, tokens)
    t = _sampled_log_probs(teacher_logits, tokens)
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0], dtype=torch.float64)  # two groups of 2: means 0.5 and 1.5
    got = on_policy_distill_advantages(s, t, mask, rewards, kl_coef=2.0, reward_weight=0.25, n_samples_per_prompt=2)
    baselined = [0.5, -0.5, -1.5, 1.5]
    for b in range(4):
        for k in range(5):
            want = 2.0 * (float(t[b, k]) - float(s[b, k])) + 0.25 * baselined[b] if mask[b, k] else 0.0
            assert float(got[b, k]) == pytest.approx(want, abs=1e-12)
    single = on_policy_distill_advantages(s, t, mask, rewards, kl_coef=1.0, reward_weight=1.0)
    assert float(single[3, 0]) == pytest.approx(float(t[3, 0] - s[3, 0]) + 3.0, abs=1e-12)  # n = 1: the raw reward


def test_the_estimator_of_compute_advantages_clips_and_does_not_whiten_or_discount(case):
    student_logits, teacher_logits, tokens, mask = case
    s = _sampled_log_probs(student_logits, tokens)
    t = _sampled_log_probs(teacher_logits, tokens)
    rewards = torch.tensor([20.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    adv, ret = compute_advantages_and_returns("on_policy_distill", rewards, mask, n_samples_per_prompt=1,
                                              student_log_probs=s, teacher_log_probs=t, opd_kl_coef=0.5,
                                              opd_reward_weight=0.1, reward_clip_range=(-10.0, 10.0), gamma=1.0)
    assert float(adv[0, 0]) == pytest.approx(0.5 * float(t[0, 0] - s[0, 0]) + 0.1 * 10.0, abs=1e-12)  # clipped
    assert float(adv[1, 2]) == pytest.approx(0.5 * float(t[1, 2] - s[1, 2]), abs=1e-12)  # its own token only
    assert torch.equal(adv, ret)
    with pytest.raises(ValueError, match="student's and the teacher's log-probs"):
        compute_advantages_and_returns("on_policy_distill", rewards, mask)


def test_full_reverse_kl_by_hand(case):
    student_logits, teacher_logits, _, mask = case
    got = full_reverse_kl(student_logits, teacher_logits, mask)
    for b in range(4):
        for k in range(5):
            ls = _log_softmax_by_hand(student_logits[b, k].tolist())
            lt = _log_softmax_by_hand(teacher_logits[b, k].tolist())
            want = sum(math.exp(a) * (a - c) for a, c in zip(ls, lt)) if mask[b, k] else 0.0
            assert float(got[b, k]) == pytest.approx(want, abs=1e-12)
    assert float(got[mask].min()) > 0


def test_the_sampled_signal_estimates_the_reverse_kl():
    """E_{y ~ p_s}[log p_s(y) - log p_t(y)] = KL(p_s || p_t): the mean of -advantage over many samples of one
    position approaches the exact value."""
    g = torch.Generator().manual_seed(3)
    ls = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    lt = torch.log_softmax(2 * torch.randn(7, generator=g, dtype=torch.float64), -1)
    y = torch.multinomial(ls.exp(), 200_000, replacement=True, generator=g)
    adv = on_policy_distill_advantages(ls[y][None], lt[y][None], torch.ones(1, y.numel(), dtype=torch.bool))
    exact = float((ls.exp() * (ls - lt)).sum())
    assert -float(adv.mean()) == pytest.approx(exact, rel=0.02)
