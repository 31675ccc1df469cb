"""A tree-walking interpreter of the expression AST over concrete values.

Used to instantiate workload rows (let, type families, shapes, refinements) and as the plain
reference the generated checks are tested against. It evaluates only the closed grammar and
the closed primitive table; nothing is handed to Python's ``eval``.

Values: ``int`` (Dim, Int), ``float``, ``bool``, ``str`` (enum members and dtype names),
``tuple[int, ...]`` (Shape), ``None`` (an absent Maybe), :class:`AdtValue`.

Every value it computes is held to the bounds of :mod:`.bounds`: an integer of at most
``MAX_INT``, a finite real float, a sequence of at most ``MAX_SEQUENCE`` items. A power that
would exceed them is refused before it is computed, and so is the repetition of a sequence
or a string (``*`` takes numbers), so no expression, however written, costs more than a few
machine operations a node. The signature package evaluates construction-time rules and lets
through this interpreter, so op construction is bounded by the same checks.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import expr as E
from .bounds import MAX_INT, MAX_POW_EXPONENT, MAX_SEQUENCE, int_in_range
from .kinds import DTYPES
from .primitives import GENERATORS, PRIMITIVES, PrimitiveError
from .schema import TypeFamily

__all__ = [
    "AdtValue",
    "BoundError",
    "EvalError",
    "Scope",
    "bound_error_of_constants",
    "eval_shape",
    "evaluate",
    "family_case",
]


class EvalError(ValueError):
    """An expression that cannot be evaluated with the values given."""


class BoundError(EvalError):
    """A value that would exceed the bounds of :mod:`.bounds` (refused, not computed)."""


@dataclass(frozen=True)
class AdtValue:
    """A value of an ADT: the constructor's name and its field values."""

    constructor: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class Scope:
    """What names mean during evaluation."""

    values: Mapping[str, Any]
    families: Mapping[str, TypeFamily] = field(default_factory=dict)
    #: tensor name -> given? (for present(x) on optional inputs / nullable outputs)
    tensors: Mapping[str, bool] = field(default_factory=dict)
    generators: bool = False  # allow generator calls (workload `values`)


_ARITH = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "//": operator.floordiv,
    "%": operator.mod,
    "**": operator.pow,
}
_CMP = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "in": lambda a, b: a in b,
    "not in": lambda a, b: a not in b,
}


def evaluate(node: E.Node, scope: Scope) -> Any:  # noqa: C901 - one case per node type
    if isinstance(node, E.Name):
        if node.id in scope.values:
            return scope.values[node.id]
        if node.id in scope.tensors:
            raise EvalError(f"tensor {node.id!r} has no value; use present({node.id})")
        if node.id in DTYPES:  # a dtype name is a constant: T == float16
            return node.id
        raise EvalError(f"{node.id!r} has no value here")
    if isinstance(node, E.Int | E.Float | E.Str | E.Bool):
        return node.value
    if isinstance(node, E.NoneLit):
        return None
    if isinstance(node, E.Attr):
        base = evaluate(node.value, scope)
        if node.attr == "value" and not isinstance(base, AdtValue):
            if base is None:
                raise EvalError(f"{E.unparse(node.value)} is absent; guard with present()")
            return base
        if isinstance(base, AdtValue):
            if node.attr in base.fields:
                return base.fields[node.attr]
            raise EvalError(
                f"{E.unparse(node.value)} is {base.constructor!r}, which has no field "
                f"{node.attr!r}"
            )
        raise EvalError(f"{E.unparse(node)}: {type(base).__name__} has no attribute")
    if isinstance(node, E.List | E.Tuple):
        out: list[Any] = []
        for item in node.items:
            if isinstance(item, E.Starred):
                v = evaluate(item.value, scope)
                if not isinstance(v, tuple | list):
                    raise EvalError(f"*{E.unparse(item.value)} needs a Shape, got {v!r}")
                out.extend(v)
                if len(out) > MAX_SEQUENCE:
                    _bounded(out, node)
            else:
                out.append(evaluate(item, scope))
        return tuple(out)
    if isinstance(node, E.Subscript):
        head = E.dotted_name(node.value)
        if head is not None and head in scope.families:
            return eval_shape(_apply_family(scope.families[head], node, scope), scope)
        base = evaluate(node.value, scope)
        if len(node.index) != 1:
            raise EvalError(f"{E.unparse(node)}: one index expected")
        i = evaluate(node.index[0], scope)
        try:
            return base[i]
        except (IndexError, TypeError, KeyError) as exc:
            raise EvalError(f"{E.unparse(node)}: {exc}") from None
    if isinstance(node, E.Call):
        return _bounded(_call(node, scope), node, items=True)
    if isinstance(node, E.UnaryOp):
        v = evaluate(node.operand, scope)
        if node.op == "not":
            return not v
        try:
            return -v
        except TypeError as exc:
            raise EvalError(f"{E.unparse(node)}: {exc}") from None
    if isinstance(node, E.BinOp):
        a, b = evaluate(node.left, scope), evaluate(node.right, scope)
        if node.op == "|":
            raise EvalError("'|' builds kinds; it has no value")
        return _bounded(_arith(node, a, b), node)
    if isinstance(node, E.BoolOp):
        if node.op == "and":
            result: Any = True
            for v in node.values:
                result = evaluate(v, scope)
                if not result:
                    return result
            return result
        result = False
        for v in node.values:
            result = evaluate(v, scope)
            if result:
                return result
        return result
    if isinstance(node, E.Compare):
        left = evaluate(node.left, scope)
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = evaluate(comp, scope)
            if isinstance(left, list):
                left = tuple(left)
            if isinstance(right, list):
                right = tuple(right)
            try:
                if not _CMP[op](left, right):
                    return False
            except TypeError as exc:
                raise EvalError(f"{E.unparse(node)}: {exc}") from None
            left = right
        return True
    if isinstance(node, E.IfExp):
        return evaluate(node.body if evaluate(node.test, scope) else node.orelse, scope)
    raise EvalError(f"{node} has no value")  # str(): a bare Starred does not unparse


def _arith(node: E.BinOp, a: Any, b: Any) -> Any:
    """``a op b``, refused before it is computed where the result could not be bounded."""
    if node.op == "*" and (isinstance(a, str | tuple | list) or isinstance(b, str | tuple | list)):
        raise BoundError(f"{E.unparse(node)}: '*' multiplies numbers; a "
                        f"{type(a if isinstance(a, str | tuple | list) else b).__name__} "
                        f"cannot be repeated")
    if (node.op == "**" and isinstance(a, int) and isinstance(b, int)
            and abs(a) >= 2 and b > MAX_POW_EXPONENT):
        raise BoundError(f"{E.unparse(node)}: {a} ** {b} exceeds {MAX_INT} (2**63 - 1), the "
                        f"largest integer a spec may compute")
    try:
        return _ARITH[node.op](a, b)
    except ZeroDivisionError:
        raise EvalError(f"{E.unparse(node)}: division by zero") from None
    except OverflowError:
        raise BoundError(f"{E.unparse(node)}: the result is too large for a float") from None
    except TypeError as exc:
        raise EvalError(f"{E.unparse(node)}: {exc}") from None


def _bounded(v: Any, node: E.Node, items: bool = False) -> Any:
    """``v``, the value of ``node``, if it is within the bounds; ``items``: check each item
    of a sequence too (a primitive's result; an arithmetic one is never a sequence)."""
    what = None
    if isinstance(v, int) and not isinstance(v, bool):
        if not int_in_range(v):
            what = f"exceeds {MAX_INT} (2**63 - 1), the largest integer a spec may compute"
    elif isinstance(v, float):
        if not math.isfinite(v):
            what = f"is {v}, not a finite number"
    elif isinstance(v, complex):
        what = "is a complex number"
    elif isinstance(v, tuple | list):
        if len(v) > MAX_SEQUENCE:
            what = f"has {len(v)} items; at most {MAX_SEQUENCE} are allowed"
        elif items:
            for x in v:
                if isinstance(x, int) and not int_in_range(x):
                    what = f"holds an item that exceeds {MAX_INT} (2**63 - 1)"
                    break
    if what is not None:
        raise BoundError(f"{E.unparse(node)}: the value {what}")
    return v


def _call(node: E.Call, scope: Scope) -> Any:
    prim = PRIMITIVES.get(node.func)
    if prim is None and scope.generators:
        prim = GENERATORS.get(node.func)
    if prim is None:
        raise EvalError(f"unknown primitive {node.func!r}")
    if prim.takes_names:
        (arg,) = node.args
        name = E.dotted_name(arg)
        if name in scope.tensors:
            return scope.tensors[name]
        return evaluate(arg, scope) is not None
    args = []
    for a in node.args:
        if isinstance(a, E.Starred):
            args.extend(evaluate(a.value, scope))
        else:
            args.append(evaluate(a, scope))
    kwargs = {k: evaluate(v, scope) for k, v in node.kwargs}
    try:
        return prim.impl(*args, **kwargs)
    except PrimitiveError as exc:
        raise EvalError(f"{E.unparse(node)}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise EvalError(f"{E.unparse(node)}: {exc}") from None


def bound_error_of_constants(node: E.Node) -> BoundError | None:
    """The first bound broken by a part of ``node`` that names nothing (``9 ** 9 ** 9`` in
    ``M * 9 ** 9 ** 9``), or None. The validator calls it on every expression it checks, so
    a constant beyond the bounds is refused at its line whether or not any workload reaches
    it; the parts are evaluated largest first, each at most once."""
    stack = [node]
    while stack:
        sub = stack.pop()
        if not E.names(sub) and not isinstance(sub, E.Starred):
            try:
                evaluate(sub, Scope({}))
            except BoundError as err:
                return err
            except EvalError:
                pass  # not a value (a kind, a string operation): other rules judge it
            continue
        stack.extend(_children(sub))
    return None


def _children(node: E.Node) -> list[E.Node]:
    out: list[E.Node] = []
    for f in node.__struct_fields__:
        v = getattr(node, f)
        if isinstance(v, E.Node):
            out.append(v)
        elif isinstance(v, tuple):
            out.extend(x[1] if isinstance(x, tuple) else x for x in v
                       if isinstance(x, E.Node | tuple))
    return out


def family_case(fam: TypeFamily, values: Mapping[str, Any]) -> E.Node:
    """The ``is`` expression of the case that matches the discriminant values."""
    key = tuple(values[d] for d in fam.discriminants)
    for case in fam.cases:
        whens = case.when if isinstance(case.when, list | tuple) else [case.when]
        if len(fam.discriminants) == 1:
            whens = [case.when]
        if len(whens) != len(key):
            continue
        if all(_matches(w, k) for w, k in zip(whens, key, strict=True)):
            return case.is_.node
    raise EvalError(f"no case of the type family matches {', '.join(map(repr, key))}")


def _matches(when: Any, value: Any) -> bool:
    if when == "_":
        return True
    if isinstance(value, AdtValue):
        return when == value.constructor
    if isinstance(value, bool) or isinstance(when, bool):
        return isinstance(value, bool) and isinstance(when, bool) and value == when
    return when == value


def _apply_family(fam: TypeFamily, node: E.Subscript, scope: Scope) -> E.Node:
    params = list(fam.params)
    if len(node.index) != len(params):
        raise EvalError(
            f"{E.unparse(node)}: the family takes {len(params)} arguments "
            f"({', '.join(params)}), got {len(node.index)}"
        )
    args = {p: evaluate(a, scope) for p, a in zip(params, node.index, strict=True)}
    chosen = family_case(fam, args)
    inner = Scope({**scope.values, **args}, scope.families, scope.tensors, scope.generators)
    return E.List(tuple(_const(v) for v in _as_shape(evaluate(chosen, inner), chosen)))


def _as_shape(v: Any, node: E.Node) -> tuple[int, ...]:
    if not isinstance(v, tuple):
        raise EvalError(f"{E.unparse(node)} is not a shape: {v!r}")
    return v


def _const(v: int) -> E.Node:
    return E.Int(v) if v >= 0 else E.UnaryOp("-", E.Int(-v))


def eval_shape(node: E.Node, scope: Scope) -> tuple[int, ...]:
    """A shape expression (``[*B, N]``, ``Mat[t, M, K]``) to a tuple of ints."""
    v = evaluate(node, scope)
    if not isinstance(v, tuple) or not all(isinstance(d, int) for d in v):
        raise EvalError(f"{E.unparse(node)} is not a shape: {v!r}")
    return v
