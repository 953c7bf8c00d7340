"""Fixtures for the offline-method tests: a second tiny causal LM (reference / teacher) and loaded models."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> str:
    """The tiny architecture with different random weights (a reference or teacher that differs from the policy)."""
    from rlhfkit.models.tiny import build_tiny_causal_lm

    return build_tiny_causal_lm(str(tmp_path_factory.mktemp("tiny_lm_seed1")), seed=1)


@pytest.fixture
def policy(tiny_model_dir):
    from rlhfkit.models.loading import load_causal_lm

    torch.manual_seed(0)
    return load_causal_lm(tiny_model_dir).eval()


@pytest.fixture
def other(other_model_dir):
    from rlhfkit.models.loading import load_causal_lm

    return load_causal_lm(other_model_dir).eval().requires_grad_(False)
