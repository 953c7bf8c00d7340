"""Shared helpers of the online RL tests: one short `rlhfkit ppo` run on the session's engine, and metric series.

Importable by name from any test (pytest puts tests/rl on the path, see pyproject.toml)."""

from __future__ import annotations

import json
from pathlib import Path

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.rl.ppo_trainer import train_ppo

HERE = Path(__file__).parent
# `run`'s GRPO with the reference model's KL as a loss (k3), 2 steps: tests/rl/conftest.py's grpo_kl_loss_run
KL_LOSS = {"max_samples": 8, "init_kl_coef": 0.1, "use_kl_loss": True, "kl_estimator": "k3"}


def run(model: str, prompts: str, out: Path, engine, observer=None, **overrides) -> list[dict]:
    flags = {"pretrain": model, "prompt_data": prompts, "input_key": "input", "label_key": "label",
             "apply_chat_template": True, "remote_rm_url": str(HERE / "letters_reward.py"),
             "advantage_estimator": "group_norm", "n_samples_per_prompt": 8, "rollout_batch_size": 4,
             "train_batch_size": 32, "micro_train_batch_size": 16, "micro_rollout_batch_size": 16,
             "generate_max_len": 8, "prompt_max_len": 128, "actor_learning_rate": 3e-2, "lr_warmup_ratio": 0.0,
             "init_kl_coef": 0.0, "num_episodes": 1, "seed": 5, "run_dir": str(out / "run"),
             "save_path": str(out / "hf"), "ckpt_path": str(out / "ckpt"), **overrides}
    cfg = parse_config("ppo", None, flags_to_argv(flags))
    train_ppo(cfg, engines=[engine], observer=observer)
    return [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]


def series(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


def assert_same_step(a: list[dict], b: list[dict], a_out: Path, b_out: Path, initial: str) -> None:
    """Two runs of the same steps (one, or a few) that must give the same updates: every metric but timings and
    throughput agrees at every step, and the saved weights agree tensor by tensor (and moved away from `initial`, so
    the check bites)."""
    import pytest
    import torch
    from safetensors.torch import load_file

    assert [r["step"] for r in a] == [r["step"] for r in b] and a
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        compared = [k for k in ra if not k.startswith(("time/", "perf/"))]
        assert {"train/grad_norm", "train/entropy", "train/policy_loss", "rollout/reward_mean"} <= set(compared)
        for key in compared:  # abs: the trainer-vs-engine log-prob mismatch metrics are float noise of ~1e-6
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-5), (ra["step"], key, ra[key], rb[key])
    wa, wb = load_file(str(a_out / "hf" / "model.safetensors")), load_file(str(b_out / "hf" / "model.safetensors"))
    w0 = load_file(str(Path(initial) / "model.safetensors"))
    assert wa.keys() == wb.keys() == w0.keys()  # the same tensors (a tied lm_head is not written twice)
    # Adam's first step moves a weight by u = lr g / (|g| + eps): about lr (0.03 here) where |g| >> eps, but
    # |du/dg| = lr eps / (|g| + eps)^2 reaches lr / eps = 3e6 at g = 0, so an element whose gradient is within a few
    # eps of zero moves by an amount that summation order alone sets. GRPO's gradients are differences of near-equal
    # sums (a group's advantages sum to zero), so their noise is ~1e-10 while eps is 1e-8: on an Intel Xeon with AMX
    # one element of the 3.2M (|g| = 0.6 eps) moved 5.3e-4 apart after one step of a ring-attention run, and one moved
    # 2.9e-3 apart after two packed steps; such elements are isolated, and in a second step their change
    # perturbs every gradient a little (mean difference 2.3e-7 = 6.2e-6 of the mean step there, against ~1e-9 after
    # one step). A real difference between two computations (a sample attended wrong, a position off, a tensor not
    # saved) moves whole rows or tensors, and the metrics above differ with it. So: at most 1e-5 of the elements
    # (32 here) beyond 1e-2 of the largest step, and a mean difference under 1e-4 of the mean step (16x the mean
    # measured with that 2.9e-3 element, as such an element can end up at most the largest step, 0.047, apart: 16x).
    # tests/rl/test_same_step_check.py shows what passes and what fails.
    diff = {n: (wa[n].double() - wb[n].double()).abs() for n in wa}
    step = torch.cat([(wa[n].double() - w0[n].double()).abs().flatten() for n in wa])
    assert float(step.mean()) > 0.01  # the step moved the weights, so agreeing is not trivial
    bound = 1e-2 * float(step.max())
    over = {n: (int((d > bound).sum()), float(d.max())) for n, d in diff.items() if float(d.max()) > bound}
    assert sum(count for count, _ in over.values()) <= 1e-5 * step.numel(), \
        f"elements differing by more than {bound:.3g} (count, largest) per tensor: {over}"
    mean = float(torch.cat([d.flatten() for d in diff.values()]).mean())
    assert mean < 1e-4 * float(step.mean()), f"mean difference {mean:.3g}, over 1e-4 of the mean step {step.mean():.3g}"


def checkpoint_tensors(folder: Path, target: Path) -> dict:
    """The tensors of one DCP folder of a checkpoint (`.../global_stepN/model` or `.../ema`), unsharded, via the file
    `target`: the model folder's weights under their HF names (its 'model' entry), the EMA folder's by name."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(target))
    loaded = torch.load(target, weights_only=False)
    return loaded["model"] if folder.name == "model" else loaded
