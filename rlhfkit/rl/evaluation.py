"""The online run's evaluation (--eval_dataset): held-out prompts generated and scored, pass@k, and the best model
(--best_metric_key) kept under <ckpt_path>/best."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.validate import need
from rlhfkit.engine.best import BestTracker, check_key, tracker_for
from rlhfkit.rl.make_experience import Rollout, Timer, generate_and_score
from rlhfkit.rl.setup import RLSetup
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout.types import SamplingConfig


def pass_at_k(correct: int, n: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n - c, k) / C(n, k)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def evaluate(s: RLSetup, step: int) -> dict[str, float]:
    """Held-out prompts at --eval_temperature, --eval_n_samples_per_prompt each; a sample is correct if score > 0."""
    cfg, n = s.cfg, s.cfg.eval_n_samples_per_prompt
    sampling = SamplingConfig(temperature=cfg.eval_temperature, top_p=1.0, max_new_tokens=cfg.generate_max_len, n=n,
                              seed=cfg.seed + 99991, stop_token_ids=tuple(s.stop_ids), max_len=cfg.max_len or None)
    rollout = generate_and_score(s.engines, s.eval_prompts, sampling, s.reward_fn, s.tokenizer, Timer(), 0,
                                 s.phases, s.agent)
    correct = (rollout.scores.view(-1, n) > 0).sum(-1).tolist()
    out = {"eval/reward_mean": float(rollout.rewards.mean()), "eval/score_mean": float(rollout.scores.mean())}
    for k in sorted({1, n}):
        out[f"eval/pass@{k}"] = sum(pass_at_k(c, n, k) for c in correct) / len(correct)
    _write_samples(s, step, rollout, "eval", limit=16)  # the same 16 held-out prompts at every evaluation
    return out


def _write_samples(s: RLSetup, step: int, rollout: Rollout, kind: str, limit: int = 6) -> None:
    """The first sample of each of the first `limit` prompts, to samples.jsonl (for the report)."""
    rows = [i for i, sample in enumerate(rollout.samples) if sample.sample_index == 0][:limit]
    with (Path(need(s.plan.run_dir, "--run_dir")) / "samples.jsonl").open("a") as f:
        for i in rows:
            prompt = rollout.prompts[rollout.samples[i].prompt_index]
            failure = rollout.reward_failure[i] if rollout.reward_failure else ""
            f.write(json.dumps({"step": step, "kind": kind, "prompt": prompt["prompt"], "response": rollout.texts[i],
                                "reward": float(rollout.rewards[i]), "label": prompt.get("label"),
                                "reward_failure": failure or None}) + "\n")


def eval_metric_keys(cfg: PPOConfig) -> list[str]:
    """The metrics `evaluate` returns (known before the run: --best_metric_key is checked against them)."""
    ks = sorted({1, cfg.eval_n_samples_per_prompt})
    return ["eval/reward_mean", "eval/score_mean", *(f"eval/pass@{k}" for k in ks)]


def best_tracker(cfg: PPOConfig) -> BestTracker | None:
    """--best_metric_key: its tracker (default key eval/pass@1), refused before anything starts when it names no
    metric of `evaluate` or there is no --eval_dataset."""
    best = tracker_for(cfg, "eval/pass@1", bool(cfg.eval_dataset))
    if best is not None:
        check_key(best.key, eval_metric_keys(cfg))
    return best


def keep_best(s: RLSetup, step: int, eval_metrics: dict[str, float]) -> None:
    """A new best evaluation: the actor's HF folder (the EMA with --enable_ema) replaces <ckpt_path>/best."""
    if s.best is None or not s.best.improves(step, eval_metrics):
        return
    shutil.rmtree(s.best.staging, ignore_errors=True)
    s.actor.call(ModelWorker.save_hf, str(s.best.staging), need(s.plan.model_path, "--pretrain"))
    s.best.commit()
