"""Every launch script in examples/ stays runnable: its `rlhfkit CMD` flags parse, the files it names exist."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from rlhfkit.config.parse import parse_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "examples").glob("*.sh"))


def commands_of(script: Path) -> list[tuple[str, list[str]]]:
    """Every `.venv/bin/rlhfkit CMD ...` invocation of a script, continuation lines joined; shell variables become
    "1" (a number fits every flag they fill)."""
    text = script.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(".venv/bin/rlhfkit "):
            tokens = shlex.split(re.sub(r"\$\{?\w+\}?", "1", line.replace('"$@"', "")))
            out.append((tokens[1], tokens[2:]))
    assert out, f"{script.name} runs no rlhfkit command"
    return out


def test_there_is_a_launch_script_per_online_and_offline_method():
    commands = {cmd for s in SCRIPTS for cmd, _ in commands_of(s)}
    assert {"ppo", "rm", "dpo", "kto", "kd", "prm", "sft", "batch-inference"} <= commands
    assert any("--agent_func_path" in argv for s in SCRIPTS for _, argv in commands_of(s))
    assert any("iter_dpo" in argv for s in SCRIPTS for _, argv in commands_of(s))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launch_script_flags_parse_and_name_existing_files(script):
    for command, argv in commands_of(script):
        module = importlib.import_module(f"rlhfkit.cli.{command.replace('-', '_')}")
        cfg = parse_config(command, module.GROUPS, argv)
        for value in vars(cfg).values():
            if isinstance(value, str) and re.match(r"^examples/", value):
                assert (ROOT / value).is_file(), f"{script.name} names {value}, which does not exist"
