"""Small documented rules of rlhfkit/rewards (found by mutation testing, docs/mutation.md)."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.rewards.base import check_batch, to_float_vector
from rlhfkit.rewards.code import _normalize_output
from rlhfkit.rewards.remote import RemoteRewardClient
from rlhfkit.rewards.reward_func import call_with_timeout


def test_program_output_keeps_leading_spaces_and_drops_trailing_ones():
    assert _normalize_output("\n  5  \n 6 \n\n") == "  5\n 6"


def test_queries_must_be_a_list_of_strings():
    with pytest.raises(TypeError, match="here: queries must be a list of strings, got str"):
        check_batch("one query", None, None, "here")
    assert check_batch(("a", "b"), None, None, "here") == (["a", "b"], ["", ""], [None, None])


def test_remote_client_defaults():
    client = RemoteRewardClient("http://127.0.0.1:1")
    assert (client.timeout, client.retries, client.backoff) == (60.0, 3, 1.0)


def test_no_timeout_calls_inline():
    assert call_with_timeout(lambda a, b: a + b, (2, 3), None, "f") == 5
    assert call_with_timeout(lambda a, b: a + b, (2, 3), 0, "f") == 5


def test_booleans_are_not_rewards():
    assert to_float_vector([1, 2.5, torch.tensor(3.0)], "rewards").tolist() == [1.0, 2.5, 3.0]
    with pytest.raises(ValueError, match="rewards must contain only numbers: True is a bool"):
        to_float_vector([1.0, True], "rewards")
