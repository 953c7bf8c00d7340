"""Batches: right-padded or packed, dynamic batching by token budget, and the model's forward kwargs.

Padded batch (``collate_padded``): ``input_ids``, ``attention_mask``, ``loss_mask``, ``position_ids`` ``[B, T]`` and
``seq_lens`` ``[B]``. Packed batch (``collate_packed``): one row ``[1, total]`` of ``input_ids``, ``loss_mask`` and
``position_ids`` (restarting at 0 for every sample), plus ``seq_lens`` ``[n]`` and ``cu_seqlens`` ``[n + 1]`` (int32,
cumulative offsets as flash-attention's varlen kernels take them). A packed batch has no ``attention_mask``.

In both, the first token of every sample has ``loss_mask`` 0: nothing predicts it, and in a packed row the token
before it belongs to another sample.

``model_inputs(batch)`` gives ``model(**kwargs)``. For a packed batch it passes ``position_ids`` with no attention
mask and ``use_cache=False``: transformers (>= 4.5x, checked on 5.x for ``sdpa`` and ``eager``) then builds a
block-diagonal causal mask from the position restarts. With a cache (``use_cache`` defaults to True) it does *not*
detect packing, which is why ``use_cache=False`` is always passed. ``explicit_mask=True`` passes a 4D additive
block-diagonal causal mask instead, for attention implementations that do not detect packing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

ID_KEYS = ("input_ids", "chosen_ids", "rejected_ids", "prompt_ids")


def _ids_and_mask(sample: dict, keys: tuple[str, str | None]) -> tuple[list[int], list[int]]:
    ids = list(sample[keys[0]])
    mask = list(sample[keys[1]]) if keys[1] and keys[1] in sample else [1] * len(ids)
    if len(mask) != len(ids):
        raise ValueError(f"sample has {len(ids)} {keys[0]} but {len(mask)} {keys[1]}")
    if ids:
        mask[0] = 0
    return ids, mask


def collate_padded(samples: Sequence[dict], pad_token_id: int,
                   keys: tuple[str, str | None] = ("input_ids", "loss_mask")) -> dict[str, torch.Tensor]:
    """Right-pad samples into ``[B, T]`` tensors. ``keys`` = (token id field, loss mask field or None for all-ones)."""
    if not samples:
        raise ValueError("collate_padded: no samples")
    rows = [_ids_and_mask(s, keys) for s in samples]
    width = max(len(ids) for ids, _ in rows)
    out = {"input_ids": torch.full((len(rows), width), pad_token_id, dtype=torch.long),
           "attention_mask": torch.zeros((len(rows), width), dtype=torch.long),
           "loss_mask": torch.zeros((len(rows), width), dtype=torch.long),
           "position_ids": torch.zeros((len(rows), width), dtype=torch.long)}
    for b, (ids, mask) in enumerate(rows):
        n = len(ids)
        out["input_ids"][b, :n] = torch.tensor(ids, dtype=torch.long)
        out["attention_mask"][b, :n] = 1
        out["loss_mask"][b, :n] = torch.tensor(mask, dtype=torch.long)
        out["position_ids"][b, :n] = torch.arange(n)
    out["seq_lens"] = torch.tensor([len(ids) for ids, _ in rows], dtype=torch.long)
    return out


def collate_packed(samples: Sequence[dict], pad_token_id: int | None = None,
                   keys: tuple[str, str | None] = ("input_ids", "loss_mask")) -> dict[str, torch.Tensor]:
    """Concatenate samples into one ``[1, total]`` row with per-sample ``position_ids``, ``seq_lens`` and
    ``cu_seqlens``. ``pad_token_id`` is not needed (a packed row has no padding); it is accepted so that both
    collate functions can be called the same way."""
    if not samples:
        raise ValueError("collate_packed: no samples")
    rows = [_ids_and_mask(s, keys) for s in samples]
    lens = [len(ids) for ids, _ in rows]
    if 0 in lens:
        raise ValueError("collate_packed: empty sample")
    return {"input_ids": torch.tensor([i for ids, _ in rows for i in ids], dtype=torch.long)[None],
            "loss_mask": torch.tensor([m for _, mask in rows for m in mask], dtype=torch.long)[None],
            "position_ids": torch.cat([torch.arange(n) for n in lens])[None],
            "seq_lens": torch.tensor(lens, dtype=torch.long),
            "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)}


def is_packed(batch: dict[str, torch.Tensor]) -> bool:
    """True for a batch made by `collate_packed`."""
    return "cu_seqlens" in batch


def model_inputs(batch: dict[str, torch.Tensor], *, model: torch.nn.Module | None = None,
                 explicit_mask: bool = False, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Keyword arguments for ``model(**kwargs)`` so a packed forward equals the unpacked one (see module docstring).

    A packed batch for a `model` on `PACKED_SDPA` (`use_packed_attention`, done by the trainers' model loaders
    under --packing_samples) carries its block layout (`rlhfkit.models.packed_attention.sample_blocks`) and an
    all-ones mask, so no ``[L, L]`` mask is built. ``dtype`` is the dtype of the 4D mask with ``explicit_mask``
    (use the model's compute dtype).
    """
    from rlhfkit.models.packed_attention import sample_blocks, uses_packed_attention

    kwargs: dict[str, Any] = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"],
                              "use_cache": False}
    if not is_packed(batch):
        kwargs["attention_mask"] = batch["attention_mask"]
    elif model is not None and uses_packed_attention(model):
        kwargs["attention_mask"] = torch.ones_like(batch["input_ids"])
        kwargs["packed_attention"] = sample_blocks(batch["seq_lens"].tolist()).to(batch["input_ids"].device)
    elif explicit_mask:
        kwargs["attention_mask"] = block_causal_mask(batch["seq_lens"], dtype)
    return kwargs


def block_causal_mask(seq_lens: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[1, 1, T, T]`` additive mask: 0 where query i may attend key j (same sample, j <= i), dtype-min elsewhere."""
    from rlhfkit.models.packed_attention import same_sample_causal

    allowed = same_sample_causal(torch.repeat_interleave(torch.arange(len(seq_lens)), seq_lens.long()))
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def unpack(values: torch.Tensor, seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """Split a packed ``[1, total, ...]`` tensor (e.g. logits) back into one tensor per sample."""
    return list(values[0].split(seq_lens.tolist(), dim=0))


def sample_num_tokens(sample: dict) -> int:
    """Tokens a sample occupies in a batch: the sum of the lengths of its token-id fields."""
    return sum(len(sample[k]) for k in ID_KEYS if k in sample)


def split_by_token_budget(samples: Sequence[dict], max_tokens: int,
                          length_fn: Callable[[dict], int] = sample_num_tokens) -> list[list[dict]]:
    """Dynamic batching: consecutive samples, greedily, while a batch's total tokens stay <= ``max_tokens``.

    Order is preserved; a sample longer than ``max_tokens`` on its own gets a batch of its own (never dropped).
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    batches: list[list[dict]] = []
    used = 0
    for sample in samples:
        n = length_fn(sample)
        if batches and used + n <= max_tokens:
            batches[-1].append(sample)
            used += n
        else:
            batches.append([sample])
            used = n
    return batches


def pack_samples(samples: Sequence[dict], max_tokens: int,
                 length_fn: Callable[[dict], int] = sample_num_tokens) -> list[list[dict]]:
    """Group samples into packed rows of at most ``max_tokens`` tokens (first-fit decreasing; deterministic).

    Rows are ordered by the position of their first sample, and samples keep their original order within a row;
    a sample longer than ``max_tokens`` gets a row of its own (never dropped). Collate each row with
    `collate_packed`.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = [length_fn(s) for s in samples]
    order = sorted(range(len(samples)), key=lambda i: -lengths[i])  # stable: ties keep input order
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        slot = next((r for r, room in enumerate(free) if lengths[i] <= room), None)
        if slot is None:
            rows.append([i])
            free.append(max_tokens - lengths[i])
        else:
            rows[slot].append(i)
            free[slot] -= lengths[i]
    rows = sorted((sorted(r) for r in rows), key=lambda r: r[0])
    return [[samples[i] for i in r] for r in rows]
