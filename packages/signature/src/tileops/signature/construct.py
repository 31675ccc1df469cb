"""The construction check: a plan's construction params against their kinds, normalised,
and the refinements that read only params.

``construct`` runs on every op construction, so it is plain Python over the entry (no
generated code): the params are checked and normalised one by one (:func:`normalize_params`;
``[4096]`` and ``(4096,)`` become the same Shape), keyed (:func:`point_key`, equal params give
one construction point), and the refinements that name only params or lets over them are
evaluated once per new point (:func:`check_param_refinements`). A failure raises a
:class:`ConstructionError` naming the param, what its kind expects, what was given and the
spec line.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from tileops.spec import AdtValue, EvalError, Scope, evaluate, kind_from_expr
from tileops.spec.bounds import int_in_range
from tileops.spec.kinds import (
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
)

from .common import fmt_value
from .errors import ConstructionError
from .sizes import SIZE, as_int, as_size, normalize_shape, not_a_size

if TYPE_CHECKING:  # pragma: no cover
    from .plan import SignaturePlan

__all__ = ["check_param_refinements", "const_lets", "normalize_params", "point_key"]


def normalize_params(plan: SignaturePlan, params: Mapping[str, Any]) -> dict[str, Any]:
    """Every construction param of ``plan``: the given value or the default, checked against
    its kind and normalised, in declaration order."""
    unknown = [k for k in params if k not in plan.sig.params]
    if unknown:
        _construction_error(
            plan, unknown[0], "one of: " + (", ".join(plan.param_names) or "no params"),
            repr(params[unknown[0]]), f"{plan.name} has no construction param "
            f"{unknown[0]!r}", params)
    values: dict[str, Any] = {}
    for n, p in plan.sig.params.items():
        if n in params:
            v = params[n]
        elif not p.required:
            v = p.default
        else:
            _construction_error(plan, n, f"{n}: {plan.kinds[n]}", "nothing",
                                f"{n} is required (it has no default)", params)
        values[n] = _normalize(plan, n, v, plan.kinds[n], params)
    return values


def point_key(plan: SignaturePlan, values: Mapping[str, Any]) -> tuple:
    """The cache key of the construction point of normalised ``values``."""
    return tuple(_hashable(values[n]) for n in plan.param_names)


def _construction_error(plan: SignaturePlan, n: str, expected: str, seen: str, because: str,
                        params: Mapping[str, Any]) -> None:
    call = ", ".join(f"{k}={fmt_value(v)}" for k, v in params.items()) or "(no params)"
    root = n.partition(".")[0]  # an ADT field (layout.max_m) is written under its param
    where = plan.where(f"signature.params.{root}") if root in plan.sig.params else \
        plan.where("signature.params")
    raise ConstructionError(plan.name, n, expected, seen, because, call, {}, where)


def _normalize(plan: SignaturePlan, n: str, v: Any, k: Kind,  # noqa: C901
               params: Mapping[str, Any], maybe: Kind | None = None) -> Any:
    """``v`` for the param (or ADT field) ``n`` of kind ``k``, checked and normalised."""

    def bad(why: str) -> None:
        # a Maybe param is reported as declared (Maybe[Int]); None was also accepted
        _construction_error(plan, n, f"{n}: {maybe or k}", f"{_shown(v)} ({type(v).__name__})",
                            why if maybe is None else f"{why}, or None", params)

    if isinstance(k, MaybeK):
        return None if v is None else _normalize(plan, n, v, k.inner, params, maybe=k)
    out = _normalized(plan, n, v, k, params, bad, maybe)
    for i in (out if isinstance(out, tuple) else (out,)):
        if type(i) is int and not int_in_range(i):
            bad(f"{n} holds an int of {i.bit_length()} bits: the integers a spec computes with "
                f"are at most 2**63 - 1 in magnitude")
    return out


def _shown(v: Any) -> str:
    """``repr(v)``, but where it holds an int of more than 256 bits, :func:`fmt_value`'s form
    (the int by its size)."""
    if isinstance(v, int | list | tuple) and not isinstance(v, bool) and any(
            isinstance(x, int) and x.bit_length() > 256
            for x in (v if isinstance(v, list | tuple) else (v,))):
        return fmt_value(v)
    return repr(v)


def _normalized(plan: SignaturePlan, n: str, v: Any, k: Kind,  # noqa: C901
                params: Mapping[str, Any], bad: Callable[[str], None],
                maybe: Kind | None) -> Any:
    """``v`` checked against kind ``k`` (not a Maybe; ``maybe`` the declared Maybe, if any)
    and normalised; ``bad`` refuses it."""
    if isinstance(k, BoolK):
        if not isinstance(v, bool):
            bad(f"{n} must be True or False")
        return v
    if isinstance(k, DimK):
        i = as_size(v)
        if i is None:
            bad(f"{n} is a Dim: {SIZE}" if as_int(v) is None else
                f"{n} is a Dim and must be >= 0")
        return i
    if isinstance(k, IntK):
        i = as_int(v)
        if i is None:
            bad(f"{n} must be an int")
        return i
    if isinstance(k, FloatK):
        # a real number of any library (numpy's float32 too), not a bool; an int stays an int
        # (torch's Scalar keeps the Python type: beside an integer tensor an int bound keeps
        # its dtype, a float one promotes it, so a dtype expression reads which it is)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or type(v).__name__ == "bool_":
            bad(f"{n} must be a number")
        if isinstance(v, numbers.Integral) and -(1 << 63) <= int(v) < 1 << 63:
            return int(v)  # (a larger one, past every integer dtype, as a float)
        try:
            return float(v)
        except OverflowError:  # an int past float's range
            bad(f"{n} is an int of {int(v).bit_length()} bits, past the largest float "
                f"(about 1.8e308)")
    if isinstance(k, ShapeK):
        if not isinstance(v, list | tuple):
            bad(f"{n} must be a list or tuple of sizes: {SIZE}")
        shape = normalize_shape(v)
        if shape is None:
            i = next(i for i, x in enumerate(v) if as_size(x) is None)
            bad(not_a_size(f"{n}[{i}]", v[i]))
        return tuple(shape)
    if isinstance(k, AxesK):
        # axes of any sign; which are in range (and that none repeats) depends on a tensor's
        # rank, so reduce_shape / axis check them where they meet one
        i = as_int(v)
        if i is not None:
            return i
        items = [as_int(x) for x in v] if isinstance(v, list | tuple) else None
        if items is not None and None not in items:
            return tuple(items)
        bad(f"{n} must be an int or a tuple of ints (axes)")
    if isinstance(k, PerAxisK):
        # an Int per axis (the kind is spelled int | tuple[int, ...]): any sign, as for an
        # Int param; the spec's refinements bound it (a kernel size > 0, a padding >= 0)
        i = as_int(v)
        if i is not None:
            return i
        items = [as_int(x) for x in v] if isinstance(v, list | tuple) else None
        if items is not None and len(items) in (1, k.n) and None not in items:
            return tuple(items)
        bad(f"{n} must be an int or a tuple of {k.n} ints")
    if isinstance(k, EnumK):
        if v not in k.values:
            bad(f"{n} must be one of {', '.join(map(repr, k.values))}")
        return v
    if isinstance(k, DTypeK):
        ad = plan.adapter
        name = v if isinstance(v, str) else ad.spec_name(v)
        if name is None:  # a dtype object this adapter does not map (numpy's, to torch's)
            _construction_error(plan, n, f"{n}: {maybe or k}", ad.describe(v),
                                ad.refusal(n, v, f"{n} must be one of {', '.join(k.members)}")
                                + (", or None" if maybe is not None else ""), params)
        if name not in k.members:
            bad(f"{n} must be one of {', '.join(k.members)}")
        return name
    if isinstance(k, AdtK):
        return _adt_value(plan, n, v, k, bad, params)
    return v  # pragma: no cover - every kind is handled above


def _adt_value(plan: SignaturePlan, n: str, v: Any, k: AdtK, bad: Callable[[str], None],
               params: Mapping[str, Any]) -> AdtValue:
    adt = plan.adts[k.name]
    if isinstance(v, AdtValue):
        ctor_name, fields = v.constructor, dict(v.fields)
    else:
        path = f"{type(v).__module__}.{type(v).__qualname__}"
        match = [c for c, ctor in adt.constructors.items() if ctor.python == path]
        if not match:
            bad(f"{n} must be a {k.name}: one of "
                + ", ".join(f"{c.python}" for c in adt.constructors.values()))
        ctor_name = match[0]
        fields = {f: getattr(v, f) for f in adt.constructors[ctor_name].fields
                  if hasattr(v, f)}  # a missing field is reported below
    ctor = adt.constructors.get(ctor_name)
    if ctor is None:
        bad(f"{ctor_name!r} is not a constructor of {k.name}")
    assert ctor is not None
    if set(fields) != set(ctor.fields):
        bad(f"{ctor_name} has fields {', '.join(ctor.fields)}")
    for fn, fex in ctor.fields.items():
        fk = kind_from_expr(fex.node, set(plan.adts))
        fields[fn] = _normalize(plan, f"{n}.{fn}", fields[fn], fk, params)
    if ctor.invariant is not None:
        try:
            ok = evaluate(ctor.invariant.node, Scope(fields))
        except EvalError as exc:
            ok, why = False, str(exc)
        else:
            why = f"{ctor_name} breaks its invariant {ctor.invariant.text!r}"
        if not ok:
            bad(why)
    return AdtValue(ctor_name, fields)


def check_param_refinements(plan: SignaturePlan, values: dict[str, Any],
                            params: Mapping) -> None:
    """The refinements that read only construction params (directly or through lets)."""
    params_only = set(plan.sig.params)
    lets = const_lets(plan, values)
    scope = Scope({**values, **lets}, plan.sig.types)
    for i, rule in enumerate(plan.sig.shape_rules):
        names = set(rule.names())
        # present() of a Maybe param is decided here too; a rule that names a tensor
        # (present(weight)) or a call-time index is left to the call check
        if names and names <= params_only | set(lets):
            try:
                ok = evaluate(rule.node, scope)
            except EvalError as exc:
                ok, extra = False, f": {exc}"
            else:
                extra = ""
            if not ok:
                shown = ", ".join(f"{m} = {fmt_value(scope.values[m])}"
                                  for m in rule.names() if m in scope.values)
                call = ", ".join(f"{k}={fmt_value(v)}" for k, v in params.items())
                raise ConstructionError(
                    plan.name, ", ".join(_params_of(plan, rule.names())),
                    rule.text, shown, f"refinement {rule.text!r} does not hold{extra}",
                    call or "(no params)", {}, plan.where(f"signature.shape_rules[{i}]"))


def returned_outputs(plan: SignaturePlan, values: dict[str, Any]) -> tuple[str, ...]:
    """The outputs a call's result holds at these params: those whose ``returned`` holds."""
    if not plan.may_leave_out:
        return plan.output_names
    scope = Scope({**values, **const_lets(plan, values)}, plan.sig.types)
    return tuple(n for n, d in plan.sig.outputs.items() if evaluate(d.returned.node, scope))


def check_returned(plan: SignaturePlan, values: dict[str, Any], params: Mapping) -> None:
    """A construction whose result would hold no output is refused, naming the params the
    outputs' ``returned`` predicates read."""
    if returned_outputs(plan, values):
        return
    names = [m for d in plan.sig.outputs.values() for m in d.returned.names()]
    rule = " or ".join(d.returned.text for d in plan.sig.outputs.values())
    shown = ", ".join(f"{m} = {fmt_value(values[m])}" for m in dict.fromkeys(names)
                      if m in values)
    call = ", ".join(f"{k}={fmt_value(v)}" for k, v in params.items())
    raise ConstructionError(
        plan.name, ", ".join(_params_of(plan, names)), rule, shown,
        "no output would be returned (each output's returned is false)",
        call or "(no params)", {}, plan.where("signature.outputs"))


def _params_of(plan: SignaturePlan, names: list[str]) -> list[str]:
    """The construction params ``names`` read, directly or through let definitions."""
    out: dict[str, None] = {}
    seen: set[str] = set()

    def visit(n: str) -> None:
        if n in seen:
            return
        seen.add(n)
        if n in plan.sig.params:
            out[n] = None
        elif n in plan.sig.let:
            for m in plan.sig.let[n].names():
                visit(m)

    for n in names:
        visit(n)
    return list(out)


def _hashable(v: Any) -> Any:
    if isinstance(v, AdtValue):
        return (v.constructor, tuple(sorted((k, _hashable(x)) for k, x in v.fields.items())))
    if isinstance(v, list):
        return tuple(v)
    if isinstance(v, float):
        if v != v:  # NaN != NaN: one key for every NaN, not a new point
            return ("nan",)
        return (float, v)  # not 1's point: a float param keeps an int as an int (_normalized)
    return v


def const_lets(plan: SignaturePlan, values: Mapping[str, Any]) -> dict[str, Any]:
    """let definitions that depend only on construction params, evaluated."""
    out: dict[str, Any] = {}
    known = set(values)
    changed = True  # validated: no cycles; iterate to a fixpoint
    while changed:
        changed = False
        for n, ex in plan.sig.let.items():
            if n in out or not set(ex.names()) <= known | set(out):
                continue
            try:
                out[n] = evaluate(ex.node, Scope({**values, **out}, plan.sig.types))
            except EvalError:
                continue
            changed = True
    return out

