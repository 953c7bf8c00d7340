"""The loss terms of one micro-batch of a PPO-family policy step (rlhfkit.rl.worker.ModelWorker.train_policy_step),
pure functions of the flags and the micro-batch's tensors: the worker runs the forwards and the backward, these
combine what the forwards returned, add the token-weighted metric sums and shape a --debug_dump_steps entry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from rlhfkit.algorithms.kl import compute_kl, kl_loss
from rlhfkit.algorithms.normalize import masked_mean
from rlhfkit.algorithms.offpolicy import importance_weights
from rlhfkit.algorithms.policy_loss import ppo_policy_loss
from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.plan import run_kl_mode
from rlhfkit.observability.metrics import merge_metrics


@dataclass
class PolicyLoss:
    """One micro-batch's policy loss (not yet scaled for FSDP2's average) and what the metrics and the dump read."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    entropy_mean: torch.Tensor                 # sum(entropy x mask) / num_tokens, detached by the caller's float()
    is_weights: torch.Tensor | None            # --enable_vllm_is_correction (not with gspo): per-token weights
    token_out: dict[str, torch.Tensor] | None  # per-token ratio, loss (and kl) when a dump asks for them


def policy_loss(cfg: PPOConfig, mb: dict[str, torch.Tensor], log_probs: torch.Tensor,
                entropy: torch.Tensor, old: torch.Tensor, sums: dict[str, Any], *, num_tokens: float,
                num_seqs: float | None, kl_coef: float, aux: torch.Tensor | None = None, aux_coef: float = 0.0,
                aux_share: int = 1, with_tokens: bool = False) -> PolicyLoss:
    """loss = policy_loss(log_probs, old, advantages) (token mean over the global mini-batch of `num_tokens` tokens;
    with --policy_loss_type gspo the mean per sequence, then over `num_seqs` rows)
            + kl_coef * kl_loss(log_probs, ref_log_probs) (with --use_kl_loss)
            - entropy_loss_coef * sum(entropy x mask) / num_tokens
            + aux_coef * aux / aux_share (the MoE router loss: `aux_share` = micro-batches x ranks).
    --enable_vllm_is_correction: per-token importance weights of the trainer over the engine log-probs (a cell of
    --is_correction_level x --is_correction_mode, or the --vllm_is_correction_type preset), or for gspo the ratio
    taken against the engine's log-probs. Adds kl_loss, aux_loss and the importance-weight metrics to `sums`
    (token-weighted)."""
    mask = mb["action_mask"]
    gspo = cfg.policy_loss_type == "gspo"
    weights = None
    ratio_base = old
    if gspo and cfg.enable_vllm_is_correction:  # OpenRLHF: GSPO's ratio is taken against the engine's
        ratio_base = mb["rollout_log_probs"]  # log-probs, with no token weights
    elif cfg.enable_vllm_is_correction:
        low, high = cfg.vllm_is_truncated_threshold
        weights, is_metrics = importance_weights(old, mb["rollout_log_probs"], mask,
                                                 correction_type=cfg.vllm_is_correction_type,
                                                 level=cfg.is_correction_level, mode=cfg.is_correction_mode,
                                                 low=low, high=high, gating=cfg.is_correction_gating)
        accumulate(sums, is_metrics, mask)
    token_out: dict[str, torch.Tensor] | None = {} if with_tokens else None
    agg: dict[str, Any] = {"loss_agg_mode": "seq_mean", "num_seqs": num_seqs} if gspo else {"num_tokens": num_tokens}
    low_high = cast("tuple[float, float] | None", cfg.eps_clip_low_high)  # a list: clip_bounds unpacks (low, high)
    loss, metrics = ppo_policy_loss(log_probs, ratio_base, mb["advantages"], mask, eps_clip=cfg.eps_clip,
                                    eps_clip_low_high=low_high,
                                    dual_clip=cfg.dual_clip, is_weights=weights, token_out=token_out,
                                    policy_loss_type=cfg.policy_loss_type, **agg)
    if ratio_base is not old:  # GSPO + IS: the ratio is the engine's, train/approx_kl stays mean(log pi_old - log pi)
        metrics["approx_kl"] = masked_mean(old - log_probs.detach(), mask)
    if run_kl_mode(cfg) == "loss":
        kl_term = kl_loss(log_probs, mb["ref_log_probs"], mask, cfg.kl_estimator, num_tokens=num_tokens,
                          old_log_probs=old if cfg.use_unbiased_kl else None)
        loss = loss + kl_coef * kl_term
        sums["kl_loss"] = sums.get("kl_loss", 0.0) + float(kl_term.detach()) * num_tokens
        if token_out is not None:  # the same estimate kl_loss aggregates, per token
            token_out["kl"] = compute_kl(log_probs.detach(), mb["ref_log_probs"], mask, cfg.kl_estimator)
    ent = (entropy * mask).sum() / num_tokens
    if cfg.entropy_loss_coef:
        loss = loss - cfg.entropy_loss_coef * (entropy * mask).sum() / num_tokens
    if aux is not None:  # the step adds coef x the mean router loss over every micro-batch of every rank
        loss = loss + aux_coef * aux / aux_share
        sums["aux_loss"] = sums.get("aux_loss", 0.0) + float(aux.detach()) / aux_share * num_tokens
    return PolicyLoss(loss, metrics, ent, weights, token_out)


def policy_dump_entry(mb: dict[str, torch.Tensor], out: PolicyLoss, old: torch.Tensor, log_probs: torch.Tensor,
                      entropy: torch.Tensor, aux: torch.Tensor | None, num_micro_batches: int) -> dict[str, Any]:
    """A policy micro-batch of a --debug_dump_steps step (with the router loss, what recomputes it too)."""
    tokens = out.token_out if out.token_out is not None else {}
    return dump_entry(mb, ("row_index", "action_mask", "advantages", "rollout_log_probs", "ref_log_probs"),
                      old_log_probs=old, log_probs=log_probs, ratio=tokens["ratio"], policy_loss=tokens["loss"],
                      entropy=entropy, is_weights=out.is_weights, kl=tokens.get("kl"), loss=out.loss,
                      clip_frac=out.metrics["clip_frac"], dual_clip_frac=out.metrics["dual_clip_frac"], aux_loss=aux,
                      sequences=mb["sequences"] if aux is not None else None,
                      attention_mask=mb["attention_mask"] if aux is not None else None,
                      num_micro_batches=torch.tensor(num_micro_batches) if aux is not None else None)


def dump_entry(mb: dict[str, torch.Tensor], keys: tuple[str, ...], **tensors: Any) -> dict[str, Any]:
    """One micro-batch of a --debug_dump_steps step: `keys` of `mb` (those present) and `tensors` (None left out),
    detached on CPU."""
    out = {k: mb[k] for k in keys if k in mb}
    out.update({k: v for k, v in tensors.items() if v is not None})
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def accumulate(sums: dict[str, Any], metrics: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
    """Token-weighted sums of per-micro-batch means (the driver divides by the global token count)."""
    merge_metrics(sums, metrics, weight=float(mask.sum()))


def has_active_dropout(model: torch.nn.Module) -> bool:
    """Whether a training forward is random: a Dropout module with p > 0 (LoRA's too), or a config dropout rate > 0
    (attention dropout is functional in most HF models, not a module)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    rates = {k: v for k, v in (vars(config) if config is not None else {}).items()
             if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return any(v > 0 for v in rates.values())
