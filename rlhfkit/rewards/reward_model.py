"""A reward model as a reward source: a scalar-head model read at the last token, in-process or in a Ray worker.

Text in (``queries``, OpenRLHF's ``serve_rm`` convention): trailing pad / eos strings are stripped and one eos is
appended (rlhfkit's reward trainer ends every sequence with eos), the text is tokenised without special tokens,
sequences longer than ``max_len`` keep their **last** ``max_len`` tokens (the reward is read at the end; the count
is logged as ``extra_logs["rm_truncated"]``), and micro-batches of ``micro_batch_size`` are left-padded and scored
with :func:`rlhfkit.models.loading.scalar_outputs`. Tokens in: :meth:`RewardModelSource.score_tokens`.

``normalize_reward=True`` (``--normalize_reward``) maps ``r -> (r - reward_mean) / reward_std`` with the statistics
the reward trainer wrote into the model's ``config.json``; if they are absent a warning says so and rewards are
left as they are (OpenRLHF's behaviour: mean 0, std 1). Several models are combined by
:func:`rlhfkit.rewards.sources.combine`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhfkit.models.loading import load_scalar_model, load_tokenizer, scalar_outputs
from rlhfkit.rewards.base import RewardOutput, check_batch

logger = logging.getLogger(__name__)
DEFAULT_MICRO_BATCH = 8
DEFAULT_MAX_LEN = 2048


def reward_stats(config: Any, spec: str) -> tuple[float, float]:
    """``(reward_mean, reward_std)`` from a model config; ``(0, 1)`` with a warning when absent."""
    mean, std = getattr(config, "reward_mean", None), getattr(config, "reward_std", None)
    if mean is None or std is None:
        logger.warning("--normalize_reward: reward model %s has no reward_mean/reward_std in its config.json; "
                       "its rewards are not normalised", spec)
        return 0.0, 1.0
    if not float(std) > 0:
        raise ValueError(f"reward model {spec}: config.json reward_std={std} must be > 0 to normalise rewards")
    return float(mean), float(std)


class RewardModelSource:
    """Score queries with one scalar-head model (see the module docstring)."""

    def __init__(self, spec: str, *, model: PreTrainedModel | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None, micro_batch_size: int | None = DEFAULT_MICRO_BATCH,
                 max_len: int = DEFAULT_MAX_LEN, normalize_reward: bool = False, dtype: torch.dtype = torch.float32,
                 device: str | torch.device | None = None, attn_implementation: str = "sdpa",
                 use_fast_tokenizer: bool = True) -> None:
        if max_len < 1 or (micro_batch_size is not None and micro_batch_size < 1):
            raise ValueError(f"max_len ({max_len}) and micro_batch_size ({micro_batch_size}) must be >= 1")
        self.spec, self.name = spec, f"rm:{spec}"
        self.micro_batch_size, self.max_len = micro_batch_size, max_len
        self.model = model if model is not None else load_scalar_model(
            spec, dtype=dtype, attn_implementation=attn_implementation)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model.to(device).eval()  # type: ignore[arg-type]  # transformers types .to() for dtypes only
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(spec, use_fast=use_fast_tokenizer)
        if self.tokenizer.pad_token_id is None:
            raise ValueError(f"reward model {spec}: its tokenizer has no pad token")
        self.mean, self.std = reward_stats(self.model.config, spec) if normalize_reward else (0.0, 1.0)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def __call__(self, queries: list[str], prompts: list[str] | None = None,
                 labels: list[Any] | None = None) -> RewardOutput:
        """Rewards (= scores) for decoded prompt + response texts."""
        queries, _, _ = check_batch(queries, prompts, labels, f"reward model {self.spec}")
        ids = [self.encode(q) for q in queries]
        truncated = torch.tensor([float(len(x) > self.max_len) for x in ids])
        rewards = self.score_ids([x[-self.max_len:] for x in ids])
        return RewardOutput(rewards, rewards.clone(), {"rm_truncated": truncated})

    def encode(self, query: str) -> list[int]:
        """Token ids of a query with trailing pad/eos stripped and one eos appended (not truncated)."""
        tok = self.tokenizer
        text = query
        for token in {t for t in (tok.pad_token, tok.eos_token) if t}:
            while text.endswith(token):
                text = text[: -len(token)]
        if tok.eos_token:
            text += tok.eos_token
        return tok(text, add_special_tokens=False)["input_ids"]

    def score_ids(self, sequences: list[list[int]]) -> torch.Tensor:
        """Rewards for unpadded token-id lists, left-padded per micro-batch. Float32 ``[B]`` on the CPU."""
        if any(len(s) == 0 for s in sequences):
            raise ValueError(f"reward model {self.spec}: an empty sequence cannot be scored")
        pad = self.tokenizer.pad_token_id
        out, step = [], self.micro_batch_size or max(len(sequences), 1)
        for start in range(0, len(sequences), step):
            chunk = sequences[start: start + step]
            width = max(len(s) for s in chunk)
            input_ids = torch.tensor([[pad] * (width - len(s)) + list(s) for s in chunk])
            mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in chunk])
            out.append(self.score_tokens(input_ids, mask))
        return torch.cat(out) if out else torch.zeros(0)

    @torch.no_grad()
    def score_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Rewards for one padded batch (any padding side): last-token value, normalised. Float32 ``[B]``, CPU."""
        values, _ = scalar_outputs(self.model, input_ids.to(self.device), attention_mask.to(self.device))
        return ((values.float() - self.mean) / self.std).cpu()
