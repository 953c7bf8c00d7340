"""Reference runs several RL test modules compare with, each run once per session (every run pays ~15 s of set-up:
Ray worker processes, model loading, the weight push into the session's engine, so sharing one beats re-running it).

Each takes the session engine itself (a run's build_setup pushes that run's initial weights into it), as
test_ppo_full.py's module fixture does."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def grpo_one_step(tiny_model_dir, echo_prompt_file, vllm_engine_session, tmp_path_factory) -> tuple[Path, list[dict]]:
    """One plain GRPO step (`ppo_helpers.run`, --max_samples 4, padded, 1 actor rank): the reference of the
    dynamic-batch (test_ppo_options.py) and ring-attention (test_ring_ppo.py) one-step equivalences."""
    from ppo_helpers import run  # here, not at collection: it imports the whole online loop

    out = tmp_path_factory.mktemp("grpo_one_step")
    return out, run(tiny_model_dir, echo_prompt_file, out, vllm_engine_session, max_samples=4)


@pytest.fixture(scope="session")
def grpo_kl_loss_run(tiny_model_dir, echo_prompt_file, vllm_engine_session,
                     tmp_path_factory) -> tuple[Path, list[dict]]:
    """Two GRPO steps with a k3 KL loss (KL_LOSS), padded, the old log-probs taken from the training pass: the
    reference of the separate-pass (test_old_log_probs.py) and packed (test_packing.py) runs of the same flags."""
    from ppo_helpers import KL_LOSS, run

    out = tmp_path_factory.mktemp("grpo_kl_loss")
    return out, run(tiny_model_dir, echo_prompt_file, out, vllm_engine_session, **KL_LOSS)
