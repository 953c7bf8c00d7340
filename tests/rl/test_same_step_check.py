"""`ppo_helpers.assert_same_step`'s weight check on made-up weights (no runs): an isolated element that summation
noise moved passes; a row moved, or every weight moved a little, fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ppo_helpers import assert_same_step
from safetensors.torch import save_file

METRICS = [{"step": 1, "train/grad_norm": 1.0, "train/entropy": 2.0, "train/policy_loss": 0.1,
            "rollout/reward_mean": 0.5}]


def _runs(tmp_path: Path, change) -> tuple[Path, Path, str]:
    """An initial model (100 tensors of 64 x 512: 3.3M weights, the tiny model's size), a run `a` that moved every
    weight by +-0.03 (Adam's first step at lr 0.03) and a run `b` equal to `a` but for `change(b)`."""
    g = torch.Generator().manual_seed(0)
    initial = {f"w{i}": torch.randn(64, 512, generator=g) for i in range(100)}
    a = {n: w + 0.03 * torch.sign(torch.randn(w.shape, generator=g)) for n, w in initial.items()}
    b = {n: w.clone() for n, w in a.items()}
    change(b)
    folders = []
    for name, weights in (("init", initial), ("a", a), ("b", b)):
        folder = tmp_path / name / ("." if name == "init" else "hf")
        folder.mkdir(parents=True)
        save_file(weights, str(folder / "model.safetensors"))
        folders.append(tmp_path / name)
    return folders[1], folders[2], str(folders[0])


def test_one_element_moved_by_noise_passes(tmp_path):
    a, b, initial = _runs(tmp_path, lambda w: w["w3"].view(-1)[17].add_(3e-3))  # as measured on the AMX machine
    assert_same_step(METRICS, METRICS, a, b, initial)


@pytest.mark.parametrize(("change", "error"), [
    (lambda w: w["w5"][7].add_(0.03), "elements differing"),  # one row of 512 moved by a step
    (lambda w: w.__setitem__("w9", w["w9"] - 0.03), "elements differing"),  # one tensor left unchanged
    (lambda w: [x.add_(1e-5 * torch.sign(torch.randn_like(x))) for x in w.values()], "mean difference"),  # all weights
], ids=["a-row", "a-tensor", "every-weight-a-little"])
def test_a_structured_difference_fails(tmp_path, change, error):
    a, b, initial = _runs(tmp_path, change)
    with pytest.raises(AssertionError, match=error):
        assert_same_step(METRICS, METRICS, a, b, initial)
