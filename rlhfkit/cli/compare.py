"""`rlhfkit compare RUN_A RUN_B`: one HTML page overlaying the two runs' curves for the metrics they share."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhfkit.errors import ReportError
from rlhfkit.observability.compare import write_compare

DESCRIPTION = ("Write one self-contained HTML page (inline SVG, no network) overlaying two runs: each run's summary "
               "(what ran, outcome, time per step, tokens/s), then one plot per metric both runs logged, A and B "
               "drawn on the same axes, and the metrics only one of them logged.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="rlhfkit compare", description=DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("run_a", metavar="RUN_A", help="the first run folder (drawn in blue)")
    parser.add_argument("run_b", metavar="RUN_B", help="the second run folder (drawn in red)")
    parser.add_argument("--output", "-o", default="compare.html", help="where to write the page")
    return parser


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        path = write_compare(args.run_a, args.run_b, args.output)
    except ReportError as err:
        print(f"rlhfkit compare: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(path)
    return path


if __name__ == "__main__":
    main()
