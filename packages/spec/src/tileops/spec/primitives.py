"""The closed table of primitives (functions an expression may call) and generators
(functions a workload uses to fill a metadata tensor).

A primitive states its arity, the kind each argument must have, the kind it returns and a
plain-Python implementation. Anything called in a spec that is not in :data:`PRIMITIVES` (or,
in a tensor's ``values``, in :data:`GENERATORS`) is an error. The signature package compiles
calls to these implementations; the validator uses them to instantiate workload rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from . import dtypes as _dt
from .bounds import MAX_SEQUENCE
from .kinds import (
    DTYPES,
    AxesK,
    BoolK,
    DimK,
    DTypeK,
    FloatK,
    IntK,
    Kind,
    MaybeK,
    PerAxisK,
    ShapeK,
)

__all__ = [
    "DTYPE_PRIMITIVES",
    "GENERATORS",
    "PRIMITIVES",
    "AxisError",
    "Primitive",
    "PrimitiveError",
    "axis",
    "broadcast",
    "ceil_div",
    "expands_to",
    "finite",
    "naxes",
    "no_promotion",
    "per_axis",
    "pool_out",
    "prod",
    "reduce_shape",
    "reduced_sizes",
    "replace_axis",
    "size_at",
]


class PrimitiveError(ValueError):
    """A primitive applied to values outside its domain (e.g. shapes that do not broadcast)."""


class AxisError(PrimitiveError, IndexError):
    """A dim out of range for a tensor's rank: an ``IndexError`` too, as torch raises for
    one (and numpy's ``AxisError`` is)."""


# An argument's accepted kinds, by name. "any" accepts every kind.
ArgKind = str
_ACCEPTS: dict[str, Callable[[Kind], bool]] = {
    "int": lambda k: isinstance(k, DimK | IntK),
    "num": lambda k: isinstance(k, DimK | IntK | FloatK),
    "bool": lambda k: isinstance(k, BoolK),
    "shape": lambda k: isinstance(k, ShapeK),
    "dtype": lambda k: isinstance(k, DTypeK),
    "ints": lambda k: isinstance(k, PerAxisK | ShapeK | DimK | IntK)
    or (isinstance(k, MaybeK) and isinstance(k.inner, PerAxisK | ShapeK | DimK | IntK)),
    "axes": lambda k: isinstance(k, AxesK | DimK | IntK)
    or (isinstance(k, MaybeK) and isinstance(k.inner, AxesK | DimK | IntK)),
    # a Python number (torch's Scalar): an Int, Float or Bool, or Maybe of one
    "number": lambda k: isinstance(k, DimK | IntK | FloatK | BoolK)
    or (isinstance(k, MaybeK) and isinstance(k.inner, DimK | IntK | FloatK | BoolK)),
    "any": lambda k: True,
}
_DESCRIBE = {
    "int": "Dim or Int",
    "num": "a number (Dim, Int or Float)",
    "bool": "Bool",
    "shape": "Shape",
    "dtype": "a DType",
    "ints": "an int, a tuple of ints or Maybe of one",
    "axes": "Axes (an int or a tuple of ints), an Int, or Maybe of one",
    "number": "a number (Int, Float or Bool) or Maybe of one",
    "any": "any kind",
}


def accepts(arg_kind: ArgKind, k: Kind) -> bool:
    return _ACCEPTS[arg_kind](k)


def describe(arg_kind: ArgKind) -> str:
    return _DESCRIBE[arg_kind]


@dataclass(frozen=True)
class Primitive:
    name: str
    params: tuple[ArgKind, ...]  # positional parameter kinds
    #: the result's kind from the arguments' (a dtype primitive computes its DType's members
    #: from theirs); raises PrimitiveError when no combination of the arguments has a result
    result: Callable[[Sequence[Kind]], Kind]
    impl: Callable[..., object]
    doc: str
    #: the kind of extra positional arguments; a tuple is a group repeated as a whole
    #: (``result_type``'s dtype and rank pairs)
    variadic: ArgKind | tuple[ArgKind, ...] | None = None
    optional: int = 0  # how many trailing params may be omitted
    kwargs: dict[str, ArgKind] = field(default_factory=dict)
    # which argument positions are tensor/optional names rather than values (present())
    takes_names: bool = False

    def arity_text(self) -> str:
        lo, hi = len(self.params) - self.optional, len(self.params)
        if self.variadic:
            return f"at least {lo}"
        return str(hi) if lo == hi else f"{lo} to {hi}"

    def grouping_text(self) -> str:
        """How extra arguments come (after the arity: ``at least 4 arguments, in pairs``)."""
        if not isinstance(self.variadic, tuple):
            return ""
        n = len(self.variadic)
        return ", in pairs" if n == 2 else f", in groups of {n}"

    def takes(self, n: int) -> bool:
        """Whether ``n`` positional arguments fit the arity."""
        lo, hi = len(self.params) - self.optional, len(self.params)
        if n < lo:
            return False
        if isinstance(self.variadic, tuple):
            return (n - hi) % len(self.variadic) == 0
        return n <= hi or self.variadic is not None

    def param_kind(self, i: int) -> ArgKind:
        """The kind argument ``i`` must have (``i`` within the arity)."""
        if i < len(self.params):
            return self.params[i]
        group = self.variadic
        assert group is not None
        return group[(i - len(self.params)) % len(group)] if isinstance(group, tuple) else group


# --- implementations ------------------------------------------------------------------------


def prod(shape: Sequence[int]) -> int:
    return math.prod(shape)


def ceil_div(a: int, b: int) -> int:
    if b == 0:
        raise PrimitiveError("ceil_div by zero")
    return -(-a // b)


def broadcast(*shapes: Sequence[int]) -> tuple[int, ...]:
    """NumPy/PyTorch broadcasting of shapes; raises PrimitiveError if they do not broadcast.

    It runs in every call check of a broadcasting op, so equal shapes return at once and the
    shapes of the last calls (hashable ones: tuples, ``torch.Size``) are remembered, by value,
    with their result; otherwise it is one pass over each shape. A conflict is reported by
    :func:`_broadcast_error`, which names the first axis (from the left) where two shapes
    disagree (never remembered: each call raises it again)."""
    if not shapes:
        return ()
    first = shapes[0]
    if all(s == first for s in shapes):
        return tuple(first)
    try:
        return _remembered_broadcast(shapes)
    except TypeError:  # a shape that is not hashable (a list)
        return _broadcast(shapes)


def _broadcast(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    rank = max(map(len, shapes))
    out = [1] * rank
    for s in shapes:
        off = rank - len(s)
        for i, d in enumerate(s):
            if d != 1:
                o = out[off + i]
                if o == 1:
                    out[off + i] = d
                elif o != d:
                    _broadcast_error(shapes)
    return tuple(out)


#: the broadcasts of the last distinct shape tuples (a bias against activations of a few
#: sizes): one lookup where the pass over the shapes took about a microsecond
_remembered_broadcast = functools.lru_cache(maxsize=1024)(_broadcast)


def expands_to(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` expands to ``target`` as ``Tensor.expand`` does: no more
    axes, and each of its axes (aligned from the right) equal to the target's or 1."""
    off = len(target) - len(shape)
    return off >= 0 and all(d == 1 or d == target[off + i] for i, d in enumerate(shape))


def _broadcast_error(shapes: Sequence[Sequence[int]]) -> None:
    """Raise the PrimitiveError of shapes that do not broadcast, at the first axis from the
    left where one disagrees with the size the shapes before it agreed on."""
    rank = max(len(s) for s in shapes)
    for axis in range(rank):
        size = 1
        for s in shapes:
            i = axis - (rank - len(s))
            if i < 0 or s[i] == 1:
                continue
            if size not in (1, s[i]):
                raise PrimitiveError(
                    f"shapes {', '.join(str(tuple(s)) for s in shapes)} do not broadcast "
                    f"(axis {axis - rank}: {size} vs {s[i]})"
                )
            size = s[i]
    raise AssertionError(f"shapes {shapes} broadcast")  # pragma: no cover - called on a conflict


def axis(d: int, rank: int) -> int:
    """Axis ``d`` of a tensor of ``rank`` axes, wrapped to ``[0, rank)`` as torch wraps a
    ``dim`` (``-1`` is the last axis; a 0-dim tensor takes ``0`` and ``-1``, as torch does)."""
    top = max(rank, 1)
    if not -top <= d < top:
        raise AxisError(f"dim {d} is out of range for a tensor of rank {rank} "
                             f"(expected an axis in [{-top}, {top - 1}])")
    return d % top


def replace_axis(shape: Sequence[int], d: int, n: int) -> tuple[int, ...]:
    """``shape`` with axis ``d`` (wrapped by :func:`axis`) of length ``n``: torch.topk's
    output over ``dim``. A 0-dim shape stays 0-dim for ``n`` of 0 or 1, as torch.topk's
    result for a 0-dim tensor is (its one element, whatever ``k`` of the two); a longer axis
    is refused."""
    if not shape:
        axis(d, 0)
        if n not in (0, 1):
            raise PrimitiveError(f"a 0-dim shape has one element along axis {d}: a length of "
                                 f"{n} does not fit (0 or 1 do, the result 0-dim)")
        return ()
    if n < 0:
        raise PrimitiveError(f"an axis length must be >= 0, got {n}")
    a = axis(d, len(shape))
    return (*shape[:a], n, *shape[a + 1:])


def size_at(shape: Sequence[int], d: int) -> int:
    """The length of axis ``d`` of ``shape`` (wrapped by :func:`axis`; a 0-dim shape is one
    element along its one admitted axis, as torch sizes it)."""
    a = axis(d, len(shape))
    return shape[a] if shape else 1


def reduce_shape(shape: Sequence[int], dim, keepdim: bool) -> tuple[int, ...]:
    """``shape`` reduced over ``dim`` as torch's reductions reduce it: ``dim`` one axis or a
    tuple of axes (each wrapped by :func:`axis`, none repeated), None or an empty tuple meaning
    every axis; the reduced axes are dropped, or kept as 1s with ``keepdim``."""
    axes = _named_axes(len(shape), dim)
    if keepdim:
        return tuple(1 if i in axes else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in axes)


def reduced_sizes(shape: Sequence[int], dim) -> tuple[int, ...]:
    """The lengths of the axes of ``shape`` that ``dim`` names, in axis order, read as
    :func:`reduce_shape` reads ``dim`` (None or ``()``: every axis; its refusals too): ``prod``
    of it is the length of the run each output element reduces."""
    axes = _named_axes(len(shape), dim)
    return tuple(n for i, n in enumerate(shape) if i in axes)


def _named_axes(rank: int, dim) -> set[int]:
    """The axes of a tensor of ``rank`` that ``dim`` names: one axis or a tuple of axes (each
    wrapped by :func:`axis`, none repeated), None or an empty tuple meaning every axis."""
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return set(range(rank))
    axes: set[int] = set()
    for d in (dim,) if isinstance(dim, int) else dim:
        a = axis(d, rank)
        if a in axes:
            raise PrimitiveError(f"dim {a} appears more than once in the dims {tuple(dim)}")
        axes.add(a)
    return axes


def per_axis(value, axis: int, n: int, fallback: int | None = None) -> int:
    """Component ``axis`` of an ``int | tuple[int, ...n]`` parameter; an int applies to every
    axis; an absent (None) value takes ``fallback``."""
    if value is None:
        if fallback is None:
            raise PrimitiveError("per_axis of an absent value needs fallback=")
        return fallback
    if isinstance(value, int):
        return value
    value = tuple(value)
    if len(value) == 1:
        return value[0]
    if len(value) != n:
        raise PrimitiveError(f"expected an int or {n} ints, got {len(value)}: {value}")
    return value[axis]


def pool_out(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """Output length of a pooling window, PyTorch's formula (including the rule that the
    last window must start inside the input or left padding when ``ceil_mode``)."""
    if s <= 0:
        raise PrimitiveError(f"pool.out stride must be positive, got {s}")
    span = size + 2 * p - d * (k - 1) - 1
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def conv_out(size: int, k: int, s: int, p: int, d: int) -> int:
    return pool_out(size, k, s, p, d, False)


def _present(value) -> bool:
    return value is not None


def _itemsize(dtype: str) -> int:
    return DTYPES[dtype]


def _len(shape: Sequence[int]) -> int:
    return len(shape)


def finite(x: float) -> bool:
    """Whether the number ``x`` is finite (not an infinity, not NaN): a float param that an
    op's arithmetic cannot take at infinity (a softcap of inf is ``inf * tanh(0)``)."""
    return math.isfinite(x)


def naxes(dim) -> int:
    """How many axes ``dim`` names: one for an int, a tuple's length (``()`` names none); None
    (every axis, as many as a tensor's rank) has no count of its own."""
    if dim is None:
        raise PrimitiveError("naxes(None): None names every axis of a tensor, so how many "
                             "depends on its rank")
    return 1 if isinstance(dim, int) else len(dim)


def _min(*xs):
    return min(xs)


def _max(*xs):
    return max(xs)


def _promote(*dtypes: str) -> str:
    out: str | None = dtypes[0]
    for d in dtypes[1:]:
        out = _dt.promote_types(out, d) if out is not None else None
    if out is None:
        raise PrimitiveError(f"promote({', '.join(dtypes)}) has no result: "
                             f"{no_promotion(dtypes)}")
    return out


def _result_type(*args: object) -> str:
    operands: list[tuple[str, int]] = list(zip(args[0::2], args[1::2], strict=True))  # type: ignore[arg-type]
    out = _dt.result_type(operands)
    if out is None:
        shown = ", ".join(f"{d} of rank {r}" for d, r in operands)
        raise PrimitiveError(f"result_type({shown}) has no result: "
                             f"{no_promotion([d for d, _ in operands])}")
    return out


def _with_numbers(d: str, *numbers: object, default: str = _dt.DEFAULT_FLOAT) -> str:
    out = _dt.with_numbers(d, numbers, default)
    if out is None:
        raise PrimitiveError(f"with_numbers({d}, {', '.join(map(repr, numbers))}) has no "
                             f"result: {no_promotion([d])}")
    return out


def _number_options(k: Kind) -> tuple[str | None, ...]:
    """The dtypes a number of kind ``k`` may take beside tensors (None: absent). A Float
    param holds what its caller passed, an int as well as a float (torch's Scalar keeps the
    Python type), so it may be int64 or any default floating dtype."""
    absent: tuple[str | None, ...] = ()
    if isinstance(k, MaybeK):
        k, absent = k.inner, (None,)
    if isinstance(k, BoolK):
        return ("bool", *absent)
    if isinstance(k, FloatK):
        return ("int64", *_dt.DEFAULT_FLOATS, *absent)
    return ("int64", *absent)


def _with_numbers_result(args: Sequence[Kind]) -> Kind:
    union = args[0].members  # type: ignore[attr-defined]
    out = _dt.with_numbers_members(union, [_number_options(k) for k in args[1:]])
    if not out:
        raise PrimitiveError(f"with_numbers has no result for any dtypes of {args[0]} "
                             f"({no_promotion(list(union))})")
    return DTypeK(out)


def no_promotion(dtypes: Sequence[str]) -> str:
    """Why torch gives no spec dtype for these operands: float8 mixed with another dtype
    (torch refuses), else a floating dtype meeting a complex one whose complex form has no
    spec name (float16's is complex32; float8's does not exist)."""
    if any(d in ("float8_e4m3fn", "float8_e5m2") for d in dtypes) and len(set(dtypes)) > 1:
        return "torch does not promote a float8 dtype with another dtype"
    return "torch's answer is the complex form of a float16 or float8 operand, which no " \
           "spec dtype names"


def _dtype_result(members: Callable[[list[tuple[str, ...]]], tuple[str, ...]],
                  name: str) -> Callable[[Sequence[Kind]], Kind]:
    """The kind of a dtype primitive's call: the DType of every result ``members`` finds over
    the DType arguments' unions (the other arguments, ranks, are not DTypes and not read)."""

    def result(args: Sequence[Kind]) -> Kind:
        unions = [k.members for k in args if isinstance(k, DTypeK)]
        out = members(unions)
        if not out:
            shown = ", ".join(str(k) for k in args if isinstance(k, DTypeK))
            raise PrimitiveError(f"{name} has no result for any dtypes of {shown} "
                                 f"({no_promotion([m for u in unions for m in u])})")
        return DTypeK(out)

    return result


def _int_result(args: Sequence[Kind]) -> Kind:
    return DimK() if all(isinstance(a, DimK) for a in args) else IntK()


def _num_result(args: Sequence[Kind]) -> Kind:
    if any(isinstance(a, FloatK) for a in args):
        return FloatK()
    return _int_result(args)


PRIMITIVES: dict[str, Primitive] = {
    p.name: p
    for p in [
        Primitive(
            "broadcast",
            ("shape",),
            lambda a: ShapeK(),
            broadcast,
            "broadcast(S1, S2, ...): the broadcast shape of the given shapes",
            variadic="shape",
        ),
        Primitive("expands_to", ("shape", "shape"), lambda a: BoolK(), expands_to,
                  "expands_to(A, S): whether a tensor of shape A expands to S (Tensor.expand: "
                  "no more axes, each equal to S's or 1)"),
        Primitive("prod", ("shape",), lambda a: DimK(), prod, "prod(S): number of elements"),
        Primitive("finite", ("num",), lambda a: BoolK(), finite,
                  "finite(x): whether the number x is finite (no infinity, no NaN)"),
        Primitive(
            "reduce_shape",
            ("shape", "axes", "bool"),
            lambda a: ShapeK(),
            reduce_shape,
            "reduce_shape(S, dim, keepdim): S reduced over the axes dim (None: every axis), "
            "reduced axes dropped or kept as 1",
        ),
        Primitive("reduced_sizes", ("shape", "axes"), lambda a: ShapeK(), reduced_sizes,
                  "reduced_sizes(S, dim): the lengths of the axes of S that dim names (None: "
                  "every axis), in order"),
        Primitive("axis", ("int", "int"), lambda a: IntK(), axis,
                  "axis(d, rank): the axis d of a tensor of that rank, wrapped to [0, rank)"),
        Primitive("replace_axis", ("shape", "int", "int"), lambda a: ShapeK(), replace_axis,
                  "replace_axis(S, d, n): S with its axis d (wrapped as axis() does) of length "
                  "n"),
        Primitive("size_at", ("shape", "int"), lambda a: DimK(), size_at,
                  "size_at(S, d): the length of axis d of S (wrapped as axis() does)"),
        Primitive("len", ("shape",), lambda a: IntK(), _len, "len(S): the rank of a Shape"),
        Primitive("naxes", ("axes",), lambda a: IntK(), naxes,
                  "naxes(dim): how many axes dim names (an int one, a tuple its length)"),
        Primitive(
            "ceil_div", ("int", "int"), _int_result, ceil_div, "ceil_div(a, b): ceil(a / b)"
        ),
        Primitive("min", ("num", "num"), _num_result, _min, "min(a, b, ...)", variadic="num"),
        Primitive("max", ("num", "num"), _num_result, _max, "max(a, b, ...)", variadic="num"),
        Primitive(
            "per_axis",
            ("ints", "int", "int"),
            lambda a: IntK(),
            per_axis,
            "per_axis(v, axis, n, fallback=x): axis `axis` of an int | n-tuple parameter",
            kwargs={"fallback": "int"},
        ),
        Primitive(
            "pool.out",
            ("int", "int", "int", "int", "int", "bool"),
            lambda a: IntK(),
            pool_out,
            "pool.out(L, k, s, p, d, ceil_mode): pooled length, PyTorch's formula",
        ),
        Primitive(
            "conv.out",
            ("int", "int", "int", "int", "int"),
            lambda a: IntK(),
            conv_out,
            "conv.out(L, k, s, p, d): convolution output length",
        ),
        Primitive(
            "present",
            ("any",),
            lambda a: BoolK(),
            _present,
            "present(x): whether an optional input or Maybe parameter is given",
            takes_names=True,
        ),
        Primitive(
            "itemsize", ("dtype",), lambda a: IntK(), _itemsize, "itemsize(T): bytes per element"
        ),
        Primitive(
            "promote",
            ("dtype", "dtype"),
            _dtype_result(_dt.promote_members, "promote"),
            _promote,
            "promote(A, B, ...): torch.promote_types folded over the dtypes",
            variadic="dtype",
        ),
        Primitive(
            "result_type",
            ("dtype", "int", "dtype", "int"),
            _dtype_result(_dt.result_type_members, "result_type"),
            _result_type,
            "result_type(A, rA, B, rB, ...): torch.result_type of tensors of dtypes A, B, ... "
            "and ranks rA, rB, ... (a 0-dim tensor counts only if its category is higher)",
            variadic=("dtype", "int"),
        ),
        Primitive(
            "promote_int_to_float",
            ("dtype", "dtype"),
            _dtype_result(lambda u: _dt.promote_int_to_float_members(
                u[0], *([u[1]] if len(u) > 1 else [])), "promote_int_to_float"),
            _dt.promote_int_to_float,
            "promote_int_to_float(T, D): T if floating or complex, else D; without D torch's "
            "default dtype (torch.get_default_dtype() at the call, float32 unless a program "
            "sets another)",
            optional=1,
        ),
        Primitive(
            "with_numbers",
            ("dtype", "number"),
            _with_numbers_result,
            _with_numbers,
            "with_numbers(D, x, ...): torch.result_type of tensors whose own is D beside the "
            "Python numbers x, ... (a bool as bool, an int as int64, a float as torch's "
            "default dtype; None: no number), which count only where their category is higher "
            "than D's",
            variadic="number",
            kwargs={"default": "dtype"},
        ),
    ]
}


#: the primitives that compute a dtype: only an output's ``dtype`` may call them (an input's
#: dtype is read from the tensor, so it is an index or a dtype name)
DTYPE_PRIMITIVES = frozenset({"promote", "result_type", "promote_int_to_float", "with_numbers"})


# --- generators (workload metadata tensors) ---------------------------------------------------


def prefix_sum(xs: Sequence[int]) -> list[int]:
    """``[0, x0, x0 + x1, ...]``: offsets of packed segments (length len(xs) + 1)."""
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def cumsum(xs: Sequence[int]) -> list[int]:
    out: list[int] = []
    for x in xs:
        out.append((out[-1] if out else 0) + x)
    return out


def _length(n: int, what: str) -> int:
    """``n`` as the length of a generated sequence: at most MAX_SEQUENCE, checked before
    anything is built."""
    if n > MAX_SEQUENCE:
        raise PrimitiveError(f"{what} would build {n} items; at most {MAX_SEQUENCE} are allowed")
    return n


def balanced_sizes(total: int, groups: int) -> list[int]:
    """``total`` split into ``groups`` sizes that differ by at most one."""
    if groups <= 0:
        raise PrimitiveError(f"balanced_sizes needs groups > 0, got {groups}")
    _length(groups, "balanced_sizes")
    q, r = divmod(total, groups)
    return [q + (1 if i < r else 0) for i in range(groups)]


def arange(n: int) -> list[int]:
    return list(range(_length(n, "arange")))


def full(n: int, value: int) -> list[int]:
    return [value] * _length(n, "full")


def class_targets(n: int, classes: int, ignored: int, ignore_index: int) -> list[int]:
    """``n`` class indices in ``[0, classes)``, spread over the whole range (a multiplicative
    hash of the position, so neighbouring rows hit distant classes and the last class is
    reached), with ``ignored`` of them, evenly spaced, set to ``ignore_index``."""
    _length(n, "class_targets")
    if classes <= 0:
        raise PrimitiveError(f"class_targets needs classes > 0, got {classes}")
    if not 0 <= ignored <= n:
        raise PrimitiveError(f"class_targets: ignored must be in [0, {n}], got {ignored}")
    out = [(i * 2654435761 + classes - 1) % classes for i in range(n)]
    for j in range(ignored):
        out[(2 * j + 1) * n // (2 * ignored)] = ignore_index
    return out


def kv_lengths(n: int, longest: int, step: int) -> list[int]:
    """``n`` sequence lengths of a decode batch: ``longest``, then each ``step`` shorter than
    the one before, floored at 0 (``step`` 0: every sequence at ``longest``). One batch holds
    the longest, lengths off any tile and, where it reaches them, 1 and 0."""
    _length(n, "kv_lengths")
    if longest < 0 or step < 0:
        raise PrimitiveError(f"kv_lengths needs longest >= 0 and step >= 0, got {longest} and "
                             f"{step}")
    return [max(longest - i * step, 0) for i in range(n)]


def page_table(n: int, pages: int, pool: int) -> list[int]:
    """The block table of ``n`` sequences of ``pages`` pages each over a pool of ``pool``
    pages, row-major: entry ``i`` is page ``i * a % pool`` for the first stride ``a`` from 5/8
    of the pool on that is coprime with it, so a sequence's pages are scattered over the pool,
    and distinct while ``n * pages <= pool`` (a smaller pool is shared)."""
    _length(n * pages, "page_table")
    if pool <= 0:
        raise PrimitiveError(f"page_table needs pool > 0, got {pool}")
    a = max(2, pool * 5 // 8)
    while math.gcd(a, pool) != 1:
        a += 1
    return [i * a % pool for i in range(n * pages)]


def distinct_rows(rows: int, k: int, n: int) -> list[int]:
    """``rows`` rows of ``k`` distinct indices in ``[0, n)``, row-major (a top-k's indices
    along the last axis): row ``r`` takes ``r, r + step, ...`` modulo ``n`` for ``step =
    n // k``, so each row's are distinct and the rows differ."""
    _length(rows * k, "distinct_rows")
    if not 0 <= k <= n:
        raise PrimitiveError(f"distinct_rows needs 0 <= k <= n, got k={k} and n={n}")
    step = max(1, n // max(k, 1))
    return [(r + j * step) % n for r in range(rows) for j in range(k)]


def _moe_loads(total: int, experts: int, uneven: int) -> list[int]:
    """``total`` rows over ``experts`` experts: evenly (``uneven`` 0, sizes differing by at
    most one) or unevenly (``uneven`` 1: every fourth expert, 3, 7, ..., gets none and expert 0
    eight times the share of each other one; the remainder goes to the first experts that get
    rows)."""
    if not uneven:
        return balanced_sizes(total, experts)
    weights = [8 if e == 0 else 0 if e % 4 == 3 else 1 for e in range(experts)]
    out = [total * w // sum(weights) for w in weights]
    left = total - sum(out)
    for e in (e for e in range(experts) if weights[e]):
        if left == 0:
            break
        out[e] += 1
        left -= 1
    return out


def moe_metadata(layout, rows: int, experts: int, uneven: int) -> list[int]:
    """The metadata of an M-grouped operand (an MGroupedLayout value ``layout``) of ``rows``
    rows over ``experts`` experts, with even (``uneven`` 0) or uneven loads (1: every fourth
    expert empty, expert 0 eight shares): contiguous with ``offsets``, the ``experts + 1`` row
    offsets of the experts' segments, each rounded up to ``alignment`` rows (the loads share
    ``rows - experts * (alignment - 1)`` rows, so the padded segments fit in ``rows``);
    contiguous with ``per_row``, the expert of each of the ``rows`` rows, -1 for padding and
    for rows past the last segment; masked, the valid rows of each ``max_m`` block (loads
    sharing half the blocks' rows, each clipped to ``max_m``)."""
    if experts <= 0:
        raise PrimitiveError(f"moe_metadata needs experts > 0, got {experts}")
    if uneven not in (0, 1):
        raise PrimitiveError(f"moe_metadata: uneven must be 0 or 1, got {uneven}")
    _length(experts, "moe_metadata")
    ctor, fields = getattr(layout, "constructor", None), getattr(layout, "fields", None)
    if ctor == "masked":
        max_m = fields["max_m"]
        return [min(c, max_m) for c in _moe_loads(experts * max_m // 2, experts, uneven)]
    if ctor != "contiguous":
        raise PrimitiveError(f"moe_metadata needs an MGroupedLayout value, got {layout!r}")
    align = fields["alignment"]
    loads = _moe_loads(max(0, rows - experts * (align - 1)), experts, uneven)
    padded = [ceil_div(c, align) * align for c in loads]
    if fields["metadata_kind"] == "offsets":
        return prefix_sum(padded)
    _length(rows, "moe_metadata")
    out: list[int] = []
    for e, (c, p) in enumerate(zip(loads, padded, strict=True)):
        out += [e] * c + [-1] * (p - c)
    return out + [-1] * (rows - len(out))


def scaled_prefix_sum(xs: Sequence[int], total: int) -> list[int]:
    """The offsets of packed sequences of lengths ``xs`` scaled to fill ``total`` items:
    ``total * prefix_sum(xs)[i] // sum(xs)``, so ``prefix_sum(xs)`` itself where ``total`` is
    their sum. A workload names its tensor's length as ``total``, so a row scaled down for a
    smaller run keeps its offsets within the tensor and its mix of lengths (an empty sequence
    stays empty; a short one may become empty)."""
    _length(len(xs) + 1, "scaled_prefix_sum")
    if any(x < 0 for x in xs) or total < 0:
        raise PrimitiveError(f"scaled_prefix_sum needs lengths and a total >= 0, got {list(xs)} "
                             f"and {total}")
    whole = sum(xs)
    if whole == 0 and total:
        raise PrimitiveError(f"scaled_prefix_sum cannot fill {total} items with sequences of "
                             f"no length")
    return [total * c // whole if whole else 0 for c in prefix_sum(xs)]


GENERATORS: dict[str, Primitive] = {
    p.name: p
    for p in [
        Primitive("prefix_sum", ("shape",), lambda a: ShapeK(), prefix_sum,
                  "prefix_sum(xs): [0, x0, x0+x1, ...], length len(xs) + 1"),
        Primitive("cumsum", ("shape",), lambda a: ShapeK(), cumsum,
                  "cumsum(xs): inclusive running sums"),
        Primitive("balanced_sizes", ("int", "int"), lambda a: ShapeK(), balanced_sizes,
                  "balanced_sizes(total, n): n sizes summing to total, differing by <= 1"),
        Primitive("arange", ("int",), lambda a: ShapeK(), arange, "arange(n): 0 .. n-1"),
        Primitive("full", ("int", "int"), lambda a: ShapeK(), full, "full(n, v): n copies of v"),
        Primitive("class_targets", ("int", "int", "int", "int"), lambda a: ShapeK(),
                  class_targets,
                  "class_targets(n, classes, ignored, ignore_index): n class indices spread "
                  "over [0, classes), `ignored` of them (evenly spaced) set to ignore_index"),
        Primitive("moe_metadata", ("any", "int", "int", "int"), lambda a: ShapeK(),
                  moe_metadata,
                  "moe_metadata(layout, rows, experts, uneven): an M-grouped operand's metadata "
                  "as the MGroupedLayout states it (offsets, per-row experts or masked counts), "
                  "even (0) or uneven (1) loads"),
        Primitive("kv_lengths", ("int", "int", "int"), lambda a: ShapeK(), kv_lengths,
                  "kv_lengths(n, longest, step): n lengths from longest down by step, floored "
                  "at 0"),
        Primitive("distinct_rows", ("int", "int", "int"), lambda a: ShapeK(), distinct_rows,
                  "distinct_rows(rows, k, n): rows rows of k distinct indices in [0, n)"),
        Primitive("page_table", ("int", "int", "int"), lambda a: ShapeK(), page_table,
                  "page_table(n, pages, pool): n rows of pages page numbers scattered over a "
                  "pool (distinct while n * pages <= pool)"),
        Primitive("scaled_prefix_sum", ("shape", "int"), lambda a: ShapeK(), scaled_prefix_sum,
                  "scaled_prefix_sum(xs, total): prefix_sum(xs) scaled to end at total"),
    ]
}
