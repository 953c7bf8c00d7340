"""The loss terms of one micro-batch of a PPO-family policy step (rlhfkit.rl.worker.ModelWorker.train_policy_step):
`PolicyLoss`, built once from the run's flags and plan, combines what the forwards returned (`PolicyBatch`) into the
loss, adds the token-weighted metric sums and shapes a --debug_dump_steps entry; the worker runs the forwards and
the backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch

from rlhfkit.algorithms.kl import compute_kl, kl_loss
from rlhfkit.algorithms.normalize import masked_mean
from rlhfkit.algorithms.offpolicy import importance_weights
from rlhfkit.algorithms.policy_loss import ppo_policy_loss
from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.plan import KLMode, RunPlan, run_kl_mode
from rlhfkit.observability.metrics import merge_metrics


@dataclass
class PolicyLossTerms:
    """One micro-batch's policy loss (not yet scaled for FSDP2's average) and what the metrics and the dump read."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    entropy_mean: torch.Tensor                 # sum(entropy x mask) / num_tokens, detached by the caller's float()
    is_weights: torch.Tensor | None            # --enable_vllm_is_correction (not with gspo): per-token weights
    token_out: dict[str, torch.Tensor] | None  # per-token ratio, loss (and kl) when a dump asks for them


@dataclass(frozen=True)
class PolicyBatch:
    """What one policy micro-batch's loss reads: the training forward's `log_probs` and `entropy` [B, R], the PPO
    ratio's `old_log_probs`, the `advantages`, the `action_mask`, and where the run has them the engines'
    `rollout_log_probs` (the IS correction) and the reference's `ref_log_probs` (the KL loss)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    action_mask: torch.Tensor
    rollout_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None

    @classmethod
    def of(cls, mb: dict[str, torch.Tensor], log_probs: torch.Tensor, entropy: torch.Tensor,
           old_log_probs: torch.Tensor) -> PolicyBatch:
        """A micro-batch dict of the rollout (action_mask, advantages, rollout/ref log-probs) with the forward's
        outputs."""
        return cls(log_probs, entropy, old_log_probs, mb["advantages"], mb["action_mask"],
                   mb.get("rollout_log_probs"), mb.get("ref_log_probs"))


def _given(value: torch.Tensor | None, name: str, why: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"the policy micro-batch has no {name}, which {why} needs")
    return value


@dataclass(frozen=True)
class PolicyLoss:
    """The PPO-family policy loss of a run, its settings fixed when the worker starts (`from_plan`).

    loss = L_pg(log_probs, ratio_base, A)                                   (rlhfkit.algorithms.policy_loss)
           + kl_coef * kl_loss(log_probs, ref_log_probs)                    (kl_mode "loss": --use_kl_loss)
           - entropy_coef * sum(entropy x mask) / num_tokens                (--entropy_loss_coef)
           + aux_coef * aux / aux_share                                     (the MoE router loss)

    L_pg is `ppo_policy_loss` of `loss_type` (ppo: -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) per token,
    with `dual_clip` c: -max(min(...), c A) where A < 0; gspo: the same on one ratio per sequence; cispo:
    -sg[clip(rho)] A log pi), aggregated as the token mean over the global mini-batch's `num_tokens` tokens (gspo:
    the mean per sequence, then over `num_seqs` rows). rho = exp(log pi - log pi_old), where pi_old is the ratio
    base: the old log-probs, or with gspo and `is_correction` the engines' (OpenRLHF's GSPO IS correction, no token
    weights). With `is_correction` otherwise each token's loss is weighted by w = importance_weights(old, rollout)
    (the `is_level` x `is_mode` cell, or the `is_type` preset, truncated to `is_bounds`, gated by `is_gating`).
    kl_loss is the `kl_estimator` estimate of KL(pi || ref) (importance-weighted by pi / pi_old with
    `unbiased_kl`), token mean over `num_tokens`."""

    loss_type: str = "ppo"                        # --policy_loss_type: ppo | gspo | cispo
    eps_clip: float = 0.2                         # --eps_clip
    eps_clip_low_high: tuple[float, float] | None = None  # --eps_clip_low_high
    dual_clip: float | None = None                # --dual_clip
    kl_mode: KLMode = "off"                       # the plan's: "loss" adds the KL term
    kl_estimator: str = "k1"                      # --kl_estimator
    unbiased_kl: bool = False                     # --use_unbiased_kl
    entropy_coef: float = 0.0                     # --entropy_loss_coef
    is_correction: bool = False                   # --enable_vllm_is_correction
    is_type: str = "tis"                          # --vllm_is_correction_type
    is_level: str | None = None                   # --is_correction_level
    is_mode: str | None = None                    # --is_correction_mode
    is_bounds: tuple[float, ...] = (0.5, 5.0)     # --vllm_is_truncated_threshold (low, high)
    is_gating: str = "ratio"                      # --is_correction_gating

    @classmethod
    def from_plan(cls, cfg: PPOConfig, plan: RunPlan) -> PolicyLoss:
        """The run's policy loss: the loss flags read once, the KL mode and estimator from the plan."""
        return cls._of(cfg, plan.kl_mode, plan.kl_estimator)

    @classmethod
    def from_flags(cls, cfg: PPOConfig) -> PolicyLoss:
        """The policy loss of bare flags (no run plan: the KL mode decided from the flags, `run_kl_mode`)."""
        return cls._of(cfg, run_kl_mode(cfg), cfg.kl_estimator)

    @classmethod
    def _of(cls, cfg: PPOConfig, kl_mode: KLMode, kl_estimator: str) -> PolicyLoss:
        low_high = cfg.eps_clip_low_high  # (low, high): clip_bounds unpacks it
        return cls(loss_type=cfg.policy_loss_type, eps_clip=cfg.eps_clip,
                   eps_clip_low_high=None if low_high is None else cast("tuple[float, float]", tuple(low_high)),
                   dual_clip=cfg.dual_clip, kl_mode=kl_mode, kl_estimator=kl_estimator,
                   unbiased_kl=bool(cfg.use_unbiased_kl), entropy_coef=cfg.entropy_loss_coef or 0.0,
                   is_correction=bool(cfg.enable_vllm_is_correction), is_type=cfg.vllm_is_correction_type,
                   is_level=cfg.is_correction_level, is_mode=cfg.is_correction_mode,
                   is_bounds=tuple(cfg.vllm_is_truncated_threshold),
                   is_gating=cfg.is_correction_gating)

    def __call__(self, batch: PolicyBatch, sums: dict[str, Any], *, num_tokens: float, num_seqs: float | None,
                 kl_coef: float, aux: torch.Tensor | None = None, aux_coef: float = 0.0, aux_share: int = 1,
                 with_tokens: bool = False) -> PolicyLossTerms:
        """The loss of `batch` (class docstring); adds kl_loss, aux_loss and the importance-weight metrics to `sums`
        (token-weighted); `with_tokens`: the per-token ratio, loss (and kl) for a dump."""
        log_probs, old, mask = batch.log_probs, batch.old_log_probs, batch.action_mask
        gspo = self.loss_type == "gspo"
        weights = None
        ratio_base = old
        if gspo and self.is_correction:  # OpenRLHF: GSPO's ratio is taken against the engine's
            ratio_base = _given(batch.rollout_log_probs, "rollout_log_probs", "--enable_vllm_is_correction")
        elif self.is_correction:  # log-probs, with no token weights
            low, high = self.is_bounds
            weights, is_metrics = importance_weights(
                old, _given(batch.rollout_log_probs, "rollout_log_probs", "--enable_vllm_is_correction"), mask,
                correction_type=self.is_type, level=self.is_level, mode=self.is_mode, low=low, high=high,
                gating=self.is_gating)
            accumulate(sums, is_metrics, mask)
        token_out: dict[str, torch.Tensor] | None = {} if with_tokens else None
        agg: dict[str, Any] = {"loss_agg_mode": "seq_mean", "num_seqs": num_seqs} if gspo else \
            {"num_tokens": num_tokens}
        loss, metrics = ppo_policy_loss(log_probs, ratio_base, batch.advantages, mask, eps_clip=self.eps_clip,
                                        eps_clip_low_high=self.eps_clip_low_high,
                                        dual_clip=self.dual_clip, is_weights=weights, token_out=token_out,
                                        policy_loss_type=self.loss_type, **agg)
        if ratio_base is not old:  # GSPO + IS: the ratio is the engine's; approx_kl stays mean(log pi_old - log pi)
            metrics["approx_kl"] = masked_mean(old - log_probs.detach(), mask)
        if self.kl_mode == "loss":
            ref = _given(batch.ref_log_probs, "ref_log_probs", "--use_kl_loss")
            kl_term = kl_loss(log_probs, ref, mask, self.kl_estimator, num_tokens=num_tokens,
                              old_log_probs=old if self.unbiased_kl else None)
            loss = loss + kl_coef * kl_term
            sums["kl_loss"] = sums.get("kl_loss", 0.0) + float(kl_term.detach()) * num_tokens
            if token_out is not None:  # the same estimate kl_loss aggregates, per token
                token_out["kl"] = compute_kl(log_probs.detach(), ref, mask, self.kl_estimator)
        entropy = batch.entropy
        ent = (entropy.detach() * mask).sum() / num_tokens  # the metric; the bonus below keeps the gradient
        if self.entropy_coef:
            loss = loss - self.entropy_coef * (entropy * mask).sum() / num_tokens
        if aux is not None:  # the step adds coef x the mean router loss over every micro-batch of every rank
            loss = loss + aux_coef * aux / aux_share
            sums["aux_loss"] = sums.get("aux_loss", 0.0) + float(aux.detach()) / aux_share * num_tokens
        return PolicyLossTerms(loss, metrics, ent, weights, token_out)


def policy_loss(cfg: PPOConfig, mb: dict[str, torch.Tensor], log_probs: torch.Tensor,
                entropy: torch.Tensor, old: torch.Tensor, sums: dict[str, Any], *, num_tokens: float,
                num_seqs: float | None, kl_coef: float, aux: torch.Tensor | None = None, aux_coef: float = 0.0,
                aux_share: int = 1, with_tokens: bool = False) -> PolicyLossTerms:
    """One micro-batch's `PolicyLoss` from bare flags (`PolicyLoss.from_flags`; the worker builds its loss once,
    from the run's plan, instead)."""
    return PolicyLoss.from_flags(cfg)(PolicyBatch.of(mb, log_probs, entropy, old), sums, num_tokens=num_tokens,
                                      num_seqs=num_seqs, kl_coef=kl_coef, aux=aux, aux_coef=aux_coef,
                                      aux_share=aux_share, with_tokens=with_tokens)


def policy_dump_entry(mb: dict[str, torch.Tensor], out: PolicyLossTerms, old: torch.Tensor, log_probs: torch.Tensor,
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
