"""Optimiser settings: ppo's per-role flags (actor, critic) and their resolution against the shared ones.

The shared flags (`--adam_betas`, `--adam_eps`, `--l2`, `--max_norm`, `--lr_scheduler`, `--lr_warmup_ratio`,
`--min_lr_ratio`, `--optim`, `--muon_*`; rlhfkit.config.options.TrainOptions) set every trained model. In ppo each
has a `--actor_<flag>` and a `--critic_<flag>` form (OpenRLHF 0.11's `--actor.adam.betas`, `--critic.max_norm`, ...),
unset by default: an unset per-role flag inherits the shared one, so a script without them behaves as before.
`optim_settings(cfg, role)` resolves them once (typed reads: `shared_optim_values`, `role_optim_values`);
TrainEngine builds its optimizer, schedule and clipping from the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, cast

from rlhfkit.config.options import TrainOptions, opt
from rlhfkit.errors import ConfigError

_INHERIT = "unset: --{flag}"


def _role(role: str, flag: str, what: str, **extra) -> Any:
    return opt(None, f"{role}: {what} ({_INHERIT.format(flag=flag)})", **extra)


@dataclass
class RoleOptimOptions:
    """Optimiser per role (actor, critic; unset: the shared flag)"""

    actor_optim: str | None = _role("actor", "optim", "optimizer", choices=["adam", "muon"])
    critic_optim: str | None = _role("critic", "optim", "optimizer", choices=["adam", "muon"])
    actor_adam_betas: list[float] | None = _role("actor", "adam_betas", "AdamW betas")
    critic_adam_betas: list[float] | None = _role("critic", "adam_betas", "AdamW betas")
    actor_adam_eps: float | None = _role("actor", "adam_eps", "AdamW epsilon")
    critic_adam_eps: float | None = _role("critic", "adam_eps", "AdamW epsilon")
    actor_l2: float | None = _role("actor", "l2", "weight decay")
    critic_l2: float | None = _role("critic", "l2", "weight decay")
    actor_max_norm: float | None = _role("actor", "max_norm", "gradient clipping norm, 0 disables")
    critic_max_norm: float | None = _role("critic", "max_norm", "gradient clipping norm, 0 disables")
    actor_lr_scheduler: str | None = _role("actor", "lr_scheduler", "schedule after warmup",
                                           choices=["cosine_with_min_lr", "cosine", "constant", "linear"])
    critic_lr_scheduler: str | None = _role("critic", "lr_scheduler", "schedule after warmup",
                                            choices=["cosine_with_min_lr", "cosine", "constant", "linear"])
    actor_lr_warmup_ratio: float | None = _role("actor", "lr_warmup_ratio", "fraction of steps of linear warmup")
    critic_lr_warmup_ratio: float | None = _role("critic", "lr_warmup_ratio", "fraction of steps of linear warmup")
    actor_min_lr_ratio: float | None = _role("actor", "min_lr_ratio", "final lr as a fraction of the peak")
    critic_min_lr_ratio: float | None = _role("critic", "min_lr_ratio", "final lr as a fraction of the peak")
    actor_muon_lr: float | None = _role("actor", "muon_lr", "Muon learning rate")
    critic_muon_lr: float | None = _role("critic", "muon_lr", "Muon learning rate")
    actor_muon_momentum: float | None = _role("actor", "muon_momentum", "Muon momentum")
    critic_muon_momentum: float | None = _role("critic", "muon_momentum", "Muon momentum")
    actor_muon_ns_steps: int | None = _role("actor", "muon_ns_steps", "Newton-Schulz iterations")
    critic_muon_ns_steps: int | None = _role("critic", "muon_ns_steps", "Newton-Schulz iterations")
    actor_muon_nesterov: bool | None = _role("actor", "muon_nesterov", "Nesterov momentum in Muon")
    critic_muon_nesterov: bool | None = _role("critic", "muon_nesterov", "Nesterov momentum in Muon")


# The settings a role may override: shared flag name -> OptimSettings field.
SHARED_OPTIM_FLAGS: dict[str, str] = {
    "optim": "optim", "adam_betas": "betas", "adam_eps": "eps", "l2": "weight_decay", "max_norm": "max_norm",
    "lr_scheduler": "lr_scheduler", "lr_warmup_ratio": "lr_warmup_ratio", "min_lr_ratio": "min_lr_ratio",
    "muon_lr": "muon_lr", "muon_momentum": "muon_momentum", "muon_ns_steps": "muon_ns_steps",
    "muon_nesterov": "muon_nesterov",
}
TRAINED_ROLES = ("actor", "critic")


@dataclass(frozen=True)
class OptimSettings:
    """One trained model's optimizer, schedule and clipping. `lr` is AdamW's (all parameters with --optim adam; the
    non-matrix ones with muon); `flags` names the flag each setting came from, for error messages."""

    optim: str
    lr: float
    betas: tuple[float, ...]
    eps: float
    weight_decay: float
    max_norm: float
    lr_scheduler: str
    lr_warmup_ratio: float
    min_lr_ratio: float
    muon_lr: float
    muon_momentum: float
    muon_ns_steps: int
    muon_nesterov: bool
    flags: tuple[tuple[str, str], ...] = ()

    def flag(self, field: str) -> str:
        return dict(self.flags).get(field, field)


def shared_optim_values(cfg: TrainOptions) -> dict[str, Any]:
    """The shared flags of SHARED_OPTIM_FLAGS, by flag name."""
    return {"optim": cfg.optim, "adam_betas": cfg.adam_betas, "adam_eps": cfg.adam_eps, "l2": cfg.l2,
            "max_norm": cfg.max_norm, "lr_scheduler": cfg.lr_scheduler, "lr_warmup_ratio": cfg.lr_warmup_ratio,
            "min_lr_ratio": cfg.min_lr_ratio, "muon_lr": cfg.muon_lr, "muon_momentum": cfg.muon_momentum,
            "muon_ns_steps": cfg.muon_ns_steps, "muon_nesterov": cfg.muon_nesterov}


def role_optim_values(cfg: RoleOptimOptions, role: str) -> dict[str, Any]:
    """`--<role>_<flag>` for each flag of SHARED_OPTIM_FLAGS (None: unset), by shared flag name."""
    if role == "actor":
        return {"optim": cfg.actor_optim, "adam_betas": cfg.actor_adam_betas, "adam_eps": cfg.actor_adam_eps,
                "l2": cfg.actor_l2, "max_norm": cfg.actor_max_norm, "lr_scheduler": cfg.actor_lr_scheduler,
                "lr_warmup_ratio": cfg.actor_lr_warmup_ratio, "min_lr_ratio": cfg.actor_min_lr_ratio,
                "muon_lr": cfg.actor_muon_lr, "muon_momentum": cfg.actor_muon_momentum,
                "muon_ns_steps": cfg.actor_muon_ns_steps, "muon_nesterov": cfg.actor_muon_nesterov}
    if role == "critic":
        return {"optim": cfg.critic_optim, "adam_betas": cfg.critic_adam_betas, "adam_eps": cfg.critic_adam_eps,
                "l2": cfg.critic_l2, "max_norm": cfg.critic_max_norm, "lr_scheduler": cfg.critic_lr_scheduler,
                "lr_warmup_ratio": cfg.critic_lr_warmup_ratio, "min_lr_ratio": cfg.critic_min_lr_ratio,
                "muon_lr": cfg.critic_muon_lr, "muon_momentum": cfg.critic_muon_momentum,
                "muon_ns_steps": cfg.critic_muon_ns_steps, "muon_nesterov": cfg.critic_muon_nesterov}
    raise ValueError(f"no optimiser flags for role {role!r}: expected one of {TRAINED_ROLES}")


def role_learning_rate(cfg: RoleOptimLR, role: str) -> float:
    """--actor_learning_rate or --critic_learning_rate."""
    if role not in TRAINED_ROLES:
        raise ValueError(f"no learning rate for role {role!r}: expected one of {TRAINED_ROLES}")
    return cfg.actor_learning_rate if role == "actor" else cfg.critic_learning_rate


class RoleOptimLR(Protocol):
    actor_learning_rate: float
    critic_learning_rate: float


class OptimFlags(Protocol):
    """What `optim_settings` reads: TrainOptions' shared flags (and, for a role, RoleOptimOptions')."""

    learning_rate: float
    optim: str
    adam_betas: list[float]
    adam_eps: float
    l2: float
    max_norm: float
    lr_scheduler: str
    lr_warmup_ratio: float
    min_lr_ratio: float
    muon_lr: float
    muon_momentum: float
    muon_ns_steps: int
    muon_nesterov: bool


def optim_settings(cfg: OptimFlags, role: str | None = None, learning_rate: float | None = None) -> OptimSettings:
    """The settings of `role` ('actor', 'critic'; None: the offline commands' one model): each `--<role>_<flag>`
    that is set, else the shared `--<flag>`. `learning_rate`: AdamW's peak lr (default --learning_rate).
    ConfigError names the flag of a value out of range. With a role, `cfg` has ppo's RoleOptimOptions too."""
    shared = shared_optim_values(cast(TrainOptions, cfg))
    own = role_optim_values(cast(RoleOptimOptions, cfg), role) if role else {}
    values: dict[str, Any] = {}
    flags: dict[str, str] = {}
    for name, field in SHARED_OPTIM_FLAGS.items():
        mine = own.get(name)
        values[field] = mine if mine is not None else shared[name]
        flags[field] = f"{role}_{name}" if mine is not None else name
    lr = cfg.learning_rate if learning_rate is None else learning_rate
    betas = values.pop("betas")
    settings = OptimSettings(lr=float(lr), betas=tuple(float(b) for b in betas), flags=tuple(flags.items()),
                             **values)
    _check(settings)
    return settings


def _check(s: OptimSettings) -> None:
    def bad(field: str, value: Any, need: str) -> ConfigError:
        return ConfigError(f"--{s.flag(field)} {value}: {need}")

    if len(s.betas) != 2 or not all(0.0 <= b < 1.0 for b in s.betas):
        raise bad("betas", " ".join(map(str, s.betas)), "give two betas, each in [0, 1)")
    if s.eps <= 0:
        raise bad("eps", s.eps, "must be > 0")
    if s.weight_decay < 0:
        raise bad("weight_decay", s.weight_decay, "must be >= 0")
    if s.max_norm < 0:
        raise bad("max_norm", s.max_norm, "must be >= 0 (0 disables clipping)")
    if not 0.0 <= s.lr_warmup_ratio <= 1.0:
        raise bad("lr_warmup_ratio", s.lr_warmup_ratio, "must lie in [0, 1]")
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        raise bad("min_lr_ratio", s.min_lr_ratio, "must lie in [0, 1]")
    if s.muon_lr < 0:
        raise bad("muon_lr", s.muon_lr, "must be >= 0")
    if not 0.0 <= s.muon_momentum < 1.0:
        raise bad("muon_momentum", s.muon_momentum, "must lie in [0, 1)")
    if not 1 <= s.muon_ns_steps < 100:
        raise bad("muon_ns_steps", s.muon_ns_steps, "must lie in [1, 99] (torch.optim.Muon's limit)")


def validate_optim(cfg: OptimFlags, roles: tuple[str, ...] = (), absent: tuple[str, ...] = ()) -> None:
    """Resolve every trained role's settings before anything starts (ConfigError on a bad value). `absent`: roles
    this run does not train; their per-role flags are refused rather than ignored. Roles: `cfg` is ppo's."""
    for role in roles or (None,):
        optim_settings(cfg, role, role_learning_rate(cast(RoleOptimLR, cfg), role) if role else None)
    for role in absent:
        given = [f"--{role}_{flag}" for flag, value in role_optim_values(cast(RoleOptimOptions, cfg), role).items()
                 if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: this run trains no {role} (only --advantage_estimator gae has a "
                              f"value model), so the flag would do nothing; drop it")
