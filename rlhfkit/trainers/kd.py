"""Knowledge distillation from a teacher (``--teacher_model``) mixed with SFT (``--kd_coef``):

    loss = (1 - kd_coef) * NLL(y | x) + kd_coef * KL(p_teacher || p_student)      (token means over response tokens)

with ``KL_t = sum_v p_T(v) (log p_T(v) - log p_S(v))`` at every response position, as OpenRLHF's ``train_kd``.
The math is `rlhfkit.algorithms.supervised.masked_lm_loss` and `distillation_loss`; the data is SFT data
(`rlhfkit.data.sft`) and a sample weighs its number of target tokens, as in SFT. The teacher is frozen and
FSDP2-sharded like the policy; both models must share the tokenizer (same vocabulary). Logits are reduced to the
response positions before the vocabulary-sized softmaxes, so the prompt costs no ``[T, V]`` work.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig

from rlhfkit.algorithms.supervised import distillation_loss, masked_lm_loss
from rlhfkit.config.commands import KDConfig
from rlhfkit.config.validate import need
from rlhfkit.data.collate import model_inputs
from rlhfkit.data.sft import build_sft_samples
from rlhfkit.engine.distributed import DistInfo
from rlhfkit.errors import ConfigError
from rlhfkit.models.context_parallel import RingGroup, local_slice, ring_group, shard_forward_kwargs, sum_over_ring
from rlhfkit.models.loading import resolve_pretrain
from rlhfkit.trainers.loop import OfflineMethod
from rlhfkit.trainers.sequence_logps import load_frozen_causal_lm, model_device, to_device
from rlhfkit.trainers.sft import collate_for, target_count


def response_logits(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Logits that predict the target tokens, ``[N, V]`` (N = targets of the batch, in row-major order)."""
    logits = model(**model_inputs(batch, model=model)).logits[:, :-1]
    return logits[batch["loss_mask"][:, 1:].bool()]


def ring_response_logits(model: nn.Module, batch: dict[str, Any], ring: RingGroup) -> tuple[torch.Tensor, ...]:
    """--ring_attn_size: this rank's chunk forward; (logits [n, V], labels [n]) of the targets its chunk predicts."""
    targets = local_slice(F.pad(batch["loss_mask"][:, 1:], (0, 1)), ring).bool()  # position t predicts t + 1
    labels = local_slice(F.pad(batch["input_ids"][:, 1:], (0, 1)), ring)[targets]
    return model(**shard_forward_kwargs(model_inputs(batch), ring)).logits[targets], labels


def kd_batch_loss(model: nn.Module, teacher: nn.Module, batch: dict[str, Any], *, kd_coef: float,
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over the micro-batch's target tokens of the mixed loss, and the NLL / KL sums. With --ring_attn_size each
    rank sums the targets of its chunk and the sums are added over the ring group, so every rank holds the whole
    micro-batch's sums (the loss convention of rlhfkit.models.context_parallel)."""
    batch = to_device(batch, model_device(model))
    ring = ring_group()
    if ring is not None:
        student, labels = ring_response_logits(model, batch, ring)
        with torch.no_grad():
            teacher_logits = ring_response_logits(teacher, batch, ring)[0]
    else:
        student = response_logits(model, batch)
        with torch.no_grad():
            teacher_logits = response_logits(teacher, batch)
        labels = batch["input_ids"][:, 1:][batch["loss_mask"][:, 1:].bool()]
    nll = masked_lm_loss(student[None], labels[None], shift=False, num_tokens=1.0)
    kl = distillation_loss(student[None], teacher_logits[None], None, num_tokens=1.0)
    if ring is not None:
        nll, kl = sum_over_ring(nll, ring), sum_over_ring(kl, ring)
    loss = (1.0 - kd_coef) * nll + kd_coef * kl
    return loss, {"nll": nll.detach(), "kd_kl": kl.detach()}


def kd_samples(cfg: KDConfig, tokenizer: Any, rows: Any) -> tuple[list[dict], dict[str, Any]]:
    return build_sft_samples(rows, tokenizer, input_key=cfg.input_key, output_key=cfg.output_key,
                             input_template=cfg.input_template, apply_chat_template=cfg.apply_chat_template,
                             max_len=cfg.max_len, pretrain_mode=cfg.pretrain_mode)


def check_vocabularies(student: str, teacher: str) -> None:
    """Student and teacher must predict over the same vocabulary."""
    sizes = {name: AutoConfig.from_pretrained(resolve_pretrain(spec)).vocab_size
             for name, spec in (("--pretrain", student), ("--teacher_model", teacher))}
    if len(set(sizes.values())) != 1:
        raise ConfigError(f"the student and teacher vocabularies differ ({sizes}): distillation needs both models "
                          "to share the tokenizer")


def kd_method(cfg: KDConfig, tokenizer: Any, dist_info: DistInfo) -> OfflineMethod:
    teacher_model = need(cfg.teacher_model, "--teacher_model")
    check_vocabularies(need(cfg.pretrain, "--pretrain"), teacher_model)
    teacher = load_frozen_causal_lm(teacher_model, cfg, dist_info, offload=cfg.teacher_offload)
    return OfflineMethod(name="kd", collate=collate_for(cfg, tokenizer), weight=target_count,
                         loss=lambda model, batch: kd_batch_loss(model, teacher, batch, kd_coef=cfg.kd_coef),
                         tokens=lambda s: len(s["input_ids"]))


def validate_kd(cfg: KDConfig) -> None:
    if not cfg.teacher_model:
        raise ConfigError("--teacher_model is required for 'rlhfkit kd'")
    if not 0.0 <= cfg.kd_coef <= 1.0:
        raise ConfigError(f"--kd_coef must lie in [0, 1], got {cfg.kd_coef}")
