"""End-to-end context parallel: `rlhfkit sft|dpo|rm|kto --ring_attn_size 2` on 2 torchrun ranks (1 data parallel x 2
ring ranks, gloo) reproduces the 1-rank run: the first step's loss and gradient norm (the whole gradient, through
the loop's normaliser and FSDP2's averaging), and the next steps' losses (fp32)."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlhfkit.config.parse import flags_to_argv
from rlhfkit.data.synthetic import echo_rows, preference_rows, unpaired_rows, write_jsonl

pytestmark = pytest.mark.slow


def steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


def run(command: str, nproc: int, flags: dict) -> list[dict]:
    if nproc == 1:  # in this process, like the other e2e tests' 1-rank runs
        importlib.import_module(f"rlhfkit.cli.{command}").main(flags_to_argv(flags))
        return steps(Path(flags["run_dir"]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", f"rlhfkit.cli.{command}", *flags_to_argv(flags)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    if flags.get("ring_attn_size", 1) > 1:  # both ranks took the same samples (no data parallel split)
        assert re.search(r"ring size x data parallel\W+2 x 1", done.stderr), done.stderr[-4000:]
    return steps(Path(flags["run_dir"]))


def compare(one: list[dict], ring: list[dict], atol: float) -> None:
    assert len(one) == len(ring) >= 2
    assert ring[0]["train/loss"] == pytest.approx(one[0]["train/loss"], abs=atol)
    assert ring[0]["train/grad_norm"] == pytest.approx(one[0]["train/grad_norm"], rel=1e-4)
    assert [r["train/loss"] for r in ring] == pytest.approx([r["train/loss"] for r in one], abs=10 * atol)
    assert one[-1]["train/loss"] != one[0]["train/loss"]  # it trains: the later steps compare trained weights


def test_sft_ring_attn_size_2_reproduces_one_rank(tiny_model_dir, tmp_path):
    data = write_jsonl(echo_rows(8, seed=1), tmp_path / "train.jsonl")
    flags = {"pretrain": tiny_model_dir, "dataset": data, "input_key": "input", "output_key": "output",
             "apply_chat_template": True, "max_len": 96, "train_batch_size": 4, "micro_train_batch_size": 2,
             "max_epochs": 1, "learning_rate": 3e-3, "lr_warmup_ratio": 0.0, "seed": 7, "param_dtype": "fp32",
             "packing_samples": False}  # padded here; packed rows: dpo below and tests/models/test_context_parallel.py
    one = run("sft", 1, {**flags, "run_dir": str(tmp_path / "one"), "save_path": str(tmp_path / "hf1")})
    ring = run("sft", 2, {**flags, "ring_attn_size": 2, "ring_head_stride": 1, "run_dir": str(tmp_path / "ring"),
                          "save_path": str(tmp_path / "hf2")})
    compare(one, ring, 1e-5)


@pytest.mark.parametrize("command", ["dpo", "rm"])  # kto shares dpo's packed path (docs/parallelism.md)
def test_dpo_rm_kto_ring_attn_size_2_reproduce_one_rank(tiny_model_dir, tiny_reward_model_dir, tmp_path, command):
    rows, keys = (unpaired_rows(8, seed=1), {"output_key": "output"}) if command == "kto" else \
        (preference_rows(8, seed=1), {"prompt_key": "prompt"})
    flags = {"pretrain": tiny_reward_model_dir if command == "rm" else tiny_model_dir, **keys,
             "dataset": write_jsonl(rows, tmp_path / "train.jsonl"), "max_len": 48, "train_batch_size": 4,
             "micro_train_batch_size": 2, "max_epochs": 1, "learning_rate": 1e-2, "lr_warmup_ratio": 0.0, "seed": 3,
             "param_dtype": "fp32", "packing_samples": command != "rm"}  # rm padded; dpo/kto packed + ref precompute
    one = run(command, 1, {**flags, "run_dir": str(tmp_path / "one"), "save_path": str(tmp_path / "hf1")})
    ring = run(command, 2, {**flags, "ring_attn_size": 2, "run_dir": str(tmp_path / "ring"),
                            "save_path": str(tmp_path / "hf2")})
    compare(one, ring, 1e-5)
    if command == "rm":  # the reward statistics written after training come from sharded forwards too
        saved = [json.loads((tmp_path / hf / "config.json").read_text()) for hf in ("hf1", "hf2")]
        assert saved[1]["reward_mean"] == pytest.approx(saved[0]["reward_mean"], abs=1e-4)
        assert saved[1]["reward_std"] == pytest.approx(saved[0]["reward_std"], abs=1e-4)
