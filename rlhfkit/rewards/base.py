"""The reward-source contract shared by every source (reward model, reward_func file, built-in verifier, HTTP).

A *reward source* is a callable ``source(queries, prompts, labels) -> RewardOutput`` with a short ``name``:

* ``queries``: ``list[str]``, prompt + response text as decoded by the online loop;
* ``prompts``: ``list[str]``, the prompt part of each query (same length);
* ``labels``: ``list[Any]`` from ``--label_key`` (entries may be None), or None for "no labels".

:class:`RewardOutput` carries ``rewards`` (float32 ``[B]``, used for training), ``scores`` (float32 ``[B]``, used for
dynamic filtering and logging, OpenRLHF's convention; equal to ``rewards`` unless the source says otherwise),
``extra_logs`` (per-sample values: float32 tensors ``[B]`` or lists of length ``B``) and ``failed`` (how many
samples were scored 0 because of a failure).

A failure that belongs to one sample (a verifier that cannot parse its number, a program whose output is not UTF-8 or
that runs past its time, a culprit under ``--reward_error_policy zero``) costs that sample, not the run: its reward
is 0 and ``extra_logs["reward_failure"]`` holds a short reason (``""`` when fine), which the online loop counts in
``reward/failed_<reason>`` and writes to samples.jsonl. A source that is down (an unreachable reward server) is not a
sample's failure: it raises.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

ERROR_POLICIES = ("raise", "zero")
QUERY_PREVIEW_CHARS = 200
FAILURE_KEY = "reward_failure"  # extra_logs: per-sample failure reason ("" when fine)
_REASON_CHARS = re.compile(r"[^a-z0-9_]+")
REASON_MAX_CHARS = 40


@dataclass
class RewardOutput:
    """Rewards for one batch. ``rewards`` and ``scores`` are float32 ``[B]``; ``extra_logs`` values have length B."""

    rewards: torch.Tensor
    scores: torch.Tensor
    extra_logs: dict[str, torch.Tensor | list] = field(default_factory=dict)
    failed: int = 0

    def __len__(self) -> int:
        return int(self.rewards.shape[0])

    def to_json(self) -> dict[str, Any]:
        """The wire shape of ``/get_reward``: ``{"rewards", "scores", "extra_logs"}`` with plain lists."""
        logs = {k: v.tolist() if isinstance(v, torch.Tensor) else list(v) for k, v in self.extra_logs.items()}
        return {"rewards": self.rewards.tolist(), "scores": self.scores.tolist(), "extra_logs": logs,
                "failed": self.failed}


@runtime_checkable
class RewardSource(Protocol):
    """Anything with a ``name`` that maps a batch of queries to a :class:`RewardOutput`."""

    name: str

    def __call__(self, queries: list[str], prompts: list[str], labels: list[Any] | None) -> RewardOutput: ...


def preview(text: Any, limit: int = QUERY_PREVIEW_CHARS) -> str:
    """The first ``limit`` characters of a query, repr-quoted, for error messages."""
    text = str(text)
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def sample_ref(index: int, query: Any) -> str:
    """``"sample 3 (query: '...')"``: how errors name a sample."""
    return f"sample {index} (query: {preview(query)})"


def check_batch(queries: Sequence[str], prompts: Sequence[str] | None, labels: Sequence[Any] | None,
                where: str) -> tuple[list[str], list[str], list[Any]]:
    """Validate batch inputs and fill defaults: prompts -> ``""`` each, labels -> ``None`` each."""
    if isinstance(queries, str) or not isinstance(queries, Sequence):
        raise TypeError(f"{where}: queries must be a list of strings, got {type(queries).__name__}")
    queries = list(queries)
    prompts = [""] * len(queries) if prompts is None else list(prompts)
    labels = [None] * len(queries) if labels is None else list(labels)
    if len(prompts) != len(queries) or len(labels) != len(queries):
        raise ValueError(f"{where}: {len(queries)} queries but {len(prompts)} prompts and {len(labels)} labels; "
                         "they must have one entry per sample")
    for i, q in enumerate(queries):
        if not isinstance(q, str):
            raise TypeError(f"{where}: query {i} is {type(q).__name__}, not a string")
    return queries, prompts, labels


def response_of(query: str, prompt: str | None) -> str:
    """The response part of a query: ``query[len(prompt):]`` when the query starts with the prompt, else the query.

    The online loop decodes ``prompt + response`` as the query and the prompt alone, so the prefix test is exact;
    a query that does not start with its prompt (re-rendered template, stripped special tokens) is used whole.
    """
    if prompt and query.startswith(prompt):
        return query[len(prompt):]
    return query


def to_float_vector(values: Any, what: str) -> torch.Tensor:
    """``values`` (list, tuple or tensor of numbers) as a float32 1-D CPU tensor; a clear error otherwise."""
    if hasattr(values, "tolist") and not isinstance(values, torch.Tensor):  # numpy arrays
        values = values.tolist()
    if isinstance(values, torch.Tensor):
        tensor = values.detach().to("cpu", torch.float32).clone()  # never alias the caller's tensor
    elif isinstance(values, (list, tuple)):
        try:
            tensor = torch.tensor([_as_number(v) for v in values], dtype=torch.float32)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{what} must contain only numbers: {err}") from err
    else:
        raise TypeError(f"{what} must be a list or a tensor of numbers, got {type(values).__name__}")
    if tensor.dim() == 2 and tensor.shape[1] == 1:
        tensor = tensor.squeeze(1)
    if tensor.dim() != 1:
        raise ValueError(f"{what} must be one number per sample (shape [B]), got shape {tuple(tensor.shape)}")
    return tensor


def _as_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value)
        raise TypeError(f"{value!r} is a {type(value).__name__}")
    return float(value)


def nonfinite_indices(tensor: torch.Tensor) -> list[int]:
    """Positions holding NaN or +-inf."""
    return [int(i) for i in (~torch.isfinite(tensor)).nonzero().flatten()]


def normalize_extra_logs(logs: Any, batch: int, what: str) -> dict[str, torch.Tensor | list]:
    """Per-sample logs: numbers -> float32 tensor ``[B]``, other lists of length B kept, scalars broadcast."""
    if logs is None:
        return {}
    if not isinstance(logs, Mapping):
        raise TypeError(f"{what}: extra_logs must be a dict, got {type(logs).__name__}")
    out: dict[str, torch.Tensor | list] = {}
    for key, value in logs.items():
        if hasattr(value, "tolist") and not isinstance(value, torch.Tensor):  # numpy arrays and scalars
            value = value.tolist()
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[str(key)] = torch.full((batch,), float(value), dtype=torch.float32)
            continue
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            out[str(key)] = value.float().expand(batch).clone()
            continue
        if not isinstance(value, (list, tuple, torch.Tensor)) or len(value) != batch:
            size = len(value) if isinstance(value, (list, tuple, torch.Tensor)) else type(value).__name__
            raise ValueError(f"{what}: extra_logs[{key!r}] must have one value per sample ({batch}), got {size}")
        out[str(key)] = _numeric_or_list(value)
    return out


def _numeric_or_list(value: Any) -> torch.Tensor | list:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float32)
    if all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in value):
        return torch.tensor([float(v) for v in value], dtype=torch.float32)
    return list(value)


def concat_outputs(parts: Sequence[RewardOutput]) -> RewardOutput:
    """Concatenate outputs of consecutive sub-batches (same extra_logs keys required), in order."""
    if not parts:
        return RewardOutput(torch.zeros(0), torch.zeros(0))
    keys = set(parts[0].extra_logs)
    for part in parts[1:]:
        if set(part.extra_logs) != keys:
            raise ValueError(f"sub-batches returned different extra_logs keys: {sorted(keys)} vs "
                             f"{sorted(part.extra_logs)}")
    logs: dict[str, torch.Tensor | list] = {}
    for key in parts[0].extra_logs:
        values = [p.extra_logs[key] for p in parts]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if len(tensors) == len(values):
            logs[key] = torch.cat(tensors)
        else:
            logs[key] = [x for v in values for x in (v.tolist() if isinstance(v, torch.Tensor) else v)]
    return RewardOutput(torch.cat([p.rewards for p in parts]), torch.cat([p.scores for p in parts]), logs,
                        sum(p.failed for p in parts))


def reason_name(reason: Any) -> str:
    """A failure reason as a metric-safe name: lowercase ``[a-z0-9_]``, at most 40 characters (``"unknown"`` if
    nothing is left)."""
    name = _REASON_CHARS.sub("_", str(reason).strip().lower()).strip("_")[:REASON_MAX_CHARS].strip("_")
    return name or "unknown"


def failure_reasons(out: RewardOutput) -> list[str]:
    """Per-sample failure reasons of ``out`` (``extra_logs["reward_failure"]``; ``""`` when fine, also for a source
    that reports none). Several reasons of one sample (combined sources) are joined with ``","``."""
    column = out.extra_logs.get(FAILURE_KEY)
    if column is None or isinstance(column, torch.Tensor):
        return [""] * len(out)
    return ["" if r is None else str(r) for r in column]


def failure_counts(reasons: Sequence[str]) -> dict[str, int]:
    """How many samples failed for each reason (a sample with several reasons counts once for each)."""
    counts: dict[str, int] = {}
    for joined in reasons:
        for reason in {reason_name(r) for r in str(joined or "").split(",") if r.strip()}:
            counts[reason] = counts.get(reason, 0) + 1
    return dict(sorted(counts.items()))


def failure_metrics(counts: Mapping[str, int], prefix: str = "reward/failed_") -> dict[str, float]:
    """``{"reward/failed_<reason>": count}`` for the metrics log."""
    return {f"{prefix}{reason}": float(n) for reason, n in sorted(counts.items())}
