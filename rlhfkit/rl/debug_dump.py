"""`--debug_dump_steps`: the tensors of chosen PPO steps, written to `<run_dir>/debug/step_<N>.pt` for checking a run
by hand (docs/rl.md, "Checking a run by hand").

Off (the default) it costs nothing: only for a dumped step does the driver call the workers' training steps with
`debug_dump=True`, and only then do they collect per-micro-batch tensors (`row_index`, each row's place in the
step's experience, rides with every training shard).

One file per dumped step, a dict (load with `torch.load(path)`):

    step, config                      the global step and the run's resolved flags (JSON types)
    experience                        what the advantage estimator and the trainers received, [B, ...] each:
        sequences, attention_mask      [B, P+R] left-padded prompt + right-padded response
        action_mask                    [B, R] bool
        rollout_log_probs              [B, R] the engine's sampling log-probs
        old_log_probs                  [B, R] the trainer's before the update (absent when the training forward
                                       computes them itself: then see each micro-batch's old_log_probs)
        ref_log_probs, kl              [B, R] reference log-probs and the per-token KL (when a reference runs)
        values                         [B, R] critic values (gae)
        rewards, scores                [B] sequence rewards as the estimator received them (before clipping and
                                       the group baseline), task scores
        advantages, returns            [B, R]
    actor, critic                     one entry per optimizer step and rank: update (0, 1, ...), epoch, rank,
                                       num_tokens (token count of the global mini-batch: the loss's denominator),
                                       grad_norm (before clipping), grad_norm_after_clip, lr (the one the step
                                       used), update_max_abs / update_norm (max |delta theta| / ||delta theta||
                                       over all parameters), micro_batches: a list of dicts, see below
    micro-batch (actor)               row_index [b] (rows of `experience`), and [b, r] (the micro-batch's trimmed
                                       response width r <= R, aligned with experience columns 0..r-1):
                                       action_mask, advantages, old_log_probs, rollout_log_probs, log_probs (new),
                                       ratio, policy_loss (per token: sum(mask * policy_loss) / num_tokens is the
                                       policy term), entropy, is_weights (IS correction), ref_log_probs and kl
                                       (--use_kl_loss: the KL loss's per-token estimate), and the scalars loss
                                       (what backward got, before the x world-size scale), clip_frac,
                                       dual_clip_frac; with --aux_loss_coef on an MoE actor also aux_loss (the
                                       router load-balancing loss of this forward; loss includes coef x aux_loss /
                                       (num_micro_batches x world size)), num_micro_batches, and the trimmed
                                       sequences / attention_mask the forward saw
    micro-batch (critic)              row_index, action_mask, values (new), old_values, returns, value_loss (per
                                       token: sum(mask * value_loss) / num_tokens is the loss), loss, value_clip_frac
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.parse import config_to_dict
from rlhfkit.errors import ConfigError


def dump_steps(values: list[str] | None) -> set[int] | str | None:
    """`--debug_dump_steps` as a set of steps, "all", or None (off); ConfigError on anything else."""
    if not values:
        return None
    if [v.lower() for v in values] == ["all"]:
        return "all"
    try:
        steps = {int(v) for v in values}
    except ValueError:
        raise ConfigError(f"--debug_dump_steps {' '.join(values)}: give global step numbers (1 3 10) or 'all'") \
            from None
    if min(steps) < 1:
        raise ConfigError(f"--debug_dump_steps {' '.join(values)}: steps count from 1")
    return steps


def wants_dump(cfg: PPOConfig, step: int) -> bool:
    steps = dump_steps(cfg.debug_dump_steps)
    return steps == "all" or (steps is not None and step in steps)


def detached_cpu(tensors: dict[str, Any]) -> dict[str, Any]:
    """A copy whose tensors are detached CPU clones (other values as they are)."""
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}


def step_record(cfg: PPOConfig, step: int, experience: dict[str, torch.Tensor],
                resolved: dict[str, Any] | None = None) -> dict[str, Any]:
    """A --debug_dump_steps step's record: the run's config (`resolved`: the flags the run plan resolved, recorded
    instead of the values given), the experience and, filled later, each optimizer step's entries."""
    config = json.loads(json.dumps({**config_to_dict(cfg), **(resolved or {})}, default=str))
    return {"step": step, "config": config, "experience": detached_cpu(experience), "actor": [], "critic": []}


def add_updates(record: dict[str, Any], role: str, update: int, epoch: int, num_tokens: float,
                per_rank: list[dict[str, Any]]) -> None:
    """The `debug` entries the ranks returned for one optimizer step of `role`."""
    for rank, entry in enumerate(per_rank):
        record[role].append({"update": update, "epoch": epoch, "rank": rank, "num_tokens": num_tokens, **entry})


def write_dump(run_dir: str, record: dict[str, Any]) -> Path:
    path = Path(run_dir) / "debug" / f"step_{record['step']}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(record, tmp)
    tmp.replace(path)
    return path
