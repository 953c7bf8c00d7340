"""Every option of every command has an entry in the option-effect registry (tests/option_effects.yaml, read by
tools/option_effects.py): a test that sets it and asserts what changes, or the reason it has no observable effect."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from tools.gen_docs import command_aliases, command_flags, commands, positional_arguments
from tools.option_effects import NoEffect, RegistryFileError, Tested, effect_of, parse, registry

REPO = Path(__file__).resolve().parents[2]


@functools.cache
def _functions(path: str) -> dict[tuple[str, ...], ast.AST]:
    """(Class, name) or (name,) -> the node of every function (methods included) in a test file."""
    out: dict[tuple[str, ...], ast.AST] = {}

    def visit(node: ast.AST, prefix: tuple[str, ...]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[(*prefix, child.name)] = child
            elif isinstance(child, ast.ClassDef):
                visit(child, (*prefix, child.name))

    visit(ast.parse((REPO / path).read_text(encoding="utf-8")), ())
    return out


def _test_source(node_id: str) -> str | None:
    """The source of the test a pytest node id names (parametrisation `[...]` ignored) and of the functions of the
    same file it calls or takes as fixtures (`base_args(...)`, a module fixture), transitively; None if there is no
    such test."""
    path, _, rest = node_id.partition("::")
    if not rest or not (REPO / path).is_file():
        return None
    functions = _functions(path)
    node = functions.get(tuple(rest.split("[")[0].split("::")))
    if node is None:
        return None
    source = (REPO / path).read_text(encoding="utf-8")
    helpers = {name[0]: fn for name, fn in functions.items() if len(name) == 1}
    seen, todo, parts = set(), [node], []
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        parts.append(ast.get_source_segment(source, fn) or "")
        names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
        assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        names |= {a.arg for a in fn.args.args}  # fixtures defined in the same file
        todo += [helpers[name] for name in names if name in helpers]
    return "\n".join(parts)


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
    assert not missing, (f"{len(missing)} option(s) have no entry in tests/option_effects.yaml (a test that proves "
                         f"they act, or the reason they cannot): {', '.join(missing)}")


def names_as_a_word(name: str, source: str) -> bool:
    """`name` occurs in `source` as a whole word: `port` in `"--port"` or `port=0`, not inside `import` or
    `report`; `timeout` not inside `reward_timeout`."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", source) is not None


def test_names_as_a_word():
    assert names_as_a_word("port", '["--port", "0"]') and names_as_a_word("port", "cfg(port=0)")
    assert not names_as_a_word("port", "import json\nreport = 1") and not names_as_a_word("timeout", "reward_timeout")
    assert names_as_a_word("ring_head_stride", '"--ds.ring_head_stride"')


def test_every_cited_test_exists_and_sets_the_flag():
    """The cheap, always-on half: every cited test exists and names the flag as a whole word. Whether the tests set
    it to a non-default value while they run is checked on the suite's record (tests/option_record.py) by
    tools/check_option_claims.py, which CI runs after both tiers (.ci/run)."""
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
        command = key.rpartition(":")[0]
        positional = bool(command) and command in commands() and flag in positional_arguments(command)
        for node_id in effect.tests:
            source = _test_source(node_id)
            if source is None:
                problems.append(f"{key}: no test {node_id}")
            elif not positional and not names_as_a_word(flag, source):  # a positional is given by place
                problems.append(f"{key}: {node_id} never names '{flag}' (as a word)")
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
    from tools import gen_docs as docs

    assert not docs.options_page_stale(), ("docs/options.md is out of date: run `make docs` "
                                           "(python -m tools.gen_docs) and commit it")
    text = docs.render_options()
    total = sum(len(flags) for flags in _all_flags().values())
    assert f"of {total} options**" in text
    assert "[test_max_norm_clips_the_gradient](../tests/trainers/test_options_act.py)" in text


def test_the_registry_file_reads_into_typed_entries():
    text = ("ppo:eps_clip:\n  what: the clip range\n  tests:\n  - tests/a.py::test_x\n  - tests/b.py::test_y\n"
            "adam_offload:\n  no_effect: 'CUDA only: inert on CPU'\n")
    assert parse(text, "f.yaml") == {
        "ppo:eps_clip": Tested(tests=("tests/a.py::test_x", "tests/b.py::test_y"), what="the clip range"),
        "adam_offload": NoEffect(reason="CUDA only: inert on CPU")}


@pytest.mark.parametrize(("text", "message"), [
    ("eps_clip:\n  what: a\n  tests: [tests/a.py::t]\neps_clip:\n  no_effect: b\n",
     "f.yaml: line 4: 'eps_clip' is listed twice (first at line 1)"),
    ("eps_clip:\n  what: a\n  tests: [tests/a.py::t]\n  no_effect: b\n",
     "f.yaml: entry 'eps_clip': has the fields ['no_effect', 'tests', 'what']"),
    ("eps_clip:\n  what: a\n", "f.yaml: entry 'eps_clip': has the fields ['what']"),
    ("eps_clip:\n  what: a\n  tests: tests/a.py::t\n", "f.yaml: entry 'eps_clip': `tests` must be a list"),
    ("eps_clip: the clip range\n", "f.yaml: entry 'eps_clip': expected a mapping"),
    ("- eps_clip\n", "f.yaml: expected a mapping from option keys to entries"),
])
def test_a_malformed_registry_file_is_an_error_naming_the_file_and_key(text, message):
    """A key listed twice is refused (YAML would keep the last one silently), as is an entry that is neither a
    proof (`what` and `tests`) nor a reason (`no_effect`)."""
    with pytest.raises(RegistryFileError) as err:
        parse(text, "f.yaml")
    assert message in str(err.value)
