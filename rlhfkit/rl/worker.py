"""One rank of a model group (actor, reference, critic, reward): a Ray actor that joins its group's process group
with the same env vars torchrun sets, so the FSDP2 engine code is the one the offline trainers use.

Memory between phases (CUDA only; on CPU every state already lives in host RAM and these are no-ops):
`offload_states` / `reload_states` move a trainer's parameters, gradients and optimizer state to host RAM and back
(`--fsdp_enable_offload`); frozen models (reference, reward) with `--ref_reward_offload` keep their parameters in host
RAM and visit the device only for their forwards.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

from rlhfkit.algorithms.entropy import entropy_from_logits
from rlhfkit.algorithms.kl import compute_kl, kl_loss
from rlhfkit.algorithms.normalize import masked_mean
from rlhfkit.algorithms.offpolicy import importance_weights, logprob_mismatch
from rlhfkit.algorithms.policy_loss import ppo_policy_loss
from rlhfkit.algorithms.supervised import masked_lm_loss
from rlhfkit.algorithms.value_loss import value_loss
from rlhfkit.config.plan import kl_mode_of
from rlhfkit.engine.checkpoint import load_checkpoint, save_checkpoint, save_hf_folder
from rlhfkit.engine.cpu_threads import set_cpu_threads
from rlhfkit.engine.distributed import init_distributed
from rlhfkit.engine.ema import resolved_ema_beta
from rlhfkit.engine.fsdp import shard_model
from rlhfkit.engine.train_engine import TrainEngine
from rlhfkit.models.logprobs import log_probs_from_logits
from rlhfkit.models.positions import position_ids
from rlhfkit.observability.metrics import merge_metrics
from rlhfkit.rl.experience import sort_rows_by_length, sort_rows_by_prompt, trim_padding
from rlhfkit.rl.packing import (
    PackedRollout,
    pack_rollout,
    pack_scored_rows,
    packed_response_log_probs,
    packed_scalar_outputs,
)
from rlhfkit.rl.ring import ring_packed_log_probs, ring_response_log_probs, setup_worker_ring
from rlhfkit.rl.vision_batch import is_vision_language, keeps_vision_tower, load_vlm_for_role, pixel_inputs
from rlhfkit.rollout.types import SyncStats


def micro_batches(batch: dict[str, torch.Tensor], size: int, max_tokens: int | None = None) -> list[dict]:
    """Cut a batch into micro-batches: `size` rows each, or (dynamic batch) rows up to `max_tokens` real tokens."""
    rows = batch["sequences"].shape[0]
    if max_tokens is None:
        bounds = [(i, min(rows, i + size)) for i in range(0, rows, size)]
    else:
        lengths = batch["attention_mask"].sum(-1).tolist()
        bounds, start, used = [], 0, 0
        for i, n in enumerate(lengths):
            if i > start and used + n > max_tokens:
                bounds.append((start, i))
                start, used = i, 0
            used += n
        bounds.append((start, rows))
    return [{k: v[a:b] for k, v in batch.items()} for a, b in bounds]


def rollout_budget(cfg: Any) -> int | None:
    """Token budget of a forward micro-batch (log-probs, values, rewards) with --use_dynamic_batch:
    --rollout_max_tokens_per_gpu, else --train_max_tokens_per_gpu (OpenRLHF's fallback); None without it."""
    if not cfg.use_dynamic_batch:
        return None
    return cfg.rollout_max_tokens_per_gpu or cfg.train_max_tokens_per_gpu


class ModelWorker:
    """A rank of a model group. `role` is 'actor', 'ref', 'critic' or 'reward'."""

    def __init__(self, role: str, cfg: dict[str, Any], rank: int, world_size: int, master_addr: str,
                 master_port: int) -> None:
        from rlhfkit.observability.run import process_log_path, redirect_output

        log_path = process_log_path(cfg.get("run_dir"), bool(cfg.get("verbose")), f"{role}_rank{rank}")
        if log_path:  # this rank's library logs go to the run folder, not the driver's console
            redirect_output(log_path)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0" if not torch.cuda.is_available()
                          else os.environ.get("LOCAL_RANK", "0"), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if not torch.cuda.is_available():  # Ray gave this actor OMP_NUM_THREADS=1 (it asks for a fraction of a CPU)
            share = cfg.get("cpu_threads_share") or max(1, world_size // max(1, int(cfg.get(f"{role}_num_nodes") or 1)))
            set_cpu_threads(int(cfg.get("torch_threads_per_worker") or 0), int(share))
        self.role = role
        self.cfg = SimpleNamespace(**cfg)
        self.dist = init_distributed()
        self.ring = setup_worker_ring(role, self.cfg)  # --ring_attn_size: actor, reference, critic (rl/ring.py)
        # FSDP2 averages gradients over the world; a ring group's ranks share one loss (rl/ring.py: the scale)
        self.loss_scale = self.dist.world_size // (self.ring.size if self.ring is not None else 1)
        self.engine: TrainEngine | None = None
        self.model = None
        self.reward_mean, self.reward_std = 0.0, 1.0
        self.offload_frozen = False
        self.offloaded = False
        self.has_dropout = False
        self.weight_sender: Any = None  # rank 0 of the actor: a WeightBroadcaster (--vllm_sync_backend gloo|nccl)
        torch.manual_seed(self.cfg.seed + rank)

    # ----------------------------------------------------------------- set-up
    def init_model(self, pretrain: str, trainable: bool, total_steps: int = 1, learning_rate: float = 0.0,
                   scalar_head: bool = False, reward_model: bool = False) -> int:
        """Load and shard the model. `scalar_head`: a `score` head (critic: a causal LM gets a fresh one);
        `reward_model`: a trained scalar checkpoint is required, and with --normalize_reward its stored
        reward_mean / reward_std are read."""
        from rlhfkit.models.loading import load_causal_lm, load_scalar_model

        attn = self.cfg.attn_implementation
        if scalar_head or reward_model:
            with torch.random.fork_rng(devices=[]):  # a fresh critic head: the same on every rank, whatever its count
                torch.manual_seed(self.cfg.seed)
                model = load_scalar_model(pretrain, init_from_causal=not reward_model, attn_implementation=attn)
        else:
            quantized = trainable and bool(getattr(self.cfg, "load_in_4bit", False))  # QLoRA actor
            if quantized and self.cfg.lora_rank <= 0:
                from rlhfkit.errors import ConfigError

                raise ConfigError("--load_in_4bit needs --lora_rank > 0: 4-bit base weights cannot be trained, only "
                                  "LoRA adapters on them (QLoRA)")
            from rlhfkit.engine.fsdp import compute_dtype

            if is_vision_language(pretrain):  # --image_key runs (rl/vision_batch.py)
                model = load_vlm_for_role(pretrain, attn, trainable, self.cfg)
            else:
                model = load_causal_lm(pretrain, attn_implementation=attn, load_in_4bit=quantized,
                                       compute_dtype=compute_dtype(self.cfg.param_dtype, self.dist.device))
        if reward_model and getattr(self.cfg, "normalize_reward", False):
            from rlhfkit.rewards.reward_model import reward_stats

            self.reward_mean, self.reward_std = reward_stats(model.config, pretrain)
        if trainable:
            if self.cfg.lora_rank > 0:  # the engines get merged weights (see _weights_for_engines)
                from rlhfkit.models.lora import apply_lora

                model = apply_lora(model, self.cfg.lora_rank, self.cfg.lora_alpha, self.cfg.target_modules,
                                   self.cfg.lora_dropout)
            ema_beta = resolved_ema_beta(self.cfg) if self.role == "actor" else None  # --enable_ema: the actor's
            self.engine = TrainEngine(model, self.cfg, self.dist, total_steps, learning_rate, role=self.role,
                                      ema_beta=ema_beta)
            self.model = self.engine.model
            self.has_dropout = has_active_dropout(model)
        else:
            model.requires_grad_(False)
            if self.ring is not None:  # the reference: sequences split over the ring group
                from rlhfkit.models.context_parallel import use_ring_attention

                use_ring_attention(model)
            self.model = shard_model(model, zero_stage=3, device=self.dist.device, param_dtype=self.cfg.param_dtype)
            self.model.eval()
            self.offload_frozen = bool(getattr(self.cfg, "ref_reward_offload", False)) and self._on_cuda()
            if self.offload_frozen:
                self._move_model("cpu")
        return sum(p.numel() for p in model.parameters())

    def compute_threads(self) -> int:
        """torch's intra-op threads in this rank (shown in the ppo start-up table)."""
        return torch.get_num_threads()

    def whereabouts(self) -> dict[str, Any]:
        """This rank's role, rank and placement as Ray sees it (recorded in the run's manifest)."""
        from rlhfkit.observability.placement import whereabouts

        return whereabouts(role=self.role, rank=self.dist.rank, threads=torch.get_num_threads())

    # ----------------------------------------------------------------- memory between phases
    def _on_cuda(self) -> bool:
        # With --adam_offload FSDP2's CPUOffloadPolicy already keeps the state in host RAM.
        return self.dist.device.type == "cuda" and not self.cfg.adam_offload

    def _move_model(self, device: str | torch.device) -> None:
        self.model.to(device)  # FSDP2 modules move their sharded parameters (and gradients) with .to()
        if str(device) == "cpu":
            torch.cuda.empty_cache()

    def offload_states(self) -> bool:
        """Trainer state (parameters, gradients, optimizer state) to host RAM. Returns whether anything moved:
        False on CPU, where it already lives there (--fsdp_enable_offload is then a no-op)."""
        if not self._on_cuda() or self.offloaded:
            return False
        if self.engine is not None:
            _move_optimizer_state(self.engine.optimizer, "cpu")
        self._move_model("cpu")
        self.offloaded = True
        return True

    def reload_states(self) -> bool:
        """Undo `offload_states`."""
        if not self.offloaded:
            return False
        self._move_model(self.dist.device)
        if self.engine is not None:
            _move_optimizer_state(self.engine.optimizer, self.dist.device)
        self.offloaded = False
        return True

    @contextlib.contextmanager
    def _frozen_on_device(self) -> Iterator[None]:
        """--ref_reward_offload: the frozen model visits the device for one forward pass (CUDA only)."""
        if self.offload_frozen:
            self._move_model(self.dist.device)
        try:
            yield
        finally:
            if self.offload_frozen:
                self._move_model("cpu")

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.dist.device) for k, v in batch.items()}

    # ----------------------------------------------------------------- forward passes
    def _pack(self, mb: dict[str, torch.Tensor]) -> PackedRollout:
        return pack_rollout(mb["sequences"], mb["attention_mask"], mb["action_mask"].shape[1])

    def _mask_dtype(self) -> torch.dtype:
        """The packed row's additive mask is in the compute dtype (sdpa takes no other)."""
        from rlhfkit.engine.fsdp import compute_dtype

        return compute_dtype(self.cfg.param_dtype, self.dist.device)

    def _action_log_probs(self, mb: dict[str, torch.Tensor], with_entropy: bool = False):
        seq, mask = mb["sequences"], mb["attention_mask"]
        width = mb["action_mask"].shape[1]
        if self.ring is not None and self.cfg.packing_samples:  # --ring_attn_size: rl/ring.py
            return ring_packed_log_probs(self.model, self._pack(mb), self.cfg.temperature, self.ring, with_entropy)
        if self.ring is not None:
            return ring_response_log_probs(self.model, seq, mask, width, self.cfg.temperature, self.ring, with_entropy)
        if self.cfg.packing_samples:  # one packed row, each shared prompt once (rl/packing.py)
            return packed_response_log_probs(self.model, self._pack(mb), self.cfg.temperature,
                                             mask_dtype=self._mask_dtype(), with_entropy=with_entropy)
        # Only the positions that predict response tokens need the (vocab-sized) LM head.
        logits = self.model(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                            logits_to_keep=width + 1, **pixel_inputs(mb)).logits
        logits = logits[:, :-1].float() / self.cfg.temperature
        log_probs = log_probs_from_logits(logits, seq[:, -width:])
        entropy = entropy_from_logits(logits.detach()) if with_entropy else None
        return log_probs, entropy

    @torch.no_grad()
    def log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token log-probs of the response tokens, [B, R] (sampling temperature applied to the logits)."""
        self.model.eval()
        width = batch["action_mask"].shape[1]
        with self._frozen_on_device():
            out = [_pad_to(self._action_log_probs(self._to_device(trim_padding(mb)))[0].cpu(), width)
                   for mb in micro_batches(batch, self.cfg.micro_rollout_batch_size, rollout_budget(self.cfg))]
        return torch.cat(out)

    @torch.no_grad()
    def probe_log_probs(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """log softmax(logits)[token] at temperature 1 of each response token, as the engines' `score` computes it
        (the weight-sync check, `rlhfkit.rl.sync_check`); collective over the group's ranks."""
        self.model.eval()
        seq = torch.tensor([list(prompt_ids) + list(response_ids)], device=self.dist.device)
        mask = torch.ones_like(seq)
        with self._frozen_on_device():
            if self.ring is not None:
                return ring_response_log_probs(self.model, seq, mask, len(response_ids), 1.0,
                                               self.ring)[0][0].cpu().tolist()
            logits = self.model(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                                logits_to_keep=len(response_ids) + 1).logits
        return log_probs_from_logits(logits[:, :-1].float(), seq[:, -len(response_ids):])[0].cpu().tolist()

    @torch.no_grad()
    def rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Reward model: the `score` head at the last real token of each row (`sequences` / `attention_mask`, any
        padding side), normalised with the stored statistics under --normalize_reward. Float32 [B]."""
        from rlhfkit.models.loading import scalar_outputs

        self.model.eval()
        out = []
        with self._frozen_on_device():
            for mb in micro_batches(batch, self.cfg.micro_rollout_batch_size, rollout_budget(self.cfg)):
                mb = self._to_device(mb)
                if self.cfg.packing_samples:
                    packed = pack_scored_rows(mb["sequences"], mb["attention_mask"], mb["prompt_lengths"])
                    last, _ = packed_scalar_outputs(self.model, packed, mask_dtype=self._mask_dtype())
                else:
                    last, _ = scalar_outputs(self.model, mb["sequences"], mb["attention_mask"])
                out.append(((last.float() - self.reward_mean) / self.reward_std).cpu())
        return torch.cat(out)

    def _values(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        from rlhfkit.models.loading import scalar_outputs

        width = mb["action_mask"].shape[1]
        if self.cfg.packing_samples:
            return packed_scalar_outputs(self.model, self._pack(mb), mask_dtype=self._mask_dtype())[1]
        _, token_values = scalar_outputs(self.model, mb["sequences"], mb["attention_mask"])
        # The value of the state before response token t is read at the position that predicts it.
        return token_values[:, -width - 1:-1].float()

    @torch.no_grad()
    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Critic values of the states before each response token, [B, R]."""
        self.model.eval()
        width = batch["action_mask"].shape[1]
        chunks = micro_batches(batch, self.cfg.micro_rollout_batch_size, rollout_budget(self.cfg))
        out = [_pad_to(self._values(self._to_device(trim_padding(mb))).cpu(), width) for mb in chunks]
        return torch.cat(out)

    # ----------------------------------------------------------------- training
    def train_policy_step(self, shard: dict[str, torch.Tensor], num_tokens: float,
                          ptx: dict[str, torch.Tensor] | None = None, ptx_tokens: float = 0.0, *,
                          num_seqs: float | None = None, kl_coef: float | None = None) -> dict[str, float]:
        """One optimizer step of the PPO-family policy loss over this rank's share of a global mini-batch.

        loss = policy_loss (token mean over the whole global mini-batch: num_tokens is its token count; with
                 --policy_loss_type gspo the mean per sequence, then over its num_seqs rows)
               + kl_coef * kl_loss (with --use_kl_loss; kl_coef is --init_kl_coef or the adaptive controller's
                 value with --kl_target) - entropy_loss_coef * entropy
               + ptx_coef * LM loss on this rank's share of a --pretrain_data batch (token mean over the global
                 ptx batch, `ptx_tokens` target tokens), when `ptx` is given.
        FSDP2 averages gradients over ranks, so each rank's loss is scaled by the world size (with --ring_attn_size N
        by world / N, the data-parallel size: rlhfkit.rl.ring).
        """
        cfg, world = self.cfg, self.loss_scale
        kl_coef = cfg.init_kl_coef if kl_coef is None else kl_coef
        gspo = cfg.policy_loss_type == "gspo"
        self.model.train()
        sums: dict[str, float] = {}
        dump: list[dict[str, Any]] | None = [] if "row_index" in shard else None  # --debug_dump_steps
        trace: list[tuple[torch.Tensor, torch.Tensor]] = []
        budget = cfg.train_max_tokens_per_gpu if cfg.use_dynamic_batch else None
        router = self.engine.aux_loss  # --aux_loss_coef on an MoE actor: the router load-balancing loss
        # Packed micro-batches keep a prompt's samples together (its tokens are computed once); padded ones are
        # sorted by length so trim_padding cuts more.
        ordered = sort_rows_by_prompt(shard) if cfg.packing_samples else sort_rows_by_length(shard)
        batches = list(micro_batches(ordered, cfg.micro_train_batch_size, budget))
        for mb in batches:
            mb = self._to_device(trim_padding(mb))
            mask = mb["action_mask"]
            log_probs, entropy = self._action_log_probs(mb, with_entropy=True)
            aux = router.pop() if router is not None else None
            old = mb.get("old_log_probs")
            if old is None:  # one optimizer step per rollout: the old policy is this one (make_experience)
                old = self._old_log_probs_of_this_policy(mb, log_probs)
                _accumulate(sums, self._rollout_metrics(old, mb), mask)
                if "trace_row" in mb:  # the per-sample trace (observability/trace.py): |engine - trainer| per token
                    trace.append((mb["trace_row"].cpu(), ((old - mb["rollout_log_probs"]).abs() * mask).cpu()))
            weights = None
            ratio_base = old
            if gspo and cfg.enable_vllm_is_correction:  # OpenRLHF: GSPO's ratio is taken against the engine's
                ratio_base = mb["rollout_log_probs"]  # log-probs, with no token weights
            elif cfg.enable_vllm_is_correction:
                low, high = cfg.vllm_is_truncated_threshold
                weights, is_metrics = importance_weights(old, mb["rollout_log_probs"], mask,
                                                         correction_type=cfg.vllm_is_correction_type, low=low,
                                                         high=high)
                _accumulate(sums, is_metrics, mask)
            token_out: dict[str, torch.Tensor] | None = {} if dump is not None else None
            agg = {"loss_agg_mode": "seq_mean", "num_seqs": num_seqs} if gspo else {"num_tokens": num_tokens}
            loss, metrics = ppo_policy_loss(log_probs, ratio_base, mb["advantages"], mask,
                                            eps_clip=cfg.eps_clip, eps_clip_low_high=cfg.eps_clip_low_high,
                                            dual_clip=cfg.dual_clip, is_weights=weights, token_out=token_out,
                                            policy_loss_type=cfg.policy_loss_type, **agg)
            if kl_mode_of(cfg.init_kl_coef, cfg.use_kl_loss) == "loss":
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
                loss = loss + self.engine.aux_loss_coef * aux / (len(batches) * world)
                sums["aux_loss"] = sums.get("aux_loss", 0.0) + float(aux.detach()) / (len(batches) * world) * num_tokens
            (loss * world).backward()
            sums["policy_loss"] = sums.get("policy_loss", 0.0) + float(loss.detach()) * num_tokens
            sums["entropy"] = sums.get("entropy", 0.0) + float(ent) * num_tokens
            _accumulate(sums, metrics, mask)
            if dump is not None:
                dump.append(_dump_entry(mb, ("row_index", "action_mask", "advantages", "rollout_log_probs",
                                             "ref_log_probs"),
                                        old_log_probs=old, log_probs=log_probs, ratio=token_out["ratio"],
                                        policy_loss=token_out["loss"], entropy=entropy, is_weights=weights,
                                        kl=token_out.get("kl"), loss=loss, clip_frac=metrics["clip_frac"],
                                        dual_clip_frac=metrics["dual_clip_frac"], aux_loss=aux,
                                        sequences=mb["sequences"] if aux is not None else None,
                                        attention_mask=mb["attention_mask"] if aux is not None else None,
                                        num_micro_batches=torch.tensor(len(batches)) if aux is not None else None))
        if ptx is not None:
            for mb in micro_batches(ptx, cfg.micro_train_batch_size):
                mb = self._to_device(mb)
                logits = self.model(input_ids=mb["sequences"], attention_mask=mb["attention_mask"],
                                    position_ids=position_ids(mb["attention_mask"])).logits
                lm = masked_lm_loss(logits, mb["sequences"], mb["loss_mask"], num_tokens=max(ptx_tokens, 1.0))
                (cfg.ptx_coef * lm * world).backward()
                if router is not None:
                    router.pop()  # the auxiliary term comes from the policy forwards only
                sums["ptx_loss"] = sums.get("ptx_loss", 0.0) + float(lm.detach()) * num_tokens
        if trace:
            sums["trace"] = trace
        return self._finish_step(sums, dump, "grad_norm", "lr")

    def _finish_step(self, sums: dict[str, Any], dump: list[dict[str, Any]] | None, norm_key: str,
                     lr_key: str) -> dict[str, Any]:
        """The optimizer step; with a dump, its report and the micro-batches go back under `debug`."""
        report: dict[str, float] | None = {} if dump is not None else None
        sums[norm_key] = self.engine.optimizer_step(report)
        sums[lr_key] = self.engine.lr
        if self.ring is not None and self.ring.rank > 0:  # the group's first rank reports its rows' sums
            sums = {k: sums[k] for k in (norm_key, lr_key)}
        if dump is not None:
            sums["debug"] = {"grad_norm": sums[norm_key], **report, "micro_batches": dump}
        return sums

    def _old_log_probs_of_this_policy(self, mb: dict[str, torch.Tensor], log_probs: torch.Tensor) -> torch.Tensor:
        """The training forward's log-probs, detached; a separate no-grad eval pass where dropout makes the training
        forward differ from the policy's (what `log_probs` would have returned before the step)."""
        if not self.has_dropout:
            return log_probs.detach()
        self.model.eval()
        with torch.no_grad():
            old = self._action_log_probs(mb)[0]
        self.model.train()
        return old

    def _rollout_metrics(self, old: torch.Tensor, mb: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rollout metrics make_experience reports when it computes the old log-probs itself: trainer/engine
        mismatch, and with a reference the KL of the policy to it."""
        mask = mb["action_mask"]
        out = {f"rollout/{k}": v for k, v in logprob_mismatch(old, mb["rollout_log_probs"], mask).items()}
        if "ref_log_probs" in mb:
            out["rollout/kl"] = masked_mean(compute_kl(old, mb["ref_log_probs"], mask, self.cfg.kl_estimator), mask)
        return out

    def train_critic_step(self, shard: dict[str, torch.Tensor], num_tokens: float) -> dict[str, float]:
        """One optimizer step of the clipped value loss (token mean over the global mini-batch)."""
        cfg, world = self.cfg, self.loss_scale
        self.model.train()
        sums: dict[str, float] = {}
        dump: list[dict[str, Any]] | None = [] if "row_index" in shard else None  # --debug_dump_steps
        ordered = sort_rows_by_prompt(shard) if cfg.packing_samples else sort_rows_by_length(shard)
        for mb in micro_batches(ordered, cfg.micro_train_batch_size):
            mb = self._to_device(trim_padding(mb))
            values = self._values(mb)
            token_out: dict[str, torch.Tensor] | None = {} if dump is not None else None
            loss, metrics = value_loss(values, mb["values"], mb["returns"], mb["action_mask"],
                                       value_clip=cfg.value_clip, num_tokens=num_tokens, token_out=token_out)
            (loss * world).backward()
            sums["critic_loss"] = sums.get("critic_loss", 0.0) + float(loss.detach()) * num_tokens
            _accumulate(sums, metrics, mb["action_mask"])
            if dump is not None:
                dump.append(_dump_entry(mb, ("row_index", "action_mask", "returns"), values=values,
                                        old_values=mb["values"], value_loss=token_out["loss"], loss=loss,
                                        value_clip_frac=metrics["value_clip_frac"]))
        return self._finish_step(sums, dump, "critic_grad_norm", "critic_lr")

    # ----------------------------------------------------------------- weights and checkpoints
    def state_dict_for_sync(self, adapter: bool = False) -> dict[str, torch.Tensor] | None:
        """Full (unsharded) parameters on CPU, tied ones once (what the broadcast sends too), or with `adapter` only
        the LoRA A/B tensors (--lora_sync adapter); collective, rank 0 returns them, other ranks None."""
        named = self._engine_weights(adapter)
        if self.dist.rank != 0:
            return _drain(named)
        return {name: tensor.cpu() for name, tensor in named}

    def _engine_weights(self, adapter: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """`_weights_for_engines`, without a frozen vision tower (--freeze_vision_tower: the engines keep theirs)."""
        named = _weights_for_engines(self.model, self._engine_dtype(), adapter)
        if keeps_vision_tower(self.cfg):
            from rlhfkit.models.vision import without_vision_tower

            return without_vision_tower(named)
        return named

    def join_weight_group(self, engines: list[Any], backend: str) -> bool:
        """Rank 0 builds the broadcast weight group with `engines` (Ray actor handles), once: a call with the same
        engines and backend reuses it. Other ranks do nothing. Returns whether a group was built."""
        from rlhfkit.rollout.weight_broadcast import WeightBroadcaster

        sender = self.weight_sender
        if self.dist.rank != 0 or (sender is not None and sender.group is not None
                                   and sender.engines == list(engines) and sender.backend == backend):
            return False
        if sender is not None:
            sender.close()
        self.weight_sender = WeightBroadcaster(engines, backend,  # deadline: --remote_call_timeout
                                               timeout_s=getattr(self.cfg, "remote_call_timeout", None))
        return True

    def broadcast_weights(self, bucket_bytes: int, adapter: bool = False) -> SyncStats | None:
        """Collective: every rank gathers the full parameters one at a time (FSDP2 all-gather); rank 0 broadcasts
        them to the engines over the weight group (`join_weight_group` first) and returns the `SyncStats`. With
        `adapter` only the LoRA A/B tensors travel (--lora_sync adapter)."""
        named = self._engine_weights(adapter)
        if self.dist.rank != 0:
            return _drain(named)
        try:
            return self.weight_sender.sync(named, bucket_bytes, lora_config=self.lora_config() if adapter else None,
                                           keep_vision_tower=keeps_vision_tower(self.cfg))
        except BaseException:  # an engine fault: finish the gathers, so the other ranks are not left in a collective
            _drain(named)
            raise

    def lora_config(self) -> dict[str, Any]:
        """The actor's LoRA adapter config (peft's, JSON-ready): what an adapter-only sync hands the engines."""
        from rlhfkit.rollout.lora_sync import adapter_config

        return adapter_config(self.model)

    def _engine_dtype(self) -> torch.dtype | None:
        """The rollout engines' dtype (--vllm_dtype, resolved by the driver): weights travel in it, so a bf16 engine
        gets half the bytes and no side casts when trainer and engine agree."""
        from rlhfkit.engine.precision import TORCH_DTYPES

        return TORCH_DTYPES.get(getattr(self.cfg, "vllm_dtype", None) or "")

    def save_checkpoint(self, path: str, step: int, trainer_state: dict[str, Any], max_keep: int) -> str:
        return str(save_checkpoint(path, step, self.model, self.engine.optimizer, self.engine.scheduler,
                                   trainer_state, max_keep, extra_state=self._ema_state()))

    def load_checkpoint(self, path: str) -> dict[str, Any] | None:
        return load_checkpoint(path, self.model, self.engine.optimizer, self.engine.scheduler, seed=self.cfg.seed,
                               extra_state=self._ema_state())

    def _ema_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        return {"ema": self.engine.ema.state_dict()} if self.engine.ema is not None else None

    def save_hf(self, out_dir: str, tokenizer_spec: str, extra_config: dict[str, Any] | None = None) -> None:
        """The HF folder of this model; with --enable_ema (actor), of its EMA weights (what OpenRLHF saves)."""
        from rlhfkit.models.loading import load_tokenizer

        ema = self.engine.ema if self.engine is not None else None
        save_hf_folder(self.model, load_tokenizer(tokenizer_spec), out_dir, extra_config,
                       weights=ema.full_state() if ema is not None else None)
        if self.dist.rank == 0 and is_vision_language(tokenizer_spec):  # the image processor beside the weights
            from rlhfkit.models.vision import load_processor

            load_processor(tokenizer_spec).save_pretrained(out_dir)


def _pad_to(values: torch.Tensor, width: int) -> torch.Tensor:
    """[b, r] per-response-token values of a trimmed micro-batch back to the batch's response width (0 beyond)."""
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))


def has_active_dropout(model: torch.nn.Module) -> bool:
    """Whether a training forward is random: a Dropout module with p > 0 (LoRA's too), or a config dropout rate > 0
    (attention dropout is functional in most HF models, not a module)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    rates = {k: v for k, v in (vars(config) if config is not None else {}).items()
             if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return any(v > 0 for v in rates.values())


def _full_named_parameters(model: torch.nn.Module, only: Callable[[str], bool] | None = None,
                            ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) per parameter (those whose name passes `only`), tied ones once; gathering a sharded
    (DTensor) one is a collective, so every rank must consume this to the end. CPU-offloaded shards visit the mesh's
    device for the gather."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        if only is not None and not only(name):
            continue
        tensor = param.detach()
        if getattr(param, "quant_state", None) is not None:  # --load_in_4bit: the engines get dequantized weights
            import bitsandbytes.functional as bnb_functional

            tensor = bnb_functional.dequantize_4bit(param.data, param.quant_state).to(torch.float32)
        elif isinstance(tensor, DTensor):
            if tensor.device.type != tensor.device_mesh.device_type:
                tensor = tensor.to(tensor.device_mesh.device_type)
            tensor = tensor.full_tensor()
        yield name, tensor


def _weights_for_engines(model: torch.nn.Module, dtype: torch.dtype | None = None, adapter: bool = False,
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """What the rollout engines load: full parameters under HF names, LoRA adapters merged into their layers, floating
    tensors in the engines' `dtype` (None: as they are). `adapter`: only the LoRA A/B tensors, under their
    saved-adapter names (only those are gathered)."""
    from rlhfkit.models.lora import merged_weights
    from rlhfkit.rollout.lora_sync import adapter_weights, is_adapter_tensor

    if adapter:
        named = adapter_weights(_full_named_parameters(model, is_adapter_tensor))
    else:
        named = merged_weights(model, _full_named_parameters(model))
    for name, tensor in named:
        yield name, tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _drain(named: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Take part in every gather of `_full_named_parameters` (ranks other than 0 keep nothing)."""
    for _ in named:
        pass


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)


def _dump_entry(mb: dict[str, torch.Tensor], keys: tuple[str, ...], **tensors: Any) -> dict[str, Any]:
    """One micro-batch of a --debug_dump_steps step: `keys` of `mb` (those present) and `tensors` (None left out),
    detached on CPU."""
    out = {k: mb[k] for k in keys if k in mb}
    out.update({k: v for k, v in tensors.items() if v is not None})
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def _accumulate(sums: dict[str, float], metrics: dict[str, torch.Tensor], mask: torch.Tensor) -> None:
    """Token-weighted sums of per-micro-batch means (the driver divides by the global token count)."""
    merge_metrics(sums, metrics, weight=float(mask.sum()))
