"""Computed output dtypes in the generated checks: a binary op with broadcasting and torch's
type promotion (``result_type(TA, len(SA), TB, len(SB))``, ``let S = broadcast(SA, SB)``),
through every mode (``check``, ``check_exact``, ``check_symbolic``, ``derive``), the table
lookup each compiles to, ``out=`` buffers, the refusals, the roofline; hypothesis over shape
and dtype pairs against torch; a conditional between dtypes (torch.all's uint8); Python numbers
beside tensors (``with_numbers``, a float param keeping an int) and a large table split at its
nested call; and the in-place activation form."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.signature import SignatureCallError, SignaturePlan
from tileops.spec import load_spec_text

torch = pytest.importorskip("torch")

DTYPES = ["bool", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64", "float8_e4m3fn"]
UNION = " | ".join(DTYPES)
#: the dtypes every pair of which torch promotes (no float8, no complex)
REAL = " | ".join(d for d in DTYPES if d not in ("complex64", "float8_e4m3fn"))
SPEC = f"""\
AddOp:
  family: test
  status: spec-only
  signature:
    forall: {{SA: Shape, SB: Shape, TA: "DType[{UNION}]", TB: "DType[{UNION}]"}}
    inputs:
      a: {{dtype: TA, shape: "[*SA]"}}
      b: {{dtype: TB, shape: "[*SB]"}}
    let: {{S: "broadcast(SA, SB)"}}
    outputs:
      out: {{dtype: "result_type(TA, len(SA), TB, len(SB))", shape: "[*S]", buffer: true}}
      eq: {{dtype: bool, shape: "[*S]"}}
      mean: {{dtype: "promote_int_to_float(promote(TA, TB))", shape: "[]"}}
  roofline:
    flops: "prod(S)"
FloatAddOp:
  family: test
  status: spec-only
  signature:
    forall: {{S: Shape, TA: "DType[float16 | float32]", TB: "DType[float16 | float32]"}}
    inputs:
      a: {{dtype: TA, shape: "[*S]"}}
      b: {{dtype: TB, shape: "[*S]"}}
    outputs:
      out: {{dtype: "promote(TA, TB)", shape: "[*S]"}}
MeanOp:
  family: test
  status: spec-only
  signature:
    forall: {{SA: Shape, SB: Shape, TA: "DType[{UNION}]", TB: "DType[{UNION}]"}}
    inputs:
      a: {{dtype: TA, shape: "[*SA]"}}
      b: {{dtype: TB, shape: "[*SB]"}}
    outputs:
      mean: {{dtype: "promote_int_to_float(promote(TA, TB))", shape: "[]"}}
AllOp:
  family: test
  status: spec-only
  signature:
    forall: {{S: Shape, T: "DType[bool | uint8 | int8 | float32]"}}
    inputs:
      x: {{dtype: T, shape: "[*S]"}}
    outputs:
      y: {{dtype: "uint8 if T == uint8 else bool", shape: "[]"}}
      s: {{dtype: "T if T == bool or T == float32 else promote(T, int64)", shape: "[]"}}
BoundOp:
  family: test
  status: spec-only
  signature:
    forall: {{S: Shape, SM: Shape, T: "DType[{REAL}]", TM: "DType[{REAL}]", TN: "DType[{REAL}]"}}
    params:
      lo: {{type: "float | None", default: null}}
      hi: {{type: "float | None", default: null}}
    inputs:
      x: {{dtype: T, shape: "[*S]"}}
      m: {{dtype: TM, shape: "[*SM]"}}
      n: {{dtype: TN, shape: "[*SM]"}}
    outputs:
      y: {{dtype: "with_numbers(T, lo, hi)", shape: "[*S]"}}
      z: {{dtype: "with_numbers(result_type(T, len(S), TM, len(SM), TN, len(SM)), lo, hi)", shape: "[*S]"}}
ReluOp:
  family: test
  status: spec-only
  signature:
    forall: {{S: Shape, T: "DType[float16 | bfloat16 | float32]"}}
    params:
      inplace: {{type: bool, default: false}}
    inputs:
      x: {{dtype: T, shape: "[*S]", mutated: inplace}}
    outputs:
      y: {{dtype: T, shape: "[*S]", alias: x}}
"""
FILE = load_spec_text(SPEC, "add.yaml")


def point(name: str = "AddOp", **params):
    return SignaturePlan(name, FILE.entries[name], spec=FILE).construct(**params)


ADD = point()


def t(shape, dtype="float32"):
    return torch.zeros(shape, dtype=getattr(torch, dtype))


def test_every_mode_computes_the_output_dtype() -> None:
    a, b = t((4, 1), "int32"), t((3,), "float16")
    for check in (ADD.check, ADD.check_exact, ADD.check_symbolic):
        call = check(a, b)
        assert call.output_dtypes == (torch.float16, torch.bool, torch.float16)
        assert call.output_shapes == ((4, 3), (4, 3), ())
        assert ADD.derive(call)[2] == call.output_dtypes
    # a 0-dim operand takes part only with a higher category
    assert ADD.check(t((2,), "int32"), t((), "float64")).output_dtypes[0] == torch.float64
    assert ADD.check(t((2,), "float32"), t((), "float64")).output_dtypes[0] == torch.float32
    assert ADD.check(t((), "float32"), t((), "float64")).output_dtypes[0] == torch.float64
    assert ADD.check(t((2,), "bool"), t((), "uint8")).output_dtypes == (
        torch.uint8, torch.bool, torch.float32)
    assert ADD.check(a, b).tensors["out"] == ((4, 3), "float16")


def test_each_mode_is_one_lookup_in_one_table() -> None:
    src = ADD.source()
    key = "[i_TA, len(i_SA) == 0, i_TB, len(i_SB) == 0]"
    check = src[src.index("def check("):src.index("def check_symbolic(")]
    exact = src[src.index("def check_exact("):src.index("def check(")]
    derive = src[src.index("def derive("):src.index("def traffic(")]
    assert "o_out = _DX" in check and key in check  # a miss goes to check_exact
    assert "o_out = _DX" in exact and ".get((i_TA, len(i_SA) == 0" in exact
    assert "if not (o_out is not None): raise _fail(" in exact
    assert key in derive and "_DX" in derive
    tables = {name for name in ADD.namespace if name.startswith("_DX")}
    assert len(tables) == 2  # out's table and mean's, shared by every mode
    table = ADD.namespace[re.search(r"o_out = (_DX\d+)\[", check).group(1)]
    assert table[torch.int32, False, torch.float64, True] is torch.float64
    assert (torch.float8_e4m3fn, False, torch.float32, False) not in table


def test_a_table_that_cannot_miss_costs_the_hot_path_nothing() -> None:
    fp = point("FloatAddOp")
    src = fp.source()
    hot = src[src.index("def check("):src.index("def check_symbolic(")]
    assert "_DX" not in hot and "_DX" not in src[:src.index("def check(")]
    derive = src[src.index("def derive("):src.index("def traffic(")]
    assert "_DX" in derive
    assert fp.check(t(3, "float16"), t(3, "float32")).output_dtypes == (torch.float32,)
    assert fp.check(t(3, "float16"), t(3, "float16")).output_dtypes == (torch.float16,)


def test_a_combination_without_a_result_is_refused_by_name() -> None:
    with pytest.raises(SignatureCallError) as info:
        ADD.check(t((2, 3), "float8_e4m3fn"), t((3,), "float32"))
    assert str(info.value) == (
        "AddOp: argument b does not match the signature\n"
        "  expected: b: Tensor[TB, [*SB]]\n"
        "  seen:     b: f32[3]\n"
        "  because:  the dtype of out, result_type(TA, len(SA), TB, len(SB)), has no value at "
        "TA = float8_e4m3fn, len(SA) = 2, TB = float32, len(SB) = 1: torch does not promote a "
        "float8 dtype with another dtype\n"
        "  call:     a: f8e4m3[2, 3], b: f32[3]\n"
        "  bound:    TA = float8_e4m3fn, SA = [2, 3], TB = float32, SB = [3], S = [2, 3]\n"
        "  spec:     add.yaml:11 (AddOp.signature.outputs.out.dtype)")
    with pytest.raises(SignatureCallError) as info:
        ADD.check_symbolic(t((2,), "float16"), t((), "complex64"))
    assert info.value.because == (
        "the dtype of out, result_type(TA, len(SA), TB, len(SB)), has no value at "
        "TA = float16, len(SA) = 1, TB = complex64, len(SB) = 0: torch's answer is the complex "
        "form of a float16 or float8 operand, which no spec dtype names")


def test_promote_int_to_float_reads_torchs_default_dtype_at_each_call() -> None:
    """An integer's float is ``torch.get_default_dtype()`` when the call looks it up (a key of
    the table), so one point serves every default; a floating dtype stays as it is."""
    mean = point("MeanOp")
    derive = mean.source()[mean.source().index("def derive("):]
    reader = re.search(r"(_F\d+)\(\)", derive).group(1)
    assert mean.namespace[reader] is torch.get_default_dtype
    a, b = t(3, "int32"), t((), "bool")
    try:
        for default in (torch.float64, torch.bfloat16, torch.float16, torch.float32):
            torch.set_default_dtype(default)
            for check in (mean.check, mean.check_exact, mean.check_symbolic):
                assert check(a, b).output_dtypes == (default,)
                assert check(t(3, "bfloat16"), b).output_dtypes == (torch.bfloat16,)
            assert ADD.check(a, b).output_dtypes == (torch.int32, torch.bool, default)
    finally:
        torch.set_default_dtype(torch.float32)
    # a combination without a result names the default it was looked up under
    with pytest.raises(SignatureCallError) as info:
        mean.check(t(3, "float8_e4m3fn"), t(3, "int32"))
    assert info.value.because == (
        "the dtype of mean, promote_int_to_float(promote(TA, TB)), has no value at "
        "TA = float8_e4m3fn, TB = int32, default_dtype() = float32: torch does not promote a "
        "float8 dtype with another dtype")


def test_a_conditional_between_dtypes_is_one_lookup() -> None:
    """torch.all keeps a uint8 input's dtype and gives bool for every other: a conditional
    whose test compares dtypes, compiled to a table as a primitive's call is (in every mode),
    its branches dtypes or dtype primitives' calls."""
    op = point("AllOp")
    want = {"bool": ("bool", "bool"), "uint8": ("uint8", "int64"), "int8": ("bool", "int64"),
            "float32": ("bool", "float32")}
    for name, (y, s) in want.items():
        x = t((3,), name)
        outs = (getattr(torch, y), getattr(torch, s))
        for check in (op.check, op.check_exact, op.check_symbolic):
            call = check(x)
            assert call.output_dtypes == outs
            assert op.derive(call)[2] == outs
    src = op.source()
    derive = src[src.index("def derive("):src.index("def traffic(")]
    assert derive.count("[i_T]") == 2  # one table each, keyed by T alone
    # the dtypes each output may have, over both branches (y's all integral: an op of it
    # records no gradient)
    members = op.plan.output_dtype_members
    assert set(members["y"]) == {"bool", "uint8"} and "float32" in members["s"]


def test_a_conditional_testing_anything_but_dtypes_is_not_compiled() -> None:
    for test, why in (("len(S) < 1", r"the test len\(S\) < 1 cannot be compiled: a dtype "
                                      r"conditional compares dtypes \(== or !=\)"),
                      ("len(S) == 0", r"len\(S\) cannot be compiled as a dtype argument")):
        spec = SPEC.replace('"uint8 if T == uint8 else bool"', f'"uint8 if {test} else bool"')
        bad = load_spec_text(spec, "add.yaml")
        with pytest.raises(Exception, match=why):
            SignaturePlan("AllOp", bad.entries["AllOp"], spec=bad).construct()


def test_numbers_beside_tensors_promote_by_their_type() -> None:
    """A float param keeps an int its caller passed: beside an integer tensor an int stays
    the tensor's dtype, a float is torch's default (read at the call); bool beside an int is
    int64. Each number type is its own point (1 and 1.0 are equal keys of a dict)."""
    x, m = t((2,), "int32"), t((), "float16")
    for lo, hi, want in ((1, None, "int32"), (1.0, None, "float32"), (None, 2, "int32"),
                         (1, 2.5, "float32"), (None, None, "int32")):
        p = point("BoundOp", lo=lo, hi=hi)
        assert p.params["lo"] == lo and type(p.params["lo"]) is type(lo)
        assert p.check(x, m, m).output_dtypes[0] is getattr(torch, want), (lo, hi)
    assert point("BoundOp", lo=1).check(t((2,), "bool"), m, m).output_dtypes[0] is torch.int64
    assert point("BoundOp", lo=-0.0).check(x, m, m).output_dtypes[0] is torch.float32
    assert point("BoundOp", lo=1.0).check(t((2,), "bfloat16"), m, m).output_dtypes[0] is \
        torch.bfloat16
    try:
        torch.set_default_dtype(torch.float64)
        assert point("BoundOp", lo=1.0).check(x, m, m).output_dtypes[0] is torch.float64
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_large_table_is_split_at_its_nested_call() -> None:
    """``with_numbers(result_type(...six operands...), lo, hi)`` would be one table of 8192
    combinations; the nested call that cannot miss gets its own table and its result is a
    key of the outer one, looked up in turn. Every combination gives what the spec's
    evaluator gives."""
    from tileops.spec import Scope, evaluate, parse_expr

    p = point("BoundOp", lo=1, hi=0.5)
    src = p.source()
    derive = src[src.index("def derive("):src.index("def traffic(")]
    assert re.search(r"_DX\d+\[_DX\d+\[i_T, len\(i_S\) == 0, i_TM, len\(i_SM\) == 0, "
                     r"i_TN\], _F\d+\(\)\]", derive), derive
    expr = parse_expr("with_numbers(result_type(T, len(S), TM, len(SM), TN, len(SM)), 1, 0.5)")
    names = ["bool", "uint8", "int32", "float16", "float64"]
    for tx, tm, tn in itertools.product(names, repeat=3):
        for sx, sm in (((2,), ()), ((), (2,)), ((2,), (2,))):
            want = evaluate(expr, Scope({"T": tx, "TM": tm, "TN": tn, "S": sx, "SM": sm}))
            got = p.check(t(sx, tx), t(sm, tm), t(sm, tn)).output_dtypes[1]
            assert got is getattr(torch, want), (tx, tm, tn, sx, sm)


def test_shapes_that_do_not_broadcast_are_refused_naming_both_and_the_axis() -> None:
    with pytest.raises(SignatureCallError) as info:
        ADD.check(t((2, 3)), t((4,)))
    assert str(info.value) == (
        "AddOp: argument b does not match the signature\n"
        "  expected: b: Tensor[TB, [*SB]]\n"
        "  seen:     b: f32[4]\n"
        "  because:  let S = broadcast(SA, SB) fails on these sizes: shapes (2, 3), (4,) do not "
        "broadcast (axis -1: 3 vs 4)\n"
        "  call:     a: f32[2, 3], b: f32[4]\n"
        "  bound:    TA = float32, SA = [2, 3], TB = float32, SB = [4]\n"
        "  spec:     add.yaml:9 (AddOp.signature.let.S)")


def test_an_out_buffer_is_checked_against_the_computed_dtype() -> None:
    a, b = t((4, 1), "int32"), t((3,), "float16")
    call = ADD.check(a, b, out=t((4, 3), "float16"))
    assert call.out_given and call.output_dtypes[0] == torch.float16
    for check in (ADD.check, ADD.check_exact):
        with pytest.raises(SignatureCallError) as info:
            check(a, b, out=t((4, 3), "float32"))
        assert info.value.argument == "out"
        assert info.value.because == ("the buffer given for out must be f16[4, 3], but is "
                                      "f32[4, 3]")
        assert info.value.expected == "out: Tensor[result_type(TA, len(SA), TB, len(SB)), [*S]]"


def test_roofline_and_traffic_read_the_broadcast_shape_and_computed_dtype() -> None:
    call = ADD.check(t((4, 1), "int32"), t((3,), "float16"))
    assert call.indices["S"] == (4, 3)
    # flops prod(S); bytes: a (4 int32), b (3 f16), out (12 f16), eq (12 bool), mean (1 f16)
    assert call.roofline() == (12, 4 * 4 + 3 * 2 + 12 * 2 + 12 + 2)


SHAPES = st.lists(st.sampled_from([1, 2, 3]), min_size=0, max_size=3).map(tuple)


@settings(max_examples=200, deadline=None)
@given(SHAPES, SHAPES, st.sampled_from(DTYPES), st.sampled_from(DTYPES))
def test_any_shape_and_dtype_pair_is_checked_as_torch_computes_it(sa, sb, da, db) -> None:
    a, b = t(sa, da), t(sb, db)
    try:
        want_shape = tuple(torch.broadcast_shapes(sa, sb))
    except RuntimeError:
        want_shape = None
    try:
        want_dtype = torch.result_type(a, b)
    except RuntimeError:
        want_dtype = None
    if want_dtype is torch.complex32:  # no spec name: refused like a failed promotion
        want_dtype = None
    try:
        p = torch.promote_types(a.dtype, b.dtype)
        want_mean = p if p.is_floating_point or p.is_complex else torch.float32
    except RuntimeError:
        want_mean = None
    if None in (want_shape, want_dtype, want_mean):
        with pytest.raises(SignatureCallError) as info:
            ADD.check(a, b)
        assert info.value.argument == "b"
        return
    call = ADD.check(a, b)
    assert call.output_shapes[0] == want_shape
    assert call.output_dtypes == (want_dtype, torch.bool, want_mean)
    assert ADD.check_exact(a, b).output_dtypes == call.output_dtypes
    out = torch.empty(want_shape, dtype=want_dtype)
    assert ADD.check(a, b, out=out).out_given


def test_the_inplace_activation_form_keeps_its_alias() -> None:
    fresh, inplace = point("ReluOp"), point("ReluOp", inplace=True)
    x = t((2, 3), "bfloat16")
    call = fresh.check(x)
    assert call.written_inputs == () and call.output_dtypes == (torch.bfloat16,)
    call = inplace.check(x)
    assert call.written_inputs == ("x",) and call.returned_outputs == ("y",)
    assert call.output_shapes == ((2, 3),) and call.output_dtypes == (torch.bfloat16,)
    assert fresh.output_like == {"y": "x"}
