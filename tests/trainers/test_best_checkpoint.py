"""--best_metric_key (rlhfkit.engine.best): the model of the best evaluation in <ckpt_path>/best, for the offline loop
(a short SFT run here) and the tracker's rules. PPO's end to end: tests/rl/test_ppo.py (resume test)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.config.parse import flags_to_argv, parse_config
from rlhfkit.data.synthetic import echo_rows, write_jsonl
from rlhfkit.engine.best import BestTracker, tracker_for
from rlhfkit.errors import ConfigError
from rlhfkit.rl.evaluation import best_tracker, eval_metric_keys


def _sft(tiny_model_dir: str, tmp_path: Path, **flags) -> list[dict]:
    from rlhfkit.cli.sft import main as sft_main

    train = write_jsonl(echo_rows(24, seed=1), tmp_path / "train.jsonl")
    held_out = write_jsonl(echo_rows(4, seed=2), tmp_path / "eval.jsonl")
    sft_main(flags_to_argv({
        "pretrain": tiny_model_dir, "dataset": train, "eval_dataset": held_out, "output_key": "output",
        "max_len": 48, "train_batch_size": 4, "micro_train_batch_size": 4, "max_epochs": 1, "eval_steps": 1,
        "learning_rate": 0.1, "lr_warmup_ratio": 0.0, "lr_scheduler": "constant", "save_steps": 1,
        "save_hf_ckpt": True, "max_ckpt_num": 10, "ckpt_path": str(tmp_path / "ckpt"),
        "save_path": str(tmp_path / "final"), "run_dir": str(tmp_path / "run"), **flags}))
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def test_sft_keeps_the_model_of_the_lowest_eval_loss(tiny_model_dir, tmp_path):
    """6 SFT steps at a high constant lr (eval/loss falls, rises, falls, rises: the best is at step 5), evaluated
    before training and after every step: <ckpt_path>/best holds the weights of the first step with the lowest
    eval/loss (lower is better for a loss), byte for byte those of that step's --save_hf_ckpt folder (the initial
    model for step 0), and best_metric.json records the step and value."""
    rows = _sft(tiny_model_dir, tmp_path, best_metric_key="eval/loss")
    losses = {r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r}
    print("\neval/loss by step", {k: round(v, 4) for k, v in losses.items()})
    assert sorted(losses) == list(range(7))
    low = min(losses.values())
    step = min(s for s, v in losses.items() if v == low)
    record = json.loads((tmp_path / "ckpt" / "best" / "best_metric.json").read_text())
    assert record == {"key": "eval/loss", "value": low, "step": step, "higher_is_better": False}
    source = Path(tiny_model_dir) if step == 0 else tmp_path / "ckpt" / f"global_step{step}" / "hf"
    best, expected = (load_file(str(p / "model.safetensors")) for p in (tmp_path / "ckpt" / "best", source))
    assert best.keys() == expected.keys()
    for name in best:
        assert torch.equal(best[name], expected[name]), name
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert step == 6 or any(not torch.equal(final[n], best[n]) for n in best)  # not simply the final model
    state = json.loads((tmp_path / "ckpt" / "global_step6" / "trainer_state.json").read_text())
    assert state["best_metric"] == record  # part of the resume checkpoint
    assert not (tmp_path / "ckpt" / "best.tmp").exists()


def test_sft_with_an_unknown_best_metric_key_stops_at_the_first_evaluation(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"--best_metric_key 'eval/pass@1' .* gives: eval/loss"):
        _sft(tiny_model_dir, tmp_path, best_metric_key="eval/pass@1")
    assert not (tmp_path / "ckpt").exists()  # before any training step


def test_tracker_direction_values_and_resume_state(tmp_path):
    """Lower is better for a key containing 'loss', higher otherwise; ties keep the first; 'auto' / '' take the
    command's default key, 'none' / unset switch it off; no evaluation data is refused; ppo checks the key against
    the metrics its evaluation gives before anything starts."""
    up = BestTracker("eval/pass@1", tmp_path)
    assert [up.improves(s, {"eval/pass@1": v}) for s, v in enumerate([0.2, 0.5, 0.5, 0.4, 0.6])] == \
        [True, True, False, False, True]
    assert (up.step, up.value) == (4, 0.6)
    down = BestTracker("eval/loss", tmp_path)
    assert [down.improves(s, {"eval/loss": v}) for s, v in enumerate([2.0, 1.5, 1.7, 1.5])] == \
        [True, True, False, False]
    again = BestTracker("eval/loss", tmp_path)
    again.load_state(down.state())
    assert (again.step, again.value) and not again.improves(9, {"eval/loss": 1.6})
    other = BestTracker("eval/chosen_reward", tmp_path)
    other.load_state(down.state())  # another key's record is not this one's
    assert other.value is None
    with pytest.raises(ConfigError, match="'eval/loss' is not an eval metric of this run; the evaluation gives: "
                                          "eval/acc"):
        down.improves(0, {"eval/acc": 1.0})

    def cfg(key, **kw):
        base = {"best_metric_key": key, "ckpt_path": str(tmp_path), "eval_dataset": "e.jsonl",
                "eval_n_samples_per_prompt": 4}
        return SimpleNamespace(**{**base, **kw})

    assert tracker_for(cfg("auto"), "eval/loss", True).key == "eval/loss"
    assert tracker_for(cfg(""), "eval/loss", True).key == "eval/loss"
    assert tracker_for(cfg("none"), "eval/loss", True) is None and tracker_for(cfg(None), "x", False) is None
    with pytest.raises(ConfigError, match="--best_metric_key 'eval/loss' .* add --eval_dataset"):
        tracker_for(cfg("eval/loss"), "eval/loss", False)

    def ppo(**flags):  # ppo's config as its command line parses it
        base = {"pretrain": "m", "prompt_data": "p.jsonl", "remote_rm_url": "builtin:math", "ckpt_path": str(tmp_path),
                "eval_dataset": "e.jsonl", "eval_n_samples_per_prompt": 4}
        return parse_config("ppo", None, flags_to_argv({**base, **flags}))

    assert eval_metric_keys(ppo()) == ["eval/reward_mean", "eval/score_mean", "eval/pass@1", "eval/pass@4"]
    assert best_tracker(ppo()) is None  # --best_metric_key unset: no best model kept
    assert best_tracker(ppo(best_metric_key="auto")).key == "eval/pass@1"
    pass_at_4 = best_tracker(ppo(best_metric_key="eval/pass@4"))  # ppo's tracker follows the parsed key
    assert pass_at_4.key == "eval/pass@4" and pass_at_4.higher_is_better
    evaluations = [{"eval/pass@1": p1, "eval/pass@4": p4} for p1, p4 in [(0.5, 0.5), (0.6, 0.4), (0.1, 0.7)]]
    assert [pass_at_4.improves(s, m) for s, m in enumerate(evaluations)] == [True, False, True]  # pass@1: T, T, F
    with pytest.raises(ConfigError, match=r"'eval/loss' is not .* eval/pass@1, eval/pass@4, eval/reward_mean"):
        best_tracker(ppo(best_metric_key="eval/loss"))
    with pytest.raises(ConfigError, match="add --eval_dataset"):
        best_tracker(ppo(best_metric_key="auto", eval_dataset=None))
