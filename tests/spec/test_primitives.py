"""The closed primitive and generator tables: each implementation against an independent
reference, the errors, and the kinds the table declares."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.spec import GENERATORS, PRIMITIVES, Scope, evaluate
from tileops.spec.evaluate import EvalError
from tileops.spec.expr import parse
from tileops.spec.kinds import AxesK, BoolK, DimK, DTypeK, FloatK, IntK, MaybeK, PerAxisK, ShapeK
from tileops.spec.primitives import (
    PrimitiveError,
    accepts,
    arange,
    balanced_sizes,
    broadcast,
    ceil_div,
    conv_out,
    cumsum,
    describe,
    expands_to,
    full,
    per_axis,
    pool_out,
    prefix_sum,
    prod,
)

# --- pool.out / conv.out ------------------------------------------------------------------------


def windows(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """Count pooling windows one by one, in padded coordinates [0, size + 2p).

    Without ceil_mode a window counts when it lies wholly inside the padded input. With it, a
    window counts when it covers a padded position no earlier window covers (a partial last
    window), provided it starts inside the input or the left padding (PyTorch's rule)."""
    span = d * (k - 1) + 1
    padded = size + 2 * p
    for i in itertools.count():  # window i starts at i * s
        start = i * s
        if ceil_mode:
            covered = (i - 1) * s + span if i else 0
            ok = covered < padded and start < size + p
        else:
            ok = start + span <= padded
        if not ok:
            return i  # windows 0 .. i - 1 count
    raise AssertionError("unreachable")  # pragma: no cover


def test_pool_out_counts_the_windows() -> None:
    # every case of a grid: lengths 1..40, kernels 1..5, strides 1..4, dilations 1..3,
    # paddings up to PyTorch's limit of k // 2, both modes, where at least one window fits
    checked = 0
    for size, k, s, d, ceil_mode in itertools.product(range(1, 41), range(1, 6), range(1, 5),
                                                      range(1, 4), (False, True)):
        for p in range(k // 2 + 1):
            if d * (k - 1) + 1 > size + 2 * p:
                continue
            assert pool_out(size, k, s, p, d, ceil_mode) == windows(size, k, s, p, d, ceil_mode), (
                size, k, s, p, d, ceil_mode)
            checked += 1
    assert checked > 8000


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # values of torch.nn.functional.max_pool2d's output size, by hand from its docs
        ((112, 3, 2, 1, 1, False), 56),  # ResNet stem
        ((55, 3, 2, 0, 1, True), 27),  # AlexNet, ceil_mode
        ((55, 3, 2, 0, 1, False), 27),
        ((6, 3, 2, 0, 1, False), 2),
        ((6, 3, 2, 0, 1, True), 3),  # a partial last window
        ((5, 2, 2, 1, 1, True), 3),  # the last window would start in the right padding
        ((32, 3, 1, 1, 2, False), 30),  # dilation
        ((7, 7, 1, 0, 1, False), 1),
    ],
)
def test_pool_out_known_values(args, expected) -> None:
    assert pool_out(*args) == expected
    assert windows(*args) == expected


def test_pool_out_rejects_a_non_positive_stride() -> None:
    with pytest.raises(PrimitiveError) as exc:
        pool_out(8, 2, 0, 0, 1, False)
    assert str(exc.value) == "pool.out stride must be positive, got 0"


def test_conv_out_is_the_floor_formula() -> None:
    for size, k, s, p, d in itertools.product(range(1, 33), range(1, 6), range(1, 5), range(4),
                                              range(1, 4)):
        if d * (k - 1) + 1 <= size + 2 * p:
            assert conv_out(size, k, s, p, d) == (size + 2 * p - d * (k - 1) - 1) // s + 1


# --- broadcast ----------------------------------------------------------------------------------


def reference_broadcast(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    """Right-align the shapes; each axis takes its one size other than 1 (or 1); None if an
    axis has two sizes other than 1."""
    rank = max(map(len, shapes), default=0)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    out = []
    for sizes in zip(*padded, strict=True):
        other = set(sizes) - {1}
        if len(other) > 1:
            return None
        out.append(other.pop() if other else 1)
    return tuple(out)


SHAPES = st.lists(st.lists(st.sampled_from([1, 2, 3]), max_size=4).map(tuple), min_size=1,
                  max_size=4)


@settings(max_examples=200, deadline=None)
@given(SHAPES)
def test_broadcast_matches_the_reference(shapes) -> None:
    expected = reference_broadcast(*shapes)
    if expected is None:
        with pytest.raises(PrimitiveError):
            broadcast(*shapes)
    else:
        assert broadcast(*shapes) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3]), max_size=4).map(tuple),
       st.lists(st.sampled_from([1, 2, 3]), max_size=4).map(tuple))
def test_expands_to_is_expand(shape, target) -> None:
    """Tensor.expand's rule: no more axes than the target, and broadcasting them to it gives
    the target itself."""
    ok = len(shape) <= len(target) and reference_broadcast(shape, target) == tuple(target)
    assert expands_to(shape, target) is ok


def test_broadcast_examples_and_error() -> None:
    assert broadcast((8, 1, 6, 1), (7, 1, 5)) == (8, 7, 6, 5)
    assert broadcast((3,), ()) == (3,)
    assert broadcast() == ()
    assert broadcast((0,), (1,)) == (0,)
    with pytest.raises(PrimitiveError) as exc:
        broadcast((2, 3), (4, 3))
    assert str(exc.value) == "shapes (2, 3), (4, 3) do not broadcast (axis -2: 2 vs 4)"


def test_a_remembered_broadcast_is_the_same_for_every_form_of_the_shapes() -> None:
    """Shapes seen before are answered from memory, by value: lists (unhashable) and tuples
    give the same result, and a conflict raises every time, never remembered as a result."""
    for shapes in [((5, 1, 4), (4,)), ([5, 1, 4], [4]), ((5, 1, 4), [4]), ((5, 1, 4), (4,))]:
        assert broadcast(*shapes) == (5, 1, 4)
        assert type(broadcast(*shapes)) is tuple
    for _ in range(2):
        with pytest.raises(PrimitiveError, match=r"axis -1: 4 vs 3"):
            broadcast((5, 1, 4), (3,))


# --- per_axis, ceil_div and the small ones ------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((3, 0, 2), {}, 3),
        ((3, 1, 2), {}, 3),
        (((3, 5), 0, 2), {}, 3),
        (((3, 5), 1, 2), {}, 5),
        (([3, 5], 1, 2), {}, 5),
        (((4,), 1, 2), {}, 4),  # a 1-tuple applies to every axis
        ((None, 1, 2), {"fallback": 7}, 7),
        (((1, 2, 3), 2, 3), {}, 3),
    ],
)
def test_per_axis(args, kwargs, expected) -> None:
    assert per_axis(*args, **kwargs) == expected


def test_per_axis_errors() -> None:
    with pytest.raises(PrimitiveError) as exc:
        per_axis(None, 0, 2)
    assert str(exc.value) == "per_axis of an absent value needs fallback="
    with pytest.raises(PrimitiveError) as exc:
        per_axis((1, 2, 3), 0, 2)
    assert str(exc.value) == "expected an int or 2 ints, got 3: (1, 2, 3)"


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 10**4))
def test_ceil_div(a: int, b: int) -> None:
    assert ceil_div(a, b) == math.ceil(Fraction(a, b))


def test_ceil_div_by_zero() -> None:
    with pytest.raises(PrimitiveError) as exc:
        ceil_div(3, 0)
    assert str(exc.value) == "ceil_div by zero"


def test_small_primitives() -> None:
    assert prod((2, 3, 4)) == 24
    assert prod(()) == 1
    assert PRIMITIVES["len"].impl((2, 3)) == 2
    assert PRIMITIVES["min"].impl(3, 1, 2) == 1
    assert PRIMITIVES["max"].impl(3, 1, 2) == 3
    assert PRIMITIVES["itemsize"].impl("bfloat16") == 2
    assert PRIMITIVES["itemsize"].impl("float8_e4m3fn") == 1
    assert PRIMITIVES["present"].impl(None) is False
    assert PRIMITIVES["present"].impl(0) is True
    sizes = PRIMITIVES["reduced_sizes"].impl
    assert [sizes((3, 0, 5), d) for d in (0, -2, (2, 0), None, ())] == [
        (3,), (0,), (3, 5), (3, 0, 5), (3, 0, 5)]
    assert sizes((), None) == () and sizes((), 0) == ()
    with pytest.raises(PrimitiveError, match=r"dim 1 appears more than once"):
        sizes((2, 3), (1, -1))
    assert [PRIMITIVES["naxes"].impl(d) for d in (-1, 0, (), (0, 2), [1, 2, 3])] == [1, 1, 0, 2, 3]
    with pytest.raises(PrimitiveError) as exc:
        PRIMITIVES["naxes"].impl(None)
    assert str(exc.value) == ("naxes(None): None names every axis of a tensor, so how many "
                              "depends on its rank")


# --- generators ---------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 1000), max_size=10))
def test_prefix_sum_and_cumsum(xs: list[int]) -> None:
    offsets = prefix_sum(xs)
    assert len(offsets) == len(xs) + 1
    assert offsets[0] == 0
    assert [b - a for a, b in itertools.pairwise(offsets)] == xs
    assert cumsum(xs) == offsets[1:]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10**5), st.integers(1, 64))
def test_balanced_sizes(total: int, groups: int) -> None:
    sizes = balanced_sizes(total, groups)
    assert len(sizes) == groups
    assert sum(sizes) == total
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_generator_examples_and_errors() -> None:
    assert prefix_sum([128, 256]) == [0, 128, 384]
    assert cumsum([128, 256]) == [128, 384]
    assert balanced_sizes(10, 3) == [4, 3, 3]
    assert arange(4) == [0, 1, 2, 3]
    assert full(3, 7) == [7, 7, 7]
    with pytest.raises(PrimitiveError) as exc:
        balanced_sizes(10, 0)
    assert str(exc.value) == "balanced_sizes needs groups > 0, got 0"


# --- the tables ---------------------------------------------------------------------------------


def test_the_tables_are_closed_and_named_by_their_keys() -> None:
    assert sorted(PRIMITIVES) == ["axis", "broadcast", "ceil_div", "conv.out", "expands_to",
                                  "finite",
                                  "itemsize", "len",
                                  "max", "min", "naxes", "per_axis", "pool.out", "present", "prod",
                                  "promote", "promote_int_to_float", "reduce_shape", "reduced_sizes",
                                  "replace_axis", "result_type", "size_at", "with_numbers"]
    assert sorted(GENERATORS) == ["arange", "balanced_sizes", "class_targets", "cumsum",
                                  "distinct_rows", "full", "kv_lengths", "moe_metadata",
                                  "page_table", "prefix_sum", "scaled_prefix_sum"]
    for table in (PRIMITIVES, GENERATORS):
        for name, prim in table.items():
            assert prim.name == name
            assert prim.doc.startswith(f"{name}(")  # the doc shows the call
    assert not set(PRIMITIVES) & set(GENERATORS)


def test_arity_texts() -> None:
    assert PRIMITIVES["pool.out"].arity_text() == "6"
    assert PRIMITIVES["broadcast"].arity_text() == "at least 1"
    assert PRIMITIVES["min"].arity_text() == "at least 2"
    assert PRIMITIVES["per_axis"].arity_text() == "3"


@pytest.mark.parametrize(
    ("name", "args", "result"),
    [
        ("ceil_div", [DimK(), DimK()], DimK()),
        ("ceil_div", [DimK(), IntK()], IntK()),
        ("min", [DimK(), FloatK()], FloatK()),
        ("max", [DimK(), DimK(), DimK()], DimK()),
        ("prod", [ShapeK()], DimK()),
        ("len", [ShapeK()], IntK()),
        ("naxes", [AxesK()], IntK()),
        ("broadcast", [ShapeK(), ShapeK()], ShapeK()),
        ("present", [MaybeK(IntK())], BoolK()),
        ("pool.out", [DimK()] * 5 + [BoolK()], IntK()),
        ("itemsize", [DTypeK(("float16",))], IntK()),
    ],
)
def test_result_kinds(name, args, result) -> None:
    assert PRIMITIVES[name].result(args) == result


@pytest.mark.parametrize(
    ("arg_kind", "good", "bad", "text"),
    [
        ("int", [DimK(), IntK()], [FloatK(), BoolK(), ShapeK()], "Dim or Int"),
        ("num", [DimK(), IntK(), FloatK()], [BoolK(), ShapeK()], "a number (Dim, Int or Float)"),
        ("bool", [BoolK()], [DimK()], "Bool"),
        ("shape", [ShapeK()], [DimK(), PerAxisK(2)], "Shape"),
        ("dtype", [DTypeK(("float16",))], [DimK()], "a DType"),
        ("ints", [PerAxisK(2), ShapeK(), DimK(), IntK(), MaybeK(PerAxisK(2))],
         [FloatK(), BoolK(), MaybeK(FloatK())], "an int, a tuple of ints or Maybe of one"),
        ("any", [DimK(), BoolK(), ShapeK()], [], "any kind"),
    ],
)
def test_argument_kinds(arg_kind, good, bad, text) -> None:
    assert all(accepts(arg_kind, k) for k in good)
    assert not any(accepts(arg_kind, k) for k in bad)
    assert describe(arg_kind) == text


# --- through the interpreter --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "values", "expected"),
    [
        ("pool.out(H, 3, 2, 1, 1, False)", {"H": 112}, 56),
        ("pool.out(H, 3, 2, 0, 1, c)", {"H": 55, "c": True}, 27),
        ("per_axis(stride, 1, 2, fallback=k)", {"stride": None, "k": 3}, 3),
        ("per_axis(stride, 1, 2, fallback=k)", {"stride": (1, 2), "k": 3}, 2),
        ("broadcast(a, b)", {"a": (4, 1), "b": (3,)}, (4, 3)),
        ("broadcast(*xs)", {"xs": ((2, 1), (1, 5))}, (2, 5)),
        ("prod([*B, N])", {"B": (2, 3), "N": 4}, 24),
        ("ceil_div(N, 128) * 128", {"N": 4097}, 4224),
        ("max(a, b, 1)", {"a": 0, "b": -1}, 1),
        ("itemsize(T) * N", {"T": "float32", "N": 8}, 32),
        ("present(eps) and eps.value > 0", {"eps": 1e-6}, True),
        ("present(eps)", {"eps": None}, False),
        ("naxes(dim) > 0", {"dim": (0, 2)}, True),
        ("naxes(dim) > 0", {"dim": ()}, False),
    ],
)
def test_primitives_through_evaluate(text, values, expected) -> None:
    assert evaluate(parse(text), Scope(values)) == expected


def test_generators_only_where_allowed() -> None:
    node = parse("prefix_sum(q_lens)")
    assert evaluate(node, Scope({"q_lens": (2, 3)}, generators=True)) == [0, 2, 5]
    with pytest.raises(EvalError) as exc:
        evaluate(node, Scope({"q_lens": (2, 3)}))
    assert str(exc.value) == "unknown primitive 'prefix_sum'"


def test_primitive_errors_become_eval_errors() -> None:
    with pytest.raises(EvalError) as exc:
        evaluate(parse("broadcast(a, b)"), Scope({"a": (2,), "b": (3,)}))
    assert str(exc.value) == "broadcast(a, b): shapes (2,), (3,) do not broadcast (axis -1: 2 vs 3)"
    with pytest.raises(EvalError) as exc:
        evaluate(parse("ceil_div(a, 0)"), Scope({"a": 2}))
    assert str(exc.value) == "ceil_div(a, 0): ceil_div by zero"


def test_distinct_rows_gives_each_row_distinct_indices_in_range() -> None:
    from tileops.spec.primitives import distinct_rows

    for rows, k, n in ((3, 2, 7), (4, 50, 128), (2, 5, 5), (5, 0, 3), (1, 1, 1)):
        out = distinct_rows(rows, k, n)
        assert len(out) == rows * k
        for r in range(rows):
            row = out[r * k:(r + 1) * k]
            assert len(set(row)) == k and all(0 <= i < n for i in row)
    with pytest.raises(PrimitiveError, match=r"distinct_rows needs 0 <= k <= n, got k=4 and n=3"):
        distinct_rows(2, 4, 3)


@pytest.mark.parametrize(("x", "want"), [(1.5, True), (0, True), (-3, True),
                                         (float("inf"), False), (float("-inf"), False),
                                         (float("nan"), False)])
def test_finite_is_whether_a_number_is_finite(x, want) -> None:
    assert PRIMITIVES["finite"].impl(x) is want
