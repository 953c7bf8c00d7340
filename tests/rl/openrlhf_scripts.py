"""Reading the OpenRLHF launch-script fixtures (tests/fixtures/openrlhf_scripts): shared by tests/config/test_dialect.py
and tests/e2e/test_openrlhf_scripts.py (pytest puts tests/rl on the path, see pyproject.toml)."""

from __future__ import annotations

import codecs
import importlib
import re
import shlex
from pathlib import Path
from string import Template

from rlhfkit.config import dialect

SCRIPTS = Path(__file__).resolve().parents[1] / "fixtures" / "openrlhf_scripts"


def groups(command: str) -> list[type]:
    """The option groups of `rlhfkit command`."""
    return importlib.import_module(f"rlhfkit.cli.{command.replace('-', '_')}").GROUPS


def script_argv(name: str, **paths: str) -> tuple[str, list[str]]:
    """(rlhfkit command, argv) of a fixture script, its `$NAME` placeholders filled in from `paths` and bash's
    $'...' strings decoded."""
    text = (SCRIPTS / name).read_text().replace("\\\n", " ")
    text = re.sub(r"\$'((?:[^'\\]|\\.)*)'", lambda m: shlex.quote(codecs.decode(m.group(1), "unicode_escape")), text)
    words = shlex.split(Template(text).safe_substitute(paths))
    command = dialect.OPENRLHF_CLIS[words[0].rsplit(".", 1)[-1]]
    assert command is not None, words[0]
    return command, words[1:]
