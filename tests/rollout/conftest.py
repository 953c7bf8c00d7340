"""Rollout test helpers; the engine fixtures (`rollout_vllm_engine`, `rollout_hf_engine`) live in tests/conftest.py
so the RL tests share the same single engine. Tests that change an engine's weights must put the original weights
back before they finish."""

from __future__ import annotations

import pytest

QUESTIONS = ["What is 2 + 2?", "Name a colour.", "Say hello.", "Count to three.", "Why is the sky blue?"]


@pytest.fixture(scope="session")
def rollout_prompts(tokenizer) -> list[list[int]]:
    """Token ids of five single-turn chat prompts (generation prompt appended), as the RL loop builds them."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in QUESTIONS
    ]


@pytest.fixture(scope="session")
def trainer_logprobs():
    """`fn(model, prompt, response, temperature=1.0, truncation=None) -> list[float]`: the trainer's
    `response_log_probs` reference (`truncation`: a `SamplingTruncation`, --top_k / --top_p)."""
    import torch

    from rlhfkit.models.logprobs import response_log_probs

    def fn(model, prompt: list[int], response: list[int], temperature: float = 1.0, truncation=None) -> list[float]:
        ids = torch.tensor([list(prompt) + list(response)])
        with torch.no_grad():
            logp = response_log_probs(model, ids, torch.ones_like(ids), temperature=temperature,
                                      truncation=truncation)
        return logp[0, len(prompt) - 1:].tolist()

    return fn
