"""Policy log-probabilities and entropy from logits, memory-frugal and in float32.

``log_softmax`` over a 49k-token vocabulary materialises a second ``[B, T, V]`` tensor; these helpers
instead compute ``logit[label] - logsumexp(logits)`` a few rows at a time, so the extra memory is
one chunk in float32 (bf16 logits are upcast chunk by chunk). Without truncation the log-probs and entropies
go through `rlhfkit.models.fused_logprobs`, whose backward recomputes each chunk's softmax instead of keeping
``[rows, V]`` float32 tensors from the forward.

With a `SamplingTruncation` (``--top_k`` / ``--top_p``) the log-sum-exp runs over the tokens the sampler kept
instead of the whole vocabulary: the log-probs of the truncated, renormalised distribution vLLM samples from and
reports (``logprobs_mode="processed_logprobs"``), see `nucleus_log_norm` and docs/rollout.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlhfkit.models.fused_logprobs import token_log_probs_and_entropy
from rlhfkit.models.positions import position_ids as default_position_ids

IGNORE_INDEX = -100
_CHUNK_ROWS = 4
_NUCLEUS_CHUNK_ROWS = 64  # rows of [V] logits sorted at a time by nucleus_log_norm


@dataclass(frozen=True)
class SamplingTruncation:
    """The sampler's truncation of the tempered distribution: keep the `top_k` most likely tokens (0: all), then the
    smallest set of those whose probability reaches `top_p` (1.0: all), renormalised. vLLM's order: temperature,
    then top-k, then top-p (vllm/v1/sample/sampler.py, ops/topk_topp_sampler.py)."""

    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise ValueError(f"SamplingTruncation.top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingTruncation.top_p must be in (0, 1], got {self.top_p}")

    @property
    def active(self) -> bool:
        """Whether anything is cut (top_k > 0 or top_p < 1)."""
        return self.top_k > 0 or self.top_p < 1.0


def nucleus_log_norm(logits: torch.Tensor, truncation: SamplingTruncation | None,
                     *, chunk_rows: int = _NUCLEUS_CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """(``log sum_{v in N} exp(z_v)``, the cut ``c``) per row of tempered logits ``z`` ``[..., V]`` (float32), where
    N is the set the sampler keeps; without an active truncation N is the whole vocabulary and ``c = -inf``.

    N is computed as vLLM's `apply_top_k_top_p_pytorch` (its CPU path) computes it, in float32: sort ascending;
    top-k sets every value below the k-th largest to -inf (tokens tied with the k-th largest stay: N may hold more
    than k); top-p takes softmax of what is left, its cumulative sum in ascending order, and drops every position
    whose sum is <= 1 - top_p, always keeping the largest. ``c`` is the smallest kept value. Ties: which of several
    tokens tied at ``c`` vLLM keeps depends on its sort, but the normaliser only depends on how many (m - a, where
    m = |N| and a = #{z > c}); each token tied at ``c`` counts with weight (m - a) / #{z = c}, and a sampled token at
    ``c`` counts as kept (vLLM sampled it, so it kept it). Gradients flow to the logits of N; the set itself is
    taken without gradient (it is piecewise constant in the logits)."""
    if truncation is None or not truncation.active:
        return torch.logsumexp(logits, dim=-1), torch.full(logits.shape[:-1], -math.inf, device=logits.device)
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    norms, cuts = [], []
    one_minus_p = 1 - torch.tensor(truncation.top_p, dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_rows):
        z = flat[start:start + chunk_rows]
        with torch.no_grad():
            ranked = z.detach().sort(dim=-1).values                                 # ascending
            if truncation.top_k > 0:
                kth = ranked[:, max(vocab - truncation.top_k, 0)].unsqueeze(-1)
                ranked = ranked.masked_fill(ranked < kth, -math.inf)
            if truncation.top_p < 1.0:
                dropped = ranked.softmax(dim=-1).cumsum(dim=-1) <= one_minus_p
                dropped[:, -1] = False                                               # at least one token
                ranked = ranked.masked_fill(dropped, -math.inf)
            kept = (ranked > -math.inf).sum(dim=-1)                                   # m
            cut = ranked.gather(-1, (vocab - kept).unsqueeze(-1))                     # [n, 1], the m-th largest
            above, tied = (z > cut), (z == cut)
            tie_weight = (kept - above.sum(-1)).float() / tied.sum(-1).float()        # in (0, 1]
            log_weight = torch.where(above, 0.0, torch.where(tied, tie_weight.log().unsqueeze(-1), -math.inf))
        norms.append(torch.logsumexp(z + log_weight, dim=-1))
        cuts.append(cut.squeeze(-1))
    return torch.cat(norms).reshape(logits.shape[:-1]), torch.cat(cuts).reshape(logits.shape[:-1])


def with_sampled_token(log_norm: torch.Tensor, cut: torch.Tensor, picked: torch.Tensor) -> torch.Tensor:
    """The normaliser of a sampled token whose tempered logit is `picked`: `log_norm` when the token is in the kept
    set (``picked >= cut``), else ``logaddexp(log_norm, picked)``: a token the engine sampled was in the engine's
    set, so where the trainer's numerics (bf16, a moved policy) put it just outside, it joins the set and its
    log-prob stays finite."""
    outside = picked < cut
    if not bool(outside.any()):
        return log_norm
    return torch.where(outside, torch.logaddexp(log_norm, picked), log_norm)


def _check_labels(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The positions whose label is the ignore index; any other label outside ``[0, V)`` is an error."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    vocab = logits.shape[-1]
    ignored = labels == IGNORE_INDEX
    bad = ~ignored & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        raise ValueError(f"labels outside [0, {vocab}) (other than {IGNORE_INDEX}): {labels[bad][:8].tolist()}")
    return ignored


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, *, chunk_rows: int | None = None,
                          truncation: SamplingTruncation | None = None) -> torch.Tensor:
    """``log softmax(logits)[..., label]`` as float32, shape ``labels.shape`` ([B, T]); with an active `truncation`
    the log-prob of the truncated, renormalised distribution: ``z[label] - log sum_{v in N} exp(z_v)``
    (`nucleus_log_norm`, `with_sampled_token`).

    Labels equal to ``-100`` (the usual ignore index) give 0.0 there; the caller's loss mask must exclude
    those positions. Any other label outside ``[0, V)`` is an error. `chunk_rows`: positions computed at a time
    (default: a few MiB of float32 without truncation, 4 batch rows with it).
    """
    ignored = _check_labels(logits, labels)
    if truncation is None or not truncation.active:
        return token_log_probs_and_entropy(logits, labels, ignore_index=IGNORE_INDEX, chunk_rows=chunk_rows)[0]
    chunk_rows = chunk_rows or _CHUNK_ROWS
    safe_labels = labels.masked_fill(ignored, 0)
    flat_logits = logits.reshape(-1, *logits.shape[-2:]) if logits.dim() > 2 else logits.unsqueeze(0)
    flat_labels = safe_labels.reshape(flat_logits.shape[:-1])
    rows = []
    for start in range(0, flat_logits.shape[0], chunk_rows):
        chunk = flat_logits[start:start + chunk_rows].float()
        picked = chunk.gather(-1, flat_labels[start:start + chunk_rows].unsqueeze(-1)).squeeze(-1)
        if truncation is None or not truncation.active:
            rows.append(picked - torch.logsumexp(chunk, dim=-1))
        else:
            log_norm, cut = nucleus_log_norm(chunk, truncation)
            rows.append(picked - with_sampled_token(log_norm, cut, picked))
    out = torch.cat(rows).reshape(labels.shape)
    return out.masked_fill(ignored, 0.0)


def tempered_log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float, *,
                                   truncation: SamplingTruncation | None = None, with_entropy: bool = False,
                                   entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The training forward's per-token outputs from the model's logits ``[..., V]`` (any dtype, upcast a chunk at a
    time): ``log softmax(logits / temperature)[label]`` float32 of shape ``labels.shape`` (0.0 at ``-100`` labels;
    with an active `truncation` that of the truncated distribution, `log_probs_from_logits`), and with
    `with_entropy` the entropy of the whole tempered distribution at every position (ignored ones included):
    ``H = logsumexp(z) - sum_v softmax(z)_v z_v``, ``z = logits / temperature``, detached (a metric) unless
    `entropy_grad` (the entropy bonus of `--entropy_loss_coef` is differentiated through it)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _check_labels(logits, labels)
    if truncation is None or not truncation.active:
        log_probs, entropy = token_log_probs_and_entropy(logits, labels, temperature=temperature,
                                                         with_entropy=with_entropy, ignore_index=IGNORE_INDEX)
        return log_probs, (entropy.detach() if entropy is not None and not entropy_grad else entropy)
    log_probs = log_probs_from_logits(logits.float() / temperature, labels, truncation=truncation)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = token_log_probs_and_entropy(logits, torch.full_like(labels, IGNORE_INDEX),
                                                  temperature=temperature, with_entropy=True)[1]
    return log_probs, entropy


def shifted_log_probs_and_entropy(logits: torch.Tensor, sequences: torch.Tensor, width: int, temperature: float, *,
                                  truncation: SamplingTruncation | None = None, with_entropy: bool = False,
                                  entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`tempered_log_probs_and_entropy` of the last `width` tokens of `sequences` [B, T] from the logits of the
    last ``width + 1`` positions [B, width + 1, V] (``logits_to_keep=width + 1``; position j predicts token j + 1):
    ([B, width], [B, width] or None). The logits are read in place: the last position gets the ignore label instead
    of being sliced off (a slice would cost a copy and a zero-filled ``[B, width + 1, V]`` gradient)."""
    if logits.shape[1] != width + 1:
        raise ValueError(f"logits of {logits.shape[1]} positions for {width} tokens: expected width + 1")
    if truncation is not None and truncation.active:
        return tempered_log_probs_and_entropy(logits[:, :-1], sequences[:, sequences.shape[1] - width:], temperature,
                                              truncation=truncation, with_entropy=with_entropy,
                                              entropy_grad=entropy_grad)
    labels = torch.nn.functional.pad(sequences[:, sequences.shape[1] - width:], (0, 1), value=IGNORE_INDEX)
    log_probs, entropy = tempered_log_probs_and_entropy(logits, labels, temperature, with_entropy=with_entropy,
                                                        entropy_grad=entropy_grad)
    return log_probs[:, :-1], (entropy[:, :-1] if entropy is not None else None)


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
    truncation: SamplingTruncation | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log p(token_t | tokens_<t)`` for ``t >= 1``: shape ``[B, T-1]``, float32.

    Column ``j`` scores ``input_ids[:, j + 1]``. Logits are divided by ``temperature`` first (as OpenRLHF
    does) so the trainer's log-probs match the distribution vLLM sampled from. Position ids default to
    ``rlhfkit.models.positions.position_ids`` so left padding does not shift positions. Entries at padded positions are
    meaningless; mask them with ``attention_mask[:, 1:]`` (or an action mask). With ``return_entropy`` the
    entropy of the same tempered distribution ([B, T-1]) is returned too, from the same forward pass. With an
    active `truncation` (applied after the temperature, as vLLM does) the log-probs are those of the truncated,
    renormalised distribution (`log_probs_from_logits`); the entropy stays that of the whole tempered distribution.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if position_ids is None:
        position_ids = default_position_ids(attention_mask)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = log_probs_from_logits(logits, input_ids[:, 1:], truncation=truncation)
    if return_entropy:
        return log_probs, entropy_from_logits(logits)
    return log_probs
