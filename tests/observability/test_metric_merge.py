"""observability.metrics.merge_metrics: the one reducer of micro-batch, rank and update metrics (#12)."""

from __future__ import annotations

import torch

from rlhfkit.observability.metrics import is_extremum, merge_metrics


def test_extrema_keep_the_extreme_and_the_rest_sum_with_their_weight():
    sums: dict[str, float] = {}
    merge_metrics(sums, {"loss": 0.5, "ratio_max": 1.25, "ratio_min": 0.75}, weight=4.0)
    merge_metrics(sums, {"loss": torch.tensor(1.0), "ratio_max": 1.5, "ratio_min": torch.tensor(0.9)}, weight=2.0)
    assert sums == {"loss": 0.5 * 4 + 1.0 * 2, "ratio_max": 1.5, "ratio_min": 0.75}
    assert merge_metrics({}, {"clipfrac": 0.25}) == {"clipfrac": 0.25}  # weight 1: a plain sum


def test_the_suffix_convention():
    assert is_extremum("rollout/logprob_abs_diff_max") and is_extremum("ratio_min")
    assert not is_extremum("max_len") and not is_extremum("loss") and not is_extremum("maxed")
