"""Option groups of `rlhfkit batch-inference` (OpenRLHF's `batch_inference` flag names)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.options import opt


@dataclass
class InferenceModelOptions:
    """Model"""

    pretrain: str | None = opt(None, "policy to sample from (generate tasks) or reward model (--eval_task rm without "
                                     "--remote_rm_url / --reward_pretrain): HF folder, hub name, .gguf or embedded:...")
    param_dtype: str = opt("auto", "engine dtype: auto = bf16 where the hardware computes it natively "
                                   "(CUDA with bf16, AVX512-BF16/AMX CPUs), fp32 elsewhere",
                           choices=["auto", "bf16", "fp16", "fp32"])
    disable_fast_tokenizer: bool = opt(False, "use the slow (Python) tokenizer")
    seed: int = opt(1234, "sampling seed (sample j of prompt i uses seed + i * best_of_n + j)")


@dataclass
class InferenceDataOptions:
    """Data"""

    dataset: str | None = opt(None, "prompts (generate) or input/output rows (rm): json/jsonl/parquet/csv files, "
                                    "folders or hub names, comma-separated")
    dataset_probs: str | None = opt(None, "comma-separated mixing probabilities, one per --dataset entry")
    dataset_split: str = opt("train", "split to read from folders/hub datasets")
    max_samples: int = opt(100_000_000, "read at most this many rows")
    input_key: str = opt("input", "key of the prompt (string or list of chat messages)")
    output_key: str = opt("output", "key of the response (--eval_task rm)")
    label_key: str | None = opt(None, "key of a label, passed to reward functions and copied to the output rows")
    input_template: str | None = opt(None, "template with one {} for the prompt, e.g. 'User: {}\\nAssistant: '")
    apply_chat_template: bool = opt(False, "format prompts with the tokenizer's chat template")
    tokenizer_chat_template: str | None = opt(None, "override the tokenizer's chat template (Jinja string)")
    max_len: int = opt(2048, "reward models: most tokens of prompt + response scored (longer: left-truncated, "
                              "counted)")
    output_path: str | None = opt(None, "where the rows go (.jsonl); required")


@dataclass
class InferenceOptions:
    """Generation, scoring and post-processing"""

    eval_task: str = opt("generate_vllm", "generate_vllm: sample with vLLM engine actors on Ray; generate: with the "
                                          "transformers engine; rm: score --dataset's input + output rows",
                         choices=["generate_vllm", "generate", "rm"])
    best_of_n: int = opt(1, "samples per prompt")
    max_new_tokens: int = opt(1024, "maximum new tokens per sample")
    prompt_max_len: int = opt(1024, "prompts longer than this (tokens) are dropped and counted")
    temperature: float = opt(1.0, "sampling temperature")
    top_p: float = opt(1.0, "nucleus sampling")
    greedy_sampling: bool = opt(False, "greedy decoding (temperature 0)")
    iter: int | None = opt(None, "iterative runs: use only prompts [iter * rollout_batch_size, (iter + 1) * "
                                 "rollout_batch_size)")
    rollout_batch_size: int = opt(2048, "prompts per --iter slice")
    enable_csft: bool = opt(False, "put --csft_prompt before every prompt (sampling from a conditional-SFT model)")
    csft_prompt: str = opt("<rm_score>: 5.00", "the condition text of --enable_csft (rlhfkit sft --csft_keys format)")
    post_processor: str | None = opt(None, "turn scored rows into training data: rs (best of n -> SFT rows), csft "
                                           "(rm_score per row -> sft --csft_keys), iter_dpo (best/worst -> DPO "
                                           "pairs); needs a reward", choices=["rs", "csft", "iter_dpo"])
    reward_pretrain: str | None = opt(None, "reward model(s) to score with, comma-separated (generate tasks: "
                                            "score right away)")
    remote_rm_url: str | None = opt(None, "reward source(s): http(s) URLs, a reward_func .py file, or builtin:NAME")
    normalize_reward: bool = opt(False, "reward models: (r - reward_mean) / reward_std from their config.json")
    reward_timeout: float = opt(60.0, "seconds a reward function / remote RM may take per batch")
    micro_batch_size: int = opt(16, "rows per reward-model forward")
    vllm_num_engines: int = opt(1, "vLLM engines (prompts are split across them)")
    tp_size: int = opt(1, "tensor parallel size of each vLLM engine (GPUs only)")
    vllm_gpu_memory_utilization: float = opt(0.9, "GPU memory fraction for vLLM")
    vllm_kv_cache_mb: int = opt(256, "CPU only: host RAM for each engine's KV cache, in MiB")
    enable_prefix_caching: bool = opt(False, "vLLM prefix caching (helps best_of_n)")
    enforce_eager: bool = opt(False, "disable CUDA graphs in vLLM")
    ray_address: str | None = opt(None, "join this Ray cluster (default: RAY_ADDRESS, else start a local one)")
    verbose: bool = opt(False, "show Ray's and vLLM's logs live on the console; without it the engines' logs go to "
                               "<output_path>.logs/ and the console keeps rlhfkit's own lines")

