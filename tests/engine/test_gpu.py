"""CUDA paths (NCCL, bf16 on a GPU, `auto` precision, CPU offload of the optimizer state). CI has no GPU: these skip
cleanly there. `benchmarks/gpu_check.sh` runs this module on a lent GPU machine, where SmolLM2's tokenizer travels as
files (`RLHFKIT_GPU_CHECK_TOKENIZER`, a folder) because the embedded model package is not installed there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cuda_tiny_model(request, tmp_path_factory) -> str:
    carried = os.environ.get("RLHFKIT_GPU_CHECK_TOKENIZER")
    if not carried:
        return request.getfixturevalue("tiny_model_dir")
    from transformers import AutoTokenizer

    from rlhfkit.models.tiny import build_tiny_causal_lm

    tokenizer = AutoTokenizer.from_pretrained(carried, local_files_only=True)
    return build_tiny_causal_lm(str(tmp_path_factory.mktemp("tiny_lm")), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> str:
    from rlhfkit.data.synthetic import echo_rows, write_jsonl

    return write_jsonl(echo_rows(16, seed=1), tmp_path_factory.mktemp("gpu_data") / "d.jsonl")


def _sft(model: str, data: str, out: Path, *extra: str, cuda: bool = True) -> list[dict]:
    """`rlhfkit sft`, 2 steps, in its own process (a fresh process group each time); `cuda=False` hides the GPU."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("RLHFKIT_AUTO_DTYPE", None)  # `auto` here means what it means for a user
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "rlhfkit", "sft", "--pretrain", model, "--dataset", data, "--input_key", "input",
           "--output_key", "label", "--apply_chat_template", "--train_batch_size", "8",
           "--micro_train_batch_size", "4", "--max_epochs", "1", "--learning_rate", "1e-3", "--lr_warmup_ratio", "0",
           "--run_dir", str(out / "run"), "--save_path", str(out / "hf"), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]


def _losses(rows: list[dict]) -> list[float]:
    return [r["train/loss"] for r in rows if "train/loss" in r]


def test_auto_precision_on_a_bf16_gpu_is_bf16_with_a_measured_ceiling(monkeypatch):
    from rlhfkit.engine.precision import resolve_precision

    monkeypatch.delenv("RLHFKIT_AUTO_DTYPE", raising=False)  # tests/conftest.py pins auto to fp32

    choice = resolve_precision("auto", "cuda")
    assert torch.cuda.is_bf16_supported()
    assert choice.dtype == "bf16" and choice.device == "cuda"
    assert choice.bf16_gflops and choice.bf16_gflops > choice.fp32_gflops > 0  # tensor cores: bf16 >> fp32


def test_sft_on_cuda_in_fp32_matches_the_cpu_and_bf16_stays_within_bf16_tolerance(cuda_tiny_model, sft_data,
                                                                                 tmp_path):
    cpu = _losses(_sft(cuda_tiny_model, sft_data, tmp_path / "cpu", "--param_dtype", "fp32", cuda=False))
    gpu_rows = _sft(cuda_tiny_model, sft_data, tmp_path / "gpu", "--param_dtype", "fp32")
    auto_rows = _sft(cuda_tiny_model, sft_data, tmp_path / "auto")
    assert len(cpu) == 2 and cpu[1] != cpu[0]  # the first step moved the weights, so step 2 checks the update
    assert _losses(gpu_rows) == pytest.approx(cpu, rel=1e-4)  # same fp32 arithmetic, other summation order
    assert _losses(auto_rows) == pytest.approx(cpu, rel=2e-2)  # bf16 compute, fp32 master weights
    assert all(r["train/peak_memory_mb"] > 0 for r in gpu_rows if "train/loss" in r)
    manifest = json.loads((tmp_path / "auto" / "run" / "manifest.json").read_text())
    assert manifest["precision"]["dtype"] == "bf16" and manifest["precision"]["device"] == "cuda"


def test_adam_offload_on_cuda_gives_the_same_steps(cuda_tiny_model, sft_data, tmp_path):
    plain = _sft(cuda_tiny_model, sft_data, tmp_path / "plain", "--param_dtype", "fp32")
    offload = _sft(cuda_tiny_model, sft_data, tmp_path / "offload", "--param_dtype", "fp32", "--adam_offload")
    assert _losses(offload) == pytest.approx(_losses(plain), rel=1e-4)
