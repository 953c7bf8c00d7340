"""rlhfkit.userfiles.import_user_file: the one importer of users' Python files (agent, reward files); every failure
names the file and what to do. Its callers' own messages: tests/agents/test_environment.py, tests/rl/test_preflight.py,
tests/rewards/test_reward_func.py."""

from __future__ import annotations

import sys

import pytest

from rlhfkit.errors import ConfigError, RewardFuncError
from rlhfkit.userfiles import import_user_file, module_name


def write(tmp_path, text: str, name: str = "user.py"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_imports_the_file_and_keeps_it_registered_under_a_stable_name(tmp_path):
    path = write(tmp_path, "from dataclasses import dataclass\n\n@dataclass\nclass Row:\n    x: int\n\n"
                           "def f():\n    return Row(3)\n")
    module = import_user_file(path, "--flag", "f")
    assert module.f().x == 3  # a dataclass in the file resolves its module through sys.modules
    assert sys.modules[module_name(path)] is module and module.__name__ == module_name(path)
    assert module_name(str(path)) == module_name(tmp_path / "." / "user.py")  # the resolved path names it


def test_a_check_only_import_puts_back_what_was_registered(tmp_path):
    path = write(tmp_path, "def f():\n    return 1\n")
    kept = import_user_file(path, "--flag", "f")
    checked = import_user_file(path, "--flag", "f", keep=False)
    assert checked is not kept and sys.modules[module_name(path)] is kept
    other = write(tmp_path, "def f():\n    return 2\n", "other.py")
    import_user_file(other, "--flag", "f", keep=False)
    assert module_name(other) not in sys.modules


@pytest.mark.parametrize("text, message", [
    (None, r"--flag {path}: no such file \(SHAPE\)$"),
    ("def f(:\n    pass\n", r"--flag {path}: syntax error at line 1: .*\n    def f\(:$"),
    ("import json\n\nTABLE = json.loads('{oops')\n",
     r"--flag {path}: importing it raised JSONDecodeError: .* at line 3\n    TABLE = json.loads"),
    ("def g():\n    pass\nh = 1\n", r"--flag {path}: defines no f and no h \(SHAPE\)$"),
])
def test_failures_name_the_file_and_the_line(tmp_path, text, message):
    path = tmp_path / "user.py"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=message.format(path=path)):
        import_user_file(path, "--flag", ("f", "h"), "SHAPE")
    assert module_name(path) not in sys.modules  # a failed import leaves nothing behind


def test_the_caller_picks_the_error_type_and_keeps_the_cause(tmp_path):
    path = write(tmp_path, "import not_a_module_xyz\n")
    with pytest.raises(RewardFuncError, match="reward function file .*user.py: importing it raised "
                                              "ModuleNotFoundError") as info:
        import_user_file(path, "reward function file", error=RewardFuncError)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)
