"""Set-up of an online run: Ray, data, model groups, rollout engines, reward source, resume."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from rlhfkit.config.parse import ConfigError, config_to_dict
from rlhfkit.config.validate import require
from rlhfkit.data.prompts import build_prompt_samples
from rlhfkit.data.readers import blend_datasets
from rlhfkit.models.loading import load_tokenizer, resolve_pretrain
from rlhfkit.observability.run import prepare_run_dir
from rlhfkit.rl.group import ModelGroup, make_placement_group
from rlhfkit.rollout.weight_sync import sync_weights

log = logging.getLogger("rlhfkit")

WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false", "VLLM_HOST_IP": "127.0.0.1",
              "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@dataclass
class RLSetup:
    cfg: Any
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

    def save_checkpoint(self, step: int, cursor: int) -> None:
        state = {"cursor": cursor}
        self.actor.call("save_checkpoint", f"{self.cfg.ckpt_path}/actor", step, state, self.cfg.max_ckpt_num)
        if self.critic is not None:
            self.critic.call("save_checkpoint", f"{self.cfg.ckpt_path}/critic", step, state, self.cfg.max_ckpt_num)
        if self.cfg.save_hf_ckpt:
            self.actor.call("save_hf", f"{self.cfg.ckpt_path}/actor/global_step{step}/hf", self.cfg.pretrain)

    def close(self) -> None:
        """Free what this run created: model ranks, placement groups, its own engines, its own Ray cluster."""
        import ray
        from ray.util.placement_group import remove_placement_group

        groups = [g for g in (self.actor, self.ref, self.critic) if g is not None]
        for group in groups:
            group.shutdown()
        for pg in {id(g.placement_group): g.placement_group for g in groups}.values():
            remove_placement_group(pg)
        if self.owns_engines:
            for engine in self.engines:
                ray.kill(engine)
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()


def start_ray(cfg: Any) -> bool:
    """Join --ray_address / RAY_ADDRESS (e.g. under `ray job submit`), else start a local cluster on loopback.
    Returns True when this process started the cluster."""
    import ray

    if ray.is_initialized():
        return False
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env={"env_vars": WORKER_ENV})
        return True
    ray.init(num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": WORKER_ENV})
    return True


def validate_rl(cfg: Any) -> None:
    require(cfg, "pretrain", "prompt_data")
    if not (cfg.remote_rm_url or cfg.reward_pretrain):
        raise ConfigError("give a reward: --remote_rm_url (reward_func .py, builtin:NAME or http URL) "
                          "or --reward_pretrain")
    if cfg.advantage_estimator in ("group_norm", "dr_grpo", "rloo", "reinforce_baseline") and \
            cfg.n_samples_per_prompt < 2:
        raise ConfigError(f"--advantage_estimator {cfg.advantage_estimator} compares the samples of a prompt: "
                          "set --n_samples_per_prompt >= 2")
    if cfg.dynamic_filtering and cfg.n_samples_per_prompt < 2:
        raise ConfigError("--dynamic_filtering needs --n_samples_per_prompt >= 2")
    buffer = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    if buffer % cfg.train_batch_size and not cfg.dynamic_filtering:
        raise ConfigError(f"--rollout_batch_size x --n_samples_per_prompt = {buffer} is not a multiple of "
                          f"--train_batch_size {cfg.train_batch_size}")
    if cfg.top_p < 1.0:
        log.warning("--top_p %s < 1: the trainer's log-probs do not model the truncated sampling distribution",
                    cfg.top_p)
    if cfg.vllm_sync_backend == "nccl":
        raise ConfigError("--vllm_sync_backend nccl is not available yet; use ray (the object store)")


def load_prompts(cfg: Any, tokenizer: Any, spec: str, split: str, probs: str | None = None) -> list[dict]:
    rows = blend_datasets(spec, probs, split=split, seed=cfg.seed, max_samples=cfg.max_samples)
    samples, stats = build_prompt_samples(rows, tokenizer, input_key=cfg.input_key, label_key=cfg.label_key,
                                          input_template=cfg.input_template,
                                          apply_chat_template=cfg.apply_chat_template,
                                          prompt_max_len=cfg.prompt_max_len)
    log.info("prompts from %s: %s", spec, stats)
    if not samples:
        raise ConfigError(f"no usable prompts in {spec} (stats {stats}): check --input_key and --prompt_max_len")
    return samples


def _groups(cfg: Any, worker_cfg: dict, total_updates: int, has_critic: bool, need_ref: bool):
    actor_world = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
    colocate_ref = cfg.colocate_actor_ref or cfg.colocate_all_models
    actor_pg = make_placement_group(cfg.actor_num_nodes, cfg.actor_num_gpus_per_node, 1.0)
    share = 0.5 if (colocate_ref and need_ref) or (cfg.colocate_all_models and has_critic) else 1.0
    actor = ModelGroup("actor", worker_cfg, actor_pg, actor_world, cfg.actor_num_nodes, share)
    actor.call("init_model", cfg.pretrain, True, total_updates, cfg.actor_learning_rate)
    ref = None
    if need_ref:
        ref_world = actor_world if colocate_ref else cfg.ref_num_nodes * cfg.ref_num_gpus_per_node
        ref_pg = actor_pg if colocate_ref else make_placement_group(cfg.ref_num_nodes, cfg.ref_num_gpus_per_node, 1.0)
        ref = ModelGroup("ref", worker_cfg, ref_pg, ref_world, cfg.ref_num_nodes, share if colocate_ref else 1.0)
        ref.call("init_model", cfg.ref_pretrain or cfg.pretrain, False)
    critic = None
    if has_critic:
        critic_world = cfg.critic_num_nodes * cfg.critic_num_gpus_per_node
        critic_pg = actor_pg if cfg.colocate_all_models else make_placement_group(
            cfg.critic_num_nodes, cfg.critic_num_gpus_per_node, 1.0)
        critic = ModelGroup("critic", worker_cfg, critic_pg, critic_world, cfg.critic_num_nodes,
                            share if cfg.colocate_all_models else 1.0)
        init = cfg.critic_pretrain or (cfg.reward_pretrain.split(",")[0] if cfg.reward_pretrain else cfg.pretrain)
        critic.call("init_model", init, True, total_updates, cfg.critic_learning_rate, True)
    return actor, ref, critic


def _engines(cfg: Any, path: str) -> list[Any]:
    if cfg.rollout_backend == "hf":
        from rlhfkit.rollout.hf_engine import create_hf_engines

        return create_hf_engines(cfg.vllm_num_engines, path)
    from rlhfkit.rollout.vllm_engine import create_vllm_engines, engine_options_from_args

    options = engine_options_from_args(cfg)
    if cfg.vllm_dtype != "auto":
        options["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[cfg.vllm_dtype]
    return create_vllm_engines(cfg.vllm_num_engines, path, **options)


def reward_source(cfg: Any) -> Any:
    from rlhfkit.rewards.sources import build_reward_source

    specs = ",".join(x for x in (cfg.reward_pretrain, cfg.remote_rm_url) if x)
    return build_reward_source(specs, timeout=cfg.reward_timeout, error_policy=cfg.reward_error_policy,
                               model_kwargs={"micro_batch_size": cfg.micro_rollout_batch_size},
                               remote_kwargs={"timeout": cfg.reward_timeout})


def build_setup(cfg: Any, engines: list[Any] | None = None) -> RLSetup:
    """Everything a run needs. `engines`: already-running rollout engines to reuse (tests, notebooks)."""
    validate_rl(cfg)
    owns_ray = start_ray(cfg)
    prepare_run_dir(cfg, True, cfg.actor_num_nodes * cfg.actor_num_gpus_per_node)
    cfg.pretrain = resolve_pretrain(cfg.pretrain)
    tokenizer = load_tokenizer(cfg.pretrain)
    if cfg.tokenizer_chat_template:
        tokenizer.chat_template = cfg.tokenizer_chat_template
    prompts = load_prompts(cfg, tokenizer, cfg.prompt_data, cfg.prompt_split, cfg.prompt_data_probs)
    eval_prompts = load_prompts(cfg, tokenizer, cfg.eval_dataset, cfg.eval_split) if cfg.eval_dataset else []
    steps_per_episode = len(prompts) // cfg.rollout_batch_size
    if steps_per_episode == 0:
        raise ConfigError(f"{len(prompts)} prompts are fewer than --rollout_batch_size {cfg.rollout_batch_size}")
    total_steps = steps_per_episode * cfg.num_episodes
    buffer = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    updates = total_steps * cfg.max_epochs * max(1, -(-buffer // cfg.train_batch_size))
    worker_cfg = {k: v for k, v in config_to_dict(cfg).items()}
    has_critic = cfg.advantage_estimator == "gae"
    need_ref = cfg.init_kl_coef > 0
    actor, ref, critic = _groups(cfg, worker_cfg, updates, has_critic, need_ref)
    owns_engines = engines is None
    if engines is None:
        engines = _engines(cfg, cfg.pretrain)
    else:  # reused engines start from this run's initial weights
        state = next(sd for sd in actor.call("state_dict_for_sync") if sd is not None)
        sync_weights(engines, state.items(), bucket_bytes=cfg.weight_sync_bucket_mb << 20)
    reward_fn = reward_source(cfg)
    stop_ids = sorted({i for i in [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
                       if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id})
    s = RLSetup(cfg, tokenizer, prompts, eval_prompts, actor, ref, critic, engines, reward_fn, stop_ids, total_steps,
                owns_ray=owns_ray, owns_engines=owns_engines)
    s.summary = {"actor ranks": actor.world_size, "reference": ref.world_size if ref else "off (init_kl_coef 0)",
                 "critic": critic.world_size if critic else "off", "rollout engines": len(engines),
                 "backend": cfg.rollout_backend, "prompts": len(prompts), "eval prompts": len(eval_prompts),
                 "samples per step": buffer, "optimizer steps per rollout": updates // max(1, total_steps),
                 "total steps": total_steps, "estimator": cfg.advantage_estimator}
    if cfg.load_checkpoint:
        _resume(s)
    return s


def _resume(s: RLSetup) -> None:
    states = s.actor.call("load_checkpoint", f"{s.cfg.ckpt_path}/actor")
    if states[0] is None:
        log.info("--load_checkpoint: nothing in %s/actor, starting fresh", s.cfg.ckpt_path)
        return
    if s.critic is not None:
        s.critic.call("load_checkpoint", f"{s.cfg.ckpt_path}/critic")
    s.start_step, s.start_cursor = states[0]["step"], states[0]["cursor"]
    state = next(sd for sd in s.actor.call("state_dict_for_sync") if sd is not None)
    sync_weights(s.engines, state.items(), bucket_bytes=s.cfg.weight_sync_bucket_mb << 20)
    log.info("resumed at step %d (prompt cursor %d); engine weights synced", s.start_step, s.start_cursor)


def save_final(s: RLSetup) -> None:
    s.actor.call("save_hf", s.cfg.save_path, s.cfg.pretrain)
    log.info("saved the policy to %s", s.cfg.save_path)
