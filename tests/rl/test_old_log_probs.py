"""The PPO ratio's old log-probs taken from the training forward (one optimizer step per rollout) instead of a separate
pass: same run, same metrics, and the separate pass wherever it is not provably redundant."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ppo_helpers import KL_LOSS, run

from rlhfkit.config.plan import run_kl_mode
from rlhfkit.rl.make_experience import old_log_probs_from_training_pass
from rlhfkit.rl.worker import has_active_dropout

pytestmark = pytest.mark.slow

COMPARED = ("rollout/reward_mean", "train/policy_loss", "train/grad_norm", "train/entropy", "train/clip_frac",
            "rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max", "rollout/is_ratio_mean",
            "train/is_weight_mean", "eval/score_mean")


def _cfg(**overrides) -> SimpleNamespace:
    base = {"recompute_old_log_probs": False, "max_epochs": 1, "train_batch_size": 32, "freezing_actor_steps": -1,
            "use_kl_loss": False, "init_kl_coef": 0.01,  # a reference model exists only with a KL coefficient
            "advantage_estimator": "group_norm"}
    return SimpleNamespace(**{**base, **overrides})


@pytest.mark.parametrize(("overrides", "rows", "has_ref", "expected"), [
    ({}, 32, False, True),                                  # GRPO, one mini-batch: reuse
    ({}, 24, False, True),                                  # dynamic filtering left fewer rows: still one step
    ({}, 64, False, False),                                 # two mini-batches: the second step's old policy differs
    ({"max_epochs": 2}, 32, False, False),                  # a second epoch trains on a moved policy
    ({}, 32, True, False),                                  # the reward-side KL needs them before the advantages
    ({"use_kl_loss": True}, 32, True, True),                # KL as a loss: measured in the training step
    ({"freezing_actor_steps": 3}, 32, False, False),        # the actor does not train in the first steps
    ({"recompute_old_log_probs": True}, 32, False, False),  # asked for
    ({"advantage_estimator": "on_policy_distill"}, 32, True, False),  # the advantages are made of them
])
def test_when_the_separate_pass_is_redundant(overrides, rows, has_ref, expected):
    cfg = _cfg(**overrides)
    plan = SimpleNamespace(distill=cfg.advantage_estimator == "on_policy_distill", kl_mode=run_kl_mode(cfg))
    assert old_log_probs_from_training_pass(cfg, plan, rows, has_ref) is expected


def test_dropout_anywhere_counts(tiny_model_dir):
    from rlhfkit.models.loading import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    assert not has_active_dropout(model)
    model.config.attention_dropout = 0.1  # functional dropout inside attention: only the config says so
    assert has_active_dropout(model)


def test_reused_old_log_probs_give_the_same_run(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    flags = {"max_samples": 8, "enable_vllm_is_correction": True, "eval_dataset": echo_prompt_file,
             "eval_steps": 2}
    reused = run(tiny_model_dir, echo_prompt_file, tmp_path / "reused", rollout_vllm_engine, **flags)
    separate = run(tiny_model_dir, echo_prompt_file, tmp_path / "separate", rollout_vllm_engine,
                   recompute_old_log_probs=True, **flags)
    assert len(reused) == len(separate) == 3  # eval at step 0, then 2 steps
    def keys(row: dict) -> list[str]:  # the log-prob stage's MFU exists only where the stage does work
        return sorted(k for k in row if not k.startswith("time/") and k != "perf/mfu_log_probs")

    for a, b in zip(reused, separate):
        assert keys(a) == keys(b)
        assert "perf/mfu_log_probs" not in a and ("perf/mfu_log_probs" in b) == ("train/policy_loss" in b)
        for key in COMPARED:
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (a["step"], key)
    trained = [r for r in reused if "train/policy_loss" in r]
    assert len(trained) == 2 and all("rollout/logprob_abs_diff_mean" in r for r in trained)
    assert all(r["time/log_probs"] < s["time/log_probs"] for r, s in zip(trained, separate[1:]))  # the pass is gone


def test_reused_old_log_probs_with_a_kl_loss_report_the_same_kl(grpo_kl_loss_run, tiny_model_dir, echo_prompt_file,
                                                                 rollout_vllm_engine, tmp_path):
    """The reused run is the session's `grpo_kl_loss_run` (tests/rl/conftest.py; test_packing.py compares with it
    too); the separate pass runs here with the same flags."""
    _, reused = grpo_kl_loss_run
    separate = run(tiny_model_dir, echo_prompt_file, tmp_path / "separate", rollout_vllm_engine,
                   recompute_old_log_probs=True, **KL_LOSS)
    assert [r["step"] for r in reused] == [1, 2]
    assert reused[0]["rollout/kl"] == pytest.approx(0.0, abs=1e-9)  # the policy starts as the reference
    for a, b in zip(reused, separate):
        for key in ("rollout/kl", "train/kl_loss", "train/policy_loss", "train/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-7), (a["step"], key)
    assert reused[1]["rollout/kl"] > 0
