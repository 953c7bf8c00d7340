"""`rlhfkit runs [RUNS_DIR]`: list the run folders under RUNS_DIR (default ./runs), one line each."""

from __future__ import annotations

import argparse
import sys

from rlhfkit.observability.runs import RunRow, format_runs, list_runs

DESCRIPTION = ("List the run folders under RUNS_DIR (folders with a metrics.jsonl, two levels deep), oldest first: "
               "command, start time, logged steps and the outcome (the eval metric before -> after, the reward or "
               "loss first -> last), as the run's report summary gives them.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="rlhfkit runs", description=DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("runs_dir", metavar="RUNS_DIR", nargs="?", default="runs",
                        help="folder holding run folders (the parent of the runs' --run_dir)")
    return parser


def main(argv: list[str] | None = None) -> list[RunRow]:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rows = list_runs(args.runs_dir)
    except FileNotFoundError as err:
        print(f"rlhfkit runs: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(format_runs(rows, args.runs_dir))
    return rows


if __name__ == "__main__":
    main()
