"""Reference runs several RL test modules compare with, each run once per session (every run pays ~15 s of set-up:
Ray worker processes, model loading, the weight push into the session's engine, so sharing one beats re-running it).

Each takes the session engine itself (a run's build_setup pushes that run's initial weights into it), as
test_ppo_full.py's module fixture does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


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


@pytest.fixture
def actor(tiny_model_dir, monkeypatch):
    """A real actor worker in this process (ModelWorker on a 1-rank gloo group, `init_model` as the driver calls
    it; tests/rl/test_ptx_coef.py, test_entropy_bonus.py). make(cfg) -> an actor worker built from `cfg` (lr 0:
    every step sees the initial weights) and the gradients
    its optimizer saw at each step (before clipping)."""
    from rlhfkit.engine.distributed import free_port
    from rlhfkit.rl.worker import ModelWorker

    port = free_port()
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)  # the worker sets these as Ray's would; restored after the test
    owned = not dist.is_initialized()

    def make(cfg):
        worker = ModelWorker("actor", dataclasses.replace(cfg, torch_threads_per_worker=torch.get_num_threads()),
                             0, 1, "127.0.0.1", port)
        worker.init_model(tiny_model_dir, True, 10, 0.0)
        engine, steps = worker.engine, []
        original = engine.optimizer_step

        def step(report=None):
            steps.append({name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().double()
                          for name, p in engine.model.named_parameters()})
            return original(report)

        engine.optimizer_step = step
        return worker, steps

    yield make
    if owned and dist.is_initialized():
        dist.destroy_process_group()
