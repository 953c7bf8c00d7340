"""Context parallel in ppo's workers (`--ring_attn_size N`): the actor, reference and critic ranks of a role form
ring groups of N consecutive ranks (rlhfkit.models.context_parallel); the N ranks of a group take the same rows of
every batch (the data-parallel rank is ``rank // N``) and each runs the model on one contiguous chunk of every row,
padded (left-padded prompt + right-padded response) or packed (`rlhfkit.rl.packing`: a response attends its prompt
and itself, a 4-D block mask whose chunk rows each rank takes). Reward models are not split (one forward per row).

Outputs. Each rank computes the logits only at the positions of its chunk that predict a response token, and the
per-token results (log-probs, entropy) of every rank are summed over the group (`sum_over_ring`: exactly one rank owns
each position, the others add 0), so every rank of the group holds the micro-batch's whole ``[B, W]`` log-probs;
values go through the value head's sequence gather (`rlhfkit.models.loading.head_values`).

Gradient scale. Each rank of a group computes the same loss ``L_g`` (normalised by the global mini-batch's token
count) and back-propagates ``dp x L_g`` instead of ``world x L_g``: the gather's backward sums the group's N identical
upstream gradients, so a group's parameter gradients add up to ``N dp dL_g/dtheta``, and FSDP2's average over the
``dp N`` ranks leaves ``sum_g dL_g/dtheta``, the unsharded step's gradient. Metrics: only the first rank of a group
reports the token-weighted sums (the others hold the same numbers), every rank its grad norm and lr.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.options import TrainOptions
from rlhfkit.errors import ConfigError
from rlhfkit.models.context_parallel import RingGroup, setup_ring_attention, shard_forward_kwargs, sum_over_ring
from rlhfkit.models.logprobs import SamplingTruncation, tempered_log_probs_and_entropy
from rlhfkit.models.positions import position_ids
from rlhfkit.rl.experience import split_rows
from rlhfkit.rl.packing import PackedRollout, kept_log_probs_and_entropy

RING_ROLES = ("actor", "ref", "critic")


def ring_size_of(role: str, cfg: TrainOptions) -> int:
    """The ring size of a role's ranks: --ring_attn_size for the actor, reference and critic, 1 for reward models."""
    return (cfg.ring_attn_size or 1) if role in RING_ROLES else 1


def rank_rows(rows: int, world: int, ring: int) -> list[list[int]]:
    """The rows each of `world` ranks takes: contiguous, balanced parts over the ``world // ring`` data-parallel
    ranks, each part given to every rank of its ring group (ranks ``[k ring, (k + 1) ring)``)."""
    parts = split_rows(rows, world // ring)
    return [parts[r // ring] for r in range(world)]


def validate_ring(cfg: PPOConfig, worlds: Mapping[str, int]) -> None:
    """--ring_attn_size in ppo: it must divide the ranks of every role it splits (`worlds`: role -> ranks of the roles
    in use), and the flags whose terms this path does not compute are refused."""
    size = cfg.ring_attn_size
    if size < 1 or cfg.ring_head_stride < 1:
        raise ConfigError(f"--ring_attn_size ({size}) and --ring_head_stride ({cfg.ring_head_stride}) must be >= 1")
    if size == 1:
        if cfg.ring_head_stride != 1:
            raise ConfigError(f"--ring_head_stride {cfg.ring_head_stride} acts only with --ring_attn_size > 1: set "
                              "both or drop --ring_head_stride")
        return
    for role, world in worlds.items():
        if role in RING_ROLES and world % size:
            raise ConfigError(f"--ring_attn_size {size} must divide the {role}'s {world} ranks (--{role}_num_nodes x "
                              f"--{role}_num_gpus_per_node = data parallel x ring size): give the {role} a multiple "
                              f"of {size} ranks or change --ring_attn_size")
    if cfg.aux_loss_coef:
        raise ConfigError(f"--aux_loss_coef with --ring_attn_size {size}: the router loss would be computed on each "
                          "rank's chunk of the sequence, not on the whole sequence; use one of the two")
    if cfg.pretrain_data:
        raise ConfigError(f"--pretrain_data (the --ptx_coef loss) with --ring_attn_size {size}: the ptx forward is not "
                          "split over the ring group yet; drop one of the two")


def setup_worker_ring(role: str, cfg: TrainOptions) -> RingGroup | None:
    """The ring groups of a role's ranks (collective over the role's process group); None for ring size 1 and for
    roles that are not split."""
    size = ring_size_of(role, cfg)
    return setup_ring_attention(size, cfg.ring_head_stride) if size > 1 else None


def _kept_logits(model: torch.nn.Module, forward_kwargs: dict[str, torch.Tensor], keep: torch.Tensor,
                 ring: RingGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's chunk forward with the LM head only at the kept global positions `keep` [K] (sorted) that fall in
    the chunk: (logits [B, k, V] in the model's dtype, owned [K] bool, index [K] of each kept position into those k
    rows, k for a position another rank owns)."""
    local = shard_forward_kwargs(forward_kwargs, ring)
    chunk = local["input_ids"].shape[1]
    start = ring.rank * chunk
    owned = (keep >= start) & (keep < start + chunk)
    logits = model(**local, logits_to_keep=keep[owned] - start).logits
    index = torch.where(owned, owned.long().cumsum(0) - 1, int(owned.sum()))
    return logits, owned, index


def ring_response_log_probs(model: torch.nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                            width: int, temperature: float, ring: RingGroup, with_entropy: bool = False, *,
                            truncation: SamplingTruncation | None = None, entropy_grad: bool = False,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Padded rows: log softmax(z_t / temperature)[y_{t+1}] of the last `width` tokens, [B, width] float32, and with
    `with_entropy` the entropy of the same distributions (detached unless `entropy_grad`); every rank of the group
    returns all of it.
    `truncation`: --top_k / --top_p log-probs (`rlhfkit.models.logprobs.log_probs_from_logits`)."""
    total = sequences.shape[1]
    keep = torch.arange(total - width - 1, total - 1, device=sequences.device)
    inputs = {"input_ids": sequences, "attention_mask": attention_mask, "position_ids": position_ids(attention_mask)}
    logits, owned, index = _kept_logits(model, inputs, keep, ring)
    labels = sequences[:, keep[owned] + 1]
    if logits.shape[1] == 0:  # a chunk that predicts no response token: [B, 0], still in the graph (the LM head ran)
        empty = logits.float().sum(-1)
        mine: tuple[torch.Tensor, torch.Tensor | None] = (empty, empty if entropy_grad else empty.detach())
    else:
        mine = tempered_log_probs_and_entropy(logits, labels, temperature, truncation=truncation,
                                              with_entropy=with_entropy, entropy_grad=entropy_grad)
    log_probs = sum_over_ring(F.pad(mine[0], (0, 1))[:, index], ring)           # [B, width], 0 where not owned
    entropy = None
    if with_entropy:
        assert mine[1] is not None  # with_entropy
        entropy = sum_over_ring(F.pad(mine[1], (0, 1))[:, index], ring)
    return log_probs, entropy


def ring_packed_log_probs(model: torch.nn.Module, packed: PackedRollout, temperature: float, ring: RingGroup,
                          with_entropy: bool = False, *, truncation: SamplingTruncation | None = None,
                          entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`rlhfkit.rl.packing.packed_response_log_probs` over the ring group: log p = z[label] - logsumexp(z) at each
    response token's predicting position (z = logits / temperature), [B, W] float32 (0 past a row's response)."""
    inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
              "attention_mask": packed.attention_mask(torch.float32) == 0}
    logits, owned, index = _kept_logits(model, inputs, packed.keep, ring)
    logits = logits.squeeze(0)                                                   # [k, V] (no zero-filled grad)
    mine = owned[packed.pick] & packed.valid
    if logits.shape[0] == 0:
        logits = F.pad(logits, (0, 0, 0, 1))                                     # a zero row, read by no one
    rows = index[packed.pick].clamp(max=logits.shape[0] - 1)                     # [B, W]; others' rows are masked
    log_probs, entropy = kept_log_probs_and_entropy(logits, rows, packed.labels, mine, temperature,
                                                    with_entropy=with_entropy, truncation=truncation,
                                                    entropy_grad=entropy_grad)
    return sum_over_ring(log_probs, ring), (sum_over_ring(entropy, ring) if entropy is not None else None)
