"""Every flag a command declares is read somewhere on that command's code path, or the command refuses it.

Static, like tests/test_layering.py: the path of `rlhfkit <command>` is every rlhfkit module that
`rlhfkit.cli.<command>` imports, directly or through others (function-level imports included). A flag counts as read
when a module on that path (the flag metadata modules below left out) does one of:

- `x.flag` (an attribute read: flat configs and typed option groups alike);
- `getattr(x, "flag")`, `x.get("flag")` (the Ray workers read their config as a mapping);
- `getattr(x, f"{role}_flag")` / `x.get(f"...")`: each `{...}` stands for any text, unless it is the loop variable
  of a `for` over a module-level literal (a tuple/list/set of strings, or a dict's keys: `for k, v in D.items()`),
  which stands for those strings; an f-string with no literal part of three characters or more says nothing;
- `getattr(x, name)` with `name` such a loop variable.

A flag is also accounted for when the command refuses it (`rejection_reason`, the DeepSpeed and per-command refusal
tables of rlhfkit/config/parse.py) or its parser accepts a single value (`choices=[...]` of one: the value is what
rlhfkit does, any other is refused). Anything else is a flag the command accepts and ignores: wire it, or refuse it.

This is a necessary condition, not proof that a flag acts (a read of `.seed` on another object counts as well): the
option-effect registry (tests/config/test_option_effects.py) cites the test that proves each effect.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from rlhfkit.config.parse import build_parser, rejection_reason
from tools.gen_docs import command_flags, commands, module_name


def _layering():  # tests/test_layering.py reads the import graph; its helpers are reused, not copied
    spec = importlib.util.spec_from_file_location("_layering", Path(__file__).parents[1] / "test_layering.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_LAYERING = _layering()
MODULES: dict[str, Path] = _LAYERING.MODULES
internal_imports = _LAYERING.internal_imports

# Modules that name every flag without reading it: the dialect and the parser.
METADATA = {"rlhfkit.config.dialect", "rlhfkit.config.parse"}
MIN_LITERAL = 3


def command_path(command: str) -> set[str]:
    """The rlhfkit modules `rlhfkit <command>` can run: its cli module and everything it imports, transitively."""
    seen = {module_name(command)}
    todo = list(seen)
    while todo:
        for name in internal_imports(todo.pop()):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen - METADATA


def _literal_strings(node: ast.AST) -> list[str] | None:
    """The strings of a tuple/list/set literal, or the string keys of a dict literal; None for anything else."""
    if isinstance(node, ast.Dict):
        items = [k for k in node.keys if k is not None]
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = list(node.elts)
    else:
        return None
    if not items or not all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items):
        return None
    return [i.value for i in items]  # type: ignore[attr-defined]


def _loop_values(tree: ast.Module) -> dict[str, list[str]]:
    """Loop variable -> the strings it runs over, for `for v in CONST` / `for v, _ in CONST.items()` (or .keys())
    where CONST is a module-level literal."""
    constants: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            values = _literal_strings(node.value)
            for target in targets:
                if isinstance(target, ast.Name) and values:
                    constants[target.id] = values
    loops: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.For, ast.comprehension)):
            continue
        it = node.iter
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in ("items", "keys"):
            it = it.func.value
        target = node.target.elts[0] if isinstance(node.target, ast.Tuple) else node.target
        if isinstance(it, ast.Name) and it.id in constants and isinstance(target, ast.Name):
            loops.setdefault(target.id, []).extend(constants[it.id])
    return loops


def _name_pattern(node: ast.AST, loops: dict[str, list[str]]) -> str | None:
    """A regex for the flag name a getattr/get argument spells, or None when it says nothing."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.Name) and node.id in loops:
        return "(" + "|".join(map(re.escape, loops[node.id])) + ")"
    if not isinstance(node, ast.JoinedStr):
        return None
    parts, informative = [], False
    for value in node.values:
        if isinstance(value, ast.Constant):
            parts.append(re.escape(str(value.value)))
            informative |= len(str(value.value)) >= MIN_LITERAL
        elif isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name) \
                and value.value.id in loops:
            parts.append("(" + "|".join(map(re.escape, loops[value.value.id])) + ")")
            informative = True
        else:
            parts.append(".+")
    return "".join(parts) if informative else None


@functools.cache
def module_reads(module: str) -> tuple[frozenset[str], tuple[str, ...]]:
    """(names read as attributes or by literal getattr/get, regexes of the dynamically spelled names) of a module."""
    tree = ast.parse(Path(MODULES[module]).read_text(encoding="utf-8"))
    loops = _loop_values(tree)
    names: set[str] = set()
    patterns: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            names.add(node.attr)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) >= 2:
                arg = node.args[1]
            elif isinstance(func, ast.Attribute) and func.attr == "get":
                arg = node.args[0]
            else:
                continue
            pattern = _name_pattern(arg, loops)
            if pattern is not None:
                patterns.add(pattern)
    return frozenset(names), tuple(sorted(patterns))


def _pinned(command: str) -> set[str]:
    """Flags whose parser accepts exactly one value."""
    module = importlib.import_module(module_name(command))
    groups = getattr(module, "GROUPS", None)
    parser = build_parser(command, list(groups)) if groups else module.build_parser()
    return {a.dest for a in parser._actions if a.choices is not None and len(list(a.choices)) == 1}


def unread_flags(command: str) -> list[str]:
    names: set[str] = set()
    patterns: list[str] = []
    for module in command_path(command):
        n, p = module_reads(module)
        names |= n
        patterns += p
    regex = re.compile("|".join(f"(?:{p})" for p in patterns) or "(?!)")
    pinned = _pinned(command)
    return [flag for flag in command_flags(command)
            if flag not in names and not regex.fullmatch(flag) and flag not in pinned
            and rejection_reason(flag, command) is None]


def test_the_rule_on_examples(tmp_path, monkeypatch):
    source = ('ROLES = ("actor", "critic")\nSHARED = {"adam_eps": 1, "l2": 2}\n'
              'def f(cfg, role):\n'
              '    a = cfg.alpha\n'
              '    b = getattr(cfg, "beta") + cfg.get("gamma")\n'
              '    c = getattr(cfg, f"{role}_num_nodes")\n'
              '    d = getattr(cfg, f"{role}_{x}")\n'
              '    for shared, _ in SHARED.items():\n'
              '        getattr(cfg, shared)\n'
              '        getattr(cfg, f"{role}_{shared}")\n'
              '    cfg.delta = 1\n')
    path = tmp_path / "m.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, "rlhfkit.fake_m", path)
    module_reads.cache_clear()
    names, patterns = module_reads("rlhfkit.fake_m")
    regex = re.compile("|".join(f"(?:{p})" for p in patterns))
    assert {"alpha"} <= names and "delta" not in names          # an assignment is not a read
    for read in ("beta", "gamma", "actor_num_nodes", "adam_eps", "l2", "critic_l2"):
        assert regex.fullmatch(read), read
    for unread in ("delta", "epsilon", "actor_learning_rate"):   # f"{role}_{x}" alone says nothing
        assert not regex.fullmatch(unread), unread
    module_reads.cache_clear()


@pytest.mark.parametrize("command", sorted(commands()))
def test_every_flag_is_read_on_its_commands_path_or_refused(command):
    unread = unread_flags(command)
    assert not unread, (f"rlhfkit {command} declares flags that no module on its path reads: "
                        f"{', '.join('--' + f for f in unread)}; wire each one to what it should change, or refuse "
                        f"it with a reason (COMMAND_REJECTED_FLAGS in rlhfkit/config/parse.py)")
