"""`builtin:code` attacks found from outside (#29): each must score 0 or be contained.

Written against the public reward API (`make_code_reward_func`, `run_case`) in its default (`auto`) sandbox mode, so
they also run against the code before the sandbox; the mode-specific checks are in test_code_sandbox_modes.py.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from rlhfkit.rewards.code import Case, make_code_reward_func, run_case

TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(5, 5) == 10"]}


def _score(program: str, tests: dict = TESTS, **kwargs) -> tuple[float, float]:
    out = make_code_reward_func(timeout=kwargs.pop("timeout", 5.0), workers=2, **kwargs)(
        ["Q" + f"```python\n{program}\n```"], ["Q"], [tests])
    return out["rewards"][0], out["scores"][0]


def test_the_honest_solution_still_scores_full_marks():
    assert _score("def add(a, b):\n    return a + b") == (1.0, 1.0)


def test_an_object_equal_to_everything_scores_zero():
    program = ("class Anything:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
               "def add(a, b):\n    return Anything()")
    assert _score(program) == (0.0, 0.0)


def test_a_subclass_of_int_equal_to_everything_scores_zero():
    program = "class Int(int):\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Int(0)"
    assert _score(program) == (0.0, 0.0)


def test_the_token_read_from_code_constants_and_printed_from_an_excepthook_scores_zero():
    program = (
        "import os, sys\n"
        "def _hook(*args):\n"
        "    frame = sys._getframe()\n"
        "    while frame.f_back: frame = frame.f_back\n"
        "    for c in frame.f_code.co_consts:\n"
        "        if isinstance(c, str): sys.stdout.write('\\n' + c.strip() + '\\n')\n"
        "    sys.stdout.flush(); os._exit(0)\n"
        "sys.excepthook = _hook\n"
        "for c in sys._getframe().f_code.co_consts:\n"
        "    if isinstance(c, str): print(c.strip())\n"
        "def add(a, b):\n    return 0\n")
    assert _score(program) == (0.0, 0.0)


def test_the_token_read_from_proc_self_cmdline_scores_zero():
    program = ("import os, re, sys\n"
               "text = open('/proc/self/cmdline', 'rb').read().decode(errors='ignore')\n"
               r"found = re.findall(r'[0-9a-f]{32}', text)" "\n"
               "sys.stdout.write('\\n' + (found[-1] if found else '') + '\\n')\n"
               "sys.stdout.flush()\nos._exit(0)\n")
    assert _score(program) == (0.0, 0.0)


def test_the_token_printed_from_an_atexit_handler_scores_zero():
    program = ("import atexit, os, sys\n"
               "_consts = [c.strip() for c in sys._getframe().f_code.co_consts\n"
               "           if isinstance(c, str) and len(c.strip()) == 32]\n"
               "def _late():\n"
               "    sys.stdout.write('\\n' + (_consts[-1] if _consts else '') + '\\n')\n"
               "    sys.stdout.flush()\n"
               "    os._exit(0)\n"
               "atexit.register(_late)\n"
               "def add(a, b):\n    return 0\n")
    assert _score(program) == (0.0, 0.0)


def test_a_program_that_reads_the_expected_values_from_its_tests_scores_zero():
    # the lookup-table attack: answer from the assert's own text, found in argv, the code objects or the frame
    program = ("import sys, re\n"
               "def add(a, b):\n"
               "    text = open('/proc/self/cmdline').read()\n"
               "    frame = sys._getframe(1)\n"
               "    consts = [c for c in frame.f_code.co_consts if isinstance(c, int)]\n"
               "    m = re.search(r'add\\(%d, %d\\) == (\\d+)' % (a, b), text)\n"
               "    return int(m.group(1)) if m else (consts[-1] if consts else 0)\n")
    assert _score(program) == (0.0, 0.0)


def _marker_processes(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="ignore"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_detached_grandchild_is_killed_with_its_case(tmp_path):
    marker = f"rlhfkit-grandchild-{os.getpid()}-{time.monotonic_ns()}"
    outside = tmp_path / "escaped"
    late_write = f"import time; time.sleep(1.5); open({str(outside)!r}, 'w').write('x')"
    program = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', {late_write!r}, {marker!r}])\n"
        "    os._exit(0)\n"
        "time.sleep(0.5)\n"
        "def add(a, b):\n    return a + b\n")
    assert _score(program) == (1.0, 1.0)
    assert _marker_processes(marker) == []
    time.sleep(2.0)
    assert not outside.exists()


def test_a_bounded_fork_bomb_is_contained():
    # bounded (at most 200 forks) so that it cannot hurt the machine even where RLIMIT_NPROC does not bind (root)
    marker = f"rlhfkit-forkbomb-{os.getpid()}-{time.monotonic_ns()}"
    program = (
        "import os, sys\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()  # out of the case's process group\n"
        f"            os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}])\n"
        "    except OSError:\n"
        "        break\n"
        "def add(a, b):\n    return a + b\n")
    _score(program, timeout=10.0)
    assert _marker_processes(marker) == []


def test_gigabytes_of_output_are_cut_off():
    program = "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(4096):\n    sys.stdout.write(chunk)\n"
    passed, timed_out = run_case(program, Case(stdin="", expected_stdout="3"), timeout=10.0)
    assert (passed, timed_out) == (False, False)  # stopped at the output cap, long before the timeout


def test_a_write_outside_the_working_folder_does_not_land(tmp_path):
    outside = tmp_path / "written_by_the_program"
    program = f"open({str(outside)!r}, 'w').write('x')\ndef add(a, b):\n    return a + b\n"
    _score(program)
    assert not outside.exists()


def test_a_local_server_cannot_be_reached():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    received: list[bytes] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                received.append(conn.recv(100))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        program = (f"import socket\ntry:\n    s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                   "    s.sendall(b'leak')\n    s.close()\nexcept OSError:\n    pass\n"
                   "def add(a, b):\n    return a + b\n")
        _score(program)
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert received == []


@pytest.mark.parametrize("tests", [{"tests": ["for x in range(3):\n    assert add(x, 0) == x"]},
                                   {"tests": ["def check(f):\n    return f(1, 2) == 3", "assert check(add)"]}])
def test_comparisons_the_program_could_answer_are_refused(tests):
    with pytest.raises(ValueError, match="sample 0"):
        _score("def add(a, b):\n    return a + b", tests)
