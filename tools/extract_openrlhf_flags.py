"""Write tests/fixtures/openrlhf_flags.json: the flags of OpenRLHF's command-line tools, both dialects.

    python tools/extract_openrlhf_flags.py MIRROR FLAGS_MD

MIRROR: a git clone of OpenRLHF (today's CLIs, dotted flags, read at HEAD); FLAGS_MD: the seed-era flag list
(../shared/FLAGS.md). Each CLI's parser is rebuilt by running the statements of its `__main__` block that add the
arguments (nothing else of OpenRLHF is imported). Output: {"openrlhf-0.11": {cli: {flag: kind}}, "seed": {...}},
kind being "switch" (store_true/store_false) or "value". The test suite reads the checked-in JSON (CI has no mirror).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

CLIS = ["train_ppo_ray", "train_sft", "train_rm", "train_dpo", "serve_rm", "lora_combiner"]
OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "openrlhf_flags.json"


def today_flags(mirror: str, cli: str) -> dict[str, str]:
    src = subprocess.run(["git", "-C", mirror, "show", f"HEAD:openrlhf/cli/{cli}.py"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    start = next(i for i, line in enumerate(src) if "argparse.ArgumentParser(" in line)
    end = next(i for i, line in enumerate(src) if "parser.parse_args()" in line and i > start)
    indent = len(src[start]) - len(src[start].lstrip())
    namespace = {"argparse": argparse, "datetime": datetime.datetime, "os": os}
    exec("\n".join(line[indent:] for line in src[start:end]), namespace)  # noqa: S102 - a trusted local mirror
    parser = namespace["parser"]
    assert isinstance(parser, argparse.ArgumentParser)
    switches = (argparse._StoreTrueAction, argparse._StoreFalseAction)
    return {opt: "switch" if isinstance(action, switches) else "value"
            for action in parser._actions if not isinstance(action, argparse._HelpAction)
            for opt in action.option_strings}


def seed_flags(flags_md: str) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    cli = None
    for line in Path(flags_md).read_text().splitlines():
        if m := re.match(r"## `(\w+)`", line):
            cli = m.group(1)
            out[cli] = {}
        elif cli and line.startswith("**"):
            for flag, switch in re.findall(r"`(--[\w.]+)`(\(flag\))?", line):
                out[cli][flag] = "switch" if switch else "value"
    return out


def main() -> None:
    mirror, flags_md = sys.argv[1:3]
    data = {"openrlhf-0.11": {cli: today_flags(mirror, cli) for cli in CLIS}, "seed": seed_flags(flags_md)}
    OUT.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    for dialect, clis in data.items():
        print(dialect, {cli: len(flags) for cli, flags in clis.items()})


if __name__ == "__main__":
    main()
