"""Kind inference: the kind of every expression of an entry, or why it has none.

Every expression rule of the validator (``kind``, ``unknown-name``, and ``present(x)`` of the
``effects`` rule) is an :class:`InferError` raised here; the rule modules add the path and the
expression text.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from .. import expr as E
from ..kinds import (
    DTYPES,
    AdtK,
    BoolK,
    DimK,
    DTypeK,
    EnumK,
    FloatK,
    IntK,
    Kind,
    MaybeK,
    ShapeK,
    is_numeric,
    kind_from_expr,
)
from ..primitives import (
    DTYPE_PRIMITIVES,
    GENERATORS,
    PRIMITIVES,
    Primitive,
    PrimitiveError,
    accepts,
    describe,
)
from ..schema import AdtDef, TypeFamily

__all__ = ["InferError", "KindInference", "NoneK", "assignable", "join_kinds"]


class InferError(Exception):
    """An expression whose kinds do not fit; ``rule`` is the rule it breaks (``kind``,
    ``unknown-name`` or ``effects``)."""

    def __init__(self, message: str, rule: str = "kind") -> None:
        super().__init__(message)
        self.message = message
        self.rule = rule


class NoneK(Kind, frozen=True):
    """The kind of the literal ``None``: only comparable with a Maybe, only assignable to one."""

    def __str__(self) -> str:
        return "None"


class KindInference:
    """Infers the kind of an expression in a scope of index kinds, the entry's type families,
    its tensors (name -> may be absent) and the ADTs; raises :class:`InferError`.

    ``generators`` admits the generator calls (only an input's ``values`` may call them);
    ``family_kinds`` gives each family's parameter kinds, for checking its applications.
    """

    def __init__(
        self,
        scope: Mapping[str, Kind],
        families: Mapping[str, TypeFamily],
        tensors: Mapping[str, bool],  # name -> may be absent
        adts: Mapping[str, AdtDef],
        generators: bool = False,
        family_kinds: Mapping[str, dict[str, Kind]] | None = None,
    ) -> None:
        self.scope = scope
        self.families = families
        self.tensors = tensors
        self.adts = adts
        self.generators = generators
        self.family_kinds = family_kinds or {}

    def infer(self, node: E.Node) -> Kind:  # noqa: C901 - one case per node type
        if isinstance(node, E.Name):
            if node.id in self.scope:
                return self.scope[node.id]
            if node.id in self.tensors:
                raise InferError(f"tensor {node.id!r} is not a value; write present({node.id})")
            if node.id in DTYPES:
                return DTypeK((node.id,))
            raise InferError(f"unknown name {node.id!r}{self._suggest(node.id)}", "unknown-name")
        if isinstance(node, E.Int):
            return DimK()
        if isinstance(node, E.Float):
            return FloatK()
        if isinstance(node, E.Bool):
            return BoolK()
        if isinstance(node, E.Str):
            return EnumK((node.value,))
        if isinstance(node, E.NoneLit):
            return NoneK()
        if isinstance(node, E.Ellipsis_):
            raise InferError("'...' is only part of kind syntax")
        if isinstance(node, E.Attr):
            return self._attr(node)
        if isinstance(node, E.List | E.Tuple):
            for item in node.items:
                self._shape_item(item)
            return ShapeK()
        if isinstance(node, E.Subscript):
            return self._family_app(node)
        if isinstance(node, E.Call):
            return self._call(node)
        if isinstance(node, E.Starred):
            raise InferError(f"{node}: '*' splices a Shape into a list; use it inside [...]")
        if isinstance(node, E.UnaryOp):
            k = self.infer(node.operand)
            if node.op == "not":
                self._want_bool(k, node.operand)
                return BoolK()
            if not is_numeric(k):
                raise InferError(f"'-' needs a number; {E.unparse(node.operand)} is {k}")
            return FloatK() if isinstance(k, FloatK) else IntK()
        if isinstance(node, E.BinOp):
            if node.op == "|":
                raise InferError(f"{E.unparse(node)}: '|' is only part of kind syntax")
            a, b = self.infer(node.left), self.infer(node.right)
            for k, side in ((a, node.left), (b, node.right)):
                if not is_numeric(k):
                    raise InferError(f"{node.op!r} needs numbers; {E.unparse(side)} is {k}")
            if node.op == "/" or isinstance(a, FloatK) or isinstance(b, FloatK):
                return FloatK()
            if node.op == "-" or isinstance(a, IntK) or isinstance(b, IntK):
                return IntK()
            return DimK()
        if isinstance(node, E.BoolOp):
            for v in node.values:
                self._want_bool(self.infer(v), v)
            return BoolK()
        if isinstance(node, E.Compare):
            left = node.left
            lk = self.infer(left)
            for op, right in zip(node.ops, node.comparators, strict=True):
                rk = self.infer(right)
                self._comparable(op, lk, rk, left, right)
                left, lk = right, rk
            return BoolK()
        if isinstance(node, E.IfExp):
            self._want_bool(self.infer(node.test), node.test)
            a, b = self.infer(node.body), self.infer(node.orelse)
            return join_kinds(a, b, node)
        raise InferError(f"{E.unparse(node)} has no kind")  # pragma: no cover

    # -- helpers --

    def _suggest(self, name: str) -> str:
        pool = list(self.scope) + list(self.tensors)
        close = difflib.get_close_matches(name, pool, n=1)
        return f" (did you mean {close[0]!r}?)" if close else ""

    def _want_bool(self, k: Kind, node: E.Node) -> None:
        if not isinstance(k, BoolK):
            raise InferError(f"{E.unparse(node)} is {k}, but a Bool is needed here")

    def _shape_item(self, item: E.Node) -> None:
        if isinstance(item, E.Starred):
            k = self.infer(item.value)
            if not isinstance(k, ShapeK):
                raise InferError(f"*{E.unparse(item.value)} splices a Shape, but it is {k}")
            return
        k = self.infer(item)
        if isinstance(k, ShapeK):
            raise InferError(
                f"{E.unparse(item)} is a Shape; splice it into the list as *{E.unparse(item)}"
            )
        if not isinstance(k, DimK | IntK):
            raise InferError(f"an axis length must be a Dim, but {E.unparse(item)} is {k}")

    def _attr(self, node: E.Attr) -> Kind:
        base = self.infer(node.value)
        if isinstance(base, MaybeK) and node.attr == "value":
            return base.inner
        if isinstance(base, AdtK):
            adt = self.adts.get(base.name)
            for ctor in (adt.constructors.values() if adt else []):
                if node.attr in ctor.fields:
                    return kind_from_expr(ctor.fields[node.attr].node, set(self.adts))
            raise InferError(f"ADT {base.name} has no field {node.attr!r}")
        raise InferError(
            f"{E.unparse(node)}: {E.unparse(node.value)} is {base}, which has no fields")

    def _family_app(self, node: E.Subscript) -> Kind:
        head = E.dotted_name(node.value)
        if head is None or head not in self.families:
            known = ", ".join(self.families) or "none declared"
            raise InferError(
                f"{E.unparse(node)}: unknown type family {head or E.unparse(node.value)!r} "
                f"(declared in signature.types: {known})",
                "unknown-name",
            )
        fam = self.families[head]
        params = self.family_kinds.get(head, {})
        if len(node.index) != len(fam.params):
            raise InferError(
                f"{E.unparse(node)}: {head} takes {len(fam.params)} arguments "
                f"({', '.join(fam.params)}), got {len(node.index)}"
            )
        for (pname, pkind), arg in zip(params.items(), node.index, strict=False):
            ak = self.infer(arg)
            if not assignable(ak, pkind):
                raise InferError(
                    f"{E.unparse(node)}: {head}'s parameter {pname} is {pkind}, but "
                    f"{E.unparse(arg)} is {ak}"
                )
        return ShapeK()

    def _call(self, node: E.Call) -> Kind:
        prim: Primitive | None = PRIMITIVES.get(node.func)
        if prim is None and self.generators:
            prim = GENERATORS.get(node.func)
        if prim is None:
            known = sorted(PRIMITIVES) + (sorted(GENERATORS) if self.generators else [])
            raise InferError(
                f"unknown primitive {node.func!r}; known: {', '.join(known)}", "unknown-name"
            )
        n = len(node.args)
        if not prim.takes(n):
            raise InferError(f"{node.func} takes {prim.arity_text()} arguments"
                             f"{prim.grouping_text()}, got {n}")
        if prim.takes_names:
            name = E.dotted_name(node.args[0])
            if name in self.tensors:
                if not self.tensors[name]:
                    raise InferError(
                        f"present({name}): {name} is never absent (it is not optional or "
                        f"nullable)",
                        "effects",
                    )
                return BoolK()
            k = self.infer(node.args[0])
            if not isinstance(k, MaybeK):
                raise InferError(
                    f"present({E.unparse(node.args[0])}) needs an optional tensor or a Maybe "
                    f"parameter; it is {k}"
                )
            return BoolK()
        kinds = []
        for i, arg in enumerate(node.args):
            want = prim.param_kind(i)
            if isinstance(arg, E.Starred) and node.func in DTYPE_PRIMITIVES:
                raise InferError(f"{node.func}: {E.unparse(arg.value)} cannot be spliced "
                                 f"(*) into its arguments; write each one")
            k = self.infer(arg.value if isinstance(arg, E.Starred) else arg)
            if isinstance(arg, E.Starred):
                if not isinstance(k, ShapeK):
                    raise InferError(
                        f"{node.func}: *{E.unparse(arg.value)} splices a Shape, got {k}")
                continue
            if not accepts(want, k):
                raise InferError(
                    f"{node.func}: argument {i + 1} must be {describe(want)}, but "
                    f"{E.unparse(arg)} is {k}"
                )
            kinds.append(k)
        for kw, v in node.kwargs:
            if kw not in prim.kwargs:
                raise InferError(f"{node.func} takes no keyword {kw!r}")
            k = self.infer(v)
            if not accepts(prim.kwargs[kw], k):
                raise InferError(f"{node.func}: {kw}= must be {describe(prim.kwargs[kw])}, got {k}")
        try:
            return prim.result(kinds)
        except PrimitiveError as err:
            raise InferError(str(err)) from None

    def _comparable(self, op: str, a: Kind, b: Kind, ln: E.Node, rn: E.Node) -> None:
        if op in ("in", "not in"):
            if not isinstance(b, ShapeK):
                raise InferError(f"{op!r} needs a tuple on the right; {E.unparse(rn)} is {b}")
            return
        ok = False
        if is_numeric(a) and is_numeric(b):
            ok = True
        elif op in ("==", "!="):
            if isinstance(a, EnumK) and isinstance(b, EnumK):
                lit, dom = (a, b) if isinstance(ln, E.Str) else (b, a)
                if isinstance(ln, E.Str) or isinstance(rn, E.Str):
                    missing = [v for v in lit.values if v not in dom.values]
                    if missing and not (isinstance(ln, E.Str) and isinstance(rn, E.Str)):
                        raise InferError(
                            f"{missing[0]!r} is not a value of {dom}; the comparison "
                            f"{E.unparse(ln)} {op} {E.unparse(rn)} is always "
                            f"{'False' if op == '==' else 'True'}"
                        )
                ok = True
            elif isinstance(a, DTypeK) and isinstance(b, DTypeK):
                ok = True
            elif type(a) is type(b) and not isinstance(a, AdtK):
                ok = True
            elif isinstance(a, MaybeK | NoneK) and isinstance(b, MaybeK | NoneK):
                ok = True
        if not ok:
            raise InferError(
                f"cannot compare {E.unparse(ln)} ({a}) {op} {E.unparse(rn)} ({b}): the kinds "
                f"differ"
            )


def assignable(value: Kind, target: Kind) -> bool:
    """Whether a value of kind ``value`` may stand where ``target`` is expected (a family
    argument): Dim and Int mix, any number is a Float, a smaller dtype or enum set fits a
    larger one, None or the inner kind fits a Maybe."""
    if value == target:
        return True
    if isinstance(target, IntK | DimK) and isinstance(value, DimK | IntK):
        return True
    if isinstance(target, FloatK) and is_numeric(value):
        return True
    if isinstance(target, DTypeK) and isinstance(value, DTypeK):
        return set(value.members) <= set(target.members)
    if isinstance(target, EnumK) and isinstance(value, EnumK):
        return set(value.values) <= set(target.values)
    if isinstance(target, MaybeK):
        return isinstance(value, NoneK) or assignable(value, target.inner)
    return False


def join_kinds(a: Kind, b: Kind, node: E.Node) -> Kind:
    """The kind of ``x if c else y`` from its branches: numbers widen, dtype and enum sets
    unite; any other pair of different kinds is an error."""
    if a == b:
        return a
    if is_numeric(a) and is_numeric(b):
        if isinstance(a, FloatK) or isinstance(b, FloatK):
            return FloatK()
        return IntK()
    if isinstance(a, EnumK) and isinstance(b, EnumK):
        return EnumK(tuple(dict.fromkeys(a.values + b.values)))
    if isinstance(a, DTypeK) and isinstance(b, DTypeK):
        return DTypeK(tuple(dict.fromkeys(a.members + b.members)))
    raise InferError(f"{E.unparse(node)}: the branches have different kinds ({a} and {b})")

