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
    # Adam's first step moves every weight by about lr * sign(g) (0.03 here); an element whose gradient is near
    # Adam's eps moves by lr * g / eps and so amplifies summation-order noise: a few of the 3.2M elements differ by
    # up to ~1e-4 while the mean difference stays ~4e-9
    diff = torch.cat([(wa[n].double() - wb[n].double()).abs().flatten() for n in wa])
    step = torch.cat([(wa[n].double() - w0[n].double()).abs().flatten() for n in wa])
    assert float(step.mean()) > 0.01  # the step moved the weights, so agreeing is not trivial
    assert float(diff.max()) < 1e-2 * float(step.max()), float(diff.max())
    assert float(diff.mean()) < 1e-5 * float(step.mean()), float(diff.mean())


def checkpoint_tensors(folder: Path, target: Path) -> dict:
    """The tensors of one DCP folder of a checkpoint (`.../global_stepN/model` or `.../ema`), unsharded, via the file
    `target`: the model folder's weights under their HF names (its 'model' entry), the EMA folder's by name."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder), str(target))
    loaded = torch.load(target, weights_only=False)
    return loaded["model"] if folder.name == "model" else loaded
