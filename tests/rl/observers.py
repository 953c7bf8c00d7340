"""Step observers (rlhfkit.rl.observer.StepObserver) that stage faults and timings from the tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlhfkit.rl.observer import NullObserver


class AroundHealthCheck(NullObserver):
    """Calls `hook(s, step, when)` with when "before health check" / "after health check" at every step."""

    def __init__(self, hook: Callable[[Any, int, str], None]) -> None:
        self.hook = hook

    def before_health_check(self, s: Any, step: int) -> None:
        self.hook(s, step, "before health check")

    def after_health_check(self, s: Any, step: int) -> None:
        self.hook(s, step, "after health check")


class BeforeChunk(NullObserver):
    """Calls `hook(gate, chunk)` before each chunk of a partial rollout takes the engines' lock."""

    def __init__(self, hook: Callable[[Any, int], None]) -> None:
        self.hook = hook

    def before_chunk(self, gate: Any, chunk: int) -> None:
        self.hook(gate, chunk)
