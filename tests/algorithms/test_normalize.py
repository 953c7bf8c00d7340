"""Masked reductions, whitening and loss aggregation against float64 loop references."""

import math

import pytest
import torch

from rlhfkit.algorithms.normalize import aggregate_loss, masked_mean, masked_sum, masked_var, masked_whiten


def ragged_mask() -> torch.Tensor:
    """Rows: all masked, length 1, right-padded, a hole in the middle (multi-turn), full."""
    return torch.tensor(
        [
            [0, 0, 0, 0, 0],
            [1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 1, 0, 1, 1],
            [1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )


def values_with_garbage(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = ragged_mask()
    x = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 3 + 1
    x = torch.where(mask, x, torch.full_like(x, float("nan")))  # padding must never be read
    return x, mask


def ref_valid(x, mask):
    return [v for row, mrow in zip(x.tolist(), mask.tolist()) for v, m in zip(row, mrow) if m]


def test_masked_sum_and_mean_ignore_masked_values():
    x, mask = values_with_garbage()
    vals = ref_valid(x, mask)
    assert masked_sum(x, mask).item() == pytest.approx(math.fsum(vals), rel=1e-12)
    assert masked_mean(x, mask).item() == pytest.approx(math.fsum(vals) / len(vals), rel=1e-12)
    per_row = masked_mean(x, mask, dim=-1)
    for b, (row, mrow) in enumerate(zip(x.tolist(), mask.tolist())):
        v = [a for a, m in zip(row, mrow) if m]
        expected = math.fsum(v) / len(v) if v else 0.0
        assert per_row[b].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_masked_mean_accepts_float_mask_and_none():
    x, mask = values_with_garbage()
    assert masked_mean(x, mask.double()).item() == pytest.approx(masked_mean(x, mask).item(), rel=1e-15)
    y = torch.arange(6.0).view(2, 3)
    assert masked_mean(y, None).item() == pytest.approx(2.5)


def test_masked_mean_rejects_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        masked_mean(torch.zeros(2, 3), torch.ones(2, 4))


@pytest.mark.parametrize("unbiased", [False, True])
def test_masked_var_matches_two_pass_loop(unbiased):
    x, mask = values_with_garbage(1)
    vals = ref_valid(x, mask)
    mu = math.fsum(vals) / len(vals)
    var = math.fsum((v - mu) ** 2 for v in vals) / (len(vals) - (1 if unbiased else 0))
    mean, v = masked_var(x, mask, unbiased=unbiased)
    assert mean.item() == pytest.approx(mu, rel=1e-12)
    assert v.item() == pytest.approx(var, rel=1e-12)


def test_masked_whiten_matches_loop_and_zeroes_padding():
    x, mask = values_with_garbage(2)
    vals = ref_valid(x, mask)
    mu = math.fsum(vals) / len(vals)
    std = math.sqrt(math.fsum((v - mu) ** 2 for v in vals) / len(vals))
    out = masked_whiten(x, mask)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            expected = (x[b, t].item() - mu) / std if mask[b, t] else 0.0
            assert out[b, t].item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
    centred = masked_whiten(x, mask, std_norm=False)
    assert centred[4, 0].item() == pytest.approx(x[4, 0].item() - mu, rel=1e-12)
    scaled = masked_whiten(x, mask, shift_mean=False)
    assert scaled[4, 0].item() == pytest.approx(x[4, 0].item() / std, rel=1e-12)


def test_masked_whiten_constant_and_empty_inputs_are_finite():
    mask = ragged_mask()
    const = torch.full(mask.shape, 3.0)
    out = masked_whiten(const, mask)
    assert torch.equal(out, torch.zeros_like(out))
    empty = masked_whiten(torch.randn(3, 4), torch.zeros(3, 4, dtype=torch.bool))
    assert torch.equal(empty, torch.zeros(3, 4))


def test_masked_whiten_keeps_low_precision_input_finite():
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out = masked_whiten(x, torch.ones(4, 6))
    assert out.dtype == torch.float32
    vals = [v for row in x.tolist() for v in row]  # the bf16 values, exactly, whitened in float64
    mu = math.fsum(vals) / len(vals)
    std = math.sqrt(math.fsum((v - mu) ** 2 for v in vals) / len(vals))
    torch.testing.assert_close(out, torch.tensor([[(v - mu) / std for v in row] for row in x.tolist()]),
                               rtol=1e-5, atol=1e-5)


def ref_aggregate(loss, mask, mode, max_len=None):
    rows = [[v for v, m in zip(r, mr) if m] for r, mr in zip(loss.tolist(), mask.tolist())]
    if mode == "token_mean":
        n = sum(len(r) for r in rows)
        return math.fsum(v for r in rows for v in r) / max(n, 1)
    if mode == "seq_mean":
        means = [math.fsum(r) / len(r) for r in rows if r]
        return math.fsum(means) / max(len(means), 1)
    length = loss.shape[1] if max_len is None else max_len
    return math.fsum(v for r in rows for v in r) / (loss.shape[0] * length)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "seq_mean_token_sum_norm"])
def test_aggregate_loss_modes(mode):
    x, mask = values_with_garbage(3)
    assert aggregate_loss(x, mask, mode).item() == pytest.approx(ref_aggregate(x, mask, mode), rel=1e-12)


def test_aggregate_loss_overrides_and_errors():
    x, mask = values_with_garbage(4)
    total = math.fsum(ref_valid(x, mask))
    assert aggregate_loss(x, mask, "token_mean", num_tokens=40).item() == pytest.approx(total / 40, rel=1e-12)
    assert aggregate_loss(x, mask, "seq_mean_token_sum_norm", max_len=8).item() == pytest.approx(
        total / (5 * 8), rel=1e-12
    )
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregate_loss(x, mask, "sum")


def test_aggregate_loss_all_masked_is_zero_with_gradient():
    x = torch.randn(2, 3, requires_grad=True)
    for mode in ("token_mean", "seq_mean", "seq_mean_token_sum_norm"):
        out = aggregate_loss(x, torch.zeros(2, 3), mode)
        assert out.item() == 0.0
        out.backward()
        assert torch.equal(x.grad, torch.zeros(2, 3))
        x.grad = None


def test_aggregate_loss_defaults_to_token_mean_and_masked_mean_rejects_dim_with_a_group():
    loss = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 1]])
    assert aggregate_loss(loss, mask).item() == pytest.approx((1 + 2 + 32) / 3, rel=1e-15)
    with pytest.raises(ValueError, match="process_group is only supported with dim=None"):
        masked_mean(loss, mask, dim=-1, process_group=object())
