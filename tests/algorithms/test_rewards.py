"""Reward shaping, clipping and KL controllers against loop references."""


import pytest
import torch

from rlhfkit.algorithms.rewards import (
    AdaptiveKLController,
    FixedKLController,
    clip_rewards,
    last_token_index,
    shape_rewards,
)

MASK = torch.tensor(
    [
        [0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 1, 1, 1],
        [0, 0, 1, 1, 1],
    ]
)


def ref_shape(r, kl, mask, coef):
    out = []
    for b, mrow in enumerate(mask.tolist()):
        valid = [t for t, m in enumerate(mrow) if m]
        row = [0.0] * len(mrow)
        for t in valid:
            row[t] = -coef * kl[b][t]
        if valid:
            row[valid[-1]] += r[b]
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def test_last_token_index():
    assert last_token_index(MASK).tolist() == [-1, 0, 2, 3, 4, 4]


@pytest.mark.parametrize("coef", [0.0, 0.05])
def test_shape_rewards_matches_reference(coef):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(6, generator=g, dtype=torch.float64)
    kl = torch.randn(6, 5, generator=g, dtype=torch.float64)
    out = shape_rewards(r, MASK, kl, coef)
    torch.testing.assert_close(out, ref_shape(r.tolist(), kl.tolist(), MASK, coef), rtol=1e-12, atol=1e-15)


def test_shape_rewards_ignores_nan_kl_padding_and_upcasts():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], dtype=torch.bfloat16)
    kl = torch.where(MASK.bool(), torch.ones(6, 5), torch.full((6, 5), float("nan")))
    out = shape_rewards(r, MASK, kl, 0.1)
    assert out.dtype == torch.float32
    # the NaN padding never reaches the result: it equals the reference on an all-ones KL
    expected = ref_shape(r.tolist(), torch.ones(6, 5).tolist(), MASK, 0.1)
    torch.testing.assert_close(out, expected.float(), rtol=1e-6, atol=1e-7)
    assert out[1].tolist() == pytest.approx([2.0 - 0.1, 0, 0, 0, 0])
    assert out[0].tolist() == [0.0] * 5


def test_shape_rewards_rejects_bad_input():
    with pytest.raises(ValueError, match=">= 0"):
        shape_rewards(torch.zeros(6), MASK, torch.zeros(6, 5), -0.1)
    with pytest.raises(ValueError, match="rewards"):
        shape_rewards(torch.zeros(5), MASK)
    with pytest.raises(ValueError, match="kl has shape"):
        shape_rewards(torch.zeros(6), MASK, torch.zeros(6, 4), 0.1)


def test_clip_rewards():
    r = torch.tensor([-20.0, -1.0, 0.5, 30.0])
    assert clip_rewards(r, (-10, 10)).tolist() == [-10.0, -1.0, 0.5, 10.0]
    assert clip_rewards(r, None) is r
    with pytest.raises(ValueError, match="low <= high"):
        clip_rewards(r, (1, -1))


def test_kl_controllers():
    fixed = FixedKLController(0.01)
    fixed.update(5.0, 100)
    assert fixed.value == 0.01
    ctl = AdaptiveKLController(0.1, kl_target=6.0, kl_horizon=10000)
    expected = 0.1
    for kl, n in [(12.0, 64), (6.0, 64), (3.0, 128), (5.7, 32)]:
        ctl.update(kl, n)
        err = min(max(kl / 6.0 - 1, -0.2), 0.2)
        expected *= 1 + err * n / 10000
        assert ctl.value == pytest.approx(expected, rel=1e-15)
    restored = AdaptiveKLController(1.0, 6.0, 10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError, match="kl_target"):
        AdaptiveKLController(0.1, 0.0, 10)


def test_fixed_kl_roundtrips():
    fixed = FixedKLController(0.05)
    assert fixed.state_dict() == {"value": 0.05}
    restored = FixedKLController(1.0)
    restored.load_state_dict({"value": 0.02})
    assert restored.value == 0.02 and isinstance(restored.value, float)


def test_shape_rewards_kl_needs_both_kl_and_a_coefficient():
    """The penalty is applied only with a KL tensor and kl_coef > 0; the default coefficient is 0."""
    r = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.25, 4.0], dtype=torch.float64)
    kl = torch.rand(MASK.shape, dtype=torch.float64) + 0.1
    plain = ref_shape(r.tolist(), kl.tolist(), MASK, 0.0)
    torch.testing.assert_close(shape_rewards(r, MASK, kl), plain)
    torch.testing.assert_close(shape_rewards(r, MASK, None, kl_coef=0.1), plain)
    torch.testing.assert_close(shape_rewards(r, MASK, kl, kl_coef=0.1), ref_shape(r.tolist(), kl.tolist(), MASK, 0.1))


def test_overlong_penalty_factor_defaults_to_one():
    from rlhfkit.algorithms.rewards import length_penalties, overlong_penalty

    lengths = torch.tensor([10, 14, 16])
    # L_max = 16, L_buf = 4: 0 up to 12 tokens, then -(|y| - 12) / 4
    assert overlong_penalty(lengths, 16, 4).tolist() == [0.0, -0.5, -1.0]
    r, _ = length_penalties(torch.zeros(3, dtype=torch.float64), lengths, torch.zeros(3, dtype=torch.bool), 16,
                            overlong_buffer_len=4)
    assert r.tolist() == [0.0, -0.5, -1.0]
