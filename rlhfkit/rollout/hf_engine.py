"""Transformers rollout engine (`--rollout_backend hf`): the same interface as the vLLM engine, no vLLM needed.

Slow but dependency-light: each prompt is generated as one batch of its `n` samples (no padding, so positions
and results never depend on the other prompts). Sampling log-probs come from `output_scores`, the scores after
the temperature and top-p warpers (for greedy decoding: the raw logits), so they follow the same rule as the vLLM
engine's `processed_logprobs`. Usable in-process or as a Ray actor (`create_hf_engines`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import ray
import torch

from rlhfkit.rollout.engine_api import RolloutEngine
from rlhfkit.rollout.remote import LIVENESS_GROUP, RemoteActors, engine_actor_class
from rlhfkit.rollout.types import FinishReason, NamedTensors, RolloutSample, SamplingConfig
from rlhfkit.rollout.weight_broadcast import WeightGroupSlot

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFEngine:
    """A causal LM with `generate`/`score` on token ids and in-place bucketed weight updates."""

    def __init__(self, pretrain_path: str, *, dtype: str = "float32", device: str | None = None,
                 cpu_threads_share: int | None = None, log_path: str | None = None) -> None:
        """`cpu_threads_share`: in a Ray actor on CPU, use the node's cores split this many ways (Ray gives 1).
        `log_path`: this process's output goes there (the run folder) instead of Ray's log stream."""
        if log_path:
            from rlhfkit.observability.run import redirect_output

            redirect_output(log_path)
        from rlhfkit.engine.cpu_threads import set_cpu_threads
        from rlhfkit.engine.host_memory import retain_freed_host_memory
        from rlhfkit.models.loading import load_causal_lm

        if dtype not in _DTYPES:
            raise ValueError(f"HFEngine dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if cpu_threads_share and self.device.type == "cpu":
            set_cpu_threads(0, cpu_threads_share)
            retain_freed_host_memory()  # each step's tensors reuse the last step's memory (engine/host_memory.py)
        model = load_causal_lm(pretrain_path, dtype=_DTYPES[dtype])
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers types .to() for dtypes only
        self.eos_token_ids = _eos_ids(self.model)
        self.pad_token_id = int(self.model.config.pad_token_id)
        self._weight_slot = WeightGroupSlot()  # --vllm_sync_backend gloo|nccl
        self._loaded: set[str] = set()  # the parameters the current weight update wrote
        self.dtype, self.prompts_generated = dtype, 0

    def ready(self) -> bool:
        """True once the model is loaded (lets callers wait on actor start)."""
        return True

    @ray.method(concurrency_group=LIVENESS_GROUP)
    def ping(self) -> bool:
        """The liveness probe: the health check before each step and the probes while a call runs
        (`rlhfkit.rollout.remote`). Served in its own concurrency group (`LIVENESS_GROUP`, a thread beside the one
        running generate, weight loads...): answers at once while the engine is alive, however busy."""
        return True

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig) -> list[RolloutSample]:
        """Generate `sampling.n` responses per prompt, ordered by (prompt, sample)."""
        samples = []
        for i, prompt in enumerate(prompt_ids):
            samples.extend(self._generate_one(i, list(prompt), sampling))
        self.prompts_generated += len(prompt_ids)
        return samples

    def _generate_one(self, index: int, prompt: list[int], sampling: SamplingConfig) -> list[RolloutSample]:
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self.eos_token_ids))
        input_ids = torch.tensor([prompt], device=self.device)
        with torch.random.fork_rng(devices=[] if self.device.type == "cpu" else [self.device]):
            seed = sampling.sample_seed(index, 0)
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=self._generation_config(sampling, sorted(stop_ids), len(prompt)),
            )
        responses = out.sequences[:, len(prompt):]
        logprobs = torch.stack(out.scores, dim=1).float().log_softmax(-1)  # [rows, steps, V]
        picked = logprobs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        rows = [0] * sampling.n if sampling.greedy else range(sampling.n)  # greedy: one row, n identical samples
        return [
            _cut(index, j, prompt, responses[r].tolist(), picked[r].tolist(), stop_ids) for j, r in enumerate(rows)
        ]

    def _generation_config(self, sampling: SamplingConfig, stop_ids: list[int], prompt_len: int) -> Any:
        from transformers import GenerationConfig

        kwargs: dict[str, Any] = {"do_sample": False}
        if not sampling.greedy:
            kwargs = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p,
                      "top_k": sampling.top_k}
        return GenerationConfig(
            max_new_tokens=sampling.new_tokens(prompt_len),
            min_new_tokens=sampling.min_tokens(prompt_len) or None,
            num_return_sequences=1 if sampling.greedy else sampling.n,
            eos_token_id=stop_ids or None,
            pad_token_id=self.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
            **kwargs,
        )

    @torch.no_grad()
    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """log softmax(logits)[token] (temperature 1) of each response token given its prompt."""
        from rlhfkit.models.logprobs import response_log_probs

        seqs = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(seqs):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        logp = response_log_probs(self.model, ids.to(self.device), mask.to(self.device))
        assert isinstance(logp, torch.Tensor)  # no entropy asked for
        logp = logp.cpu()
        return [logp[row, len(p) - 1 : len(s) - 1].tolist() for row, (p, s) in enumerate(zip(prompt_ids, seqs))]

    def begin_weight_update(self) -> None:
        """Parameters are overwritten in place bucket by bucket; start recording which."""
        self._loaded = set()

    @torch.no_grad()
    def load_weight_bucket(self, named_tensors: NamedTensors) -> int:
        """Copy one bucket of (HF name, full tensor) pairs into the model's parameters."""
        result = self.model.load_state_dict(dict(named_tensors), strict=False)
        if result.unexpected_keys:
            raise KeyError(f"weight sync sent names the HF engine's model does not have: {result.unexpected_keys[:8]}")
        self._loaded.update(name for name, _ in named_tensors)
        return len(named_tensors)

    def finish_weight_update(self) -> None:
        """Check that every parameter was written (no cache outlives a `generate` call, so nothing else to do)."""
        from rlhfkit.rollout.worker_ext import check_every_parameter_loaded

        check_every_parameter_loaded(self.model, self._loaded, "HF engine")

    # ---- weight sync over a torch.distributed broadcast (--vllm_sync_backend gloo|nccl), see weight_broadcast
    def compute_threads(self) -> int:
        """torch's intra-op threads in this engine."""
        return torch.get_num_threads()

    def whereabouts(self) -> dict[str, Any]:
        """This engine's placement as Ray sees it, its dtype, and how many prompts it has generated for."""
        from rlhfkit.observability.placement import whereabouts

        return whereabouts(role="engine", backend="hf", dtype=self.dtype, prompts_generated=self.prompts_generated)

    def weight_sync_info(self) -> dict[str, Any]:
        """How many group ranks this engine takes (one: it is a single process) and whether it has CUDA."""
        return {"workers": 1, "cuda": self.device.type == "cuda"}

    def join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                          timeout_s: float) -> list[int]:
        """Join the sender's weight group as rank `rank_offset` (replacing any earlier group); returns [rank]."""
        return [self._weight_slot.join(host, port, rank_offset, world_size, backend, timeout_s)]

    def receive_weight_bucket(self, meta: list) -> int:
        """Receive one broadcast bucket (names, shapes, dtypes in `meta`) and load it like `load_weight_bucket`."""
        return self.load_weight_bucket(self._weight_slot.receive(meta))

    def leave_weight_group(self) -> None:
        """Drop this engine's side of the weight group (no-op when not in one)."""
        self._weight_slot.leave()

def _eos_ids(model: Any) -> list[int]:
    ids: set[int] = set()
    for source in (model.config.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if source is not None:
            ids.update([source] if isinstance(source, int) else source)
    return sorted(ids)


def _cut(
    index: int, sample: int, prompt: list[int], tokens: list[int], logprobs: list[float], stop_ids: set[int]
) -> RolloutSample:
    """Trim the padding after the first stop token (kept, as vLLM keeps it) and set the finish reason."""
    reason: FinishReason = "length"
    for t, tok in enumerate(tokens):
        if tok in stop_ids:
            tokens, logprobs, reason = tokens[: t + 1], logprobs[: t + 1], "stop"
            break
    return RolloutSample(index, sample, prompt, tokens, logprobs, reason)


def create_hf_engines(
    num_engines: int,
    pretrain_path: str,
    *,
    dtype: str = "float32",
    num_cpus_per_engine: float = 0.5,
    placement_group: Any = None,
    log_dir: str | None = None,
    indices: Sequence[int] | None = None,
) -> list[Any]:
    """Start `num_engines` `HFEngine` Ray actors (1 GPU each when the cluster has GPUs) and wait until ready.
    `indices`: start only these engines of the `num_engines` (a restart after a fault), with their own options."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    num_gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
    engine_cls = engine_actor_class(HFEngine)  # ping served beside a running call
    engines = []
    for k in range(num_engines) if indices is None else indices:
        options: dict[str, Any] = {"num_cpus": num_cpus_per_engine, "num_gpus": num_gpus}
        if placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=placement_group,  # as rlhfkit.rl.group.bundle_index: engine k where rank k is
                placement_group_bundle_index=k * len(placement_group.bundle_specs) // num_engines,
            )
        log_path = os.path.join(log_dir, f"engine{k}.log") if log_dir else None
        engines.append(engine_cls.options(**options).remote(pretrain_path, dtype=dtype, cpu_threads_share=num_engines,
                                                            log_path=log_path))
    RemoteActors(engines, role="engine", ranks=list(range(num_engines)) if indices is None else list(indices),
                 hang_timeout_s=0).call(RolloutEngine.ready)  # no probes: an actor answers nothing, ping included,
    # until its __init__ returns
    return engines
