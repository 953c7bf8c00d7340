"""Python reward functions: a user file (``--remote_rm_url path/to/reward_func.py``) or a built-in verifier.

The file defines OpenRLHF's shape::

    def reward_func(queries: list[str], prompts: list[str], labels: list) -> dict:
        return {"rewards": [...], "scores": [...], "extra_logs": {"name": [...]}}

``rewards`` (list or tensor, one number per sample) is required; ``scores`` defaults to ``rewards``; ``extra_logs``
is optional (per-sample values, scalars are broadcast).

Failures never become silent zeros. A call that raises, runs past ``timeout`` seconds, returns something malformed
(no ``rewards`` key, wrong length, non-numbers) fails *as a whole*: the batch is then bisected (each half re-called,
recursively, left first) down to single samples to find the culprit. A call that returns NaN/inf names the sample
directly. With ``error_policy="raise"`` (default) the first culprit stops the run with a :class:`RewardFuncError`
naming ``file:function``, the sample index and the start of its query, chained to the original exception. With
``error_policy="zero"`` culprits score 0, ``RewardOutput.failed`` counts them, and ``extra_logs["reward_failed"]``
(1.0 per failed sample), ``extra_logs["reward_error"]`` (the message, ``""`` when fine) and
``extra_logs["reward_failure"]`` (a short reason: ``error``, ``timeout``, ``malformed``, ``nonfinite``) say which and
why.

Per-sample failures the function itself reports are not errors of the function: it returns
``extra_logs["reward_failure"]``, one short reason per sample (``""`` or None when fine; the built-ins use
``number_too_long``, ``unparseable_number``, ``undecodable_output``, ``timeout``). Under either policy those samples
score 0 (reward and score), count in ``failed``, and get ``reward_failed`` 1.0 and the reason in ``reward_error``.

Timeouts run the call in a daemon **thread** (``threading.Thread`` + ``join(timeout)``), not a subprocess: the user's
function, its imports and module state (a loaded verifier, a tokenizer, a cache) stay in-process, and queries need
no pickling. The caveat: a Python thread cannot be killed, so a timed-out call keeps running in the background until
it returns (its result is discarded). Daemon threads do not block interpreter exit (a ``ThreadPoolExecutor``'s would).
Under the ``zero`` policy a function that hangs for ever leaks one thread per timeout; functions that run external
code should enforce their own timeouts (e.g. ``subprocess.run(..., timeout=...)``).

Bisection re-calls the function on sub-batches; a function whose rewards depend on the whole batch (e.g. group
normalisation) gets sub-batch values for the healthy samples of a failed batch under the ``zero`` policy.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rlhfkit.errors import RewardFuncError
from rlhfkit.rewards.base import (
    ERROR_POLICIES,
    FAILURE_KEY,
    RewardOutput,
    check_batch,
    concat_outputs,
    failure_counts,
    nonfinite_indices,
    normalize_extra_logs,
    sample_ref,
    to_float_vector,
)
from rlhfkit.userfiles import import_user_file

logger = logging.getLogger(__name__)
FUNC_NAME = "reward_func"
DEFAULT_TIMEOUT = 60.0
FAILED_KEY, ERROR_KEY = "reward_failed", "reward_error"
FILE_SHAPE = ("a reward file must define `def reward_func(queries, prompts, labels)` returning "
              "{'rewards': [...], 'scores': [...], 'extra_logs': {...}}")


class _CallFailed(Exception):
    """A whole call failed (raised, timed out, malformed result). ``cause`` is the user's exception, if any;
    ``code`` the short reason a culprit gets under the ``zero`` policy (``error``, ``timeout``, ``malformed``)."""

    def __init__(self, reason: str, cause: BaseException | None = None, code: str = "malformed") -> None:
        super().__init__(reason)
        self.reason, self.cause, self.code = reason, cause, code


def load_reward_func(path: str | Path, func_name: str = FUNC_NAME) -> Callable[..., Any]:
    """Import ``path`` as a fresh module and return its ``func_name``; clear errors naming the file otherwise."""
    if not Path(path).expanduser().is_file():
        raise FileNotFoundError(f"reward function file {str(path)!r} does not exist; {FILE_SHAPE}")
    module = import_user_file(path, "reward function file", func_name, FILE_SHAPE, error=RewardFuncError)
    return getattr(module, func_name)


def call_with_timeout(func: Callable[..., Any], args: tuple, timeout: float | None, name: str) -> Any:
    """``func(*args)`` in a daemon thread, waiting at most ``timeout`` s (None or <= 0: call inline, no limit)."""
    if not timeout or timeout <= 0:
        try:
            return func(*args)
        except Exception as err:
            raise _CallFailed(f"raised {type(err).__name__}: {err}", err, "error") from err
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = func(*args)
        except BaseException as err:  # handed back to the caller thread below
            box["error"] = err

    thread = threading.Thread(target=target, name=f"reward:{name}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise _CallFailed(f"timed out after {timeout:g} s (--reward_timeout); the call keeps running in a "
                          "background thread", code="timeout")
    if "error" in box:
        raised = box["error"]
        raise _CallFailed(f"raised {type(raised).__name__}: {raised}", raised, "error")
    return box.get("value")


class RewardFuncSource:
    """A ``reward_func`` callable as a reward source, with timeout, validation, culprit search and error policy."""

    def __init__(self, func: Callable[..., Any], name: str, *, timeout: float | None = DEFAULT_TIMEOUT,
                 error_policy: str = "raise", path: str | None = None, func_name: str = FUNC_NAME) -> None:
        if error_policy not in ERROR_POLICIES:
            raise ValueError(f"--reward_error_policy must be one of {ERROR_POLICIES}, got {error_policy!r}")
        self.func, self.name, self.timeout, self.error_policy = func, name, timeout, error_policy
        self.path, self.func_name = path, func_name

    @classmethod
    def from_file(cls, path: str | Path, *, func_name: str = FUNC_NAME, **kwargs: Any) -> RewardFuncSource:
        """Load ``func_name`` from a user file; the source's name is ``"path:func_name"``."""
        func = load_reward_func(path, func_name)
        return cls(func, f"{path}:{func_name}", path=str(path), func_name=func_name, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle a file-backed source by path (Ray ships it to workers; the module is re-imported there)."""
        state = dict(self.__dict__)
        if self.path is not None:
            state["func"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.func is None:
            self.func = load_reward_func(self.path, self.func_name)

    def __call__(self, queries: list[str], prompts: list[str] | None = None,
                 labels: list[Any] | None = None) -> RewardOutput:
        """Score a batch (see the module docstring for failures and the error policy)."""
        batch = check_batch(queries, prompts, labels, f"reward function {self.name}")
        out = self._score(list(range(len(batch[0]))), batch, batch_failure=None)
        if out.failed:
            reasons = failure_counts(out.extra_logs[FAILURE_KEY])  # type: ignore[arg-type]  # a list column
            logger.warning("reward function %s: %d of %d samples failed and were scored 0 (%s); messages in "
                           "extra_logs[%r]", self.name, out.failed, len(out),
                           ", ".join(f"{k}: {v}" for k, v in reasons.items()), ERROR_KEY)
        return out

    # -- internals ---------------------------------------------------------------------------------------------

    def _score(self, idx: list[int], batch: tuple[list, list, list], batch_failure: _CallFailed | None
               ) -> RewardOutput:
        """Score ``idx``; on a whole-call failure bisect it. Returns an output with the failure logs filled."""
        if not idx:
            return _empty()
        sub = tuple([column[i] for i in idx] for column in batch)
        try:
            out = self._call(*sub)
        except _CallFailed as failure:
            first = batch_failure or failure
            if len(idx) == 1:
                return self._failed_sample(idx[0], batch[0][idx[0]], failure, first, len(batch[0]))
            half = len(idx) // 2
            left = self._score(idx[:half], batch, first)
            right = self._score(idx[half:], batch, first)
            if not (left.failed or right.failed):
                self._irreproducible(len(idx), first)
            return _concat_filled([left, right])
        return self._check_finite(idx, batch[0], out)

    def _call(self, queries: list[str], prompts: list[str], labels: list[Any]) -> RewardOutput:
        """One call, validated; raises :class:`_CallFailed` for anything that fails the whole call."""
        result = call_with_timeout(self.func, (queries, prompts, labels), self.timeout, self.name)
        n = len(queries)
        if not isinstance(result, dict):
            raise _CallFailed(f"returned {type(result).__name__}, not a dict with a 'rewards' key")
        if "rewards" not in result:
            raise _CallFailed(f"returned a dict without the 'rewards' key (keys: {list(result)})")
        try:
            rewards = to_float_vector(result["rewards"], "'rewards'")
            scores = rewards if result.get("scores") is None else to_float_vector(result["scores"], "'scores'")
            logs = normalize_extra_logs(result.get("extra_logs"), n, "returned")
        except (TypeError, ValueError) as err:
            raise _CallFailed(f"returned a malformed result: {err}", err) from err
        for key, values in (("rewards", rewards), ("scores", scores)):
            if values.shape[0] != n:
                raise _CallFailed(f"returned {values.shape[0]} {key} for a batch of {n} samples")
        reasons = _reported_failures(logs.pop(FAILURE_KEY, None), n)
        scores = scores.clone() if scores is rewards else scores
        failed = [i for i, reason in enumerate(reasons) if reason]
        rewards[failed] = 0.0
        scores[failed] = 0.0
        logs[FAILED_KEY] = torch.tensor([float(bool(r)) for r in reasons])
        logs[ERROR_KEY] = list(reasons)
        logs[FAILURE_KEY] = list(reasons)
        return RewardOutput(rewards, scores, logs, failed=len(failed))

    def _check_finite(self, idx: list[int], queries: list[str], out: RewardOutput) -> RewardOutput:
        """Per-sample NaN/inf: raise naming the sample, or zero it (policy ``zero``)."""
        bad = sorted(set(nonfinite_indices(out.rewards)) | set(nonfinite_indices(out.scores)))
        for local in bad:
            value = out.rewards[local] if not torch.isfinite(out.rewards[local]) else out.scores[local]
            which = "reward" if not torch.isfinite(out.rewards[local]) else "score"
            reason = f"returned a non-finite {which} ({float(value)})"
            if self.error_policy == "raise":
                raise RewardFuncError(f"reward function {self.name} {reason} for "
                                      f"{sample_ref(idx[local], queries[idx[local]])}")
            out.rewards[local] = out.scores[local] = 0.0
            out.extra_logs[FAILED_KEY][local] = 1.0
            errors, codes = out.extra_logs[ERROR_KEY], out.extra_logs[FAILURE_KEY]
            assert isinstance(errors, list) and isinstance(codes, list)  # the reasons columns are lists of strings
            errors[local] = reason
            codes[local] = "nonfinite"
            out.failed += 1
        return out

    def _failed_sample(self, index: int, query: str, failure: _CallFailed, first: _CallFailed,
                       batch_size: int) -> RewardOutput:
        """A single sample whose call fails: raise (policy ``raise``) or a zero row with the reason."""
        if self.error_policy == "raise":
            context = "" if batch_size == 1 or first is failure else \
                f" (found by re-calling sub-batches after the batch of {batch_size} failed: {first.reason})"
            raise RewardFuncError(f"reward function {self.name} failed on {sample_ref(index, query)}: "
                                  f"{failure.reason}{context}") from failure.cause
        logs: dict[str, torch.Tensor | list] = {FAILED_KEY: torch.ones(1), ERROR_KEY: [failure.reason],
                                                FAILURE_KEY: [failure.code]}
        return RewardOutput(torch.zeros(1), torch.zeros(1), logs, failed=1)

    def _irreproducible(self, size: int, first: _CallFailed) -> None:
        """Every sub-batch succeeded although the whole batch failed: no single sample to blame."""
        message = (f"reward function {self.name} failed on the batch of {size} samples ({first.reason}) "
                   "but succeeded on every half of it, so no single sample is to blame")
        if self.error_policy == "raise":
            raise RewardFuncError(message) from first.cause
        logger.warning("%s; using the sub-batch results", message)


def _empty() -> RewardOutput:
    return RewardOutput(torch.zeros(0), torch.zeros(0), {FAILED_KEY: torch.zeros(0), ERROR_KEY: [], FAILURE_KEY: []})


def _reported_failures(column: Any, n: int) -> list[str]:
    """The function's own ``extra_logs["reward_failure"]``: one reason per sample (str, ``""`` / None when fine)."""
    if column is None:
        return [""] * n
    if isinstance(column, torch.Tensor) or any(r is not None and not isinstance(r, str) for r in column):
        raise _CallFailed(f"returned a malformed result: extra_logs[{FAILURE_KEY!r}] must hold one reason string "
                          "per sample ('' or None when the sample did not fail)")
    return ["" if r is None else r.strip() for r in column]


def _concat_filled(parts: list[RewardOutput]) -> RewardOutput:
    """Concatenate sub-batch outputs; a key missing from a part (a failed sample's row) is filled (0.0 / None)."""
    keys: dict[str, bool] = {}
    for part in parts:
        for key, value in part.extra_logs.items():
            keys[key] = keys.get(key, True) and isinstance(value, torch.Tensor)
    for part in parts:
        for key, numeric in keys.items():
            if key not in part.extra_logs:
                part.extra_logs[key] = torch.zeros(len(part)) if numeric else [None] * len(part)
    return concat_outputs(parts)
