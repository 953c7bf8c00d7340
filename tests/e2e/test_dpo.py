"""End-to-end `rlhfkit dpo` on a tiny model: the implicit reward margin grows and the chosen answers' log-probs
rise relative to the rejected ones, on held-out pairs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhfkit.cli.dpo import main as dpo_main
from rlhfkit.config.parse import flags_to_argv
from rlhfkit.data.synthetic import preference_rows, write_jsonl

pytestmark = pytest.mark.slow


def argv(**flags) -> list[str]:
    return flags_to_argv(flags)


def evals(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/loss" in r]


def test_dpo_widens_the_margin_and_raises_chosen_over_rejected(tiny_model_dir, tmp_path):
    train = write_jsonl(preference_rows(64, seed=1), tmp_path / "train.jsonl")
    held_out = write_jsonl(preference_rows(24, seed=2), tmp_path / "eval.jsonl")
    result = dpo_main(argv(pretrain=tiny_model_dir, dataset=train, eval_dataset=held_out, prompt_key="prompt",
                           max_len=48, train_batch_size=8, micro_train_batch_size=8, max_epochs=1,
                           learning_rate=1e-2, lr_warmup_ratio=0, beta=0.1, seed=3,
                           run_dir=tmp_path / "run", save_path=tmp_path / "hf"))
    before, after = evals(tmp_path / "run")[0], evals(tmp_path / "run")[-1]
    assert before["step"] == 0 and after["step"] == 8
    assert before["eval/reward_margin"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at step 0
    assert after["eval/reward_margin"] > 1.0, after
    assert after["eval/reward_accuracy"] >= 0.9, after
    gap = lambda r: r["eval/chosen_logps"] - r["eval/rejected_logps"]  # noqa: E731
    assert gap(after) > gap(before) + 10.0, (before, after)
    assert after["eval/loss"] < 0.5 * before["eval/loss"]
    assert result["train/reward_margin"] > 0
    assert (tmp_path / "hf" / "config.json").is_file()


def test_packed_dpo_run_reproduces_the_padded_run(tiny_model_dir, tmp_path):
    """--packing_samples changes how a micro-batch is laid out, not what is learned: the loss curves agree."""
    train = write_jsonl(preference_rows(16, seed=1), tmp_path / "train.jsonl")
    curves = []
    for packed in (False, True):
        run_dir = tmp_path / f"run_{packed}"
        dpo_main(argv(pretrain=tiny_model_dir, dataset=train, prompt_key="prompt", max_len=48, train_batch_size=4,
                      micro_train_batch_size=2, max_epochs=1, learning_rate=1e-2, lr_warmup_ratio=0, beta=0.1,
                      seed=3, packing_samples=packed, run_dir=run_dir, save_path=tmp_path / f"hf_{packed}"))
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        curves.append([r["train/loss"] for r in rows if "train/loss" in r])
    assert len(curves[0]) == 4 and curves[0][-1] != curves[0][0]
    assert curves[1] == pytest.approx(curves[0], abs=1e-4)


def test_two_ranks_equal_one_rank(tiny_model_dir, tmp_path):
    """torchrun with 2 ranks x micro 1 == 1 rank x micro 2: the reference precompute is sharded over the ranks and
    gathered, and the shared loop normalises by the global pair count."""
    import os
    import subprocess
    import sys

    train = write_jsonl(preference_rows(16, seed=4), tmp_path / "train.jsonl")

    def flags(out: Path, micro: int) -> list[str]:
        return argv(pretrain=tiny_model_dir, dataset=train, prompt_key="prompt", max_len=48, train_batch_size=4,
                    micro_train_batch_size=micro, max_epochs=1, learning_rate=1e-2, lr_warmup_ratio=0, beta=0.1,
                    seed=3, run_dir=out / "run", save_path=out / "hf")

    dpo_main(flags(tmp_path / "one", 2))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "rlhfkit.cli.dpo", *flags(tmp_path / "two", 1)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    losses = []
    for name in ("one", "two"):
        rows = [json.loads(line) for line in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]
        losses.append([(r["step"], r["train/loss"]) for r in rows if "train/loss" in r])
    assert len(losses[0]) == 4 and [s for s, _ in losses[0]] == [s for s, _ in losses[1]]
    assert [v for _, v in losses[1]] == pytest.approx([v for _, v in losses[0]], rel=1e-4, abs=1e-5)
