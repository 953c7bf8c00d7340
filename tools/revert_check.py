"""The revert check of the option-effect registry (issue #28): does a claim hold when the option stops acting?

For a seeded random sample of the registry's Tested entries, the entry's cited tests run with the option forced back
to its default (tests/option_record.py, a pytest plugin: the parsed config's field is reset, a refused flag is taken
off the command line, a subprocess's argv loses it; rlhfkit's code is untouched). A claim holds when at least one cited
test then fails, having passed unchanged. Only default-tier tests run (entries whose cited tests are all marked slow
are left out of the sample), as are entries of a positional argument (required: its default is no value).

One pytest session per round: a round reverts a different entry's option in each test it runs (RLHFKIT_REVERT_PLAN),
so an entry sharing a test with another sampled entry waits for a later round. First a baseline session without
reverts: an entry whose cited tests do not pass unchanged is inconclusive.

    python tools/revert_check.py --sample 30 --seed 42     # prints each entry and the fraction that holds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.check_option_claims import entry_targets  # noqa: E402


def base(node_id: str) -> str:
    return node_id.split("[", 1)[0]


def pytest_session(node_ids: list[str], record: Path, plan: dict[str, list[str]] | None, timeout: int) -> dict:
    """Run the tests (default tier) once; the record of the session (outcome per node id)."""
    env = {**os.environ, "RLHFKIT_OPTION_RECORD": str(record)}
    env.pop("RLHFKIT_REVERT_OPTIONS", None)
    record.unlink(missing_ok=True)
    if plan is not None:
        plan_file = record.with_suffix(".plan.json")
        plan_file.write_text(json.dumps(plan))
        env["RLHFKIT_REVERT_PLAN"] = str(plan_file)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:randomly", "--timeout", "300",
           "-o", "cache_dir=" + str(record.parent / "cache"), *sorted(set(node_ids))]
    subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(record.read_text())["tests"] if record.is_file() else {}


def outcomes(record: dict, node_id: str) -> list[str]:
    return [entry["outcome"] for nodeid, entry in record.items() if nodeid == node_id or base(nodeid) == node_id]


def default_tier(node_ids: list[str]) -> set[str]:
    """The node ids (without parametrisation) pytest selects with -m "not slow"."""
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow",
                           "-p", "no:cacheprovider", *sorted(set(node_ids))],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    return {base(line.strip()) for line in done.stdout.splitlines() if "::" in line}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=30, help="entries drawn (default-tier ones)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--keys", nargs="*", default=None, help="check these registry keys instead of a sample")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds for one pytest session")
    parser.add_argument("--json", default=None, help="write the verdicts here")
    args = parser.parse_args(argv)

    from tools.gen_docs import commands, positional_arguments
    from tools.option_effects import Tested, registry

    entries = {k: e for k, e in registry().items() if isinstance(e, Tested)}
    targets = entry_targets()
    positional = {f"{c}:{p}" for c in commands() for p in positional_arguments(c)}
    candidates = sorted(k for k in entries if k not in positional and targets.get(k))
    fast = default_tier([t for k in candidates for t in entries[k].tests])
    tests_of = {k: [t for t in entries[k].tests if base(t) in fast] for k in candidates}
    eligible = [k for k in candidates if tests_of[k]]
    chosen = args.keys or sorted(random.Random(args.seed).sample(eligible, min(args.sample, len(eligible))))
    print(f"{len(entries)} Tested entries; {len(eligible)} with a default-tier cited test; checking {len(chosen)}"
          f" (seed {args.seed})", flush=True)

    work = Path(tempfile.mkdtemp(prefix="revert-check-"))
    baseline = pytest_session([t for k in chosen for t in tests_of[k]], work / "baseline.json", None, args.timeout)
    verdicts: dict[str, str] = {}
    pending = []
    for key in chosen:
        runs = [outcomes(baseline, t) for t in tests_of[key]]
        if all(r and all(o == "passed" for o in r) for r in runs):
            pending.append(key)
        else:
            verdicts[key] = "inconclusive (a cited test does not pass unchanged)"
    round_no = 0
    while pending:
        round_no += 1
        plan: dict[str, list[str]] = {}
        this_round, later = [], []
        for key in pending:
            if any(base(t) in plan for t in tests_of[key]):
                later.append(key)
                continue
            flags = sorted({f"{command}:{dest}" for command, dest in targets[key]})
            plan.update({base(t): flags for t in tests_of[key]})
            this_round.append(key)
        print(f"round {round_no}: {len(this_round)} entries, {len(plan)} tests", flush=True)
        record = pytest_session(list(plan), work / f"round{round_no}.json", plan, args.timeout)
        for key in this_round:
            failed = [t for t in tests_of[key] if any(o == "failed" for o in outcomes(record, t))]
            verdicts[key] = (f"holds: {failed[0]} fails with the option at its default" if failed else
                             "DOES NOT HOLD: the cited default-tier tests pass with the option at its default")
            print(f"  {key}: {verdicts[key]}", flush=True)
        pending = later
    decided = [k for k in chosen if not verdicts[k].startswith("inconclusive")]
    holding = [k for k in decided if verdicts[k].startswith("holds")]
    for key in chosen:
        if not verdicts[key].startswith("holds"):
            print(f"{key}: {verdicts[key]}")
    print(f"revert check: {len(holding)} of {len(decided)} sampled claims hold "
          f"({len(chosen) - len(decided)} inconclusive; seed {args.seed})")
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": args.seed, "verdicts": verdicts}, indent=1))
    return 0 if len(holding) == len(decided) else 1


if __name__ == "__main__":
    raise SystemExit(main())
