"""The validator's ``effects`` rule: alias, write_only, buffer, effect predicates and
presence. Specs that pass it and specs that break it, with the exact diagnostic."""

from __future__ import annotations

import pytest

from .validate_base import (
    FLAG,
    FLOPS,
    ROW,
    X,
    Y,
    diagnostics,
    edit,
    passing_params,
    shown,
)

PASSING = {
    "effects": [
        ("alias-conditional", edit(
            X, 'x: {dtype: T, shape: "[M, N]", mutated: flag}',
            Y, 'y: {dtype: T, shape: "[M, N]", alias: x}',
            ROW, "{M: 2, N: 3, flag: true,")),
        # x's dtype where x is written, another where the output is fresh (a clamp's
        # promoted result)
        ("alias-dtype-where-written", edit(
            X, 'x: {dtype: T, shape: "[M, N]", mutated: flag}',
            Y, 'y: {dtype: "T if flag else promote(T, float32)", shape: "[M, N]", alias: x}')),
        ("alias-nullable", edit(
            X, 'x: {dtype: T, shape: "[M, N]", mutated: flag}',
            Y, 'y: {dtype: T, shape: "[M, N]", alias: x, nullable: flag}')),
        ("write-only", edit(X, 'x: {dtype: T, shape: "[M, N]", mutated: true, '
                               'write_only: true}')),
        ("buffer", edit(Y, 'y: {dtype: T, shape: "[M, N]", buffer: true}')),
        ("shape-only", edit(X, 'x: {dtype: T, shape: "[M, N]", shape_only: true}')),
        ("returned-on-a-param", edit(
            Y, Y + '\n      z: {dtype: T, shape: "[M]", returned: flag}')),
        ("returned-false-beside-a-returned-one", edit(
            Y, Y + '\n      z: {dtype: T, shape: "[M]", returned: false}')),
        ("presence", edit(
            X, X + '\n      w: {dtype: T, shape: "[N]", optional: "not flag"}',
            FLOPS, 'flops: "M * N * (2 if present(w) else 1)"',
            "label: small}", "label: small, some: [w]}")),
    ],
}


@pytest.mark.parametrize("text", passing_params(PASSING))
def test_passing(text: str) -> None:
    assert shown(diagnostics(text)) == []


FAILING = [
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
        edit(X, 'x: {dtype: T, shape: "[M, N]", mutated: flag}',
             Y, 'y: {dtype: "promote(T, float32) if flag else T", shape: "[M, N]", alias: x}'),
        [
            (
                "effects",
                "op.yaml:11: in Op.signature.outputs.y.alias: output y aliases input x but"
                " their types differ: Tensor[T, [M, N]] vs Tensor[promote(T, float32) if flag"
                " else T, [M, N]]",
            ),
        ],
        id="effects:alias-of-another-dtype-where-written",
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
        edit(X, 'x: {dtype: T, shape: "[M, N]", mutated: true, shape_only: true}'),
        [
            (
                "effects",
                "op.yaml:9: in Op.signature.inputs.x.shape_only: a shape_only input's elements"
                " are never read, so the op cannot write them either; drop mutated or"
                " shape_only",
            ),
        ],
        id="effects:shape-only-mutated",
    ),
    pytest.param(
        edit(X, 'x: {dtype: T, shape: "[M, N]", shape_only: true, values: "arange(M * N)"}'),
        [
            (
                "effects",
                "op.yaml:9: in Op.signature.inputs.x.shape_only: a shape_only input's elements"
                " are never read; a values generator would fill them for nothing; drop values"
                " or shape_only",
            ),
        ],
        id="effects:shape-only-values",
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
        edit(Y, 'y: {dtype: T, shape: "[M, N]", returned: "N > 0"}'),
        [
            (
                "effects",
                "op.yaml:11: in Op.signature.outputs.y.returned: 'N > 0': returned may depend"
                " only on construction params (a result's arity is fixed when the op is"
                " built); 'N' is not a construction param",
            ),
        ],
        id="effects:returned-depends-on-a-dim",
    ),
    pytest.param(
        edit(Y, 'y: {dtype: T, shape: "[M, N]", returned: "present(x)"}'),
        [
            (
                "effects",
                "op.yaml:11: in Op.signature.outputs.y.returned: 'present(x)': returned may"
                " depend only on construction params (a result's arity is fixed when the op is"
                " built); 'x' is not a construction param",
            ),
        ],
        id="effects:returned-depends-on-presence",
    ),
    pytest.param(
        edit(FLAG, FLAG + "\n      n: {type: int, default: 1}",
             Y, 'y: {dtype: T, shape: "[M, N]", returned: "n"}'),
        [
            (
                "kind",
                "op.yaml:12: in Op.signature.outputs.y.returned: 'n' is Int, but a Bool"
                " predicate is expected here",
            ),
        ],
        id="kind:returned-not-a-bool",
    ),
    pytest.param(
        edit(Y, 'y: {dtype: T, shape: "[M, N]", buffer: true, returned: flag}'),
        [
            (
                "effects",
                "op.yaml:11: in Op.signature.outputs.y.returned: an output with buffer is the"
                " caller's tensor and is always returned; drop returned or buffer",
            ),
        ],
        id="effects:returned-with-buffer",
    ),
    pytest.param(
        edit(X, 'x: {dtype: T, shape: "[M, N]", mutated: true}',
             Y, 'y: {dtype: T, shape: "[M, N]", alias: x, returned: flag}'),
        [
            (
                "effects",
                "op.yaml:11: in Op.signature.outputs.y.returned: an output with alias is the"
                " caller's tensor and is always returned; drop returned or alias",
            ),
        ],
        id="effects:returned-with-alias",
    ),
    pytest.param(
        edit(Y, 'y: {dtype: T, shape: "[M, N]", returned: false}'),
        [
            (
                "effects",
                "op.yaml:10: in Op.signature.outputs: every output is returned: false; a call"
                " must return at least one",
            ),
        ],
        id="effects:nothing-returned",
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
]


@pytest.mark.parametrize(("text", "expected"), FAILING)
def test_failing(text: str, expected: list[tuple[str, str]]) -> None:
    assert shown(diagnostics(text)) == expected
