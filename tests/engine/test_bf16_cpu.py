"""bf16 on a CPU, asked for explicitly (auto picks it only where the CPU computes it natively): the FSDP2 mixed
precision trainer and a bf16 rollout engine, on the tiny model so it stays cheap on CPUs that emulate bf16."""

from __future__ import annotations

import json

import pytest
from ppo_helpers import run

from rlhfkit.cli.sft import main as sft_main
from rlhfkit.data.synthetic import echo_rows, write_jsonl

pytestmark = pytest.mark.slow


def _losses(run_dir) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def test_sft_in_bf16_matches_fp32_within_bf16_tolerance(tiny_model_dir, tmp_path):
    data = write_jsonl(echo_rows(16, seed=1), tmp_path / "d.jsonl")
    losses, manifests = {}, {}
    for dtype in ("bf16", "fp32"):
        out = tmp_path / dtype
        sft_main(["--pretrain", tiny_model_dir, "--dataset", data, "--input_key", "input", "--output_key", "output",
                  "--apply_chat_template", "--train_batch_size", "8", "--micro_train_batch_size", "4",
                  "--max_epochs", "1", "--param_dtype", dtype, "--run_dir", str(out / "run")])
        losses[dtype] = _losses(out / "run")
        manifests[dtype] = json.loads((out / "run" / "manifest.json").read_text())
    assert len(losses["bf16"]) == 2
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
    assert losses["bf16"] != losses["fp32"]  # bf16 compute did happen
    assert manifests["bf16"]["precision"]["dtype"] == "bf16"
    assert manifests["bf16"]["precision"]["reason"].startswith("requested")


def test_grpo_with_a_bf16_trainer_and_a_bf16_engine(tiny_model_dir, echo_prompt_file, ray_cluster, tmp_path):
    from rlhfkit.rollout.hf_engine import create_hf_engines

    [engine] = create_hf_engines(1, tiny_model_dir, dtype="bfloat16", num_cpus_per_engine=0.5)
    try:
        rows = run(tiny_model_dir, echo_prompt_file, tmp_path, engine, max_samples=8, rollout_backend="hf",
                   param_dtype="bf16", vllm_dtype="bf16", enable_vllm_is_correction=True)
    finally:
        ray_cluster.kill(engine)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        # weights travel in the engine's dtype: 2 bytes per parameter (tied embeddings once)
        assert row["sync/bytes"] == 2 * _tiny_parameter_count(tiny_model_dir)
        # trainer and engine compute in bf16 on the same weights: close, not equal
        assert 0 < row["rollout/logprob_abs_diff_mean"] < 0.05


def _tiny_parameter_count(model_dir: str) -> int:
    from rlhfkit.models.loading import load_causal_lm

    model = load_causal_lm(model_dir)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once
