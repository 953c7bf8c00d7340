"""The IS-correction grid (--is_correction_level token|seq|geo x --is_correction_mode mask|clip|trunc): every cell
against a float64 reference written from the formulas of docs/algorithms.md, the named presets (tis, icepop,
seq-mask-tis) equal to their cells, and the upstream OpenRLHF fixes that concern these weights (#1298, #1314)."""

import math

import pytest
import torch

from rlhfkit.algorithms.offpolicy import IS_CORRECTION_PRESETS, importance_weights, is_correction_cell
from rlhfkit.algorithms.policy_loss import ppo_policy_loss

D = torch.float64
LOW, HIGH = 0.5, 2.0
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0],
                     [1, 1, 1, 1]], dtype=torch.bool)
# log w = old - rollout per token; padding holds junk the weights must not read
LOG_W = [[0.1, -0.2, 0.15, 50.0],     # every token inside; product e^0.05, geo e^0.0167: inside
         [1.2, 0.9, -0.1, 0.3],       # tokens 0, 1 above 2 (e^1.2, e^0.9 > 2); product e^2.3 > 2; geo e^0.575 = 1.78
         [-1.5, 0.2, -9.0, 9.0],      # token 0 below 0.5; product e^-1.3 < 0.5; geo e^-0.65 = 0.52 inside
         [1.0, 1.0, 1.0, -0.2],       # tokens 0-2 above; product e^2.8; geo e^0.7 = 2.01 > 2
         [3.0, 3.0, 3.0, 3.0],        # no valid token
         [-0.9, -0.9, -0.9, -0.3]]    # tokens 0-2 below 0.5; product e^-3; geo e^-0.75 = 0.47 < 0.5


def batch():
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.0]] * 6, dtype=D)
    return old, old - torch.tensor(LOG_W, dtype=D)


def reference(level, mode):
    """(weights, truncated share) from the written formulas, in Python floats."""
    weights, outside, valid = [], 0, 0
    for b, row in enumerate(LOG_W):
        logs = [row[t] for t in range(4) if MASK[b, t]]
        seq = {"seq": math.exp(math.fsum(logs)) if logs else 1.0,
               "geo": math.exp(math.fsum(logs) / len(logs)) if logs else 1.0}
        out = []
        for t in range(4):
            if not MASK[b, t]:
                out.append(0.0)
                continue
            w = math.exp(row[t])
            u = w if level == "token" else seq[level]
            inside = LOW <= u <= HIGH
            if mode == "trunc":
                v, off = min(u, HIGH), u > HIGH
            elif mode == "clip":
                v, off = min(max(u, LOW), HIGH), not inside
            else:
                v, off = (min(max(w, LOW), HIGH) if inside else 0.0), not inside
            out.append(v)
            valid += 1
            outside += off
        weights.append(out)
    return torch.tensor(weights, dtype=D), outside / valid


@pytest.mark.parametrize("level", ["token", "seq", "geo"])
@pytest.mark.parametrize("mode", ["mask", "clip", "trunc"])
def test_every_cell_matches_the_float64_formula(level, mode):
    """--is_correction_level LEVEL --is_correction_mode MODE: weights and truncated share of the formula."""
    old, rollout = batch()
    w, metrics = importance_weights(old, rollout, MASK, level=level, mode=mode, low=LOW, high=HIGH)
    want, outside = reference(level, mode)
    torch.testing.assert_close(w, want, rtol=1e-12, atol=0)
    assert float(metrics["is_truncated_frac"]) == pytest.approx(outside, rel=1e-12)
    kept = [float(want[b, t]) for b in range(6) for t in range(4) if MASK[b, t]]
    assert float(metrics["is_weight_mean"]) == pytest.approx(math.fsum(kept) / len(kept), rel=1e-12)
    assert not w.requires_grad


def test_the_cells_differ_where_their_definitions_do():
    """Each cell gives a different weight tensor on this batch (the batch reaches every branch)."""
    old, rollout = batch()
    cells = {(lv, md): importance_weights(old, rollout, MASK, level=lv, mode=md, low=LOW, high=HIGH)[0]
             for lv in ("token", "seq", "geo") for md in ("mask", "clip", "trunc")}
    tensors = list(cells.values())
    assert all(not torch.equal(a, b) for i, a in enumerate(tensors) for b in tensors[i + 1:])
    # row 2 (product e^-1.3 < 0.5, geo 0.52 inside): seq x mask drops it, geo x mask keeps it, token clamped
    assert (cells["seq", "mask"][2] == 0).all() and float(cells["geo", "mask"][2, 0]) == LOW
    assert float(cells["seq", "trunc"][2, 0]) == pytest.approx(math.exp(-1.3))  # trunc leaves small weights


@pytest.mark.parametrize("preset", ["tis", "icepop", "seq-mask-tis"])
def test_presets_equal_their_cells(preset):
    """--vllm_is_correction_type PRESET gives what its cell (--is_correction_level, --is_correction_mode) gives."""
    old, rollout = batch()
    level, mode = IS_CORRECTION_PRESETS[preset]
    by_name = importance_weights(old, rollout, MASK, correction_type=preset, low=LOW, high=HIGH)
    by_cell = importance_weights(old, rollout, MASK, level=level, mode=mode, low=LOW, high=HIGH)
    torch.testing.assert_close(by_name[0], by_cell[0], rtol=0, atol=0)
    assert by_name[1].keys() == by_cell[1].keys()
    assert all(torch.equal(by_name[1][k], by_cell[1][k]) for k in by_name[1])
    assert is_correction_cell(preset) == (level, mode)
    assert {"tis": ("token", "clip"), "icepop": ("token", "mask"), "seq-mask-tis": ("geo", "mask")}[preset] == \
        (level, mode)


def test_grid_flags_are_checked():
    old, rollout = batch()
    with pytest.raises(ValueError, match="go together"):
        importance_weights(old, rollout, MASK, level="token")
    with pytest.raises(ValueError, match="--is_correction_level"):
        importance_weights(old, rollout, MASK, level="sequence", mode="mask")
    with pytest.raises(ValueError, match="--is_correction_mode"):
        importance_weights(old, rollout, MASK, level="seq", mode="truncate")


def test_seq_mask_tis_clamps_the_token_weights_of_kept_sequences():
    """OpenRLHF #1298 (issue #1295), ported: a sequence kept by its geometric mean still has its token weights
    clamped into [low, high]; before the fix, a token weight e^3 = 20.1 of a kept row went into the loss as is."""
    old = torch.zeros(1, 3, dtype=D)
    rollout = torch.tensor([[-3.0, 1.5, 1.5]], dtype=D)  # log w = (3, -1.5, -1.5): geo mean e^0 = 1, kept
    w, _ = importance_weights(old, rollout, None, correction_type="seq-mask-tis", low=0.5, high=5.0)
    assert w.tolist() == [[5.0, 0.5, 0.5]]


def test_icepop_rejecting_an_overflowing_token_gives_a_finite_loss_and_zero_gradient():
    """OpenRLHF #1314 (fixed there by torch.where instead of a multiply by the filter): with one token ratio exp(1000)
    and one ratio 1, the loss is the kept token's, and the rejected token gets gradient 0, no NaN. rlhfkit never had
    the bug: the log-ratio is clamped to +-20 and the rejection is a torch.where."""
    old = torch.tensor([[0.0, -1.0]], dtype=D)
    rollout = torch.tensor([[-1000.0, -1.0]], dtype=D)
    log_probs = old.clone().requires_grad_(True)
    w, _ = importance_weights(old, rollout, None, correction_type="icepop", low=0.5, high=5.0)
    loss, _ = ppo_policy_loss(log_probs, old, torch.ones_like(old), None, is_weights=w)
    loss.backward()
    assert w.tolist() == [[0.0, 1.0]]
    assert float(loss.detach()) == -0.5  # -(0 x 1 + 1 x 1) / 2 tokens
    assert log_probs.grad.tolist() == [[0.0, -0.5]]
