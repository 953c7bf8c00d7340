"""Optimiser settings: ppo's per-role flags (actor, critic) and their resolution against the shared ones.

The shared flags (`--adam_betas`, `--adam_eps`, `--l2`, `--max_norm`, `--lr_scheduler`, `--lr_warmup_ratio`,
`--min_lr_ratio`, `--optim`, `--muon_*`; rlhfkit.config.options.TrainOptions) set every trained model. In ppo each
trained role has ONE group, `RoleOptimGroup` instantiated per role (`ActorOptimOptions`, `CriticOptimOptions`): its
peak learning rate `--<role>_learning_rate` and a `--<role>_<flag>` per shared flag (OpenRLHF 0.11's
`--actor.adam.betas`, `--critic.max_norm`, ...), unset by default: an unset per-role flag inherits the shared one, so
a script without them behaves as before. The settings are declared once, in `ROLE_SETTINGS`; `optim_settings(cfg,
role)` resolves them (`role_optim_values`); TrainEngine builds its optimizer, schedule and clipping from the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from rlhfkit.config.options import opt
from rlhfkit.errors import ConfigError


@dataclass(frozen=True)
class RoleSetting:
    """One optimiser setting a role may set for itself (ROLE_SETTINGS' key: the shared flag it overrides): the
    OptimSettings field it fills, its type and its help."""

    field: str
    type: Any
    what: str
    choices: tuple[str, ...] = ()


# The settings a role may override, declared once, by shared flag name: every per-role group, its flags' help and
# the resolution read it.
ROLE_SETTINGS: dict[str, RoleSetting] = {
    "optim": RoleSetting("optim", str, "optimizer", ("adam", "muon")),
    "adam_betas": RoleSetting("betas", list[float], "AdamW betas"),
    "adam_eps": RoleSetting("eps", float, "AdamW epsilon"),
    "l2": RoleSetting("weight_decay", float, "weight decay"),
    "max_norm": RoleSetting("max_norm", float, "gradient clipping norm, 0 disables"),
    "lr_scheduler": RoleSetting("lr_scheduler", str, "schedule after warmup",
                                ("cosine_with_min_lr", "cosine", "constant", "linear")),
    "lr_warmup_ratio": RoleSetting("lr_warmup_ratio", float, "fraction of steps of linear warmup"),
    "min_lr_ratio": RoleSetting("min_lr_ratio", float, "final lr as a fraction of the peak"),
    "muon_lr": RoleSetting("muon_lr", float, "Muon learning rate"),
    "muon_momentum": RoleSetting("muon_momentum", float, "Muon momentum"),
    "muon_ns_steps": RoleSetting("muon_ns_steps", int, "Newton-Schulz iterations"),
    "muon_nesterov": RoleSetting("muon_nesterov", bool, "Nesterov momentum in Muon"),
}
TRAINED_ROLES = ("actor", "critic")


class RoleOptimGroup:
    """One trained role's optimiser group, declared by `class XOptimOptions(RoleOptimGroup, role=..., learning_rate=
    ...)` under @dataclass: before the dataclass is made, it gets `<role>_learning_rate` (the role's peak AdamW
    learning rate, default `learning_rate`) and `<role>_<flag>` for each of ROLE_SETTINGS (None: the shared --<flag>).
    Not a dataclass itself (a flag lives in exactly one group). Read the fields with `role_learning_rate` and
    `role_optim_values`, which name them from the role."""

    role: ClassVar[str] = ""

    def __init_subclass__(cls, *, role: str = "", learning_rate: float = 0.0, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not role:  # a command's class that has the group: its fields are already declared
            return
        cls.role = role
        annotations = cls.__dict__.get("__annotations__", {})
        cls.__annotations__ = annotations
        annotations[f"{role}_learning_rate"] = float
        setattr(cls, f"{role}_learning_rate", opt(learning_rate, f"{role}: peak learning rate"))
        for flag, s in ROLE_SETTINGS.items():
            extra: dict[str, Any] = {"choices": list(s.choices)} if s.choices else {}
            annotations[f"{role}_{flag}"] = s.type | None
            setattr(cls, f"{role}_{flag}", opt(None, f"{role}: {s.what} (unset: --{flag})", **extra))


@dataclass
class ActorOptimOptions(RoleOptimGroup, role="actor", learning_rate=1e-6):
    """Optimiser of the actor (policy; unset: the shared flag)"""


@dataclass
class CriticOptimOptions(RoleOptimGroup, role="critic", learning_rate=9e-6):
    """Optimiser of the critic (value model; unset: the shared flag)"""


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


def _check_role(role: str) -> None:
    if role not in TRAINED_ROLES:
        raise ValueError(f"no optimiser flags for role {role!r}: expected one of {TRAINED_ROLES}")


def role_optim_values(cfg: object, role: str) -> dict[str, Any]:
    """`--<role>_<flag>` for each of ROLE_SETTINGS (None: unset), by shared flag name; `cfg` has the role's group."""
    _check_role(role)
    return {flag: getattr(cfg, f"{role}_{flag}") for flag in ROLE_SETTINGS}


def role_learning_rate(cfg: object, role: str) -> float:
    """--actor_learning_rate or --critic_learning_rate."""
    _check_role(role)
    return float(getattr(cfg, f"{role}_learning_rate"))


class SharedOptimFlags(Protocol):
    """What `optim_settings` reads by type: --learning_rate (TrainOptions); the flags of ROLE_SETTINGS (the shared
    ones and, with a role, the role's) it reads by name."""

    learning_rate: float


def optim_settings(cfg: SharedOptimFlags, role: str | None = None, learning_rate: float | None = None) -> OptimSettings:
    """The settings of `role` ('actor', 'critic'; None: the offline commands' one model): each `--<role>_<flag>`
    that is set, else the shared `--<flag>`. `learning_rate`: AdamW's peak lr (default --learning_rate).
    ConfigError names the flag of a value out of range. With a role, `cfg` has the role's RoleOptimGroup too."""
    own = role_optim_values(cfg, role) if role else {}
    values: dict[str, Any] = {}
    flags: dict[str, str] = {}
    for flag, s in ROLE_SETTINGS.items():
        mine = own.get(flag)
        values[s.field] = mine if mine is not None else getattr(cfg, flag)
        flags[s.field] = f"{role}_{flag}" if mine is not None else flag
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


def validate_optim(cfg: SharedOptimFlags, roles: tuple[str, ...] = (), absent: tuple[str, ...] = ()) -> None:
    """Resolve every trained role's settings before anything starts (ConfigError on a bad value). `absent`: roles
    this run does not train; their per-role flags are refused rather than ignored. Roles: `cfg` is ppo's."""
    for role in roles or (None,):
        optim_settings(cfg, role, role_learning_rate(cfg, role) if role else None)
    for role in absent:
        given = [f"--{role}_{flag}" for flag, value in role_optim_values(cfg, role).items()
                 if value is not None]
        if given:
            raise ConfigError(f"{', '.join(given)}: this run trains no {role} (only --advantage_estimator gae has a "
                              f"value model), so the flag would do nothing; drop it")
