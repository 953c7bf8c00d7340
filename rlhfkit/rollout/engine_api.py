"""The rollout engines' remote interface: the methods the online loop calls on an engine actor (`VLLMEngine`,
`HFEngine`), declared once so each call names its method as a typed key, never a string:
`RemoteActors(engines, role="engine").call(RolloutEngine.weight_sync_info)` (`rlhfkit.rollout.remote`). mypy checks
the arguments against these signatures and types the results; `tests/rollout/test_typed_remote_calls.py` checks that
both engine classes define every method (the vLLM-only ones: vLLM only) with the same required parameters.
"""

from __future__ import annotations

from typing import Any, Protocol

from rlhfkit.rollout.types import NamedTensors, RolloutSample, SamplingConfig

# Served by vLLM engines only: sleep mode (--vllm_enable_sleep), adapter-only LoRA sync (--lora_sync adapter), the
# prefix cache. Every other method of `RolloutEngine` is served by every backend.
VLLM_ONLY = frozenset({"begin_lora_update", "finish_lora_update", "reset_prefix_cache", "sleep", "wake_up"})


class RolloutEngine(Protocol):
    """One rollout engine actor, as the driver and the weight sender call it."""

    def ready(self) -> bool: ...

    def ping(self) -> bool: ...

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[RolloutSample]: ...

    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]: ...

    def begin_weight_update(self, keep_vision_tower: bool = False) -> None: ...  # the argument: vLLM only

    def load_weight_bucket(self, named_tensors: NamedTensors) -> int: ...

    def finish_weight_update(self) -> None: ...

    def compute_threads(self) -> int: ...

    def whereabouts(self) -> dict[str, Any]: ...

    def weight_sync_info(self) -> dict[str, Any]: ...

    def join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                          timeout_s: float) -> list[int]: ...

    def receive_weight_bucket(self, meta: list) -> int: ...

    def leave_weight_group(self) -> None: ...

    # ---- vLLM only (VLLM_ONLY)
    def begin_lora_update(self) -> None: ...

    def finish_lora_update(self, config: dict[str, Any]) -> int: ...

    def reset_prefix_cache(self) -> bool: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self) -> None: ...
