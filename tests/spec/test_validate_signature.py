"""The validator on an entry's declarations: ``index-source``, ``unknown-name``,
``let-cycle``, ``default`` and ``composition``. For each rule, specs that pass it and specs
that break it, with the exact diagnostic (``file:line: in path: message``) and the rule id."""

from __future__ import annotations

import pytest

from .validate_base import (
    FLAG,
    FLOPS,
    OUT,
    ROW,
    X,
    Y,
    diagnostics,
    edit,
    mat,
    passing_params,
    shown,
)

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
    "let-cycle": [
        ("chain", edit(OUT, '    let: {A: "B + 1", B: "M * 2"}\n' + OUT,
                       Y, 'y: {dtype: T, shape: "[A, N]"}')),
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


@pytest.mark.parametrize("text", passing_params(PASSING))
def test_passing(text: str) -> None:
    assert shown(diagnostics(text)) == []


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
                " axis, broadcast, ceil_div, conv.out, expands_to, finite, itemsize, len, max, min,"
                " naxes, per_axis, pool.out, present, prod, promote, promote_int_to_float,"
                " reduce_shape, reduced_sizes, replace_axis, result_type, size_at, with_numbers",
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
                " 'prefix_sum'; known: axis, broadcast, ceil_div, conv.out, expands_to, finite,"
                " itemsize, len, max, min, naxes, per_axis, pool.out, present, prod, promote,"
                " promote_int_to_float, reduce_shape, reduced_sizes, replace_axis, result_type,"
                " size_at, with_numbers",
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
                " call, one of arange, balanced_sizes, class_targets, cumsum, distinct_rows,"
                " full, kv_lengths, moe_metadata, page_table, prefix_sum, scaled_prefix_sum",
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
