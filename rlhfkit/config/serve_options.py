"""The option group of `rlhfkit serve-rm` (OpenRLHF's `serve_rm` names): the flags only it has. Its reward-source,
model-loading and length flags are in the shared groups (rlhfkit.config.reward_options, rlhfkit.config.options)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.options import opt

DESCRIPTION = "Serve a reward model or reward_func over HTTP."


@dataclass
class ServeRMOptions:
    """Reward server"""

    host: str = opt("127.0.0.1", "bind address (OpenRLHF: 0.0.0.0)")
    port: int = opt(5000, "TCP port (0: any free port)")
    auth_token: str | None = opt(None, "require 'Authorization: Bearer TOKEN' (default $RLHFKIT_RM_TOKEN)")
    batch_size: int | None = opt(None, "micro-batch size (default: the whole request)")
