"""`builtin:code`: run the response's Python program against the label's tests in a resource-limited subprocess.

The program is the last ```` ```python ```` (or plain ```` ``` ````) fenced block of the response, else the whole
response. The label (a dict, or a JSON string of one) says how to test it:

* ``{"tests": ["assert add(1, 2) == 3", ...]}`` (or a single string): each assertion runs after the program, in its
  own process; a case passes when the process exits 0 after the assertion ran (a program that exits early, e.g.
  ``sys.exit(0)`` before the appended test, fails the case);
* ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``: stdin/stdout cases; a case passes when the program's
  stdout equals the expected output (trailing whitespace of each line and trailing blank lines ignored).

Reward = the fraction of cases that pass; score = 1.0 when all pass, else 0.0 (pass@k counts whole solutions).
``extra_logs``: ``code_pass_rate``, ``code_has_block`` (a fenced block was found), ``code_timeouts``.

Each case runs ``python -I -S`` (isolated: no user site, no environment variables, no current directory on the
path) in a fresh empty temporary directory, with an empty environment, ``RLIMIT_AS`` = ``memory_mb``,
``RLIMIT_CPU`` and a wall-clock ``timeout``, ``RLIMIT_FSIZE`` = 16 MiB, and no stdin beyond the case's input.
Cases of a batch run concurrently (``workers``, default the CPU count). **This is resource limiting, not a
security boundary**: the program can still read files the user can read and open network connections. Train on
untrusted generations at scale behind a container or a sandbox service (`--remote_rm_url http://...`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlhfkit.rewards.base import response_of

FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
FILE_LIMIT = 16 * 2**20


@dataclass(frozen=True)
class Case:
    """One test: code appended to the program (an assertion), or stdin with the expected stdout."""

    append: str = ""
    stdin: str = ""
    expected_stdout: str | None = None


def extract_program(response: str) -> tuple[str, bool]:
    """(program, whether it came from a fenced block): the last fenced block, else the whole response."""
    blocks = FENCE.findall(response)
    return (blocks[-1], True) if blocks else (response, False)


def parse_cases(label: Any, index: int) -> list[Case]:
    """The test cases of one label; ValueError naming the sample for anything else."""
    if isinstance(label, str):
        try:
            label = json.loads(label)
        except json.JSONDecodeError as err:
            raise ValueError(f"builtin:code: sample {index}: the label is not JSON ({err}); expected "
                             '{"tests": [...]} or {"inputs": [...], "outputs": [...]}') from None
    if not isinstance(label, dict):
        raise ValueError(f"builtin:code: sample {index}: the label must be a dict, got {type(label).__name__}")
    if "tests" in label:
        tests = [label["tests"]] if isinstance(label["tests"], str) else list(label["tests"])
        return [Case(append=str(t)) for t in tests]
    inputs, outputs = label.get("inputs"), label.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise ValueError(f"builtin:code: sample {index}: the label needs 'tests', or 'inputs' and 'outputs' lists of "
                         f"the same length (keys: {sorted(label)})")
    return [Case(stdin=str(i), expected_stdout=str(o)) for i, o in zip(inputs, outputs)]


def _normalize_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


# The child sets its own limits, then runs the program (passed as argv[1]) as `__main__`. Not `preexec_fn`: that runs
# Python between fork and exec, which deadlocks when another thread of this process (Ray's, the reward pool's) held a
# lock at the fork (seen here: a test hung in `_execute_child` for 10+ minutes, the child stuck before exec).
_LIMITED_RUNNER = """import resource as _r, sys as _s
for _k, _v in ((_r.RLIMIT_AS, {memory}), (_r.RLIMIT_CPU, {cpu}), (_r.RLIMIT_FSIZE, {fsize})):
    _r.setrlimit(_k, (_v, _v))
_src = _s.argv.pop(1)
del _r, _s, _k, _v
exec(compile(_src, "<string>", "exec"), {{"__name__": "__main__", "__builtins__": __builtins__}})
"""


def _limited_command(source: str, memory_mb: int, cpu_seconds: int) -> list[str]:
    """`python -c` that caps address space, CPU seconds and file size (RLIMIT_AS/CPU/FSIZE, soft = hard), then
    runs `source`."""
    runner = _LIMITED_RUNNER.format(memory=memory_mb << 20, cpu=cpu_seconds, fsize=FILE_LIMIT)
    return [sys.executable, "-I", "-S", "-c", runner, source]


def run_case(program: str, case: Case, *, timeout: float = 5.0, memory_mb: int = 512) -> tuple[bool, bool]:
    """(passed, timed out) of one case in a fresh limited subprocess. An assertion case passes only when the
    process exits 0 *after* the assertions ran: a random token printed after them must end stdout, so a program
    that calls `sys.exit(0)` (or `os._exit(0)`) before the appended tests does not pass them."""
    reached = secrets.token_hex(16)
    source = program if not case.append else \
        f"{program}\n\n{case.append}\n\nimport sys as _rlhfkit_sys\n_rlhfkit_sys.stdout.write('\\n{reached}\\n')\n"
    with tempfile.TemporaryDirectory(prefix="rlhfkit_code_") as workdir:
        try:
            done = subprocess.run(_limited_command(source, memory_mb, max(1, int(timeout) + 1)), input=case.stdin,
                                  capture_output=True, text=True, timeout=timeout, cwd=workdir, env={},
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return False, True
    if done.returncode != 0:
        return False, False
    if case.expected_stdout is None:
        return not case.append or done.stdout.rstrip().endswith(reached), False
    return _normalize_output(done.stdout) == _normalize_output(case.expected_stdout), False


def make_code_reward_func(timeout: float = 5.0, memory_mb: int = 512,
                          workers: int | None = None) -> Callable[..., dict[str, Any]]:
    """The `builtin:code` reward_func (see the module docstring)."""
    def code_reward_func(queries: list[str], prompts: list[str], labels: list[Any]) -> dict[str, Any]:
        if labels is None or any(label is None for label in labels):
            raise ValueError("builtin:code needs a label with the tests of every sample (set --label_key)")
        programs = [extract_program(response_of(q, p)) for q, p in zip(queries, prompts)]
        jobs = [(i, program, case) for i, ((program, _), label) in enumerate(zip(programs, labels))
                for case in parse_cases(label, i)]
        with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
            results = list(pool.map(lambda job: run_case(job[1], job[2], timeout=timeout, memory_mb=memory_mb),
                                    jobs))
        passed, total, timeouts = [0] * len(queries), [0] * len(queries), [0] * len(queries)
        for (i, _, _), (ok, timed_out) in zip(jobs, results):
            passed[i] += ok
            total[i] += 1
            timeouts[i] += timed_out
        rates = [p / t if t else 0.0 for p, t in zip(passed, total)]
        return {"rewards": rates, "scores": [float(p == t and t > 0) for p, t in zip(passed, total)],
                "extra_logs": {"code_pass_rate": rates, "code_has_block": [float(b) for _, b in programs],
                               "code_timeouts": [float(t) for t in timeouts]}}

    return code_reward_func
