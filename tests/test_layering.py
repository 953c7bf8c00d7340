"""Which package may import which (docs/architecture.md), read statically: every `import` of every module file under
rlhfkit/, function-level and `TYPE_CHECKING` imports included, so a lazy import cannot hide an arrow. Beside
tests/algorithms/test_purity.py (`algorithms` imports nothing of ours).

Dependencies point one way: cli -> (trainers | rl | inference) -> launch -> (engine, rollout, rewards, agents) ->
(models, data, algorithms); `config`, `errors` and `userfiles` (the user-file importer) sit below them all, and
`observability` (what a run records and renders, used from every layer) imports only `config` and `errors`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rlhfkit

PACKAGE_DIR = Path(rlhfkit.__file__).parent
COMMANDS = {"cli"}
ONLINE = {"rl", "trainers", "inference"}

# package -> the rlhfkit packages it must not import (any module in them)
FORBIDDEN: dict[str, set[str]] = {
    "errors": {"*"},                                                  # a leaf: imports nothing of ours
    "userfiles": {p.name for p in PACKAGE_DIR.iterdir() if p.is_dir() and (p / "__init__.py").exists()},  # errors only
    "config": COMMANDS | ONLINE | {"launch"},                        # config imports no command
    "inference": COMMANDS | {"rl", "trainers"},
    "launch": COMMANDS | ONLINE,
    "rollout": COMMANDS | ONLINE | {"launch"},
    "engine": COMMANDS | ONLINE | {"launch", "rollout"},
    "data": COMMANDS | ONLINE | {"launch", "rollout", "engine", "rewards", "agents"},
    # what a run records and renders: read by every layer, so it imports only config and errors
    "observability": COMMANDS | ONLINE | {"launch", "rollout", "engine", "rewards", "agents", "models", "data",
                                          "algorithms", "inference"},
}


def module_files() -> dict[str, Path]:
    out = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = module_files()


def imported_names(module: str, path: Path) -> dict[str, int]:
    """Every dotted name `module` imports (for `from a.b import c`: `a.b` and `a.b.c`), with the line of its first
    import; relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            found.setdefault(name, node.lineno)
    return found


def internal_imports(module: str) -> dict[str, int]:
    """The rlhfkit modules `module` imports -> line."""
    return {name: line for name, line in imported_names(module, MODULES[module]).items()
            if name in MODULES and name != module}


def top_package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def arrows_against(package: str) -> list[str]:
    forbidden = FORBIDDEN[package]
    bad = []
    for module in sorted(MODULES):
        if top_package(module) != package:
            continue
        for name, line in sorted(internal_imports(module).items()):
            target = top_package(name)
            if target == package or name == "rlhfkit":
                continue
            if "*" in forbidden or target in forbidden:
                bad.append(f"{MODULES[module].relative_to(PACKAGE_DIR.parent)}:{line} imports {name}")
    return bad


def test_the_import_reader_sees_function_level_and_relative_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from rlhfkit.rl import setup\n    from ..cli import main\n"
                    "    import rlhfkit.trainers.sft as s\n")
    names = imported_names("rlhfkit.inference.m", path)
    assert {"rlhfkit.rl.setup", "rlhfkit.cli.main", "rlhfkit.trainers.sft"} <= set(names)
    assert names["rlhfkit.rl.setup"] == 2


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_runs_against_the_layers(package):
    assert any(top_package(m) == package for m in MODULES), f"rlhfkit/{package} does not exist"
    bad = arrows_against(package)
    assert not bad, (f"rlhfkit.{package} must not import {sorted(FORBIDDEN[package])}:\n  " + "\n  ".join(bad)
                     + "\nmove the shared code down (rlhfkit/errors.py, rlhfkit/launch/, rlhfkit/data/, ...) "
                       "instead of importing up")


# The engines are built from specs made at the command's edge (rlhfkit.launch.engine_spec, rl/, inference/): the
# rollout engines read nothing of the configuration, the training engine no command class (it types what it reads
# with protocols and option groups).
NO_COMMAND_CLASSES: dict[str, tuple[str, ...]] = {
    "rollout": ("rlhfkit.config",),           # VLLMEngineSpec, SamplingConfig, LoraSyncSpec: made by the caller
    "engine": ("rlhfkit.config.commands",),   # TrainEngineFlags, DtypeFlags: structural
}


@pytest.mark.parametrize("package", sorted(NO_COMMAND_CLASSES))
def test_engines_are_built_from_specs_not_from_command_classes(package):
    bad = [f"{MODULES[module].relative_to(PACKAGE_DIR.parent)}:{line} imports {name}"
           for module in sorted(MODULES) if top_package(module) == package
           for name, line in sorted(internal_imports(module).items())
           if any(name == banned or name.startswith(banned + ".") for banned in NO_COMMAND_CLASSES[package])]
    assert not bad, (f"rlhfkit.{package} must not import {NO_COMMAND_CLASSES[package]}: build a spec at the "
                     "command's edge (rlhfkit.launch.engine_spec) and pass it in:\n  " + "\n  ".join(bad))


def import_cycles() -> list[set[str]]:
    """Strongly connected groups (more than one module) of the module import graph (Tarjan)."""
    graph = {m: set(internal_imports(m)) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycles_between_modules():
    """None at all, none excused: e.g. rollout.weight_sync <-> rollout.weight_broadcast (both now take their buckets
    from rollout.buckets) and config.effects <-> config.effects_ppo (the option-effect registry, now a data file,
    tests/option_effects.yaml) were cycles once."""
    cycles = [sorted(c) for c in import_cycles()]
    assert not cycles, f"import cycles (function-level imports count): {cycles}"


def test_weight_broadcast_does_not_import_weight_sync():
    assert "rlhfkit.rollout.weight_sync" not in internal_imports("rlhfkit.rollout.weight_broadcast")


# Exceptions that stay beside their only user: private control flow, or an HTTP status carrier of the serve-rm server.
LOCAL_EXCEPTIONS = {"rlhfkit.rewards.server.BadRequest"}


def test_the_error_types_live_in_rlhfkit_errors():
    """Every public exception class of rlhfkit is defined in rlhfkit/errors.py, which any layer may import."""
    import rlhfkit.errors as errors

    names = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, Exception)}
    elsewhere = []
    for module, path in sorted(MODULES.items()):
        if module == "rlhfkit.errors":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
            if (bases & (names | {"Exception", "ValueError", "RuntimeError", "TypeError", "KeyError", "OSError"})
                    and f"{module}.{node.name}" not in LOCAL_EXCEPTIONS):
                elsewhere.append(f"{module}.{node.name}")
    assert not elsewhere, f"define these in rlhfkit/errors.py: {elsewhere}"
    assert not internal_imports("rlhfkit.errors")
