"""The option group of `rlhfkit serve-rm` (OpenRLHF's `serve_rm` names): the flags only it has. Its reward-source,
model-loading and length flags are in the shared groups (rlhfkit.config.reward_options, rlhfkit.config.options)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhfkit.config.options import opt

DESCRIPTION = "Serve a reward model or reward_func over HTTP."


@dataclass
class ServeRMOptions:
    """Reward server"""

    host: str = opt("127.0.0.1", "bind address (OpenRLHF: 0.0.0.0); an address other than loopback needs "
                                 "--auth_token or --allow_unauthenticated")
    port: int = opt(5000, "TCP port (0: any free port)")
    auth_token: str | None = opt(None, "require 'Authorization: Bearer TOKEN' (default $RLHFKIT_RM_TOKEN)")
    batch_size: int | None = opt(None, "micro-batch size (default: the whole request)")
    allow_unauthenticated: bool = opt(False, "serve a non-loopback --host without a token (refused otherwise: "
                                             "anyone on the network could call the reward source); logs a warning")
    request_timeout: float = opt(30.0, "seconds a client has to send a whole request (headers and body, in total, "
                                       "not per read) and to take the answer; past it: 408 and the connection closed")
    max_request_mb: float = opt(256.0, "largest request body in MiB; a larger Content-Length is refused (413) "
                                       "before the body is read")
    max_connections: int = opt(64, "connections served at once; more are answered 503 (Retry-After) at once")
    batch_max_queries: int = opt(1024, "the most queries scored in one batch: requests that arrive while a batch is "
                                       "scored are merged into the next one up to this (a larger request is scored "
                                       "alone); 0: never merge (a reward_func that looks at the whole batch sees "
                                       "one request)")
