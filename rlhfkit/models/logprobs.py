"""Policy log-probabilities and entropy from logits, memory-frugal and in float32.

``log_softmax`` over a 49k-token vocabulary materialises a second ``[B, T, V]`` tensor; these helpers
instead compute ``logit[label] - logsumexp(logits)`` a few batch rows at a time, so the extra memory is
one chunk in float32 (bf16 logits are upcast chunk by chunk).
"""

from __future__ import annotations

import torch

from rlhfkit.models.positions import position_ids as default_position_ids

IGNORE_INDEX = -100
_CHUNK_ROWS = 4


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, *, chunk_rows: int = _CHUNK_ROWS) -> torch.Tensor:
    """``log softmax(logits)[..., label]`` as float32, shape ``labels.shape`` ([B, T]).

    Labels equal to ``-100`` (the usual ignore index) give 0.0 there; the caller's loss mask must exclude
    those positions. Any other label outside ``[0, V)`` is an error.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    vocab = logits.shape[-1]
    ignored = labels == IGNORE_INDEX
    bad = ~ignored & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        raise ValueError(f"labels outside [0, {vocab}) (other than {IGNORE_INDEX}): {labels[bad][:8].tolist()}")
    safe_labels = labels.masked_fill(ignored, 0)
    flat_logits = logits.reshape(-1, *logits.shape[-2:]) if logits.dim() > 2 else logits.unsqueeze(0)
    flat_labels = safe_labels.reshape(flat_logits.shape[:-1])
    rows = []
    for start in range(0, flat_logits.shape[0], chunk_rows):
        chunk = flat_logits[start:start + chunk_rows].float()
        picked = chunk.gather(-1, flat_labels[start:start + chunk_rows].unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(chunk, dim=-1))
    out = torch.cat(rows).reshape(labels.shape)
    return out.masked_fill(ignored, 0.0)


def entropy_from_logits(logits: torch.Tensor, *, chunk_rows: int = _CHUNK_ROWS) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim, float32, shape ``logits.shape[:-1]``.

    Uses ``H = logsumexp(z) - sum(softmax(z) * z)``, a few rows at a time.
    """
    flat = logits.reshape(-1, *logits.shape[-2:]) if logits.dim() > 2 else logits.unsqueeze(0)
    rows = []
    for start in range(0, flat.shape[0], chunk_rows):
        chunk = flat[start:start + chunk_rows].float()
        probs = torch.softmax(chunk, dim=-1)
        rows.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(-1))
    return torch.cat(rows).reshape(logits.shape[:-1])


def response_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log p(token_t | tokens_<t)`` for ``t >= 1``: shape ``[B, T-1]``, float32.

    Column ``j`` scores ``input_ids[:, j + 1]``. Logits are divided by ``temperature`` first (as OpenRLHF
    does) so the trainer's log-probs match the distribution vLLM sampled from. Position ids default to
    ``rlhfkit.models.positions.position_ids`` so left padding does not shift positions. Entries at padded positions are
    meaningless; mask them with ``attention_mask[:, 1:]`` (or an action mask). With ``return_entropy`` the
    entropy of the same tempered distribution ([B, T-1]) is returned too, from the same forward pass.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if position_ids is None:
        position_ids = default_position_ids(attention_mask)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = log_probs_from_logits(logits, input_ids[:, 1:])
    if return_entropy:
        return log_probs, entropy_from_logits(logits)
    return log_probs
