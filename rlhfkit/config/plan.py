"""The facts an online run derives from its flags and its cluster, resolved once (#12, #30): `RunPlan`.

`resolve_plan(cfg)` reads the ppo options and answers, in one place, what the rest of the run would otherwise
re-derive from the raw flags:

- `needs_critic`: `--advantage_estimator gae` (the only estimator with a value model);
- `group_estimator`: the estimator compares the samples of a prompt (reinforce_baseline, group_norm, dr_grpo,
  rloo), so it needs `--n_samples_per_prompt >= 2` and undiscounted returns;
- `kl_mode`: "off" (`--init_kl_coef` 0: no reference model), "penalty" (the KL is subtracted from the rewards) or
  "loss" (`--use_kl_loss`: the KL is a term of the policy loss); always "off" with `--advantage_estimator
  on_policy_distill`, whose reference role holds the teacher instead; `kl_estimator` and `init_kl_coef` beside it
  (`kl_coef(value)`: a step's coefficient, --init_kl_coef when no adaptive controller gives one);
- `distill`: on-policy distillation (`on_policy_distill`); `needs_ref` is `kl_mode != "off" or distill`, and
  `reference_model` is what the reference role loads (the teacher, or --ref_pretrain / --pretrain; None without a
  reference); `reward_models`: the --reward_pretrain specs that are models (each a Ray group), given by the caller
  (`rlhfkit.rl.validate.plan_run`: the rule is the rewards package's);
- the world size of each role (`--<role>_num_nodes x --<role>_num_gpus_per_node`);
- `sync_transport`: the weight transport `--vllm_sync_backend` means on this cluster (ray, gloo or nccl), once the
  driver knows whether the cluster has GPUs (`resolve_plan(cfg, has_gpus)` or `plan.on_cluster(...)`), else None;
  nccl on a cluster without GPUs falls back to gloo (the same broadcast) with one warning.

What only the cluster answers is filled by the driver once Ray runs (`on_cluster`, a new frozen plan): the trainer
and engine dtypes (`--param_dtype` / `--vllm_dtype` auto resolved, `rlhfkit.engine.precision`) and the decision
record, the model path (`--pretrain` resolved to a folder), the run folder (`--run_dir` or the default); and once the
engines exist, `lora_sync` (`--lora_sync auto` resolved against them, `with_lora_sync`). Before that these fields
hold the flags as given. The user's config object is never written to: everything resolved lives here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Literal

from rlhfkit.config.commands import PPOConfig, PrecisionRecord
from rlhfkit.config.rl_options import PlacementOptions
from rlhfkit.errors import ConfigError

logger = logging.getLogger(__name__)

# The estimators whose baseline is the other samples of the same prompt (rlhfkit.algorithms.advantages keeps the
# same tuple: algorithms imports nothing of ours; tests/config/test_plan.py checks that the two agree).
GROUP_ESTIMATORS = ("reinforce_baseline", "group_norm", "dr_grpo", "rloo")
DISTILL_ESTIMATOR = "on_policy_distill"
ROLES = ("actor", "ref", "critic", "reward")
KLMode = Literal["off", "penalty", "loss"]


def resolve_sync_backend(requested: str, has_gpus: bool, colocated: bool) -> str:
    """The transport `--vllm_sync_backend requested` means on this cluster; ConfigError where it cannot work."""
    if requested == "auto":
        if not has_gpus:
            return "gloo"
        return "ray" if colocated else "nccl"
    if requested == "nccl" and not has_gpus:  # one launch script for a laptop and a cluster (#13)
        logger.warning("--vllm_sync_backend nccl: this Ray cluster has no GPUs, so the weights go over gloo, the "
                       "same broadcast on CPU")
        return "gloo"
    if requested == "nccl" and colocated:
        raise ConfigError("--vllm_sync_backend nccl cannot be used with --colocate_all_models: NCCL cannot connect "
                          "two processes on the same GPU (trainer rank and engine share it). Use "
                          "--vllm_sync_backend ray, gloo, or auto (which picks ray here)")
    if requested not in ("ray", "gloo", "nccl"):
        raise ConfigError(f"--vllm_sync_backend {requested!r}: expected auto, ray, gloo or nccl")
    return requested


@dataclass(frozen=True)
class RunPlan:
    """The derived facts of one online run (module docstring); frozen: a resolution makes a new plan."""

    estimator: str
    needs_critic: bool
    group_estimator: bool
    kl_mode: KLMode
    layout: tuple[tuple[str, int, int], ...]   # (role, nodes, ranks per node) for each of ROLES
    sync_transport: str | None = None          # ray | gloo | nccl once resolved against the cluster
    distill: bool = False                      # on_policy_distill: the reference role holds the teacher
    kl_estimator: str = "k1"                   # --kl_estimator: the penalty's and the KL loss's estimate
    init_kl_coef: float = 0.0                  # --init_kl_coef: the KL coefficient without an adaptive controller
    reference_model: str | None = None         # what the reference role loads (as given; None: no reference)
    reward_models: tuple[str, ...] = ()        # --reward_pretrain specs that are reward models (Ray groups)
    requested_transport: str = "auto"          # --vllm_sync_backend as given
    colocate_all: bool = False                 # --colocate_all_models (the transport depends on it)
    trainer_dtype: str = "auto"                # --param_dtype, concrete once resolved against the cluster
    engine_dtype: str = "auto"                 # --vllm_dtype, concrete once resolved (auto: the trainer's)
    precision: PrecisionRecord | None = None   # the precision decision (manifest, start-up table, MFU)
    model_path: str | None = None              # --pretrain, a local folder once resolved
    run_dir: str | None = None                 # --run_dir, or the default folder once resolved
    lora_sync: str = "auto"                    # --lora_sync, adapter or merged once resolved against the engines

    @property
    def transport(self) -> str:
        """The resolved weight transport (ray, gloo or nccl); RuntimeError before `on_cluster`."""
        if self.sync_transport is None:
            raise RuntimeError("the run plan was not resolved against the cluster: the weight transport is unknown")
        return self.sync_transport

    @property
    def adapter_sync(self) -> bool:
        """The engines receive only the LoRA adapter (--lora_sync resolved to adapter)."""
        return self.lora_sync == "adapter"

    def kl_coef(self, value: float | None = None) -> float:
        """A step's KL coefficient: `value` (the adaptive controller's, --kl_target), else --init_kl_coef."""
        return self.init_kl_coef if value is None else value

    def on_cluster(self, has_gpus: bool, *, precision: PrecisionRecord, trainer_dtype: str, engine_dtype: str,
                   run_dir: str) -> RunPlan:
        """This plan with what the cluster answers: the transport, the dtypes (with the decision record) and the run
        folder."""
        transport = resolve_sync_backend(self.requested_transport, has_gpus, self.colocate_all)
        return replace(self, sync_transport=transport, trainer_dtype=trainer_dtype,
                       engine_dtype=engine_dtype, precision=precision, run_dir=run_dir)

    def resolved_flags(self) -> dict[str, Any]:
        """The flags this plan resolves, under their flag names, with the plan's values (the run's records show
        these instead of the values given; a field not resolved yet holds the flag as given)."""
        return {"pretrain": self.model_path, "param_dtype": self.trainer_dtype, "vllm_dtype": self.engine_dtype,
                "vllm_sync_backend": self.sync_transport or self.requested_transport, "run_dir": self.run_dir,
                "lora_sync": self.lora_sync}

    def with_model_path(self, path: str) -> RunPlan:
        """This plan with --pretrain resolved to a local folder (`rlhfkit.models.loading.resolve_pretrain`)."""
        return replace(self, model_path=path)

    def with_lora_sync(self, mode: str) -> RunPlan:
        """This plan with --lora_sync resolved against the engines (adapter or merged)."""
        return replace(self, lora_sync=mode)

    @property
    def needs_ref(self) -> bool:
        """A reference model is loaded: the KL is a penalty or a loss, or the role scores as the teacher."""
        return self.kl_mode != "off" or self.distill

    def nodes(self, role: str) -> int:
        return self._row(role)[1]

    def ranks_per_node(self, role: str) -> int:
        return self._row(role)[2]

    def world(self, role: str) -> int:
        """The role's rank count: its nodes x ranks per node."""
        _, nodes, per_node = self._row(role)
        return nodes * per_node

    def _row(self, role: str) -> tuple[str, int, int]:
        for row in self.layout:
            if row[0] == role:
                return row
        raise KeyError(f"no role {role!r}: expected one of {ROLES}")


def kl_mode_of(init_kl_coef: float, use_kl_loss: bool) -> KLMode:
    """off without a KL coefficient (no reference model), loss with --use_kl_loss, else a reward penalty."""
    if init_kl_coef <= 0:
        return "off"
    return "loss" if use_kl_loss else "penalty"


def run_kl_mode(cfg: PPOConfig) -> KLMode:
    """The run's KL to a reference: `kl_mode_of` the flags, "off" with on_policy_distill (the reference role holds
    the teacher, whose log-ratio is the advantage itself)."""
    if cfg.advantage_estimator == DISTILL_ESTIMATOR:
        return "off"
    return kl_mode_of(cfg.init_kl_coef, bool(cfg.use_kl_loss))


def reference_model(cfg: PPOConfig) -> str:
    """What the reference role loads: with on_policy_distill the teacher (--teacher_model, else --ref_pretrain;
    validate_rl refuses a run with neither), otherwise --ref_pretrain, else --pretrain."""
    if cfg.advantage_estimator == DISTILL_ESTIMATOR:
        teacher = cfg.teacher_model or cfg.ref_pretrain
        if not teacher:
            raise ConfigError("--advantage_estimator on_policy_distill needs a teacher: --teacher_model PATH (or "
                              "--ref_pretrain PATH); the student (--pretrain) cannot be its own teacher")
        return teacher
    if cfg.pretrain is None:
        raise ConfigError("--pretrain is required")
    return cfg.ref_pretrain or cfg.pretrain


def _named_reference(cfg: PPOConfig) -> str | None:
    """`reference_model`, or None where the flags name none (no --pretrain, or on_policy_distill without a
    teacher: validate_rl refuses such a run with `reference_model`'s error)."""
    try:
        return reference_model(cfg)
    except ConfigError:
        return None


def role_layout(cfg: PlacementOptions) -> tuple[tuple[str, int, int], ...]:
    """(role, --<role>_num_nodes, --<role>_num_gpus_per_node) for each of ROLES, in that order."""
    return (("actor", int(cfg.actor_num_nodes), int(cfg.actor_num_gpus_per_node)),
            ("ref", int(cfg.ref_num_nodes), int(cfg.ref_num_gpus_per_node)),
            ("critic", int(cfg.critic_num_nodes), int(cfg.critic_num_gpus_per_node)),
            ("reward", int(cfg.reward_num_nodes), int(cfg.reward_num_gpus_per_node)))


def resolve_plan(cfg: PPOConfig, has_gpus: bool | None = None, reward_models: tuple[str, ...] = ()) -> RunPlan:
    """The run's derived facts from its ppo options; `has_gpus` (known once Ray runs) resolves the sync transport;
    `reward_models`: the --reward_pretrain specs that are models (`rlhfkit.rl.validate.plan_run` gives them)."""
    estimator = cfg.advantage_estimator
    layout = role_layout(cfg)
    transport = None if has_gpus is None else \
        resolve_sync_backend(cfg.vllm_sync_backend, has_gpus, bool(cfg.colocate_all_models))
    kl_mode = run_kl_mode(cfg)
    distill = estimator == DISTILL_ESTIMATOR
    needs_ref = kl_mode != "off" or distill
    reference = _named_reference(cfg) if needs_ref else None
    return RunPlan(estimator=estimator, needs_critic=estimator == "gae", group_estimator=estimator in GROUP_ESTIMATORS,
                   kl_mode=kl_mode, layout=layout, sync_transport=transport, distill=distill,
                   kl_estimator=cfg.kl_estimator, init_kl_coef=float(cfg.init_kl_coef),
                   reference_model=reference, reward_models=tuple(reward_models),
                   requested_transport=cfg.vllm_sync_backend, colocate_all=bool(cfg.colocate_all_models),
                   trainer_dtype=cfg.param_dtype, engine_dtype=cfg.vllm_dtype, model_path=cfg.pretrain,
                   run_dir=cfg.run_dir, lora_sync=cfg.lora_sync)
