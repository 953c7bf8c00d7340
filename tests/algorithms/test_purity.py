"""`rlhfkit.algorithms` is pure math: it imports torch and the standard library only, never other rlhfkit
packages, models, I/O or Ray (DESIGN.md: `algorithms/` imports nothing of ours)."""

import ast
from pathlib import Path

import rlhfkit.algorithms as algorithms

ALLOWED_ROOTS = {"torch", "math", "__future__"}


def test_algorithms_imports_only_torch_and_stdlib_math():
    for path in Path(algorithms.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = {node.module.split(".")[0]}
            else:
                continue
            assert roots <= ALLOWED_ROOTS, f"{path.name} imports {roots - ALLOWED_ROOTS}"


def test_public_api_is_documented():
    for name in algorithms.__all__:
        obj = getattr(algorithms, name)
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), name


def test_docs_list_every_public_name():
    doc = (Path(algorithms.__file__).parents[2] / "docs" / "algorithms.md").read_text()
    missing = [name for name in algorithms.__all__ if name not in doc]
    assert not missing, f"docs/algorithms.md does not mention {missing}"
