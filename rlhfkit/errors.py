"""The error types of rlhfkit, in one leaf module that every layer may import (it imports nothing of ours).

Each message says what was wrong, where (flag, file, line, key, sample) and what to do. The command line
(`rlhfkit.cli.main`) turns a `ConfigError` or a `DataError` into `rlhfkit <command>: error: ...` and exit status 2.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A flag or config-file problem; the message names the flag and what to do."""


class DataError(ValueError):
    """Bad input data or data flags. The message names the file, the line/row and what to do."""


class RewardError(RuntimeError):
    """A reward could not be computed; the message names the source and, where known, the sample."""


class RewardFuncError(RewardError):
    """A reward function failed; the message names ``file:function`` and the sample."""


class RemoteRewardError(RewardError):
    """A reward server could not give valid rewards; names the URL, the attempts and the last error."""


class AgentError(RuntimeError):
    """An environment misbehaved; the message names the file, the method, the episode and the turn."""


class DriftError(ValueError):
    """A call's prompt does not continue the episode's earlier prompt and sampled tokens."""


class WeightSyncMismatch(RuntimeError):
    """An engine's log-probs differ from the trainer's by more than the bound after weights were loaded."""


class UnsafeCheckpointError(ConfigError):
    """A checkpoint file that holds something other than plain data and tensors: refused, never unpickled
    (rlhfkit.engine.safe_state); the message names the file and what to do."""


class ReportError(ValueError):
    """The run folder cannot be reported on (it does not exist, or has no metrics.jsonl)."""


class RemoteCallError(RuntimeError):
    """A Ray remote call of the online loop failed for a reason outside the callee's code: it passed its deadline
    (`RemoteCallTimeout`) or its actor died (`RemoteActorDied`). The message names the role, the rank(s), the node
    and the method; `role`, `ranks`, `method` and `waited_s` say the same for code that handles it."""

    def __init__(self, message: str, *, role: str = "", ranks: list[int] | tuple[int, ...] = (), method: str = "",
                 waited_s: float = 0.0) -> None:  # defaults: pickling (through Ray) rebuilds it from the message
        super().__init__(message)
        self.role, self.ranks, self.method, self.waited_s = role, list(ranks), method, waited_s


class RemoteCallTimeout(RemoteCallError):
    """A remote call passed its deadline (--remote_call_timeout, or a health check's shorter one)."""


class RemoteActorHung(RemoteCallTimeout):
    """A callee stopped answering its liveness probe (an engine's `ping`, served on a thread of its own;
    --engine_hang_timeout) or sending heartbeats (a model-group rank; --trainer_hang_timeout) while a call ran: its
    process is stopped, frozen, or holds the interpreter; the call is abandoned (a hung rank is killed)."""


class RemoteActorDied(RemoteCallError):
    """The actor a remote call went to died (killed, crashed, or its node lost) before it answered."""


class CheckFailed(Exception):
    """builtin:code: an assert's value could not be computed from the program's values (a leaf raised or sent no
    plain data, arithmetic failed); the check fails (rlhfkit.rewards.code_asserts)."""
