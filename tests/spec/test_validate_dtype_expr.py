"""Dtype expressions in the validator: an output's dtype may be computed (``promote``,
``result_type``, ``promote_int_to_float``), an input's may not; the arguments' kinds, the
arity, a call with no result at all, a workload case with none, the kind the validator infers
(read by the ``backward`` rule's dtype unification), and ``dtype: bool``. Exact diagnostics."""

from __future__ import annotations

import pytest

from tileops.spec.kinds import DTypeK

from .validate_base import FLOPS, OUT, ROW, X, Y, diagnostics, edit, shown

TWO = "DType[float16 | bfloat16]"
BINARY = (
    "M: Dim, N: Dim,", "SA: Shape, SB: Shape, U: \"DType[int32 | float32]\",",
    X, 'x: {dtype: T, shape: "[*SA]"}\n      w: {dtype: U, shape: "[*SB]"}',
    OUT, '    let: {S: "broadcast(SA, SB)"}\n' + OUT,
    ROW, "{SA: [2, 3], SB: [3],",
    FLOPS, 'flops: "prod(S)"',
    "[{T: float16}]", "[{T: float16, U: int32}, {T: bfloat16, U: float32}]",
)


def binary(out_dtype: str) -> str:
    return edit(*BINARY, Y, f'y: {{dtype: "{out_dtype}", shape: "[*S]"}}')


@pytest.mark.parametrize("dtype", [
    "promote(T, U)",
    "result_type(T, len(SA), U, len(SB))",
    "promote_int_to_float(U)",
    "promote_int_to_float(result_type(T, len(SA), U, 0))",
    "promote(T, U, float32, bool)",
])
def test_an_output_dtype_may_be_computed(dtype: str) -> None:
    assert shown(diagnostics(binary(dtype))) == []


def test_dtype_bool_on_a_tensor_is_torch_bool() -> None:
    assert shown(diagnostics(edit(Y, 'y: {dtype: bool, shape: "[M, N]"}'))) == []
    assert shown(diagnostics(binary("promote(U, bool)"))) == []
    # where a kind is written, a lone bool stays the Bool kind: a dtype set is DType[bool]
    assert shown(diagnostics(edit("T: \"DType[float16 | bfloat16]\"", "T: bool")))[0] == (
        "kind", "op.yaml:9: in Op.signature.inputs.x.dtype: 'T' is Bool, but a DType is "
                "expected here")


FAILING = [
    pytest.param(
        edit(*BINARY, 'w: {dtype: U, shape: "[*SB]"}', 'w: {dtype: "promote(T, U)", '
             'shape: "[*SB]"}', Y, 'y: {dtype: T, shape: "[*S]"}'),
        [("kind", "op.yaml:10: in Op.signature.inputs.w.dtype: 'promote(T, U)': an input's "
                  "dtype is a DType index or a dtype name, which the tensor's dtype is checked "
                  "against; a computed dtype (promote, promote_int_to_float, result_type, "
                  "with_numbers, or a let of one) is an output's")],
        id="computed-input-dtype"),
    pytest.param(
        edit(*BINARY, 'w: {dtype: U, shape: "[*SB]"}', 'w: {dtype: V, shape: "[*SB]"}',
             '    let: {S: "broadcast(SA, SB)"}\n',
             '    let: {S: "broadcast(SA, SB)", V: "promote(T, U)"}\n', Y,
             'y: {dtype: T, shape: "[*S]"}'),
        [("kind", "op.yaml:10: in Op.signature.inputs.w.dtype: 'V': an input's dtype is a "
                  "DType index or a dtype name, which the tensor's dtype is checked against; a "
                  "computed dtype (promote, promote_int_to_float, result_type, with_numbers, or "
                  "a let of one) is an output's")],
        id="let-input-dtype"),
    pytest.param(
        binary("promote(T, len(SA))"),
        [("kind", "op.yaml:13: in Op.signature.outputs.y.dtype: 'promote(T, len(SA))': "
                  "promote: argument 2 must be a DType, but len(SA) is Int")],
        id="non-dtype-argument"),
    pytest.param(
        binary("result_type(T, SA, U, len(SB))"),
        [("kind", "op.yaml:13: in Op.signature.outputs.y.dtype: 'result_type(T, SA, U, "
                  "len(SB))': result_type: argument 2 must be Dim or Int, but SA is Shape")],
        id="rank-not-an-int"),
    pytest.param(
        binary("result_type(T, len(SA), U)"),
        [("kind", "op.yaml:13: in Op.signature.outputs.y.dtype: 'result_type(T, len(SA), U)': "
                  "result_type takes at least 4 arguments, in pairs, got 3")],
        id="result-type-pairs"),
    pytest.param(
        binary("promote(T)"),
        [("kind", "op.yaml:13: in Op.signature.outputs.y.dtype: 'promote(T)': promote takes at "
                  "least 2 arguments, got 1")],
        id="promote-arity"),
    pytest.param(
        binary("promote(T, *SA)"),
        [("kind", "op.yaml:13: in Op.signature.outputs.y.dtype: 'promote(T, *SA)': promote: SA "
                  "cannot be spliced (*) into its arguments; write each one")],
        id="splice"),
    pytest.param(
        binary("promote(float8_e4m3fn, U)"),
        [("kind", "op.yaml:13: in Op.signature.outputs.y.dtype: 'promote(float8_e4m3fn, U)': "
                  "promote has no result for any dtypes of DType[float8_e4m3fn], DType[int32 | "
                  "float32] (torch does not promote a float8 dtype with another dtype)")],
        id="no-result-at-all"),
    pytest.param(
        binary("len(SA)"),
        [("kind", "op.yaml:13: in Op.signature.outputs.y.dtype: 'len(SA)' is Int, but a DType "
                  "is expected here")],
        id="not-a-dtype"),
    pytest.param(
        edit(*BINARY[:-2], "[{T: float16}]", "[{T: float16, U: int32}]",
             "T: \"DType[float16 | bfloat16]\"", "T: \"DType[float16 | float8_e5m2]\"",
             Y, 'y: {dtype: "promote(T, U)", shape: "[*S]"}',
             "{T: float16, U: int32}", "{T: float8_e5m2, U: int32}"),
        [("workload", "op.yaml:15: in Op.workloads[0].dtype_cases[0]: workload 'small': dtype "
                      "of y: promote(T, U): promote(float8_e5m2, int32) has no result: torch "
                      "does not promote a float8 dtype with another dtype")],
        id="workload-case-without-a-result"),
]


@pytest.mark.parametrize(("text", "expected"), FAILING)
def test_failing(text: str, expected: list[tuple[str, str]]) -> None:
    assert shown(diagnostics(text)) == expected


def test_the_kind_of_a_computed_dtype_is_every_result_over_the_unions() -> None:
    from tileops.spec import load_spec_text
    from tileops.spec.kinds import kind_from_expr
    from tileops.spec.validate.context import EntryContext, Report

    spec = load_spec_text(binary("result_type(T, len(SA), U, len(SB))"), "op.yaml")
    entry = spec.entries["Op"]
    ctx = EntryContext("Op", entry, Report("op.yaml", spec), {}, None)
    ctx.model.kinds.update({n: kind_from_expr(e.node) for n, e in entry.signature.forall.items()})
    infer = ctx.kinds().infer
    # float16/bfloat16 with int32/float32, either side 0-dim or not: a floating side always
    # outranks an int32, so int32 is never the result
    assert infer(entry.signature.outputs["y"].dtype.node) == DTypeK(
        ("float16", "bfloat16", "float32"))
    assert infer(spec.entries["Op"].signature.outputs["y"].dtype.node.args[0]) == DTypeK(
        ("float16", "bfloat16"))


BACKWARD = """\
MulOp:
  family: test
  status: spec-only
  signature:
    forall: {S: Shape, TA: "DType[float16 | float32]", TB: "DType[float16 | float32]"}
    inputs:
      a: {dtype: TA, shape: "[*S]"}
      b: {dtype: TB, shape: "[*S]"}
    outputs:
      y: {dtype: "promote(TA, TB)", shape: "[*S]"}
  backward:
    op: MulBwdOp
    saves: [a, b]
    inputs: {dy: "grad(y)", a: a, b: b}
    grads: {a: da}
MulBwdOp:
  family: test
  status: spec-only
  signature:
    forall: {R: Shape, U: "DType[UNION]", VA: "DType[float16 | float32]",
             VB: "DType[float16 | float32]"}
    inputs:
      dy: {dtype: U, shape: "[*R]"}
      a: {dtype: VA, shape: "[*R]"}
      b: {dtype: VB, shape: "[*R]"}
    outputs:
      da: {dtype: VA, shape: "[*R]"}
"""


def test_backward_unification_reads_the_kind_of_a_computed_dtype() -> None:
    from tileops.spec import load_spec_text, validate_spec_file

    def check(union: str) -> list[tuple[str, str]]:
        text = BACKWARD.replace("UNION", union)
        return shown(validate_spec_file(load_spec_text(text, "op.yaml")))

    assert check("float16 | float32") == []
    assert check("float16") == [(
        "backward", "op.yaml:14: in MulOp.backward.inputs.dy: MulBwdOp.dy has dtype U, which "
                    "does not unify with promote(TA, TB), the dtype of grad(y): MulBwdOp's U is "
                    "DType[float16] and cannot stand for MulOp's promote(TA, TB), which may be "
                    "float32")]
