"""The default path of every GPU and native-bf16 CPU, in the default tier wherever CI lands: GRPO and PPO with a
critic end to end in bf16 (trainer and engine forced to bf16, the weight-sync check on with its default bound), on
the tiny model. On a CPU without native bf16 this is emulated and slow, but the model is tiny."""

from __future__ import annotations

import math

import pytest
from ppo_helpers import run, series


@pytest.fixture(scope="module")
def bf16_engine(ray_cluster, tiny_model_dir):
    from rlhfkit.rollout.vllm_engine import create_vllm_engines

    [engine] = create_vllm_engines(1, tiny_model_dir, enforce_eager=True, max_model_len=512,
                                   cpu_kv_cache_bytes=64 * 2**20, dtype="bfloat16", seed=0, num_cpus_per_engine=0.5)
    yield engine
    ray_cluster.kill(engine)


BF16 = {"param_dtype": "bf16", "vllm_dtype": "bf16", "enable_vllm_is_correction": True, "num_episodes": 1,
        "max_samples": 8}


def _checked_every_sync(rows: list[dict]) -> None:
    diffs, bounds = series(rows, "sync/logprob_diff"), series(rows, "sync/logprob_bound")
    assert len(diffs) == len(bounds) == len(series(rows, "time/step")) >= 2
    assert all(0 < d <= b for d, b in zip(diffs, bounds)), (diffs, bounds)  # bf16 noise is never exactly 0
    assert all(math.isfinite(x) for x in series(rows, "train/policy_loss") + series(rows, "train/grad_norm"))
    assert all(0 < x < 0.5 for x in series(rows, "rollout/logprob_abs_diff_mean")), rows


def test_grpo_in_bf16_trains_with_the_sync_check_on(tiny_model_dir, echo_prompt_file, bf16_engine, tmp_path):
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, bf16_engine, **BF16)
    _checked_every_sync(rows)
    assert series(rows, "train/grad_norm")[0] > 0


def test_ppo_with_a_critic_in_bf16_trains_with_the_sync_check_on(tiny_model_dir, echo_prompt_file, bf16_engine,
                                                                 tmp_path):
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, bf16_engine, advantage_estimator="gae",
               n_samples_per_prompt=2, train_batch_size=8, critic_learning_rate=5e-3, **BF16)
    _checked_every_sync(rows)
    assert all(math.isfinite(x) and x > 0 for x in series(rows, "train/critic_loss"))
