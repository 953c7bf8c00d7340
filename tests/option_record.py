"""A pytest plugin (registered by tests/conftest.py) that records, per test, which options of which command the test
set to a non-default value, and can force chosen options back to their defaults (the revert check).

The option-effect registry (tests/option_effects.yaml) cites, for every option, tests that set it and show what
changes. `tools/check_option_claims.py` reads this record and fails an entry whose cited tests never set the option;
`tools/revert_check.py` runs an entry's cited tests with the option forced back to its default and expects them to
fail. All of it lives here, in tests/: rlhfkit's runtime code holds none of it.

What counts as "set", seen from the pytest process:

- a command config (`rlhfkit.config.commands.CONFIG_CLASSES`: what `parse_config` returns, or built directly as in
  `PPOConfig(ckpt_path=...)`, `dataclasses.replace` included) whose field differs from the class's default;
- a flag named on a command line that `parse_config` refuses (ConfigError: the refusal is the flag's effect);
- an option of an argparse command without a config class (`rlhfkit demo`, `report`, `runs`, `compare`,
  `lora-merge`: parsers whose prog is "rlhfkit <command>") whose parsed value differs from the parser's default;
- the argv of a subprocess that runs an rlhfkit command (`-m rlhfkit <command>`, `-m rlhfkit.cli.<module>`, also
  under torchrun, or the `rlhfkit` script), parsed here the same way.

Environment:
- RLHFKIT_OPTION_RECORD: the JSON file the record is merged into at the end of the session (the entries of the tests
  that ran replace their old ones); default: <pytest cache>/rlhfkit/option_record.json.
- RLHFKIT_REVERT_OPTIONS: comma-separated `command:flag` pairs forced back to the default: a config's field is reset
  after it is built, a refused flag is taken off the command line before parsing, an argparse command's value is reset
  after parsing, and a subprocess's command line loses the flag.
- RLHFKIT_REVERT_PLAN: a JSON file {node id: ["command:flag", ...]}: the same, per test.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import io
import json
import os
import subprocess
from pathlib import Path
from typing import Any

RECORD_ENV = "RLHFKIT_OPTION_RECORD"
REVERT_ENV = "RLHFKIT_REVERT_OPTIONS"
REVERT_PLAN_ENV = "RLHFKIT_REVERT_PLAN"
OWNER_ENV = "RLHFKIT_OPTION_RECORD_OWNER"  # set by the recording session for its subprocesses
RECORD_VERSION = 1


def _reverted(items: Any) -> dict[str, set[str]]:
    """command -> the flags forced back to their defaults, from `command:flag` strings."""
    out: dict[str, set[str]] = {}
    for item in filter(None, (s.strip() for s in items)):
        command, _, flag = item.rpartition(":")
        out.setdefault(command, set()).add(flag)
    return out


def _revert_plan() -> dict[str, dict[str, set[str]]]:
    """node id (without parametrisation) -> its own forced defaults: RLHFKIT_REVERT_PLAN names a JSON file
    {node id: ["command:flag", ...]} (tools/revert_check.py: one pytest session reverts a different option in each
    test)."""
    path = os.environ.get(REVERT_PLAN_ENV)
    if not path:
        return {}
    return {node: _reverted(items) for node, items in json.loads(Path(path).read_text()).items()}


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _differs(value: Any, default: Any) -> bool:
    try:
        return bool(value != default)
    except Exception:  # a value that cannot be compared (an array): count it as set
        return True


def flag_names_in_argv(argv: list[str]) -> list[str]:
    """The flags a command line names: `--a`, `--a=1`, `--no-a`, OpenRLHF's dotted `--group.a` (all give `a`)."""
    names = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name = token[2:].split("=", 1)[0].rsplit(".", 1)[-1]
            names.append(name[3:] if name.startswith("no-") else name)
    return names


def strip_flag(argv: list[str], flag: str) -> list[str]:
    """argv without `--flag` (any spelling flag_names_in_argv knows) and the values that follow it."""
    out: list[str] = []
    skipping = False
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            named = flag_names_in_argv([token]) == [flag]
            skipping = named and "=" not in token
            if not named:
                out.append(token)
        elif not skipping:
            out.append(token)
    return out


class OptionRecorder:
    """Installed for the pytest session: wraps the command configs' __init__, `parse_config`, argparse parsing and
    subprocess.Popen; `current` is the node id of the running test."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.current: str | None = None
        self.tests: dict[str, dict[str, Any]] = {}
        self.revert_everywhere = _reverted(os.environ.get(REVERT_ENV, "").split(","))
        self.plan = _revert_plan()
        self.quiet = False
        self._undo: list[tuple[Any, str, Any]] = []
        self._parse_config: Any = None

    @property
    def revert(self) -> dict[str, set[str]]:
        """What the running test forces back to the default (nothing while a subprocess's argv is parsed here)."""
        if self.quiet:
            return {}
        if self.current is not None and self.plan:
            return self.plan.get(self.current.split("[", 1)[0], {})
        return self.revert_everywhere

    # ---- bookkeeping
    def note(self, command: str, flags: Any) -> None:
        if self.current is None:
            return
        entry = self.tests.setdefault(self.current, {"set": {}, "outcome": "passed"})
        entry["set"].setdefault(command, set()).update(flags)

    def outcome(self, nodeid: str, outcome: str) -> None:
        entry = self.tests.setdefault(nodeid, {"set": {}, "outcome": "passed"})
        if entry["outcome"] == "passed" or outcome != "passed":
            entry["outcome"] = outcome

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    # ---- install / uninstall
    def install(self) -> None:
        import sys

        import rlhfkit.config.parse as parse
        from rlhfkit.config.commands import CONFIG_CLASSES

        for command, cls in CONFIG_CLASSES.items():
            self._patch(cls, "__init__", self._wrap_init(command, cls, cls.__init__))
        self._parse_config = original = parse.parse_config
        wrapped = self._wrap_parse_config(original)
        for module in list(sys.modules.values()):  # `from rlhfkit.config.parse import parse_config` copies
            if getattr(module, "__name__", "").startswith("rlhfkit") and getattr(module, "parse_config",
                                                                                 None) is original:
                self._patch(module, "parse_config", wrapped)
        self._patch(argparse.ArgumentParser, "parse_known_args",
                    self._wrap_argparse(argparse.ArgumentParser.parse_known_args))
        self._patch(subprocess.Popen, "__init__", self._wrap_popen(subprocess.Popen.__init__))

    def uninstall(self) -> None:
        while self._undo:
            owner, name, value = self._undo.pop()
            setattr(owner, name, value)

    # ---- the wrappers
    def _wrap_init(self, command: str, cls: type, init: Any) -> Any:
        recorder = self
        defaults = {f.name: _field_default(f) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            if type(self) is not cls:
                return
            for flag in recorder.revert.get(command, ()):
                if flag in defaults and defaults[flag] is not dataclasses.MISSING:
                    setattr(self, flag, copy.deepcopy(defaults[flag]))
            recorder.note(command, [name for name, default in defaults.items()
                                    if default is dataclasses.MISSING or _differs(getattr(self, name), default)])

        return __init__

    def _wrap_parse_config(self, original: Any) -> Any:
        from rlhfkit.errors import ConfigError

        recorder = self

        @functools.wraps(original)
        def parse_config(command: Any, groups: Any = None, argv: Any = None, description: str = "") -> Any:
            import sys

            name = command if isinstance(command, str) else command.command  # a name or a command class
            args = list(sys.argv[1:] if argv is None else argv)
            for flag in recorder.revert.get(name, ()):
                args = strip_flag(args, flag)
            try:
                return original(command, groups, args, description)
            except (ConfigError, SystemExit):  # a refused flag: the refusal is its effect
                recorder.note(name, flag_names_in_argv(args))
                raise

        return parse_config

    def _wrap_argparse(self, original: Any) -> Any:
        from rlhfkit.config.commands import CONFIG_CLASSES

        recorder = self

        @functools.wraps(original)
        def parse_known_args(parser: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
            ns, rest = original(parser, args, namespace)
            prog = parser.prog or ""
            command = prog[len("rlhfkit "):] if prog.startswith("rlhfkit ") else ""
            if not command or command in CONFIG_CLASSES:
                return ns, rest
            dests = {a.dest: a for a in parser._actions if a.dest not in ("help", argparse.SUPPRESS)}
            for flag in recorder.revert.get(command, ()):
                if flag in dests:
                    setattr(ns, flag, copy.deepcopy(dests[flag].default))
            recorder.note(command, [dest for dest, action in dests.items()
                                    if _differs(getattr(ns, dest, action.default), action.default)])
            return ns, rest

        return parse_known_args

    def _wrap_popen(self, original: Any) -> Any:
        recorder = self

        @functools.wraps(original)
        def __init__(popen: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
            if isinstance(args, (list, tuple)) and recorder.current is not None:
                found = rlhfkit_command(list(map(str, args)))
                if found is not None:
                    start, command = found
                    argv = list(map(str, args[start:]))
                    for flag in recorder.revert.get(command, ()):
                        argv = strip_flag(argv, flag)
                    args = [*args[:start], *argv]
                    recorder.parse_quietly(command, argv)
            original(popen, args, *rest, **kwargs)

        return __init__

    def parse_quietly(self, command: str, argv: list[str]) -> None:
        """Record what a subprocess's command line sets, by parsing it here (errors are the subprocess's to report)."""
        from rlhfkit.config.commands import CONFIG_CLASSES

        self.quiet = True  # the subprocess's argv is already stripped
        try:
            with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
                if command in CONFIG_CLASSES:
                    self._parse_config(command, None, argv)
                else:
                    import importlib

                    module = importlib.import_module(f"rlhfkit.cli.{command.replace('-', '_')}")
                    if hasattr(module, "build_parser"):
                        module.build_parser().parse_known_args(argv)
        except BaseException:  # noqa: BLE001 - a bad command line is the subprocess's error, not the record's
            pass
        finally:
            self.quiet = False

    # ---- the file
    def write(self) -> None:
        if self.path is None or not self.tests:
            return
        data: dict[str, Any] = {"version": RECORD_VERSION, "tests": {}}
        if self.path.is_file():
            with contextlib.suppress(ValueError, OSError):
                old = json.loads(self.path.read_text())
                if old.get("version") == RECORD_VERSION:
                    data["tests"] = old["tests"]
        for nodeid, entry in self.tests.items():
            data["tests"][nodeid] = {"outcome": entry["outcome"],
                                     "set": {c: sorted(flags) for c, flags in sorted(entry["set"].items())}}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=0, sort_keys=True))
        tmp.replace(self.path)


_MODULE_COMMANDS = {"batch_inference": "batch-inference", "serve_rm": "serve-rm", "lora_merge": "lora-merge"}


def rlhfkit_command(args: list[str]) -> tuple[int, str] | None:
    """(index of the command's first argument, command) of a command line that runs an rlhfkit command, else None:
    `... -m rlhfkit sft ...`, `... -m rlhfkit.cli.sft ...` (torchrun's too), `.../rlhfkit sft ...`."""
    for i, token in enumerate(args):
        module = args[i + 1] if token == "-m" and i + 1 < len(args) else None
        if module == "rlhfkit" and i + 2 < len(args):
            return i + 3, args[i + 2]
        if module and module.startswith("rlhfkit.cli."):
            name = module[len("rlhfkit.cli."):]
            return i + 2, _MODULE_COMMANDS.get(name, name)
    if args and Path(args[0]).name == "rlhfkit" and len(args) > 1:
        return 2, args[1]
    return None


# ---- pytest hooks (this module is registered as a plugin by tests/conftest.py)

_recorder: OptionRecorder | None = None


def pytest_configure(config: Any) -> None:
    global _recorder
    if os.environ.get(OWNER_ENV):  # a pytest run by a test (tests/test_ci_skips.py): its parent records
        return
    os.environ[OWNER_ENV] = str(os.getpid())
    path = os.environ.get(RECORD_ENV)
    if path:
        target: Path | None = Path(path)
    elif getattr(config, "cache", None) is not None:
        target = Path(config.cache.mkdir("rlhfkit")) / "option_record.json"
    else:
        target = None
    if target is None and not os.environ.get(REVERT_ENV) and not os.environ.get(REVERT_PLAN_ENV):
        return
    _recorder = OptionRecorder(target)
    _recorder.install()


def pytest_unconfigure(config: Any) -> None:
    global _recorder
    if os.environ.get(OWNER_ENV) == str(os.getpid()):
        del os.environ[OWNER_ENV]
    if _recorder is not None:
        _recorder.uninstall()
        _recorder.write()
        _recorder = None


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    if _recorder is not None:
        _recorder.current = nodeid


def pytest_runtest_logreport(report: Any) -> None:
    if _recorder is None:
        return
    if report.failed:
        _recorder.outcome(report.nodeid, "failed")
    elif report.skipped:
        _recorder.outcome(report.nodeid, "skipped")
    else:
        _recorder.outcome(report.nodeid, "passed")


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    if _recorder is not None:
        _recorder.current = None
