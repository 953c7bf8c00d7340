"""`rlhfkit report RUN_DIR`: write RUN_DIR/report.html, one self-contained page of plots, samples and the manifest."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhfkit.errors import ReportError
from rlhfkit.observability.report import write_report

DESCRIPTION = ("Write RUN_DIR/report.html: one self-contained HTML page (inline SVG plots, no network) with the "
               "run's command, versions and hardware, plots of every logged metric, sample generations from the "
               "first and last step, and the command that reproduces the run; for an online run also "
               "RUN_DIR/samples.html, the per-sample trace of one step (--step).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="rlhfkit report", description=DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run folder (the run's --run_dir): holds metrics.jsonl, "
                        "manifest.json and samples.jsonl")
    parser.add_argument("--output", "-o", default=None,
                        help="where to write the page (default: RUN_DIR/report.html)")
    parser.add_argument("--step", type=int, default=None,
                        help="the step the samples page (samples.html beside the report) shows: its per-sample "
                        "trace, sortable, with one sample's tokens coloured by advantage and mismatch "
                        "(default: the last step)")
    return parser


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        path = write_report(args.run_dir, args.output, args.step)
    except ReportError as err:
        print(f"rlhfkit report: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(path)
    if (path.with_name("samples.html")).is_file():
        print(path.with_name("samples.html"))
    return path


if __name__ == "__main__":
    main()
