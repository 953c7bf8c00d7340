"""--async_train: step t+1's rollout is generated while step t trains, with weights one step old."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from ppo_helpers import run, series

from rlhfkit.errors import ConfigError

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def test_async_samples_one_step_behind_and_still_learns(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                        tmp_path):
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, async_train=True,
               enable_vllm_is_correction=True, num_episodes=2)
    assert len(rows) == 24
    mismatch = series(rows, "rollout/logprob_abs_diff_mean")
    # step 1 is generated before any update; from step 2 on the engine is one update behind the trainer
    assert mismatch[0] < 1e-3 and min(mismatch[1:]) > 1e-2, mismatch
    assert len(series(rows, "time/wait_rollout")) == 23  # every step but the last had a rollout in flight
    # one step off-policy learns later than the synchronous run (test_ppo: +0.05 in 12 steps), but it learns
    rewards = series(rows, "rollout/reward_mean")
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.3, rewards


def test_async_resume_continues_with_the_rollout_generated_ahead(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                                 tmp_path):
    flags = {"max_samples": 16, "save_steps": 2, "max_ckpt_num": 5, "async_train": True}
    full = run(tiny_model_dir, echo_prompt_file, tmp_path / "full", rollout_vllm_engine, **flags)
    assert len(full) == 4
    pending = tmp_path / "full" / "ckpt" / "driver" / "pending_rollout_step2.pt"
    assert pending.exists()
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "ckpt" / "driver").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "ckpt" / "actor", resumed_dir / "ckpt" / "actor")
    shutil.rmtree(resumed_dir / "ckpt" / "actor" / "global_step4")
    shutil.copy(pending, resumed_dir / "ckpt" / "driver" / pending.name)
    resumed = run(tiny_model_dir, echo_prompt_file, resumed_dir, rollout_vllm_engine, load_checkpoint=True, **flags)
    assert [r["step"] for r in resumed] == [3, 4]
    for before, after in zip(full[2:], resumed):
        for key in ("rollout/reward_mean", "rollout/logprob_abs_diff_mean", "train/grad_norm", "train/entropy"):
            assert after[key] == pytest.approx(before[key], abs=1e-6), key


def test_async_contradicts_colocating_everything(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    with pytest.raises(ConfigError, match="--async_train generates while the models train"):
        run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, async_train=True, colocate_all_models=True)
    with pytest.raises(ConfigError, match="--async_queue_size 2: only 1"):
        run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, async_train=True, async_queue_size=2)
