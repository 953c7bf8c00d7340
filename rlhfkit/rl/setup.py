"""Set-up of an online run: Ray, data, model groups and their placement, rollout engines, rewards, resume.

Placement: every role is a `ModelGroup` of `--<role>_num_nodes x --<role>_num_gpus_per_node` ranks in a Ray
placement group. `--colocate_actor_ref` puts the reference on the actor's bundles, `--colocate_critic_reward` the
reward model(s) on the critic's, `--colocate_all_models` every model and the vLLM engines on the actor's; roles on
the same bundles split it (a fraction of a GPU each, or of the bundle's logical CPU).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from rlhfkit.agents.environment import AgentSpec, load_agent
from rlhfkit.algorithms.rewards import AdaptiveKLController, FixedKLController
from rlhfkit.config.commands import PPOConfig
from rlhfkit.config.optim_options import validate_optim
from rlhfkit.config.parse import config_to_dict
from rlhfkit.config.plan import RLPlan, resolve_plan
from rlhfkit.config.validate import require
from rlhfkit.data.prompts import build_prompt_samples
from rlhfkit.data.readers import blend_datasets
from rlhfkit.engine.ema import validate_ema
from rlhfkit.engine.precision import apply_precision
from rlhfkit.errors import ConfigError, RemoteCallError
from rlhfkit.launch.preflight import preflight
from rlhfkit.launch.ray_cluster import cluster_has_gpus, start_ray
from rlhfkit.models.loading import attention_kernel, load_tokenizer, resolve_pretrain, stop_token_ids
from rlhfkit.observability.mfu import FlopModel
from rlhfkit.observability.placement import collect_whereabouts, record_placement
from rlhfkit.observability.run import prepare_run_dir, record_resume
from rlhfkit.rl.colocation import Phases
from rlhfkit.rl.debug_dump import dump_steps
from rlhfkit.rl.group import ModelGroup, make_placement_group
from rlhfkit.rl.make_experience import PromptStream
from rlhfkit.rl.reward_group import RolloutRewards, model_specs, text_sources
from rlhfkit.rl.ring import validate_ring
from rlhfkit.rl.sync_check import SyncCheck
from rlhfkit.rl.vision_batch import VisionInputs, check_vision_model, image_column, validate_vision
from rlhfkit.rl.weight_push import push_actor_weights
from rlhfkit.rollout.remote import call_all, set_remote_call_timeout, wait_remote

log = logging.getLogger("rlhfkit")


@dataclass
class RLSetup:
    cfg: PPOConfig
    tokenizer: Any
    prompts: list[dict]
    eval_prompts: list[dict]
    actor: ModelGroup
    ref: ModelGroup | None
    critic: ModelGroup | None
    engines: list[Any]
    reward_fn: Any
    stop_ids: list[int]
    total_steps: int
    start_step: int = 0
    start_cursor: int = 0
    summary: dict[str, Any] = field(default_factory=dict)
    owns_ray: bool = False
    owns_engines: bool = True
    rewards: list[ModelGroup] = field(default_factory=list)  # reward-model groups (also inside reward_fn)
    ptx: PromptStream | None = None                           # --pretrain_data samples for the --ptx_coef loss
    phases: Phases | None = None
    placement_groups: list[Any] = field(default_factory=list)
    agent: AgentSpec | None = None                            # --agent_func_path: multi-turn episodes
    sync_check: SyncCheck | None = None                       # engines vs trainer log-probs after each sync
    flops: FlopModel | None = None                            # the actor's FLOPs per token (perf/mfu_* metrics)
    kl_ctl: Any = None                                        # KL coefficient: fixed, or adaptive (--kl_target)
    plan: RLPlan | None = None                                # the facts derived from the flags (config/plan.py)
    engine_factory: Any = None                                # (indices) -> new engines k (restarts; own engines)
    best: Any = None                                          # --best_metric_key: rlhfkit.engine.best.BestTracker
    vision: VisionInputs | None = None                        # --image_key: the processor (rl/vision_batch.py)

    @property
    def groups(self) -> list[ModelGroup]:
        return [g for g in (self.actor, self.ref, self.critic, *self.rewards) if g is not None]

    def ptx_per_rank(self, rows: int) -> list[tuple[dict, float]] | None:
        """This policy step's --pretrain_data batch (`rows` samples), split over the actor ranks, with the global
        count of target tokens; None without --pretrain_data."""
        if self.ptx is None:
            return None
        from rlhfkit.data.collate import collate_padded
        from rlhfkit.rl.experience import split_rows

        batch = collate_padded(self.ptx.take(max(rows, self.actor.world_size)), self.tokenizer.pad_token_id)
        tensors = {"sequences": batch["input_ids"], "attention_mask": batch["attention_mask"],
                   "loss_mask": batch["loss_mask"]}
        tokens = float(batch["loss_mask"].sum())
        return [({k: v[torch.tensor(part)] for k, v in tensors.items()}, tokens)
                for part in split_rows(tensors["sequences"].shape[0], self.actor.world_size)]

    def save_checkpoint(self, step: int, cursor: int) -> None:
        state = {"cursor": cursor, "ptx_cursor": self.ptx.cursor if self.ptx is not None else 0}
        kl_ctl = getattr(self, "kl_ctl", None)
        if kl_ctl is not None:
            state["kl_ctl"] = kl_ctl.state_dict()
        best = getattr(self, "best", None)
        if best is not None:  # the best eval so far (this step's evaluation ran before the checkpoint)
            state["best_metric"] = best.state()
        self.actor.call("save_checkpoint", f"{self.cfg.ckpt_path}/actor", step, state, self.cfg.max_ckpt_num)
        if self.critic is not None:
            self.critic.call("save_checkpoint", f"{self.cfg.ckpt_path}/critic", step, state, self.cfg.max_ckpt_num)
        if self.cfg.save_hf_ckpt:
            self.actor.call("save_hf", f"{self.cfg.ckpt_path}/actor/global_step{step}/hf", self.cfg.pretrain)

    def close(self) -> None:
        """Free what this run created: model ranks, placement groups, its own engines, its own Ray cluster."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            group.shutdown()
        if self.owns_engines:
            for engine in self.engines:
                ray.kill(engine)
            self.owns_engines = False
        for pg in self.placement_groups:
            remove_placement_group(pg)
        self.placement_groups = []
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()


def validate_rl(cfg: PPOConfig) -> None:
    require(cfg, "pretrain", "prompt_data")
    if cfg.agent_func_path and (cfg.remote_rm_url or cfg.reward_pretrain):
        given = "--remote_rm_url" if cfg.remote_rm_url else "--reward_pretrain"
        raise ConfigError(f"--agent_func_path and {given} both give the reward: an agent environment rewards its "
                          f"episodes from step(); drop {given}, or call your reward inside step()")
    if cfg.agent_action_max_len is not None and (cfg.agent_action_max_len < 1 or not cfg.agent_func_path):
        raise ConfigError(f"--agent_action_max_len {cfg.agent_action_max_len}: must be >= 1 and goes with "
                          "--agent_func_path (it caps one turn of a multi-turn episode)")
    if not (cfg.remote_rm_url or cfg.reward_pretrain or cfg.agent_func_path):
        raise ConfigError("give a reward: --remote_rm_url (reward_func .py, builtin:NAME or http URL) "
                          "or --reward_pretrain")
    if cfg.lora_sync == "adapter":  # what the flags alone rule out fails before anything starts
        from rlhfkit.rollout.lora_sync import adapter_sync_blocker

        if (blocker := adapter_sync_blocker(cfg)) is not None:
            raise ConfigError(f"--lora_sync adapter cannot work here: {blocker}. Use --lora_sync merged (or auto)")
    plan = resolve_plan(cfg)
    validate_vision(cfg, plan.needs_critic)
    validate_ring(cfg, {role: plan.world(role) for role, used in (("actor", True), ("ref", plan.needs_ref),
                                                                  ("critic", plan.needs_critic)) if used})
    trained = ("actor", "critic") if plan.needs_critic else ("actor",)
    validate_optim(cfg, trained, absent=() if plan.needs_critic else ("critic",))
    if plan.group_estimator and cfg.n_samples_per_prompt < 2:
        raise ConfigError(f"--advantage_estimator {cfg.advantage_estimator} compares the samples of a prompt: "
                          "set --n_samples_per_prompt >= 2")
    if plan.group_estimator and cfg.gamma != 1.0:
        raise ConfigError(f"--gamma {cfg.gamma} with --advantage_estimator {cfg.advantage_estimator}: a group "
                          "baseline compares whole-response rewards, so the returns are undiscounted (OpenRLHF "
                          "sets gamma to 1 for it): drop --gamma, or use gae / reinforce")
    if cfg.packing_samples and attention_kernel(cfg.attn_implementation) not in ("sdpa", "eager"):  # as it runs
        raise ConfigError(f"--packing_samples with --attn_implementation {cfg.attn_implementation}: the packed row "
                          "needs a 4D block mask, which only sdpa and eager honour; use one of them, or drop "
                          "--packing_samples")
    _validate_algorithm_flags(cfg)
    validate_ema(cfg)
    if cfg.dynamic_filtering and cfg.n_samples_per_prompt < 2:
        raise ConfigError("--dynamic_filtering needs --n_samples_per_prompt >= 2")
    buffer = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    if buffer % cfg.train_batch_size and not cfg.dynamic_filtering:
        raise ConfigError(f"--rollout_batch_size x --n_samples_per_prompt = {buffer} is not a multiple of "
                          f"--train_batch_size {cfg.train_batch_size}")
    if cfg.top_p < 1.0:
        log.warning("--top_p %s < 1: the trainer's log-probs do not model the truncated sampling distribution",
                    cfg.top_p)
    if cfg.reward_weights is not None:
        try:
            [float(w) for w in cfg.reward_weights.split(",")]
        except ValueError:
            raise ConfigError(f"--reward_weights {cfg.reward_weights!r}: expected comma-separated numbers") from None
    if cfg.ptx_coef < 0:
        raise ConfigError(f"--ptx_coef {cfg.ptx_coef} must be >= 0")
    if cfg.pretrain_data and cfg.ptx_coef == 0:
        log.warning("--pretrain_data is given but --ptx_coef is 0: the auxiliary loss is off")
    if cfg.async_train and cfg.colocate_all_models:
        raise ConfigError("--async_train generates while the models train, but --colocate_all_models puts the engines "
                          "on the training devices (they take turns): drop one of the two")
    _validate_async(cfg)
    if cfg.async_train and not cfg.enable_vllm_is_correction:
        log.warning("--async_train samples with weights one step old: add --enable_vllm_is_correction to correct "
                    "the policy loss with truncated importance weights")
    dump_steps(cfg.debug_dump_steps)  # ConfigError on a bad value
    _validate_colocation(cfg, plan)


def _validate_async(cfg: PPOConfig) -> None:
    """--async_queue_size and --partial_rollout (rl/async_rollout.py)."""
    if cfg.async_queue_size < 1:
        raise ConfigError(f"--async_queue_size {cfg.async_queue_size}: must be >= 1 (rollouts generated ahead)")
    if cfg.partial_rollout and not cfg.async_train:
        raise ConfigError("--partial_rollout resumes generations across weight syncs while the trainer steps: it "
                          "needs --async_train")
    if cfg.partial_rollout and cfg.agent_func_path:
        raise ConfigError("--partial_rollout chunks single-turn generation; with --agent_func_path the episodes "
                          "are generated whole: drop one of the two")
    if cfg.partial_rollout_chunk_tokens < 1:
        raise ConfigError(f"--partial_rollout_chunk_tokens {cfg.partial_rollout_chunk_tokens}: must be >= 1")


def kl_controller(cfg: PPOConfig) -> AdaptiveKLController | FixedKLController:
    """The KL coefficient of each step: adaptive from --init_kl_coef with --kl_target (updated by the loop after
    every step from the measured KL, over --rollout_batch_size x --n_samples_per_prompt samples), else fixed."""
    if cfg.kl_target is not None:
        return AdaptiveKLController(cfg.init_kl_coef, cfg.kl_target, cfg.kl_horizon)
    return FixedKLController(cfg.init_kl_coef)


def _validate_algorithm_flags(cfg: PPOConfig) -> None:
    """--kl_target / --kl_horizon, --use_unbiased_kl and the length penalties."""
    if cfg.kl_target is not None:
        if cfg.kl_target <= 0 or cfg.kl_horizon <= 0:
            raise ConfigError(f"--kl_target {cfg.kl_target} and --kl_horizon {cfg.kl_horizon} must be > 0")
        if cfg.init_kl_coef <= 0:
            raise ConfigError("--kl_target adapts the KL coefficient from --init_kl_coef, which is 0 (no reference "
                              "model, and 0 stays 0): set --init_kl_coef > 0")
    if cfg.use_kl_loss and cfg.init_kl_coef <= 0:
        raise ConfigError("--use_kl_loss adds init_kl_coef x KL(policy || reference) to the loss, but "
                          f"--init_kl_coef is {cfg.init_kl_coef} (no reference model is loaded): set --init_kl_coef "
                          "> 0, or drop --use_kl_loss")
    if cfg.use_unbiased_kl and not cfg.use_kl_loss:
        raise ConfigError("--use_unbiased_kl weights the KL loss: it goes with --use_kl_loss")
    if cfg.overlong_buffer_len is not None and not 0 < cfg.overlong_buffer_len <= cfg.generate_max_len:
        raise ConfigError(f"--overlong_buffer_len {cfg.overlong_buffer_len} must be in (0, --generate_max_len "
                          f"{cfg.generate_max_len}]")
    coef = cfg.stop_properly_penalty_coef
    if coef is not None and coef > 1:
        raise ConfigError(f"--stop_properly_penalty_coef {coef}: a scale in [0, 1], or a fixed reward < 0")


def _validate_colocation(cfg: PPOConfig, plan: RLPlan) -> None:
    """Colocated roles share bundles rank for rank, so their rank counts must match (as in OpenRLHF)."""
    has_critic = plan.needs_critic
    has_rm = bool(model_specs(cfg))
    pairs = []
    if cfg.colocate_all_models:
        pairs += [("ref", plan.needs_ref), ("critic", has_critic), ("reward", has_rm)]
        pairs = [("actor", role, used) for role, used in pairs]
    else:
        if cfg.colocate_actor_ref:
            pairs.append(("actor", "ref", plan.needs_ref))
        if cfg.colocate_critic_reward:
            pairs.append(("critic", "reward", has_critic and has_rm))
    for a, b, used in pairs:
        if used and plan.world(a) != plan.world(b):
            flag = "--colocate_all_models" if cfg.colocate_all_models else f"--colocate_{a}_{b}"
            raise ConfigError(f"{flag}: the {a} has {plan.world(a)} ranks ({a}_num_nodes x {a}_num_gpus_per_node) "
                              f"but the {b} {plan.world(b)}; colocated roles share bundles rank for rank: set "
                              f"--{b}_num_nodes {plan.nodes(a)} --{b}_num_gpus_per_node {plan.ranks_per_node(a)}")


def load_prompts(cfg: PPOConfig, tokenizer: Any, spec: str, split: str, probs: str | None = None) -> list[dict]:
    rows = blend_datasets(spec, probs, split=split, seed=cfg.seed, max_samples=cfg.max_samples)
    images = image_column(cfg, spec) if cfg.image_key else None  # --image_key: rl/vision_batch.py
    samples, stats = build_prompt_samples(rows, tokenizer, input_key=cfg.input_key, label_key=cfg.label_key,
                                          input_template=cfg.input_template,
                                          apply_chat_template=cfg.apply_chat_template,
                                          prompt_max_len=cfg.prompt_max_len, images=images)
    log.info("prompts from %s: %s", spec, stats)
    if not samples:
        raise ConfigError(f"no usable prompts in {spec} (stats {stats}): check --input_key and --prompt_max_len")
    return samples


@dataclass
class Placement:
    """The placement groups of a run and how many roles share each one's bundles."""

    groups: dict[str, Any] = field(default_factory=dict)   # role -> placement group
    sharing: dict[int, int] = field(default_factory=dict)  # id(placement group) -> roles on its bundles
    owned: list[Any] = field(default_factory=list)

    def new(self, plan: RLPlan, role: str) -> Any:
        pg = make_placement_group(plan.nodes(role), plan.ranks_per_node(role), 1.0)
        self.owned.append(pg)
        return pg

    def put(self, role: str, pg: Any) -> None:
        self.groups[role] = pg
        self.sharing[id(pg)] = self.sharing.get(id(pg), 0) + 1

    def share(self, role: str) -> float:
        """The fraction of a bundle each role on `role`'s placement group gets."""
        return 1.0 / self.sharing[id(self.groups[role])]


def plan_placement(cfg: PPOConfig, plan: RLPlan, reward_specs: list[str], create_engines: bool) -> Placement:
    """Placement groups per role: roles named by a colocation flag share the bundles of the group they join."""
    has_critic, need_ref = plan.needs_critic, plan.needs_ref
    p = Placement()
    p.put("actor", p.new(plan, "actor"))
    everything = cfg.colocate_all_models
    if need_ref:
        p.put("ref", p.groups["actor"] if (everything or cfg.colocate_actor_ref) else p.new(plan, "ref"))
    if has_critic:
        p.put("critic", p.groups["actor"] if everything else p.new(plan, "critic"))
    for k, _ in enumerate(reward_specs):
        if everything:
            pg = p.groups["actor"]
        elif cfg.colocate_critic_reward and has_critic:
            pg = p.groups["critic"]
        else:
            pg = p.new(plan, "reward")
        p.put(f"reward{k}", pg)
    if everything and create_engines:
        p.put("engines", p.groups["actor"])
    return p


def _groups(cfg: PPOConfig, plan: RLPlan, worker_cfg: dict, total_updates: int, reward_specs: list[str],
            placement: Placement, made: list[ModelGroup]):
    """Create and initialise the model groups (appending each to `made` as soon as it exists, for clean-up).

    On CPU every rank computes on the node's cores split among all model ranks per node (`cpu_threads_share`):
    the roles' forwards run side by side in the log-prob phase."""
    has_critic, need_ref = plan.needs_critic, plan.needs_ref
    roles = ["actor"] + ["ref"] * need_ref + ["critic"] * has_critic + ["reward"] * len(reward_specs)
    worker_cfg = {**worker_cfg, "cpu_threads_share": sum(plan.ranks_per_node(r) for r in roles)}

    def group(role: str, key: str) -> ModelGroup:
        pg = placement.groups[key]
        made.append(ModelGroup(role, worker_cfg, pg, plan.world(role), plan.nodes(role), placement.share(key)))
        return made[-1]

    actor = group("actor", "actor")
    pending = [(actor, ("init_model", cfg.pretrain, True, total_updates, cfg.actor_learning_rate))]
    ref = None
    if need_ref:
        ref = group("ref", "ref")
        pending.append((ref, ("init_model", cfg.ref_pretrain or cfg.pretrain, False)))
    critic = None
    if has_critic:
        critic = group("critic", "critic")
        init = cfg.critic_pretrain or (reward_specs[0] if reward_specs else cfg.pretrain)
        pending.append((critic, ("init_model", init, True, total_updates, cfg.critic_learning_rate, True)))
    rewards = []
    for k, spec in enumerate(reward_specs):
        rewards.append(group("reward", f"reward{k}"))
        pending.append((rewards[-1], ("init_model", spec, False, 1, 0.0, True, True)))
    actor.params = _init_all(pending)[0]
    return actor, ref, critic, rewards


def _init_all(pending: list[tuple[ModelGroup, tuple]]) -> list[int]:
    """Initialise every group's model concurrently (the groups load in parallel, each rank set collectively);
    returns each group's parameter count."""
    refs = [[getattr(w, args[0]).remote(*args[1:]) for w in g.workers] for g, args in pending]
    counts = []
    for (g, args), group_refs in zip(pending, refs):
        try:
            counts.append(wait_remote(group_refs, role=g.role, method=args[0], handles=g.workers)[0])
        except RemoteCallError:  # names the role, rank, node and method already
            raise
        except Exception as err:
            raise RuntimeError(f"loading the {g.role} model {args[1]!r} failed: {err}") from err
    return counts


def _check_reward_tokenizers(tokenizer: Any, specs: list[str]) -> None:
    """Reward models on Ray read the policy's token ids, so they must share its tokenizer."""
    vocab = tokenizer.get_vocab()
    for spec in specs:
        if load_tokenizer(spec).get_vocab() != vocab:
            raise ConfigError(f"--reward_pretrain {spec}: its tokenizer differs from the policy's ({cfg_name(spec)}); "
                              "reward models on the reward group score the policy's token ids. Serve it with "
                              "'rlhfkit serve-rm --reward_pretrain ...' and pass --remote_rm_url http://HOST:PORT "
                              "instead (the server re-tokenises the text)")


def cfg_name(spec: str) -> str:
    return spec.rsplit("/", 1)[-1]


def _engines(cfg: PPOConfig, path: str, placement: Placement, indices: list[int] | None = None) -> list[Any]:
    """The run's rollout engines from the flags; `indices`: only those engines, with their own options (a restart
    after a fault, `rlhfkit.rl.engine_faults`)."""
    from rlhfkit.rollout.vllm_engine import ENGINE_DTYPES, create_vllm_engines, engine_options

    log_dir = None if cfg.verbose or not cfg.run_dir else os.path.join(cfg.run_dir, "logs")  # engine<k>.log
    if cfg.rollout_backend == "hf":
        from rlhfkit.rollout.hf_engine import create_hf_engines

        return create_hf_engines(cfg.vllm_num_engines, path, dtype=ENGINE_DTYPES[cfg.vllm_dtype], log_dir=log_dir,
                                 indices=indices)

    options = engine_options(cfg, dtype=cfg.vllm_dtype, seed=cfg.seed)  # vllm_dtype: resolved by apply_precision
    if "engines" in placement.groups:  # --colocate_all_models: engine k on the actor's bundle k (x TP)
        share = placement.share("engines")
        options.update(placement_group=placement.groups["engines"], num_gpus_per_engine=share,
                       num_cpus_per_engine=0.25 * share)
    options["enable_sleep_mode"] = cfg.vllm_enable_sleep
    options["max_lora_rank"] = lora_engine_rank(cfg)
    return create_vllm_engines(cfg.vllm_num_engines, path, log_dir=log_dir, indices=indices, **options)


def lora_engine_rank(cfg: PPOConfig) -> int:
    """The LoRA rank the run's vLLM engines serve: vLLM's rank for --lora_rank when an adapter-only sync may be used
    (--lora_sync auto or adapter, nothing in the flags against it), else 0 (plain engines)."""
    from rlhfkit.rollout.lora_sync import adapter_sync_blocker, engine_max_lora_rank

    if cfg.lora_sync == "merged" or adapter_sync_blocker(cfg) is not None:
        return 0
    return engine_max_lora_rank(cfg.lora_rank)


def resolve_run_lora_sync(cfg: PPOConfig, engines: list[Any]) -> None:
    """Set cfg.lora_sync to adapter or merged (--lora_sync auto resolved against the engines), logging the reason
    once when the run trains LoRA."""
    from rlhfkit.rollout.lora_sync import resolve_lora_sync

    infos = call_all(engines, "weight_sync_info", role="engine")
    cfg.lora_sync, reason = resolve_lora_sync(cfg, infos)
    if cfg.lora_rank > 0:
        log.info("LoRA weight sync: %s (%s)", cfg.lora_sync, reason)


def build_rewards(cfg: PPOConfig, tokenizer: Any, groups: list[ModelGroup], specs: list[str]) -> RolloutRewards:
    weights = [float(w) for w in cfg.reward_weights.split(",")] if cfg.reward_weights else None
    try:
        return RolloutRewards([(f"rm:{spec}", g) for spec, g in zip(specs, groups)], text_sources(cfg),
                              rule=cfg.reward_combine, weights=weights, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def load_ptx(cfg: PPOConfig, tokenizer: Any) -> PromptStream | None:
    """--pretrain_data as SFT samples (input_ids, loss_mask), max length --prompt_max_len + --generate_max_len."""
    if not cfg.pretrain_data or cfg.ptx_coef == 0:
        return None
    from rlhfkit.data.sft import build_sft_samples

    rows = blend_datasets(cfg.pretrain_data, cfg.pretrain_data_probs, split=cfg.pretrain_split, seed=cfg.seed,
                          max_samples=cfg.max_samples)
    sft = cfg.pretrain_output_key is not None
    samples, stats = build_sft_samples(rows, tokenizer, input_key=cfg.pretrain_input_key or cfg.input_key,
                                       output_key=cfg.pretrain_output_key,
                                       input_template=cfg.input_template if sft else None,
                                       apply_chat_template=cfg.apply_chat_template and sft,
                                       max_len=cfg.prompt_max_len + cfg.generate_max_len, pretrain_mode=not sft)
    log.info("--pretrain_data %s: %s", cfg.pretrain_data, stats)
    if not samples:
        raise ConfigError(f"no usable samples in --pretrain_data {cfg.pretrain_data} (stats {stats})")
    return PromptStream(samples, cfg.seed + 1)


def build_setup(cfg: PPOConfig, engines: list[Any] | None = None, best: Any = None) -> RLSetup:
    """Everything a run needs. `engines`: already-running rollout engines to reuse (tests, notebooks); `best`: the
    --best_metric_key tracker (restored on resume)."""
    validate_rl(cfg)
    set_remote_call_timeout(cfg.remote_call_timeout)  # every remote call's deadline (rlhfkit.rollout.remote)
    preflight(cfg, engines)  # model context, host devices and RAM, the user's .py files: before Ray starts
    agent = load_agent(cfg.agent_func_path, cfg.agent_action_max_len) if cfg.agent_func_path else None
    owns_ray = start_ray(cfg)
    has_gpus = cluster_has_gpus()
    plan = resolve_plan(cfg, has_gpus)  # the derived facts, the weight transport resolved against this cluster
    cfg.vllm_sync_backend = plan.sync_transport
    # before worker_cfg (workers get concrete dtypes); the driver never creates a CUDA context of its own
    apply_precision(cfg, "cuda" if has_gpus else "cpu", touch_device=False)
    prepare_run_dir(cfg, True, plan.world("actor"), torchrun=False)  # the driver starts the ranks: no torchrun
    cfg.pretrain = resolve_pretrain(cfg.pretrain)
    tokenizer = load_tokenizer(cfg.pretrain, use_fast=not cfg.disable_fast_tokenizer)
    if cfg.tokenizer_chat_template:
        tokenizer.chat_template = cfg.tokenizer_chat_template
    check_vision_model(cfg)
    vision = VisionInputs.load(cfg.pretrain) if cfg.image_key else None
    prompts = load_prompts(cfg, tokenizer, cfg.prompt_data, cfg.prompt_split, cfg.prompt_data_probs)
    eval_prompts = load_prompts(cfg, tokenizer, cfg.eval_dataset, cfg.eval_split) if cfg.eval_dataset else []
    ptx = load_ptx(cfg, tokenizer)
    steps_per_episode = len(prompts) // cfg.rollout_batch_size
    if steps_per_episode == 0:
        raise ConfigError(f"{len(prompts)} prompts are fewer than --rollout_batch_size {cfg.rollout_batch_size}")
    total_steps = steps_per_episode * cfg.num_episodes
    buffer = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    updates = total_steps * cfg.max_epochs * max(1, -(-buffer // cfg.train_batch_size))
    worker_cfg = {k: v for k, v in config_to_dict(cfg).items()}
    reward_specs = [resolve_pretrain(spec) for spec in model_specs(cfg)]
    _check_reward_tokenizers(tokenizer, reward_specs)
    if engines is None and cfg.colocate_all_models and \
            cfg.vllm_num_engines * cfg.vllm_tensor_parallel_size != plan.world("actor"):
        raise ConfigError(f"--colocate_all_models: --vllm_num_engines {cfg.vllm_num_engines} x "
                          f"--vllm_tensor_parallel_size {cfg.vllm_tensor_parallel_size} must equal the actor's "
                          f"{plan.world('actor')} ranks (one engine shard per bundle)")
    placement = plan_placement(cfg, plan, reward_specs, engines is None)
    made: list[ModelGroup] = []
    owns_engines = engines is None
    try:
        actor, ref, critic, reward_groups = _groups(cfg, plan, worker_cfg, updates, reward_specs, placement, made)
        if engines is None:
            engines = _engines(cfg, cfg.pretrain, placement)
        resolve_run_lora_sync(cfg, engines)
        if not owns_engines:  # reused engines start from this run's initial weights
            push_actor_weights(actor, engines, cfg)
        sync_check = SyncCheck.from_run(vision.probe_prompts(prompts) if vision else prompts, cfg)
        sync_check.check(actor, engines, "start (engines loaded from --pretrain)" if owns_engines
                         else "start (this run's weights pushed into the given engines)")
        reward_fn = None if agent else build_rewards(cfg, tokenizer, reward_groups, reward_specs)
    except BaseException:
        _abandon(made, placement.owned, engines if owns_engines else None)
        raise
    stop_ids = stop_token_ids(tokenizer)
    from transformers import AutoConfig

    flops = FlopModel.from_config(AutoConfig.from_pretrained(cfg.pretrain), actor.params)
    s = RLSetup(cfg, tokenizer, prompts, eval_prompts, actor, ref, critic, engines, reward_fn, stop_ids, total_steps,
                owns_ray=owns_ray, owns_engines=owns_engines, rewards=reward_groups, ptx=ptx,
                placement_groups=placement.owned, agent=agent, flops=flops, sync_check=sync_check)
    s.plan, s.best, s.vision = plan, best, vision
    s.phases = Phases.from_config(cfg, engines, [actor, critic], has_gpus)
    if owns_engines:  # engines the run created can be restarted after a fault (--max_engine_restarts)
        s.engine_factory = partial(_engines, cfg, cfg.pretrain, placement)
    s.kl_ctl = kl_controller(cfg)
    s.summary = {"actor ranks": actor.world_size, "reference": ref.world_size if ref else "off (init_kl_coef 0)",
                 "critic": critic.world_size if critic else "off",
                 "reward models": ", ".join(f"{g.world_size} x {spec}" for spec, g in zip(reward_specs, reward_groups))
                 or "none", "reward": agent.name if agent else reward_fn.name, "placement": _layout(cfg),
                 "rollout engines": len(engines), "backend": cfg.rollout_backend,
                 "weight sync": cfg.vllm_sync_backend, "prompts": len(prompts),
                 "eval prompts": len(eval_prompts), "samples per step": buffer,
                 "optimizer steps per rollout": updates // max(1, total_steps), "total steps": total_steps,
                 "estimator": cfg.advantage_estimator, "precision": cfg.precision.summary(),
                 "engine dtype": cfg.vllm_dtype, "compute threads": _threads_line(actor, engines)}
    if ptx is not None:
        s.summary["ptx samples"] = len(ptx.samples)
    record_placement(cfg.run_dir, collect_whereabouts(s.groups, engines))
    try:
        if cfg.load_checkpoint:
            _resume(s)
    except BaseException:
        s.close()
        raise
    return s


def _threads_line(actor: ModelGroup, engines: list[Any]) -> str:
    """"actor 2, engines 2": torch threads per actor rank and per engine (Ray alone would give each 1 on CPU)."""
    engine_threads = call_all(engines, "compute_threads", role="engine") if engines else []
    return f"actor {','.join(map(str, sorted(set(actor.call('compute_threads')))))}, engines " + \
        (",".join(map(str, sorted(set(engine_threads)))) or "none")


def _layout(cfg: PPOConfig) -> str:
    if cfg.colocate_all_models:
        return "all models + engines colocated"
    parts = [name for flag, name in ((cfg.colocate_actor_ref, "actor+ref"), (cfg.colocate_critic_reward,
                                                                             "critic+reward")) if flag]
    return ", ".join(parts) + " colocated" if parts else "separate"


def _abandon(groups: list[ModelGroup], pgs: list[Any], engines: list[Any] | None) -> None:
    """Free what a failed set-up created."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        group.shutdown()
    for engine in engines or []:
        ray.kill(engine)
    for pg in pgs:
        remove_placement_group(pg)


def _resume(s: RLSetup) -> None:
    states = s.actor.call("load_checkpoint", f"{s.cfg.ckpt_path}/actor")
    if states[0] is None:
        log.info("--load_checkpoint: nothing in %s/actor, starting fresh", s.cfg.ckpt_path)
        return
    if s.critic is not None:
        critic_states = s.critic.call("load_checkpoint", f"{s.cfg.ckpt_path}/critic")
        if critic_states[0] is None or critic_states[0]["step"] != states[0]["step"]:
            found = "nothing" if critic_states[0] is None else f"step {critic_states[0]['step']}"
            raise ConfigError(f"--load_checkpoint: {s.cfg.ckpt_path}/actor is at step {states[0]['step']} but "
                              f"{s.cfg.ckpt_path}/critic holds {found}; a PPO (gae) run resumes both. Copy the "
                              "critic checkpoint of the same step, or start fresh")
    s.start_step, s.start_cursor = states[0]["step"], states[0]["cursor"]
    if s.ptx is not None:
        s.ptx.cursor = states[0].get("ptx_cursor", 0)
    if getattr(s, "kl_ctl", None) is not None and "kl_ctl" in states[0]:  # the adaptive coefficient goes on
        s.kl_ctl.load_state_dict(states[0]["kl_ctl"])
    if getattr(s, "best", None) is not None:
        s.best.load_state(states[0].get("best_metric"))
    notes = [f"actor {record_resume(s.cfg.run_dir, 'actor', states[0])}"]
    if s.critic is not None:
        notes.append(f"critic {record_resume(s.cfg.run_dir, 'critic', critic_states[0])}")
    push_actor_weights(s.actor, s.engines, s.cfg)
    log.info("resumed at step %d (prompt cursor %d; %s); engine weights synced", s.start_step, s.start_cursor,
             ", ".join(notes))


def save_final(s: RLSetup) -> None:
    s.actor.call("save_hf", s.cfg.save_path, s.cfg.pretrain)
    log.info("saved the policy to %s", s.cfg.save_path)
    if s.critic is not None and s.cfg.save_value_network:
        s.critic.call("save_hf", f"{s.cfg.save_path}_critic", s.cfg.pretrain)
        log.info("saved the critic to %s_critic", s.cfg.save_path)
