"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def stepped_linear() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """A seeded Linear(4, 2) after one AdamW step, its optimizer (with state) and a constant scheduler: the small
    model the checkpoint tests save and load."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
