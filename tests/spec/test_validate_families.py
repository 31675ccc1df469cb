"""The validator's ``family`` rule (type families are total, with no case twice) and its
``solvable`` rule (unification reads every forall index). Specs that pass and specs that break
them, with the exact diagnostic (``file:line: in path: message``) and the rule id."""

from __future__ import annotations

import pytest

from .validate_base import (
    FLAG,
    FLOPS,
    FORALL,
    LAYOUT,
    ROW,
    X,
    Y,
    diagnostics,
    edit,
    mat,
    passing_params,
    shown,
)

#: b's shape is read by no required input: B is given only where b is
OPT = ("forall: {M: Dim,", "forall: {B: Shape, M: Dim,",
       X, X + '\n      b: {dtype: T, shape: "[*B]", optional: true}',
       "    outputs:", '    shape_rules:\n    - "not present(b) or expands_to(B, [M, N])"\n'
       "    outputs:")
#: an output db of b's dtype U, None where NULLABLE holds
NULLABLE_DB = ("forall: {M: Dim,", 'forall: {U: "DType[float32 | float16]", M: Dim,',
               X, X + '\n      b: {dtype: U, shape: "[M, N]", optional: true}',
               Y, Y + '\n      db: {dtype: U, shape: "[M, N]", nullable: "NULLABLE"}')
#: an optional input b of its own dtype U
DTYPE_B = ("forall: {M: Dim,", 'forall: {U: "DType[float32 | float16]", M: Dim,',
           X, X + '\n      b: {dtype: U, shape: "[M, N]", optional: true}')
_ONLY_B = ("reads B, which only the optional input b gives: it may appear only in its "
           "declaration and in shape rules of the form 'not present(b) or ...'")

PASSING = {
    "family": [
        ("bool-total", edit(*mat('{when: false, is: "[R, C]"}', '{when: true, is: "[C, R]"}'))),
        ("wildcard", edit(*mat('{when: true, is: "[C, R]"}', '{when: _, is: "[R, C]"}'))),
        ("enum-total", edit(
            FLAG, "mode: {type: \"'a' | 'b'\", default: a}",
            FORALL, "    types:\n      Mat:\n        params: {t: \"'a' | 'b'\", R: Dim, C: Dim}\n"
                    "        match: t\n        cases:\n"
                    '        - {when: a, is: "[R, C]"}\n        - {when: b, is: "[C, R]"}\n'
                    + FORALL,
            X, 'x: {dtype: T, shape: "Mat[mode, M, N]"}')),
        ("two-discriminants", edit(
            FORALL, "    types:\n      Two:\n        params: {s: Bool, t: Bool, R: Dim}\n"
                    "        match: [s, t]\n        cases:\n"
                    '        - {when: [true, _], is: "[R]"}\n'
                    '        - {when: [false, true], is: "[R]"}\n'
                    '        - {when: [false, false], is: "[R]"}\n' + FORALL,
            X, 'x: {dtype: T, shape: "[*Two[flag, flag, M], N]"}')),
        ("adt-constructors", edit(
            FLAG, LAYOUT,
            FORALL, "    types:\n      Rows:\n        params: {l: MGroupedLayout, M: Dim}\n"
                    "        match: l\n        cases:\n"
                    '        - {when: contiguous, is: "[M]"}\n'
                    '        - {when: masked, is: "[l.max_m]"}\n' + FORALL,
            Y, 'y: {dtype: T, shape: "[*Rows[layout, M], N]"}',
            ROW, "{M: 2, N: 3, layout: {masked: {max_m: 4}},")),
    ],
    "solvable": [
        ("affine-axis", edit(X, 'x: {dtype: T, shape: "[2 * M + 1, N]"}')),
        ("one-unknown-star", edit(
            "M: Dim,", "B: Shape, M: Dim,", X, 'x: {dtype: T, shape: "[*B, M, N]"}',
            ROW, "{B: [], M: 2, N: 3,")),
        ("every-family-case", edit(*mat('{when: false, is: "[R, C]"}',
                                        '{when: true, is: "[C, R]"}'))),
        # an index only an optional input gives: read where that input is present
        ("optional-input-index", edit(
            *OPT, ROW, ROW + " B: [3], some: [b],", "label: small}",
            "label: small}\n  - {M: 2, N: 3, dtype_cases: [{T: float16}], label: without-b}")),
        ("optional-input-dtype", edit(
            "forall: {M: Dim,", 'forall: {U: "DType[float32 | float16]", M: Dim,',
            X, X + '\n      b: {dtype: U, shape: "[M, N]", optional: true}')),
        # an output that is None wherever the optional input is absent may have its dtype
        # (a gradient of b)
        ("optional-input-dtype-of-a-nullable-output", edit(*NULLABLE_DB, "NULLABLE",
                                                           "not flag or not present(b)")),
        # read in the branch only a given b takes (clamp's promotion of its bounds)
        ("optional-input-dtype-in-a-guarded-branch", edit(
            *DTYPE_B, Y, 'y: {dtype: "promote(T, U) if present(b) else T", shape: "[M, N]"}')),
        ("optional-input-dtype-in-a-guarded-branch-of-a-let", edit(
            *DTYPE_B, "    outputs:", '    let: {R: "T if not present(b) else promote(T, U)"}\n'
            "    outputs:", Y, 'y: {dtype: R, shape: "[M, N]"}')),
    ],
}


@pytest.mark.parametrize("text", passing_params(PASSING))
def test_passing(text: str) -> None:
    assert shown(diagnostics(text)) == []


FAILING = [
    pytest.param(
        edit(*mat('{when: false, is: "[R, C]"}')),
        [
            (
                "family",
                "op.yaml:9: in Op.signature.types.Mat.cases: Mat is not total: no case for t ="
                " true",
            ),
        ],
        id="family:not-total",
    ),
    pytest.param(
        edit(*mat('{when: false, is: "[R, C]"}', '{when: true, is: "[C, R]"}', '{when: true, is: "[R, R]"}')),
        [
            (
                "family",
                "op.yaml:12: in Op.signature.types.Mat.cases[2]: this case is already covered"
                " by case 1 (cases are tried in order; remove the duplicate)",
            ),
        ],
        id="family:duplicate-case",
    ),
    pytest.param(
        edit(*mat('{when: _, is: "[R, C]"}', '{when: true, is: "[C, R]"}')),
        [
            (
                "family",
                "op.yaml:11: in Op.signature.types.Mat.cases[1]: this case is already covered"
                " by case 0 (cases are tried in order; remove the duplicate)",
            ),
        ],
        id="family:case-after-wildcard",
    ),
    pytest.param(
        edit(*mat('{when: false, is: "[R, C]"}', '{when: maybe, is: "[C, R]"}', '{when: _, is: "[C, R]"}')),
        [
            (
                "family",
                "op.yaml:11: in Op.signature.types.Mat.cases[1]: when 'maybe' is not a value of"
                " t (false, true)",
            ),
        ],
        id="family:when-not-a-value",
    ),
    pytest.param(
        edit(FORALL, "    types:\n      Mat:\n        params: {t: Dim, R: Dim, C: Dim}\n        match: t\n        cases:\n        - {when: 1, is: \"[R, C]\"}\n" + FORALL, X, 'x: {dtype: T, shape: "Mat[M, M, N]"}'),
        [
            (
                "family",
                "op.yaml:8: in Op.signature.types.Mat.match: Mat matches on t, which is Dim; a"
                " discriminant is Bool, an enum, a DType or an ADT",
            ),
        ],
        id="family:non-finite-discriminant",
    ),
    pytest.param(
        edit(FORALL, "    types:\n      Mat:\n        params: {t: Bool, R: Dim, C: Dim}\n        match: s\n        cases:\n        - {when: _, is: \"[R, C]\"}\n" + FORALL, X, 'x: {dtype: T, shape: "Mat[flag, M, N]"}'),
        [
            (
                "family",
                "op.yaml:8: in Op.signature.types.Mat.match: match names 's', which is not a"
                " parameter of Mat (t, R, C)",
            ),
        ],
        id="family:match-not-a-param",
    ),
    pytest.param(
        edit(FORALL, "    types:\n      Two:\n        params: {s: Bool, t: Bool, R: Dim}\n        match: [s, t]\n        cases:\n        - {when: [true], is: \"[R]\"}\n        - {when: [_, _], is: \"[R]\"}\n" + FORALL, X, 'x: {dtype: T, shape: "[*Two[flag, flag, M], N]"}'),
        [
            (
                "family",
                "op.yaml:10: in Op.signature.types.Two.cases[0]: when must give 2 values (s, t)",
            ),
        ],
        id="family:when-arity",
    ),
    pytest.param(
        edit(FORALL, "    types:\n      Two:\n        params: {s: Bool, t: Bool, R: Dim}\n        match: [s, t]\n        cases:\n        - {when: [true, _], is: \"[R]\"}\n        - {when: [false, true], is: \"[R]\"}\n" + FORALL, X, 'x: {dtype: T, shape: "[*Two[flag, flag, M], N]"}'),
        [
            (
                "family",
                "op.yaml:9: in Op.signature.types.Two.cases: Two is not total: no case for s x"
                " t = (false, false)",
            ),
        ],
        id="family:two-discriminants-not-total",
    ),
    pytest.param(
        edit(FLAG, LAYOUT, FORALL, "    types:\n      Rows:\n        params: {l: MGroupedLayout, M: Dim}\n        match: l\n        cases:\n        - {when: masked, is: \"[l.max_m]\"}\n" + FORALL, Y, 'y: {dtype: T, shape: "[*Rows[layout, M], N]"}', ROW, "{M: 2, N: 3, layout: {masked: {max_m: 4}},"),
        [
            (
                "family",
                "op.yaml:9: in Op.signature.types.Rows.cases: Rows is not total: no case for l"
                " = contiguous",
            ),
        ],
        id="family:adt-not-total",
    ),
    pytest.param(
        edit(FLAG, LAYOUT, FORALL, "    types:\n      Rows:\n        params: {l: MGroupedLayout, M: Dim}\n        match: l\n        cases:\n        - {when: contiguous, is: \"[l.max_m]\"}\n        - {when: masked, is: \"[M]\"}\n" + FORALL, Y, 'y: {dtype: T, shape: "[*Rows[layout, M], N]"}', ROW, "{M: 2, N: 3, layout: {masked: {max_m: 4}},"),
        [
            (
                "family",
                "op.yaml:10: in Op.signature.types.Rows.cases[0]: this case of Rows reads"
                " l.max_m, but it selects l = contiguous, which has no field 'max_m' (a field"
                " of masked only)",
            ),
        ],
        id="family:adt-field-of-another-constructor",
    ),
    pytest.param(
        # a wildcard selects every constructor earlier cases leave: each must have the field
        edit(FLAG, LAYOUT, FORALL, "    types:\n      Rows:\n        params: {l: MGroupedLayout, M: Dim}\n        match: l\n        cases:\n        - {when: masked, is: \"[M]\"}\n        - {when: _, is: \"[l.max_m]\"}\n" + FORALL, Y, 'y: {dtype: T, shape: "[*Rows[layout, M], N]"}', ROW, "{M: 2, N: 3, layout: {masked: {max_m: 4}},"),
        [
            (
                "family",
                "op.yaml:11: in Op.signature.types.Rows.cases[1]: this case of Rows reads"
                " l.max_m, but it selects l = contiguous, which has no field 'max_m' (a field"
                " of masked only)",
            ),
        ],
        id="family:adt-field-under-a-wildcard",
    ),
    pytest.param(
        edit(FORALL, "    types:\n      Sz:\n        params: {d: \"DType[float16 | bfloat16]\", R: Dim}\n        match: d\n        cases:\n        - {when: float16, is: \"[R]\"}\n" + FORALL, Y, 'y: {dtype: T, shape: "Sz[T, M]"}'),
        [
            (
                "family",
                "op.yaml:9: in Op.signature.types.Sz.cases: Sz is not total: no case for d ="
                " bfloat16",
            ),
        ],
        id="family:dtype-not-total",
    ),
    pytest.param(
        edit("forall: {M: Dim,", "forall: {K: Dim, M: Dim,"),
        [
            (
                "solvable",
                "op.yaml:5: in Op.signature.forall.K: forall index K is not solvable from the"
                " inputs: K does not appear where unification can read it (a bare axis, an"
                " affine axis like 2 * K + 1, or the only unknown-length *K of a required"
                " input)",
            ),
            (
                "workload",
                "op.yaml:13: in Op.workloads[0]: workload 'small' does not give K",
            ),
        ],
        id="solvable:absent-dim",
    ),
    pytest.param(
        edit(X, 'x: {dtype: float32, shape: "[M, N]"}'),
        [
            (
                "solvable",
                "op.yaml:5: in Op.signature.forall.T: forall index T is not solvable from the"
                " inputs: no required input has dtype T",
            ),
        ],
        id="solvable:dtype-of-no-input",
    ),
    pytest.param(
        edit(X, 'x: {dtype: T, shape: "[M * M, N]"}'),
        [
            (
                "solvable",
                "op.yaml:5: in Op.signature.forall.M: forall index M is not solvable from the"
                " inputs: M does not appear where unification can read it (a bare axis, an"
                " affine axis like 2 * M + 1, or the only unknown-length *M of a required"
                " input)",
            ),
        ],
        id="solvable:non-affine-axis",
    ),
    pytest.param(
        edit(X, 'x: {dtype: T, shape: "[M]"}\n      w: {dtype: T, shape: "[N]", optional: true}', "label: small}", "label: small, some: [w]}"),
        [
            # N has a value only where w is given: an output and the roofline cannot read it
            ("solvable", "op.yaml:12: in Op.signature.outputs.y.shape: '[M, N]' reads N, which "
                         "only the optional input w gives: it may appear only in its declaration "
                         "and in shape rules of the form 'not present(w) or ...'"),
            ("solvable", "op.yaml:16: in Op.roofline.flops: 'M * N' reads N, which only the "
                         "optional input w gives: it may appear only in its declaration and in "
                         "shape rules of the form 'not present(w) or ...'"),
        ],
        id="solvable:only-in-an-optional-input",
    ),
    pytest.param(
        edit("forall: {M: Dim,", "forall: {A: Shape, B: Shape, M: Dim,", X, 'x: {dtype: T, shape: "[*A, *B, M, N]"}', ROW, "{A: [1], B: [2], M: 2, N: 3,"),
        [
            (
                "solvable",
                "op.yaml:5: in Op.signature.forall.A: forall index A is not solvable from the"
                " inputs: A does not appear where unification can read it (a bare axis, an"
                " affine axis like 2 * A + 1, or the only unknown-length *A of a required"
                " input)",
            ),
            (
                "solvable",
                "op.yaml:5: in Op.signature.forall.B: forall index B is not solvable from the"
                " inputs: B does not appear where unification can read it (a bare axis, an"
                " affine axis like 2 * B + 1, or the only unknown-length *B of a required"
                " input)",
            ),
        ],
        id="solvable:two-unknown-stars",
    ),
    pytest.param(
        edit(*mat('{when: false, is: "[R, C]"}', '{when: true, is: "[R, R]"}')),
        [
            (
                "solvable",
                "op.yaml:12: in Op.signature.forall.N: forall index N is not solvable from the"
                " inputs: N does not appear where unification can read it (a bare axis, an"
                " affine axis like 2 * N + 1, or the only unknown-length *N of a required"
                " input) (when Mat[flag, M, N] is [R, R])",
            ),
        ],
        id="solvable:in-one-family-case",
    ),
    pytest.param(
        edit(*OPT[:4], "    outputs:", '    shape_rules:\n    - "expands_to(B, [M, N])"\n'
             "    outputs:"),
        [("solvable", f"op.yaml:12: in Op.signature.shape_rules[0]: 'expands_to(B, [M, N])' "
                      f"{_ONLY_B}"),
         ("workload", "op.yaml:16: in Op.workloads[0].dtype_cases[0]: workload 'small': "
                      "refinement 'expands_to(B, [M, N])': 'B' has no value here")],
        id="solvable:optional-index-in-an-unguarded-rule",
    ),
    pytest.param(
        edit(*OPT, Y, 'y: {dtype: T, shape: "[M, N, *B]"}', FLOPS, 'flops: "M * prod(B)"'),
        [("solvable", f"op.yaml:14: in Op.signature.outputs.y.shape: '[M, N, *B]' {_ONLY_B}"),
         ("solvable", f"op.yaml:18: in Op.roofline.flops: 'M * prod(B)' {_ONLY_B}"),
         ("workload", "op.yaml:16: in Op.workloads[0].dtype_cases[0]: workload 'small': "
                      "shape of y ([M, N, *B]): 'B' has no value here")],
        id="solvable:optional-index-in-an-output-and-the-roofline",
    ),
    pytest.param(
        edit(*NULLABLE_DB, "NULLABLE", "not flag"),
        [("solvable", "op.yaml:13: in Op.signature.outputs.db.dtype: 'U' reads U, which only "
                      "the optional input b gives: it may appear only in its declaration and "
                      "in shape rules of the form 'not present(b) or ...'")],
        id="solvable:optional-dtype-of-an-output-present-without-b",
    ),
    pytest.param(
        edit(*DTYPE_B, Y, 'y: {dtype: "T if present(b) else promote(T, U)", shape: "[M, N]"}'),
        [("solvable", "op.yaml:12: in Op.signature.outputs.y.dtype: 'T if present(b) else "
                      "promote(T, U)' reads U, which only the optional input b gives: it may "
                      "appear only in its declaration and in shape rules of the form 'not "
                      "present(b) or ...'")],
        id="solvable:optional-dtype-in-the-branch-without-b",
    ),
    pytest.param(
        edit(*OPT, ROW, ROW + " some: [b],"),
        [("workload", "op.yaml:16: in Op.workloads[0]: workload 'small' does not give B")],
        id="workload:optional-index-where-its-input-is-given",
    ),
]


@pytest.mark.parametrize(("text", "expected"), FAILING)
def test_failing(text: str, expected: list[tuple[str, str]]) -> None:
    assert shown(diagnostics(text)) == expected
