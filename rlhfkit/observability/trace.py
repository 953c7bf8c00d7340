"""The per-sample trace: every training sample of every online step, one JSON line each, in `<run_dir>/samples.jsonl`
(docs/rl.md, "Per-sample trace"; the report's samples page, `rlhfkit report RUN_DIR --step N`, reads it).

The driver calls `write_step_trace` once per step, after the training step (the loss weights are known then) and
before the weights are synced; the lines of a step are appended and flushed at once, so a crashed run keeps every
step it finished. Held-out evaluation keeps writing its own few lines (`"kind": "eval"`, prompt/response/reward/label).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

TRACE_NAME = "samples.jsonl"
LOSS_WEIGHT_KEY = "loss_weight"  # Experience.info[...]: [B] float, summed by train_on_experience
VERSIONS_KEY = "policy_versions"  # RolloutSample.extra[...]: per response token (rlhfkit.rollout.partial)
MISMATCH_KEY = "trainer_logprob_abs_diff"  # Experience.info[...]: [B, R], from the training forward


def add_loss_weights(exp: Any, index: torch.Tensor, mask: torch.Tensor, num_tokens: float, num_seqs: float,
                     seq_mean: bool) -> None:
    """One actor optimizer step over the rows `index` of `exp` (its global mini-batch, `mask` their action masks):
    each row's share of the policy loss's denominator is added to `exp.info["loss_weight"]` -- its trained tokens /
    the mini-batch's (`num_tokens`), or 1 / rows (`num_seqs`) for a sequence-mean loss (gspo)."""
    weights = exp.info.setdefault(LOSS_WEIGHT_KEY, torch.zeros(exp.batch_size, dtype=torch.float64))
    has_tokens = (mask.sum(-1) > 0).double()  # a row with no token is not in the sequence mean
    share = has_tokens / num_seqs if seq_mean else mask.sum(-1).double() / num_tokens
    weights.index_add_(0, index.long(), share)


def policy_version(step: int, async_train: bool) -> int:
    """The optimizer step whose weights the engines held when the rollout of `step` was generated (0: the initial
    weights) in the one-step pipeline: step - 1, or with --async_train (generated while the previous step trained)
    step - 2, at least 0. Used only for samples that recorded no versions (`sample.extra["policy_versions"]`)."""
    return max(0, step - (2 if async_train else 1))


def _versions(sample: Any, fallback: int) -> list[int]:
    """The policy version of each response token as recorded by the loop (rl/async_rollout.py), else `fallback`."""
    return list(sample.extra.get(VERSIONS_KEY) or [fallback])


def take_trainer_mismatch(exp: Any, results: list[dict[str, Any]]) -> None:
    """Pop the `trace` entries an actor's training step returns when its own forward gave the old log-probs (one
    optimizer step per rollout, make_experience.old_log_probs_from_training_pass): (rows, |rollout - trainer|
    log-prob per token) per micro-batch, kept in `exp.info["trainer_logprob_abs_diff"]` [B, R] (first epoch)."""
    for result in results:
        for rows, diff in result.pop("trace", None) or []:
            out = exp.info.setdefault(MISMATCH_KEY, torch.full(exp.action_mask.shape, float("nan")))
            for j, row in enumerate(rows.tolist()):
                if math.isnan(float(out[row, 0])):
                    out[row] = 0.0
                    out[row, :diff.shape[1]] = diff[j].float()


def _abs_diff(exp: Any) -> torch.Tensor | None:
    """[B, R] |rollout - trainer log-prob| per token: from the separate old-log-prob pass (`exp.old_log_probs`),
    else from the training forward (`take_trainer_mismatch`); None when neither ran (the actor frozen)."""
    if exp.old_log_probs is not None:
        return (exp.rollout_log_probs.float() - exp.old_log_probs.float()).abs()
    return exp.info.get(MISMATCH_KEY)


def _number(value: Any) -> float | str | None:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, bool | int | float):
        value = float(value)
        return value if math.isfinite(value) else None
    return None if value is None else str(value)


def _components(extra_logs: dict[str, Any], rows: int) -> list[dict[str, Any]]:
    """Per-sample reward components from the reward source's extra_logs (entries with one value per row)."""
    out: list[dict[str, Any]] = [{} for _ in range(rows)]
    for key, values in (extra_logs or {}).items():
        if isinstance(values, torch.Tensor):
            if values.dim() != 1 or values.numel() != rows:
                continue
            values = values.tolist()
        elif not isinstance(values, list | tuple) or len(values) != rows:
            continue
        for i, value in enumerate(values):
            out[i][str(key)] = _number(value)
    return out


def _failure(rollout: Any, row: int) -> str | None:
    """The reason the reward of `row` failed (the sample scored 0 for it; rlhfkit.rewards.base), None when fine."""
    reasons = getattr(rollout, "reward_failure", None) or []
    return (reasons[row] or None) if row < len(reasons) else None


def _rounded(values: torch.Tensor) -> list[float | None]:
    return [None if not math.isfinite(v) else round(v, 6) for v in values.tolist()]


def trace_rows(step: int, rollout: Any, exp: Any, tokenizer: Any, *,
               async_train: bool = False) -> list[dict[str, Any]]:
    """One dict per row of `exp` (the step's training batch; `rollout` the samples it was built from)."""
    mask = exp.action_mask
    diff = _abs_diff(exp)
    weights = exp.info.get(LOSS_WEIGHT_KEY)
    components = _components(rollout.extra_logs, exp.batch_size)
    fallback = policy_version(step, async_train)
    rows = []
    for i, sample in enumerate(rollout.samples):
        width = len(sample.response_ids)
        m = mask[i, :width]
        adv = exp.advantages[i, :width].float() if exp.advantages is not None else None
        trained = int(m.sum())
        versions = _versions(sample, fallback)
        row: dict[str, Any] = {
            "step": step, "kind": "train", "prompt_index": sample.prompt_index, "sample_index": sample.sample_index,
            "prompt": rollout.prompts[sample.prompt_index].get("prompt"),
            "label": rollout.prompts[sample.prompt_index].get("label"),
            "response": rollout.texts[i], "response_ids": list(sample.response_ids),
            "finish_reason": sample.finish_reason, "response_length": width, "trained_tokens": trained,
            "turns": sample.extra.get("turns"),
            "reward": _number(exp.rewards[i]), "reward_components": components[i] or None,
            "reward_failure": _failure(rollout, i),
            "score": _number(exp.scores[i]) if exp.scores is not None else None,
            "advantage": None, "advantage_first": None,
            "loss_weight": None if weights is None else round(float(weights[i]), 8),
            "policy_version": min(versions), "policy_versions": sorted(set(versions)),
            "staleness": step - 1 - min(versions),
            "token_policy_versions": versions if len(set(versions)) > 1 else None,
            "logprob_abs_diff_mean": None, "logprob_abs_diff_max": None,
            "tokens": [tokenizer.decode([t]) for t in sample.response_ids],
            "token_advantages": None, "token_logprob_abs_diff": None,
        }
        if adv is not None and trained:
            row["advantage"] = round(float(adv[m].mean()), 6)
            row["advantage_first"] = round(float(adv[m][0]), 6)
        if adv is not None:
            row["token_advantages"] = _rounded(torch.where(m, adv, torch.full_like(adv, float("nan"))))
        if diff is not None:
            d = diff[i, :width]
            if trained:
                row["logprob_abs_diff_mean"] = round(float(d[m].mean()), 8)
                row["logprob_abs_diff_max"] = round(float(d[m].max()), 8)
            row["token_logprob_abs_diff"] = _rounded(torch.where(m, d, torch.full_like(d, float("nan"))))
        rows.append(row)
    return rows


def append_rows(run_dir: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Append `rows` as JSON lines to `<run_dir>/samples.jsonl`, flushed to disk."""
    path = Path(run_dir) / TRACE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    with path.open("a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
    return path


def write_step_trace(s: Any, step: int, rollout: Any, exp: Any) -> None:
    """The step's trace lines (called by the online loop after its training step)."""
    append_rows(s.plan.run_dir, trace_rows(step, rollout, exp, s.tokenizer, async_train=bool(s.cfg.async_train)))
