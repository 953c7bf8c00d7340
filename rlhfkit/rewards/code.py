"""`builtin:code`: run the response's Python program against the label's tests in a sandbox (rewards/sandbox.py).

The program is the last ```` ```python ```` (or plain ```` ``` ````) fenced block of the response, else the whole
response. The label (a dict, or a JSON string of one) says how to test it:

* ``{"tests": ["assert add(1, 2) == 3", ...]}`` (or a single string): each test is one case, run after the program
  in its own sandbox. The assert's expected values stay in the reward process: the sandbox evaluates only the
  operands the program must compute (``add(1, 2)``) and sends their values back as plain data over a pipe of its
  own; the comparison happens here (rewards/code_asserts.py). A case passes when the program ran to its end, every
  setup statement of the test ran and every assert holds on those values; printing, exiting early or hooks the
  program installs give it nothing to forge;
* ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``: stdin/stdout cases; a case passes when the program
  exits 0 and its stdout equals the expected output (trailing whitespace of each line and trailing blank lines
  ignored).

Reward = the fraction of cases that pass; score = 1.0 when all pass, else 0.0 (pass@k counts whole solutions).
``extra_logs``: ``code_pass_rate``, ``code_has_block`` (a fenced block was found), ``code_timeouts``,
``code_sandbox_namespaces`` (1.0 where the cases ran in the namespaces sandbox), ``reward_failure``.

Failures that belong to one sample cost that sample alone (reward and score 0, the reason in
``extra_logs["reward_failure"]``, counted by the online loop in ``reward/failed_<reason>``): a case that runs past
``timeout`` seconds (``timeout``; the limit is per program run, so a slow sample never holds up the batch beyond its
own cases), one whose stdout or result values exceed ``--code_max_output_kb`` (``output_limit``), a case whose
stdout is not UTF-8 (``undecodable_output``) and a sandbox that could not be set up (``sandbox_error``). A sample's
first such reason is given. Limits and isolation: rewards/sandbox.py and docs/rewards.md (what each
``--code_sandbox`` mode stops and what it does not). Cases of a batch run concurrently (``workers``, default the
CPU count).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlhfkit.rewards.base import response_of
from rlhfkit.rewards.code_asserts import check_passes, leaf_values, plan_asserts
from rlhfkit.rewards.sandbox import (
    OUTPUT_LIMIT,
    SANDBOX_ERROR,
    TIMEOUT,
    SandboxLimits,
    describe_mode,
    resolve_mode,
    run_sandboxed,
)

logger = logging.getLogger(__name__)

FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
UNDECODABLE = "undecodable_output"  # per-sample failure reasons (extra_logs["reward_failure"]), with sandbox.py's
__all__ = ["OUTPUT_LIMIT", "SANDBOX_ERROR", "TIMEOUT", "UNDECODABLE", "Case", "check_case", "extract_program",
           "make_code_reward_func", "parse_cases", "run_case"]


@dataclass(frozen=True)
class Case:
    """One test: assert statements run after the program, or stdin with the expected stdout."""

    append: str = ""
    stdin: str = ""
    expected_stdout: str | None = None


def extract_program(response: str) -> tuple[str, bool]:
    """(program, whether it came from a fenced block): the last fenced block, else the whole response."""
    blocks = FENCE.findall(response)
    return (blocks[-1], True) if blocks else (response, False)


def parse_cases(label: Any, index: int) -> list[Case]:
    """The test cases of one label; ValueError naming the sample (and test) for anything else."""
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
        for number, test in enumerate(tests):
            plan_asserts([str(test)], f"builtin:code: sample {index}, label 'tests'[{number}]")
        return [Case(append=str(t)) for t in tests]
    inputs, outputs = label.get("inputs"), label.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise ValueError(f"builtin:code: sample {index}: the label needs 'tests', or 'inputs' and 'outputs' lists of "
                         f"the same length (keys: {sorted(label)})")
    return [Case(stdin=str(i), expected_stdout=str(o)) for i, o in zip(inputs, outputs)]


def _normalize_output(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


def check_case(program: str, case: Case, *, timeout: float = 5.0, memory_mb: int | None = None,
               limits: SandboxLimits | None = None, sandbox: str = "auto") -> tuple[bool, str]:
    """(passed, failure reason) of one case in a fresh sandbox (rewards/sandbox.py, mode ``sandbox``); the reason is
    ``""``, ``"timeout"``, ``"output_limit"``, ``"undecodable_output"`` or ``"sandbox_error"``. ``memory_mb``
    overrides ``limits.memory_mb``."""
    limits = limits or SandboxLimits()
    if memory_mb is not None:
        limits = SandboxLimits(**{**limits.__dict__, "memory_mb": memory_mb})
    plan = plan_asserts([case.append], "builtin:code") if case.append else None
    run = run_sandboxed(program, plan.steps if plan else [], stdin=case.stdin,
                        capture_stdout=case.expected_stdout is not None, timeout=timeout, limits=limits,
                        mode=sandbox)
    if run.failure:
        return False, run.failure
    if case.expected_stdout is not None:
        try:
            stdout = run.stdout.decode("utf-8")
        except UnicodeDecodeError:
            return False, UNDECODABLE
        return run.exit_status == 0 and _normalize_output(stdout) == _normalize_output(case.expected_stdout), ""
    if plan is None:
        return run.exit_status == 0 and {"program": "ok"} in run.messages, ""
    leaves, ran = leaf_values(plan, run.messages)
    return ran and all(check_passes(check, leaves, plan.bindings) for check in plan.checks), ""


def run_case(program: str, case: Case, *, timeout: float = 5.0, memory_mb: int | None = None,
             limits: SandboxLimits | None = None, sandbox: str = "auto") -> tuple[bool, bool]:
    """(passed, timed out) of one case (:func:`check_case`)."""
    passed, reason = check_case(program, case, timeout=timeout, memory_mb=memory_mb, limits=limits, sandbox=sandbox)
    return passed, reason == TIMEOUT


def make_code_reward_func(timeout: float = 5.0, memory_mb: int | None = None, workers: int | None = None,
                          limits: SandboxLimits | None = None,
                          sandbox: str = "auto") -> Callable[..., dict[str, Any]]:
    """The `builtin:code` reward_func (see the module docstring); ``timeout``: seconds per program run (case);
    ``limits`` / ``sandbox``: the ``--code_*`` flags (rewards/sandbox.py). The sandbox mode is resolved (and
    logged) here, so an unavailable ``sandbox="namespaces"`` fails at start, not at the first batch."""
    mode = resolve_mode(sandbox)
    logger.info("builtin:code sandbox: %s", describe_mode(sandbox))
    limits = limits or SandboxLimits()
    if memory_mb is not None:
        limits = SandboxLimits(**{**limits.__dict__, "memory_mb": memory_mb})

    def code_reward_func(queries: list[str], prompts: list[str], labels: list[Any]) -> dict[str, Any]:
        if labels is None or any(label is None for label in labels):
            raise ValueError("builtin:code needs a label with the tests of every sample (set --label_key)")
        programs = [extract_program(response_of(q, p)) for q, p in zip(queries, prompts)]
        jobs = [(i, program, case) for i, ((program, _), label) in enumerate(zip(programs, labels))
                for case in parse_cases(label, i)]
        with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
            results = list(pool.map(lambda job: check_case(job[1], job[2], timeout=timeout, limits=limits,
                                                           sandbox=mode), jobs))
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
                               "code_timeouts": [float(t) for t in timeouts],
                               "code_sandbox_namespaces": [float(mode == "namespaces")] * n,
                               "reward_failure": failures}}

    return code_reward_func
