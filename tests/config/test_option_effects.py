"""Every option of every command has an entry in the option-effect registry (rlhfkit/config/effects.py):
a test that sets it and asserts what changes, or the reason it has no observable effect."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from rlhfkit.cli.docs import command_aliases, command_flags, commands
from rlhfkit.config.effects import NoEffect, Tested, effect_of, registry

REPO = Path(__file__).resolve().parents[2]


@functools.cache
def _functions(path: str) -> dict[tuple[str, ...], str]:
    """(Class, name) or (name,) -> source text of every function (methods included) in a test file."""
    file = REPO / path
    source = file.read_text(encoding="utf-8")
    out: dict[tuple[str, ...], str] = {}

    def visit(node: ast.AST, prefix: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[(*prefix, child.name)] = ast.get_source_segment(source, child) or ""
            elif isinstance(child, ast.ClassDef):
                visit(child, (*prefix, child.name))

    visit(ast.parse(source), ())
    return out


def _test_source(node_id: str) -> str | None:
    """The source of the test a pytest node id names (parametrisation `[...]` ignored), None if there is none."""
    path, _, rest = node_id.partition("::")
    if not rest or not (REPO / path).is_file():
        return None
    parts = tuple(rest.split("[")[0].split("::"))
    return _functions(path).get(parts)


def _all_flags() -> dict[str, list[str]]:
    """Every command's flags and their other names (aliases such as --tp_size and --max_new_tokens)."""
    return {command: command_flags(command) + command_aliases(command) for command in commands()}


def test_aliases_are_listed_and_have_their_own_entries():
    assert {"max_new_tokens", "freeze_visual_encoder", "tp_size"} <= set(command_aliases("ppo"))
    assert "tp_size" in command_aliases("sft") and "no-freeze_visual_encoder" not in command_aliases("ppo")
    assert effect_of("ppo", "max_new_tokens") is not effect_of("batch-inference", "max_new_tokens")
    assert effect_of("sft", "tp_size") is not effect_of("batch-inference", "tp_size")


def test_every_option_of_every_command_has_an_entry():
    missing = [f"{command}:{flag}" for command, flags in _all_flags().items() for flag in flags
               if effect_of(command, flag) is None]
    assert not missing, (f"{len(missing)} option(s) have no entry in rlhfkit/config/effects.py (a test that proves "
                         f"they act, or the reason they cannot): {', '.join(missing)}")


def test_every_cited_test_exists_and_sets_the_flag():
    problems = []
    for key, effect in sorted(registry().items()):
        flag = key.split(":")[-1]
        if isinstance(effect, NoEffect):
            if not effect.reason.strip():
                problems.append(f"{key}: NoEffect without a reason")
            continue
        assert isinstance(effect, Tested), key
        if not effect.tests or not effect.what.strip():
            problems.append(f"{key}: Tested needs tests and a `what`")
        for node_id in effect.tests:
            source = _test_source(node_id)
            if source is None:
                problems.append(f"{key}: no test {node_id}")
            elif flag not in source:
                problems.append(f"{key}: {node_id} never names '{flag}'")
    assert not problems, "\n".join(problems)


def test_no_entry_is_stale():
    flags = _all_flags()
    every = {flag for names in flags.values() for flag in names}
    stale = []
    for key in registry():
        command, _, flag = key.rpartition(":")
        if command and (command not in flags or flag not in flags[command]):
            stale.append(key)
        elif not command and flag not in every:
            stale.append(key)
    assert not stale, f"entries for options no command has: {', '.join(sorted(stale))}"


def test_the_options_page_is_up_to_date_and_counts_every_option():
    from rlhfkit.cli import docs

    assert not docs.options_page_stale(), ("docs/options.md is out of date: run `make docs` "
                                           "(python -m rlhfkit.cli.docs) and commit it")
    text = docs.render_options()
    total = sum(len(flags) for flags in _all_flags().values())
    assert f"of {total} options**" in text
    assert "[test_max_norm_clips_the_gradient](../tests/trainers/test_options_act.py)" in text


def test_the_registry_merges_the_ppo_table_in_either_import_order():
    import subprocess
    import sys

    code = ("import rlhfkit.config.effects_ppo as p; from rlhfkit.config.effects import registry; "
            "assert set(p.PPO_EFFECTS) <= set(registry())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
