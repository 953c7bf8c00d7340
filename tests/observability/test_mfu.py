"""Model FLOPs utilisation: the FLOP model against a hand count of the tiny model's parameters, the ratio's closed
form, and the perf/* metrics of a real run against the formula on the run's own logged quantities."""

from __future__ import annotations

import json
import logging

import pytest
from ppo_helpers import run

from rlhfkit.engine.precision import resolve_precision
from rlhfkit.observability.mfu import FlopModel, mfu


def test_flop_model_counts_the_decoder_and_the_head(tiny_model_dir):
    from rlhfkit.models.loading import load_causal_lm

    model = load_causal_lm(tiny_model_dir)
    names = dict(model.named_parameters())
    body = sum(p.numel() for n, p in names.items() if "embed_tokens" not in n and "lm_head" not in n)
    total = sum(p.numel() for p in model.parameters())
    flops = FlopModel.from_config(model.config, total)
    assert flops.body == body
    assert flops.head == model.config.vocab_size * model.config.hidden_size
    assert flops.forward(10, 3) == 2 * body * 10 + 2 * flops.head * 3
    assert flops.training(10, 3) == 3 * flops.forward(10, 3)


def test_mfu_closed_form():
    assert mfu(4e11, 2.0, 100.0) == pytest.approx(2.0)      # 4e11 FLOPs in 2 s at 100 GFLOP/s
    assert mfu(4e11, 2.0, 100.0, devices=4) == pytest.approx(0.5)
    assert mfu(1.0, 0.0, 100.0) is None and mfu(1.0, 1.0, None) is None


@pytest.mark.slow
def test_a_run_reports_training_mfu_against_the_measured_ceiling(tiny_model_dir, echo_prompt_file,
                                                                  rollout_vllm_engine, tmp_path):
    rows = run(tiny_model_dir, echo_prompt_file, tmp_path, rollout_vllm_engine, max_samples=4,
               recompute_old_log_probs=True)
    ceiling = resolve_precision("auto", "cpu").ceiling_gflops()
    assert ceiling and ceiling > 1
    (row,) = rows
    # mfu x time x ceiling = FLOPs, the same for the training stage (3x) and the log-prob pass (1x, actor only)
    train_flops = row["perf/mfu_training"] * row["time/training"] * ceiling
    forward_flops = row["perf/mfu_log_probs"] * row["time/log_probs"] * ceiling
    assert train_flops == pytest.approx(3 * forward_flops, rel=1e-6)
    assert 0 < row["perf/mfu_training"] < 1 and row["perf/generation_tokens_per_s"] > 0


def test_a_stage_faster_than_the_ceiling_reports_no_mfu_and_forgets_the_probe(monkeypatch, tmp_path, caplog):
    """A cached ceiling read on a busy machine (here 1 GFLOP/s) makes a stage look faster than the CPU's matmuls:
    the run reports no MFU instead of one over 100%, from then on, and deletes the cached probe so the next run
    measures again."""
    from types import SimpleNamespace

    import torch

    from rlhfkit.config.plan import RunPlan
    from rlhfkit.engine import precision
    from rlhfkit.rl.ppo_trainer import stage_utilisation

    monkeypatch.setenv("RLHFKIT_CACHE", str(tmp_path))
    key = precision._probe_key()  # the cache file an earlier version wrote from a probe on a busy machine
    cache = precision._cache_file(key)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"key": key, "fp32_gflops": 1.0, "bf16_gflops": 1.0}))
    ceiling = precision.Precision("fp32", "auto", "cpu", "cpu", "AVX2", False, 1.0, 1.0, "auto")
    plan = RunPlan("group_norm", False, True, "off", (), precision=ceiling)
    flops = FlopModel(body=1_000_000, head=10_000)
    setup = SimpleNamespace(cfg=SimpleNamespace(packing_samples=False, actor_num_nodes=1, max_epochs=1),
                            flops=flops, plan=plan, actor=SimpleNamespace(world_size=1), critic=None, ref=None)
    exp = SimpleNamespace(attention_mask=torch.ones(4, 12), action_mask=torch.ones(4, 4), old_log_probs=None)
    timer = SimpleNamespace(seconds={"generation": 1.0, "training": 0.01, "log_probs": 0.0})
    with caplog.at_level(logging.WARNING, logger="rlhfkit"):
        out = stage_utilisation(setup, exp, timer)
    assert not any(key.startswith("perf/mfu") for key in out) and "perf/generation_tokens_per_s" in out
    assert "ran faster than the matmul ceiling" in caplog.text and str(cache) in caplog.text
    assert not cache.exists() and setup.plan.precision.ceiling_gflops() is None
    caplog.clear()
    assert not any(key.startswith("perf/mfu") for key in stage_utilisation(setup, exp, timer))  # and stays silent
    assert "ran faster" not in caplog.text
