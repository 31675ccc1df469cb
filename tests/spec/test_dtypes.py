"""The promotion lattice of ``tileops.spec.dtypes`` against torch: ``promote_types`` and
``result_type`` over every pair of the spec's dtype names (every rank combination of 0-dim and
not), ``promote_int_to_float`` against torch's integral-to-float rule, ``with_numbers`` against
torch's promotion of a tensor beside Python numbers; the set forms the
validator and the generated tables use against brute force; and the primitives of those
names through the evaluator, with their refusals."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.spec import DTYPES, PRIMITIVES, Scope, evaluate, parse_expr
from tileops.spec.dtypes import (
    DEFAULT_FLOATS,
    promote_int_to_float,
    promote_int_to_float_members,
    promote_members,
    promote_types,
    result_type,
    result_type_members,
    with_numbers,
    with_numbers_members,
)
from tileops.spec.evaluate import EvalError

torch = pytest.importorskip("torch")

NAMES = list(DTYPES)
PAIRS = list(itertools.product(NAMES, NAMES))


def _torch_name(fn) -> str | None:
    """torch's answer as a spec name; None where torch raises or answers a dtype the spec
    does not name (complex32)."""
    try:
        out = fn()
    except RuntimeError:
        return None
    name = str(out).removeprefix("torch.")
    return name if name in DTYPES else None


def test_every_spec_dtype_is_a_torch_dtype() -> None:
    assert all(isinstance(getattr(torch, n), torch.dtype) for n in NAMES)


def test_promote_types_is_torchs_over_every_pair() -> None:
    got = {(a, b): promote_types(a, b) for a, b in PAIRS}
    want = {(a, b): _torch_name(lambda a=a, b=b: torch.promote_types(getattr(torch, a),
                                                                     getattr(torch, b)))
            for a, b in PAIRS}
    assert got == want
    # the cases the rule has: none of them may be vacuous
    assert got["uint8", "int8"] == "int16" and got["float16", "bfloat16"] == "float32"
    assert got["float64", "complex64"] == "complex128" and got["bool", "uint8"] == "uint8"
    assert got["float8_e4m3fn", "float32"] is None and got["float8_e5m2", "float8_e5m2"]


@pytest.mark.parametrize("ranks", list(itertools.product((0, 1, 2), repeat=2)))
def test_result_type_is_torchs_over_every_pair_and_rank(ranks: tuple[int, int]) -> None:
    ra, rb = ranks
    mismatches = []
    for a, b in PAIRS:
        x = torch.zeros((1,) * ra, dtype=getattr(torch, a))
        y = torch.zeros((2,) * rb, dtype=getattr(torch, b))
        want = _torch_name(lambda x=x, y=y: torch.result_type(x, y))
        if result_type([(a, ra), (b, rb)]) != want:
            mismatches.append((a, b, want))
    assert mismatches == []


def test_result_type_reads_only_whether_a_rank_is_zero() -> None:
    assert result_type([("int32", 1), ("float64", 0)]) == "float64"  # higher category
    assert result_type([("float32", 1), ("float64", 0)]) == "float32"  # same category
    assert result_type([("int64", 0), ("float16", 3)]) == "float16"
    assert result_type([("float16", 1), ("complex64", 0)]) is None  # torch: complex32
    assert result_type([("bfloat16", 1), ("complex128", 0)]) == "complex64"
    assert result_type([("int8", 0), ("uint8", 0)]) == "int16"  # all 0-dim: plain promotion
    assert result_type([("float8_e4m3fn", 1), ("float32", 0)]) == "float8_e4m3fn"


@pytest.mark.parametrize("name", NAMES)
def test_promote_int_to_float_is_torchs(name: str) -> None:
    d = getattr(torch, name)
    want = d if (d.is_floating_point or d.is_complex) else torch.get_default_dtype()
    assert promote_int_to_float(name) == str(want).removeprefix("torch.")
    if name in ("bool", "int32", "float32", "complex64"):  # as torch's own ops answer
        assert str(torch.sin(torch.zeros(2, dtype=d)).dtype) == f"torch.{promote_int_to_float(name)}"


@pytest.mark.parametrize("default", DEFAULT_FLOATS)
def test_promote_int_to_float_takes_torchs_default_dtype(default: str) -> None:
    """``torch.set_default_dtype`` takes exactly DEFAULT_FLOATS, and an integer input then
    gives the default: ``promote_int_to_float(T, default)`` answers it."""
    try:
        torch.set_default_dtype(getattr(torch, default))
        for name in ("bool", "int32", "float32", "bfloat16"):
            got = torch.sin(torch.zeros(2, dtype=getattr(torch, name))).dtype
            assert str(got) == f"torch.{promote_int_to_float(name, default)}"
    finally:
        torch.set_default_dtype(torch.float32)
    for name in ("int8", "complex64", "float8_e4m3fn"):  # none torch takes as a default
        with pytest.raises((TypeError, RuntimeError)):
            torch.set_default_dtype(getattr(torch, name))
    assert torch.get_default_dtype() == torch.float32


#: Python numbers beside a tensor, one or two of them (None: no number)
NUMBERS = [(None,), (True,), (3,), (1.5,), (2, 0.5), (False, 7), (None, -1.0), (True, 2.5),
           (None, None)]


@pytest.mark.parametrize("rank", [0, 2])
@pytest.mark.parametrize("numbers", NUMBERS, ids=repr)
def test_with_numbers_is_torchs_promotion_beside_python_numbers(numbers, rank) -> None:
    """torch's type promotion of one tensor and Python numbers (its elementwise ops' rule, as
    ``torch._prims_common.elementwise_dtypes`` states it): a wrapped number counts only where
    its category is higher, below a 0-dim tensor."""
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    given = [n for n in numbers if n is not None]
    mismatches = []
    for name in NAMES:
        x = torch.zeros((2,) * rank, dtype=getattr(torch, name))
        want = _torch_name(lambda x=x: elementwise_dtypes(
            x, *given, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1])
        if len(given) == 1:  # and as torch.result_type answers it
            assert want == _torch_name(lambda x=x: torch.result_type(x, given[0]))
        if with_numbers(name, numbers) != want:
            mismatches.append((name, want))
    assert mismatches == []


@pytest.mark.parametrize("default", DEFAULT_FLOATS)
def test_with_numbers_gives_a_float_torchs_default_dtype(default: str) -> None:
    try:
        torch.set_default_dtype(getattr(torch, default))
        for name in ("bool", "int32", "float16"):
            x = torch.zeros(2, dtype=getattr(torch, name))
            got = str(torch.result_type(x, 0.5)).removeprefix("torch.")
            assert with_numbers(name, [0.5], default) == got
    finally:
        torch.set_default_dtype(torch.float32)
    assert with_numbers("int32", [0.5]) == "float32"  # without a default: torch's own


UNIONS = st.lists(st.sampled_from(NAMES), min_size=1, max_size=5, unique=True)


@settings(max_examples=150, deadline=None)
@given(st.lists(UNIONS, min_size=1, max_size=3),
       st.lists(st.sampled_from(((False,), (True,), (False, True))), min_size=3, max_size=3))
def test_set_forms_are_every_result_over_the_unions(unions, zero) -> None:
    results = set()
    for combo in itertools.product(*unions):
        for facts in itertools.product(*zero[:len(unions)]):
            results.add(result_type([(d, 0 if z else 1) for d, z in zip(combo, facts,
                                                                          strict=True)]))
    assert set(result_type_members(unions, zero[:len(unions)])) == results - {None}
    promoted = set()
    for combo in itertools.product(*unions):
        acc = combo[0]
        for d in combo[1:]:
            acc = acc and promote_types(acc, d)
        promoted.add(acc)
    assert set(promote_members(unions)) == promoted - {None}
    assert set(promote_int_to_float_members(unions[0])) == {
        promote_int_to_float(d, default) for d in unions[0] for default in DEFAULT_FLOATS}
    assert set(promote_int_to_float_members(unions[0], ["float32"])) == {
        promote_int_to_float(d) for d in unions[0]}


@settings(max_examples=100, deadline=None)
@given(UNIONS, st.lists(st.sampled_from([("bool",), ("int64", None), ("bool", "int64", None)]),
                        max_size=2),
       st.sampled_from([(), (None,), DEFAULT_FLOATS, ("int64", *DEFAULT_FLOATS, None)]))
def test_with_numbers_members_are_every_result(union, options, floats) -> None:
    """The set form over each number's dtypes: every result of one choice of each (a float
    number's dtype is the default, so the last number's float options are the defaults)."""
    options = [*options, floats] if floats else options
    number = {None: None, "bool": True, "int64": 1}
    results = {with_numbers(d, [number.get(n, 0.5) for n in combo],
                            next((n for n in combo if n in DEFAULT_FLOATS), "float32"))
               for d in union for combo in itertools.product(*options)}
    assert set(with_numbers_members(union, options)) == results - {None}


def test_set_forms_are_in_dtype_order() -> None:
    assert promote_members([("float32", "int8"), ("bool", "float16")]) == \
        ("int8", "float16", "float32")


# --- the primitives, through the evaluator -------------------------------------------------


def ev(text: str, **values):
    return evaluate(parse_expr(text), Scope(values))


def test_the_primitives_evaluate_by_name() -> None:
    assert ev("promote(TA, TB)", TA="uint8", TB="int8") == "int16"
    assert ev("promote(bool, int32, float16)") == "float16"
    assert ev("result_type(TA, len(SA), TB, len(SB))", TA="int32", SA=(4,), TB="float64",
              SB=()) == "float64"
    assert ev("result_type(TA, len(SA), TB, len(SB))", TA="float32", SA=(4,), TB="float64",
              SB=()) == "float32"
    assert ev("promote_int_to_float(promote(TA, TB))", TA="int32", TB="bool") == "float32"
    assert ev("promote_int_to_float(T, float64)", T="int32") == "float64"
    assert ev("promote_int_to_float(T, float64)", T="bfloat16") == "bfloat16"
    assert ev("itemsize(promote(TA, TB))", TA="float16", TB="bfloat16") == 4
    assert ev("with_numbers(T, a, b)", T="int32", a=1, b=None) == "int32"
    assert ev("with_numbers(T, a, b)", T="int32", a=1, b=2.5) == "float32"
    assert ev("with_numbers(T, a, default=float64)", T="int8", a=2.5) == "float64"
    assert ev("with_numbers(T, a)", T="bool", a=1) == "int64"
    assert ev("with_numbers(T, a)", T="bfloat16", a=1e300) == "bfloat16"
    assert PRIMITIVES["result_type"].takes(4) and PRIMITIVES["result_type"].takes(6)
    assert not PRIMITIVES["result_type"].takes(5)


@pytest.mark.parametrize(("text", "values", "message"), [
    ("promote(TA, TB)", {"TA": "float8_e4m3fn", "TB": "float32"},
     "promote(TA, TB): promote(float8_e4m3fn, float32) has no result: torch does not promote "
     "a float8 dtype with another dtype"),
    ("result_type(TA, 2, TB, 0)", {"TA": "float16", "TB": "complex64"},
     "result_type(TA, 2, TB, 0): result_type(float16 of rank 2, complex64 of rank 0) has no "
     "result: torch's answer is the complex form of a float16 or float8 operand, which no "
     "spec dtype names"),
])
def test_a_combination_without_a_result_is_refused(text, values, message) -> None:
    with pytest.raises(EvalError) as info:
        ev(text, **values)
    assert str(info.value) == message
