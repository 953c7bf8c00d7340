"""One rank of a model group (actor, reference, critic, reward): a Ray actor that joins its group's process group
with the same env vars torchrun sets, so the FSDP2 engine code is the one the offline trainers use.

Memory between phases (CUDA only; on CPU every state already lives in host RAM and these are no-ops):
`offload_states` / `reload_states` move a trainer's parameters, gradients and optimizer state to host RAM and back
(`--fsdp_enable_offload`); frozen models (reference, reward) with `--ref_reward_offload` keep their parameters in host
RAM and visit the device only for their forwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from rlhfkit.algorithms.kl import compute_kl
from rlhfkit.algorithms.normalize import masked_mean
from rlhfkit.algorithms.offpolicy import logprob_mismatch
from rlhfkit.algorithms.supervised import masked_lm_loss
from rlhfkit.algorithms.value_loss import value_loss
from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.plan import RunPlan, resolve_plan
from rlhfkit.engine.checkpoint import load_checkpoint, save_checkpoint, save_hf_folder
from rlhfkit.engine.cpu_threads import set_cpu_threads
from rlhfkit.engine.distributed import init_distributed
from rlhfkit.engine.ema import resolved_ema_beta
from rlhfkit.engine.fsdp import shard_model
from rlhfkit.engine.host_memory import retain_freed_host_memory
from rlhfkit.engine.train_engine import TrainEngine
from rlhfkit.models.logprobs import SamplingTruncation
from rlhfkit.models.positions import position_ids
from rlhfkit.rl.experience import trim_padding
from rlhfkit.rl.forward import ForwardStrategy, LogProbs, forward_strategy
from rlhfkit.rl.micro_batch import micro_batches, pad_to, rollout_budget
from rlhfkit.rl.policy_step import (
    PolicyBatch,
    PolicyLoss,
    accumulate,
    dump_entry,
    has_active_dropout,
    policy_dump_entry,
)
from rlhfkit.rl.ring import setup_worker_ring
from rlhfkit.rl.vision_batch import is_vision_language, keeps_vision_tower, load_vlm_for_role
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
    """A rank of a model group. `role` is 'actor', 'ref', 'critic' or 'reward'; `cfg` is the run's typed config and
    `plan` the run's plan (`rlhfkit.config.plan.RunPlan`: the dtypes, the run folder, the KL mode, the world sizes;
    Ray pickles both to this process; without one, a rank made directly from flags plans from them alone);
    `cpu_threads_share`: the model ranks that split a node's cores on CPU (0: this role's ranks per node);
    `heartbeat_board`: the job's heartbeat board, beaten to from a thread of this process every few seconds so a
    stopped rank is found (`rlhfkit.rollout.heartbeat`; None: no beats). Every method runs on the process's main
    thread."""

    model: torch.nn.Module  # set by init_model
    forward: ForwardStrategy  # how the model runs over a micro-batch: chosen once by init_model (rl/forward.py)

    def __init__(self, role: str, cfg: PPOConfig, rank: int, world_size: int, master_addr: str,
                 master_port: int, cpu_threads_share: int = 0, heartbeat_board: Any = None,
                 plan: RunPlan | None = None) -> None:
        from rlhfkit.observability.run import process_log_path, redirect_output
        from rlhfkit.rollout.heartbeat import Heartbeat, beat_interval

        self.heartbeat = Heartbeat(heartbeat_board, beat_interval(cfg.trainer_hang_timeout)) \
            if heartbeat_board is not None and cfg.trainer_hang_timeout > 0 else None  # first: beats from here on

        plan = plan if plan is not None else resolve_plan(cfg)
        log_path = process_log_path(plan.run_dir, cfg.verbose, f"{role}_rank{rank}")
        if log_path:  # this rank's library logs go to the run folder, not the driver's console
            redirect_output(log_path)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0" if not torch.cuda.is_available()
                          else os.environ.get("LOCAL_RANK", "0"), MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        if not torch.cuda.is_available():  # Ray gave this actor OMP_NUM_THREADS=1 (it asks for a fraction of a CPU)
            nodes = plan.nodes(role)
            share = cpu_threads_share or max(1, world_size // max(1, nodes or 1))
            set_cpu_threads(cfg.torch_threads_per_worker or 0, share)
            retain_freed_host_memory()  # each step's tensors reuse the last step's memory (engine/host_memory.py)
        self.role = role
        self.cfg = cfg
        self.plan = plan
        self.policy_loss = PolicyLoss.from_plan(cfg, plan)  # the actor's loss, its settings fixed once
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
        vision = False
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

            vision = is_vision_language(pretrain)
            if vision:  # --image_key runs (rl/vision_batch.py)
                model = load_vlm_for_role(pretrain, attn, trainable, self.cfg)
            else:
                model = load_causal_lm(pretrain, attn_implementation=attn, load_in_4bit=quantized,
                                       compute_dtype=compute_dtype(self.plan.trainer_dtype, self.dist.device))
        self.forward = forward_strategy(self.cfg, ring=self.ring, vision=vision, truncation=self.truncation,
                                        mask_dtype=self._mask_dtype())
        self.forward.prepare(model)
        if reward_model and self.cfg.normalize_reward:
            from rlhfkit.rewards.reward_model import reward_stats

            self.reward_mean, self.reward_std = reward_stats(model.config, pretrain)
        if trainable:
            if self.cfg.lora_rank > 0:  # the engines get merged weights (rl/worker_weights.py)
                from rlhfkit.models.lora import apply_lora

                model = apply_lora(cast("PreTrainedModel", model), self.cfg.lora_rank, self.cfg.lora_alpha,
                                   self.cfg.target_modules, self.cfg.lora_dropout)
            ema_beta = resolved_ema_beta(self.cfg) if self.role == "actor" else None  # --enable_ema: the actor's
            # the engine reads the compute dtype from its config: the plan's, resolved by the driver
            engine_cfg = dataclasses.replace(self.cfg, param_dtype=self.plan.trainer_dtype)
            self.engine = TrainEngine(model, engine_cfg, self.dist, total_steps, learning_rate, role=self.role,
                                      ema_beta=ema_beta)
            self.model = self.engine.model
            self.has_dropout = has_active_dropout(model)
        else:
            model.requires_grad_(False)
            if self.ring is not None:  # the reference: sequences split over the ring group
                from rlhfkit.models.context_parallel import use_ring_attention

                use_ring_attention(model)
            self.model = shard_model(model, zero_stage=3, device=self.dist.device, param_dtype=self.plan.trainer_dtype)
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
    def _mask_dtype(self) -> torch.dtype:
        """The packed row's additive mask is in the compute dtype (sdpa takes no other)."""
        from rlhfkit.engine.fsdp import compute_dtype

        return compute_dtype(self.plan.trainer_dtype, self.dist.device)

    def _action_log_probs(self, mb: dict[str, torch.Tensor], with_entropy: bool = False) -> LogProbs:
        return self.forward.action_log_probs(self.model, mb, with_entropy)

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
        time (packed: all in one row), as the engines' `score` computes it (the weight-sync check,
        `rlhfkit.rl.sync_check`); collective over the group's ranks."""
        self.model.eval()
        with self._frozen_on_device():
            return self.forward.probe_log_probs(self.model, prompts, responses, self.dist.device)

    @torch.no_grad()
    def rewards(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Reward model: the `score` head at the last real token of each row (`sequences` / `attention_mask`, any
        padding side), normalised with the stored statistics under --normalize_reward. Float32 [B]."""
        self.model.eval()
        out = []
        with self._frozen_on_device():
            for mb in micro_batches(batch, self.cfg.micro_rollout_batch_size, rollout_budget(self.cfg)):
                last = self.forward.rewards(self.model, self._to_device(mb))
                out.append(((last.float() - self.reward_mean) / self.reward_std).cpu())
        return torch.cat(out)

    def _values(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.forward.values(self.model, mb)

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
               + kl_coef * kl_loss (with --use_kl_loss; kl_coef is the adaptive controller's value with --kl_target,
                 else the plan's --init_kl_coef) - entropy_loss_coef * entropy  (rlhfkit.rl.policy_step.PolicyLoss)
               + ptx_coef * LM loss on this rank's share of a --pretrain_data batch (token mean over the global
                 ptx batch, `ptx_tokens` target tokens), when `ptx` is given.
        FSDP2 averages gradients over ranks, so each rank's loss is scaled by the world size (with --ring_attn_size N
        by world / N, the data-parallel size: rlhfkit.rl.ring). `debug_dump` (--debug_dump_steps): each
        micro-batch's tensors come back under `debug` (rl/debug_dump.py).
        """
        cfg, world, engine = self.cfg, self.loss_scale, self._trainer()
        kl_coef = self.plan.kl_coef(kl_coef)
        self.model.train()
        sums: dict[str, Any] = {}
        dump: list[dict[str, Any]] | None = [] if debug_dump else None  # --debug_dump_steps
        trace: list[tuple[torch.Tensor, torch.Tensor]] = []
        budget = cfg.train_max_tokens_per_gpu if cfg.use_dynamic_batch else None
        router = engine.aux_loss  # --aux_loss_coef on an MoE actor: the router load-balancing loss
        # Packed micro-batches keep a prompt's samples together (its tokens are computed once); padded ones are
        # sorted by length so trim_padding cuts more (the strategy's order).
        ordered = self.forward.order(shard)
        batches = list(micro_batches(ordered, cfg.micro_train_batch_size, budget))
        for mb in batches:
            mb = self._to_device(trim_padding(mb))
            mask = mb["action_mask"]
            # --entropy_loss_coef: the bonus -c x mean entropy is differentiated (else the entropy is a metric)
            log_probs, entropy = self.forward.action_log_probs(self.model, mb, with_entropy=True,
                                                               entropy_grad=bool(self.policy_loss.entropy_coef))
            assert entropy is not None  # with_entropy
            aux = router.pop() if router is not None else None
            old = mb.get("old_log_probs")
            if old is None:  # one optimizer step per rollout: the old policy is this one (make_experience)
                old = self._old_log_probs_of_this_policy(mb, log_probs)
                accumulate(sums, self._rollout_metrics(old, mb), mask)
                if "row_index" in mb:  # the per-sample trace (observability/trace.py): |engine - trainer| per token
                    trace.append((mb["row_index"].cpu(), ((old - mb["rollout_log_probs"]).abs() * mask).cpu()))
            out = self.policy_loss(PolicyBatch.of(mb, log_probs, entropy, old), sums, num_tokens=num_tokens,
                                   num_seqs=num_seqs, kl_coef=kl_coef, aux=aux, aux_coef=engine.aux_loss_coef,
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
            out["rollout/kl"] = masked_mean(compute_kl(old, mb["ref_log_probs"], mask, self.plan.kl_estimator), mask)
        return out

    def train_critic_step(self, shard: dict[str, torch.Tensor], num_tokens: float,
                          debug_dump: bool = False) -> dict[str, float]:
        """One optimizer step of the clipped value loss (token mean over the global mini-batch); `debug_dump`: see
        `train_policy_step`."""
        cfg, world = self.cfg, self.loss_scale
        self.model.train()
        sums: dict[str, float] = {}
        dump: list[dict[str, Any]] | None = [] if debug_dump else None  # --debug_dump_steps
        ordered = self.forward.order(shard)
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
        named = weights_for_engines(self.model, engine_dtype(self.plan.engine_dtype), adapter)
        if keeps_vision_tower(self.cfg, self.plan.model_path):
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
                                           keep_vision_tower=keeps_vision_tower(self.cfg, self.plan.model_path))
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
