"""End-to-end tensor parallel: `rlhfkit sft --tp_size 2` on 2 torchrun ranks (1 data parallel x 2 tensor parallel,
gloo) reproduces the 1-rank run: the first step's loss and gradient norm, the next steps' losses (fp32), and the saved
HF folder is a whole, ordinary model (it loads with from_pretrained, and its weights equal the 1-rank run's)."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhfkit.config.parse import flags_to_argv
from rlhfkit.data.synthetic import echo_rows, write_jsonl

pytestmark = pytest.mark.slow


def steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


def run_tp(flags: dict) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "rlhfkit.cli.sft", *flags_to_argv(flags)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.search(r"tensor parallel x data parallel\W+2 x 1", done.stderr), done.stderr[-4000:]
    return steps(Path(flags["run_dir"]))


def test_sft_tp_size_2_reproduces_one_rank(tiny_model_dir, tmp_path):
    data = write_jsonl(echo_rows(8, seed=1), tmp_path / "train.jsonl")
    flags = {"pretrain": tiny_model_dir, "dataset": data, "input_key": "input", "output_key": "output",
             "apply_chat_template": True, "max_len": 96, "train_batch_size": 4, "micro_train_batch_size": 2,
             "max_epochs": 1, "learning_rate": 3e-3, "lr_warmup_ratio": 0.0, "seed": 7, "param_dtype": "fp32",
             "packing_samples": True}
    importlib.import_module("rlhfkit.cli.sft").main(flags_to_argv({**flags, "run_dir": str(tmp_path / "one"),
                                                                   "save_path": str(tmp_path / "hf1")}))
    one = steps(tmp_path / "one")
    # --tp_size: the training commands' alias of --ds_tensor_parallel_size
    two = run_tp({**flags, "tp_size": 2, "run_dir": str(tmp_path / "tp"), "save_path": str(tmp_path / "hf2")})
    assert len(one) == len(two) >= 2
    assert two[0]["train/loss"] == pytest.approx(one[0]["train/loss"], abs=1e-5)
    assert two[0]["train/grad_norm"] == pytest.approx(one[0]["train/grad_norm"], rel=1e-4)
    assert [r["train/loss"] for r in two] == pytest.approx([r["train/loss"] for r in one], abs=1e-4)
    assert one[-1]["train/loss"] != one[0]["train/loss"]  # it trains: the later steps compare trained weights
    want, got = (AutoModelForCausalLM.from_pretrained(tmp_path / hf).state_dict() for hf in ("hf1", "hf2"))
    assert set(got) == set(want)
    for name, weight in want.items():
        torch.testing.assert_close(got[name], weight, rtol=0, atol=1e-4, msg=name)
