"""Values against kinds: whether a YAML value (a default, a workload value, an ADT field)
is a value of a kind, and the evaluator's value for it.

A YAML value is plain: ints, floats, booleans, strings, lists, ``null`` and, for an ADT,
``{constructor: {field: value}}``. The evaluator (:mod:`tileops.spec.evaluate`) wants shapes
as tuples and ADT values as :class:`~tileops.spec.evaluate.AdtValue`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..evaluate import AdtValue, EvalError, Scope, evaluate
from ..kinds import (
    AdtK,
    AxesK,
    BoolK,
    DimK,
    DTypeK,
    EnumK,
    FloatK,
    IntK,
    Kind,
    MaybeK,
    PerAxisK,
    ShapeK,
    kind_from_expr,
)
from ..schema import AdtDef

__all__ = ["case_key", "conforms", "domain", "fmt_value", "same_value", "to_value"]


def domain(k: Kind, adts: Mapping[str, AdtDef]) -> list[Any]:
    """Every value of a discriminant kind (a family matches on it); [] for others."""
    if isinstance(k, BoolK):
        return [False, True]
    if isinstance(k, EnumK):
        return list(k.values)
    if isinstance(k, DTypeK):
        return list(k.members)
    if isinstance(k, AdtK):
        return list(adts[k.name].constructors) if k.name in adts else []
    return []


def same_value(a: Any, b: Any) -> bool:
    """Equality that keeps booleans apart from ints (YAML ``1`` is not ``true``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b


def case_key(combo: tuple) -> tuple:
    """A hashable key for a tuple of discriminant values that tells ``1`` from ``True``."""
    return tuple((type(v).__name__, v) for v in combo)


def fmt_value(v: Any) -> str:
    """A discriminant value as the YAML spells it (``true``, not ``True``)."""
    return str(v).lower() if isinstance(v, bool) else str(v)


def conforms(v: Any, k: Kind, adts: Mapping[str, AdtDef]) -> str | None:  # noqa: C901
    """None when ``v`` is a value of ``k``; else what was expected instead."""
    if isinstance(k, MaybeK):
        return None if v is None else conforms(v, k.inner, adts)
    if v is None:
        return "None is only a value of Maybe[...] (write the type as X | None)"
    if isinstance(k, BoolK):
        return None if isinstance(v, bool) else "expected true or false"
    if isinstance(k, DimK):
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
        return None if ok else "expected a non-negative integer"
    if isinstance(k, IntK):
        ok = isinstance(v, int) and not isinstance(v, bool)
        return None if ok else "expected an integer"
    if isinstance(k, FloatK):
        ok = isinstance(v, int | float) and not isinstance(v, bool)
        return None if ok else "expected a number"
    if isinstance(k, ShapeK):
        ok = isinstance(v, list | tuple) and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
        return None if ok else "expected a list of non-negative integers"
    if isinstance(k, AxesK):
        if isinstance(v, int) and not isinstance(v, bool):
            return None
        ok = isinstance(v, list | tuple) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in v)
        return None if ok else "expected an axis (an integer) or a list of axes"
    if isinstance(k, PerAxisK):
        if isinstance(v, int) and not isinstance(v, bool):
            return None
        ok = isinstance(v, list | tuple) and len(v) in (1, k.n) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in v)
        return None if ok else f"expected an integer or a list of {k.n} integers"
    if isinstance(k, EnumK):
        return None if v in k.values else f"expected one of {', '.join(map(repr, k.values))}"
    if isinstance(k, DTypeK):
        return None if v in k.members else f"expected one of {', '.join(k.members)}"
    if isinstance(k, AdtK):
        adt = adts.get(k.name)
        if adt is None:
            return f"ADT {k.name} is not defined"
        if not (isinstance(v, dict) and len(v) == 1):
            return (f"write an ADT value as {{constructor: {{field: value}}}}; constructors: "
                    f"{', '.join(adt.constructors)}")
        (ctor_name, fields), = v.items()
        ctor = adt.constructors.get(ctor_name)
        if ctor is None:
            return f"{ctor_name!r} is not a constructor of {k.name} ({', '.join(adt.constructors)})"
        fields = fields or {}
        if set(fields) != set(ctor.fields):
            return f"{ctor_name} has fields {', '.join(ctor.fields) or 'none'}; got " \
                   f"{', '.join(fields) or 'none'}"
        for fn, fex in ctor.fields.items():
            err = conforms(fields[fn], kind_from_expr(fex.node, set(adts)), adts)
            if err:
                return f"{ctor_name}.{fn}: {err}"
        if ctor.invariant is not None:
            scope = Scope({fn: to_value(fv, kind_from_expr(ctor.fields[fn].node, set(adts)),
                                         adts) for fn, fv in fields.items()})
            try:
                if not evaluate(ctor.invariant.node, scope):
                    return f"{ctor_name} breaks its invariant {ctor.invariant.text!r}"
            except EvalError as exc:
                return f"{ctor_name}: invariant: {exc}"
        return None
    return None


def to_value(v: Any, k: Kind, adts: Mapping[str, AdtDef]) -> Any:
    """The evaluator's value for a YAML value of kind ``k`` (already conforming)."""
    if isinstance(k, MaybeK):
        return None if v is None else to_value(v, k.inner, adts)
    if isinstance(k, ShapeK) or (isinstance(k, PerAxisK | AxesK) and isinstance(v, list)):
        return tuple(v)
    if isinstance(k, AdtK) and isinstance(v, dict):
        (ctor_name, fields), = v.items()
        ctor = adts[k.name].constructors[ctor_name]
        return AdtValue(ctor_name, {
            fn: to_value(fv, kind_from_expr(ctor.fields[fn].node, set(adts)), adts)
            for fn, fv in (fields or {}).items()
        })
    return v
