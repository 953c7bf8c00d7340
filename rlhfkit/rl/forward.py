"""How a `ModelWorker` runs its model over a micro-batch: one strategy per layout, chosen once when the worker loads
its model (`forward_strategy`), then called for every forward (log-probs, values, rewards, the weight-sync probe).

- `PaddedForward`: the Experience layout as it is (left-padded prompt + right-padded response rows).
- `VisionForward`: padded rows plus their images (a vision-language model, `--image_key`; rl/vision_batch.py).
- `PackedForward`: `--packing_samples`, one packed row per micro-batch, each shared prompt once (rl/packing.py).
- `RingPaddedForward` / `RingPackedForward`: `--ring_attn_size N` (actor, reference, critic): every sequence split
  over a ring group of N ranks, padded or packed (rl/ring.py).

Each strategy is exactly the path the worker took per call before (#30: the choice is made once, not per call); the
layouts' log-probs, values and gradients agree with each other (tests/rl/test_packing.py, test_ring_ppo.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhfkit.config.commands import PPOConfig
from rlhfkit.models.context_parallel import RingGroup
from rlhfkit.models.logprobs import SamplingTruncation, log_probs_from_logits, shifted_log_probs_and_entropy
from rlhfkit.models.packed_attention import use_packed_attention
from rlhfkit.models.positions import position_ids
from rlhfkit.rl.experience import sort_rows_by_length, sort_rows_by_prompt
from rlhfkit.rl.packing import (
    PackedRollout,
    pack_rollout,
    pack_rows,
    pack_scored_rows,
    packed_response_log_probs,
    packed_scalar_outputs,
)
from rlhfkit.rl.ring import ring_packed_log_probs, ring_response_log_probs
from rlhfkit.rl.vision_batch import pixel_inputs

Batch = dict[str, torch.Tensor]
LogProbs = tuple[torch.Tensor, torch.Tensor | None]  # (log-probs [B, W], entropy [B, W] or None)


@dataclass(frozen=True)
class PaddedForward:
    """Padded rows. `temperature`: the sampling temperature applied to the logits; `truncation`: --top_k / --top_p
    log-probs (`rlhfkit.rl.worker.logprob_truncation`); `mask_dtype`: the compute dtype, which a packed row's additive
    mask takes (sdpa takes no other)."""

    temperature: float
    truncation: SamplingTruncation | None
    mask_dtype: torch.dtype

    name = "padded"

    def order(self, shard: Batch) -> Batch:
        """A training shard's rows in micro-batch order: sorted by length, so `trim_padding` cuts more."""
        return sort_rows_by_length(shard)

    def action_log_probs(self, model: torch.nn.Module, mb: Batch, with_entropy: bool = False,
                         entropy_grad: bool = False) -> LogProbs:
        """log softmax(z_t / temperature)[y_{t+1}] of each response token, [B, W] float32, and with `with_entropy` the
        entropy of the same distributions (detached, unless `entropy_grad`: --entropy_loss_coef's bonus)."""
        seq, mask = mb["sequences"], mb["attention_mask"]
        width = mb["action_mask"].shape[1]
        # Only the positions that predict response tokens need the (vocab-sized) LM head.
        logits = model(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                       logits_to_keep=width + 1, **self.model_inputs(mb)).logits
        return shifted_log_probs_and_entropy(logits, seq, width, self.temperature, truncation=self.truncation,
                                             with_entropy=with_entropy, entropy_grad=entropy_grad)

    def model_inputs(self, mb: Batch) -> Batch:
        """Inputs the model takes beside the token ids (none for a text model)."""
        return {}

    def prepare(self, model: torch.nn.Module) -> None:
        """Set up a freshly loaded model for this layout (once, before it is wrapped or sharded): nothing here."""

    def values(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        """A `score`-head model's value of the state before each response token, [B, W] float32."""
        from rlhfkit.models.loading import scalar_outputs

        width = mb["action_mask"].shape[1]
        _, token_values = scalar_outputs(model, mb["sequences"], mb["attention_mask"])
        # The value of the state before response token t is read at the position that predicts it.
        return token_values[:, -width - 1:-1].float()

    def rewards(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        """A reward model's `score` head at the last real token of each row (any padding side), [B]."""
        from rlhfkit.models.loading import scalar_outputs

        return scalar_outputs(model, mb["sequences"], mb["attention_mask"])[0]

    def probe_log_probs(self, model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]],
                        device: torch.device) -> list[list[float]]:
        """log softmax(logits)[token] at temperature 1, untruncated, of each response token after its prompt: what the
        engines' `score` computes (the weight-sync check, `rlhfkit.rl.sync_check`). Here one sequence at a time."""
        scores = []
        for prompt_ids, response_ids in zip(prompts, responses, strict=True):
            seq = torch.tensor([list(prompt_ids) + list(response_ids)], device=device)
            scores.append(self.probe_row(model, seq, torch.ones_like(seq), len(response_ids)).cpu().tolist())
        return scores

    def probe_row(self, model: torch.nn.Module, seq: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
        """`probe_log_probs` of the last `width` tokens of the one row `seq` [1, T]."""
        logits = model(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                       logits_to_keep=width + 1).logits
        return log_probs_from_logits(logits[:, :-1].float(), seq[:, -width:])[0]


@dataclass(frozen=True)
class VisionForward(PaddedForward):
    """Padded rows of a vision-language model: the rows' images go with the token ids (`pixel_inputs`)."""

    name = "vision"

    def model_inputs(self, mb: Batch) -> Batch:
        return pixel_inputs(mb)


@dataclass(frozen=True)
class PackedForward(PaddedForward):
    """--packing_samples: one packed row per micro-batch, each distinct prompt once (rl/packing.py)."""

    name = "packed"

    def order(self, shard: Batch) -> Batch:
        """Rows grouped by prompt: a prompt's samples land in one micro-batch, so its tokens are computed once."""
        return sort_rows_by_prompt(shard)

    def prepare(self, model: torch.nn.Module) -> None:
        """An SDPA model attends packed rows block by block, without an L x L mask (models/packed_attention.py)."""
        use_packed_attention(model)

    def pack(self, mb: Batch) -> PackedRollout:
        return pack_rollout(mb["sequences"], mb["attention_mask"], mb["action_mask"].shape[1])

    def action_log_probs(self, model: torch.nn.Module, mb: Batch, with_entropy: bool = False,
                         entropy_grad: bool = False) -> LogProbs:
        return packed_response_log_probs(model, self.pack(mb), self.temperature, mask_dtype=self.mask_dtype,
                                         with_entropy=with_entropy, truncation=self.truncation,
                                         entropy_grad=entropy_grad)

    def values(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        return packed_scalar_outputs(model, self.pack(mb), mask_dtype=self.mask_dtype)[1]

    def rewards(self, model: torch.nn.Module, mb: Batch) -> torch.Tensor:
        packed = pack_scored_rows(mb["sequences"], mb["attention_mask"], mb["prompt_lengths"])
        return packed_scalar_outputs(model, packed, mask_dtype=self.mask_dtype)[0]

    def probe_log_probs(self, model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]],
                        device: torch.device) -> list[list[float]]:
        """Every probe sequence in one packed row (each prompt once): one forward instead of one per sequence."""
        packed = pack_rows([list(p) for p in prompts], [list(r) for r in responses],
                           max(1, max(map(len, responses))), device)
        log_probs, _ = packed_response_log_probs(model, packed, 1.0, mask_dtype=self.mask_dtype)
        return [row[:len(r)].cpu().tolist() for row, r in zip(log_probs, responses, strict=True)]


@dataclass(frozen=True)
class RingPaddedForward(PaddedForward):
    """--ring_attn_size: padded rows, each split over the ring group `ring` (rl/ring.py); values go through the value
    head's sequence gather inside the model."""

    ring: RingGroup | None = None  # always given (forward_strategy); a default only because the fields above have none

    name = "ring"

    def action_log_probs(self, model: torch.nn.Module, mb: Batch, with_entropy: bool = False,
                         entropy_grad: bool = False) -> LogProbs:
        return ring_response_log_probs(model, mb["sequences"], mb["attention_mask"], mb["action_mask"].shape[1],
                                       self.temperature, _group(self.ring), with_entropy, truncation=self.truncation,
                                       entropy_grad=entropy_grad)

    def probe_row(self, model: torch.nn.Module, seq: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
        return ring_response_log_probs(model, seq, mask, width, 1.0, _group(self.ring))[0][0]


@dataclass(frozen=True)
class RingPackedForward(PackedForward):
    """--ring_attn_size with --packing_samples: the packed row split over the ring group `ring` (rl/ring.py); the
    probe's single rows are split padded, as `RingPaddedForward` does."""

    ring: RingGroup | None = None  # always given (forward_strategy)

    name = "ring-packed"

    def prepare(self, model: torch.nn.Module) -> None:
        """Nothing: the ring's own attention (`use_ring_attention`) takes the packed row's mask, split by rank."""

    def action_log_probs(self, model: torch.nn.Module, mb: Batch, with_entropy: bool = False,
                         entropy_grad: bool = False) -> LogProbs:
        return ring_packed_log_probs(model, self.pack(mb), self.temperature, _group(self.ring), with_entropy,
                                     truncation=self.truncation, entropy_grad=entropy_grad)

    def probe_log_probs(self, model: torch.nn.Module, prompts: list[list[int]], responses: list[list[int]],
                        device: torch.device) -> list[list[float]]:
        return PaddedForward.probe_log_probs(self, model, prompts, responses, device)  # one split row at a time

    def probe_row(self, model: torch.nn.Module, seq: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
        return ring_response_log_probs(model, seq, mask, width, 1.0, _group(self.ring))[0][0]


def _group(ring: RingGroup | None) -> RingGroup:
    if ring is None:
        raise ValueError("a ring forward strategy needs its ring group (forward_strategy passes it)")
    return ring


ForwardStrategy = PaddedForward  # the interface every strategy has: the padded one is the base


def forward_strategy(cfg: PPOConfig, *, ring: RingGroup | None, vision: bool, truncation: SamplingTruncation | None,
                     mask_dtype: torch.dtype) -> ForwardStrategy:
    """The one forward strategy of a worker: `ring` (its ring group, --ring_attn_size; None for a reward model or
    ring size 1), `vision` (it loaded a vision-language model), --packing_samples and --temperature from `cfg`.
    (Images go with neither packing nor ring attention: `rlhfkit.rl.vision_batch.validate_vision` refuses both.)"""
    t, cut, dtype = cfg.temperature, truncation, mask_dtype
    if ring is not None:
        return RingPackedForward(t, cut, dtype, ring) if cfg.packing_samples else RingPaddedForward(t, cut, dtype, ring)
    if cfg.packing_samples:
        return PackedForward(t, cut, dtype)
    return VisionForward(t, cut, dtype) if vision else PaddedForward(t, cut, dtype)
