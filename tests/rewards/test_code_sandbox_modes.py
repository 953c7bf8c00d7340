"""`builtin:code`'s sandbox modes (rewards/sandbox.py): what each stops, the --code_* flags, the manifest entry.

The namespaces tests need user namespaces (this machine has them: `unshare -Urn true` works); where they do not
work the tests say so and skip. Bubblewrap is not a mode: rlhfkit enters the namespaces itself."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from rlhfkit.config.parse import parse_config
from rlhfkit.observability.run import write_manifest
from rlhfkit.rewards.code import OUTPUT_LIMIT, Case, check_case, make_code_reward_func
from rlhfkit.rewards.sandbox import (
    SandboxLimits,
    describe_mode,
    manifest_entries,
    namespaces_available,
    resolve_mode,
    run_sandboxed,
)
from rlhfkit.rewards.sources import RewardSpec, reward_source_from_config
from rlhfkit.rl.reward_group import text_sources

NAMESPACES, WHY_NOT = namespaces_available()
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason=f"user namespaces do not work here: {WHY_NOT}")
MODES = [pytest.param("namespaces", marks=needs_namespaces), "rlimit"]
ADD = "def add(a, b):\n    return a + b\n"


def _alive(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="ignore"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.parametrize("mode", MODES)
def test_asserts_pass_only_on_the_right_plain_values(mode):
    assert check_case(ADD, Case(append="assert add(1, 2) == 3\nassert add(5, 5) == 10"), sandbox=mode) == (True, "")
    assert check_case(ADD, Case(append="assert add(1, 2) == 4"), sandbox=mode) == (False, "")
    eq_all = "class E:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return E()\n"
    assert check_case(eq_all, Case(append="assert add(1, 2) == 3"), sandbox=mode) == (False, "")
    # expected values bound by the test stay here; arithmetic, tolerance and containment are evaluated here
    tests = "expected = 3\nassert add(1, 2) == expected\nassert abs(add(0.1, 0.2) - 0.3) < 1e-9\n" \
            "assert add(1, 1) in {2, 4} and sorted([add(2, 2), add(0, 1)]) == [1, 4]\nassert not add(0, 0)"
    assert check_case(ADD, Case(append=tests), sandbox=mode) == (True, "")


@pytest.mark.parametrize("mode", MODES)
def test_the_setsid_grandchildren_of_a_case_die_with_it(mode):
    marker = f"rlhfkit-mode-gc-{os.getpid()}-{time.monotonic_ns()}"
    program = ("import os, sys\nfor _ in range(5):\n    if os.fork() == 0:\n        os.setsid()\n"
               "        if os.fork() == 0:\n"
               "            os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', "
               f"{marker!r}])\n        os._exit(0)\n" + ADD)
    assert check_case(program, Case(append="assert add(1, 2) == 3"), sandbox=mode) == (True, "")
    assert _alive(marker) == []


@pytest.mark.parametrize("mode", MODES)
def test_output_over_the_cap_kills_the_case(mode):
    program = "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n"
    limits = SandboxLimits(max_output_kb=256)
    assert check_case(program, Case(expected_stdout="x"), timeout=20, limits=limits, sandbox=mode) == \
        (False, OUTPUT_LIMIT)
    flood = ("import os\nfor fd in [int(f) for f in os.listdir('/proc/self/fd') if int(f) > 2]:\n"
             "    try:\n        os.write(fd, b'[' * (1 << 20))\n    except OSError:\n        pass\n" + ADD)
    passed, _ = check_case(flood, Case(append="assert add(1, 2) == 3"), timeout=20, limits=limits, sandbox=mode)
    assert not passed


@needs_namespaces
def test_namespaces_hide_the_host_and_its_network(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("labels")
    probe = (f"import os, socket\nassert not os.path.exists({str(secret)!r})\nassert os.listdir('.') == []\n"
             "assert not os.path.exists('/work') and not os.path.exists('/home')\n"
             "try:\n    socket.create_connection(('127.0.0.1', 22), timeout=1)\n    reached = True\n"
             "except OSError:\n    reached = False\nassert not reached\n"
             "assert sorted(os.listdir('/proc'))[:1] == ['1'] or not os.listdir('/proc')[0].isdigit()\n")
    assert check_case(probe, Case(), sandbox="namespaces") == (True, "")
    assert check_case(probe, Case(), sandbox="rlimit")[0] is False  # the fallback sees the host (documented)


@needs_namespaces
def test_the_process_limit_binds_a_fork_bomb_in_the_namespace():
    # bounded at 400 forks; in the namespace RLIMIT_NPROC counts this case's processes alone (as root: uid nobody)
    program = ("import os, time\nmade = 0\nfor _ in range(400):\n    try:\n        pid = os.fork()\n"
               "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n"
               "    made += 1\nprint(made)\n")
    run = run_sandboxed(program, [], capture_stdout=True, timeout=10, limits=SandboxLimits(max_procs=8),
                        mode="namespaces")
    assert run.exit_status == 0 and 0 < int(run.stdout) < 8


def test_an_unknown_mode_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--code_sandbox must be one of"):
        resolve_mode("docker")


def _limits_program(flag_value: dict[str, int]) -> str:
    """A program whose assert reads its own rlimits: it passes only under the given ones."""
    return "import resource\ndef limits():\n    return [resource.getrlimit(getattr(resource, n))[0] for n in " \
           f"{list(flag_value)!r}]\n"


@pytest.mark.parametrize("flag, value, check", [
    ("code_memory_mb", 300, "assert limits() == [300 * 2 ** 20]"),
    ("code_max_open_files", 17, "assert limits() == [17]"),
    ("code_max_file_mb", 3, "assert limits() == [3 * 2 ** 20]"),
])
def test_code_limit_flags_reach_the_sandbox(flag, value, check):
    rlimit = {"code_memory_mb": "RLIMIT_AS", "code_max_open_files": "RLIMIT_NOFILE",
              "code_max_file_mb": "RLIMIT_FSIZE"}[flag]
    response = f"```python\n{_limits_program({rlimit: 0})}```"
    cfg = parse_config("ppo", None, ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "builtin:code",
                                     f"--{flag}", str(value)])
    (ppo_source,) = text_sources(cfg)
    bi_source = reward_source_from_config(RewardSpec(remote_rm_url="builtin:code", **{flag: value}))
    for source in (ppo_source, bi_source):
        assert source(["Q" + response], ["Q"], [{"tests": [check]}]).rewards.tolist() == [1.0]


def test_code_max_procs_and_max_output_kb_flags_reach_the_sandbox():
    cfg = parse_config("ppo", None, ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "builtin:code",
                                     "--code_max_procs", "7", "--code_max_output_kb", "2"])
    (source,) = text_sources(cfg)
    nproc = "```python\nimport resource\ndef n():\n    return resource.getrlimit(resource.RLIMIT_NPROC)[0]\n```"
    out = source(["Q" + nproc], ["Q"], [{"tests": ["assert n() == 7" if resolve_mode("auto") == "namespaces"
                                                   or os.geteuid() == 0 else "assert n() > 7"]}])
    assert out.rewards.tolist() == [1.0]
    chatty = "```python\nprint('x' * 4096)\n```"
    out = source(["Q" + chatty], ["Q"], [{"inputs": [""], "outputs": ["x" * 4096]}])
    assert out.rewards.tolist() == [0.0] and out.extra_logs["reward_failure"] == ["output_limit"]


@pytest.mark.parametrize("mode", MODES)
def test_code_sandbox_flag_picks_the_mode_and_the_manifest_names_it(tmp_path, mode):
    cfg = parse_config("ppo", None, ["--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "builtin:code",
                                     "--code_sandbox", mode])
    (source,) = text_sources(cfg)
    out = source(["Q```python\n" + ADD + "```"], ["Q"], [{"tests": ["assert add(1, 2) == 3"]}])
    assert out.extra_logs["code_sandbox_namespaces"].tolist() == [float(mode == "namespaces")]
    write_manifest(tmp_path, cfg, world_size=1, torchrun=False, extra=manifest_entries(cfg))  # as rl/setup.py does
    entry = json.loads((tmp_path / "manifest.json").read_text())["code_sandbox"]
    assert entry["requested"] == mode and entry["mode"] == mode and entry == describe_mode(mode)


def test_the_reward_func_reports_the_mode_it_runs_in():
    out = make_code_reward_func(workers=1, sandbox="rlimit")(["Q```python\n" + ADD + "```"], ["Q"],
                                                              [{"tests": ["assert add(2, 2) == 4"]}])
    assert out["extra_logs"]["code_sandbox_namespaces"] == [0.0] and out["rewards"] == [1.0]
