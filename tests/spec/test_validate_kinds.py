"""The validator's ``kind`` rule: kinds agree wherever an index is used. Specs that pass it
and specs that break it, with the exact diagnostic (``file:line: in path: message``)."""

from __future__ import annotations

import pytest

from .validate_base import (
    FLAG,
    FLOPS,
    OUT,
    ROW,
    X,
    diagnostics,
    edit,
    mat,
    passing_params,
    shown,
)

PASSING = {
    "kind": [
        ("splice-shape", edit(
            "M: Dim,", "B: Shape, M: Dim,", X, 'x: {dtype: T, shape: "[*B, M, N]"}',
            ROW, "{B: [4, 5], M: 2, N: 3,")),
        ("predicates-and-formulas", edit(
            OUT, '    shape_rules: ["M >= 1 and (N % 2 == 1 or flag)", '
                 '"T == float16 or itemsize(T) == 2"]\n' + OUT,
            FLOPS, 'flops: "M * N / 2 if flag else M * N"')),
    ],
}


@pytest.mark.parametrize("text", passing_params(PASSING))
def test_passing(text: str) -> None:
    assert shown(diagnostics(text)) == []


FAILING = [
    pytest.param(
        edit("N: Dim,", "N: Dimm,"),
        [
            (
                "kind",
                "op.yaml:5: in Op.signature.forall.N: unknown kind 'Dimm'; expected Dim, Shape,"
                " Axes, Bool, Int, Float, DType[...], a dtype name, an enum of quoted strings,"
                " Maybe[...] or an ADT (MGroupedLayout)",
            ),
        ],
        id="kind:unknown-kind",
    ),
    pytest.param(
        edit("forall: {M: Dim", "forall: {M: Shape", ROW, "{M: [2], N: 3,"),
        [
            (
                "kind",
                "op.yaml:9: in Op.signature.inputs.x.shape: '[M, N]': M is a Shape; splice it"
                " into the list as *M",
            ),
            (
                "kind",
                "op.yaml:11: in Op.signature.outputs.y.shape: '[M, N]': M is a Shape; splice it"
                " into the list as *M",
            ),
            (
                "kind",
                "op.yaml:15: in Op.roofline.flops: 'M * N': '*' needs numbers; M is Shape",
            ),
        ],
        id="kind:shape-not-spliced",
    ),
    pytest.param(
        edit(X, 'x: {dtype: T, shape: "[*M, N]"}'),
        [
            (
                "kind",
                "op.yaml:9: in Op.signature.inputs.x.shape: '[*M, N]': *M splices a Shape, but"
                " it is Dim",
            ),
        ],
        id="kind:splice-a-dim",
    ),
    pytest.param(
        edit(X, 'x: {dtype: T, shape: "M"}'),
        [
            (
                "kind",
                "op.yaml:9: in Op.signature.inputs.x.shape: 'M': a shape is a list ([M, N],"
                " [*S]) or a type family application (Mat[t, M, K])",
            ),
        ],
        id="kind:shape-not-a-list",
    ),
    pytest.param(
        edit(X, 'x: {dtype: M, shape: "[M, N]"}'),
        [
            (
                "kind",
                "op.yaml:9: in Op.signature.inputs.x.dtype: 'M' is Dim, but a DType is expected"
                " here",
            ),
        ],
        id="kind:dtype-not-a-dtype",
    ),
    pytest.param(
        edit(OUT, '    shape_rules: ["M + N"]\n' + OUT),
        [
            (
                "kind",
                "op.yaml:10: in Op.signature.shape_rules[0]: 'M + N' is Dim, but a Bool"
                " predicate is expected here",
            ),
        ],
        id="kind:predicate-not-bool",
    ),
    pytest.param(
        edit(OUT, '    shape_rules: ["not M"]\n' + OUT),
        [
            (
                "kind",
                "op.yaml:10: in Op.signature.shape_rules[0]: 'not M': M is Dim, but a Bool is"
                " needed here",
            ),
        ],
        id="kind:not-of-a-number",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "M > N"'),
        [
            (
                "kind",
                "op.yaml:15: in Op.roofline.flops: 'M > N' is Bool, but a number is expected"
                " here",
            ),
        ],
        id="kind:formula-not-a-number",
    ),
    pytest.param(
        edit(OUT, '    shape_rules: ["flag == M"]\n' + OUT),
        [
            (
                "kind",
                "op.yaml:10: in Op.signature.shape_rules[0]: 'flag == M': cannot compare flag"
                " (Bool) == M (Dim): the kinds differ",
            ),
        ],
        id="kind:compare-different-kinds",
    ),
    pytest.param(
        edit(FLAG, "mode: {type: \"'a' | 'b'\", default: a}", OUT, "    shape_rules: [\"mode == 'c'\"]\n" + OUT),
        [
            (
                "kind",
                'op.yaml:10: in Op.signature.shape_rules[0]: "mode == \'c\'": \'c\' is not a value'
                " of 'a' | 'b'; the comparison mode == 'c' is always False",
            ),
        ],
        id="kind:enum-literal-not-a-value",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "M if flag else T"'),
        [
            (
                "kind",
                "op.yaml:15: in Op.roofline.flops: 'M if flag else T': M if flag else T: the"
                " branches have different kinds (Dim and DType[float16 | bfloat16])",
            ),
        ],
        id="kind:branches-differ",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "M * x"'),
        [
            (
                "kind",
                "op.yaml:15: in Op.roofline.flops: 'M * x': tensor 'x' is not a value; write"
                " present(x)",
            ),
        ],
        id="kind:tensor-as-value",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "ceil_div(M)"'),
        [
            (
                "kind",
                "op.yaml:15: in Op.roofline.flops: 'ceil_div(M)': ceil_div takes 2 arguments,"
                " got 1",
            ),
        ],
        id="kind:primitive-arity",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "ceil_div(M, flag)"'),
        [
            (
                "kind",
                "op.yaml:15: in Op.roofline.flops: 'ceil_div(M, flag)': ceil_div: argument 2"
                " must be Dim or Int, but flag is Bool",
            ),
        ],
        id="kind:primitive-argument",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "ceil_div(M, N, x=1)"'),
        [
            (
                "kind",
                "op.yaml:15: in Op.roofline.flops: 'ceil_div(M, N, x=1)': ceil_div takes no"
                " keyword 'x'",
            ),
        ],
        id="kind:primitive-keyword",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "M if present(M) else N"'),
        [
            (
                "kind",
                "op.yaml:15: in Op.roofline.flops: 'M if present(M) else N': present(M) needs"
                " an optional tensor or a Maybe parameter; it is Dim",
            ),
        ],
        id="kind:present-of-a-dim",
    ),
    pytest.param(
        edit(*mat('{when: _, is: "[R, C]"}', use='x: {dtype: T, shape: "Mat[flag, M]"}')),
        [
            (
                "kind",
                "op.yaml:15: in Op.signature.inputs.x.shape: 'Mat[flag, M]': Mat[flag, M]: Mat"
                " takes 3 arguments (t, R, C), got 2",
            ),
        ],
        id="kind:family-arity",
    ),
    pytest.param(
        edit(*mat('{when: _, is: "[R, C]"}', use='x: {dtype: T, shape: "Mat[M, M, N]"}')),
        [
            (
                "kind",
                "op.yaml:15: in Op.signature.inputs.x.shape: 'Mat[M, M, N]': Mat[M, M, N]:"
                " Mat's parameter t is Bool, but M is Dim",
            ),
        ],
        id="kind:family-argument",
    ),
    pytest.param(
        edit(*mat('{when: _, is: "R"}')),
        [
            (
                "kind",
                "op.yaml:10: in Op.signature.types.Mat.cases[0].is: 'R' is Dim, but a shape is"
                " expected here",
            ),
        ],
        id="kind:family-case-not-a-shape",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "M | N"'),
        [
            (
                "kind",
                "op.yaml:15: in Op.roofline.flops: 'M | N': M | N: '|' is only part of kind"
                " syntax",
            ),
        ],
        id="kind:pipe-outside-a-kind",
    ),
    pytest.param(
        edit(X, 'x: {dtype: T, shape: "[M, N]", mutated: "1"}'),
        [
            (
                "kind",
                "op.yaml:9: in Op.signature.inputs.x.mutated: '1' is Dim, but a Bool predicate"
                " is expected here",
            ),
        ],
        id="kind:effect-not-bool",
    ),
]


@pytest.mark.parametrize(("text", "expected"), FAILING)
def test_failing(text: str, expected: list[tuple[str, str]]) -> None:
    assert shown(diagnostics(text)) == expected
