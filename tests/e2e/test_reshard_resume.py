"""Issue #14 item 6: a checkpoint written by 2 SFT ranks resumes on 1 and the reverse (DCP resharding of model and
optimizer; the RNG rule of rlhfkit/engine/checkpoint.py), and the losses after resume are the uninterrupted run's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlhfkit.cli.sft import main as sft_main
from rlhfkit.config.parse import flags_to_argv
from rlhfkit.data.synthetic import echo_rows, write_jsonl

# fp32 on CPU; 2 ranks and 1 sum the same global batch in another order, so steps agree to float noise, not bits.
REL = 1e-4
# 2 steps per epoch, 4 in all
FLAGS = {"max_samples": 16, "max_epochs": 2, "max_ckpt_num": 10}


def base_args(model_dir: str, data: str, out: Path, **overrides) -> list[str]:
    flags = {"pretrain": model_dir, "dataset": data, "input_key": "input", "output_key": "output",
             "apply_chat_template": True, "max_len": 96, "train_batch_size": 8, "micro_train_batch_size": 4,
             "learning_rate": 3e-3, "lr_warmup_ratio": 0.0, "seed": 7, "run_dir": str(out / "run"),
             "save_path": str(out / "hf"), **overrides}
    return flags_to_argv(flags)


def train_losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def torchrun(nproc: int, argv: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "rlhfkit.cli.sft", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> str:
    return write_jsonl(echo_rows(16, seed=1), tmp_path_factory.mktemp("reshard") / "train.jsonl")


def _check_resumed(out: Path, saved: int, resumed: int, step: int, uninterrupted: dict[int, float]) -> float:
    """Asserts the resumed run's losses and manifest; returns the largest relative loss difference."""
    after = train_losses(out / "run")
    assert sorted(after) == list(range(step + 1, 5))
    for k, loss in after.items():
        assert loss == pytest.approx(uninterrupted[k], rel=REL), (k, loss, uninterrupted[k])
    manifest = json.loads((out / "run" / "manifest.json").read_text())
    assert manifest["resumed"]["model"]["note"] == f"resharded from {saved} to {resumed} ranks"
    assert manifest["resumed"]["model"]["step"] == step
    return max(abs(loss - uninterrupted[k]) / uninterrupted[k] for k, loss in after.items())


def test_sft_resumes_from_one_rank_on_two_and_from_two_on_one(tiny_model_dir, train_file, tmp_path):
    """1 rank runs 4 steps uninterrupted; its step-2 checkpoint (end of epoch 0) resumes on 2 ranks (torchrun), which
    write their own step-3 checkpoint (mid-epoch 1); that resumes on 1 rank. Both resumed runs log the uninterrupted
    run's losses."""
    full, two, one = tmp_path / "full", tmp_path / "two", tmp_path / "one"
    sft_main(base_args(tiny_model_dir, train_file, full, ckpt_path=str(full / "ckpt"), save_steps=2, **FLAGS))
    uninterrupted = train_losses(full / "run")
    assert sorted(uninterrupted) == [1, 2, 3, 4]
    shutil.copytree(full / "ckpt" / "global_step2", two / "ckpt" / "global_step2")
    torchrun(2, base_args(tiny_model_dir, train_file, two, ckpt_path=str(two / "ckpt"), load_checkpoint=True,
                          save_steps=3, **FLAGS))
    worst = _check_resumed(two, 1, 2, 2, uninterrupted)
    written = two / "ckpt" / "global_step3"
    assert json.loads((written / "trainer_state.json").read_text())["world_size"] == 2
    assert sorted(p.name for p in written.glob("rng_rank*.pt")) == ["rng_rank0.pt", "rng_rank1.pt"]
    shutil.copytree(written, one / "ckpt" / "global_step3")
    sft_main(base_args(tiny_model_dir, train_file, one, ckpt_path=str(one / "ckpt"), load_checkpoint=True,
                       save_steps=-1, **FLAGS))
    worst = max(worst, _check_resumed(one, 2, 1, 3, uninterrupted))
    print(f"\nresharded SFT resume: largest relative loss difference to the uninterrupted run {worst:.1e}")
    # the check bites: training moved the loss (a resume that ignored the checkpoint would log step 1's loss) ...
    assert uninterrupted[1] - uninterrupted[4] > 0.2, uninterrupted
    # ... and the final weights of both resumed runs are the uninterrupted run's, away from the initial ones
    w0, wf = (load_file(str(Path(d) / "model.safetensors")) for d in (tiny_model_dir, full / "hf"))
    moved = max(float((wf[k] - w0[k]).abs().max()) for k in wf)
    assert moved > 3e-3, moved  # Adam moves a weight by about lr (3e-3) a step
    for out in (two, one):
        w = load_file(str(out / "hf" / "model.safetensors"))
        diff = max(float((wf[k] - w[k]).abs().max()) for k in wf)
        print(f"{out.name} ranks: final weights differ by at most {diff:.1e} (training moved them {moved:.1e})")
        assert diff < 1e-3 * moved, (out.name, diff, moved)
