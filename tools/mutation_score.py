"""Score per folder of the last `make mutation` run (docs/mutation.md).

Reads mutmut's results (mutants/rlhfkit/<folder>/*.meta), keeps the mutants of the sample pattern, and subtracts
the survivors that docs/mutation.md lists as equivalent (its table rows start with "| `rlhfkit.").

mutmut runs, for each mutant, the tests that called the mutated function in its own process. Tests that drive the
code in child processes (the 2-rank gloo check) are never picked, so the survivors of a folder listed in RECHECK
are run once more against those tests when the mutated function has a distributed path (process_group, dist.,
all_reduce), inside mutants/ with MUTANT_UNDER_TEST set (the children import the mutated copy); a failure there
counts as a kill ("killed by recheck").

    python tools/mutation_score.py "algorithms=*[16]" "data=*1" "rewards=1"   # folder=globs (comma-separated)
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILLED = {1, 3, 36, 24, -24, 152, 255, -11, -9, 37}  # test failure / pytest error / timeout / crash / type check
SURVIVED = {0}
NO_TESTS = {5, 33}
TARGET = {"algorithms": 0.95, "data": 0.85, "rewards": 0.85}
RECHECK = {"algorithms": ["tests/algorithms/test_distributed.py"]}
DISTRIBUTED = re.compile(r"process_group|dist\.|all_reduce")


def function_source(name: str) -> str:
    """Source of the original function of a mutant (``pkg.mod.x_func__mutmut_3``, ``pkg.mod.xǁClsǁmeth__mutmut_1``)."""
    module, func = name.rsplit("__mutmut_", 1)[0].rsplit(".", 1)
    tree: ast.AST = ast.parse(source := (ROOT / (module.replace(".", "/") + ".py")).read_text())
    path = func[2:].split("ǁ") if func.startswith("xǁ") else [func[2:]]
    for part in path:
        found = next((n for n in ast.iter_child_nodes(tree) if getattr(n, "name", None) == part), None)
        if found is None:
            return ""
        tree = found
    return ast.get_source_segment(source, tree) or ""


def touches_distributed(name: str) -> bool:
    """The mutated function has a distributed path (it takes a process group or calls torch.distributed)."""
    return name.split(".")[1] in RECHECK and bool(DISTRIBUTED.search(function_source(name)))


def recheck(name: str, tests: list[str]) -> bool:
    """True when ``tests`` fail with mutant ``name`` active (the mutant is killed)."""
    env = {**os.environ, "MUTANT_UNDER_TEST": name, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    return subprocess.run(cmd, cwd=ROOT / "mutants", env=env, capture_output=True).returncode != 0


def equivalent_names() -> set[str]:
    doc = ROOT / "docs" / "mutation.md"
    if not doc.exists():
        return set()
    return set(re.findall(r"^\| `(rlhfkit\.[\w.]+__mutmut_\d+)`", doc.read_text(), flags=re.M))


def score(folder: str, patterns: list[str], equivalent: set[str]) -> tuple[Counter, list[str]]:
    counts: Counter = Counter()
    alive: list[str] = []
    for meta in sorted((ROOT / "mutants" / "rlhfkit" / folder).glob("*.meta")):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            if not any(fnmatch.fnmatch(name, p) for p in patterns):
                continue
            counts["total"] += 1
            if code in KILLED:
                counts["killed"] += 1
            elif name in equivalent:
                counts["equivalent"] += 1
            elif code is None:
                counts["not run"] += 1
            elif code in SURVIVED and touches_distributed(name) and recheck(name, RECHECK.get(folder, [])):
                counts["killed"] += 1
                counts["killed by recheck"] += 1
            else:
                counts["survived" if code in SURVIVED else "no tests" if code in NO_TESTS else "other"] += 1
                alive.append(name)
    return counts, alive


def main(argv: list[str]) -> int:
    equivalent = equivalent_names()
    ok = True
    for arg in argv:
        folder, globs = arg.split("=", 1)
        counts, alive = score(folder, [f"*__mutmut_{g}" for g in globs.split(",")], equivalent)
        relevant = counts["total"] - counts["equivalent"]
        rate = counts["killed"] / relevant if relevant else 0.0
        target = TARGET.get(folder, 0.85)
        ok &= rate >= target and not counts["not run"]
        print(
            f"rlhfkit/{folder}: killed {counts['killed']} / {relevant} non-equivalent = {rate:.1%} "
            f"(target {target:.0%}; sampled {counts['total']}, equivalent {counts['equivalent']}, "
            f"killed by recheck {counts['killed by recheck']}, "
            f"survived {counts['survived']}, no tests {counts['no tests']}, not run {counts['not run']})"
        )
        for name in alive:
            print(f"    alive: {name}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
