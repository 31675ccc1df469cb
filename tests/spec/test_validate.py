"""The static validator: for every rule, specs that pass it and specs that break it, with the
exact diagnostic (``file:line: in path: message``) and the rule id."""

from __future__ import annotations

from pathlib import Path

import pytest

from tileops.spec import (
    RULES,
    Diagnostic,
    load_spec_text,
    load_types_file,
    load_types_text,
    validate_entry,
    validate_spec_file,
    validate_types,
)
from tileops.spec.validate import check_paths

SPECS = Path(__file__).parent / "specs"
TYPES, _ = load_types_file(SPECS / "types.yaml")
TYPES_TEXT = (SPECS / "types.yaml").read_text(encoding="utf-8")

# A valid entry every case edits. Line numbers in the expected messages refer to it.
BASE = """\
Op:
  family: test
  status: spec-only
  signature:
    forall: {M: Dim, N: Dim, T: "DType[float16 | bfloat16]"}
    params:
      flag: {type: bool, default: false}
    inputs:
      x: {dtype: T, shape: "[M, N]"}
    outputs:
      y: {dtype: T, shape: "[M, N]"}
  workloads:
  - {M: 2, N: 3, dtype_cases: [{T: float16}], label: small}
  roofline:
    flops: "M * N"
"""

X = 'x: {dtype: T, shape: "[M, N]"}'
Y = 'y: {dtype: T, shape: "[M, N]"}'
OUT = "    outputs:"
FORALL = "    forall:"
FLAG = "flag: {type: bool, default: false}"
FLOPS = 'flops: "M * N"'
ROW = "{M: 2, N: 3,"
LAYOUT = "layout: {type: MGroupedLayout}"

MAT = (
    "    types:\n"
    "      Mat:\n"
    "        params: {t: Bool, R: Dim, C: Dim}\n"
    "        match: t\n"
    "        cases:\n"
)


def edit(*pairs: str) -> str:
    text = BASE
    for old, new in zip(pairs[::2], pairs[1::2], strict=True):
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


def mat(*cases: str, use: str = 'x: {dtype: T, shape: "Mat[flag, M, N]"}') -> tuple[str, ...]:
    """Edits that declare the family Mat with ``cases`` and use it for x."""
    body = "".join(f"        - {c}\n" for c in cases)
    return (FORALL, MAT + body + FORALL, X, use)


def diagnostics(text: str) -> list[Diagnostic]:
    return validate_spec_file(load_spec_text(text, "op.yaml"), TYPES.adts)


def shown(diags: list[Diagnostic]) -> list[tuple[str, str]]:
    return [(d.rule, str(d)) for d in diags]


def test_the_base_spec_is_valid() -> None:
    assert diagnostics(BASE) == []


# --- passing cases: each exercises its rule and is accepted ------------------------------------

PASSING = {
    "index-source": [
        ("forall-params-let-data", edit(
            OUT, '    let: {P: "M * N"}\n    data: {lens: Shape}\n' + OUT,
            ROW, "{M: 2, N: 3, lens: [1],")),
    ],
    "unknown-name": [
        ("primitives-and-names", edit(FLOPS, 'flops: "ceil_div(M, 128) * max(N, 1) * '
                                             'itemsize(T)"')),
        ("generator-in-values", edit(
            X, X + '\n      cu: {dtype: int32, shape: "[K]", values: "prefix_sum(lens)"}',
            "M: Dim,", "M: Dim, K: Dim,",
            "    inputs:", "    data: {lens: Shape}\n    inputs:",
            ROW, "{M: 2, N: 3, K: 3, lens: [4, 5],")),
    ],
    "kind": [
        ("splice-shape", edit(
            "M: Dim,", "B: Shape, M: Dim,", X, 'x: {dtype: T, shape: "[*B, M, N]"}',
            ROW, "{B: [4, 5], M: 2, N: 3,")),
        ("predicates-and-formulas", edit(
            OUT, '    shape_rules: ["M >= 1 and (N % 2 == 1 or flag)", '
                 '"T == float16 or itemsize(T) == 2"]\n' + OUT,
            FLOPS, 'flops: "M * N / 2 if flag else M * N"')),
    ],
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
    "let-cycle": [
        ("chain", edit(OUT, '    let: {A: "B + 1", B: "M * 2"}\n' + OUT,
                       Y, 'y: {dtype: T, shape: "[A, N]"}')),
    ],
    "solvable": [
        ("affine-axis", edit(X, 'x: {dtype: T, shape: "[2 * M + 1, N]"}')),
        ("one-unknown-star", edit(
            "M: Dim,", "B: Shape, M: Dim,", X, 'x: {dtype: T, shape: "[*B, M, N]"}',
            ROW, "{B: [], M: 2, N: 3,")),
        ("every-family-case", edit(*mat('{when: false, is: "[R, C]"}',
                                        '{when: true, is: "[C, R]"}'))),
    ],
    "effects": [
        ("alias-conditional", edit(
            X, 'x: {dtype: T, shape: "[M, N]", mutated: flag}',
            Y, 'y: {dtype: T, shape: "[M, N]", alias: x}',
            ROW, "{M: 2, N: 3, flag: true,")),
        ("alias-nullable", edit(
            X, 'x: {dtype: T, shape: "[M, N]", mutated: flag}',
            Y, 'y: {dtype: T, shape: "[M, N]", alias: x, nullable: flag}')),
        ("write-only", edit(X, 'x: {dtype: T, shape: "[M, N]", mutated: true, '
                               'write_only: true}')),
        ("buffer", edit(Y, 'y: {dtype: T, shape: "[M, N]", buffer: true}')),
        ("presence", edit(
            X, X + '\n      w: {dtype: T, shape: "[N]", optional: "not flag"}',
            FLOPS, 'flops: "M * N * (2 if present(w) else 1)"',
            "label: small}", "label: small, some: [w]}")),
    ],
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
    "default": [
        ("defaults-of-every-kind", edit(
            FLAG, FLAG + "\n      k: {type: \"int | tuple[int, int]\", default: [1, 2]}\n"
                  "      eps: {type: \"float | None\", default: null}\n"
                  "      n: {type: int, default: -1}\n"
                  "      mode: {type: \"'a' | 'b'\", default: b}\n"
                  "      lay: {type: MGroupedLayout, default: {masked: {max_m: 8}}}")),
    ],
    "composition": [
        ("stages", edit("  roofline:", "  composition:\n    stages:\n"
                                       "    - {name: first, op: Other}\n"
                                       "    - {name: second, op: Other}\n  roofline:")
         + "Other:\n  family: test\n  status: planned\n  signature: {}\n"),
    ],
}


@pytest.mark.parametrize(
    "text",
    [pytest.param(text, id=f"{rule}:{name}") for rule, cases in PASSING.items()
     for name, text in cases],
)
def test_passing(text: str) -> None:
    assert shown(diagnostics(text)) == []


def test_adt_passing() -> None:
    types, lines = load_types_text(TYPES_TEXT, "types.yaml")
    assert validate_types(types, "types.yaml", lines) == []


# --- failing cases: one per rule and sub-case, with the exact diagnostics -----------------------

FAILING = [
    pytest.param(
        edit(FLAG, FLAG + "\n      M: {type: int, default: 1}"),
        [
            (
                "index-source",
                "op.yaml:8: in Op.signature.params.M: index 'M' has two sources: forall and"
                " params; an index is declared exactly once",
            ),
        ],
        id="index-source:forall-and-param",
    ),
    pytest.param(
        edit(OUT, '    let: {flag: "M > 1"}\n' + OUT),
        [
            (
                "index-source",
                "op.yaml:10: in Op.signature.let.flag: index 'flag' has two sources: params and"
                " let; an index is declared exactly once",
            ),
        ],
        id="index-source:param-and-let",
    ),
    pytest.param(
        edit("    inputs:", "    data: {N: Shape}\n    inputs:"),
        [
            (
                "index-source",
                "op.yaml:8: in Op.signature.data.N: index 'N' has two sources: forall and data;"
                " an index is declared exactly once",
            ),
        ],
        id="index-source:forall-and-data",
    ),
    pytest.param(
        edit("N: Dim,", "N: Dim, x: Dim,"),
        [
            (
                "index-source",
                "op.yaml:5: in Op.signature.forall.x: 'x' names both an index and a tensor",
            ),
        ],
        id="index-source:index-and-tensor",
    ),
    pytest.param(
        edit(*mat('{when: _, is: "[R, C]"}'), "forall: {M: Dim,", "forall: {Mat: Dim, M: Dim,"),
        [
            (
                "index-source",
                "op.yaml:11: in Op.signature.forall.Mat: 'Mat' names both an index and a type"
                " family",
            ),
        ],
        id="index-source:index-and-family",
    ),
    pytest.param(
        edit("N: Dim,", "N: Dim, \"2x\": Dim,"),
        [
            (
                "index-source",
                "op.yaml:5: in Op.signature.forall.2x: '2x' is not a valid index name",
            ),
        ],
        id="index-source:bad-index-name",
    ),
    pytest.param(
        edit(X, X + '\n      "a-b": {dtype: T, shape: "[M]"}'),
        [
            (
                "index-source",
                "op.yaml:10: in Op.signature.inputs.a-b: 'a-b' is not a valid tensor name",
            ),
        ],
        id="index-source:bad-tensor-name",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "M * Q"'),
        [
            (
                "unknown-name",
                "op.yaml:15: in Op.roofline.flops: 'M * Q': unknown name 'Q'",
            ),
        ],
        id="unknown-name:index",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "M * NN"'),
        [
            (
                "unknown-name",
                "op.yaml:15: in Op.roofline.flops: 'M * NN': unknown name 'NN' (did you mean"
                " 'N'?)",
            ),
        ],
        id="unknown-name:close-match",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "foo(M)"'),
        [
            (
                "unknown-name",
                "op.yaml:15: in Op.roofline.flops: 'foo(M)': unknown primitive 'foo'; known:"
                " broadcast, ceil_div, conv.out, itemsize, len, max, min, per_axis, pool.out,"
                " present, prod",
            ),
        ],
        id="unknown-name:primitive",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "prefix_sum(M)"'),
        [
            (
                "unknown-name",
                "op.yaml:15: in Op.roofline.flops: 'prefix_sum(M)': unknown primitive"
                " 'prefix_sum'; known: broadcast, ceil_div, conv.out, itemsize, len, max, min,"
                " per_axis, pool.out, present, prod",
            ),
        ],
        id="unknown-name:generator-outside-values",
    ),
    pytest.param(
        edit(X, 'x: {dtype: T, shape: "Foo[M, N]"}'),
        [
            (
                "unknown-name",
                "op.yaml:9: in Op.signature.inputs.x.shape: 'Foo[M, N]': Foo[M, N]: unknown"
                " type family 'Foo' (declared in signature.types: none declared)",
            ),
        ],
        id="unknown-name:family",
    ),
    pytest.param(
        edit(X, X + '\n      z: {dtype: int32, shape: "[M]", values: "M + 1"}'),
        [
            (
                "unknown-name",
                "op.yaml:10: in Op.signature.inputs.z.values: 'M + 1': values is a generator"
                " call, one of arange, balanced_sizes, cumsum, full, prefix_sum",
            ),
        ],
        id="unknown-name:values-not-a-generator",
    ),
    pytest.param(
        edit(OUT, '    shape_rules: ["M <= K"]\n' + OUT),
        [
            (
                "unknown-name",
                "op.yaml:10: in Op.signature.shape_rules[0]: 'M <= K': unknown name 'K'",
            ),
        ],
        id="unknown-name:refinement",
    ),
    pytest.param(
        edit(OUT, '    let: {A: "M * Z"}\n' + OUT),
        [
            (
                "unknown-name",
                "op.yaml:10: in Op.signature.let.A: 'M * Z': unknown name 'Z'",
            ),
        ],
        id="unknown-name:let",
    ),
    pytest.param(
        edit("N: Dim,", "N: Dimm,"),
        [
            (
                "kind",
                "op.yaml:5: in Op.signature.forall.N: unknown kind 'Dimm'; expected Dim, Shape,"
                " Bool, Int, Float, DType[...], a dtype name, an enum of quoted strings,"
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
        edit(OUT, '    let: {A: "A + 1"}\n' + OUT),
        [
            (
                "let-cycle",
                "op.yaml:10: in Op.signature.let.A: let has a cycle: A -> A",
            ),
        ],
        id="let-cycle:self",
    ),
    pytest.param(
        edit(OUT, '    let: {A: "B + 1", B: "A * 2"}\n' + OUT),
        [
            (
                "let-cycle",
                "op.yaml:10: in Op.signature.let.A: let has a cycle: A -> B -> A",
            ),
        ],
        id="let-cycle:two",
    ),
    pytest.param(
        edit(OUT, '    let: {A: "B + 1", B: "C + 1", C: "A"}\n' + OUT),
        [
            (
                "let-cycle",
                "op.yaml:10: in Op.signature.let.A: let has a cycle: A -> B -> C -> A",
            ),
        ],
        id="let-cycle:three",
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
            (
                "solvable",
                "op.yaml:5: in Op.signature.forall.N: forall index N is not solvable from the"
                " inputs: N does not appear where unification can read it (a bare axis, an"
                " affine axis like 2 * N + 1, or the only unknown-length *N of a required"
                " input)",
            ),
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
        edit(Y, 'y: {dtype: T, shape: "[M, N]", alias: z}'),
        [
            (
                "effects",
                "op.yaml:11: in Op.signature.outputs.y.alias: alias 'z' is not an input"
                " (inputs: x)",
            ),
        ],
        id="effects:alias-to-a-missing-input",
    ),
    pytest.param(
        edit(Y, 'y: {dtype: T, shape: "[M, N]", alias: x}'),
        [
            (
                "effects",
                "op.yaml:11: in Op.signature.outputs.y.alias: output y aliases input x, which"
                " is never written; declare mutated on x",
            ),
        ],
        id="effects:alias-to-a-non-mutated-input",
    ),
    pytest.param(
        edit(X, 'x: {dtype: T, shape: "[M, N]", mutated: true}', Y, 'y: {dtype: T, shape: "[N, M]", alias: x}'),
        [
            (
                "effects",
                "op.yaml:11: in Op.signature.outputs.y.alias: output y aliases input x but"
                " their types differ: Tensor[T, [M, N]] vs Tensor[T, [N, M]]",
            ),
        ],
        id="effects:alias-with-another-type",
    ),
    pytest.param(
        edit(X, 'x: {dtype: T, shape: "[M, N]", write_only: true}'),
        [
            (
                "effects",
                "op.yaml:9: in Op.signature.inputs.x.write_only: write_only is for an input the"
                " op writes; set mutated too",
            ),
        ],
        id="effects:write-only-without-mutated",
    ),
    pytest.param(
        edit(X, 'b: {dtype: T, shape: "[N]", optional: true}\n      ' + X),
        [
            (
                "effects",
                "op.yaml:10: in Op.signature.inputs.x: input x is required but comes after the"
                " optional input b; optional inputs come last, so a positional call can leave"
                " them out",
            ),
        ],
        id="effects:optional-before-required",
    ),
    pytest.param(
        edit(X, 'x: {dtype: T, shape: "[M, N]", mutated: true}', Y, 'y: {dtype: T, shape: "[M, N]", alias: x, buffer: true}'),
        [
            (
                "effects",
                "op.yaml:11: in Op.signature.outputs.y.buffer: an aliased output is the input"
                " itself; it cannot also take a caller's buffer",
            ),
        ],
        id="effects:buffer-with-alias",
    ),
    pytest.param(
        edit(X, 'x: {dtype: T, shape: "[M, N]", mutated: "M > 1"}'),
        [
            (
                "effects",
                "op.yaml:9: in Op.signature.inputs.x.mutated: 'M > 1': mutated may depend only"
                " on construction params and present(...); 'M' is not a construction param",
            ),
        ],
        id="effects:mutated-depends-on-a-dim",
    ),
    pytest.param(
        edit(X, X + '\n      w: {dtype: T, shape: "[N]", optional: "N > 2"}'),
        [
            (
                "effects",
                "op.yaml:10: in Op.signature.inputs.w.optional: 'N > 2': optional may depend"
                " only on construction params and present(...); 'N' is not a construction param",
            ),
        ],
        id="effects:optional-depends-on-a-dim",
    ),
    pytest.param(
        edit(Y, 'y: {dtype: T, shape: "[M, N]", nullable: "N > 0"}'),
        [
            (
                "effects",
                "op.yaml:11: in Op.signature.outputs.y.nullable: 'N > 0': nullable may depend"
                " only on construction params and present(...); 'N' is not a construction param",
            ),
        ],
        id="effects:nullable-depends-on-a-dim",
    ),
    pytest.param(
        edit(FLOPS, 'flops: "M if present(x) else N"'),
        [
            (
                "effects",
                "op.yaml:15: in Op.roofline.flops: 'M if present(x) else N': present(x): x is"
                " never absent (it is not optional or nullable)",
            ),
        ],
        id="effects:present-of-a-required-tensor",
    ),
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
    pytest.param(
        edit("default: false", "default: null"),
        [
            (
                "default",
                "op.yaml:7: in Op.signature.params.flag.default: default None is not Bool: None"
                " is only a value of Maybe[...] (write the type as X | None)",
            ),
        ],
        id="default:none-for-a-bool",
    ),
    pytest.param(
        edit(FLAG, "mode: {type: \"'a' | 'b'\", default: c}"),
        [
            (
                "default",
                "op.yaml:7: in Op.signature.params.mode.default: default 'c' is not 'a' | 'b':"
                " expected one of 'a', 'b'",
            ),
        ],
        id="default:enum",
    ),
    pytest.param(
        edit(FLAG, "k: {type: \"int | tuple[int, int]\", default: [1, 2, 3]}"),
        [
            (
                "default",
                "op.yaml:7: in Op.signature.params.k.default: default [1, 2, 3] is not"
                " PerAxis[2]: expected an integer or a list of 2 integers",
            ),
        ],
        id="default:per-axis-length",
    ),
    pytest.param(
        edit(FLAG, "k: {type: Dim, default: -1}"),
        [
            (
                "default",
                "op.yaml:7: in Op.signature.params.k.default: default -1 is not Dim: expected a"
                " non-negative integer",
            ),
        ],
        id="default:dim-negative",
    ),
    pytest.param(
        edit(FLAG, "lay: {type: MGroupedLayout, default: {contiguous: {packing: aligned, metadata_kind: offsets, alignment: 1}}}"),
        [
            (
                "default",
                "op.yaml:7: in Op.signature.params.lay.default: default {'contiguous':"
                " {'packing': 'aligned', 'metadata_kind': 'offsets', 'alignment': 1}} is not"
                ' MGroupedLayout: contiguous breaks its invariant "(packing == \'tight\') =='
                ' (alignment == 1) and alignment >= 1"',
            ),
        ],
        id="default:adt-invariant",
    ),
    pytest.param(
        edit("  roofline:", "  composition:\n    stages:\n    - {name: a, op: Other}\n    - {name: a, op: Other}\n  roofline:") + "Other:\n  family: test\n  status: planned\n  signature: {}\n",
        [
            (
                "composition",
                "op.yaml:17: in Op.composition.stages[1]: stage 'a' is declared twice",
            ),
        ],
        id="composition:duplicate-stage",
    ),
    pytest.param(
        edit("  roofline:", "  composition:\n    stages:\n    - {name: a, op: Missing}\n  roofline:"),
        [
            (
                "composition",
                "op.yaml:16: in Op.composition.stages[0]: stage 'a' runs 'Missing', which is"
                " not a known op",
            ),
        ],
        id="composition:unknown-op",
    ),
    pytest.param(
        edit("  roofline:", "  composition:\n    stages:\n    - {name: a, op: Op}\n  roofline:"),
        [
            (
                "composition",
                "op.yaml:16: in Op.composition.stages[0]: Op cannot be a stage of itself",
            ),
        ],
        id="composition:itself",
    ),
]


@pytest.mark.parametrize(("text", "expected"), FAILING)
def test_failing(text: str, expected: list[tuple[str, str]]) -> None:
    assert shown(diagnostics(text)) == expected


def test_every_rule_has_a_passing_and_a_failing_case() -> None:
    failing_rules = {p.id.split(":")[0] for p in FAILING} | {p.id.split(":")[0] for p in ADT_FAILING}
    assert failing_rules == set(RULES)
    assert set(PASSING) | {"adt"} == set(RULES)
    # each failing case's id names the rule of its first diagnostic
    for p in FAILING:
        assert p.values[1][0][0] == p.id.split(":")[0], p.id


# --- adt: the shared ADTs of types.yaml ---------------------------------------------------------


def types_edit(old: str, new: str) -> str:
    assert old in TYPES_TEXT, old
    return TYPES_TEXT.replace(old, new, 1)


ADT_FAILING = [
    pytest.param(
        types_edit("python: tileops.ops.moe.MaskedLayoutSpec", "python: MaskedLayoutSpec"),
        [(
            "adt",
            "types.yaml:15: in adts.MGroupedLayout.constructors.masked.python: python must be a "
            "dotted class path (package.module.Class), got 'MaskedLayoutSpec'",
        )],
        id="adt:bad-python-path",
    ),
    pytest.param(
        types_edit("fields: {max_m: Dim}", "fields: {max_m: Dimension}"),
        [(
            "adt",
            "types.yaml:16: in adts.MGroupedLayout.constructors.masked.fields.max_m: unknown kind "
            "'Dimension'; expected Dim, Shape, Bool, Int, Float, DType[...], a dtype name, an "
            "enum of quoted strings, Maybe[...] or an ADT (MGroupedLayout)",
        )],
        id="adt:bad-field-kind",
    ),
    pytest.param(
        types_edit("fields: {max_m: Dim}", 'fields: {max_m: Dim}\n        invariant: "max_m + 1"'),
        [(
            "adt",
            "types.yaml:17: in adts.MGroupedLayout.constructors.masked.invariant: 'max_m + 1' is "
            "Dim, but an invariant is a Bool predicate",
        )],
        id="adt:non-bool-invariant",
    ),
    pytest.param(
        types_edit("and alignment >= 1", "and alignmnt >= 1"),
        [(
            "unknown-name",
            "types.yaml:13: in adts.MGroupedLayout.constructors.contiguous.invariant: \"(packing "
            "== 'tight') == (alignment == 1) and alignmnt >= 1\": unknown name 'alignmnt' (did "
            "you mean 'alignment'?)",
        )],
        id="adt:invariant-names-an-unknown-field",
    ),
    pytest.param(
        "adts:\n  L: {constructors: {}}\n",
        [("adt", "types.yaml:2: in adts.L: ADT L has no constructors")],
        id="adt:no-constructors",
    ),
    pytest.param(
        'adts:\n  "a-b": {constructors: {c: {python: a.B}}}\n',
        [("adt", "types.yaml:2: in adts.a-b: 'a-b' is not a valid ADT name")],
        id="adt:bad-name",
    ),
]


@pytest.mark.parametrize(("text", "expected"), ADT_FAILING)
def test_adt_failing(text: str, expected: list[tuple[str, str]]) -> None:
    types, lines = load_types_text(text, "types.yaml")
    assert shown(validate_types(types, "types.yaml", lines)) == expected


def test_an_adt_field_may_be_another_adt() -> None:
    text = ("adts:\n  A: {constructors: {c: {python: a.C, fields: {inner: B}}}}\n"
            "  B: {constructors: {d: {python: a.D}}}\n")
    types, lines = load_types_text(text, "types.yaml")
    assert validate_types(types, "types.yaml", lines) == []


# --- the library calls --------------------------------------------------------------------------


def test_validate_entry_without_a_file_has_no_line() -> None:
    spec = load_spec_text(edit(FLOPS, 'flops: "M * Q"'), "op.yaml")
    (d,) = validate_entry("Op", spec.entries["Op"], adts=TYPES.adts)
    assert d == Diagnostic("<entry>", None, "Op.roofline.flops", "'M * Q': unknown name 'Q'",
                           "unknown-name")
    assert str(d) == "<entry>: in Op.roofline.flops: 'M * Q': unknown name 'Q'"
    # with the file it names the line
    (d,) = validate_entry("Op", spec.entries["Op"], spec=spec, adts=TYPES.adts)
    assert str(d) == "op.yaml:15: in Op.roofline.flops: 'M * Q': unknown name 'Q'"


def test_validate_spec_file_takes_the_known_ops() -> None:
    text = edit("  roofline:", "  composition:\n    stages:\n    - {name: a, op: Elsewhere}\n"
                               "  roofline:")
    spec = load_spec_text(text, "op.yaml")
    assert validate_spec_file(spec, TYPES.adts, known_ops={"Op", "Elsewhere"}) == []
    assert [d.rule for d in validate_spec_file(spec, TYPES.adts)] == ["composition"]


def test_an_adt_is_unknown_without_its_types_file() -> None:
    spec = load_spec_text(edit(FLAG, LAYOUT, ROW, "{M: 2, N: 3, layout: {masked: {max_m: 4}},"),
                          "op.yaml")
    assert shown(validate_spec_file(spec)) == [(
        "kind",
        "op.yaml:7: in Op.signature.params.layout.type: unknown kind 'MGroupedLayout'; expected "
        "Dim, Shape, Bool, Int, Float, DType[...], a dtype name, an enum of quoted strings, "
        "Maybe[...] or an ADT (none declared)",
    )]


# --- check_paths: files, folders, types.yaml, ops across files ----------------------------------


def write(folder: Path, name: str, text: str) -> Path:
    p = folder / name
    p.write_text(text, encoding="utf-8")
    return p


def test_check_paths_reads_a_folder_with_its_types(tmp_path: Path) -> None:
    write(tmp_path, "types.yaml", TYPES_TEXT)
    write(tmp_path, "a.yaml", edit(FLAG, LAYOUT, ROW, "{M: 2, N: 3, layout: {masked: {max_m: 4}},"))
    loaded, diags = check_paths([tmp_path])
    assert diags == []
    assert [Path(s.path).name for s in loaded] == ["a.yaml"]


def test_check_paths_finds_types_beside_a_file(tmp_path: Path) -> None:
    write(tmp_path, "types.yaml", TYPES_TEXT)
    a = write(tmp_path, "a.yaml", edit(FLAG, LAYOUT,
                                       ROW, "{M: 2, N: 3, layout: {masked: {max_m: 4}},"))
    assert check_paths([a])[1] == []


def test_check_paths_knows_the_ops_of_every_file(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", edit("  roofline:", "  composition:\n    stages:\n"
                                                  "    - {name: a, op: Other}\n  roofline:"))
    write(tmp_path, "b.yaml", "Other:\n  family: test\n  status: planned\n  signature: {}\n")
    assert check_paths([tmp_path])[1] == []


def test_check_paths_rejects_an_op_declared_in_two_files(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", BASE)
    write(tmp_path, "b.yaml", "\n" + BASE)
    _, diags = check_paths([tmp_path])
    assert [(d.rule, str(d)) for d in diags] == [
        ("index-source", f"{tmp_path / 'b.yaml'}:2: in Op: op Op is also declared in "
                         f"{tmp_path / 'a.yaml'}"),
    ]


def test_check_paths_reports_load_errors_and_goes_on(tmp_path: Path) -> None:
    write(tmp_path, "types.yaml", types_edit("python: tileops.ops.moe.MaskedLayoutSpec",
                                             "python: Masked"))
    write(tmp_path, "a.yaml", edit("status: spec-only", "status: done"))
    write(tmp_path, "b.yaml", edit(FLOPS, 'flops: "Q"'))
    loaded, diags = check_paths([tmp_path])
    assert [Path(s.path).name for s in loaded] == ["b.yaml"]
    assert [(d.rule, Path(d.file).name, d.line) for d in diags] == [
        ("adt", "types.yaml", 15), ("schema", "a.yaml", 3), ("unknown-name", "b.yaml", 15)]


def test_check_paths_reports_a_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    loaded, diags = check_paths([missing])
    assert loaded == []
    assert [str(d) for d in diags] == [f"{missing}: cannot read: No such file or directory"]
    assert diags[0].rule == "io"
