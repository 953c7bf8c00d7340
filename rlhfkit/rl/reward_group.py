"""Rewards of a rollout: reward models on Ray model groups, read from token ids, plus text sources.

* Each `--reward_pretrain` model is one frozen, FSDP2-sharded `ModelGroup` (role "reward",
  `--reward_num_nodes x --reward_num_gpus_per_node` ranks). It scores the rollout's token ids directly - no decode
  and re-encode: each row is prompt + response with trailing eos/pad tokens dropped and one eos appended (the shape
  `rlhfkit rm` trains on, and the one `RewardModelSource` / `serve-rm` build from text), and the reward is the
  `score` head at that last token. `--normalize_reward` maps `r -> (r - reward_mean) / reward_std` with the
  statistics `rlhfkit rm` stored in the model's config.json. The reward model must share the policy's tokenizer
  (checked at set-up); one that does not can be served with `rlhfkit serve-rm` and used through `--remote_rm_url`.
* `--remote_rm_url` specs (reward_func files, `builtin:NAME`, http(s) reward servers) are text sources
  (`rlhfkit.rewards`), called on the driver with the decoded queries.
* Several rewards combine per sample with `rlhfkit.rewards.sources.combine`: `--reward_combine mean|sum`, or
  `--reward_weights` (model rewards first, in `--reward_pretrain` order, then the `--remote_rm_url` sources).
  Each one's own value is kept in `extra_logs["<name>/reward"]` (logged as `reward/<name>/reward`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from rlhfkit.config.commands import PPOConfig
from rlhfkit.rewards.base import RewardOutput, check_batch
from rlhfkit.rewards.remote import RemoteRewardClient, max_response_bytes, remote_timeout
from rlhfkit.rewards.reward_func import RewardFuncSource
from rlhfkit.rewards.reward_model import RewardModelSource
from rlhfkit.rewards.sources import builtin_source, code_sandbox_options, combine, spec_kind, split_specs
from rlhfkit.rl.group import run_side_by_side
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout.types import RolloutSample


def model_specs(cfg: PPOConfig) -> list[str]:
    """The `--reward_pretrain` specs that are reward models (each gets a Ray group)."""
    return [s for s in split_specs(cfg.reward_pretrain) if spec_kind(s) == "model"]


def text_specs(cfg: PPOConfig) -> list[str]:
    """Every other reward spec (in `--reward_pretrain`, then `--remote_rm_url` order)."""
    return [s for s in split_specs(cfg.reward_pretrain) if spec_kind(s) != "model"] + split_specs(cfg.remote_rm_url)


def text_sources(cfg: PPOConfig) -> list[Any]:
    """One source per text spec; all http(s) URLs form one client (replicas sharing each batch)."""
    sources: list[Any] = []
    specs = text_specs(cfg)
    urls = [s for s in specs if spec_kind(s) == "remote"]
    for spec in specs:
        kind = spec_kind(spec)
        if kind == "remote":
            if not any(isinstance(s, RemoteRewardClient) for s in sources):
                timeout = remote_timeout(cfg.remote_rm_timeout, cfg.reward_timeout)
                sources.append(RemoteRewardClient(urls, timeout=timeout, retries=cfg.remote_rm_retries,
                                                  backoff=cfg.remote_rm_backoff, token=cfg.remote_rm_token,
                                                  max_response_bytes=max_response_bytes(
                                                      cfg.remote_rm_max_response_mb)))
        elif kind == "file":
            sources.append(RewardFuncSource.from_file(spec, timeout=cfg.reward_timeout,
                                                      error_policy=cfg.reward_error_policy))
        elif kind == "builtin":
            sources.append(builtin_source(spec, timeout=cfg.reward_timeout, error_policy=cfg.reward_error_policy,
                                          format_pattern=cfg.reward_format_pattern, **code_sandbox_options(cfg)))
        else:  # a model named in --remote_rm_url: scored in-process from text (OpenRLHF accepts no such thing)
            sources.append(RewardModelSource(spec, micro_batch_size=cfg.micro_rollout_batch_size,
                                             normalize_reward=cfg.normalize_reward))
    return sources


def reward_batch(samples: Sequence[RolloutSample], eos_token_id: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Left-padded `sequences` / `attention_mask` of prompt + response, trailing eos/pad dropped, one eos appended;
    `prompt_lengths` [B] (for --packing_samples, which computes a prompt shared by several samples once)."""
    rows = []
    for s in samples:
        response = list(s.response_ids)
        while response and response[-1] in (eos_token_id, pad_token_id):
            response.pop()
        rows.append(list(s.prompt_ids) + response + [eos_token_id])
    width = max(len(r) for r in rows)
    sequences = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        sequences[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return {"sequences": sequences, "attention_mask": mask,
            "prompt_lengths": torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)}


class RolloutRewards:
    """The run's reward: reward-model groups (token ids) and text sources, combined per sample.

    `score_rollout(samples, queries, prompts, labels)` is what the online loop calls; a plain
    `(queries, prompts, labels)` call works when there is no reward-model group.
    """

    def __init__(self, models: Sequence[tuple[str, Any]], texts: Sequence[Any], *, rule: str = "mean",
                 weights: Sequence[float] | None = None, eos_token_id: int = 0, pad_token_id: int = 0) -> None:
        count = len(models) + len(texts)
        if count == 0:
            raise ValueError("no reward: set --reward_pretrain or --remote_rm_url")
        if weights is not None and len(weights) != count:
            names = [n for n, _ in models] + [s.name for s in texts]
            raise ValueError(f"--reward_weights has {len(weights)} values for {count} reward sources {names} "
                             "(reward models first, then --remote_rm_url sources)")
        self.models, self.texts = list(models), list(texts)
        self.rule, self.weights = rule, list(weights) if weights is not None else None
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.name = "+".join([n for n, _ in self.models] + [s.name for s in self.texts])

    @property
    def groups(self) -> list[Any]:
        return [g for _, g in self.models]

    def score_rollout(self, samples: Sequence[RolloutSample], queries: list[str], prompts: list[str],
                      labels: list[Any] | None) -> RewardOutput:
        outputs: list[RewardOutput] = []
        if self.models:
            batch = reward_batch(samples, self.eos_token_id, self.pad_token_id)
            calls = [(group, partial(group.map_rows_async, ModelWorker.rewards, batch)) for _, group in self.models]
            for rewards in run_side_by_side(calls):
                outputs.append(RewardOutput(rewards.float(), rewards.float().clone(), {}))
        outputs += [source(queries, prompts, labels) for source in self.texts]
        if len(outputs) == 1 and self.weights is None:
            return outputs[0]
        return combine(outputs, [n for n, _ in self.models] + [s.name for s in self.texts], self.rule, self.weights)

    def __call__(self, queries: list[str], prompts: list[str] | None = None,
                 labels: list[Any] | None = None) -> RewardOutput:
        if self.models:
            raise TypeError(f"{self.name}: reward models on Ray score token ids; call score_rollout(samples, ...)")
        queries, prompts, labels = check_batch(queries, prompts, labels, f"reward sources {self.name}")
        return self.score_rollout([], queries, prompts, labels)
