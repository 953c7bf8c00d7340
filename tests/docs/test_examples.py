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


def command_of(script: Path) -> tuple[str, list[str]]:
    """The `.venv/bin/rlhfkit CMD ...` invocation of a script, continuation lines joined, shell variables filled."""
    text = script.read_text().replace("\\\n", " ")
    [line] = [ln for ln in text.splitlines() if ln.startswith(".venv/bin/rlhfkit ")]
    line = line.replace('"$@"', "").replace('"$RUN', '"runs/x').replace('"$MODEL"', "tiny-model")
    tokens = shlex.split(line)
    return tokens[1], tokens[2:]


def test_there_is_a_launch_script_per_online_and_offline_method():
    commands = {command_of(s)[0] for s in SCRIPTS}
    assert {"ppo", "rm", "dpo", "kto", "kd", "prm"} <= commands
    assert any("--agent_func_path" in command_of(s)[1] for s in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launch_script_flags_parse_and_name_existing_files(script):
    command, argv = command_of(script)
    module = importlib.import_module(f"rlhfkit.cli.{command}")
    cfg = parse_config(command, module.GROUPS, argv)
    for value in vars(cfg).values():
        if isinstance(value, str) and re.match(r"^examples/", value):
            assert (ROOT / value).is_file(), f"{script.name} names {value}, which does not exist"
