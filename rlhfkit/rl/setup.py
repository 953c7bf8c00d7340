"""Set-up of an online run: Ray, data, model groups and their placement (`rlhfkit.rl.placement`), rollout engines,
rewards, resume; the flags are checked first (`rlhfkit.rl.validate`), which makes the run's plan
(`rlhfkit.config.plan.RunPlan`); the set-up completes it against the cluster and the engines and keeps it on the
`RLSetup`, where everything reads the derived facts. The user's config object is never written to.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlhfkit.agents.environment import AgentSpec, load_agent
from rlhfkit.algorithms.rewards import AdaptiveKLController, FixedKLController
from rlhfkit.config.commands import PPOConfig, PrecisionRecord
from rlhfkit.config.optim_options import role_learning_rate
from rlhfkit.config.plan import RunPlan
from rlhfkit.config.rl_options import prompt_bound
from rlhfkit.config.validate import need
from rlhfkit.data.prompts import build_prompt_samples
from rlhfkit.data.readers import blend_datasets
from rlhfkit.engine.precision import apply_precision, engine_dtype_of
from rlhfkit.errors import ConfigError, RemoteCallError
from rlhfkit.launch.preflight import preflight
from rlhfkit.launch.ray_cluster import cluster_has_gpus, start_ray
from rlhfkit.models.loading import load_tokenizer, resolve_pretrain, stop_token_ids
from rlhfkit.models.vocabulary import check_same_tokenizer
from rlhfkit.observability.mfu import FlopModel
from rlhfkit.observability.placement import record_placement
from rlhfkit.observability.run import prepare_run_dir, record_resume, resolve_run_dir
from rlhfkit.rewards.sandbox import manifest_entries as sandbox_manifest_entries
from rlhfkit.rl.colocation import Phases
from rlhfkit.rl.group import ModelGroup, Pending
from rlhfkit.rl.make_experience import PromptStream
from rlhfkit.rl.placement import Placement, collect_whereabouts, plan_placement
from rlhfkit.rl.reward_group import RolloutRewards, text_sources
from rlhfkit.rl.rollout_dump import RolloutDump, RolloutReplay
from rlhfkit.rl.sync_check import SyncCheck
from rlhfkit.rl.validate import validate_rl
from rlhfkit.rl.vision_batch import VisionInputs, check_vision_model, image_column
from rlhfkit.rl.weight_push import push_actor_weights
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout.engine_api import RolloutEngine
from rlhfkit.rollout.remote import RemoteActors, set_engine_hang_timeout, set_remote_call_timeout

log = logging.getLogger("rlhfkit")
# (group, the model it loads, the start of its ranks' ModelWorker.init_model): one group's model initialisation
InitCall = tuple[ModelGroup, str, Callable[[], Pending[list[int]]]]


@dataclass
class RLSetup:
    cfg: PPOConfig
    plan: RunPlan                                             # the facts derived once (config/plan.py)
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
    engine_factory: Any = None                                # (indices) -> new engines k (restarts; own engines)
    best: Any = None                                          # --best_metric_key: rlhfkit.engine.best.BestTracker
    vision: VisionInputs | None = None                        # --image_key: the processor (rl/vision_batch.py)
    rollout_dump: RolloutDump | None = None                   # --rollout_dump_dir (rl/rollout_dump.py)
    rollout_replay: RolloutReplay | None = None               # --rollout_replay_dir: no engines, rollouts read

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
        self.actor.call(ModelWorker.save_checkpoint, f"{self.cfg.ckpt_path}/actor", step, state,
                        self.cfg.max_ckpt_num)
        if self.critic is not None:
            self.critic.call(ModelWorker.save_checkpoint, f"{self.cfg.ckpt_path}/critic", step, state,
                             self.cfg.max_ckpt_num)
        if self.cfg.save_hf_ckpt:
            self.actor.call(ModelWorker.save_hf, f"{self.cfg.ckpt_path}/actor/global_step{step}/hf",
                            need(self.plan.model_path, "--pretrain"))

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


def kl_controller(cfg: PPOConfig, plan: RunPlan | None = None) -> AdaptiveKLController | FixedKLController:
    """The KL coefficient of each step: adaptive from --init_kl_coef (the plan's) with --kl_target (updated by the
    loop after every step from the measured KL, over --rollout_batch_size x --n_samples_per_prompt samples), else
    fixed."""
    init = plan.init_kl_coef if plan is not None else cfg.init_kl_coef
    if cfg.kl_target is not None:
        return AdaptiveKLController(init, cfg.kl_target, cfg.kl_horizon)
    return FixedKLController(init)


def load_prompts(cfg: PPOConfig, tokenizer: Any, spec: str, split: str, probs: str | None = None,
                 model_path: str | None = None) -> list[dict]:
    """The prompt samples of `spec` (`model_path`: the resolved --pretrain, whose processor places the images)."""
    rows = blend_datasets(spec, probs, split=split, seed=cfg.seed, max_samples=cfg.max_samples)
    images = image_column(cfg, spec, model_path) if cfg.image_key else None  # --image_key: rl/vision_batch.py
    samples, stats = build_prompt_samples(rows, tokenizer, input_key=cfg.input_key, label_key=cfg.label_key,
                                          input_template=cfg.input_template,
                                          apply_chat_template=cfg.apply_chat_template,
                                          prompt_max_len=prompt_bound(cfg.prompt_max_len, cfg.max_len),
                                          images=images)
    log.info("prompts from %s: %s", spec, stats)
    if not samples:
        raise ConfigError(f"no usable prompts in {spec} (stats {stats}): check --input_key, --prompt_max_len "
                          "and --max_len")
    return samples


def _groups(cfg: PPOConfig, plan: RunPlan, total_updates: int, reward_specs: list[str], placement: Placement,
            made: list[ModelGroup], critic_specs: list[str] | None = None):
    """Create and initialise the model groups (appending each to `made` as soon as it exists, for clean-up).
    `reward_specs`: the reward models to load (none in a replay); `critic_specs`: the run's reward models, the first
    of which initialises the critic without --critic_pretrain (default: `reward_specs`). Each rank gets the
    typed config and the run's plan (Ray pickles both).

    On CPU every rank computes on the node's cores split among all model ranks per node (`cpu_threads_share`):
    the roles' forwards run side by side in the log-prob phase."""
    has_critic, need_ref = plan.needs_critic, plan.needs_ref
    roles = ["actor"] + ["ref"] * need_ref + ["critic"] * has_critic + ["reward"] * len(reward_specs)
    share = sum(plan.ranks_per_node(r) for r in roles)

    def group(role: str, key: str) -> ModelGroup:
        pg = placement.groups[key]
        made.append(ModelGroup(role, cfg, pg, plan.world(role), plan.nodes(role), placement.share(key), share,
                               plan=plan))
        return made[-1]

    actor = group("actor", "actor")
    init = ModelWorker.init_model
    model_path = need(plan.model_path, "--pretrain")
    pending: list[InitCall] = [(actor, model_path, partial(actor.call_async, init, model_path, True, total_updates,
                                                           role_learning_rate(cfg, "actor")))]
    ref = None
    if need_ref:
        ref = group("ref", "ref")
        ref_spec = resolve_pretrain(need(plan.reference_model, "--ref_pretrain"))
        pending.append((ref, ref_spec, partial(ref.call_async, init, ref_spec, False)))
    critic = None
    if has_critic:
        critic = group("critic", "critic")
        critic_specs = reward_specs if critic_specs is None else critic_specs
        critic_spec = cfg.critic_pretrain or (critic_specs[0] if critic_specs else model_path)
        pending.append((critic, critic_spec, partial(critic.call_async, init, critic_spec, True, total_updates,
                                                     role_learning_rate(cfg, "critic"), True)))
    rewards = []
    for k, spec in enumerate(reward_specs):
        rewards.append(group("reward", f"reward{k}"))
        pending.append((rewards[-1], spec, partial(rewards[-1].call_async, init, spec, False, 1, 0.0, True, True)))
    actor.params = _init_all(pending)[0]
    return actor, ref, critic, rewards


def _init_all(pending: list[InitCall]) -> list[int]:
    """Initialise every group's model concurrently (the groups load in parallel, each rank set collectively);
    returns each group's parameter count."""
    started = [start() for _, _, start in pending]
    counts = []
    for (g, spec, _), calls in zip(pending, started):
        try:
            counts.append(calls.get()[0])
        except RemoteCallError:  # names the role, rank, node and method already
            raise
        except Exception as err:
            raise RuntimeError(f"loading the {g.role} model {spec!r} failed: {err}") from err
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


def _engines(cfg: PPOConfig, plan: RunPlan, placement: Placement, indices: list[int] | None = None) -> list[Any]:
    """The run's rollout engines from the flags and the plan (the model folder, the engine dtype, the run folder);
    `indices`: only those engines, with their own options (a restart after a fault, `rlhfkit.rl.engine_faults`)."""
    from rlhfkit.launch.engine_spec import vllm_engine_spec
    from rlhfkit.rollout.vllm_engine import ENGINE_DTYPES, create_vllm_engines

    path = need(plan.model_path, "--pretrain")
    log_dir = None if cfg.verbose or not plan.run_dir else os.path.join(plan.run_dir, "logs")  # engine<k>.log
    if cfg.rollout_backend == "hf":
        from rlhfkit.rollout.hf_engine import create_hf_engines

        return create_hf_engines(cfg.vllm_num_engines, path, dtype=ENGINE_DTYPES[plan.engine_dtype], log_dir=log_dir,
                                 indices=indices)

    options = vllm_engine_spec(cfg, dtype=plan.engine_dtype, seed=cfg.seed).kwargs()  # resolved in the plan
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
    from rlhfkit.launch.engine_spec import lora_sync_spec
    from rlhfkit.rollout.lora_sync import adapter_sync_blocker, engine_max_lora_rank

    if cfg.lora_sync == "merged" or adapter_sync_blocker(lora_sync_spec(cfg)) is not None:
        return 0
    return engine_max_lora_rank(cfg.lora_rank)


def resolve_run_lora_sync(cfg: PPOConfig, engines: list[Any]) -> str:
    """--lora_sync resolved against the engines: adapter or merged (auto decided), logging the reason once when the
    run trains LoRA."""
    from rlhfkit.launch.engine_spec import lora_sync_spec
    from rlhfkit.rollout.lora_sync import resolve_lora_sync

    infos = RemoteActors(engines, role="engine").call(RolloutEngine.weight_sync_info)
    mode, reason = resolve_lora_sync(lora_sync_spec(cfg), infos)
    if cfg.lora_rank > 0:
        log.info("LoRA weight sync: %s (%s)", mode, reason)
    return mode


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


def set_process_deadlines(cfg: PPOConfig) -> None:
    """The driver's process-wide waits on its remote calls (rlhfkit.rollout.remote): --remote_call_timeout, every
    call's deadline, and --engine_hang_timeout, the liveness probes of the engines while a call runs."""
    set_remote_call_timeout(cfg.remote_call_timeout)
    set_engine_hang_timeout(cfg.engine_hang_timeout)


def build_setup(cfg: PPOConfig, engines: list[Any] | None = None, best: Any = None) -> RLSetup:
    """Everything a run needs. `engines`: already-running rollout engines to reuse (tests, notebooks); `best`: the
    --best_metric_key tracker (restored on resume).

    With --rollout_replay_dir the rollouts come from a dump: no engines are created (given ones are not used), no
    reward model, reward function or agent environment is loaded (the dump holds the rewards), and there is no
    weight-sync check (nothing to compare the trainer with: the rollout/* log-prob mismatch metrics compare it with
    the dumped engine log-probs instead)."""
    plan = validate_rl(cfg)  # the run's plan, made once from the flags; completed below, never re-derived
    replay = bool(cfg.rollout_replay_dir)
    if replay:
        engines = []
    if plan.distill:  # the teacher scores the student's token ids
        check_same_tokenizer(need(cfg.pretrain, "--pretrain"), need(plan.reference_model, "--teacher_model"),
                             teacher_flag="--teacher_model" if cfg.teacher_model else "--ref_pretrain")
    set_process_deadlines(cfg)
    preflight(cfg, engines)  # model context, host devices and RAM, the user's .py files: before Ray starts
    agent = load_agent(cfg.agent_func_path, cfg.agent_action_max_len) if cfg.agent_func_path and not replay else None
    owns_ray = start_ray(cfg)
    has_gpus = cluster_has_gpus()
    # the driver never creates a CUDA context of its own; the workers get the plan's concrete dtypes
    precision = apply_precision(cfg, "cuda" if has_gpus else "cpu", touch_device=False)
    plan = plan.on_cluster(has_gpus, precision=precision, trainer_dtype=precision.dtype,
                           engine_dtype=need(engine_dtype_of(cfg, precision), "--vllm_dtype"),
                           run_dir=str(resolve_run_dir(cfg)))  # the weight transport resolved against this cluster
    run_dir = prepare_run_dir(cfg, True, plan.world("actor"), torchrun=False,  # the driver starts the ranks
                              extra=sandbox_manifest_entries(cfg), run_dir=Path(need(plan.run_dir, "--run_dir")),
                              resolved=plan.resolved_flags(), precision=precision)
    plan = plan.with_model_path(resolve_pretrain(need(cfg.pretrain, "--pretrain")))
    pretrain = need(plan.model_path, "--pretrain")
    rollout_replay = RolloutReplay(cfg, plan.resolved_flags()) if replay else None  # checked before any model loads
    rollout_dump = RolloutDump(cfg, plan.resolved_flags()) if cfg.rollout_dump_dir else None
    tokenizer = _policy_tokenizer(cfg, pretrain)
    check_vision_model(cfg, pretrain)
    vision = VisionInputs.load(pretrain) if cfg.image_key else None
    prompts = load_prompts(cfg, tokenizer, need(cfg.prompt_data, "--prompt_data"), cfg.prompt_split,
                           cfg.prompt_data_probs, model_path=pretrain)
    eval_prompts = load_prompts(cfg, tokenizer, cfg.eval_dataset, cfg.eval_split, model_path=pretrain) \
        if cfg.eval_dataset else []
    ptx = load_ptx(cfg, tokenizer)
    total_steps, updates = _step_counts(cfg, len(prompts))
    critic_specs = [resolve_pretrain(spec) for spec in plan.reward_models]
    reward_specs = [] if replay else critic_specs  # a replay's rewards are in the dump
    _check_reward_tokenizers(tokenizer, reward_specs)
    _check_engine_colocation(cfg, plan, engines is None)
    placement = plan_placement(cfg, plan, reward_specs, engines is None)
    made: list[ModelGroup] = []
    owns_engines = engines is None
    try:
        actor, ref, critic, reward_groups = _groups(cfg, plan, updates, reward_specs, placement, made, critic_specs)
        if engines is None:
            engines = _engines(cfg, plan, placement)
        sync_check = None
        if not replay:
            plan = plan.with_lora_sync(resolve_run_lora_sync(cfg, engines))
            if not owns_engines:  # reused engines start from this run's initial weights
                push_actor_weights(actor, engines, cfg, plan)
            sync_check = SyncCheck.from_run(vision.probe_prompts(prompts) if vision else prompts, cfg, plan)
            sync_check.check(actor, engines, "start (engines loaded from --pretrain)" if owns_engines
                             else "start (this run's weights pushed into the given engines)")
        reward_fn = None if agent or replay else build_rewards(cfg, tokenizer, reward_groups, reward_specs)
    except BaseException:
        _abandon(made, placement.owned, engines if owns_engines else None)
        raise
    stop_ids = stop_token_ids(tokenizer)
    from transformers import AutoConfig

    flops = FlopModel.from_config(AutoConfig.from_pretrained(pretrain), actor.params)
    s = RLSetup(cfg, plan, tokenizer, prompts, eval_prompts, actor, ref, critic, engines, reward_fn, stop_ids,
                total_steps, owns_ray=owns_ray, owns_engines=owns_engines, rewards=reward_groups, ptx=ptx,
                placement_groups=placement.owned, agent=agent, flops=flops, sync_check=sync_check)
    s.best, s.vision = best, vision
    s.rollout_dump, s.rollout_replay = rollout_dump, rollout_replay
    s.phases = Phases.from_config(cfg, engines, [actor, critic], has_gpus)
    if owns_engines:  # engines the run created can be restarted after a fault (--max_engine_restarts)
        s.engine_factory = partial(_engines, cfg, plan, placement)
    s.kl_ctl = kl_controller(cfg, plan)
    s.summary = _summary(s, reward_specs, updates, precision)
    record_placement(run_dir, collect_whereabouts(s.groups, engines))
    try:
        if cfg.load_checkpoint:
            _resume(s)
    except BaseException:
        s.close()
        raise
    return s


def _policy_tokenizer(cfg: PPOConfig, pretrain: str) -> Any:
    """The policy's tokenizer (--disable_fast_tokenizer), with --tokenizer_chat_template when given."""
    tokenizer = load_tokenizer(pretrain, use_fast=not cfg.disable_fast_tokenizer)
    if cfg.tokenizer_chat_template:
        tokenizer.chat_template = cfg.tokenizer_chat_template
    return tokenizer


def _step_counts(cfg: PPOConfig, num_prompts: int) -> tuple[int, int]:
    """(policy steps of the run, optimizer steps of each trained model): --num_episodes passes over the prompts in
    steps of --rollout_batch_size prompts; each step makes --max_epochs x ceil(rollout_batch_size x
    n_samples_per_prompt / train_batch_size) optimizer steps."""
    steps_per_episode = num_prompts // cfg.rollout_batch_size
    if steps_per_episode == 0:
        raise ConfigError(f"{num_prompts} prompts are fewer than --rollout_batch_size {cfg.rollout_batch_size}")
    total_steps = steps_per_episode * cfg.num_episodes
    buffer = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    return total_steps, total_steps * cfg.max_epochs * max(1, -(-buffer // cfg.train_batch_size))


def _check_engine_colocation(cfg: PPOConfig, plan: RunPlan, create_engines: bool) -> None:
    """--colocate_all_models puts one engine shard on each of the actor's bundles (the run's own engines only)."""
    if create_engines and cfg.colocate_all_models and \
            cfg.vllm_num_engines * cfg.vllm_tensor_parallel_size != plan.world("actor"):
        raise ConfigError(f"--colocate_all_models: --vllm_num_engines {cfg.vllm_num_engines} x "
                          f"--vllm_tensor_parallel_size {cfg.vllm_tensor_parallel_size} must equal the actor's "
                          f"{plan.world('actor')} ranks (one engine shard per bundle)")


def _summary(s: RLSetup, reward_specs: list[str], updates: int, precision: PrecisionRecord) -> dict[str, Any]:
    """The derived-quantities table printed at the start of the run (`print_derived_table`)."""
    cfg, actor, ref, critic = s.cfg, s.actor, s.ref, s.critic
    reference = ref.world_size if ref else "off (init_kl_coef 0)"
    if ref is not None and s.plan.distill:
        reference = f"{ref.world_size} x teacher {s.plan.reference_model}"
    summary = {"actor ranks": actor.world_size, "reference": reference,
               "critic": critic.world_size if critic else "off",
               "reward models": ", ".join(f"{g.world_size} x {spec}" for spec, g in zip(reward_specs, s.rewards))
               or "none", "reward": _reward_name(s), "placement": _layout(cfg),
               "rollout engines": len(s.engines), "backend": cfg.rollout_backend,
               "weight sync": s.plan.transport, "prompts": len(s.prompts),
               "eval prompts": len(s.eval_prompts),
               "samples per step": cfg.rollout_batch_size * cfg.n_samples_per_prompt,
               "optimizer steps per rollout": updates // max(1, s.total_steps), "total steps": s.total_steps,
               "estimator": cfg.advantage_estimator, "precision": precision.summary(),
               "engine dtype": s.plan.engine_dtype, "compute threads": _threads_line(actor, s.engines)}
    if s.ptx is not None:
        summary["ptx samples"] = len(s.ptx.samples)
    return summary


def _reward_name(s: RLSetup) -> str:
    if s.rollout_replay is not None:
        return f"replayed from {s.cfg.rollout_replay_dir}"
    return s.agent.name if s.agent else s.reward_fn.name


def _threads_line(actor: ModelGroup, engines: list[Any]) -> str:
    """"actor 2, engines 2": torch threads per actor rank and per engine (Ray alone would give each 1 on CPU)."""
    engine_threads = RemoteActors(engines, role="engine").call(RolloutEngine.compute_threads) if engines else []
    return f"actor {','.join(map(str, sorted(set(actor.call(ModelWorker.compute_threads)))))}, engines " + \
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
    states = s.actor.call(ModelWorker.load_checkpoint, f"{s.cfg.ckpt_path}/actor")
    if states[0] is None:
        log.info("--load_checkpoint: nothing in %s/actor, starting fresh", s.cfg.ckpt_path)
        return
    critic_state: dict[str, Any] | None = None
    if s.critic is not None:
        critic_states = s.critic.call(ModelWorker.load_checkpoint, f"{s.cfg.ckpt_path}/critic")
        if critic_states[0] is None or critic_states[0]["step"] != states[0]["step"]:
            found = "nothing" if critic_states[0] is None else f"step {critic_states[0]['step']}"
            raise ConfigError(f"--load_checkpoint: {s.cfg.ckpt_path}/actor is at step {states[0]['step']} but "
                              f"{s.cfg.ckpt_path}/critic holds {found}; a PPO (gae) run resumes both. Copy the "
                              "critic checkpoint of the same step, or start fresh")
        critic_state = critic_states[0]
    s.start_step, s.start_cursor = states[0]["step"], states[0]["cursor"]
    if s.ptx is not None:
        s.ptx.cursor = states[0].get("ptx_cursor", 0)
    if getattr(s, "kl_ctl", None) is not None and "kl_ctl" in states[0]:  # the adaptive coefficient goes on
        s.kl_ctl.load_state_dict(states[0]["kl_ctl"])
    if getattr(s, "best", None) is not None:
        s.best.load_state(states[0].get("best_metric"))
    notes = [f"actor {record_resume(s.plan.run_dir, 'actor', states[0])}"]
    if critic_state is not None:
        notes.append(f"critic {record_resume(s.plan.run_dir, 'critic', critic_state)}")
    if s.engines:  # none in a replay
        push_actor_weights(s.actor, s.engines, s.cfg, s.plan)
    log.info("resumed at step %d (prompt cursor %d; %s); engine weights synced", s.start_step, s.start_cursor,
             ", ".join(notes))


def save_final(s: RLSetup) -> None:
    s.actor.call(ModelWorker.save_hf, s.cfg.save_path, need(s.plan.model_path, "--pretrain"))
    log.info("saved the policy to %s", s.cfg.save_path)
    if s.critic is not None and s.cfg.save_value_network:
        s.critic.call(ModelWorker.save_hf, f"{s.cfg.save_path}_critic", need(s.plan.model_path, "--pretrain"))
        log.info("saved the critic to %s_critic", s.cfg.save_path)
