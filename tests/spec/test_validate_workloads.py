"""The validator's ``workload`` rule: every workload row instantiates. Specs that pass it
and specs that break it, with the exact diagnostic (``file:line: in path: message``)."""

from __future__ import annotations

import pytest

from .validate_base import (
    FLAG,
    LAYOUT,
    OUT,
    ROW,
    X,
    Y,
    diagnostics,
    edit,
    passing_params,
    shown,
)

PASSING = {
    "workload": [
        ("every-kind-of-value", edit(
            FLAG, FLAG + "\n      k: {type: \"int | tuple[int, int]\", default: 1}\n"
                  "      eps: {type: \"float | None\", default: null}\n"
                  "      mode: {type: \"'a' | 'b'\", default: a}\n      " + LAYOUT,
            ROW, "{M: 2, N: 3, k: [3, 3], eps: 0.5, mode: b, flag: true, "
                 "layout: {contiguous: {packing: aligned, metadata_kind: per_row, "
                 "alignment: 16}},")),
        ("refinement-holds", edit(OUT, '    shape_rules: ["M < N"]\n' + OUT)),
        ("generated-values", edit(
            X, X + '\n      cu: {dtype: int32, shape: "[K]", values: "prefix_sum(lens)"}',
            "M: Dim,", "M: Dim, K: Dim,",
            "    inputs:", "    data: {lens: Shape}\n    inputs:",
            ROW, "{M: 2, N: 3, K: 3, lens: [4, 5],")),
        ("single-dtype-needs-no-case", edit(
            '"DType[float16 | bfloat16]"', '"DType[bfloat16]"',
            ", dtype_cases: [{T: float16}]", "")),
    ],
}


@pytest.mark.parametrize("text", passing_params(PASSING))
def test_passing(text: str) -> None:
    assert shown(diagnostics(text)) == []


FAILING = [
    pytest.param(
        edit(ROW, "{M: 2,"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0]: workload 'small' does not give N",
            ),
        ],
        id="workload:missing-index",
    ),
    pytest.param(
        edit(FLAG, "k: {type: int}"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0]: workload 'small' does not give k",
            ),
        ],
        id="workload:missing-required-param",
    ),
    pytest.param(
        edit("{T: float16}", "{T: float32}"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0].dtype_cases[0]: T = 'float32' is not in"
                " DType[float16 | bfloat16]",
            ),
        ],
        id="workload:dtype-not-in-the-set",
    ),
    pytest.param(
        edit(", dtype_cases: [{T: float16}]", ""),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0]: dtype case does not give T (float16 |"
                " bfloat16)",
            ),
        ],
        id="workload:dtype-case-missing",
    ),
    pytest.param(
        edit("{T: float16}", "{T: float16, M: float16}"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0].dtype_cases[0]: 'M' is not a DType index of Op",
            ),
        ],
        id="workload:dtype-case-names-a-dim",
    ),
    pytest.param(
        edit(OUT, '    shape_rules: ["M > N"]\n' + OUT),
        [
            (
                "workload",
                "op.yaml:14: in Op.workloads[0].dtype_cases[0]: workload 'small' breaks"
                " refinement 'M > N' (M=2, N=3)",
            ),
        ],
        id="workload:refinement-broken",
    ),
    pytest.param(
        edit(ROW, "{M: 2, N: 3, Q: 1,"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0].Q: 'Q' is not an index or a param of Op",
            ),
        ],
        id="workload:unknown-key",
    ),
    pytest.param(
        edit(OUT, '    let: {A: "M + 1"}\n' + OUT, ROW, "{M: 2, N: 3, A: 3,"),
        [
            (
                "workload",
                "op.yaml:14: in Op.workloads[0].A: 'A' is not an index or a param of Op (let"
                " values are computed, not given)",
            ),
        ],
        id="workload:let-value-given",
    ),
    pytest.param(
        edit("label: small}", "label: small, some: [x]}"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0].some: some names 'x', which is not an optional"
                " input (none)",
            ),
        ],
        id="workload:some-names-a-required-input",
    ),
    pytest.param(
        edit(ROW, "{M: -2, N: 3,"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0].M: M = -2 is not Dim: expected a non-negative"
                " integer",
            ),
        ],
        id="workload:negative-dim",
    ),
    pytest.param(
        edit(ROW, "{M: true, N: 3,"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0].M: M = True is not Dim: expected a non-negative"
                " integer",
            ),
        ],
        id="workload:bool-for-a-dim",
    ),
    pytest.param(
        edit(ROW, "{M: 2, N: 3, flag: 3,"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0].flag: flag = 3 is not Bool: expected true or"
                " false",
            ),
        ],
        id="workload:param-of-another-kind",
    ),
    pytest.param(
        edit(OUT, '    let: {A: "M - 5"}\n' + OUT, Y, 'y: {dtype: T, shape: "[A, N]"}'),
        [
            (
                "workload",
                "op.yaml:14: in Op.workloads[0].dtype_cases[0]: workload 'small': y would have"
                " shape (-3, 3) ([A, N]), with a negative axis",
            ),
        ],
        id="workload:negative-axis",
    ),
    pytest.param(
        edit(X, X + '\n      w: {dtype: T, shape: "[N]", optional: flag}'),
        [
            (
                "workload",
                "op.yaml:14: in Op.workloads[0].dtype_cases[0]: workload 'small' omits w, which"
                " is required here (flag is False)",
            ),
        ],
        id="workload:optional-input-required-here",
    ),
    pytest.param(
        edit(OUT, '    let: {A: "M // (N - 3)"}\n' + OUT),
        [
            (
                "workload",
                "op.yaml:14: in Op.workloads[0].dtype_cases[0]: workload 'small': let A = M //"
                " (N - 3): M // (N - 3): division by zero",
            ),
        ],
        id="workload:let-fails",
    ),
    pytest.param(
        edit(X, X + '\n      cu: {dtype: int32, shape: "[M]", values: "prefix_sum(lens)"}', "    inputs:", "    data: {lens: Shape}\n    inputs:", ROW, "{M: 2, N: 3, lens: [1, 2],"),
        [
            (
                "workload",
                "op.yaml:15: in Op.workloads[0].dtype_cases[0]: workload 'small': values of cu"
                " (prefix_sum(lens)) gives 3 elements, but its shape (2,) holds 2",
            ),
        ],
        id="workload:values-length-mismatch",
    ),
    pytest.param(
        edit(X, X + '\n      cu: {dtype: int32, shape: "[M]", values: "prefix_sum(lens)"}', "    inputs:", "    data: {lens: Shape}\n    inputs:"),
        [
            (
                "workload",
                "op.yaml:15: in Op.workloads[0]: workload 'small' does not give lens",
            ),
        ],
        id="workload:data-missing",
    ),
    pytest.param(
        edit(FLAG, LAYOUT, ROW, "{M: 2, N: 3, layout: {weird: {}},"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0].layout: layout = {'weird': {}} is not"
                " MGroupedLayout: 'weird' is not a constructor of MGroupedLayout (contiguous,"
                " masked)",
            ),
        ],
        id="workload:adt-not-a-constructor",
    ),
    pytest.param(
        edit(FLAG, LAYOUT, ROW, "{M: 2, N: 3, layout: {masked: {max_m: 2, x: 1}},"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0].layout: layout = {'masked': {'max_m': 2, 'x':"
                " 1}} is not MGroupedLayout: masked has fields max_m; got max_m, x",
            ),
        ],
        id="workload:adt-wrong-fields",
    ),
    pytest.param(
        edit(FLAG, LAYOUT, ROW, "{M: 2, N: 3, layout: {masked: {max_m: -1}},"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0].layout: layout = {'masked': {'max_m': -1}} is"
                " not MGroupedLayout: masked.max_m: expected a non-negative integer",
            ),
        ],
        id="workload:adt-field-of-another-kind",
    ),
    pytest.param(
        edit(FLAG, LAYOUT, ROW, "{M: 2, N: 3, layout: {contiguous: {packing: tight, metadata_kind: offsets, alignment: 4}},"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0].layout: layout = {'contiguous': {'packing':"
                " 'tight', 'metadata_kind': 'offsets', 'alignment': 4}} is not MGroupedLayout:"
                ' contiguous breaks its invariant "(packing == \'tight\') == (alignment == 1) and'
                ' alignment >= 1"',
            ),
        ],
        id="workload:adt-invariant-broken",
    ),
    pytest.param(
        edit(FLAG, LAYOUT, ROW, "{M: 2, N: 3, layout: masked,"),
        [
            (
                "workload",
                "op.yaml:13: in Op.workloads[0].layout: layout = 'masked' is not"
                " MGroupedLayout: write an ADT value as {constructor: {field: value}};"
                " constructors: contiguous, masked",
            ),
        ],
        id="workload:adt-value-not-a-mapping",
    ),
]


@pytest.mark.parametrize(("text", "expected"), FAILING)
def test_failing(text: str, expected: list[tuple[str, str]]) -> None:
    assert shown(diagnostics(text)) == expected
