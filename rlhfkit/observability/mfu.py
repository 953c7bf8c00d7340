"""Model FLOPs utilisation: the FLOPs a stage had to do over what the hardware's measured matmul ceiling allows in
the same time, so every run shows how far each stage is from the machine's limit.

FLOPs per token (the usual 2N forward / 6N forward+backward rule, attention's quadratic term left out):
    forward  = 2 * body + 2 * head * (share of tokens whose logits are computed)
    training = 3 * forward
`body` = parameters that multiply every token (the decoder layers: everything but the input embedding and the LM
head), `head` = vocab x hidden (the LM head matmul, whether tied or not), applied only where logits are needed (the
response positions in RL). The ceiling is the matmul rate of the precision in use (`rlhfkit.engine.precision`), times
the devices that share the work (GPUs; CPU nodes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FlopModel:
    body: float
    head: float

    @classmethod
    def from_config(cls, config: Any, total_params: int) -> FlopModel:
        """From an HF config and the model's parameter count (tied embeddings counted once)."""
        text = getattr(config, "text_config", None) or config  # a VLM's language model config
        vocab, hidden = int(text.vocab_size), int(text.hidden_size)
        head = vocab * hidden
        tied = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
        body = total_params - head - (0 if tied else head)  # minus the input embedding, and the untied head
        return cls(body=float(max(body, 0)), head=float(head))

    def forward(self, tokens: float, logit_tokens: float) -> float:
        return 2 * self.body * tokens + 2 * self.head * logit_tokens

    def training(self, tokens: float, logit_tokens: float) -> float:
        return 3 * self.forward(tokens, logit_tokens)


def mfu(flops: float, seconds: float, ceiling_gflops: float | None, devices: int = 1) -> float | None:
    """flops / (seconds * ceiling * devices); None where the ceiling is unknown or nothing was timed."""
    if not ceiling_gflops or seconds <= 0:
        return None
    return flops / (seconds * ceiling_gflops * 1e9 * devices)
