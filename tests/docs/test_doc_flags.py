"""Every `--flag` that docs/*.md and docs/commands/*.md name exists, for the command the text is about.

The rule, per segment of text (an inline code span, the prose of a line outside its code spans, or one logical line
of a fenced code block with its `\\` continuations joined):

- after `rlhfkit <command>` (or `-m rlhfkit.cli.<command>`, `-m rlhfkit.cli.main <command>`), up to the next such
  mention, a flag must be one of that command's flags (read from the very parser behind its `--help`), or one it
  refuses with a reason;
- a segment that starts with another program (`ray start ...`, `torchrun ...`, `pip install ...`, a script path)
  names that program's flags before any rlhfkit command: they are not checked;
- any other flag must exist in at least one command, be refused by them, be a flag of one of the repository's own
  scripts (benchmarks/, examples/, tools/, the docs generator: their `add_argument("--...")` calls, read statically),
  or be listed in OTHER_PROGRAMS below (flags of other tools that prose names on their own, each with its tool).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from rlhfkit.cli.main import COMMANDS
from rlhfkit.config import dialect
from rlhfkit.config.parse import COMMAND_REJECTED_FLAGS, REJECTED_FLAGS, build_parser
from tools import gen_docs as generator
from tools import porting_doc

DOCS_DIR = generator.REPO_ROOT / "docs"

# Flags of other programs that the docs name in prose on their own: flag -> the program.
OTHER_PROGRAMS = {
    "--temp-dir": "ray start", "--runtime-env-json": "ray job submit", "--submission-id": "ray job submit",
    "--nnodes": "torchrun", "--node_rank": "torchrun", "--rdzv_endpoint": "torchrun",
    "--max-children": "mutmut",
    "--flag": "placeholder (Boolean flags take --flag / --no-flag)", "--no-flag": "placeholder",
}
# First words of a segment that run another program (its own flags follow).
OTHER_PROGRAM_WORDS = {"ray", "torchrun", "pip", "mutmut", "deepspeed", "make", "git", "curl", "pytest", "bash", "sh",
                       "python", "python3", "vllm", "tensorboard", "wandb", "docker", "kubectl"}
FLAG = re.compile(r"(?<![\w\-/.])--([A-Za-z][\w.\-]*\w|[A-Za-z])")
_NAMES = "(" + "|".join(sorted(map(re.escape, COMMANDS), key=len, reverse=True)) + r")(?![\w-])"
MENTION = re.compile(r"\brlhfkit " + _NAMES + r"|-m rlhfkit\.cli\.main " + _NAMES + r"|-m rlhfkit\.cli\.(\w+)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def command_flags() -> dict[str, set[str]]:
    """command -> its flags (`--name` and `--no-name` forms, hidden ones included) and the flags it refuses."""
    out = {}
    for command in COMMANDS:
        module = importlib.import_module(generator.module_name(command))
        if getattr(module, "GROUPS", None):
            parser = build_parser(command, list(module.GROUPS), "")
            refused = set(REJECTED_FLAGS) | set(COMMAND_REJECTED_FLAGS.get(command, {}))
        elif callable(getattr(module, "build_parser", None)):
            parser, refused = module.build_parser(), set()
        else:
            raise AssertionError(f"rlhfkit {command} has no parser to read its flags from")
        flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
        translated = {f"--{name}" for name in dialect.table(command)}  # OpenRLHF's names: mapped or refused
        out[command] = flags | {f"--{name}" for name in refused} | translated
    return out


def script_flags() -> set[str]:
    """`--flags` that the repository's scripts declare with `add_argument` (benchmarks/, examples/, tools/, the docs
    generator): the docs describe those scripts too."""
    root = generator.REPO_ROOT
    files = [p for d in ("benchmarks", "examples", "tools") for p in (root / d).rglob("*.py")]
    found = set()
    for path in [*files, Path(generator.__file__)]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                found |= {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                          and a.value.startswith("--")}
    return found


FLAGS = command_flags()
ANY_COMMAND = set().union(*FLAGS.values())
# OpenRLHF tools without an rlhfkit command: docs/porting.md lists their flags with the reason
NO_COMMAND_FLAGS = {flag for dialect_flags in porting_doc.openrlhf_flags().values()
                    for cli, flags in dialect_flags.items() if dialect.OPENRLHF_CLIS[cli] is None for flag in flags}
KNOWN = ANY_COMMAND | script_flags() | set(OTHER_PROGRAMS) | NO_COMMAND_FLAGS


def segments(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every segment of a Markdown page (see the module docstring)."""
    out: list[tuple[int, str]] = []
    in_code, pending, start = False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            if not pending:
                start = number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            out.append((start, (pending + line).strip()))
            pending = ""
            continue
        spans = [m.group(2) for m in CODE_SPAN.finditer(line)]
        out += [(number, s.strip()) for s in spans]
        out.append((number, CODE_SPAN.sub(" ` ", line)))
    return out


def starts_another_program(segment: str) -> bool:
    words = segment.split()
    if not words:
        return False
    first = words[0].rsplit("/", 1)[-1]
    if first in ("python", "python3") and len(words) > 2 and words[1] == "-m" and words[2] == "rlhfkit.cli.main":
        return False  # `python -m rlhfkit.cli.main <command>`; other modules are programs
    return first in OTHER_PROGRAM_WORDS or first.endswith((".py", ".sh"))


def problems_in(segment: str) -> list[str]:
    found = []
    mentions = [(m.start(), m.group(1) or m.group(2) or m.group(3).replace("_", "-"))
                for m in MENTION.finditer(segment)]
    mentions = [(pos, c) for pos, c in mentions if c in FLAGS]   # `-m rlhfkit.cli.main` names no command
    external = starts_another_program(segment)
    for m in FLAG.finditer(segment):
        flag = "--" + m.group(1)
        owner = next((c for pos, c in reversed(mentions) if pos < m.start()), None)
        if owner is not None:
            if flag not in FLAGS[owner]:
                found.append(f"{flag} is not a flag of `rlhfkit {owner}`")
        elif external:
            continue
        elif flag not in KNOWN:
            found.append(f"{flag} is a flag of no rlhfkit command (nor of a script of this repository)")
    return found


def doc_pages() -> list[Path]:
    return sorted(DOCS_DIR.glob("*.md")) + sorted((DOCS_DIR / "commands").glob("*.md"))


def test_the_rule_on_examples():
    assert problems_in("rlhfkit sft --pretrain x --max_len 8") == []
    assert problems_in("rlhfkit sft --kd_coef 0.5") == ["--kd_coef is not a flag of `rlhfkit sft`"]
    assert problems_in("rlhfkit kd --kd_coef 0.5; rlhfkit sft --pretrain x") == []
    assert problems_in("ray job submit --address http://h:8265 -- rlhfkit ppo --pretrain x") == []
    assert problems_in("ray job submit -- rlhfkit ppo --max-len 8") == ["--max-len is not a flag of `rlhfkit ppo`"]
    assert problems_in("torchrun --nproc_per_node 2 -m rlhfkit.cli.sft --kd_coef 1") == [
        "--kd_coef is not a flag of `rlhfkit sft`"]
    assert problems_in("set --no_such_flag") == [
        "--no_such_flag is a flag of no rlhfkit command (nor of a script of this repository)"]
    assert problems_in("`--inprocess` (examples/dpo_ref_modes.py)") == []
    assert problems_in("python -m tools.gen_docs --check") == []
    assert problems_in("python -m rlhfkit.cli.main rm --kd_coef 1") == ["--kd_coef is not a flag of `rlhfkit rm`"]
    assert problems_in("--apply_chat_template, --no-apply_chat_template and --zpg (refused)") == []
    text = "```bash\nrlhfkit dpo --pretrain m \\\n  --beta 0.1 \\\n  --kd_coef 1\n```\nsee `--beta`\n"
    found = [(n, p) for n, s in segments(text) for p in problems_in(s)]
    assert found == [(2, "--kd_coef is not a flag of `rlhfkit dpo`")]


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(DOCS_DIR)))
def test_every_flag_named_in_the_docs_exists(page):
    found = [f"docs/{page.relative_to(DOCS_DIR)}:{number}: {problem}"
             for number, segment in segments(page.read_text(encoding="utf-8")) for problem in problems_in(segment)]
    assert not found, "\n".join(found)
