"""Option groups that ppo (its rollout) and batch-inference share: the Ray cluster, the vLLM engines, sampling.

Each flag is declared once here; a command's own default is in rlhfkit.config.commands.COMMAND_DEFAULTS and its
own help, where the flag means something different there, in the field's `command_help`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.options import opt


@dataclass
class RayOptions:
    """Ray"""

    ray_address: str | None = opt(None, "join this Ray cluster (default: RAY_ADDRESS, else start a local one)")
    verbose: bool = opt(False, "show Ray's, vLLM's and the workers' logs live on the console; without it they go to "
                               "<run_dir>/logs/ (one file per model rank and engine) and the console keeps "
                               "rlhfkit's own lines",
                        command_help={"batch-inference": "show Ray's and vLLM's logs live on the console; without it "
                                                         "the engines' logs go to <output_path>.logs/ and the "
                                                         "console keeps rlhfkit's own lines"})


@dataclass
class VLLMEngineOptions:
    """vLLM engines"""

    vllm_num_engines: int = opt(1, "vLLM engines (prompts are split across them)")
    vllm_gpu_memory_utilization: float = opt(0.9, "GPU memory fraction for vLLM (on CPU: see --vllm_kv_cache_mb)")
    vllm_kv_cache_mb: int = opt(256, "CPU only: host RAM for each engine's KV cache, in MiB")
    enforce_eager: bool = opt(False, "disable CUDA graphs in vLLM")
    enable_prefix_caching: bool = opt(False, "vLLM prefix caching (helps several samples per prompt)")


@dataclass
class SamplingOptions:
    """Sampling"""

    prompt_max_len: int = opt(1024, "prompts longer than this (tokens) are dropped and counted")
    temperature: float = opt(1.0, "sampling temperature",
                             command_help={"ppo": "sampling temperature (trainer log-probs use the same)"})
    top_p: float = opt(1.0, "nucleus sampling: keep the smallest set of most likely tokens whose probability "
                            "reaches this (1.0: off)",
                       command_help={"ppo": "nucleus sampling: keep the smallest set of most likely tokens whose "
                                            "probability reaches this (1.0: off); the trainer's log-probs are those "
                                            "of the same truncated distribution (--logprobs_truncation)"})
    top_k: int = opt(0, "sample among the k most likely tokens only, before --top_p (0: off)",
                     command_help={"ppo": "sample among the k most likely tokens only, before --top_p (0: off); the "
                                          "trainer's log-probs are those of the same truncated distribution "
                                          "(--logprobs_truncation)"})
    rollout_batch_size: int = opt(1024, "prompts per step",
                                  command_help={"batch-inference": "prompts per --iter slice"})
