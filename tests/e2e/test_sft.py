"""End-to-end SFT on a tiny model: 1 and 2 ranks, rank/micro-batch invariance, exact resume, HF output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhfkit.cli.sft import main as sft_main
from rlhfkit.config.parse import flags_to_argv
from rlhfkit.data.synthetic import echo_rows, write_jsonl

pytestmark = pytest.mark.slow


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in read_metrics(run_dir) if "train/loss" in r}


@pytest.fixture(scope="module")
def echo_data(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("echo")
    return write_jsonl(echo_rows(64, seed=1), root / "train.jsonl"), write_jsonl(echo_rows(16, seed=2),
                                                                                  root / "eval.jsonl")


def base_args(model_dir: str, data: str, out: Path, **overrides) -> list[str]:
    flags = {"pretrain": model_dir, "dataset": data, "input_key": "input", "output_key": "output",
             "apply_chat_template": True, "max_len": 96, "train_batch_size": 8, "micro_train_batch_size": 4,
             "max_epochs": 1, "learning_rate": 3e-3, "lr_warmup_ratio": 0.0, "seed": 7,
             "run_dir": str(out / "run"), "save_path": str(out / "hf"), **overrides}
    return flags_to_argv(flags)


def torchrun(nproc: int, argv: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "rlhfkit.cli.sft", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def test_sft_one_rank_learns_and_saves_a_loadable_hf_model(tiny_model_dir, echo_data, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhfkit.trainers import loop

    train, held_out = echo_data
    ids = AutoTokenizer.from_pretrained(tiny_model_dir)("Repeat: cat dog", return_tensors="pt").input_ids
    trained_logits = {}
    save = loop.save_hf_folder

    def logits_then_save(model, tokenizer, out_dir, *args, **kwargs):  # the trained (sharded) model's own forward
        if Path(out_dir) == tmp_path / "hf":
            model.eval()
            with torch.no_grad():
                trained_logits["final"] = model(input_ids=ids).logits.float().clone()
        return save(model, tokenizer, out_dir, *args, **kwargs)

    monkeypatch.setattr(loop, "save_hf_folder", logits_then_save)
    sft_main(base_args(tiny_model_dir, train, tmp_path, eval_dataset=held_out, max_epochs=3))
    rows = read_metrics(tmp_path / "run")
    evals = [r["eval/loss"] for r in rows if "eval/loss" in r]
    assert len(evals) == 4  # before training + after each epoch
    assert evals[-1] < 0.7 * evals[0], evals  # held-out response loss falls
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("Repeat: cat dog", return_tensors="pt").input_ids.equal(ids)
    with torch.no_grad():
        reloaded = model(input_ids=ids).logits
        initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()(input_ids=ids).logits
    # the reloaded folder computes what the trained model computed, and that is not the starting point
    torch.testing.assert_close(reloaded, trained_logits["final"], rtol=1e-4, atol=1e-4)
    assert (reloaded - initial).abs().max() > 0.1
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["config"]["learning_rate"] == pytest.approx(3e-3) and manifest["seed"] == 7


def test_two_ranks_micro_two_equals_one_rank_micro_four(tiny_model_dir, echo_data, tmp_path):
    train, _ = echo_data
    one = tmp_path / "one"
    two = tmp_path / "two"
    sft_main(base_args(tiny_model_dir, train, one, micro_train_batch_size=4))
    torchrun(2, base_args(tiny_model_dir, train, two, micro_train_batch_size=2))
    a, b = train_losses(one / "run"), train_losses(two / "run")
    assert len(a) == 8 and a.keys() == b.keys()
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-4, abs=1e-5), (step, a[step], b[step])


def test_resume_from_a_checkpoint_reproduces_the_uninterrupted_losses(tiny_model_dir, echo_data, tmp_path):
    train, _ = echo_data
    full = tmp_path / "full"
    sft_main(base_args(tiny_model_dir, train, full, save_steps=4, ckpt_path=str(full / "ckpt"), max_epochs=2,
                       max_ckpt_num=10))
    uninterrupted = train_losses(full / "run")
    assert len(uninterrupted) == 16
    # A run stopped after step 4 leaves exactly the global_step4 checkpoint behind.
    resumed = tmp_path / "resumed"
    (resumed / "ckpt").mkdir(parents=True)
    shutil.copytree(full / "ckpt" / "global_step4", resumed / "ckpt" / "global_step4")
    sft_main(base_args(tiny_model_dir, train, resumed, save_steps=4, ckpt_path=str(resumed / "ckpt"),
                       max_epochs=2, load_checkpoint=True))
    after = train_losses(resumed / "run")
    assert sorted(after) == list(range(5, 17))
    for step, loss in after.items():
        assert loss == pytest.approx(uninterrupted[step], abs=1e-6), step


def test_max_ckpt_num_keeps_the_newest(tiny_model_dir, echo_data, tmp_path):
    train, _ = echo_data
    sft_main(base_args(tiny_model_dir, train, tmp_path, save_steps=2, ckpt_path=str(tmp_path / "ckpt"),
                       max_ckpt_num=2))
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert kept == ["global_step6", "global_step8"]


def test_tensorboard_wandb_offline_and_the_derived_table(tiny_model_dir, echo_data, tmp_path, capsys):
    train, _ = echo_data
    sft_main(base_args(tiny_model_dir, train, tmp_path, max_samples=16, use_tensorboard=str(tmp_path / "tb"),
                       use_wandb="offline"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0].parent), size_guidance={"scalars": 0})
    acc.Reload()
    board = {(e.step, tag): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    jsonl = {(r["step"], k): v for r in read_metrics(tmp_path / "run") for k, v in r.items()
             if k != "step" and isinstance(v, (int, float))}
    assert {"train/loss", "train/lr"} <= {k for _, k in jsonl}
    assert board.keys() == jsonl.keys()  # every scalar of metrics.jsonl, at its step, and nothing else
    for key, value in jsonl.items():
        assert board[key] == pytest.approx(value, rel=1e-6, abs=1e-30), key  # TensorBoard stores float32
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    err = capsys.readouterr().err
    for row in ("accumulation steps", "total steps", "tokens per step", "world size"):
        assert row in err


def test_packing_zero3_and_checkpointing_leave_the_loss_curve_unchanged(tiny_model_dir, echo_data, tmp_path):
    train, _ = echo_data
    plain = tmp_path / "plain"
    variant = tmp_path / "variant"
    sft_main(base_args(tiny_model_dir, train, plain, max_samples=32))
    sft_main(base_args(tiny_model_dir, train, variant, max_samples=32, packing_samples=True, zero_stage=3,
                       gradient_checkpointing=True))
    a, b = train_losses(plain / "run"), train_losses(variant / "run")
    assert len(a) == 4 and a.keys() == b.keys()
    for step in a:
        assert a[step] == pytest.approx(b[step], rel=1e-4, abs=1e-5), (step, a[step], b[step])
