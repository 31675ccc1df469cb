"""Type promotion over the spec's dtype names: torch's rules, without torch.

An output's dtype may be computed from its inputs' (``promote(TA, TB)``,
``result_type(TA, len(SA), TB, len(SB))``, ``promote_int_to_float(T)``) and from the Python
numbers beside them (``with_numbers(T, min, max)``: torch's wrapped numbers); the primitives of
those names (:mod:`.primitives`) are these functions over the names of :data:`.kinds.DTYPES`.
They follow ``c10::promoteTypes`` and ATen's ``result_type`` (``TypeProperties.cpp``)
exactly, and the tests compare them with ``torch.promote_types`` and ``torch.result_type``
over every pair and every 0-dim combination. Where torch raises (float8 mixed with any other
dtype) or answers a dtype no spec name denotes (``complex32``, the complex of ``float16``),
there is no result: the function returns None, and a call whose dtypes reach such a
combination is refused by name.

Every function here also has a *set* form (``*_members``): the dtypes an expression may
take when each argument may be any dtype of its ``DType[...]`` union. The validator computes
the kind of a dtype expression with it (a DType whose members are those results), and the
signature package the table it looks the dtype up in per call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import product

__all__ = [
    "CATEGORY",
    "DEFAULT_FLOAT",
    "DEFAULT_FLOATS",
    "promote_int_to_float",
    "promote_int_to_float_members",
    "promote_members",
    "promote_types",
    "result_type",
    "result_type_members",
    "with_numbers",
    "with_numbers_members",
]

#: torch's default floating dtype as torch ships (``torch.get_default_dtype()`` until a
#: program sets another): the value of ``promote_int_to_float`` of an integer where nothing
#: names the default (the spec's own evaluation: workloads, ``show``)
DEFAULT_FLOAT = "float32"
#: the dtypes torch takes as its default (``torch.set_default_dtype``), which a call's
#: ``promote_int_to_float`` of an integer may be: the signature package reads the default at
#: each call
DEFAULT_FLOATS = ("float16", "bfloat16", "float32", "float64")

#: the category of each dtype name, in torch's order bool < integer < floating < complex
CATEGORY: dict[str, int] = {
    "bool": 0,
    "uint8": 1, "int8": 1, "int16": 1, "int32": 1, "int64": 1,
    "float8_e4m3fn": 2, "float8_e5m2": 2, "float16": 2, "bfloat16": 2, "float32": 2,
    "float64": 2,
    "complex64": 3, "complex128": 3,
}
_BOOL, _INT, _FLOAT, _COMPLEX = 0, 1, 2, 3

_SIGNED_BITS = {"int8": 8, "int16": 16, "int32": 32, "int64": 64}
_FLOAT8 = frozenset({"float8_e4m3fn", "float8_e5m2"})
#: floating dtypes by width; float16 and bfloat16 share one (they promote to float32)
_FLOAT_WIDTH = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}
#: the complex dtype of a floating one, as ATen's toComplexType (float16's, complex32, has
#: no spec name; float8 has none in torch)
_TO_COMPLEX = {"bfloat16": "complex64", "float32": "complex64", "float64": "complex128"}


def promote_types(a: str, b: str) -> str | None:
    """``torch.promote_types(a, b)`` by name; None where torch refuses (float8 mixed with
    another dtype)."""
    if a == b:
        return a
    if a in _FLOAT8 or b in _FLOAT8:
        return None
    ca, cb = CATEGORY[a], CATEGORY[b]
    if ca != cb:  # the higher category wins, widened where the lower needs it
        hi, lo = (a, b) if ca > cb else (b, a)
        if CATEGORY[hi] == _COMPLEX and lo == "float64":
            return "complex128"
        return hi
    if ca == _INT:
        if a == "uint8" or b == "uint8":  # uint8 with a signed int: a signed int holding both
            other = b if a == "uint8" else a
            return other if _SIGNED_BITS[other] > 8 else "int16"
        return a if _SIGNED_BITS[a] > _SIGNED_BITS[b] else b
    if ca == _FLOAT:
        wa, wb = _FLOAT_WIDTH[a], _FLOAT_WIDTH[b]
        if wa == wb:  # float16 and bfloat16
            return "float32"
        return a if wa > wb else b
    return "complex128"  # two different complex dtypes


def _promote_skip_undefined(a: str | None, b: str | None) -> str | None:
    """ATen's ``promote_skip_undefined``: an undefined side (``""`` here) gives the other."""
    if a == "":
        return b
    if b == "":
        return a
    if a is None or b is None:
        return None
    return promote_types(a, b)


def _combine_categories(higher: str | None, lower: str | None) -> str | None:
    """ATen's ``combine_categories``: ``higher`` is the promotion of the operands with
    dimensions, ``lower`` that of the 0-dim ones; ``""`` is undefined (no such operand) and
    None a promotion that failed."""
    if higher is None or lower is None:
        return None
    ch = CATEGORY.get(higher, -1)
    cl = CATEGORY.get(lower, -1)
    if ch == _COMPLEX:
        return higher
    if cl == _COMPLEX:
        # the higher's value type is kept if it is floating; an integral one takes the
        # lower's complex dtype
        if ch == _FLOAT:
            return _TO_COMPLEX.get(higher)
        return lower
    if ch == _FLOAT:
        return higher
    if higher == "bool" or cl == _FLOAT:
        return _promote_skip_undefined(higher, lower)
    if higher != "":
        return higher
    return lower


def result_type(operands: Sequence[tuple[str, int]]) -> str | None:
    """``torch.result_type`` of tensors given as ``(dtype, rank)``: the operands with
    dimensions are promoted together, the 0-dim ones together, and a 0-dim operand counts only
    where its category is higher (ATen's ``combine_categories``). None where torch refuses or
    answers a dtype with no spec name."""
    dim, zero = "", ""
    for dtype, rank in operands:
        if rank == 0:
            zero = _promote_skip_undefined(zero, dtype)  # type: ignore[assignment]
        else:
            dim = _promote_skip_undefined(dim, dtype)  # type: ignore[assignment]
    out = _combine_categories(dim, zero)
    return out or None


def promote_int_to_float(a: str, default: str = DEFAULT_FLOAT) -> str:
    """torch's promotion of an integral input to a floating op (``torch.sin`` of an int
    tensor, true division): bool and integer dtypes become the default float (``default``,
    torch's ``get_default_dtype()`` at the call), floating and complex ones stay as they
    are."""
    return a if CATEGORY[a] >= _FLOAT else default


def number_dtype(value: object, default: str = DEFAULT_FLOAT) -> str:
    """The dtype torch gives a Python number beside tensors (a *wrapped number*): ``bool`` for
    a bool, ``int64`` for an int, torch's default floating dtype (``default``) for a float."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int64"
    return default


def with_numbers(d: str, numbers: Iterable[object], default: str = DEFAULT_FLOAT) -> str | None:
    """``torch.result_type`` of tensors whose own result is ``d`` beside the Python
    ``numbers`` (None: no number): the numbers promote together (:func:`number_dtype`) and
    count only where their category is higher than ``d``'s, below the 0-dim tensors (ATen's
    ``wrappedResult``; torch.clamp's scalar bounds promote so: an int32 tensor beside 1 stays
    int32, beside 1.5 is the default float, a bool one beside 1 is int64). None where torch
    gives no spec dtype."""
    wrapped = ""
    for v in numbers:
        if v is not None:
            wrapped = _promote_skip_undefined(wrapped, number_dtype(v, default))  # type: ignore[assignment]
    return _combine_categories(d, wrapped) or None


# --- the set forms ------------------------------------------------------------------------


def promote_members(unions: Sequence[Iterable[str]]) -> tuple[str, ...]:
    """Every result of ``promote`` folded over one dtype of each union (none of those
    combinations that torch refuses), in the order of :data:`.kinds.DTYPES`."""
    acc: set[str | None] = set(unions[0])
    for u in unions[1:]:
        acc = {None if a is None else promote_types(a, b) for a in acc for b in u}
    return _ordered(acc)


def result_type_members(unions: Sequence[Iterable[str]],
                        zero: Sequence[Iterable[bool]] | None = None) -> tuple[str, ...]:
    """Every result of ``result_type`` over one dtype of each union and, for each operand,
    each of the rank facts in ``zero`` (True: 0-dim; both when not given). Exact and cheap:
    the fold keeps the set of (promotion with dimensions, promotion of 0-dim ones) pairs,
    at most 15 x 15 of them, whatever the number of operands."""
    states: set[tuple[str | None, str | None]] = {("", "")}
    for i, u in enumerate(unions):
        facts = (False, True) if zero is None else tuple(zero[i])
        states = {(_promote_skip_undefined(d, t), z) if not is_zero
                  else (d, _promote_skip_undefined(z, t))
                  for (d, z), t, is_zero in product(states, u, facts)}
    return _ordered({_combine_categories(d, z) or None for d, z in states})


def promote_int_to_float_members(union: Iterable[str],
                                  defaults: Iterable[str] = DEFAULT_FLOATS) -> tuple[str, ...]:
    """Every result of ``promote_int_to_float`` over ``union`` and the default dtypes
    (``defaults``: every one torch takes, where the call reads it)."""
    return _ordered({promote_int_to_float(a, d) for a in union for d in defaults})


def with_numbers_members(union: Iterable[str], numbers: Sequence[Iterable[str | None]]
                         ) -> tuple[str, ...]:
    """Every result of :func:`with_numbers` over ``union`` and, for each number, each dtype
    it may take (its :func:`number_dtype` under any default; None: absent)."""
    wrapped: set[str | None] = {""}
    for options in numbers:
        wrapped = {w if n is None else
                   None if w is None else _promote_skip_undefined(w, n)
                   for w in wrapped for n in options}
    return _ordered({None if w is None else _combine_categories(d, w) or None
                     for d in union for w in wrapped})


def _ordered(names: set[str | None]) -> tuple[str, ...]:
    return tuple(n for n in CATEGORY if n in names)
