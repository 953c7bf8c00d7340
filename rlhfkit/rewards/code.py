"""`builtin:code`: run the response's Python program against the label's tests in a resource-limited subprocess.

The program is the last ```` ```python ```` (or plain ```` ``` ````) fenced block of the response, else the whole
response. The label (a dict, or a JSON string of one) says how to test it:

* ``{"tests": ["assert add(1, 2) == 3", ...]}`` (or a single string): each assertion runs after the program, in its
  own process; a case passes when the process exits 0 after the assertion ran (a program that exits early, e.g.
  ``sys.exit(0)`` before the appended test, fails the case);
* ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``: stdin/stdout cases; a case passes when the program's
  stdout equals the expected output (trailing whitespace of each line and trailing blank lines ignored).

Reward = the fraction of cases that pass; score = 1.0 when all pass, else 0.0 (pass@k counts whole solutions).
``extra_logs``: ``code_pass_rate``, ``code_has_block`` (a fenced block was found), ``code_timeouts``,
``reward_failure``.

Failures that belong to one sample cost that sample alone (reward and score 0, the reason in
``extra_logs["reward_failure"]``, counted by the online loop in ``reward/failed_<reason>``): a case that runs past
``timeout`` seconds (``timeout``; the limit is per program run, so a slow sample never holds up the batch beyond its
own cases) and a case whose stdout is not UTF-8 (``undecodable_output``). A sample's first such reason is given.

Each case runs ``python -I -S`` (isolated: no user site, no environment variables, no current directory on the
path) in a fresh empty temporary directory, with an empty environment, ``RLIMIT_AS`` = ``memory_mb``,
``RLIMIT_CPU`` and a wall-clock ``timeout`` (``--reward_timeout`` for ``builtin:code``; at the timeout the process
group is killed), ``RLIMIT_FSIZE`` = 16 MiB, and no stdin beyond the case's input.
Cases of a batch run concurrently (``workers``, default the CPU count). **This is resource limiting, not a
security boundary**: the program can still read files the user can read and open network connections. Train on
untrusted generations at scale behind a container or a sandbox service (`--remote_rm_url http://...`).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
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
TIMEOUT, UNDECODABLE = "timeout", "undecodable_output"  # per-sample failure reasons (extra_logs["reward_failure"])


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


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the case's process group (the child leads its own session), then the child itself."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # already gone
        pass
    proc.kill()


def check_case(program: str, case: Case, *, timeout: float = 5.0, memory_mb: int = 512) -> tuple[bool, str]:
    """(passed, failure reason) of one case in a fresh limited subprocess; the reason is ``""``, ``"timeout"`` (ran
    past ``timeout`` s: its process group is killed) or ``"undecodable_output"`` (stdout is not UTF-8). An
    assertion case passes only when the process exits 0 *after* the assertions ran: a random token printed after
    them must end stdout, so a program that calls `sys.exit(0)` (or `os._exit(0)`) before the appended tests does
    not pass them."""
    reached = secrets.token_hex(16)
    source = program if not case.append else \
        f"{program}\n\n{case.append}\n\nimport sys as _rlhfkit_sys\n_rlhfkit_sys.stdout.write('\\n{reached}\\n')\n"
    with tempfile.TemporaryDirectory(prefix="rlhfkit_code_") as workdir:
        with subprocess.Popen(_limited_command(source, memory_mb, max(1, int(timeout) + 1)), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=workdir, env={},
                              start_new_session=True) as proc:
            try:
                raw, _ = proc.communicate(case.stdin.encode("utf-8", "surrogateescape"), timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                try:  # a descendant that left the group may still hold stdout open: do not wait for it
                    proc.communicate(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
                return False, TIMEOUT
    try:
        stdout = raw.decode("utf-8")
    except UnicodeDecodeError:
        return False, UNDECODABLE
    if proc.returncode != 0:
        return False, ""
    if case.expected_stdout is None:
        return not case.append or stdout.rstrip().endswith(reached), ""
    return _normalize_output(stdout) == _normalize_output(case.expected_stdout), ""


def run_case(program: str, case: Case, *, timeout: float = 5.0, memory_mb: int = 512) -> tuple[bool, bool]:
    """(passed, timed out) of one case (:func:`check_case`)."""
    passed, reason = check_case(program, case, timeout=timeout, memory_mb=memory_mb)
    return passed, reason == TIMEOUT


def make_code_reward_func(timeout: float = 5.0, memory_mb: int = 512,
                          workers: int | None = None) -> Callable[..., dict[str, Any]]:
    """The `builtin:code` reward_func (see the module docstring); ``timeout``: seconds per program run (case)."""
    def code_reward_func(queries: list[str], prompts: list[str], labels: list[Any]) -> dict[str, Any]:
        if labels is None or any(label is None for label in labels):
            raise ValueError("builtin:code needs a label with the tests of every sample (set --label_key)")
        programs = [extract_program(response_of(q, p)) for q, p in zip(queries, prompts)]
        jobs = [(i, program, case) for i, ((program, _), label) in enumerate(zip(programs, labels))
                for case in parse_cases(label, i)]
        with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
            results = list(pool.map(lambda job: check_case(job[1], job[2], timeout=timeout, memory_mb=memory_mb),
                                    jobs))
        n = len(queries)
        passed, total, timeouts, failures = [0] * n, [0] * n, [0] * n, [""] * n
        for (i, _, _), (ok, reason) in zip(jobs, results):
            passed[i] += ok
            total[i] += 1
            timeouts[i] += reason == TIMEOUT
            failures[i] = failures[i] or reason
        rates = [p / t if t else 0.0 for p, t in zip(passed, total)]
        rewards = [0.0 if f else r for r, f in zip(rates, failures)]
        scores = [float(p == t and t > 0 and not f) for p, t, f in zip(passed, total, failures)]
        return {"rewards": rewards, "scores": scores,
                "extra_logs": {"code_pass_rate": rates, "code_has_block": [float(b) for _, b in programs],
                               "code_timeouts": [float(t) for t in timeouts], "reward_failure": failures}}

    return code_reward_func
