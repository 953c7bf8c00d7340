"""The option group of `rlhfkit serve-rm` (OpenRLHF's `serve_rm` names, plus the reward_func options)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.options import opt

DESCRIPTION = "Serve a reward model or reward_func over HTTP."


@dataclass
class ServeRMOptions:
    """Reward server"""

    reward_pretrain: str | None = opt(None, "reward model(s), comma-separated (combined per --reward_combine)")
    remote_rm_url: str | None = opt(None, "a reward_func .py file or builtin:math|format|exact")
    host: str = opt("127.0.0.1", "bind address (OpenRLHF: 0.0.0.0)")
    port: int = opt(5000, "TCP port (0: any free port)")
    auth_token: str | None = opt(None, "require 'Authorization: Bearer TOKEN' (default $RLHFKIT_RM_TOKEN)")
    normalize_reward: bool = opt(False, "apply reward_mean/reward_std from config.json")
    max_len: int = opt(2048, "keep the last max_len tokens of each query")
    batch_size: int | None = opt(None, "micro-batch size (default: the whole request)")
    value_head_prefix: str = opt("score", "name of the scalar head (rlhfkit's heads are always 'score')",
                                 choices=["score"])
    param_dtype: str = opt("fp32", "the reward model's dtype (OpenRLHF default: bf16)",
                           choices=["bf16", "fp16", "fp32"])
    attn_implementation: str = opt("sdpa", "attention kernel (OpenRLHF default: flash_attention_2)")
    disable_fast_tokenizer: bool = opt(False, "use the slow (Python) tokenizer")
    reward_timeout: float = opt(60.0, "seconds per reward_func call")
    reward_error_policy: str = opt("raise", "a failing reward_func: raise (HTTP 422) or score the sample 0",
                                   choices=["raise", "zero"])
    reward_combine: str = opt("mean", "how several reward sources combine", choices=["mean", "sum"])
    reward_weights: str | None = opt(None, "comma-separated weights, one per reward source")
    reward_format_pattern: str | None = opt(None, "regex for builtin:format")
