"""CUDA paths (NCCL, bf16 mixed precision, CPU offload). CI has no GPU: these skip cleanly there."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_sft_step_in_bf16_on_cuda_matches_fp32_within_bf16_tolerance(tiny_model_dir, tmp_path):
    import json

    from rlhfkit.cli.sft import main as sft_main
    from rlhfkit.data.synthetic import echo_rows, write_jsonl

    data = write_jsonl(echo_rows(16, seed=1), tmp_path / "d.jsonl")
    losses = {}
    for dtype in ("bf16", "fp32"):
        out = tmp_path / dtype
        sft_main(["--pretrain", tiny_model_dir, "--dataset", data, "--input_key", "input", "--output_key", "output",
                  "--apply_chat_template", "--train_batch_size", "8", "--micro_train_batch_size", "4",
                  "--max_epochs", "1", "--param_dtype", dtype, "--run_dir", str(out / "run"),
                  "--save_path", str(out / "hf")])
        rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        losses[dtype] = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=2e-2)
