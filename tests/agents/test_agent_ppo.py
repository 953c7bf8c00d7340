"""`rlhfkit ppo --agent_func_path`: GRPO on two-turn episodes, end to end on real Ray + vLLM + the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ppo_helpers import run, series

from rlhfkit.errors import ConfigError

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


AGENT = {"remote_rm_url": None, "agent_func_path": str(HERE / "two_turn_env.py"), "agent_action_max_len": 4,
         "generate_max_len": 40}


def test_grpo_on_two_turn_episodes_raises_the_environment_reward(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                                 tmp_path):
    # 8 steps (32 prompts) at lr 5e-2, not 12 at 3e-2 (measured with seed 5: 0.07 in steps 1-3, 0.54 / 0.79 / 0.89 in
    # steps 6-8; at lr 3e-2 these 8 steps stay at 0.07-0.09)
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, max_samples=32,
               actor_learning_rate=5e-2, **AGENT)
    rewards = series(rows, "rollout/reward_mean")
    assert len(rewards) == 8
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.05, rewards
    assert all(t == 2.0 for t in series(rows, "rollout/turns_mean"))
    assert all(n > 10 for n in series(rows, "rollout/env_tokens_mean"))  # the feedback is in the sequences
    assert all(n <= 8 for n in series(rows, "rollout/response_length_mean"))  # ... but not trained on
    assert max(series(rows, "rollout/logprob_abs_diff_mean")) < 1e-3
    assert series(rows, "reward/upper_share") == pytest.approx(rewards)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert any("Again, louder." in s["response"] for s in samples)


def test_an_agent_and_another_reward_source_contradict(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    with pytest.raises(ConfigError, match="--agent_func_path and --remote_rm_url both give the reward"):
        run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine,
                 **{**AGENT, "remote_rm_url": str(HERE.parent / "rl" / "letters_reward.py")})
    with pytest.raises(ConfigError, match="--agent_action_max_len 4: must be >= 1 and goes with --agent_func_path"):
        run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, agent_action_max_len=4)


def test_openrlhfs_example_agent_file_trains_a_step(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    """OpenRLHF's examples/python/agent_func.py, only its import changed: 2-4 turns (randint(1, 3) + 1), its
    feedback in the sequences, its 0/1 final reward as the episode reward and as `dummy_scores`."""
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine,
               **{**AGENT, "agent_func_path": str(HERE / "openrlhf_agent_func.py"), "generate_max_len": 96,
                  "max_samples": 4, "n_samples_per_prompt": 4, "train_batch_size": 16})  # one step of 16 episodes
    [row] = rows
    assert 2.0 < row["rollout/turns_mean"] <= 4.0
    assert row["rollout/env_tokens_mean"] >= 20  # at least one "[INCORRECT] ... try again" per episode
    assert row["rollout/response_length_mean"] <= 16  # 4 actions of at most 4 tokens
    assert 0.0 <= row["rollout/reward_mean"] <= 1.0
    assert row["reward/dummy_scores"] == pytest.approx(row["rollout/reward_mean"])
    assert row["rollout/logprob_abs_diff_mean"] < 1e-3
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert any("Human: [INCORRECT]" in s["response"] for s in samples)
