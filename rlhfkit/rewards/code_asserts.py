"""`builtin:code`'s assert tests, split so that the expected values never reach the program's process.

A test (``"assert add(1, 2) == 3"``, several statements allowed) is parsed here, in the reward process:

* each top-level ``assert`` becomes a *check* evaluated here, on plain data: its literals, ``NAME = <literal>``
  bindings of the test, arithmetic, comparisons, ``and``/``or``/``not``, displays, subscripts and calls of a few
  pure built-ins (:data:`SAFE_CALLS`, ``math.isclose``) stay here; every other sub-expression (``add(1, 2)``: a
  *leaf*) is evaluated in the sandbox, which sends its value back as type-tagged JSON of exact built-in types
  (anything else, such as an object whose ``__eq__`` is always true, fails the check);
* every other top-level statement (imports, ``x = make()``) runs in the sandbox, in order, between the leaves;
  a literal binding goes there too only when sandboxed code names it.

What can therefore not be forged: printing, exiting early, atexit or excepthook tricks, or reading the process's
argv, memory or code objects give the program nothing, since no expected value and no pass token is there; a
check passes only when the values the program computed are right. Refused (ValueError naming the sample and test):
an ``assert`` inside a compound statement (``for``, ``if``, ``def check(...)``) and any comparison in code that
would run in the sandbox, since there it could be answered by the program's own ``__eq__``/``__lt__``.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlhfkit.errors import CheckFailed

LEAF_PREFIX = "\0leaf"  # not an identifier, so no test can name it
SAFE_CALLS: dict[str, Callable[..., Any]] = {
    "abs": abs, "len": len, "sorted": sorted, "set": set, "frozenset": frozenset, "tuple": tuple, "list": list,
    "min": min, "max": max, "sum": sum, "round": round, "int": int, "float": float, "str": str, "bool": bool,
    "all": all, "any": any}
SAFE_MATH: dict[str, Callable[..., Any]] = {"isclose": math.isclose, "sqrt": math.sqrt, "floor": math.floor,
                                           "ceil": math.ceil}
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos,
                                            ast.Invert: operator.invert}
_COMPARE: dict[type, Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b, ast.Is: operator.is_,
    ast.IsNot: operator.is_not}
MAX_SIZE = 1 << 20  # elements / characters / bits the parent builds from arithmetic on the program's values


@dataclass
class AssertPlan:
    """The sandbox's steps (``{"exec": src}`` / ``{"eval": src}``) and the checks, each an expression over leaves
    (``LEAF_PREFIX + <step index>`` names) and literal bindings, evaluated by :func:`check_passes`."""

    steps: list[dict[str, str]] = field(default_factory=list)
    checks: list[ast.expr] = field(default_factory=list)
    bindings: dict[str, Any] = field(default_factory=dict)


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


class _Splitter:
    """Turns assert expressions into parent-side trees whose leaves are sandbox steps."""

    def __init__(self, plan: AssertPlan, where: str) -> None:
        self.plan, self.where = plan, where

    def child(self, node: ast.AST, kind: str) -> None:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Compare):
                raise ValueError(f"{self.where}: the comparison {ast.unparse(sub)!r} would run in the program's "
                                 "process, where the program's own __eq__/__lt__ could answer it; write each "
                                 "comparison as an operand of a top-level assert (assert f(x) == 3)")
        self.plan.steps.append({kind: ast.unparse(node)})

    def leaf(self, node: ast.expr) -> ast.expr:
        self.child(node, "eval")
        return ast.Name(id=f"{LEAF_PREFIX}{len(self.plan.steps) - 1}", ctx=ast.Load())

    def split(self, node: ast.expr) -> ast.expr:
        """``node`` with every sub-expression the parent cannot evaluate replaced by a leaf."""
        if isinstance(node, ast.Constant):
            return node
        if isinstance(node, ast.Name):
            return node if node.id in self.plan.bindings else self.leaf(node)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not any(isinstance(e, ast.Starred)
                                                                        for e in node.elts):
            node.elts = [self.split(e) for e in node.elts]
            return node
        if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
            node.keys = [self.split(k) for k in node.keys if k is not None]
            node.values = [self.split(v) for v in node.values]
            return node
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            node.operand = self.split(node.operand)
            return node
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            node.left, node.right = self.split(node.left), self.split(node.right)
            return node
        if isinstance(node, ast.BoolOp):
            node.values = [self.split(v) for v in node.values]
            return node
        if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
            node.left, node.comparators = self.split(node.left), [self.split(c) for c in node.comparators]
            return node
        if isinstance(node, ast.IfExp):
            node.test, node.body, node.orelse = self.split(node.test), self.split(node.body), self.split(node.orelse)
            return node
        if isinstance(node, ast.Subscript):
            if isinstance(node.slice, ast.Slice):
                parts = [node.slice.lower, node.slice.upper, node.slice.step]
                node.slice.lower, node.slice.upper, node.slice.step = [None if p is None else self.split(p)
                                                                       for p in parts]
            else:
                node.slice = self.split(node.slice)
            node.value = self.split(node.value)
            return node
        if isinstance(node, ast.Call) and _safe_callable(node.func) is not None and \
                not any(isinstance(a, ast.Starred) for a in node.args) and all(k.arg for k in node.keywords) and \
                not (isinstance(node.func, ast.Name) and node.func.id in ("sorted", "min", "max")
                     and any(k.arg == "key" for k in node.keywords)):
            node.args = [self.split(a) for a in node.args]
            for keyword in node.keywords:
                keyword.value = self.split(keyword.value)
            return node
        return self.leaf(node)


def _safe_callable(func: ast.expr) -> Callable[..., Any] | None:
    if isinstance(func, ast.Name):
        return SAFE_CALLS.get(func.id)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "math":
        return SAFE_MATH.get(func.attr)
    return None


def plan_asserts(tests: list[str], where: str) -> AssertPlan:
    """The :class:`AssertPlan` of a label's tests; ValueError naming ``where`` and the test for what it refuses."""
    plan = AssertPlan()
    deferred: list[tuple[int, str, str]] = []  # (step position, name, source) of literal bindings
    for number, test in enumerate(tests):
        here = f"{where}, test {number}"
        try:
            module = ast.parse(test)
        except SyntaxError as err:
            raise ValueError(f"{here}: not Python ({err.msg}, line {err.lineno}): {test!r}") from None
        splitter = _Splitter(plan, here)
        for statement in module.body:
            if isinstance(statement, ast.Assert):
                plan.checks.append(splitter.split(statement.test))
                continue
            nested = [n for n in ast.walk(statement) if isinstance(n, ast.Assert)]
            if nested:
                raise ValueError(f"{here}: an assert inside a {type(statement).__name__.lower()} statement would "
                                 "run in the program's process, where it can be forged; write each check as a "
                                 "top-level `assert <expression>`")
            target = statement.targets[0] if isinstance(statement, ast.Assign) and len(statement.targets) == 1 \
                else None
            is_literal, value = _literal(statement.value) if isinstance(target, ast.Name) and \
                isinstance(statement, ast.Assign) else (False, None)
            if isinstance(target, ast.Name) and is_literal:
                plan.bindings[target.id] = value
                deferred.append((len(plan.steps), target.id, ast.unparse(statement)))
                continue
            for name in _names(statement):
                plan.bindings.pop(name, None)  # rebound in the sandbox: from here on a leaf
            splitter.child(statement, "exec")
    named = set().union(*(_names(ast.parse(s.get("exec") or s["eval"])) for s in plan.steps)) if plan.steps else set()
    for position, name, source in reversed(deferred):
        if name in named:
            plan.steps.insert(position, {"exec": source})
            _renumber(plan, position)
    return plan


def _renumber(plan: AssertPlan, inserted_at: int) -> None:
    for check in plan.checks:
        for node in ast.walk(check):
            if isinstance(node, ast.Name) and node.id.startswith(LEAF_PREFIX):
                index = int(node.id[len(LEAF_PREFIX):])
                if index >= inserted_at:
                    node.id = f"{LEAF_PREFIX}{index + 1}"


# ---- values from the sandbox

def decode(tagged: Any, depth: int = 0) -> Any:
    """A type-tagged JSON value (rewards/sandbox_child.py ``encode``) as plain Python data; ValueError otherwise."""
    if depth > 100 or not isinstance(tagged, list) or len(tagged) != 2 or not isinstance(tagged[0], str):
        raise ValueError("not a tagged value")
    kind, raw = tagged
    if kind == "NoneType" and raw is None:
        return None
    if kind == "bool" and isinstance(raw, bool):
        return raw
    if kind == "str" and isinstance(raw, str):
        return raw
    if kind == "int" and isinstance(raw, str):
        return int(raw)
    if kind == "float" and isinstance(raw, str):
        return float.fromhex(raw)
    if kind == "bytes" and isinstance(raw, str):
        return bytes.fromhex(raw)
    if kind in ("list", "tuple", "set", "frozenset") and isinstance(raw, list):
        items = [decode(item, depth + 1) for item in raw]
        try:
            return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)
        except TypeError as err:  # an unhashable member of a set
            raise ValueError(str(err)) from None
    if kind == "dict" and isinstance(raw, list) and all(isinstance(p, list) and len(p) == 2 for p in raw):
        try:
            return {decode(k, depth + 1): decode(v, depth + 1) for k, v in raw}
        except TypeError as err:
            raise ValueError(str(err)) from None
    raise ValueError(f"not a tagged value of kind {kind!r}")


def _bounded(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple, set, frozenset, dict)) and len(value) > MAX_SIZE:
        raise CheckFailed("a value over the size bound")
    if isinstance(value, int) and value.bit_length() > MAX_SIZE:
        raise CheckFailed("an integer over the size bound")
    return value


def _binary(op: ast.operator, left: Any, right: Any) -> Any:
    if isinstance(op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and \
            abs(right) * max(1, abs(left).bit_length()) > MAX_SIZE:
        raise CheckFailed("a power over the size bound")
    if isinstance(op, ast.Mult) and isinstance(left, int) != isinstance(right, int):
        sized, times = (right, left) if isinstance(left, int) else (left, right)
        if hasattr(sized, "__len__") and isinstance(times, int) and len(sized) * max(times, 0) > MAX_SIZE:
            raise CheckFailed("a repetition over the size bound")
    return _bounded(_BINARY[type(op)](left, right))


def evaluate(node: ast.expr, leaves: dict[str, Any], bindings: dict[str, Any]) -> Any:
    """A check's expression on plain data; ``leaves``: values (or exceptions) by leaf name."""
    def ev(n: ast.expr) -> Any:
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.Name):
            if n.id.startswith(LEAF_PREFIX):
                value = leaves.get(n.id, CheckFailed("the program sent no value"))
                if isinstance(value, Exception):
                    raise CheckFailed(str(value))
                return value
            return bindings[n.id]
        if isinstance(n, ast.List):
            return [ev(e) for e in n.elts]
        if isinstance(n, ast.Tuple):
            return tuple(ev(e) for e in n.elts)
        if isinstance(n, ast.Set):
            return {ev(e) for e in n.elts}
        if isinstance(n, ast.Dict):
            return {ev(k): ev(v) for k, v in zip(n.keys, n.values) if k is not None}
        if isinstance(n, ast.UnaryOp):
            return _bounded(_UNARY[type(n.op)](ev(n.operand)))
        if isinstance(n, ast.BinOp):
            return _binary(n.op, ev(n.left), ev(n.right))
        if isinstance(n, ast.BoolOp):
            result: Any = None
            for value_node in n.values:
                result = ev(value_node)
                if (not result) if isinstance(n.op, ast.And) else bool(result):
                    return result
            return result
        if isinstance(n, ast.Compare):
            left = ev(n.left)
            for op, comparator in zip(n.ops, n.comparators):
                right = ev(comparator)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(n, ast.IfExp):
            return ev(n.body) if ev(n.test) else ev(n.orelse)
        if isinstance(n, ast.Subscript):
            if isinstance(n.slice, ast.Slice):
                parts = [None if p is None else ev(p) for p in (n.slice.lower, n.slice.upper, n.slice.step)]
                return ev(n.value)[slice(*parts)]
            return ev(n.value)[ev(n.slice)]
        if isinstance(n, ast.Call):
            func = _safe_callable(n.func)
            if func is None:
                raise CheckFailed(f"not evaluable here: {ast.unparse(n)}")
            return _bounded(func(*[ev(a) for a in n.args], **{k.arg: ev(k.value) for k in n.keywords if k.arg}))
        raise CheckFailed(f"not evaluable here: {ast.unparse(n)}")

    return ev(node)


def check_passes(check: ast.expr, leaves: dict[str, Any], bindings: dict[str, Any]) -> bool:
    """Whether one assert holds on the program's values (False where any value it needs is missing or bad)."""
    try:
        return bool(evaluate(check, leaves, bindings))
    except (CheckFailed, ArithmeticError, TypeError, ValueError, KeyError, IndexError, AttributeError,
            RecursionError, MemoryError):
        return False


def leaf_values(plan: AssertPlan, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """(value or exception by leaf name, whether the program and every exec step ran) from the sandbox's
    messages; the first message of a step counts."""
    by_step: dict[int, dict[str, Any]] = {}
    for message in messages:
        step = message.get("step")
        if type(step) is int and step not in by_step:
            by_step[step] = message
    ran = {"program": "ok"} in messages
    leaves: dict[str, Any] = {}
    for index, step in enumerate(plan.steps):
        got = by_step.get(index)
        ok = got is not None and got.get("ok") is True
        if "exec" in step:
            ran = ran and ok
            continue
        if not ok or got is None:
            leaves[f"{LEAF_PREFIX}{index}"] = CheckFailed(f"step {index} failed")
            continue
        try:
            leaves[f"{LEAF_PREFIX}{index}"] = decode(got.get("value"))
        except (ValueError, RecursionError) as err:
            leaves[f"{LEAF_PREFIX}{index}"] = CheckFailed(f"step {index}: {err}")
    return leaves, ran
