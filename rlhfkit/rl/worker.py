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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from rlhfkit.algorithms.entropy import entropy_from_logits
from rlhfkit.algorithms.kl import compute_kl
from rlhfkit.algorithms.normalize import masked_mean
from rlhfkit.algorithms.offpolicy import logprob_mismatch
from rlhfkit.algorithms.supervised import masked_lm_loss
from rlhfkit.algorithms.value_loss import value_loss
from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.plan import role_layout
from rlhfkit.engine.checkpoint import load_checkpoint, save_checkpoint, save_hf_folder
from rlhfkit.engine.cpu_threads import set_cpu_threads
from rlhfkit.engine.distributed import init_distributed
from rlhfkit.engine.ema import resolved_ema_beta
from rlhfkit.engine.fsdp import shard_model
from rlhfkit.engine.train_engine import TrainEngine
from rlhfkit.models.logprobs import SamplingTruncation, log_probs_from_logits
from rlhfkit.models.positions import position_ids
from rlhfkit.rl.experience import sort_rows_by_length, sort_rows_by_prompt, trim_padding
from rlhfkit.rl.micro_batch import micro_batches, pad_to, rollout_budget
from rlhfkit.rl.packing import (
    PackedRollout,
    pack_rollout,
    pack_scored_rows,
    packed_response_log_probs,
    packed_scalar_outputs,
)
from rlhfkit.rl.policy_step import accumulate, dump_entry, has_active_dropout, policy_dump_entry, policy_loss
from rlhfkit.rl.ring import ring_packed_log_probs, ring_response_log_probs, setup_worker_ring
from rlhfkit.rl.vision_batch import is_vision_language, keeps_vision_tower, load_vlm_for_role, pixel_inputs
from rlhfkit.rl.worker_weights import drain, engine_dtype, move_optimizer_state, weights_for_engines
from rlhfkit.rollout.types import SyncStats

if TYPE_CHECKING:
    from transformers import PreTrainedModel



def logprob_truncation(cfg: PPOConfig) -> SamplingTruncation | None:
    """The truncation the trainer applies to its log-probs (actor: old and current; reference): the engines' top-k /
    top-p (`--top_k --top_p`) with `--logprobs_truncation auto`, None with `off` or when nothing is cut. The set of
    each position is the model's own nucleus of its tempered logits, as vLLM computes it from the same weights
    (`rlhfkit.models.logprobs.nucleus_log_norm`; docs/rollout.md)."""
    if cfg.logprobs_truncation == "off":
        return None
    truncation = SamplingTruncation(top_k=cfg.top_k, top_p=cfg.top_p)
    return truncation if truncation.active else None


class ModelWorker:
    """A rank of a model group. `role` is 'actor', 'ref', 'critic' or 'reward'; `cfg` is the run's typed config (Ray
    pickles it to this process); `cpu_threads_share`: the model ranks that split a node's cores on CPU (0: this
    role's ranks per node); `heartbeat_board`: the job's heartbeat board, beaten to from a thread of this process
    every few seconds so a stopped rank is found (`rlhfkit.rollout.heartbeat`; None: no beats). Every method runs
    on the process's main thread."""

    model: torch.nn.Module  # set by init_model

    def __init__(self, role: str, cfg: PPOConfig, rank: int, world_size: int, master_addr: str,
                 master_port: int, cpu_threads_share: int = 0, heartbeat_board: Any = None) -> None:
        from rlhfkit.observability.run import process_log_path, redirect_output
        from rlhfkit.rollout.heartbeat import Heartbeat, beat_interval

        self.heartbeat = Heartbeat(heartbeat_board, beat_interval(cfg.trainer_hang_timeout)) \
            if heartbeat_board is not None and cfg.trainer_hang_timeout > 0 else None  # first: beats from here on

        log_path = process_log_path(cfg.run_dir, cfg.verbose, f"{role}_rank{rank}")
        if log_path:  # this rank's library logs go to the run folder, not the driver's console
            redirect_output(log_path)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0" if not torch.cuda.is_available()
                          else os.environ.get("LOCAL_RANK", "0"), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if not torch.cuda.is_available():  # Ray gave this actor OMP_NUM_THREADS=1 (it asks for a fraction of a CPU)
            nodes = {name: count for name, count, _ in role_layout(cfg)}[role]
            share = cpu_threads_share or max(1, world_size // max(1, nodes or 1))
            set_cpu_threads(cfg.torch_threads_per_worker or 0, share)
        self.role = role
        self.cfg = cfg
        self.dist = init_distributed()
        self.truncation = logprob_truncation(cfg)  # --top_k / --top_p with --logprobs_truncation auto
        self.ring = setup_worker_ring(role, self.cfg)  # --ring_attn_size: actor, reference, critic (rl/ring.py)
        # FSDP2 averages gradients over the world; a ring group's ranks share one loss (rl/ring.py: the scale)
        self.loss_scale = self.dist.world_size // (self.ring.size if self.ring is not None else 1)
        self.engine: TrainEngine | None = None
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
        model: torch.nn.Module
        if scalar_head or reward_model:
            with torch.random.fork_rng(devices=[]):  # a fresh critic head: the same on every rank, whatever its count
                torch.manual_seed(self.cfg.seed)
                model = load_scalar_model(pretrain, init_from_causal=not reward_model, attn_implementation=attn)
        else:
            quantized = trainable and self.cfg.load_in_4bit  # QLoRA actor
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
        if reward_model and self.cfg.normalize_reward:
            from rlhfkit.rewards.reward_model import reward_stats

            self.reward_mean, self.reward_std = reward_stats(model.config, pretrain)
        if trainable:
            if self.cfg.lora_rank > 0:  # the engines get merged weights (rl/worker_weights.py)
                from rlhfkit.models.lora import apply_lora

                model = apply_lora(cast("PreTrainedModel", model), self.cfg.lora_rank, self.cfg.lora_alpha,
                                   self.cfg.target_modules, self.cfg.lora_dropout)
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
            self.offload_frozen = self.cfg.ref_reward_offload and self._on_cuda()
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
            move_optimizer_state(self.engine.optimizer, "cpu")
        self._move_model("cpu")
        self.offloaded = True
        return True

    def reload_states(self) -> bool:
        """Undo `offload_states`."""
        if not self.offloaded:
            return False
        self._move_model(self.dist.device)
        if self.engine is not None:
            move_optimizer_state(self.engine.optimizer, self.dist.device)
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
        truncation = self.truncation
        if self.ring is not None and self.cfg.packing_samples:  # --ring_attn_size: rl/ring.py
            return ring_packed_log_probs(self.model, self._pack(mb), self.cfg.temperature, self.ring, with_entropy,
                                         truncation=truncation)
        if self.ring is not None:
            return ring_response_log_probs(self.model, seq, mask, width, self.cfg.temperature, self.ring, with_entropy,
                                           truncation=truncation)
        if self.cfg.packing_samples:  # one packed row, each shared prompt once (rl/packing.py)
            return packed_response_log_probs(self.model, self._pack(mb), self.cfg.temperature,
                                             mask_dtype=self._mask_dtype(), with_entropy=with_entropy,
                                             truncation=truncation)
        # Only the positions that predict response tokens need the (vocab-sized) LM head.
        logits = self.model(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                            logits_to_keep=width + 1, **pixel_inputs(mb)).logits
        logits = logits[:, :-1].float() / self.cfg.temperature
        log_probs = log_probs_from_logits(logits, seq[:, -width:], truncation=truncation)
        entropy = entropy_from_logits(logits.detach()) if with_entropy else None
        return log_probs, entropy

    @torch.no_grad()
    def log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token log-probs of the response tokens, [B, R] (sampling temperature applied to the logits)."""
        self.model.eval()
        width = batch["action_mask"].shape[1]
        with self._frozen_on_device():
            out = [pad_to(self._action_log_probs(self._to_device(trim_padding(mb)))[0].cpu(), width)
                   for mb in micro_batches(batch, self.cfg.micro_rollout_batch_size, rollout_budget(self.cfg))]
        return torch.cat(out)

    @torch.no_grad()
    def probe_log_probs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """log softmax(logits)[token] at temperature 1 of each response token after its prompt, one sequence at a
        time, as the engines' `score` computes it (the weight-sync check, `rlhfkit.rl.sync_check`); collective over
        the group's ranks."""
        self.model.eval()
        scores = []
        with self._frozen_on_device():
            for prompt_ids, response_ids in zip(prompts, responses, strict=True):
                seq = torch.tensor([list(prompt_ids) + list(response_ids)], device=self.dist.device)
                mask = torch.ones_like(seq)
                if self.ring is not None:
                    scores.append(ring_response_log_probs(self.model, seq, mask, len(response_ids), 1.0,
                                                          self.ring)[0][0].cpu().tolist())
                    continue
                logits = self.model(input_ids=seq, attention_mask=mask, position_ids=position_ids(mask),
                                    logits_to_keep=len(response_ids) + 1).logits
                scores.append(log_probs_from_logits(logits[:, :-1].float(),
                                                    seq[:, -len(response_ids):])[0].cpu().tolist())
        return scores

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
        out = [pad_to(self._values(self._to_device(trim_padding(mb))).cpu(), width) for mb in chunks]
        return torch.cat(out)

    # ----------------------------------------------------------------- training
    def train_policy_step(self, shard: dict[str, torch.Tensor], num_tokens: float,
                          ptx: dict[str, torch.Tensor] | None = None, ptx_tokens: float = 0.0, *,
                          num_seqs: float | None = None, kl_coef: float | None = None,
                          debug_dump: bool = False) -> dict[str, Any]:
        """One optimizer step of the PPO-family policy loss over this rank's share of a global mini-batch.

        loss = policy_loss (token mean over the whole global mini-batch: num_tokens is its token count; with
                 --policy_loss_type gspo the mean per sequence, then over its num_seqs rows)
               + kl_coef * kl_loss (with --use_kl_loss; kl_coef is --init_kl_coef or the adaptive controller's
                 value with --kl_target) - entropy_loss_coef * entropy  (rlhfkit.rl.policy_step.policy_loss)
               + ptx_coef * LM loss on this rank's share of a --pretrain_data batch (token mean over the global
                 ptx batch, `ptx_tokens` target tokens), when `ptx` is given.
        FSDP2 averages gradients over ranks, so each rank's loss is scaled by the world size (with --ring_attn_size N
        by world / N, the data-parallel size: rlhfkit.rl.ring). `debug_dump` (--debug_dump_steps): each
        micro-batch's tensors come back under `debug` (rl/debug_dump.py).
        """
        cfg, world, engine = self.cfg, self.loss_scale, self._trainer()
        kl_coef = cfg.init_kl_coef if kl_coef is None else kl_coef
        self.model.train()
        sums: dict[str, Any] = {}
        dump: list[dict[str, Any]] | None = [] if debug_dump else None  # --debug_dump_steps
        trace: list[tuple[torch.Tensor, torch.Tensor]] = []
        budget = cfg.train_max_tokens_per_gpu if cfg.use_dynamic_batch else None
        router = engine.aux_loss  # --aux_loss_coef on an MoE actor: the router load-balancing loss
        # Packed micro-batches keep a prompt's samples together (its tokens are computed once); padded ones are
        # sorted by length so trim_padding cuts more.
        ordered = sort_rows_by_prompt(shard) if cfg.packing_samples else sort_rows_by_length(shard)
        batches = list(micro_batches(ordered, cfg.micro_train_batch_size, budget))
        for mb in batches:
            mb = self._to_device(trim_padding(mb))
            mask = mb["action_mask"]
            log_probs, entropy = self._action_log_probs(mb, with_entropy=True)
            assert entropy is not None  # with_entropy
            aux = router.pop() if router is not None else None
            old = mb.get("old_log_probs")
            if old is None:  # one optimizer step per rollout: the old policy is this one (make_experience)
                old = self._old_log_probs_of_this_policy(mb, log_probs)
                accumulate(sums, self._rollout_metrics(old, mb), mask)
                if "row_index" in mb:  # the per-sample trace (observability/trace.py): |engine - trainer| per token
                    trace.append((mb["row_index"].cpu(), ((old - mb["rollout_log_probs"]).abs() * mask).cpu()))
            out = policy_loss(cfg, mb, log_probs, entropy, old, sums, num_tokens=num_tokens, num_seqs=num_seqs,
                              kl_coef=kl_coef, aux=aux, aux_coef=engine.aux_loss_coef,
                              aux_share=len(batches) * world, with_tokens=dump is not None)
            (out.loss * world).backward()
            sums["policy_loss"] = sums.get("policy_loss", 0.0) + float(out.loss.detach()) * num_tokens
            sums["entropy"] = sums.get("entropy", 0.0) + float(out.entropy_mean) * num_tokens
            accumulate(sums, out.metrics, mask)
            if dump is not None:
                dump.append(policy_dump_entry(mb, out, old, log_probs, entropy, aux, len(batches)))
        if ptx is not None:
            self._ptx_backward(ptx, ptx_tokens, num_tokens, sums, router)
        if trace:
            sums["trace"] = trace
        return self._finish_step(sums, dump, "grad_norm", "lr")

    def _ptx_backward(self, ptx: dict[str, torch.Tensor], ptx_tokens: float, num_tokens: float,
                      sums: dict[str, Any], router: Any) -> None:
        """The gradient of ptx_coef * LM loss (token mean over the global ptx batch's `ptx_tokens` target tokens) of
        this rank's share of a --pretrain_data batch; the router's auxiliary terms of these forwards are dropped."""
        for mb in micro_batches(ptx, self.cfg.micro_train_batch_size):
            mb = self._to_device(mb)
            logits = self.model(input_ids=mb["sequences"], attention_mask=mb["attention_mask"],
                                position_ids=position_ids(mb["attention_mask"])).logits
            lm = masked_lm_loss(logits, mb["sequences"], mb["loss_mask"], num_tokens=max(ptx_tokens, 1.0))
            (self.cfg.ptx_coef * lm * self.loss_scale).backward()
            if router is not None:
                router.pop()  # the auxiliary term comes from the policy forwards only
            sums["ptx_loss"] = sums.get("ptx_loss", 0.0) + float(lm.detach()) * num_tokens

    def _trainer(self) -> TrainEngine:
        """The optimizer side of a trainable rank (actor, critic)."""
        if self.engine is None:
            raise RuntimeError(f"the {self.role} rank is frozen: it has no optimizer (init_model trainable=False)")
        return self.engine

    def _finish_step(self, sums: dict[str, Any], dump: list[dict[str, Any]] | None, norm_key: str,
                     lr_key: str) -> dict[str, Any]:
        """The optimizer step; with a dump, its report and the micro-batches go back under `debug`."""
        report: dict[str, float] | None = {} if dump is not None else None
        engine = self._trainer()
        sums[norm_key] = engine.optimizer_step(report)
        sums[lr_key] = engine.lr
        if self.ring is not None and self.ring.rank > 0:  # the group's first rank reports its rows' sums
            sums = {k: sums[k] for k in (norm_key, lr_key)}
        if dump is not None and report is not None:
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

    def train_critic_step(self, shard: dict[str, torch.Tensor], num_tokens: float,
                          debug_dump: bool = False) -> dict[str, float]:
        """One optimizer step of the clipped value loss (token mean over the global mini-batch); `debug_dump`: see
        `train_policy_step`."""
        cfg, world = self.cfg, self.loss_scale
        self.model.train()
        sums: dict[str, float] = {}
        dump: list[dict[str, Any]] | None = [] if debug_dump else None  # --debug_dump_steps
        ordered = sort_rows_by_prompt(shard) if cfg.packing_samples else sort_rows_by_length(shard)
        for mb in micro_batches(ordered, cfg.micro_train_batch_size):
            mb = self._to_device(trim_padding(mb))
            values = self._values(mb)
            token_out: dict[str, torch.Tensor] | None = {} if dump is not None else None
            loss, metrics = value_loss(values, mb["values"], mb["returns"], mb["action_mask"],
                                       value_clip=cfg.value_clip, num_tokens=num_tokens, token_out=token_out)
            (loss * world).backward()
            sums["critic_loss"] = sums.get("critic_loss", 0.0) + float(loss.detach()) * num_tokens
            accumulate(sums, metrics, mb["action_mask"])
            if dump is not None and token_out is not None:
                dump.append(dump_entry(mb, ("row_index", "action_mask", "returns"), values=values,
                                       old_values=mb["values"], value_loss=token_out["loss"], loss=loss,
                                       value_clip_frac=metrics["value_clip_frac"]))
        return self._finish_step(sums, dump, "critic_grad_norm", "critic_lr")

    # ----------------------------------------------------------------- weights and checkpoints
    def state_dict_for_sync(self, adapter: bool = False) -> dict[str, torch.Tensor] | None:
        """Full (unsharded) parameters on CPU, tied ones once (what the broadcast sends too), or with `adapter` only
        the LoRA A/B tensors (--lora_sync adapter); collective, rank 0 returns them, other ranks None."""
        named = self._engine_weights(adapter)
        if self.dist.rank != 0:
            drain(named)
            return None
        return {name: tensor.cpu() for name, tensor in named}

    def _engine_weights(self, adapter: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """`_weights_for_engines`, without a frozen vision tower (--freeze_vision_tower: the engines keep theirs)."""
        named = weights_for_engines(self.model, engine_dtype(self.cfg.vllm_dtype), adapter)
        if keeps_vision_tower(self.cfg):
            from rlhfkit.models.vision import without_vision_tower

            return without_vision_tower(named)
        return named

    def join_weight_group(self, engines: list[Any], backend: str) -> bool:
        """Rank 0 builds the broadcast weight group with `engines` (Ray actor handles), once: a call with the same
        engines and backend reuses it. Other ranks do nothing. Returns whether a group was built."""
        from rlhfkit.rollout.remote import set_engine_hang_timeout
        from rlhfkit.rollout.weight_broadcast import WeightBroadcaster

        set_engine_hang_timeout(self.cfg.engine_hang_timeout)  # this rank's waits on the engines probe them too
        sender = self.weight_sender
        if self.dist.rank != 0 or (sender is not None and sender.group is not None
                                   and sender.engines == list(engines) and sender.backend == backend):
            return False
        if sender is not None:
            sender.close()
        self.weight_sender = WeightBroadcaster(engines, backend,  # deadline: --remote_call_timeout
                                               timeout_s=self.cfg.remote_call_timeout)
        return True

    def broadcast_weights(self, bucket_bytes: int, adapter: bool = False) -> SyncStats | None:
        """Collective: every rank gathers the full parameters one at a time (FSDP2 all-gather); rank 0 broadcasts
        them to the engines over the weight group (`join_weight_group` first) and returns the `SyncStats`. With
        `adapter` only the LoRA A/B tensors travel (--lora_sync adapter)."""
        named = self._engine_weights(adapter)
        if self.dist.rank != 0:
            drain(named)
            return None
        try:
            return self.weight_sender.sync(named, bucket_bytes, lora_config=self.lora_config() if adapter else None,
                                           keep_vision_tower=keeps_vision_tower(self.cfg))
        except BaseException:  # an engine fault: finish the gathers, so the other ranks are not left in a collective
            drain(named)
            raise

    def lora_config(self) -> dict[str, Any]:
        """The actor's LoRA adapter config (peft's, JSON-ready): what an adapter-only sync hands the engines."""
        from rlhfkit.rollout.lora_sync import adapter_config

        return adapter_config(self.model)

    def save_checkpoint(self, path: str, step: int, trainer_state: dict[str, Any], max_keep: int) -> str:
        engine = self._trainer()
        return str(save_checkpoint(path, step, engine.state_model, engine.optimizer, engine.scheduler,
                                   trainer_state, max_keep, extra_state=self._ema_state()))

    def load_checkpoint(self, path: str) -> dict[str, Any] | None:
        engine = self._trainer()
        state = load_checkpoint(path, engine.state_model, engine.optimizer, engine.scheduler, seed=self.cfg.seed,
                                extra_state=self._ema_state())
        engine.after_load()
        return state

    def _ema_state(self) -> dict[str, dict[str, torch.Tensor]] | None:
        ema = self._trainer().ema
        return {"ema": ema.state_dict()} if ema is not None else None

    def save_hf(self, out_dir: str, tokenizer_spec: str, extra_config: dict[str, Any] | None = None) -> None:
        """The HF folder of this model; with --enable_ema (actor), of its EMA weights (what OpenRLHF saves)."""
        from rlhfkit.models.loading import load_tokenizer

        ema = self.engine.ema if self.engine is not None else None
        weights = self.engine.state_model if self.engine is not None else self.model  # fp32 masters where kept
        save_hf_folder(weights, load_tokenizer(tokenizer_spec), out_dir, extra_config,
                       weights=ema.full_state() if ema is not None else None)
        if self.dist.rank == 0 and is_vision_language(tokenizer_spec):  # the image processor beside the weights
            from rlhfkit.models.vision import load_processor

            load_processor(tokenizer_spec).save_pretrained(out_dir)
