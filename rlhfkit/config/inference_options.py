"""The option group of `rlhfkit batch-inference` (OpenRLHF's `batch_inference` flag names): the flags only it has.

Its other groups are shared: model loading and data (rlhfkit.config.options), the Ray cluster, vLLM engines and
sampling (rlhfkit.config.engine_options) and the reward sources (rlhfkit.config.reward_options).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.options import opt


@dataclass
class InferenceOptions:
    """Generation, scoring and post-processing"""

    eval_task: str = opt("generate_vllm", "generate_vllm: sample with vLLM engine actors on Ray; generate: with the "
                                          "transformers engine; rm: score --dataset's input + output rows",
                         choices=["generate_vllm", "generate", "rm"])
    best_of_n: int = opt(1, "samples per prompt")
    max_new_tokens: int = opt(1024, "maximum new tokens per sample")
    greedy_sampling: bool = opt(False, "greedy decoding (temperature 0)")
    iter: int | None = opt(None, "iterative runs: use only prompts [iter * rollout_batch_size, (iter + 1) * "
                                 "rollout_batch_size)")
    enable_csft: bool = opt(False, "put --csft_prompt before every prompt (sampling from a conditional-SFT model)")
    csft_prompt: str = opt("<rm_score>: 5.00", "the condition text of --enable_csft (rlhfkit sft --csft_keys format)")
    post_processor: str | None = opt(None, "turn scored rows into training data: rs (best of n -> SFT rows), csft "
                                           "(rm_score per row -> sft --csft_keys), iter_dpo (best/worst -> DPO "
                                           "pairs); needs a reward", choices=["rs", "csft", "iter_dpo"])
    micro_batch_size: int = opt(16, "rows per reward-model forward")
    tp_size: int = opt(1, "tensor parallel size of each vLLM engine (GPUs only)")
    output_path: str | None = opt(None, "where the rows go (.jsonl); required")
