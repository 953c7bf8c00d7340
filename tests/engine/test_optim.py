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
