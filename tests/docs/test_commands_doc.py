"""docs/commands/*.md is generated from the command definitions: fail when a page is out of date."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest

from rlhfkit.config.options import opt
from rlhfkit.config.parse import build_parser
from tools import gen_docs as docs

HOW_TO_FIX = "run `make docs` (python -m tools.gen_docs) and commit docs/commands/"


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return docs.generate()


def test_command_pages_are_up_to_date(pages):
    stale = docs.stale_pages(docs.DEFAULT_OUT, pages)
    assert not stale, f"docs/commands is out of date ({', '.join(stale)}): {HOW_TO_FIX}"


def test_every_command_has_a_page_listed_in_the_index(pages):
    from rlhfkit.cli.main import COMMANDS

    assert set(pages) == {f"{c}.md" for c in COMMANDS} | {docs.INDEX}
    for command in COMMANDS:
        assert f"]({command}.md)" in pages[docs.INDEX]
        assert pages[f"{command}.md"].startswith(docs.MARKER)


def test_a_group_page_lists_every_flag_of_its_parser(pages):
    """Pages of GROUPS commands come from the same parser as --help: every flag, grouped by docstring heading."""
    import importlib

    from rlhfkit.cli.main import COMMANDS

    checked = 0
    for command in COMMANDS:
        module = importlib.import_module(docs.module_name(command))
        if not getattr(module, "GROUPS", None):
            continue
        page = pages[f"{command}.md"]
        parser = build_parser(command, module.GROUPS, getattr(module, "DESCRIPTION", ""))
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"`{flag}`" in page, f"{command}.md lacks {flag}"
        for group in module.GROUPS:
            assert f"\n## {group.__doc__.strip().splitlines()[0]}\n" in page
        checked += 1
    assert checked, "no command exposes GROUPS"


@dataclasses.dataclass
class FakeOptions:
    """Fake group
    Second docstring line: an intro under the heading."""

    alpha: float = opt(0.5, "a | pipe and <angle> and *star*")
    mode: str = opt("fast", "how", choices=["fast", "slow"])
    names: list[str] = opt(["a", "b"], "several")
    path: str | None = opt(None, "where")
    flag: bool = opt(False, "a switch")
    sep: str = opt("x\ny", "separator with a newline")


@pytest.fixture
def fake_commands(monkeypatch):
    groups_mod = types.ModuleType("rlhfkit.cli.fake_groups")
    groups_mod.GROUPS = [FakeOptions]
    groups_mod.DESCRIPTION = "A fake command from option groups."
    import argparse

    def build() -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="rlhfkit fake-parser", description="From its own parser.")
        p.add_argument("target", metavar="TARGET", help="what to do it to")
        p.add_argument("--count", type=int, default=3, help="how many (default %(default)s)")
        p.add_argument("--dry", action="store_true", help="do nothing")
        p.add_argument("--hidden", action="store_true", help=argparse.SUPPRESS)
        return p

    parser_mod = types.ModuleType("rlhfkit.cli.fake_parser")
    parser_mod.build_parser = build
    bare_mod = types.ModuleType("rlhfkit.cli.fake_bare")
    for mod in (groups_mod, parser_mod, bare_mod):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(docs, "commands", lambda: {"fake-groups": "groups summary", "fake-parser": "parser summary",
                                                   "fake-bare": "bare summary"})


def test_rendering_groups_parser_and_bare_modules(fake_commands):
    pages = docs.generate()
    groups = pages["fake-groups.md"]
    assert "\n## Fake group\n\nSecond docstring line: an intro under the heading.\n" in groups
    assert "| `--alpha` | float | `0.5` |  | a \\| pipe and &lt;angle&gt; and \\*star\\* |" in groups
    assert "| `--mode` | str | `fast` | fast, slow | how |" in groups
    assert "| `--names` | list[str] | `a b` |  | several |" in groups
    assert "| `--path` | str \\| None | `None` |  | where |" in groups
    assert "| `--flag`, `--no-flag` | bool | `False` |  | a switch |" in groups
    assert "`x\\ny`" in groups
    assert "rlhfkit fake-groups [--config run.yaml] [flags]" in groups and "## Not supported" in groups
    parser = pages["fake-parser.md"]
    assert "rlhfkit fake-parser TARGET [flags]" in parser and "From its own parser." in parser
    assert "| `TARGET` | str | `(required)` |  | what to do it to |" in parser
    assert "| `--count` | int | `3` |  | how many (default 3) |" in parser
    assert "| `--dry` | bool | `False` |  | do nothing |" in parser
    assert "hidden" not in parser and "--config" not in parser
    assert "exposes neither `GROUPS`" in pages["fake-bare.md"]
    index = pages[docs.INDEX]
    assert "| [`rlhfkit fake-groups`](fake-groups.md) | groups summary | 7 |" in index
    assert "| [`rlhfkit fake-bare`](fake-bare.md) | bare summary | not documented |" in index
    assert docs.undocumented_commands() == ["fake-bare"]


def test_write_and_check_find_stale_and_removed_pages(fake_commands, tmp_path, capsys):
    out = tmp_path / "commands"
    assert docs.main(["--out", str(out)]) == 0
    assert docs.main(["--check", "--out", str(out)]) == 0
    (out / "fake-parser.md").write_text((out / "fake-parser.md").read_text() + "edited\n")
    (out / "gone.md").write_text(docs.MARKER + "\n# a command that was removed\n")
    (out / "notes.md").write_text("# hand-written, not generated: left alone\n")
    (out / "fake-bare.md").unlink()
    assert docs.stale_pages(out) == ["fake-bare.md", "fake-parser.md", "gone.md"]
    capsys.readouterr()
    assert docs.main(["--check", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "fake-bare.md, fake-parser.md, gone.md" in err and "make docs" in err
    docs.main(["--out", str(out)])
    assert docs.stale_pages(out) == [] and not (out / "gone.md").exists() and (out / "notes.md").exists()
