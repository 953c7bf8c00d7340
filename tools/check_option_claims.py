"""Check the option-effect registry against what its cited tests actually set (issue #28).

The test suite records, per test, the options each test set to a non-default value (tests/option_record.py, a pytest
plugin: every `make test` / `make test-slow` merges into the record). An entry of the registry
(tests/option_effects.yaml) claims that its cited tests set the option and show its effect; this tool fails an
entry when every cited test that ran and passed left the option at its default (for every command the entry stands
for). CI (.ci/run) runs it after both tiers:

    python tools/check_option_claims.py                 # the record of the suite's runs (.pytest_cache)
    python tools/check_option_claims.py --record F      # or RLHFKIT_OPTION_RECORD=F, as the suite wrote it
    python tools/check_option_claims.py --require-all   # also fail entries whose cited tests did not run

Entries whose cited tests were all skipped (GPU-only) or did not run are listed, not failed (unless --require-all).
Exit status 1 when an entry fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_RECORD = REPO / ".pytest_cache" / "d" / "rlhfkit" / "option_record.json"
# Entries known to fail the check, each to be fixed (a cited test that sets the option, through the config) and then
# struck from the list; one registry key a line, '#' comments. A listed entry that passes is reported (strike it).
KNOWN = REPO / "tools" / "option_claims_unproven.txt"


def known_unproven(path: Path = KNOWN) -> set[str]:
    if not path.is_file():
        return set()
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line}


@dataclass
class Verdict:
    key: str            # the registry key ("flag" or "command:flag")
    status: str         # "proven", "not set", "not run", "skipped"
    detail: str


def flag_spellings() -> dict[str, dict[str, str]]:
    """command -> {name the registry uses (flag or alias): the name the record uses (argparse dest)}."""
    from tools.gen_docs import commands, describe

    out: dict[str, dict[str, str]] = {}
    for command in commands():
        names: dict[str, str] = {}
        for group in describe(command).groups:
            for flag in group.flags:
                first = flag.names[0]
                primary = first[2:] if first.startswith("--") else first.lower()
                names[primary] = primary
                for other in flag.names[1:]:
                    if other.startswith("--") and not other.startswith("--no-"):
                        names[other[2:]] = primary
        names.pop("config", None)
        out[command] = names
    return out


def entry_targets() -> dict[str, set[tuple[str, str]]]:
    """registry key -> the (command, recorded name) pairs whose option the entry stands for."""
    from tools.option_effects import registry

    entries = registry()
    out: dict[str, set[tuple[str, str]]] = {key: set() for key in entries}
    for command, names in flag_spellings().items():
        for name, dest in names.items():  # the key effect_of resolves: the command's own first, then the shared
            key = f"{command}:{name}" if f"{command}:{name}" in entries else name
            if key in entries:  # set through its flag (the dest) or refused under this name
                out[key] |= {(command, dest), (command, name)}
    return out


def _matching(tests: dict[str, dict], node_id: str) -> list[dict]:
    """The recorded runs of a cited node id: the id itself, or each parametrisation of it."""
    if node_id in tests:
        return [tests[node_id]]
    return [entry for nodeid, entry in tests.items() if nodeid.split("[", 1)[0] == node_id]


def check(record: dict) -> list[Verdict]:
    """One verdict per Tested entry of the registry."""
    from tools.option_effects import Tested, registry

    tests = record.get("tests", {})
    targets = entry_targets()
    verdicts = []
    for key, effect in sorted(registry().items()):
        if not isinstance(effect, Tested):
            continue
        wanted = targets.get(key, set())
        ran = skipped = 0
        setting = []
        for node_id in effect.tests:
            runs = _matching(tests, node_id)
            passed = [r for r in runs if r["outcome"] == "passed"]
            if not runs:
                continue
            if not passed:
                skipped += all(r["outcome"] == "skipped" for r in runs)
                continue
            ran += 1
            if any(dest in r["set"].get(command, ()) for r in passed for command, dest in wanted):
                setting.append(node_id)
        cited = len(effect.tests)
        if setting:
            verdicts.append(Verdict(key, "proven", f"set by {len(setting)} of {cited} cited test(s)"))
        elif ran:
            commands = sorted({c for c, _ in wanted})
            verdicts.append(Verdict(key, "not set", f"{ran} cited test(s) ran and passed without setting "
                                    f"--{key.split(':')[-1]} of {', '.join(commands) or '(no command)'}"))
        elif skipped:
            verdicts.append(Verdict(key, "skipped", f"the cited tests were skipped ({skipped} of {cited})"))
        else:
            verdicts.append(Verdict(key, "not run", f"none of the {cited} cited test(s) is in the record"))
    return verdicts


def record_path(given: str | None) -> Path:
    return Path(given or os.environ.get("RLHFKIT_OPTION_RECORD") or DEFAULT_RECORD)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", default=None, help="the record file (default: $RLHFKIT_OPTION_RECORD, else "
                                                        f"{DEFAULT_RECORD.relative_to(REPO)})")
    parser.add_argument("--require-all", action="store_true", help="fail entries whose cited tests did not run")
    args = parser.parse_args(argv)
    path = record_path(args.record)
    if not path.is_file():
        print(f"no option record at {path}: run the test suite first (make test test-slow)", file=sys.stderr)
        return 2
    verdicts = check(json.loads(path.read_text()))
    known = known_unproven()
    for v in verdicts:
        if v.key in known and v.status == "not set":
            v.status, v.detail = "known", v.detail + f" (listed in {KNOWN.relative_to(REPO)})"
        elif v.key in known and v.status == "proven":
            v.status, v.detail = "struck", f"proven now: strike it from {KNOWN.relative_to(REPO)}"
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v.status] = counts.get(v.status, 0) + 1
    failing = {"not set"} | ({"not run"} if args.require_all else set())
    for status in ("not set", "struck", "known", "not run", "skipped"):
        for v in verdicts:
            if v.status == status:
                print(f"{'FAIL' if status in failing else 'note'} {v.key}: {v.detail}")
    print("option claims: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + f" (record {path})")
    return 1 if any(v.status in failing for v in verdicts) else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
