"""The sandbox `builtin:code` runs programs in: one process tree per test case, limited, isolated where the OS
allows, and killed whole when the case ends.

Modes (``--code_sandbox``; ``auto`` picks the strongest that works here, found once per process by running a probe):

* ``namespaces``: new user, mount, network, pid, IPC and UTS namespaces entered with ``unshare(2)`` by our own
  child code (rewards/sandbox_child.py; no bubblewrap or setuid helper needed, only unprivileged user namespaces,
  or root): the program sees a fresh read-only root with /usr, the Python installation, /dev/null|zero|random|
  urandom, a private /proc and an empty size-capped writable /tmp (its working directory), no network but a
  loopback that is down, and no process outside its pid namespace; it runs without capabilities (as an
  unprivileged uid when the reward process is root). When the case ends its pid 1 is killed, and with it every
  process of the namespace.
* ``rlimit``: the fallback: the same limits and process-tree kill, in an empty temporary working directory, but the
  program can read and write whatever the training user can and reach the network.

Both modes set, in the program process, ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_CPU`` (the timeout, rounded up, +1),
``RLIMIT_FSIZE`` (``max_file_mb``), ``RLIMIT_NOFILE`` (``max_open_files``), ``RLIMIT_CORE`` 0 and ``RLIMIT_NPROC``
(``max_procs``). The kernel counts ``RLIMIT_NPROC`` per user, and never applies it to root: in ``namespaces`` mode
it counts the processes of the program's uid in its own user namespace (Linux >= 5.14), so it bounds this case
alone (as root the program runs as an unprivileged uid for this); in ``rlimit`` mode it is set to the user's task
count at the start plus ``max_procs`` (racy with the user's other processes) and does nothing under root, where
only the timeout and the kill bound a fork bomb. Output is read at most ``max_output_kb`` KiB a stream; a program
that writes more is killed (failure ``output_limit``).

The parent (this module) starts the supervisor in a new session, reads the result pipe and the program's stdout
until the supervisor reports the program's exit (or the timeout or an output cap), then SIGKILLs every descendant
of the supervisor it can find in /proc (orphans come back to the supervisor, a child subreaper, even after
``setsid``), the process group, and the supervisor last.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SANDBOX_MODES = ("auto", "namespaces", "rlimit")
TIMEOUT, OUTPUT_LIMIT, SANDBOX_ERROR = "timeout", "output_limit", "sandbox_error"
_CHILD_SOURCE = (Path(__file__).with_name("sandbox_child.py")).read_text()
_READ_CHUNK = 65536


@dataclass(frozen=True)
class SandboxLimits:
    """Per-case limits (each a ``--code_*`` flag)."""

    memory_mb: int = 512        # RLIMIT_AS
    max_procs: int = 32         # RLIMIT_NPROC (see the module docstring for what it counts)
    max_open_files: int = 64    # RLIMIT_NOFILE
    max_file_mb: int = 16       # RLIMIT_FSIZE; also the size of each tmpfs of the namespaces mode
    max_output_kb: int = 1024   # bytes read of stdout and of the result pipe, each


@dataclass
class SandboxRun:
    """What one case's process tree produced: the program's stdout (when captured), the messages of the result
    pipe, the program's exit status (None: it never reported one) and a failure reason (``""``, ``timeout``,
    ``output_limit``, ``sandbox_error``)."""

    stdout: bytes = b""
    messages: list[dict[str, Any]] = field(default_factory=list)
    exit_status: int | None = None
    failure: str = ""


def _python() -> str:
    return os.path.realpath(sys.executable)


def _readonly_dirs() -> list[str]:
    """What a namespaced program sees of the host, read-only: the system's binaries and libraries and Python."""
    dirs = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/alternatives"]
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == d or prefix.startswith(d + "/") for d in dirs):
        dirs.append(prefix)
    return [d for d in dirs if os.path.lexists(d)]


def _proc_files(name: str) -> Iterator[tuple[int, str]]:
    """(pid, text of /proc/<pid>/<name>) of every process whose file can still be read (others come and go)."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                yield int(entry.name), Path(entry.path, name).read_text()
            except OSError:
                continue


def _user_tasks() -> int:
    """Tasks (threads count: the kernel's RLIMIT_NPROC counts them) of this process's real uid."""
    uid, count = os.getuid(), 0
    for _, status in _proc_files("status"):
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1").strip())
    return count


def _rlimits(limits: SandboxLimits, mode: str, timeout: float) -> dict[str, int]:
    as_root = os.geteuid() == 0
    if mode == "namespaces":  # counted in the namespace: the program's uid alone (root: + init and its parent)
        nproc = limits.max_procs + (0 if as_root else 2)
    else:
        nproc = limits.max_procs + (0 if as_root else _user_tasks())
    return {"RLIMIT_AS": limits.memory_mb << 20, "RLIMIT_CPU": int(timeout) + 2,
            "RLIMIT_FSIZE": limits.max_file_mb << 20, "RLIMIT_NOFILE": limits.max_open_files, "RLIMIT_CORE": 0,
            "RLIMIT_NPROC": nproc}


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (from /proc's parent links), deepest last."""
    children: dict[int, list[int]] = {}
    for pid, stat in _proc_files("stat"):
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the supervisor's descendants (again while new ones appear), its process group, then itself."""
    for _ in range(20):
        below = _descendants(proc.pid)
        if not below:
            break
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.005)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.kill()
    proc.wait()


def _collect(proc: subprocess.Popen, result_fd: int, stdout_fd: int | None, deadline: float,
             cap: int) -> SandboxRun:
    """Read the result pipe (and stdout) until ``done``, the deadline or a cap."""
    run = SandboxRun()
    buffers = {result_fd: bytearray(), **({stdout_fd: bytearray()} if stdout_fd is not None else {})}
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                run.failure = TIMEOUT
                break
            for key, _ in selector.select(left):
                chunk = os.read(key.fd, _READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffers[key.fd] += chunk
                if len(buffers[key.fd]) > cap:
                    run.failure = OUTPUT_LIMIT
                    break
            if run.failure:
                break
            if b'"done"' in buffers[result_fd]:
                run.messages = _messages(bytes(buffers[result_fd]))
                if any("done" in m for m in run.messages):
                    if stdout_fd is not None:  # the program has exited: what it wrote is in the pipe
                        try:
                            while chunk := os.read(stdout_fd, _READ_CHUNK):
                                buffers[stdout_fd] += chunk
                                if len(buffers[stdout_fd]) > cap:
                                    run.failure = OUTPUT_LIMIT
                                    break
                        except BlockingIOError:
                            pass
                    break
    run.messages = _messages(bytes(buffers[result_fd]))
    run.stdout = bytes(buffers[stdout_fd]) if stdout_fd is not None else b""
    done = [m["done"] for m in run.messages if "done" in m and type(m["done"]) is int]
    run.exit_status = done[0] if done else None
    if not run.failure and any("sandbox" in m for m in run.messages):
        run.failure = SANDBOX_ERROR
    return run


def _messages(data: bytes) -> list[dict[str, Any]]:
    """The result pipe's JSON lines that are objects; anything else (a program writing junk) is dropped."""
    out = []
    for line in data.split(b"\n"):
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):  # junk, or nesting deep enough to exhaust the decoder's stack
            continue
        if isinstance(message, dict):
            out.append(message)
    return out


def _spawn_and_collect(plan: dict[str, Any], *, stdin: Any, capture_stdout: bool, cwd: str | None, timeout: float,
                       max_output_bytes: int, capture_stderr: bool = False) -> tuple[SandboxRun, str]:
    """Start rewards/sandbox_child.py on ``plan`` (handed over in a file, results back through a pipe) in a new
    session, collect its messages until the deadline, kill its whole tree. Returns the run and, with
    ``capture_stderr`` (the probe only: a program's own stderr could fill the pipe), the child's stderr, where a
    sandbox set-up failure prints before any program runs."""
    result_r, result_w = os.pipe()
    try:
        with tempfile.TemporaryFile(dir=cwd) as plan_file:
            plan_file.write(json.dumps(plan).encode())
            plan_file.seek(0)
            proc = subprocess.Popen([_python(), "-I", "-S", "-c", _CHILD_SOURCE, str(plan_file.fileno()),
                                     str(result_w)], stdin=stdin,
                                    stdout=subprocess.PIPE if capture_stdout else subprocess.DEVNULL,
                                    stderr=subprocess.PIPE if capture_stderr else subprocess.DEVNULL, cwd=cwd, env={},
                                    start_new_session=True,
                                    pass_fds=(plan_file.fileno(), result_w))
            os.close(result_w)
            result_w = -1
            try:
                run = _collect(proc, result_r, proc.stdout.fileno() if proc.stdout else None,
                               time.monotonic() + timeout, max_output_bytes)
            finally:
                kill_tree(proc)
                stderr = proc.stderr.read(1 << 16).decode(errors="replace").strip() if proc.stderr else ""
                for stream in (proc.stdout, proc.stderr):
                    if stream:
                        stream.close()
            return run, stderr
    finally:
        os.close(result_r)
        if result_w >= 0:
            os.close(result_w)


def run_sandboxed(program: str, steps: list[dict[str, str]], *, stdin: str = "", capture_stdout: bool = False,
                  timeout: float = 5.0, limits: SandboxLimits = SandboxLimits(), mode: str = "auto") -> SandboxRun:
    """Run ``program`` then ``steps`` (see rewards/sandbox_child.py) in one sandboxed process tree, kill the tree."""
    mode = resolve_mode(mode)
    plan = {"program": program, "steps": steps, "mode": mode, "limits": _rlimits(limits, mode, timeout),
            "as_root_outside": os.geteuid() == 0, "ro_dirs": _readonly_dirs(),
            "tmpfs_bytes": limits.max_file_mb << 20}
    with tempfile.TemporaryDirectory(prefix="rlhfkit_code_") as workdir, \
            tempfile.TemporaryFile(dir=workdir) as stdin_file:
        stdin_file.write(stdin.encode("utf-8", "surrogateescape"))
        stdin_file.seek(0)
        run, _ = _spawn_and_collect(plan, stdin=stdin_file, capture_stdout=capture_stdout, cwd=workdir,
                                    timeout=timeout, max_output_bytes=limits.max_output_kb << 10)
        return run


def resolve_mode(mode: str) -> str:
    """``auto`` -> the strongest mode that works here; a named mode must work (ValueError naming the flag)."""
    if mode not in SANDBOX_MODES:
        raise ValueError(f"--code_sandbox must be one of {SANDBOX_MODES}, got {mode!r}")
    if mode == "rlimit":
        return mode
    works, reason = namespaces_available()
    if works:
        return "namespaces"
    if mode == "namespaces":
        raise ValueError(f"--code_sandbox namespaces: user namespaces do not work here ({reason}); use "
                         "--code_sandbox rlimit (no filesystem or network isolation) or run where they do")
    return "rlimit"


@functools.lru_cache(maxsize=1)
def namespaces_available() -> tuple[bool, str]:
    """(whether the namespaces mode works here, why not): a probe program must run and see itself isolated."""
    here = os.path.realpath(__file__)
    probe = f"import os\nassert os.listdir('/tmp') == [] and not os.path.exists({here!r})\n"
    plan = {"program": probe, "steps": [], "mode": "namespaces", "limits": {}, "ro_dirs": _readonly_dirs(),
            "as_root_outside": os.geteuid() == 0, "tmpfs_bytes": 1 << 20}
    run, stderr = _spawn_and_collect(plan, stdin=subprocess.DEVNULL, capture_stdout=False, cwd=None, timeout=30.0,
                                     max_output_bytes=1 << 20, capture_stderr=True)
    if run.exit_status == 0 and {"program": "ok"} in run.messages:
        return True, ""
    why = [str(m["sandbox"]) for m in run.messages if "sandbox" in m] + stderr.splitlines()[-1:]
    return False, "; ".join(why) or f"the probe failed ({run.failure or run.exit_status})"


def describe_mode(mode: str = "auto") -> dict[str, Any]:
    """The sandbox mode ``mode`` resolves to here and why (for the run manifest and the log)."""
    works, reason = namespaces_available()
    resolved = "rlimit" if mode == "rlimit" or not works else "namespaces"
    return {"requested": mode, "mode": resolved, "namespaces_available": works,
            **({"namespaces_unavailable_because": reason} if not works else {})}


def manifest_entries(cfg: Any) -> dict[str, Any]:
    """The run manifest's `code_sandbox` entry (`describe_mode` of --code_sandbox) when a reward flag of `cfg` names
    builtin:code, else nothing."""
    specs = f"{getattr(cfg, 'reward_pretrain', None) or ''},{getattr(cfg, 'remote_rm_url', None) or ''}"
    if "builtin:code" not in specs:
        return {}
    return {"code_sandbox": describe_mode(str(getattr(cfg, "code_sandbox", "auto")))}
