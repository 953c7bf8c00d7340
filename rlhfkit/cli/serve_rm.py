"""`rlhfkit serve-rm` (also `python -m rlhfkit.cli.serve_rm`): serve a reward model or reward_func over HTTP."""

from __future__ import annotations

from rlhfkit.rewards.server import build_parser, serve_rm_main  # noqa: F401 (build_parser: generated docs)


def main(argv: list[str] | None = None) -> None:
    serve_rm_main(argv)


if __name__ == "__main__":
    main()
