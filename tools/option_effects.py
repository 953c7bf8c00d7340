"""The option-effect registry, read from tests/option_effects.yaml (its header describes the format) into typed
entries: for every option of every command, the tests that prove it acts (`Tested`) or the reason it has no
observable effect (`NoEffect`). Test and docs apparatus: tests/config/test_option_effects.py, tools/gen_docs.py
(docs/options.md), tools/check_option_claims.py and tools/revert_check.py read it; rlhfkit itself never does.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
REGISTRY_FILE = REPO / "tests" / "option_effects.yaml"


@dataclass(frozen=True)
class Tested:
    """The option's effect is asserted by these tests: pytest node ids relative to the repository root."""

    tests: tuple[str, ...]
    what: str  # one line: what the tests assert changes when the option is set

    __test__ = False  # not a pytest test class, although its name starts with "Test"


@dataclass(frozen=True)
class NoEffect:
    """The option has no effect a test can observe (or is refused); `reason` says why."""

    reason: str


Effect = Tested | NoEffect


class RegistryFileError(ValueError):
    """tests/option_effects.yaml is malformed; the message names the file, the key and what to fix."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (PyYAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise RegistryFileError(f"{key_node.start_mark.name}: line {key_node.start_mark.line + 1}: "
                                        f"{key!r} is listed twice (first at line {seen[key] + 1}); keep one entry")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _entry(source: str, key: Any, body: Any) -> Effect:
    where = f"{source}: entry {key!r}"
    if not isinstance(key, str) or not key:
        raise RegistryFileError(f"{where}: a key is a flag name or `command:flag`")
    if not isinstance(body, dict):
        raise RegistryFileError(f"{where}: expected a mapping with `what` and `tests`, or `no_effect`")
    fields = set(body)
    if fields == {"no_effect"}:
        reason = body["no_effect"]
        if not isinstance(reason, str):
            raise RegistryFileError(f"{where}: `no_effect` must be text (the reason)")
        return NoEffect(reason=reason)
    if fields == {"what", "tests"}:
        what, tests = body["what"], body["tests"]
        if not isinstance(what, str):
            raise RegistryFileError(f"{where}: `what` must be text")
        if not isinstance(tests, list) or not all(isinstance(t, str) for t in tests):
            raise RegistryFileError(f"{where}: `tests` must be a list of pytest node ids")
        return Tested(tests=tuple(tests), what=what)
    raise RegistryFileError(f"{where}: has the fields {sorted(fields)}; expected exactly `what` and `tests` "
                            f"(a test proves the effect) or `no_effect` (the reason none can)")


def parse(text: str, source: str = str(REGISTRY_FILE)) -> dict[str, Effect]:
    """The registry in `text` (the contents of a registry file): key -> entry, in file order."""
    loader = _UniqueKeyLoader(text)
    loader.name = source
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as err:
        raise RegistryFileError(f"{source}: not valid YAML: {err}") from err
    finally:
        loader.dispose()  # type: ignore[no-untyped-call]
    if not isinstance(data, dict):
        raise RegistryFileError(f"{source}: expected a mapping from option keys to entries")
    return {key: _entry(source, key, body) for key, body in data.items()}


@functools.cache
def registry(path: Path = REGISTRY_FILE) -> Mapping[str, Effect]:
    """Every entry of the registry file (read once): key (`flag` or `command:flag`) -> entry."""
    return parse(path.read_text(encoding="utf-8"), str(path))


def effect_of(command: str, flag: str) -> Effect | None:
    """The entry for `--flag` of `rlhfkit command`: the command-specific key first, then the shared one."""
    effects = registry()
    return effects.get(f"{command}:{flag}") or effects.get(flag)
