"""Post-processors against hand computations (float64 for the csft standardisation)."""

from __future__ import annotations

import math

import pytest

from rlhfkit.inference.postprocess import (
    conditional_sft,
    get_post_processor,
    iterative_dpo_pairs,
    rejection_sampling,
)

ROWS = [
    {"input": "p1", "output": "a", "reward": 0.5},
    {"input": "p1", "output": "b", "reward": 2.0},
    {"input": "p1", "output": "c", "reward": -1.0},
    {"input": "p2", "output": "d", "reward": 3.0},
    {"input": "p2", "output": "e", "reward": 3.0},
    {"input": "p3", "output": "f", "reward": 1.0},
]


def test_rejection_sampling_keeps_the_best_output_per_prompt_first_on_ties():
    rows, stats = rejection_sampling(ROWS)
    assert rows == [{"input": "p1", "output": "b", "reward": 2.0}, {"input": "p2", "output": "d", "reward": 3.0},
                    {"input": "p3", "output": "f", "reward": 1.0}]
    assert stats == {"inputs": 3, "rows": 3}


def test_iterative_dpo_pairs_best_against_worst_and_counts_what_it_skips():
    rows, stats = iterative_dpo_pairs(ROWS)
    assert rows == [{"prompt": "p1", "chosen": "b", "rejected": "c", "chosen_reward": 2.0, "rejected_reward": -1.0}]
    assert stats == {"inputs": 3, "rows": 1, "skipped_single_output": 1, "skipped_all_equal": 1}


def test_conditional_sft_standardises_rewards_over_the_file():
    rows, _ = conditional_sft(ROWS)
    rewards = [r["reward"] for r in ROWS]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    assert [r["rm_score"] for r in rows] == [round((r - mean) / std, 2) for r in rewards]
    assert [r["output"] for r in rows] == [r["output"] for r in ROWS]
    same, _ = conditional_sft([{"input": "p", "output": "x", "reward": 4.0}] * 2)
    assert [r["rm_score"] for r in same] == [0.0, 0.0]


def test_unknown_post_processor_is_named():
    with pytest.raises(ValueError, match="--post_processor 'best'"):
        get_post_processor("best")
