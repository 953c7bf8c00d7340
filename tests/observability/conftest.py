"""Synthetic run folders for the report tests (no training): metrics.jsonl, manifest.json, samples.jsonl."""

from __future__ import annotations

import json
import types
from html.parser import HTMLParser
from pathlib import Path

import pytest

STEPS = 12
TIME_STAGES = ["generation", "weight_sync", "log_probs", "reward", "training"]
# Each plotted figure's data-metric names at least these metrics.
EXPECTED_METRICS = ["rollout/reward_mean", "rollout/kl", "rollout/response_length_mean", "train/loss",
                    "train/policy_loss", "train/critic_loss", *(f"time/{s}" for s in TIME_STAGES),
                    "rollout/logprob_abs_diff_mean", "eval/loss", "eval/reward_mean", "train/lr"]
SCRIPT = "<script>alert('x')</script>"


def make_run(run_dir: Path, *, partial_last_line: bool = True) -> Path:
    """A PPO-like run: every metric family, eval at step 0 and every 4 steps, NaN/inf as strings, samples."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, "eval/loss": 2.5, "eval/reward_mean": 0.1}]
    for step in range(1, STEPS + 1):
        row = {"step": step, "train/loss": 2.0 / step, "train/lr": 1e-6 * min(1.0, step / 3),
               "train/policy_loss": 0.3 / step, "train/critic_loss": 1.5 / step,
               "rollout/reward_mean": 0.05 * step, "rollout/reward_std": 0.1, "rollout/kl": 0.002 * step,
               "rollout/response_length_mean": 30.0 + step, "rollout/response_length_max": 64,
               "rollout/logprob_abs_diff_mean": 0.01, "rollout/logprob_abs_diff_max": 0.3,
               "train/grad_norm": 1.0 / step, "time/step": 7.0,
               **{f"time/{s}": t for s, t in zip(TIME_STAGES, [3.0, 0.5, 1.5, 0.2, 1.8])}}
        if step == 5:
            row["rollout/kl"] = "nan"
        if step == 6:
            row["train/policy_loss"] = "inf"
        rows.append(row)
        if step % 4 == 0:
            rows.append({"step": step, "eval/loss": 2.5 - 0.1 * step, "eval/reward_mean": 0.1 + 0.05 * step})
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if partial_last_line:
        text += '{"step": 13, "train/lo'       # a run killed while writing
    (run_dir / "metrics.jsonl").write_text(text)
    manifest = {"command": "rlhfkit ppo --pretrain embedded:smollm2-135m-instruct --seed 7 --input_template "
                           "'<b>{}</b>'",
                "config": {"seed": 7, "pretrain": "embedded:smollm2-135m-instruct"}, "seed": 7,
                "versions": {"rlhfkit": "0.1.0", "torch": "2.13.0", "vllm": None}, "python": "3.11.2",
                "git_sha": "0123456789abcdef0123456789abcdef01234567",
                "hardware": {"platform": "Linux-x86_64", "cpu_count": 2, "gpus": [], "world_size": 1},
                "started": "2025-01-01T00:00:00"}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    samples = []
    for step, kind in [(0, "eval"), (1, "train"), (6, "train"), (STEPS, "train"), (STEPS, "eval")]:
        for i in range(2):
            samples.append({"step": step, "kind": kind, "prompt": f"What is {i} + {step}? <b>bold</b> & more",
                            "response": f"{SCRIPT} answer {i + step} (step {step})", "reward": 0.5 * i,
                            "label": str(i + step)})
    (run_dir / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return run_dir


class Elements(HTMLParser):
    """Collects (tag, attrs) of every start tag, and the page text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}))

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)

    def handle_data(self, data):
        self.text.append(data)

    def find(self, tag: str) -> list[dict[str, str]]:
        return [a for t, a in self.elements if t == tag]

    def figure_metrics(self) -> set[str]:
        return {m for a in self.find("figure") for m in a.get("data-metric", "").split()}


def parse_html(text: str) -> Elements:
    parser = Elements()
    parser.feed(text)
    parser.close()
    return parser


@pytest.fixture(scope="session")
def run_kit():
    """The helpers above, for tests (conftest modules are not importable under --import-mode=importlib)."""
    return types.SimpleNamespace(make_run=make_run, parse_html=parse_html, EXPECTED_METRICS=EXPECTED_METRICS,
                                 SCRIPT=SCRIPT, STEPS=STEPS, TIME_STAGES=TIME_STAGES)
