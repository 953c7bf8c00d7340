"""What the online loop tells an observer (`train_ppo(cfg, observer=...)`): the moments where a dead or hung engine
or a slow trainer can be staged from outside. The run itself passes `NullObserver` (nothing happens); fault and
timing tests pass their own (tests/rl/observers.py)."""

from __future__ import annotations

from typing import Any, Protocol


class StepObserver(Protocol):
    def before_health_check(self, s: Any, step: int) -> None:
        """Step `step` is about to ping the engines (`s`: the run's RLSetup)."""

    def after_health_check(self, s: Any, step: int) -> None:
        """The engines answered step `step`'s ping (or were restarted); its rollout comes next."""

    def before_chunk(self, gate: Any, chunk: int) -> None:
        """--partial_rollout: chunk `chunk` of a rollout is about to take the engines' lock (`gate`: EngineGate)."""


class NullObserver:
    """Observes nothing: the observer of a run."""

    def before_health_check(self, s: Any, step: int) -> None:
        pass

    def after_health_check(self, s: Any, step: int) -> None:
        pass

    def before_chunk(self, gate: Any, chunk: int) -> None:
        pass
