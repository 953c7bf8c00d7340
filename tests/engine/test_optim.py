import math

import pytest
import torch

from rlhfkit.engine.optim import build_optimizer, build_scheduler


def reference_lr(step, total, warmup, peak, floor):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / (total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def test_warmup_then_cosine_with_min_lr_matches_closed_form():
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, lr=1e-3, betas=[0.9, 0.95], weight_decay=0.0)
    sched = build_scheduler(opt, total_steps=20, warmup_ratio=0.1, schedule="cosine_with_min_lr", min_lr_ratio=0.1)
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [reference_lr(s, 20, 2, 1e-3, 0.1) for s in range(20)]
    assert seen == pytest.approx(expected, rel=1e-12)
    assert seen[-1] > 1e-4 * 0.99  # floored, never reaches zero before the end


def test_weight_decay_skips_biases():
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(model, lr=1e-3, betas=[0.9, 0.95], weight_decay=0.1)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert id(model.weight) in decayed and id(model.bias) not in decayed


@pytest.mark.parametrize("max_norm", [0.05, 1e6])  # clipped, and not (the divisor is 1)
def test_clipping_folded_into_the_fused_adamw_step_equals_clip_then_step_float64(max_norm):
    """`TrainEngine.optimizer_step` hands clip_grad_norm_'s coefficient to torch's fused AdamW as the divisor of
    every gradient (`clip_divisor`) instead of scaling the gradients in a pass of its own. One step on random
    parameters equals AdamW done by hand in float64 on the clipped gradients g x min(1, max_norm / (||g|| + 1e-6))."""
    from rlhfkit.engine.optim import takes_grad_scale
    from rlhfkit.engine.train_engine import clip_divisor

    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    start = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    params = [torch.nn.Parameter(p.float()) for p in start]
    for p, grad in zip(params, grads):
        p.grad = grad.float()
    lr, betas, eps, decay = 1e-2, (0.9, 0.95), 1e-8, 0.1
    optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=decay, fused=True)
    assert takes_grad_scale(optimizer)
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    optimizer.grad_scale = clip_divisor(norm, max_norm)
    optimizer.step()
    total = math.sqrt(sum(float((grad ** 2).sum()) for grad in grads))
    coef = min(1.0, max_norm / (total + 1e-6))
    for p, p0, grad in zip(params, start, grads):
        clipped = grad * coef
        m, v = (1 - betas[0]) * clipped, (1 - betas[1]) * clipped ** 2  # first step: bias corrections 1 - beta
        expected = p0 * (1 - lr * decay) - lr * (m / (1 - betas[0])) / ((v / (1 - betas[1])).sqrt() + eps)
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-6, atol=1e-6)
    assert not takes_grad_scale(torch.optim.AdamW(params, lr=lr, foreach=False))

