"""Steps 1-3 of an online step: prompts -> rollout engines -> rewards -> (filter) -> log-probs -> advantages.

The driver holds the whole batch, so advantages and their normalisation are global by construction.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from rlhfkit.agents.environment import AgentSpec
from rlhfkit.agents.executor import run_episodes
from rlhfkit.agents.openai_server import run_endpoint_episodes
from rlhfkit.algorithms.advantages import compute_advantages_and_returns
from rlhfkit.algorithms.kl import compute_kl
from rlhfkit.algorithms.normalize import masked_mean
from rlhfkit.algorithms.offpolicy import logprob_mismatch
from rlhfkit.algorithms.rewards import length_penalties
from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.plan import RunPlan
from rlhfkit.engine.safe_state import register_dataclasses
from rlhfkit.rewards.base import failure_counts, failure_reasons
from rlhfkit.rl.experience import Experience, build_experience
from rlhfkit.rl.group import run_side_by_side
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout.dispatch import generate_on_engines
from rlhfkit.rollout.types import RolloutSample, SamplingConfig


@dataclass
class PromptStream:
    """An endless, seeded stream over the prompt set: prompt k is permutation_{k // N}[k % N].

    Its only state is `cursor` (prompts consumed), which makes resuming exact.
    """

    samples: list[dict[str, Any]]
    seed: int
    cursor: int = 0

    def take(self, count: int) -> list[dict[str, Any]]:
        n = len(self.samples)
        out = []
        for k in range(self.cursor, self.cursor + count):
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 7919 + k // n)).tolist()
            out.append(self.samples[perm[k % n]])
        self.cursor += count
        return out


@dataclass
class Timer:
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, began: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - began


@dataclass
class Rollout:
    prompts: list[dict[str, Any]]
    samples: list[RolloutSample]
    rewards: torch.Tensor
    scores: torch.Tensor
    texts: list[str]
    reward_failed: int = 0
    extra_logs: dict[str, Any] = field(default_factory=dict)
    # per row: the reward's failure reason ("" when fine; extra_logs["reward_failure"], rlhfkit.rewards.base), kept
    # row-aligned through dynamic filtering; and the counts per reason over every sample scored (filtered ones too)
    reward_failure: list[str] = field(default_factory=list)
    reward_failures: dict[str, int] = field(default_factory=dict)


def register_rollout_types() -> None:
    """The dataclasses a rollout holds, allowed in the plain-data format of engine/safe_state (the pending rollouts of
    an --async_train checkpoint, and --rollout_dump_dir's step files)."""
    register_dataclasses(Rollout, Timer, RolloutSample, SamplingConfig)


def generate_and_score(engines: list[Any], prompts: list[dict[str, Any]], sampling: SamplingConfig,
                       reward_fn: Callable | None, tokenizer: Any, timer: Timer, seed_offset: int,
                       phases: Any | None = None, agent: AgentSpec | None = None,
                       generate: Callable | None = None) -> Rollout:
    """Generate n responses per prompt and score them. Rows come back prompt-major.

    `reward_fn`: a text reward source `(queries, prompts, labels)`, or an object with `score_rollout(samples,
    queries, prompts, labels)` (`rl.reward_group.RolloutRewards`: reward models read the token ids).
    `agent` (`--agent_func_path`): multi-turn episodes instead, rewarded by the environment (`reward_fn` unused).
    `phases` (`rl.colocation.Phases`): engines awake for generation, models back on the device for scoring.
    `generate` (`--partial_rollout`): `(engines, prompt_ids, sampling) -> samples` instead of `generate_on_engines`
    (`rl.async_rollout.EngineGate.chunked`: generation in chunks, weight syncs between them).
    """
    if phases is not None:
        phases.before_generation()
    began = time.perf_counter()
    sampling = sampling.shifted(seed_offset) if sampling.seed is not None else sampling
    if agent is not None:
        return _agent_rollout(engines, prompts, sampling, agent, tokenizer, timer, phases)
    prompt_ids = [p["prompt_ids"] for p in prompts]
    if any("images" in p for p in prompts):  # --image_key: the engines expand the placeholders (rl/vision_batch.py)
        samples = generate_on_engines(engines, prompt_ids, sampling, [p.get("images") or [] for p in prompts])
    else:
        samples = (generate or generate_on_engines)(engines, prompt_ids, sampling)
    timer.add("generation", began)
    if phases is not None:
        phases.after_generation()
    began = time.perf_counter()
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    prompt_texts = [prompts[s.prompt_index]["prompt"] for s in samples]
    labels = [prompts[s.prompt_index].get("label") for s in samples]
    queries = [p + t for p, t in zip(prompt_texts, texts)]
    score_rollout = getattr(reward_fn, "score_rollout", None)
    if score_rollout is not None:
        out = score_rollout(samples, queries, prompt_texts, labels)
    elif reward_fn is not None:
        out = reward_fn(queries, prompt_texts, labels)
    else:
        raise ValueError("generate_and_score: no reward_fn (only an agent's episodes reward themselves)")
    timer.add("reward", began)
    reasons = failure_reasons(out)
    return Rollout(prompts, samples, out.rewards.float(), out.scores.float(), texts, out.failed, out.extra_logs,
                   reasons, failure_counts(reasons))


def _agent_rollout(engines: list[Any], prompts: list[dict[str, Any]], sampling: SamplingConfig, agent: AgentSpec,
                   tokenizer: Any, timer: Timer, phases: Any | None) -> Rollout:
    """Multi-turn episodes (`rlhfkit.agents`); generation and environment time go to the generation and reward
    stages. The engines stay awake through every turn."""
    if agent.run_agent is not None:
        out = run_endpoint_episodes(engines, prompts, sampling, agent, tokenizer, agent.action_max_len)
    else:
        out = run_episodes(engines, prompts, sampling, agent, tokenizer, agent.action_max_len)
    timer.seconds["generation"] = timer.seconds.get("generation", 0.0) + out.generation_seconds
    timer.seconds["reward"] = timer.seconds.get("reward", 0.0) + out.environment_seconds
    if phases is not None:
        phases.after_generation()
    return Rollout(prompts, out.samples, out.rewards, out.scores, out.texts, 0, out.extra_logs)


def keep_groups(scores: torch.Tensor, n: int, low: float, high: float) -> list[int]:
    """Dynamic filtering: indices of the groups whose mean score lies strictly inside (low, high)."""
    means = scores.view(-1, n).mean(-1)
    return [g for g, m in enumerate(means.tolist()) if low < m < high]


def select_groups(rollout: Rollout, groups: list[int], n: int) -> Rollout:
    rows = [g * n + j for g in groups for j in range(n)]
    index = torch.tensor(rows, dtype=torch.long)
    prompt_map = {g: i for i, g in enumerate(groups)}
    samples = []
    for r in rows:
        samples.append(replace(rollout.samples[r], prompt_index=prompt_map[rollout.samples[r].prompt_index]))
    reasons = [rollout.reward_failure[r] for r in rows] if rollout.reward_failure else []
    return Rollout([rollout.prompts[g] for g in groups], samples, rollout.rewards[index], rollout.scores[index],
                   [rollout.texts[r] for r in rows], rollout.reward_failed, rollout.extra_logs, reasons,
                   dict(rollout.reward_failures))


def merge_rollouts(parts: list[Rollout]) -> Rollout:
    prompts, samples, texts, offset = [], [], [], 0
    for part in parts:
        samples += [replace(s, prompt_index=s.prompt_index + offset) for s in part.samples]
        prompts += part.prompts
        texts += part.texts
        offset += len(part.prompts)
    counts: dict[str, int] = {}
    for part in parts:
        for reason, n in part.reward_failures.items():
            counts[reason] = counts.get(reason, 0) + n
    reasons = [r for p in parts for r in (p.reward_failure or [""] * len(p.samples))]
    return Rollout(prompts, samples, torch.cat([p.rewards for p in parts]), torch.cat([p.scores for p in parts]),
                   texts, sum(p.reward_failed for p in parts), parts[0].extra_logs if parts else {}, reasons,
                   dict(sorted(counts.items())))


def to_experience(rollout: Rollout, pad_token_id: int) -> Experience:
    s = rollout.samples
    exp = build_experience([x.prompt_ids for x in s], [x.response_ids for x in s], [x.response_logprobs for x in s],
                           [x.prompt_index for x in s], pad_token_id, [x.action_mask for x in s])
    exp.rewards, exp.scores = rollout.rewards, rollout.scores
    exp.info["truncated"] = torch.tensor([x.finish_reason == "length" for x in s], dtype=torch.float32)
    return exp


def apply_length_penalties(rollout: Rollout, exp: Experience, cfg: PPOConfig) -> dict[str, float]:
    """DAPO's overlong and ProRL's stop-properly penalties (`rlhfkit.algorithms.rewards.length_penalties`) on the
    sequence rewards, in place on both `exp.rewards` and `rollout.rewards` (so rollout/reward_mean is the penalised
    reward, as in OpenRLHF), before any advantage; returns `rollout/*` metrics (none when both are off)."""
    if cfg.overlong_buffer_len is None and cfg.stop_properly_penalty_coef is None:
        return {}
    rewards, metrics = length_penalties(filled(exp.rewards, "rewards"), exp.response_length, exp.info["truncated"],
                                        cfg.generate_max_len, overlong_buffer_len=cfg.overlong_buffer_len,
                                        overlong_penalty_factor=cfg.overlong_penalty_factor,
                                        stop_properly_penalty_coef=cfg.stop_properly_penalty_coef)
    exp.rewards = rollout.rewards = rewards
    return {f"rollout/{k}": v for k, v in metrics.items()}


def filled(value: torch.Tensor | None, name: str) -> torch.Tensor:
    """An Experience field an earlier stage of the step sets (`to_experience`: rewards and scores); a None here is a
    bug in the pipeline's order, not a user error."""
    if value is None:
        raise ValueError(f"the experience has no {name} yet: to_experience sets it before this stage")
    return value


def model_batch(exp: Experience) -> dict[str, torch.Tensor]:
    batch = {"sequences": exp.sequences, "attention_mask": exp.attention_mask, "action_mask": exp.action_mask}
    for key in ("pixel_values", "pixel_attention_mask"):  # --image_key: the rows' images
        if getattr(exp, key) is not None:
            batch[key] = getattr(exp, key)
    return batch


def old_log_probs_from_training_pass(cfg: PPOConfig, plan: RunPlan, rows: int, has_ref: bool) -> bool:
    """Whether the PPO ratio's old log-probs can be the training forward's own, detached: the rollout makes exactly
    one optimizer step (one mini-batch of `rows` <= --train_batch_size, --max_epochs 1, the actor trains from the first
    step), so the policy that would compute them in a separate pass is the one being trained, and no reward-side KL
    needs them before the advantages (on_policy_distill's advantages are made of them: never). The worker still
    runs a separate no-grad pass for models with active dropout."""
    return (not cfg.recompute_old_log_probs and cfg.max_epochs == 1 and rows <= cfg.train_batch_size
            and cfg.freezing_actor_steps <= 0 and not plan.distill and (not has_ref or plan.kl_mode == "loss"))


def fill_log_probs_and_advantages(exp: Experience, cfg: PPOConfig, plan: RunPlan, actor: Any, ref: Any | None,
                                  critic: Any | None, timer: Timer, kl_coef: float | None = None) -> dict[str, float]:
    """Trainer log-probs, reference log-probs, values, KL, advantages and returns (in place); returns metrics.
    `kl_coef`: the reward-side KL coefficient of this step (the adaptive controller's value; None: the plan's
    --init_kl_coef); the KL mode, its estimator and on-policy distillation are the plan's.

    When `old_log_probs_from_training_pass` holds, the actor's pass is skipped (`exp.old_log_probs` stays None):
    the training step takes them from its own forward and reports the rollout mismatch metrics itself."""
    began = time.perf_counter()
    batch = model_batch(exp)
    reuse = old_log_probs_from_training_pass(cfg, plan, exp.batch_size, ref is not None)
    calls = [] if reuse else [(actor, partial(actor.map_rows_async, ModelWorker.log_probs, batch))]
    if ref is not None:
        calls.append((ref, partial(ref.map_rows_async, ModelWorker.log_probs, batch)))
    if critic is not None:
        calls.append((critic, partial(critic.map_rows_async, ModelWorker.values, batch)))
    results = run_side_by_side(calls)  # separate placement groups: at the same time
    old = None
    if not reuse:
        old = exp.old_log_probs = results.pop(0)
    mask = exp.action_mask
    distill = plan.distill  # the reference role holds the teacher
    if ref is not None:
        exp.ref_log_probs = results.pop(0)
        if old is not None and not distill:  # reused: the KL is the training step's kl_loss (--use_kl_loss)
            exp.kl = compute_kl(old, exp.ref_log_probs, mask, plan.kl_estimator)
    if critic is not None:
        exp.values = results.pop(0)
    timer.add("log_probs", began)
    penalty = ref is not None and plan.kl_mode == "penalty"
    kl_coef = plan.kl_coef(kl_coef) if penalty else 0.0
    clip_low, clip_high = cfg.reward_clip_range
    exp.advantages, exp.returns = compute_advantages_and_returns(
        plan.estimator, filled(exp.rewards, "rewards"), mask, n_samples_per_prompt=cfg.n_samples_per_prompt,
        values=exp.values, kl=exp.kl, kl_coef=kl_coef, gamma=cfg.gamma, lambd=cfg.lambd,
        reward_clip_range=(clip_low, clip_high), std_norm=not cfg.no_advantage_std_norm,
        student_log_probs=old if distill else None, teacher_log_probs=exp.ref_log_probs if distill else None,
        opd_kl_coef=cfg.opd_kl_coef, opd_reward_weight=cfg.opd_reward_weight)
    metrics = {} if old is None else {f"rollout/{k}": float(v) for k, v in
                                      logprob_mismatch(old, exp.rollout_log_probs, mask).items()}
    if distill and old is not None and exp.ref_log_probs is not None:  # the sampled reverse KL to the teacher
        metrics["rollout/opd_reverse_kl"] = float(masked_mean(old - exp.ref_log_probs, mask))
    if exp.kl is not None:
        metrics["rollout/kl"] = float(masked_mean(exp.kl, mask))
    return metrics
