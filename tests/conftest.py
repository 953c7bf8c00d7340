"""Session-wide fixtures: tiny random-init models (built once) and one Ray cluster for the whole suite."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny Llama-family causal LM (2 layers, hidden 64, head_dim 32) with SmolLM2's real tokenizer and chat template."""
    from rlhfkit.models.tiny import build_tiny_causal_lm

    return build_tiny_causal_lm(str(tmp_path_factory.mktemp("tiny_lm")))


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory) -> str:
    """The same tiny architecture with a scalar `score` head (AutoModelForSequenceClassification, num_labels=1)."""
    from rlhfkit.models.tiny import build_tiny_scalar_model

    return build_tiny_scalar_model(str(tmp_path_factory.mktemp("tiny_rm")))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from rlhfkit.models.loading import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster shared by every test that needs it (logical CPUs > cores so all roles fit)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()
