"""Choose reward sources from specs and combine several into one.

A spec list is the comma-separated values of ``--reward_pretrain`` and ``--remote_rm_url`` together. Each spec is:

* ``http://...`` / ``https://...``: a reward server; **all** URLs form one :class:`RemoteRewardClient` whose
  servers share each batch (replicas of one reward, as OpenRLHF's list of ``--remote_rm_url`` servers);
* ``*.py``: a user ``reward_func`` file (:class:`RewardFuncSource`);
* ``builtin:NAME``: a built-in verifier (``math``, ``format``, ``exact``);
* anything else: a reward model (local folder, hub name, ``.gguf``, ``embedded:...``; :class:`RewardModelSource`).

Several sources are combined per sample by :func:`combine`: ``mean`` (default) or ``sum`` of their rewards, or with
``weights`` a weighted sum ``sum_i w_i * r_i``. Scores combine the same way. Each source's own rewards and logs
are kept in ``extra_logs`` under ``"<source name>/..."`` (a repeated name gets ``#2``, ...); ``failed`` adds the
sources' counts, and ``extra_logs["reward_failure"]`` joins each sample's failure reasons (``","``).

``builtin:code`` bounds each program it runs by ``--reward_timeout`` (a program over it scores 0 with the reason
``timeout``), so its calls get no batch deadline; every other reward_func and built-in gets ``--reward_timeout``
per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhfkit.rewards.base import FAILURE_KEY, RewardOutput, RewardSource, check_batch, failure_reasons
from rlhfkit.rewards.remote import RemoteRewardClient, max_response_bytes, remote_timeout
from rlhfkit.rewards.reward_func import DEFAULT_TIMEOUT, RewardFuncSource
from rlhfkit.rewards.reward_model import RewardModelSource
from rlhfkit.rewards.sandbox import SandboxLimits
from rlhfkit.rewards.verifiers import get_builtin

COMBINE_RULES = ("mean", "sum")
BUILTIN_PREFIX = "builtin:"


def split_specs(specs: str | Sequence[str] | None) -> list[str]:
    """Flatten comma-separated spec strings into a list, dropping empty items."""
    items = [specs] if isinstance(specs, str) else list(specs or [])
    return [part.strip() for item in items for part in str(item).split(",") if part.strip()]


def spec_kind(spec: str) -> str:
    """``"remote"``, ``"file"``, ``"builtin"`` or ``"model"``."""
    if spec.startswith(("http://", "https://")):
        return "remote"
    if spec.endswith(".py"):
        return "file"
    if spec.startswith(BUILTIN_PREFIX):
        return "builtin"
    return "model"


def build_reward_source(specs: str | Sequence[str], *, timeout: float | None = DEFAULT_TIMEOUT,
                        error_policy: str = "raise", combine_rule: str = "mean",
                        weights: Sequence[float] | None = None, format_pattern: str | None = None,
                        model_kwargs: dict[str, Any] | None = None,
                        remote_kwargs: dict[str, Any] | None = None,
                        code_kwargs: dict[str, Any] | None = None) -> RewardSource:
    """One reward source for ``specs`` (see the module docstring); several are wrapped in :class:`CombinedSource`.

    ``timeout`` / ``error_policy`` apply to reward_func files and built-ins; ``model_kwargs`` go to
    :class:`RewardModelSource` (``micro_batch_size``, ``max_len``, ``normalize_reward``, ``dtype``, ``device``, ...);
    ``remote_kwargs`` to :class:`RemoteRewardClient` (``timeout``, ``retries``, ``backoff``, ``token``,
    ``max_response_bytes``); ``code_kwargs`` to ``builtin:code`` (:func:`code_sandbox_options`).
    """
    items = split_specs(specs)
    if not items:
        raise ValueError("no reward source: set --reward_pretrain (reward model) or --remote_rm_url "
                         "(http(s) URL, reward_func .py file, or builtin:math|format|exact)")
    sources: list[RewardSource] = []
    urls = [s for s in items if spec_kind(s) == "remote"]
    for spec in items:
        kind = spec_kind(spec)
        if kind == "remote":
            if not any(isinstance(s, RemoteRewardClient) for s in sources):
                sources.append(RemoteRewardClient(urls, **(remote_kwargs or {})))
        elif kind == "file":
            sources.append(RewardFuncSource.from_file(spec, timeout=timeout, error_policy=error_policy))
        elif kind == "builtin":
            sources.append(builtin_source(spec, timeout=timeout, error_policy=error_policy,
                                          format_pattern=format_pattern, **(code_kwargs or {})))
        else:
            sources.append(RewardModelSource(spec, **(model_kwargs or {})))
    return sources[0] if len(sources) == 1 and weights is None else CombinedSource(sources, combine_rule, weights)


CODE_PROGRAM_SECONDS = 5.0  # builtin:code's limit per program run (at most --reward_timeout)
CODE_FLAGS = {"code_memory_mb": "memory_mb", "code_max_procs": "max_procs", "code_max_open_files": "max_open_files",
              "code_max_file_mb": "max_file_mb", "code_max_output_kb": "max_output_kb"}


def code_sandbox_options(cfg: Any) -> dict[str, Any]:
    """``builtin_source``'s ``code_sandbox`` / ``code_limits`` from a config with the ``--code_*`` flags (those it
    lacks keep their defaults)."""
    values = {limit: int(getattr(cfg, flag)) for flag, limit in CODE_FLAGS.items() if hasattr(cfg, flag)}
    for flag, value in values.items():
        if value <= 0:
            raise ValueError(f"--{next(f for f, v in CODE_FLAGS.items() if v == flag)} must be positive, got {value}")
    return {"code_sandbox": str(getattr(cfg, "code_sandbox", "auto")), "code_limits": SandboxLimits(**values)}


def builtin_source(spec: str, *, timeout: float | None = DEFAULT_TIMEOUT, error_policy: str = "raise",
                   format_pattern: str | None = None, code_sandbox: str = "auto",
                   code_limits: SandboxLimits | None = None) -> RewardFuncSource:
    """The source of a ``builtin:NAME`` spec. ``timeout`` (``--reward_timeout``) bounds each call, except for
    ``builtin:code``, which bounds each program run by ``CODE_PROGRAM_SECONDS`` (5 s), or by ``timeout`` where that is
    smaller, and so gets no batch deadline: a policy that writes endless loops costs 5 s a program, not a minute.
    ``code_sandbox`` / ``code_limits``: builtin:code's ``--code_sandbox`` and ``--code_*`` limits
    (:func:`code_sandbox_options`)."""
    name = spec[len(BUILTIN_PREFIX):]
    if name == "code":
        program_timeout = min(CODE_PROGRAM_SECONDS, float(timeout)) if timeout and timeout > 0 else \
            CODE_PROGRAM_SECONDS
        func = get_builtin(name, program_timeout=program_timeout, code_sandbox=code_sandbox, code_limits=code_limits)
        return RewardFuncSource(func, spec, timeout=None, error_policy=error_policy)
    func = get_builtin(name, format_pattern=format_pattern)
    return RewardFuncSource(func, spec, timeout=timeout, error_policy=error_policy)


@dataclass(frozen=True)
class RewardSpec:
    """The reward flags a reward source is built from (`rlhfkit batch-inference` fills it from its options); a
    None value takes the default."""

    reward_pretrain: str | None = None
    remote_rm_url: str | None = None
    reward_timeout: float | None = DEFAULT_TIMEOUT
    reward_error_policy: str = "raise"
    reward_combine: str = "mean"
    reward_weights: str | None = None
    reward_format_pattern: str | None = None
    normalize_reward: bool = False
    max_len: int = 2048
    micro_rollout_batch_size: int = 8          # the reward models' rows per forward (ppo's flag name)
    remote_rm_timeout: float | None = None   # the reward-server flags (rlhfkit.config.options.RemoteRewardOptions)
    remote_rm_retries: int = 3
    remote_rm_backoff: float = 1.0
    remote_rm_token: str | None = None       # None: env RLHFKIT_RM_TOKEN
    remote_rm_max_response_mb: float = 64.0
    code_sandbox: str = "auto"               # builtin:code's sandbox and limits (rlhfkit.rewards.sandbox)
    code_memory_mb: int = 512
    code_max_procs: int = 32
    code_max_open_files: int = 64
    code_max_file_mb: int = 16
    code_max_output_kb: int = 1024


def reward_source_from_config(spec: RewardSpec, micro_batch_size: int | None = None) -> RewardSource:
    """:func:`build_reward_source` from a :class:`RewardSpec` (``spec.reward_pretrain``, ``spec.remote_rm_url``, ...);
    ``micro_batch_size``, when given, overrides ``spec.micro_rollout_batch_size``. ``remote_rm_timeout`` unset:
    ``reward_timeout`` (60 when that is 0 or unset)."""
    reward_timeout = DEFAULT_TIMEOUT if spec.reward_timeout is None else spec.reward_timeout
    specs = split_specs(spec.reward_pretrain) + split_specs(spec.remote_rm_url)
    rows = micro_batch_size if micro_batch_size is not None else spec.micro_rollout_batch_size
    model_kwargs = {"normalize_reward": bool(spec.normalize_reward), "max_len": int(spec.max_len),
                    "micro_batch_size": int(rows)}
    remote_kwargs = {"timeout": remote_timeout(spec.remote_rm_timeout, reward_timeout),
                     "retries": int(spec.remote_rm_retries), "backoff": float(spec.remote_rm_backoff),
                     "token": spec.remote_rm_token,
                     "max_response_bytes": max_response_bytes(spec.remote_rm_max_response_mb)}
    weights = spec.reward_weights
    return build_reward_source(
        specs, timeout=reward_timeout, error_policy=spec.reward_error_policy, combine_rule=spec.reward_combine,
        weights=[float(w) for w in split_specs(weights)] if weights is not None else None,
        format_pattern=spec.reward_format_pattern, model_kwargs=model_kwargs, remote_kwargs=remote_kwargs,
        code_kwargs=code_sandbox_options(spec))


def combine(outputs: Sequence[RewardOutput], names: Sequence[str], rule: str = "mean",
            weights: Sequence[float] | None = None) -> RewardOutput:
    """Combine per-sample rewards of several sources: mean / sum, or a weighted sum when ``weights`` is given."""
    if rule not in COMBINE_RULES:
        raise ValueError(f"--reward_combine must be one of {COMBINE_RULES}, got {rule!r}")
    if not outputs or len(outputs) != len(names):
        raise ValueError(f"combine needs one name per output ({len(outputs)} outputs, {len(names)} names)")
    sizes = {len(o) for o in outputs}
    if len(sizes) != 1:
        raise ValueError(f"reward sources returned different batch sizes: {dict(zip(names, map(len, outputs)))}")
    if weights is not None and len(weights) != len(outputs):
        raise ValueError(f"--reward_weights has {len(weights)} values for {len(outputs)} reward sources {list(names)}")
    w = torch.tensor([float(x) for x in weights] if weights is not None else
                     [1.0 / len(outputs) if rule == "mean" else 1.0] * len(outputs), dtype=torch.float32)
    rewards = (w[:, None] * torch.stack([o.rewards for o in outputs])).sum(0)
    scores = (w[:, None] * torch.stack([o.scores for o in outputs])).sum(0)
    logs: dict[str, torch.Tensor | list] = {}
    for name, out in zip(unique_names(names), outputs):
        logs[f"{name}/reward"] = out.rewards
        logs.update({f"{name}/{key}": value for key, value in out.extra_logs.items()})
    per_source = [failure_reasons(o) for o in outputs]
    logs[FAILURE_KEY] = [",".join(r for r in sample if r) for sample in zip(*per_source)]
    return RewardOutput(rewards, scores, logs, sum(o.failed for o in outputs))


def unique_names(names: Sequence[str]) -> list[str]:
    """Names made unique for log keys: a repeated name gets ``#2``, ``#3``, ..."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


class CombinedSource:
    """Several reward sources called in turn on the same batch and merged with :func:`combine`."""

    def __init__(self, sources: Sequence[RewardSource], rule: str = "mean",
                 weights: Sequence[float] | None = None) -> None:
        if rule not in COMBINE_RULES:
            raise ValueError(f"--reward_combine must be one of {COMBINE_RULES}, got {rule!r}")
        if weights is not None and len(weights) != len(sources):
            raise ValueError(f"--reward_weights has {len(weights)} values for {len(sources)} reward sources "
                             f"{[s.name for s in sources]}")
        self.sources, self.rule, self.weights = list(sources), rule, weights
        self.name = "+".join(s.name for s in self.sources)

    def __call__(self, queries: list[str], prompts: list[str] | None = None,
                 labels: list[Any] | None = None) -> RewardOutput:
        """Call every source, then :func:`combine`."""
        queries, prompts, labels = check_batch(queries, prompts, labels, f"reward sources {self.name}")
        outputs = [source(queries, prompts, labels) for source in self.sources]
        return combine(outputs, [s.name for s in self.sources], self.rule, self.weights)
