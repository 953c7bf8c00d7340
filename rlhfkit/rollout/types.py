"""The rollout interface shared by every backend: sampling settings in, token ids and sampling log-probs out.

Token ids in, token ids out: no backend re-tokenises. Text is decoded only by callers that need it (reward
functions, logs).

Log-prob semantics (the trainer must compute the same quantity, see `docs/rollout.md`):
`RolloutSample.response_logprobs[t]` is `log softmax(logits_t / T)[token_t]`, the log-probability of the sampled
token under the distribution it was sampled from, where `T = temperature` (`T = 1` for greedy, `temperature == 0`).
With `top_k > 0` or `top_p < 1` (sampled, not greedy) that distribution is truncated to the kept tokens and
renormalised, after the temperature: the trainer reproduces it with `SamplingConfig.truncation`
(`rlhfkit.models.logprobs.SamplingTruncation`, ppo's `--logprobs_truncation auto`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from rlhfkit.models.logprobs import SamplingTruncation

FinishReason = Literal["stop", "length"]
NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample responses (backend-neutral).

    Flags: `--temperature` -> temperature, `--top_p` -> top_p, `--top_k` -> top_k (0: off),
    `--generate_max_len` -> max_new_tokens,
    `--n_samples_per_prompt` -> n, `--seed` -> seed, ppo's `--max_len` -> max_len (prompt + response <= max_len:
    a prompt of p tokens gets `new_tokens(p)` = min(max_new_tokens, max_len - p) new tokens; None: max_new_tokens
    for every prompt). `temperature == 0` means greedy decoding.
    Sample `j` of prompt `i` is drawn with seed `seed + i * n + j`, so results do not depend on how the prompts
    are split across engines.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_len: int | None = None
    top_k: int = 0
    min_new_tokens: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingConfig.top_k (--top_k) must be >= 0 (0: off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingConfig.max_new_tokens (--generate_max_len) must be >= 1, got {self.max_new_tokens}"
            )
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"SamplingConfig.min_new_tokens (--generate_min_len) must be in [0, max_new_tokens = "
                             f"{self.max_new_tokens}] (--generate_max_len), got {self.min_new_tokens}")
        if self.n < 1:
            raise ValueError(f"SamplingConfig.n (--n_samples_per_prompt) must be >= 1, got {self.n}")
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(f"SamplingConfig.max_len (--max_len) must be >= 2 or None, got {self.max_len}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    def new_tokens(self, prompt_len: int) -> int:
        """The most new tokens for a prompt of `prompt_len` tokens: max_new_tokens, capped by what `max_len` leaves
        (at least 1, as OpenRLHF's rollout; the prompt data drops prompts that leave no room)."""
        if self.max_len is None:
            return self.max_new_tokens
        return max(1, min(self.max_new_tokens, self.max_len - prompt_len))

    def min_tokens(self, prompt_len: int) -> int:
        """The fewest new tokens for a prompt of `prompt_len` tokens (--generate_min_len, capped by `new_tokens`)."""
        return min(self.min_new_tokens, self.new_tokens(prompt_len))

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (temperature 0)."""
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature the sampling log-probs are computed at (1.0 for greedy decoding)."""
        return 1.0 if self.greedy else self.temperature

    @property
    def truncation(self) -> SamplingTruncation | None:
        """The top-k / top-p truncation the engine applies to what it samples and reports (None: none, or greedy
        decoding, which vLLM takes from the whole distribution)."""
        from rlhfkit.models.logprobs import SamplingTruncation

        if self.greedy or (self.top_k == 0 and self.top_p == 1.0):
            return None
        return SamplingTruncation(top_k=self.top_k, top_p=self.top_p)

    def sample_seed(self, prompt_index: int, sample_index: int) -> int | None:
        """The seed of sample `sample_index` of prompt `prompt_index` (None when unseeded)."""
        if self.seed is None:
            return None
        return self.seed + prompt_index * self.n + sample_index

    def shifted(self, prompt_offset: int) -> SamplingConfig:
        """The config for a shard whose first prompt is prompt `prompt_offset` of the whole batch."""
        if self.seed is None or prompt_offset == 0:
            return self
        return dataclasses.replace(self, seed=self.seed + prompt_offset * self.n)


@dataclass
class RolloutSample:
    """One generated response.

    `response_logprobs[t]` is the sampling log-prob of `response_ids[t]` (see the module docstring).
    `finish_reason` is "stop" when the response ended on EOS or a stop token id (which is kept as the last
    response token), "length" when it hit `max_new_tokens`.
    `action_mask[t]` is False where `response_ids[t]` was written by an environment, not sampled (multi-turn
    agents, `rlhfkit.agents`): those tokens are context for the next turn, masked from the loss, and their
    `response_logprobs` are 0. None means every response token was sampled.
    """

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: FinishReason
    extra: dict[str, Any] = field(default_factory=dict)
    action_mask: list[bool] | None = None

    def __post_init__(self) -> None:
        if len(self.response_ids) != len(self.response_logprobs):
            raise ValueError(
                f"RolloutSample: {len(self.response_ids)} response ids but {len(self.response_logprobs)} log-probs"
            )
        if self.action_mask is not None and len(self.action_mask) != len(self.response_ids):
            raise ValueError(
                f"RolloutSample: {len(self.response_ids)} response ids but an action_mask of {len(self.action_mask)}"
            )


@dataclass(frozen=True)
class SyncStats:
    """What one weight sync moved and how long it took."""

    seconds: float
    bytes: int
    buckets: int
    tensors: int


@runtime_checkable
class RolloutEngine(Protocol):
    """What every rollout backend (vLLM, HF) offers, locally or as a Ray actor.

    Weight updates are streamed: `begin_weight_update`, then `load_weight_bucket` once per bucket (names are HF
    names, tensors are full/unsharded), then `finish_weight_update` (which also resets the prefix cache).
    Over a torch.distributed broadcast (`rlhfkit.rollout.weight_broadcast`) the engine first joins the sender's
    group (`weight_sync_info`, `join_weight_group`) and each bucket arrives by `receive_weight_bucket(meta)`.
    """

    # the liveness probe (health check before each step, probes while a call runs): True at once when alive. A Ray
    # actor class serves it beside a running call: @ray.method(concurrency_group=LIVENESS_GROUP), made an actor
    # class by engine_actor_class (rlhfkit.rollout.remote)
    def ping(self) -> bool: ...

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[RolloutSample]: ...

    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]: ...

    def begin_weight_update(self) -> None: ...

    def load_weight_bucket(self, named_tensors: NamedTensors) -> int: ...

    def finish_weight_update(self) -> None: ...

    def weight_sync_info(self) -> dict[str, Any]: ...

    def join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                          timeout_s: float) -> list[int]: ...

    def receive_weight_bucket(self, meta: list) -> int: ...

    def leave_weight_group(self) -> None: ...
