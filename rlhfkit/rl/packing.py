"""Padding-free RL micro-batches that compute each shared prompt once (`rlhfkit ppo --packing_samples`).

A micro-batch of the Experience layout (left-padded prompt + right-padded response, one row per sample) becomes one
packed row: for each distinct prompt, its tokens once, then the tokens of every response to it. A 4D additive mask
lets a response token attend to its own prompt and its own earlier tokens only; positions count from 0 in each
prompt and continue from the prompt's length in each of its responses. Every response token therefore sees exactly
the context it had in its padded row, so the log-probs equal the padded forward's (up to float summation order;
tests/rl/test_packing.py checks values and gradients). The first token of a response is predicted by the last
token of its prompt, which every response of that prompt shares.

Cost: the forward and backward run over ``sum_prompts p + sum_rows l`` tokens instead of ``B x (max p + max l)``
(padding included): with n samples per prompt (GRPO's groups) the prompt is computed once instead of n times, and
no padding is computed at all. Attention: a model on SDPA attends the packed row block by block
(`rlhfkit.models.packed_attention`: each sample's prompt + response as a causal row, or each prompt group under its
own mask, whichever the block sizes make cheaper), never over an ``L x L`` mask; a model on another attention
implementation gets the dense ``[1, 1, L, L]`` mask (`PackedRollout.attention_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhfkit.algorithms.entropy import entropy_from_logits
from rlhfkit.models.fused_logprobs import pair_log_probs_and_entropy
from rlhfkit.models.logprobs import SamplingTruncation, nucleus_log_norm, with_sampled_token
from rlhfkit.models.packed_attention import (
    PackedAttention,
    causal_rows,
    causal_rows_cost,
    cheapest_layout,
    masked_blocks,
    masked_blocks_cost,
    shared_prompts,
    shared_prompts_cost,
    uses_packed_attention,
)


@dataclass
class PackedRollout:
    """One packed row and how to read the response log-probs back out of its logits.

    input_ids, position_ids: [1, L]; group, segment: [L] (which prompt; -1 on prompt tokens, else the row);
    keep: [K] the positions whose logits are needed; pick: [B, W] index into `keep` of the position that predicts
    response token t of row r; labels: [B, W]; valid: [B, W] (t < that row's response length); last: [B] the
    packed position of each row's last real token (a reward model's score is read there); blocks: how a model on
    `PACKED_SDPA` attends the row (`rlhfkit.models.packed_attention`).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    group: torch.Tensor
    segment: torch.Tensor
    keep: torch.Tensor
    pick: torch.Tensor
    labels: torch.Tensor
    valid: torch.Tensor
    last: torch.Tensor
    blocks: PackedAttention

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    def model_inputs(self, model: torch.nn.Module, mask_dtype: torch.dtype) -> dict[str, object]:
        """Keywords for `model(...)` on this row: the tokens, their positions, and how to attend: the block layout
        for a model on `PACKED_SDPA` (an all-ones 2D mask beside it, so transformers builds no mask), else the dense
        4D mask in `mask_dtype`."""
        inputs: dict[str, object] = {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}
        if uses_packed_attention(model):
            inputs["attention_mask"] = torch.ones_like(self.input_ids)
            inputs["packed_attention"] = self.blocks
        else:
            inputs["attention_mask"] = self.attention_mask(mask_dtype)
        return inputs

    def attention_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, L, L] additive: 0 where query i may attend key j (`allowed`), dtype-min elsewhere."""
        allowed = allowed_keys(self.group, self.segment)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def allowed_keys(group: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """[L, L] bool over packed positions (or any subset of them, in packed order): query i may attend key j when both
    belong to the same prompt, j <= i, and key j is in the prompt or in the query's own response."""
    same_prompt = group[:, None] == group[None, :]
    visible = (segment[None, :] == -1) | (segment[None, :] == segment[:, None])
    causal = torch.ones(len(group), len(group), dtype=torch.bool, device=group.device).tril()
    return same_prompt & visible & causal


def allowed_between(group: torch.Tensor, segment: torch.Tensor, queries: torch.Tensor,
                    keys: torch.Tensor) -> torch.Tensor:
    """[q, k] bool: `allowed_keys` for query positions `queries` and key positions `keys` (packed positions, any
    order): the same prompt, key j at or before query i, and key j in the prompt or in the query's own response."""
    same_prompt = group[queries][:, None] == group[keys][None, :]
    visible = (segment[keys][None, :] == -1) | (segment[keys][None, :] == segment[queries][:, None])
    return same_prompt & visible & (keys[None, :] <= queries[:, None])


def attention_blocks(prompt_positions: list[range], row_group: list[int], row_positions: list[range],
                     group: torch.Tensor, segment: torch.Tensor) -> PackedAttention:
    """The cheapest (`cheapest_layout`, from the sizes alone) of three exact block layouts of a packed row: causal
    rows (each sample's prompt + response), masked blocks (each prompt group under its mask), or shared prompts
    (each prompt causally, each response against its prompt and itself)."""
    rows = [list(prompt_positions[g]) + list(r) for g, r in zip(row_group, row_positions)]
    groups = [list(p) for p in prompt_positions]
    for g, r in zip(row_group, row_positions):
        groups[g] += list(r)
    blocks = [sorted(g) for g in groups]
    length = len(group)
    responses = [(g, r) for g, r in zip(row_group, row_positions) if len(r)]
    prompt_width = max(map(len, prompt_positions))
    query_width = max((len(r) for _, r in responses), default=0)
    key_width = max((len(prompt_positions[g]) + len(r) for g, r in responses), default=0)
    return cheapest_layout([
        (causal_rows_cost(len(rows), max(map(len, rows))), lambda: causal_rows(rows, length)),
        (masked_blocks_cost(len(blocks), max(map(len, blocks))),
         lambda: masked_blocks(blocks, lambda positions: allowed_keys(group[positions], segment[positions]), length)),
        (shared_prompts_cost(len(prompt_positions), prompt_width, len(responses), query_width, key_width),
         lambda: shared_prompts(prompt_positions, responses,
                                lambda q, k: allowed_between(group, segment, q, k), length))])


def pack_rollout(sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int) -> PackedRollout:
    """Pack rows of `sequences` ([B, P + W]: prompt left-padded in the first P columns, response right-padded in the
    last W) into one row, each distinct prompt once (see the module docstring)."""
    prompt_width = sequences.shape[1] - response_width
    seq, real = sequences.cpu(), attention_mask.cpu().bool()
    prompts, responses = [], []
    for r in range(seq.shape[0]):
        n = int(real[r, prompt_width:].sum())
        if not bool(real[r, prompt_width:prompt_width + n].all()):
            raise ValueError(f"row {r}: packing needs a right-padded response (its attention mask has a hole)")
        prompts.append(seq[r, :prompt_width][real[r, :prompt_width]].tolist())
        responses.append(seq[r, prompt_width:prompt_width + n].tolist())
    return pack_rows(prompts, responses, response_width, sequences.device)


def pack_scored_rows(sequences: torch.Tensor, attention_mask: torch.Tensor,
                     prompt_lengths: torch.Tensor) -> PackedRollout:
    """Pack left-padded prompt + response rows (a reward model's batch, `reward_batch`) given each row's prompt
    length, so the samples of a prompt share it."""
    seq, real = sequences.cpu(), attention_mask.cpu().bool()
    prompts, responses = [], []
    for r in range(seq.shape[0]):
        row = seq[r][real[r]].tolist()
        cut = int(prompt_lengths[r])
        prompts.append(row[:cut])
        responses.append(row[cut:])
    return pack_rows(prompts, responses, max(1, max(map(len, responses))), sequences.device)


def pack_rows(prompts: list[list[int]], responses: list[list[int]], response_width: int,
              device: torch.device | str = "cpu") -> PackedRollout:
    """One packed row from each sample's prompt and response tokens; equal prompts are laid out once."""
    rows = len(prompts)
    tokens: list[int] = []
    positions: list[int] = []
    group: list[int] = []
    segment: list[int] = []
    laid_out: dict[tuple[int, ...], tuple[int, int]] = {}  # prompt tokens -> (group, packed index of its last token)
    prompt_positions: list[range] = []  # each group's prompt, packed positions
    row_group: list[int] = []
    row_positions: list[range] = []  # each row's response, packed positions
    pick = torch.zeros(rows, response_width, dtype=torch.long)
    labels = torch.zeros(rows, response_width, dtype=torch.long)
    valid = torch.zeros(rows, response_width, dtype=torch.bool)
    last_token = torch.zeros(rows, dtype=torch.long)
    for r, (prompt, response) in enumerate(zip(prompts, responses)):
        if not prompt:
            raise ValueError(f"row {r}: packing needs a non-empty prompt")
        key = tuple(prompt)
        if key not in laid_out:
            tokens += prompt
            positions += range(len(prompt))
            group += [len(laid_out)] * len(prompt)
            segment += [-1] * len(prompt)
            laid_out[key] = (len(laid_out), len(tokens) - 1)
            prompt_positions.append(range(len(tokens) - len(prompt), len(tokens)))
        g, last = laid_out[key]
        start, n = len(tokens), len(response)
        row_group.append(g)
        row_positions.append(range(start, start + n))
        tokens += response
        positions += range(len(prompt), len(prompt) + n)
        group += [g] * n
        segment += [r] * n
        pick[r, :n] = torch.arange(start - 1, start + n - 1)
        if n:
            pick[r, 0] = last
            labels[r, :n] = torch.tensor(response)
        valid[r, :n] = True
        last_token[r] = start + n - 1 if n else last
    keep = torch.unique(pick[valid])
    pick = torch.searchsorted(keep, pick).clamp(max=max(len(keep) - 1, 0)).masked_fill(~valid, 0)
    group_t, segment_t = torch.tensor(group), torch.tensor(segment)
    blocks = attention_blocks(prompt_positions, row_group, row_positions, group_t, segment_t)
    return PackedRollout(input_ids=torch.tensor([tokens], device=device),
                         position_ids=torch.tensor([positions], device=device),
                         group=group_t.to(device), segment=segment_t.to(device),
                         keep=keep.to(device), pick=pick.to(device), labels=labels.to(device),
                         valid=valid.to(device), last=last_token.to(device), blocks=blocks.to(device))


def packed_response_log_probs(model: torch.nn.Module, packed: PackedRollout, temperature: float, *,
                              mask_dtype: torch.dtype, with_entropy: bool = False,
                              truncation: SamplingTruncation | None = None, entropy_grad: bool = False,
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[label] of every response token, [B, W] float32 (0 past a row's response),
    and with `with_entropy` the entropy of the same distribution ([B, W], detached unless `entropy_grad`), from
    one packed forward.

    log p = z[label] - logsumexp(z) at the predicting position, z = logits / temperature; the log-sum-exp is taken
    once per kept position, so a prompt's last position, shared by all its responses, costs one row of the head.
    With an active `truncation` (--top_k / --top_p) it runs over the kept set of each position instead
    (`rlhfkit.models.logprobs.nucleus_log_norm`), which a sampled token outside it joins (`with_sampled_token`).
    """
    # squeeze, not [0]: select's backward would fill a zero [1, K, V] tensor and copy the gradient into it
    logits = model(**packed.model_inputs(model, mask_dtype), logits_to_keep=packed.keep).logits.squeeze(0)  # [K, V]
    return kept_log_probs_and_entropy(logits, packed.pick, packed.labels, packed.valid, temperature,
                                      with_entropy=with_entropy, truncation=truncation, entropy_grad=entropy_grad)


def kept_log_probs_and_entropy(logits: torch.Tensor, pick: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                               temperature: float, *, with_entropy: bool = False,
                               truncation: SamplingTruncation | None = None, entropy_grad: bool = False,
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From the logits of the kept positions ([K, V], any dtype): log p = z[labels] - logsumexp(z) at row `pick` of
    each (row, token) [B, W], z = logits / temperature, float32, 0 where not `valid`; with `with_entropy` the entropy
    of the same distributions [B, W] (0 where not `valid`; detached unless `entropy_grad`). Without an active
    `truncation` one fused pass (`rlhfkit.models.fused_logprobs`) that upcasts a chunk of rows at a time and keeps no
    [K, V] float32 tensor."""
    if truncation is None or not truncation.active:
        picked, row_entropy = pair_log_probs_and_entropy(logits, pick.reshape(-1), labels.reshape(-1),
                                                         temperature=temperature, with_entropy=with_entropy)
        log_probs = picked.reshape(pick.shape).masked_fill(~valid, 0.0)
        if row_entropy is not None and not entropy_grad:
            row_entropy = row_entropy.detach()
        entropy = row_entropy[pick].masked_fill(~valid, 0.0) if row_entropy is not None else None
        return log_probs, entropy
    logits = logits.float() / temperature
    log_norm, cut = nucleus_log_norm(logits, truncation)                         # [K], [K]
    picked = logits[pick, labels]                                                # [B, W]
    log_probs = (picked - with_sampled_token(log_norm[pick], cut[pick], picked)).masked_fill(~valid, 0.0)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())[pick].masked_fill(~valid, 0.0)
    return log_probs, entropy


def packed_scalar_outputs(model: torch.nn.Module, packed: PackedRollout, *, mask_dtype: torch.dtype,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A `score`-head model (critic, reward model) on the packed row: (the value at each row's last real token [B]
    (the reward), the value of the state before each response token [B, W], 0 past a row's response), float32.
    The state before response token t is read at the position that predicts it, as the padded critic does."""
    from rlhfkit.models.loading import head_values

    values = head_values(model, **packed.model_inputs(model, mask_dtype))[0].float()  # [L]
    token_values = values[packed.keep][packed.pick].masked_fill(~packed.valid, 0.0)
    return values[packed.last], token_values
