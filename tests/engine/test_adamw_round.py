"""AdamW and stochastic rounding in one pass (`rlhfkit.engine.adamw_round`): the same masters, optimizer state and
bf16 weights as torch's fused AdamW step followed by `MasterWeights.sync_to_model`, and AdamW's formula by hand in
float64."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from rlhfkit.engine.adamw_round import adamw_step_and_round, fuses_adamw_and_rounding
from rlhfkit.engine.master_weights import MasterWeights, RoundingScratch
from rlhfkit.engine.optim import build_optimizer

LR, BETAS, EPS, DECAY = 1e-3, (0.9, 0.95), 1e-8, 0.1


def _model() -> nn.Module:
    """A 300 x 300 weight (above the size split over threads), a bias and a small 2-D weight; weights of a few
    hundredths, as a language model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 300), nn.Linear(300, 7, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    return model


def _gradients(masters: nn.Module, step: int, skip: str | None = None) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for name, p in masters.named_parameters():
        p.grad = None if name == skip else torch.randn(p.shape, generator=g) * 1e-2


def _close_to_float32_rounding(got: torch.Tensor, expected: torch.Tensor, scale: float) -> None:
    """Equal up to 4 float32 ulps of `scale` (the size of the terms that were added: their order and fused
    multiply-adds differ between the kernels)."""
    diff = float((got.detach() - expected.detach()).abs().max())
    assert diff <= 4 * torch.finfo(torch.float32).eps * scale, f"{diff:.3g} against a scale of {scale:.3g}"


def _pair(threads: int) -> tuple[tuple[MasterWeights, torch.optim.AdamW], tuple[MasterWeights, torch.optim.AdamW]]:
    """Two identical bf16 models with fp32 masters (stochastic rounding, seed 7) and fused AdamW optimizers."""
    sides = []
    for _ in range(2):
        master = MasterWeights(_model(), torch.bfloat16, rounding="stochastic", seed=7)
        master.scratch = RoundingScratch("cpu", threads=threads)
        sides.append((master, build_optimizer(master.masters, LR, BETAS, DECAY, EPS)))
    return sides[0], sides[1]


@pytest.mark.parametrize("threads", [1, 3])
def test_one_pass_equals_torch_fused_adamw_then_the_rounding(threads):
    """Three steps (the second with a clip's grad_scale, the third without a gradient for the bias): the masters and
    AdamW's moments within float32 rounding of torch's fused AdamW (the kernels order a few operations differently),
    the step counts equal, and the bf16 weights bit for bit those `sync_to_model` rounds from torch's masters wherever
    the two masters are equal (where they differ in the last bit, a rounding may differ)."""
    (ours, ours_opt), (torch_side, torch_opt) = _pair(threads)
    assert fuses_adamw_and_rounding(ours_opt, ours)
    for step, scale, skip in ((1, None, None), (2, torch.tensor(3.0), None), (3, None, "0.bias")):
        for master in (ours, torch_side):
            _gradients(master.masters, step, skip)
        adamw_step_and_round(ours_opt, ours, step, grad_scale=scale)
        if scale is not None:
            torch_opt.grad_scale = scale  # type: ignore[attr-defined]
        torch_opt.step()
        if scale is not None:
            del torch_opt.grad_scale  # type: ignore[attr-defined]
        torch_side.sync_to_model(step)
        for (param, master), (other_param, other) in zip(ours.pairs, torch_side.pairs):
            _close_to_float32_rounding(master, other, float(other.detach().abs().max()))
            if master in ours_opt.state:
                for key in ("exp_avg", "exp_avg_sq"):
                    moment = torch_opt.state[other][key]
                    _close_to_float32_rounding(ours_opt.state[master][key], moment, float(moment.abs().max()))
                assert float(ours_opt.state[master]["step"]) == float(torch_opt.state[other]["step"])
            same = master == other
            assert torch.equal(param[same], other_param[same]), f"step {step}: the rounding differs"
    bias = dict(ours.masters.named_parameters())["0.bias"]
    assert float(ours_opt.state[bias]["step"]) == 2  # no gradient at step 3: not stepped, only rounded
    assert all(param.dtype == torch.bfloat16 for param, _ in ours.pairs)


def test_one_pass_is_adamw_by_hand_in_float64():
    """Two steps of one weight matrix with weight decay and a grad_scale: the masters equal AdamW computed by hand in
    float64 (bias corrections 1 - beta^t) to float32 precision, and every bf16 weight is one of the two bf16
    neighbours of its master."""
    (ours, optimizer), _ = _pair(2)
    weight = dict(ours.masters.named_parameters())["0.weight"]
    p = weight.detach().double().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for step, scale in ((1, 2.0), (2, 1.0)):
        _gradients(ours.masters, step)
        g = weight.grad.double() / scale
        adamw_step_and_round(optimizer, ours, step, grad_scale=torch.tensor(scale))
        p = p * (1 - LR * DECAY)
        m = BETAS[0] * m + (1 - BETAS[0]) * g
        v = BETAS[1] * v + (1 - BETAS[1]) * g * g
        p = p - LR / (1 - BETAS[0] ** step) * m / ((v / (1 - BETAS[1] ** step)).sqrt() + EPS)
        torch.testing.assert_close(weight.detach().double(), p, rtol=1e-6, atol=1e-9)
    rounded = ours.pairs[0][0].detach()
    lower = weight.detach().to(torch.bfloat16)  # nearest; the other neighbour is one bf16 step away
    step_size = (weight.detach().abs() * 2 ** -7).clamp_min(torch.finfo(torch.float32).tiny)
    assert bool(((rounded.float() - weight.detach()).abs() <= step_size).all())
    assert not torch.equal(rounded, lower)  # stochastic: some weights round away from the nearest
    assert math.isfinite(float(rounded.float().sum()))


def test_only_torch_fused_adamw_over_stochastically_rounded_masters_is_fused():
    """Nearest rounding, the per-parameter AdamW loop, amsgrad or no masters: the two-pass step stays."""
    (master, optimizer), _ = _pair(1)
    assert fuses_adamw_and_rounding(optimizer, master)
    assert not fuses_adamw_and_rounding(optimizer, None)
    nearest = MasterWeights(_model(), torch.bfloat16, rounding="nearest")
    assert not fuses_adamw_and_rounding(build_optimizer(nearest.masters, LR, BETAS, DECAY, EPS), nearest)
    loop = torch.optim.AdamW(master.masters.parameters(), lr=LR, foreach=False)
    assert not fuses_adamw_and_rounding(loop, master)
    amsgrad = torch.optim.AdamW(master.masters.parameters(), lr=LR, fused=True, amsgrad=True)
    assert not fuses_adamw_and_rounding(amsgrad, master)
    sgd = torch.optim.SGD(copy.deepcopy(master.masters).parameters(), lr=LR)
    assert not fuses_adamw_and_rounding(sgd, master)
