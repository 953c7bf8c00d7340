"""`rlhfkit serve-rm` (also `python -m rlhfkit.cli.serve_rm`): serve a reward model or reward_func over HTTP."""

from __future__ import annotations

from rlhfkit.config.commands import ServeRMConfig
from rlhfkit.config.serve_options import DESCRIPTION
from rlhfkit.rewards.server import serve_rm_main

GROUPS = list(ServeRMConfig.GROUPS)
__all__ = ["DESCRIPTION", "GROUPS", "main"]


def main(argv: list[str] | None = None) -> None:
    serve_rm_main(argv)


if __name__ == "__main__":
    main()
