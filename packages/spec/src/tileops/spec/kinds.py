"""Kinds: what values a type index may take.

| kind                    | values                                   | written as                           |
|-------------------------|------------------------------------------|--------------------------------------|
| ``Dim``                 | a non-negative int, one axis length      | ``Dim``                              |
| ``Shape``               | a tuple of Dims, for rank-polymorphism   | ``Shape``, ``list[int]``,            |
|                         |                                          | ``tuple[int, ...]``                  |
| ``DType[a | b]``        | one of the listed dtypes                 | ``DType[float16 | bfloat16]``,       |
|                         |                                          | ``bfloat16 | float16`` (a param)     |
| ``Bool``                | True / False                             | ``Bool``, ``bool``                   |
| ``Int`` / ``Float``     | a construction number (may be negative)  | ``int``, ``float``                   |
| enum                    | one of the listed strings                | ``'tight' | 'aligned'``              |
| ADT                     | a value of one constructor               | its name, e.g. ``MGroupedLayout``    |
| ``PerAxis[n]``          | an int or an n-tuple of ints             | ``int | tuple[int, int]``            |
| ``Axes``                | axes of a tensor: an int or a tuple of   | ``Axes``, ``int | tuple[int, ...]``, |
|                         | ints, each of any sign (``-1`` the last) | ``int | list[int] | tuple[int, ...]``|
| ``Maybe[X]``            | an X, or absent (None)                   | ``X | None``, ``Maybe[X]``           |

Kinds are frozen structs; :func:`kind_from_expr` reads them from the expression AST.
"""

from __future__ import annotations

import msgspec

from . import expr as E

__all__ = [
    "DTYPES",
    "AdtK",
    "AxesK",
    "BoolK",
    "DTypeK",
    "DimK",
    "EnumK",
    "FloatK",
    "IntK",
    "Kind",
    "KindError",
    "MaybeK",
    "PerAxisK",
    "ShapeK",
    "is_discriminant",
    "is_numeric",
    "kind_from_expr",
]

#: dtype name -> size in bytes. The closed set of dtype names a spec may use.
DTYPES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


class KindError(ValueError):
    """A kind expression that does not denote a kind."""


class Kind(msgspec.Struct, frozen=True, tag=True, tag_field="kind"):
    def __str__(self) -> str:  # pragma: no cover - every subclass overrides
        return type(self).__name__


class DimK(Kind, frozen=True):
    def __str__(self) -> str:
        return "Dim"


class IntK(Kind, frozen=True):
    def __str__(self) -> str:
        return "Int"


class FloatK(Kind, frozen=True):
    def __str__(self) -> str:
        return "Float"


class BoolK(Kind, frozen=True):
    def __str__(self) -> str:
        return "Bool"


class ShapeK(Kind, frozen=True):
    def __str__(self) -> str:
        return "Shape"


class DTypeK(Kind, frozen=True):
    members: tuple[str, ...]

    def __str__(self) -> str:
        return f"DType[{' | '.join(self.members)}]"


class EnumK(Kind, frozen=True):
    values: tuple[str, ...]

    def __str__(self) -> str:
        return " | ".join(repr(v) for v in self.values)


class AdtK(Kind, frozen=True):
    name: str

    def __str__(self) -> str:
        return self.name


class PerAxisK(Kind, frozen=True):
    n: int

    def __str__(self) -> str:
        return f"PerAxis[{self.n}]"


class AxesK(Kind, frozen=True):
    """Axes of a tensor, as torch's reductions take ``dim``: one int or a tuple of ints, each of
    any sign (``-1`` is the last axis). Which axes are in range, and that none repeats, depends
    on the tensor's rank, so a value is checked where it meets one (``reduce_shape``,
    ``axis``), not at construction."""

    def __str__(self) -> str:
        return "Axes"


class MaybeK(Kind, frozen=True):
    inner: Kind

    def __str__(self) -> str:
        return f"Maybe[{self.inner}]"


def is_numeric(k: Kind) -> bool:
    return isinstance(k, DimK | IntK | FloatK)


def is_discriminant(k: Kind) -> bool:
    """Finite kinds that may select a type-family case."""
    return isinstance(k, BoolK | EnumK | AdtK | DTypeK)


_NAMED: dict[str, Kind] = {
    "Dim": DimK(),
    "Shape": ShapeK(),
    "Axes": AxesK(),
    "Bool": BoolK(),
    "bool": BoolK(),
    "Int": IntK(),
    "int": IntK(),
    "Float": FloatK(),
    "float": FloatK(),
}


def _alternatives(node: E.Node) -> list[E.Node]:
    if isinstance(node, E.BinOp) and node.op == "|":
        return _alternatives(node.left) + _alternatives(node.right)
    return [node]


def _is_int_name(n: E.Node) -> bool:
    return isinstance(n, E.Name) and n.id in ("int", "Int", "Dim")


def _tuple_arity(n: E.Node) -> int | None:
    """``tuple[int, int]`` -> 2; ``tuple[int, ...]`` / ``list[int]`` -> -1; else None."""
    if not isinstance(n, E.Subscript) or not isinstance(n.value, E.Name):
        return None
    head, idx = n.value.id, n.index
    if head == "list" and len(idx) == 1 and _is_int_name(idx[0]):
        return -1
    if head == "tuple":
        if len(idx) == 2 and _is_int_name(idx[0]) and isinstance(idx[1], E.Ellipsis_):
            return -1
        if idx and all(_is_int_name(i) for i in idx):
            return len(idx)
    return None


def kind_from_expr(node: E.Node, adts: frozenset[str] | set[str] = frozenset()) -> Kind:
    """Read a kind from its expression (``DType[float16 | bfloat16]``, ``int | None``, ...).

    ``adts`` are the ADT names in scope. Raises :class:`KindError` saying what is accepted.
    """
    alts = _alternatives(node)
    if len(alts) > 1:
        return _union_kind(node, alts, adts)
    if isinstance(node, E.Name):
        if node.id in _NAMED:
            return _NAMED[node.id]
        if node.id in DTYPES:
            return DTypeK((node.id,))
        if node.id in adts:
            return AdtK(node.id)
        raise KindError(
            f"unknown kind {node.id!r}; expected Dim, Shape, Axes, Bool, Int, Float, DType[...], "
            f"a dtype name, an enum of quoted strings, Maybe[...] or an ADT "
            f"({', '.join(sorted(adts)) or 'none declared'})"
        )
    if isinstance(node, E.Str):
        return EnumK((node.value,))
    if isinstance(node, E.Subscript) and isinstance(node.value, E.Name):
        head = node.value.id
        if head == "DType":
            members = [a for i in node.index for a in _alternatives(i)]
            bad = [E.unparse(m) for m in members if not (isinstance(m, E.Name) and m.id in DTYPES)]
            if bad or not members:
                raise KindError(
                    f"DType[...] lists dtype names; {', '.join(bad) or 'nothing'} is not one "
                    f"(known: {', '.join(DTYPES)})"
                )
            return DTypeK(_dedup(m.id for m in members))  # type: ignore[union-attr]
        if head == "Maybe" and len(node.index) == 1:
            inner = kind_from_expr(node.index[0], adts)
            if isinstance(inner, MaybeK):
                raise KindError(f"{E.unparse(node)!r} nests Maybe")
            return MaybeK(inner)
        if (
            head == "PerAxis"
            and len(node.index) == 1
            and isinstance(node.index[0], E.Int)
            and node.index[0].value > 0
        ):
            return PerAxisK(node.index[0].value)
        if _tuple_arity(node) == -1:
            return ShapeK()
    raise KindError(f"{E.unparse(node)!r} is not a kind")


def _union_kind(node: E.Node, alts: list[E.Node], adts: frozenset[str] | set[str]) -> Kind:
    text = E.unparse(node)
    non_none = [a for a in alts if not isinstance(a, E.NoneLit)]
    if len(non_none) < len(alts):
        if not non_none:
            raise KindError(f"{text!r} is only None")
        inner_node = non_none[0]
        for a in non_none[1:]:
            inner_node = E.BinOp("|", inner_node, a)
        inner = kind_from_expr(inner_node, adts)
        if isinstance(inner, MaybeK):
            raise KindError(f"{text!r} nests Maybe")
        return MaybeK(inner)
    if all(isinstance(a, E.Str) for a in alts):
        return EnumK(_dedup(a.value for a in alts))  # type: ignore[union-attr]
    if all(isinstance(a, E.Name) and a.id in DTYPES for a in alts):
        return DTypeK(_dedup(a.id for a in alts))  # type: ignore[union-attr]
    arities = [_tuple_arity(a) for a in alts]
    if all(ar == -1 for ar in arities):
        return ShapeK()  # list[int] | tuple[int, ...]
    ints = [a for a in alts if _is_int_name(a)]
    if len(ints) == 1 and len(alts) > 1 and all(
            ar == -1 for a, ar in zip(alts, arities, strict=True) if a is not ints[0]):
        return AxesK()  # int | tuple[int, ...] (| list[int])
    tuples = [ar for ar in arities if ar is not None and ar > 0]
    if len(ints) == 1 and len(tuples) == 1 and len(alts) == 2:
        return PerAxisK(tuples[0])  # int | tuple[int, int]
    raise KindError(
        f"{text!r} is not a kind: a union is a dtype set (float16 | bfloat16), an enum "
        f"('a' | 'b'), an optional (X | None), int | tuple[int, ...n], "
        f"list[int] | tuple[int, ...] or axes (int | tuple[int, ...])"
    )


def _dedup(items) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))
