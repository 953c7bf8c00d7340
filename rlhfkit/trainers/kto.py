"""KTO (Ethayarajh et al., 2024) on unpaired data: a completion and a boolean label (true: desirable).

With ``r = log pi(y|x) - log pi_ref(y|x)`` (sums over response tokens) and the reference point
``z = max(0, mean_j (log pi(y'_j|x_j) - log pi_ref(y'_j|x_j)))`` over mismatched pairs ``(x_j, y'_j)``:

    desirable   : lambda_D (1 - sigmoid(beta (r - z)))
    undesirable : lambda_U (1 - sigmoid(beta (z - r)))          (mean over the global batch; a sample weighs 1)

The math is `rlhfkit.algorithms.preference.kto_loss`. The mismatched completion ``y'_j`` of sample ``j`` is the
response of another sample, fixed when the data is built (a seeded derangement of the training set), so reference
log-probs of both sequences can be precomputed (``--ref_mode precompute``, the default, as for DPO). ``z`` is estimated
over each micro-batch's mismatched pairs, with no gradient, as in the KTO paper (OpenRLHF additionally averages it
over the ranks; here it stays per micro-batch so that no collective runs inside the loss).

``--vanilla_loss`` (OpenRLHF's KTO trainer's option, ContextualAI HALOs' even-sampling KTO,
`rlhfkit.algorithms.preference.vanilla_kto_labelled_loss`): no mismatched pairs are scored; the reference point of a
desirable sample is ``max(0, mean r)`` over the micro-batch's undesirable samples and vice versa (with gradient;
0 for a side the micro-batch lacks), no sample weights.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from rlhfkit.algorithms.preference import kto_loss, vanilla_kto_labelled_loss
from rlhfkit.config.commands import KTOConfig
from rlhfkit.config.validate import need
from rlhfkit.data.unpaired import build_unpaired_samples
from rlhfkit.engine.distributed import DistInfo
from rlhfkit.trainers.loop import OfflineMethod
from rlhfkit.trainers.sequence_logps import (
    annotate_reference,
    collate_sides,
    load_frozen_causal_lm,
    model_device,
    sequence_sums,
    to_device,
)

COMPLETION = ("input_ids", "loss_mask")
MISMATCHED = ("kl_input_ids", "kl_loss_mask")
REF_KEYS = ("ref_logp", "ref_kl_logp")


def attach_mismatched(samples: list[dict], seed: int, max_len: int) -> None:
    """Give every sample a mismatched sequence: its own prompt followed by the response of another sample
    (``kl_input_ids`` / ``kl_loss_mask``), chosen by a seeded derangement; cut to ``max_len``."""
    if len(samples) < 2:
        for s in samples:
            s["kl_input_ids"], s["kl_loss_mask"] = list(s["input_ids"]), list(s["loss_mask"])
        return
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    for k, i in enumerate(order):
        me, other = samples[i], samples[order[(k + 1) % len(order)]]
        prompt = me["input_ids"][:me["prompt_len"]]
        response = other["input_ids"][other["prompt_len"]:]
        ids = (prompt + response)[:max_len]
        mask = ([0] * len(prompt) + list(other["loss_mask"][other["prompt_len"]:]))[:max_len]
        if not any(mask[1:]):  # the prompt fills max_len: keep at least the last response token scored
            ids, mask = ids[:-1] + response[-1:], mask[:-1] + [1]
        me["kl_input_ids"], me["kl_loss_mask"] = ids, mask


def kto_samples(cfg: KTOConfig, tokenizer: Any, rows: Any) -> tuple[list[dict], dict[str, Any]]:
    samples, stats = build_unpaired_samples(rows, tokenizer, input_key=cfg.input_key, output_key=cfg.output_key,
                                            label_key=need(cfg.label_key, "--label_key"),
                                            input_template=cfg.input_template,
                                            apply_chat_template=cfg.apply_chat_template, max_len=cfg.max_len)
    attach_mismatched(samples, cfg.seed, cfg.max_len)
    if cfg.ref_mode == "precompute":
        annotate_reference(cfg, samples, tokenizer.pad_token_id,
                           [(*COMPLETION, REF_KEYS[0]), (*MISMATCHED, REF_KEYS[1])])
    return samples, stats


def collate_kto(samples: Sequence[dict], pad_token_id: int, packed: bool = False) -> dict[str, Any]:
    """``completion``: the B completions; ``mismatched``: the B mismatched sequences (each padded, or packed into
    one row); ``desirable [B]``; and ``ref_logps`` / ``ref_kl_logps [B]`` when precomputed."""
    batch: dict[str, Any] = {"completion": collate_sides(samples, pad_token_id, [COMPLETION], packed),
                             "mismatched": collate_sides(samples, pad_token_id, [MISMATCHED], packed),
                             "desirable": torch.tensor([bool(s["label"]) for s in samples])}
    if all(REF_KEYS[0] in s for s in samples):
        batch["ref_logps"] = torch.tensor([s[REF_KEYS[0]] for s in samples], dtype=torch.float32)
        batch["ref_kl_logps"] = torch.tensor([s[REF_KEYS[1]] for s in samples], dtype=torch.float32)
    return batch


def kto_batch_loss(model: nn.Module, batch: dict[str, Any], *, beta: float, desirable_loss_weight: float = 1.0,
                   undesirable_loss_weight: float = 1.0, ref_model: nn.Module | None = None,
                   vanilla: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over the micro-batch of the KTO loss (``vanilla``: ``--vanilla_loss``'s), and metric sums."""
    device = model_device(model)
    completion, mismatched = to_device(batch["completion"], device), to_device(batch["mismatched"], device)
    logps, _ = sequence_sums(model, completion)
    with torch.no_grad():
        kl_logps = None if vanilla else sequence_sums(model, mismatched)[0]
        if ref_model is not None:
            ref_logps, _ = sequence_sums(ref_model, completion)
            ref_kl_logps = None if vanilla else sequence_sums(ref_model, mismatched)[0]
        elif "ref_logps" in batch:
            ref_logps, ref_kl_logps = batch["ref_logps"].to(device), batch["ref_kl_logps"].to(device)
        else:
            raise ValueError("KTO batch has no reference log-probs: use --ref_mode live or precompute them")
    desirable = batch["desirable"].to(device)
    n = logps.shape[0]
    if vanilla:
        loss, rewards, points = vanilla_kto_labelled_loss(logps, ref_logps, desirable, beta=beta, reduction="sum")
        extra = {"kl_desirable": points[0] * n, "kl_undesirable": points[1] * n}
    else:
        assert kl_logps is not None and ref_kl_logps is not None
        loss, rewards, z = kto_loss(logps, ref_logps, desirable, kl_logps, ref_kl_logps, beta=beta,
                                    desirable_loss_weight=desirable_loss_weight,
                                    undesirable_loss_weight=undesirable_loss_weight, reduction="sum")
        extra = {"kl": z * n}
    sign = desirable.to(rewards.dtype) * 2 - 1
    return loss, {**extra, "reward": rewards.sum(), "signed_reward": (sign * rewards).sum(),
                  "signed_logps": (sign * logps.detach()).sum()}


def kto_method(cfg: KTOConfig, tokenizer: Any, dist_info: DistInfo) -> OfflineMethod:
    ref_model = None
    if cfg.ref_mode == "live":
        ref_model = load_frozen_causal_lm(need(cfg.ref_pretrain or cfg.pretrain, "--pretrain"), cfg, dist_info,
                                          offload=cfg.ref_offload)
    pad_id = tokenizer.pad_token_id

    def loss(model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return kto_batch_loss(model, batch, beta=cfg.beta, desirable_loss_weight=cfg.desirable_loss_weight,
                              undesirable_loss_weight=cfg.undesirable_loss_weight, ref_model=ref_model,
                              vanilla=cfg.vanilla_loss)

    return OfflineMethod(name="kto", collate=lambda samples: collate_kto(samples, pad_id, cfg.packing_samples),
                         weight=lambda s: 1.0,
                         loss=loss, tokens=lambda s: len(s["input_ids"]) + len(s["kl_input_ids"]))


def validate_kto(cfg: KTOConfig) -> None:
    from rlhfkit.errors import ConfigError

    if cfg.beta <= 0:
        raise ConfigError(f"--beta must be > 0, got {cfg.beta}")
    if cfg.desirable_loss_weight < 0 or cfg.undesirable_loss_weight < 0:
        raise ConfigError("--desirable_loss_weight and --undesirable_loss_weight must be >= 0")
    if cfg.vanilla_loss and (cfg.desirable_loss_weight != 1.0 or cfg.undesirable_loss_weight != 1.0):
        raise ConfigError(f"--vanilla_loss with --desirable_loss_weight {cfg.desirable_loss_weight} "
                          f"--undesirable_loss_weight {cfg.undesirable_loss_weight}: vanilla KTO weighs every sample "
                          "1 (its reference points pair the two sides); drop the weights or --vanilla_loss")
