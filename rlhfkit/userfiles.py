"""Importing a user's Python file by path (`--agent_func_path`, `--remote_rm_url` / `--reward_pretrain` files).

One importer for every place that loads user code, so each failure reads the same and names the file: a missing
file, a syntax error (with its line), an exception raised while importing (with the file's line it came from), or a
file that defines none of the names it must. A leaf below every package but `rlhfkit.errors`
(tests/test_layering.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from pathlib import Path
from types import ModuleType

from rlhfkit.errors import ConfigError


def module_name(path: str | Path) -> str:
    """The name a user file is imported under: the same for the same file in every process."""
    resolved = str(Path(path).expanduser().resolve())
    return "rlhfkit_user_" + hashlib.sha1(resolved.encode()).hexdigest()[:12]


def import_user_file(path: str | Path, label: str, needs: str | tuple[str, ...] = (), shape: str = "", *,
                     error: type[Exception] = ConfigError, keep: bool = True) -> ModuleType:
    """Import `path` as a fresh module and return it; `error` (message `"{label} {path}: ..."`) when it cannot.

    `label` names where the path came from (a flag such as `--agent_func_path`); `needs`: names of which the file
    must define at least one callable; `shape`: what such a file looks like, added to the missing-file and
    missing-name messages. With `keep` the module stays in `sys.modules` (pickling and dataclasses in the file
    resolve it, tests read it there); without, whatever was there before is put back (a check-only import).
    """
    file = Path(path).expanduser()
    where = f"{label} {path}"
    hint = f" ({shape})" if shape else ""
    if not file.is_file():
        raise error(f"{where}: no such file{hint}")
    name = module_name(file)
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise error(f"{where}: cannot be imported as a Python file (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    before = sys.modules.get(name)
    sys.modules[name] = module  # during the import too: the file's dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except SyntaxError as err:
        _restore(name, before)
        line = (err.text or "").strip()
        raise error(f"{where}: syntax error at line {err.lineno}: {err.msg}"
                    + (f"\n    {line}" if line else "")) from err
    except Exception as err:
        _restore(name, before)
        raise error(f"{where}: importing it raised {type(err).__name__}: {err}{_line_in(file, err)}") from err
    names = (needs,) if isinstance(needs, str) else needs
    missing = names and not any(callable(getattr(module, n, None)) for n in names)
    if missing or not keep:
        _restore(name, before)
    if missing:
        raise error(f"{where}: defines no {' and no '.join(names)}{hint}")
    return module


def _restore(name: str, before: ModuleType | None) -> None:
    if before is None:
        sys.modules.pop(name, None)
    else:
        sys.modules[name] = before


def _line_in(file: Path, err: BaseException) -> str:
    """` at line N` and the line's code, for the innermost frame of the traceback that is in `file`."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if Path(f.filename).resolve() == file.resolve()]
    if not frames:
        return ""
    return f" at line {frames[-1].lineno}" + (f"\n    {frames[-1].line}" if frames[-1].line else "")
