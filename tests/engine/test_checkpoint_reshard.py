"""The RNG rule of a checkpoint resumed on another number of ranks (rlhfkit/engine/checkpoint.py); the model and
optimizer resharding itself is tested end to end in tests/e2e/test_reshard_resume.py and tests/rl/test_ppo_full.py."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from rlhfkit.engine import checkpoint
from rlhfkit.engine.checkpoint import derived_rng_seed, load_checkpoint, save_checkpoint


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _place(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setattr(checkpoint, "_rank", lambda: rank)
    monkeypatch.setattr(checkpoint, "_world_size", lambda: world)


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group
def test_each_rank_takes_its_saved_rng_or_a_derived_one(tmp_path, monkeypatch, stepped_linear):
    model, optimizer, scheduler = stepped_linear
    _place(monkeypatch, 0, 1)
    torch.manual_seed(123)
    saved_torch = torch.get_rng_state()
    save_checkpoint(tmp_path, 6, model, optimizer, scheduler, {"epoch": 0}, max_keep=1)
    assert json.loads((tmp_path / "global_step6" / "trainer_state.json").read_text())["world_size"] == 1
    weight = model.weight.detach().clone()

    torch.manual_seed(999)  # rank 0 of 2: the saved rank 0's state, and the manifest's facts
    with torch.no_grad():
        model.weight.zero_()
    _place(monkeypatch, 0, 2)
    logger, lines = logging.getLogger("rlhfkit"), _Lines()
    logger.addHandler(lines)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        state = load_checkpoint(tmp_path, model, optimizer, scheduler, seed=7)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    assert torch.equal(torch.get_rng_state(), saved_torch) and torch.equal(model.weight, weight)
    assert (state["saved_world_size"], state["world_size"], state["step"]) == (1, 2, 6)
    [note] = lines.messages
    assert "from 1 to 2 ranks" in note and str(derived_rng_seed(7, 6, 1)) in note

    draws = []
    for _ in range(2):  # rank 1 of 2: no saved state; seeded from (seed, step, rank), the same every time
        torch.manual_seed(999)
        _place(monkeypatch, 1, 2)
        load_checkpoint(tmp_path, model, optimizer, scheduler, seed=7)
        draws.append(torch.rand(3))
    torch.manual_seed(derived_rng_seed(7, 6, 1))
    expected = torch.rand(3)
    assert torch.equal(draws[0], expected) and torch.equal(draws[1], expected)
    assert not torch.equal(expected, torch.manual_seed(123) and torch.rand(3))  # not rank 0's stream
    seeds = {derived_rng_seed(7, 6, r) for r in range(4)} | {derived_rng_seed(7, 8, 1), derived_rng_seed(8, 6, 1)}
    assert len(seeds) == 6  # another rank, step or --seed: another stream
