"""The Experience record: one typed batch that carries a rollout through the pipeline.

Layout (OpenRLHF's): `sequences` = left-padded prompt (P columns) + right-padded response (R columns).
Token-level tensors over the response are `[B, R]` and aligned with `action_mask`.
Rows are prompt-major: the n samples of a prompt are consecutive (the advantage estimators rely on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass
class Experience:
    sequences: torch.Tensor                    # [B, P + R] long
    attention_mask: torch.Tensor               # [B, P + R] long (0 on padding)
    action_mask: torch.Tensor                  # [B, R] bool (True on generated tokens)
    rollout_log_probs: torch.Tensor            # [B, R] sampling log-probs reported by the rollout engine
    prompt_index: torch.Tensor                 # [B] long: which prompt of the step produced the row
    old_log_probs: torch.Tensor | None = None  # [B, R] trainer log-probs before the update (PPO ratio denominator)
    ref_log_probs: torch.Tensor | None = None  # [B, R] reference model
    values: torch.Tensor | None = None         # [B, R] critic
    kl: torch.Tensor | None = None             # [B, R] per-token KL estimate
    rewards: torch.Tensor | None = None        # [B] sequence reward used for training
    scores: torch.Tensor | None = None         # [B] task score (filtering, pass@k)
    advantages: torch.Tensor | None = None     # [B, R]
    returns: torch.Tensor | None = None        # [B, R]
    pixel_values: torch.Tensor | None = None   # [B, N, C, H, W] images of the row's prompt (rl/vision_batch.py)
    pixel_attention_mask: torch.Tensor | None = None  # [B, N, H, W]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.sequences.shape[0]

    @property
    def response_length(self) -> torch.Tensor:
        return self.action_mask.sum(-1)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor field that is set (for slicing and shipping to workers)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value
        return out

    def select(self, rows: list[int] | torch.Tensor) -> Experience:
        """A new Experience with only `rows` (info is shared)."""
        index = torch.as_tensor(rows, dtype=torch.long)
        return Experience(**{k: v[index] for k, v in self.tensors().items()}, info=self.info)


def build_experience(prompt_ids: list[list[int]], response_ids: list[list[int]], rollout_log_probs: list[list[float]],
                     prompt_index: list[int], pad_token_id: int,
                     action_masks: list[list[bool] | None] | None = None) -> Experience:
    """Assemble left-padded prompts + right-padded responses into an Experience.

    `action_masks[i]` (optional, one per row; None = all True) marks the sampled response tokens; environment
    tokens of a multi-turn response are False there, so they are attended to but never trained on.
    """
    if not prompt_ids:
        raise ValueError("build_experience got an empty rollout")
    width_p = max(len(p) for p in prompt_ids)
    width_r = max(1, max(len(r) for r in response_ids))
    rows = len(prompt_ids)
    sequences = torch.full((rows, width_p + width_r), pad_token_id, dtype=torch.long)
    attention = torch.zeros((rows, width_p + width_r), dtype=torch.long)
    action = torch.zeros((rows, width_r), dtype=torch.bool)
    logps = torch.zeros((rows, width_r), dtype=torch.float32)
    for i, (prompt, response, logp) in enumerate(zip(prompt_ids, response_ids, rollout_log_probs)):
        if len(logp) != len(response):
            raise ValueError(f"row {i}: {len(response)} response tokens but {len(logp)} rollout log-probs")
        sequences[i, width_p - len(prompt):width_p] = torch.tensor(prompt, dtype=torch.long)
        attention[i, width_p - len(prompt):width_p] = 1
        if response:
            sequences[i, width_p:width_p + len(response)] = torch.tensor(response, dtype=torch.long)
            attention[i, width_p:width_p + len(response)] = 1
            mask = action_masks[i] if action_masks is not None and action_masks[i] is not None else None
            action[i, :len(response)] = True if mask is None else torch.tensor(mask, dtype=torch.bool)
            logps[i, :len(response)] = torch.tensor(logp, dtype=torch.float32)
    return Experience(sequences=sequences, attention_mask=attention, action_mask=action, rollout_log_probs=logps,
                      prompt_index=torch.tensor(prompt_index, dtype=torch.long))


def trim_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the columns that are padding in every row: leading prompt padding, trailing response padding. Tensors of
    the sequence width ([B, P+R]) and of the response width ([B, R], `action_mask`'s) are cut alike; the rest
    ([B] rows) is kept. Positions come from the attention mask, so the model sees the same inputs per row: a
    micro-batch of short rows no longer pays for the longest row of the whole rollout."""
    mask = batch["attention_mask"]
    seq_width, resp_width = mask.shape[1], batch["action_mask"].shape[1]
    prompt_width = seq_width - resp_width
    real = mask.bool()
    first = int(real.float().argmax(-1).min()) if real.any() else 0
    left = min(first, prompt_width - 1)                      # keep at least one prompt column
    used = int(real[:, prompt_width:].sum(-1).max()) if resp_width else 0
    keep = max(1, used)
    out = {}
    for key, value in batch.items():
        if key.startswith("pixel_"):  # per-row images ([B, N, ...]): nothing to cut
            out[key] = value
        elif value.dim() >= 2 and value.shape[1] == seq_width:
            out[key] = value[:, left:prompt_width + keep]
        elif value.dim() >= 2 and value.shape[1] == resp_width:
            out[key] = value[:, :keep]
        else:
            out[key] = value
    return out


def sort_rows_by_length(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows ordered by real-token count (stable), so consecutive micro-batches hold rows of similar length and
    `trim_padding` cuts more. For sums over rows only (a training step); outputs per row would need the order back."""
    order = torch.argsort(batch["attention_mask"].sum(-1), stable=True)
    return {k: v[order] for k, v in batch.items()}


def sort_rows_by_prompt(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rows ordered by `prompt_index` (stable), so the samples of a prompt share micro-batches (packed, the
    prompt is then computed once). For sums over rows only, like `sort_rows_by_length`."""
    order = torch.argsort(batch["prompt_index"], stable=True)
    return {k: v[order] for k, v in batch.items()}


def split_rows(num_rows: int, parts: int) -> list[list[int]]:
    """Contiguous, as-even-as-possible row ranges for `parts` ranks."""
    base, extra = divmod(num_rows, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out
