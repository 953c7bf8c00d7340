"""Model FLOPs utilisation: the FLOP model against a hand count of the tiny model's parameters, the ratio's closed
form, and the perf/* metrics of a real run against the formula on the run's own logged quantities."""

from __future__ import annotations

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
