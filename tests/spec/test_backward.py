"""The ``backward:`` block of a forward entry and the ``backward`` rule: the block's wiring
to the backward op of the same file, and the unification of the two signatures' shapes and
dtypes. Realistic fixtures (an RMSNorm, a GEMM with ``Mat`` and ``needs``, a fused add whose
two inputs share one gradient) pass; every check fails with its exact message; renaming the
backward's indices keeps an entry valid and perturbing one shape breaks it."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.spec import (
    Diagnostic,
    Expr,
    SpecLoadError,
    expr,
    load_spec_text,
    validate_entry,
    validate_spec_file,
)
from tileops.spec.schema import Backward, GradOf, OpEntry, Saved, SpecFile, feed_of

# Three forward entries and their backward ops, as the shipped norm and GEMM specs write them.
# RMSNormBwdOp names its indices S and U where the forward says B and T: the two signatures
# are matched under a renaming, not by name.
FIXTURE = """\
RMSNormFwdOp:
  family: norm
  status: spec-only
  signature:
    forall: {B: Shape, T: "DType[float16 | bfloat16 | float32]"}
    params:
      normalized_shape: {type: "list[int] | tuple[int, ...]"}
      eps: {type: "float | None", default: null}
    inputs:
      x: {dtype: T, shape: "[*B, *normalized_shape]"}
      weight: {dtype: T, shape: "[*normalized_shape]", optional: true}
    outputs:
      y: {dtype: T, shape: "[*B, *normalized_shape]"}
    shape_rules:
    - "len(normalized_shape) > 0"
  workloads:
  - {B: [4], normalized_shape: [8], some: [weight], dtype_cases: [{T: float32}], label: small}
  backward:
    op: RMSNormBwdOp
    saves: [x, weight]
    inputs: {dy: "grad(y)", x: x, weight: weight}
    grads: {x: dx, weight: dweight}
    needs: {weight: grad_weight}

RMSNormBwdOp:
  family: norm
  status: spec-only
  signature:
    forall: {S: Shape, U: "DType[float16 | bfloat16 | float32 | float64]"}
    params:
      normalized_shape: {type: "list[int] | tuple[int, ...]"}
      eps: {type: "float | None", default: null}
      grad_weight: {type: bool, default: true}
    inputs:
      dy: {dtype: U, shape: "[*S, *normalized_shape]"}
      x: {dtype: U, shape: "[*S, *normalized_shape]"}
      weight: {dtype: U, shape: "[*normalized_shape]", optional: true}
    outputs:
      dx: {dtype: U, shape: "[*S, *normalized_shape]"}
      dweight: {dtype: U, shape: "[*normalized_shape]", nullable: "not grad_weight or not present(weight)"}
    shape_rules:
    - "len(normalized_shape) > 0"
  workloads:
  - {S: [4], normalized_shape: [8], some: [weight], dtype_cases: [{U: float32}], label: small}

GemmFwdOp:
  family: gemm
  status: spec-only
  signature:
    types:
      Mat:
        params: {t: Bool, R: Dim, C: Dim}
        match: t
        cases:
        - {when: false, is: "[R, C]"}
        - {when: true, is: "[C, R]"}
    forall: {M: Dim, N: Dim, K: Dim, T: "DType[float16 | bfloat16]"}
    params:
      trans_a: {type: bool, default: false}
      trans_b: {type: bool, default: false}
    inputs:
      a: {dtype: T, shape: "Mat[trans_a, M, K]"}
      b: {dtype: T, shape: "Mat[trans_b, K, N]"}
    outputs:
      c: {dtype: T, shape: "[M, N]"}
  workloads:
  - {M: 2, N: 3, K: 4, trans_b: true, dtype_cases: [{T: bfloat16}], label: small-nt}
  backward:
    op: GemmBwdOp
    saves: [a, b]
    inputs: {dc: "grad(c)", a: a, b: b}
    grads: {a: da, b: db}
    needs: {a: grad_a, b: grad_b}

GemmBwdOp:
  family: gemm
  status: spec-only
  signature:
    types:
      Mat:
        params: {t: Bool, R: Dim, C: Dim}
        match: t
        cases:
        - {when: false, is: "[R, C]"}
        - {when: true, is: "[C, R]"}
    forall: {M: Dim, N: Dim, K: Dim, T: "DType[float16 | bfloat16 | float64]"}
    params:
      trans_a: {type: bool, default: false}
      trans_b: {type: bool, default: false}
      grad_a: {type: bool, default: true}
      grad_b: {type: bool, default: true}
    inputs:
      dc: {dtype: T, shape: "[M, N]"}
      a: {dtype: T, shape: "Mat[trans_a, M, K]"}
      b: {dtype: T, shape: "Mat[trans_b, K, N]"}
    outputs:
      da: {dtype: T, shape: "Mat[trans_a, M, K]", nullable: "not grad_a"}
      db: {dtype: T, shape: "Mat[trans_b, K, N]", nullable: "not grad_b"}
  workloads:
  - {M: 2, N: 3, K: 4, grad_a: false, dtype_cases: [{T: bfloat16}], label: weight-only}

FusedAddRMSNormFwdOp:
  family: norm
  status: spec-only
  signature:
    forall: {B: Shape, N: Dim, T: "DType[float16 | bfloat16 | float32]"}
    params:
      eps: {type: float, default: 1.0e-6}
      inplace: {type: bool, default: false}
    inputs:
      x: {dtype: T, shape: "[*B, N]", mutated: inplace}
      residual: {dtype: T, shape: "[*B, N]", mutated: inplace}
      weight: {dtype: T, shape: "[N]", optional: true}
    outputs:
      y: {dtype: T, shape: "[*B, N]", alias: x}
      residual_out: {dtype: T, shape: "[*B, N]", alias: residual}
  workloads:
  - {B: [2], N: 8, some: [weight], dtype_cases: [{T: float16}], label: small}
  backward:
    op: FusedAddRMSNormBwdOp
    saves: [residual_out, weight]
    inputs: {dy: "grad(y)", dresidual_out: "grad(residual_out)", residual_out: residual_out, weight: weight}
    grads: {x: dx, residual: dx, weight: dweight}
    needs: {weight: grad_weight}

FusedAddRMSNormBwdOp:
  family: norm
  status: spec-only
  signature:
    forall: {B: Shape, N: Dim, T: "DType[float16 | bfloat16 | float32 | float64]"}
    params:
      eps: {type: float, default: 1.0e-6}
      grad_weight: {type: bool, default: true}
    inputs:
      dy: {dtype: T, shape: "[*B, N]"}
      dresidual_out: {dtype: T, shape: "[*B, N]"}
      residual_out: {dtype: T, shape: "[*B, N]"}
      weight: {dtype: T, shape: "[N]", optional: true}
    outputs:
      dx: {dtype: T, shape: "[*B, N]"}
      dweight: {dtype: T, shape: "[N]", nullable: "not grad_weight or not present(weight)"}
  workloads:
  - {B: [2], N: 8, some: [weight], dtype_cases: [{T: float16}], label: small}
"""

# A small forward and backward every failing case edits; line numbers in the expected
# messages refer to it as edited.
MINI = """\
Op:
  family: test
  status: spec-only
  signature:
    forall: {M: Dim, N: Dim, T: "DType[float16 | bfloat16]"}
    params:
      flag: {type: bool, default: false}
    inputs:
      x: {dtype: T, shape: "[M, N]"}
      w: {dtype: T, shape: "[N]"}
    outputs:
      y: {dtype: T, shape: "[M, N]"}
  backward:
    op: OpBwd
    saves: [x, w]
    inputs: {dy: "grad(y)", x: x, w: w}
    grads: {x: dx, w: dw}
    needs: {w: grad_w}

OpBwd:
  family: test
  status: spec-only
  signature:
    forall: {P: Dim, Q: Dim, T: "DType[float16 | bfloat16]"}
    params:
      flag: {type: bool, default: false}
      grad_w: {type: bool, default: true}
    inputs:
      dy: {dtype: T, shape: "[P, Q]"}
      x: {dtype: T, shape: "[P, Q]"}
      w: {dtype: T, shape: "[Q]"}
    outputs:
      dx: {dtype: T, shape: "[P, Q]"}
      dw: {dtype: T, shape: "[Q]", nullable: "not grad_w"}
"""

FEEDS = 'inputs: {dy: "grad(y)", x: x, w: w}'
SAVES = "saves: [x, w]"
GRADS = "grads: {x: dx, w: dw}"
NEEDS = "needs: {w: grad_w}"
BWD_PARAMS = "      grad_w: {type: bool, default: true}"
BWD_FORALL = 'forall: {P: Dim, Q: Dim, T: "DType[float16 | bfloat16]"}'


def edit(base: str, *pairs: str, within: str = "") -> str:
    """``base`` with each ``old`` replaced by ``new`` once, in the entry ``within`` if given
    (the fixtures repeat some lines in the forward and the backward)."""
    start = base.index(f"\n{within}:\n") if within else 0
    head, text = base[:start], base[start:]
    for old, new in zip(pairs[::2], pairs[1::2], strict=True):
        assert old in text, old
        text = text.replace(old, new, 1)
    return head + text


def diagnostics(text: str) -> list[Diagnostic]:
    return validate_spec_file(load_spec_text(text, "ops.yaml"))


def shown(diags: list[Diagnostic]) -> list[tuple[str, str]]:
    return [(d.rule, str(d)) for d in diags]


def test_the_fixtures_are_valid() -> None:
    assert shown(diagnostics(FIXTURE)) == []
    assert shown(diagnostics(MINI)) == []


def test_the_block_loads_as_a_backward_struct() -> None:
    spec = load_spec_text(FIXTURE, "ops.yaml")
    bw = spec.entries["FusedAddRMSNormFwdOp"].backward
    assert bw == Backward(
        op="FusedAddRMSNormBwdOp",
        saves=("residual_out", "weight"),
        inputs={"dy": Expr("grad(y)"), "dresidual_out": Expr("grad(residual_out)"),
                "residual_out": Expr("residual_out"), "weight": Expr("weight")},
        grads={"x": "dx", "residual": "dx", "weight": "dweight"},
        needs={"weight": "grad_weight"},
    )
    assert bw.feeds == {"dy": GradOf(output="y"), "dresidual_out": GradOf(output="residual_out"),
                        "residual_out": Saved(name="residual_out"),
                        "weight": Saved(name="weight")}
    assert spec.entries["FusedAddRMSNormBwdOp"].backward is None
    assert spec.line_of("FusedAddRMSNormFwdOp.backward.grads.residual") == 123


@pytest.mark.parametrize(("text", "feed"), [
    ("grad(y)", GradOf(output="y")),
    ("y", Saved(name="y")),
    ("grad(y, z)", None),
    ("grad(y=y)", None),
    ("grad(2 * y)", None),
    ("grads(y)", None),
    ("y.grad", None),
    ("[y]", None),
])
def test_a_feed_is_read_from_the_parsed_expression(text: str, feed: object) -> None:
    assert feed_of(Expr(text)) == feed


def test_feeds_refuses_a_value_that_is_no_feed() -> None:
    bw = Backward(op="B", inputs={"dy": Expr("grad(y) + 1")}, grads={"x": "dx"})
    with pytest.raises(ValueError, match=r"^backward input dy is fed 'grad\(y\) \+ 1', which "
                       r"is neither grad\(<forward output>\) nor a saved name$"):
        bw.feeds  # noqa: B018 - the property raises


@pytest.mark.parametrize(("old", "new", "message"), [
    ("    needs: {w: grad_w}\n", "    needs: {w: grad_w}\n    need: {x: grad_x}\n",
     "ops.yaml:19: in Op.backward: unknown field 'need'; expected one of: op, inputs, grads, "
     "saves, needs, reaches"),
    ("    grads: {x: dx, w: dw}\n", "",
     "ops.yaml:13: in Op.backward: missing required field 'grads'"),
    (FEEDS, 'inputs: {dy: "grad(y", x: x, w: w}',
     "ops.yaml:16: in Op.backward.inputs.dy: cannot parse 'grad(y' at column 5: '(' was "
     "never closed"),
    (SAVES, "saves: x", "ops.yaml:15: in Op.backward.saves: expected list, got string"),
])
def test_a_malformed_block_is_a_loading_error(old: str, new: str, message: str) -> None:
    with pytest.raises(SpecLoadError) as exc:
        load_spec_text(edit(MINI, old, new), "ops.yaml")
    assert str(exc.value) == message


OWN = '      dw: {dtype: T, shape: "[Q]", nullable: "not grad_w"}\n'
LETS = "".join(f"      L{i}: L{i - 1}\n" for i in range(1, 61))

FAILING = [
    pytest.param(
        edit(MINI, OWN, '      dw: {dtype: T, shape: "[Q]"}\n'),
        [
            ('backward', 'ops.yaml:18: in Op.backward.needs.w: needs turns the gradient of w off with grad_w, but OpBwd\'s output dw is not nullable on it (never None); declare it nullable: "not grad_w"'),
        ],
        id="backward:needs-output-not-nullable",
    ),
    pytest.param(
        edit(MINI, "op: OpBwd", "op: OpBwdd"),
        [
            ('backward', "ops.yaml:14: in Op.backward.op: backward op 'OpBwdd' is not an entry of ops.yaml (entries: Op, OpBwd)"),
        ],
        id="backward:op-not-in-the-file",
    ),
    pytest.param(
        edit(MINI, OWN, OWN + '  backward:\n    op: Op\n    inputs: {x: "grad(dx)", w: "grad(dw)"}\n    grads: {dy: y}\n'),
        [
            ('backward', 'ops.yaml:14: in Op.backward.op: backward op OpBwd has a backward: block of its own; a backward op is not differentiated again'),
            ('backward', 'ops.yaml:36: in OpBwd.backward.op: backward op Op has a backward: block of its own; a backward op is not differentiated again'),
        ],
        id="backward:op-with-a-backward-of-its-own",
    ),
    pytest.param(
        edit(MINI, SAVES, "saves: [x, w, z]"),
        [
            ('backward', "ops.yaml:15: in Op.backward.saves[2]: saves names 'z', which is not an input or an output of Op (inputs: x, w; outputs: y)"),
        ],
        id="backward:saves-an-unknown-tensor",
    ),
    pytest.param(
        edit(MINI, SAVES, "saves: [x, w, x]"),
        [
            ('backward', 'ops.yaml:15: in Op.backward.saves[2]: saves names x twice'),
        ],
        id="backward:saves-a-tensor-twice",
    ),
    pytest.param(
        edit(MINI, FEEDS, 'inputs: {dy: "grad(y)", x: x, w: w, dz: "grad(y)"}'),
        [
            ('backward', "ops.yaml:16: in Op.backward.inputs.dz: inputs feeds 'dz', which is not an input of OpBwd (inputs: dy, x, w)"),
        ],
        id="backward:inputs-feeds-an-unknown-input",
    ),
    pytest.param(
        edit(MINI, FEEDS, 'inputs: {x: x, w: w}'),
        [
            ('backward', 'ops.yaml:16: in Op.backward.inputs: inputs does not feed dy, a required input of OpBwd (inputs: dy, x, w)'),
        ],
        id="backward:inputs-misses-a-required-input",
    ),
    pytest.param(
        edit(MINI, FEEDS, 'inputs: {dy: "grad(y) * 2", x: x, w: w}'),
        [
            ('backward', "ops.yaml:16: in Op.backward.inputs.dy: 'grad(y) * 2' is neither grad(<output of Op>) nor a saved name (saves: x, w)"),
        ],
        id="backward:inputs-value-is-no-feed",
    ),
    pytest.param(
        edit(MINI, FEEDS, 'inputs: {dy: "grad(x)", x: x, w: w}'),
        [
            ('backward', "ops.yaml:16: in Op.backward.inputs.dy: 'grad(x)': 'x' is not an output of Op (outputs: y)"),
        ],
        id="backward:inputs-grad-of-an-input",
    ),
    pytest.param(
        edit(MINI, SAVES, "saves: [x]"),
        [
            ('backward', "ops.yaml:16: in Op.backward.inputs.w: 'w' is not a saved name (saves: x); a backward input is grad(<output>) or a name listed in saves"),
        ],
        id="backward:inputs-name-not-saved",
    ),
    pytest.param(
        edit(MINI, 'w: {dtype: T, shape: "[N]"}', 'w: {dtype: T, shape: "[N]", optional: true}'),
        [
            ('backward', "ops.yaml:16: in Op.backward.inputs.w: OpBwd's input w is required, but it is fed w, which may be absent from a call of Op (optional: True); declare w optional"),
        ],
        id="backward:inputs-optional-feeds-required",
    ),
    pytest.param(
        edit(MINI, GRADS, "grads: {}", NEEDS, "needs: {}"),
        [
            ('backward', 'ops.yaml:17: in Op.backward.grads: grads maps no input of Op to a gradient; a backward differentiates at least one input'),
        ],
        id="backward:grads-empty",
    ),
    pytest.param(
        edit(MINI, GRADS, "grads: {x: dx, w: dw, y: dx}"),
        [
            ('backward', "ops.yaml:17: in Op.backward.grads.y: grads names 'y', which is not an input of Op (inputs: x, w)"),
        ],
        id="backward:grads-key-not-an-input",
    ),
    pytest.param(
        edit(MINI, GRADS, "grads: {x: dx, w: dww}"),
        [
            ('backward', "ops.yaml:17: in Op.backward.grads.w: grads maps w to 'dww', which is not an output of OpBwd (outputs: dx, dw)"),
        ],
        id="backward:grads-value-not-an-output",
    ),
    pytest.param(
        edit(MINI, NEEDS, "needs: {w: grad_w, y: grad_w}"),
        [
            ('backward', "ops.yaml:18: in Op.backward.needs.y: needs names 'y', which is not a key of grads (grads: x, w)"),
        ],
        id="backward:needs-key-not-in-grads",
    ),
    pytest.param(
        edit(MINI, NEEDS, "needs: {w: grad_ww}"),
        [
            ('backward', "ops.yaml:18: in Op.backward.needs.w: needs maps w to 'grad_ww', which is not a param of OpBwd (params: flag, grad_w)"),
        ],
        id="backward:needs-value-not-a-param",
    ),
    pytest.param(
        edit(MINI, NEEDS, NEEDS + "\n    reaches: {x: [y], z: [y]}"),
        [
            ('backward', "ops.yaml:19: in Op.backward.reaches.z: reaches names 'z', which is not a key of grads (grads: x, w)"),
        ],
        id="backward:reaches-key-not-in-grads",
    ),
    pytest.param(
        edit(MINI, NEEDS, NEEDS + "\n    reaches: {w: [y, z]}"),
        [
            ('backward', "ops.yaml:19: in Op.backward.reaches.w: reaches lists 'z' for w, which is not an output of Op (outputs: y)"),
        ],
        id="backward:reaches-an-unknown-output",
    ),
    pytest.param(
        edit(MINI, NEEDS, NEEDS + "\n    reaches: {w: []}"),
        [
            ('backward', 'ops.yaml:19: in Op.backward.reaches.w: reaches lists no output for w; an input with a gradient reaches at least one output'),
        ],
        id="backward:reaches-no-output",
    ),
    pytest.param(
        edit(MINI, NEEDS, NEEDS + "\n    reaches: {w: [y, y]}"),
        [
            ('backward', 'ops.yaml:19: in Op.backward.reaches.w: reaches lists an output twice for w'),
        ],
        id="backward:reaches-an-output-twice",
    ),
    pytest.param(
        edit(MINI, NEEDS, "needs: {w: scale}", BWD_PARAMS, BWD_PARAMS + "\n      scale: {type: float, default: 1.0}"),
        [
            ('backward', 'ops.yaml:18: in Op.backward.needs.w: needs maps w to scale, a param of OpBwd of kind Float; a needs param is Bool'),
        ],
        id="backward:needs-value-not-bool",
    ),
    pytest.param(
        edit(MINI, BWD_PARAMS, BWD_PARAMS + "\n      alpha: {type: float}"),
        [
            ('backward', "ops.yaml:14: in Op.backward.op: OpBwd's param alpha has no default and is neither a param of Op nor a needs param; give it a default"),
        ],
        id="backward:param-without-a-source",
    ),
    pytest.param(
        edit(MINI, "flag: {type: bool, default: false}", "flag: {type: int, default: 0}", within="OpBwd"),
        [
            ('backward', "ops.yaml:14: in Op.backward.op: OpBwd's param flag is Int, but it is passed Op's flag, which is Bool"),
        ],
        id="backward:shared-param-of-another-kind",
    ),
    pytest.param(
        edit(FIXTURE, '- {when: true, is: "[C, R]"}', '- {when: true, is: "[R, C]"}', within="GemmBwdOp"),
        [
            ('backward', 'ops.yaml:69: in GemmFwdOp.backward.op: GemmBwdOp declares type family Mat unlike GemmFwdOp; a shape written Mat[...] in both is compared as written, so the two declarations must be the same'),
        ],
        id="backward:family-declared-differently",
    ),
    pytest.param(
        edit(FIXTURE, 'forall: {S: Shape,', 'forall: {Q: Dim, S: Shape,', 'dy: {dtype: U, shape: "[*S, *normalized_shape]"}', 'dy: {dtype: U, shape: "[*S, Q]"}', "{S: [4],", "{Q: 8, S: [4],", within="RMSNormBwdOp"),
        [
            ('backward', 'ops.yaml:21: in RMSNormFwdOp.backward.inputs.dy: RMSNormBwdOp.dy has shape [*S, Q], which does not unify with [*B, *normalized_shape], the shape of grad(y): Q is a Dim of RMSNormBwdOp and cannot stand for *normalized_shape'),
        ],
        id="backward:shape-dim-for-a-splat",
    ),
    pytest.param(
        edit(FIXTURE, 'da: {dtype: T, shape: "Mat[trans_a, M, K]"', 'da: {dtype: T, shape: "Mat[trans_a, K, M]"', within="GemmBwdOp"),
        [
            ('backward', "ops.yaml:72: in GemmFwdOp.backward.grads.a: GemmBwdOp.da has shape Mat[trans_a, K, M], which does not unify with Mat[trans_a, M, K], the shape of the input a: GemmBwdOp's K stands for K (bound by a), but here for M"),
        ],
        id="backward:shape-index-bound-twice",
    ),
    pytest.param(
        edit(FIXTURE, 'dy: {dtype: U, shape: "[*S, *normalized_shape]"}', 'dy: {dtype: U, shape: "[*normalized_shape, *S]"}', within="RMSNormBwdOp"),
        [
            ('backward', "ops.yaml:21: in RMSNormFwdOp.backward.inputs.dy: RMSNormBwdOp.dy has shape [*normalized_shape, *S], which does not unify with [*B, *normalized_shape], the shape of grad(y): RMSNormBwdOp's normalized_shape stands for [*normalized_shape] (bound by passing RMSNormFwdOp's normalized_shape), and *normalized_shape does not match *B"),
        ],
        id="backward:shape-axes-in-another-order",
    ),
    pytest.param(
        edit(FIXTURE, "residual: dx,", "residual: dweight,"),
        [
            ('backward', 'ops.yaml:123: in FusedAddRMSNormFwdOp.backward.grads.residual: FusedAddRMSNormBwdOp.dweight has shape [N], which does not unify with [*B, N], the shape of the input residual: [N] lists 1 item (its Shape indices spliced) and [*B, N] lists 2'),
        ],
        id="backward:shape-of-another-rank",
    ),
    pytest.param(
        edit(FIXTURE, 'a: {dtype: T, shape: "Mat[trans_a, M, K]"}', 'a: {dtype: T, shape: "[M, K]"}', within="GemmBwdOp"),
        [
            ('backward', 'ops.yaml:71: in GemmFwdOp.backward.inputs.a: GemmBwdOp.a has shape [M, K], which does not unify with Mat[trans_a, M, K], the shape of the saved input a: [M, K] does not match Mat[trans_a, M, K]'),
        ],
        id="backward:shape-family-against-a-list",
    ),
    pytest.param(
        edit(FIXTURE, 'forall: {S: Shape,', 'forall: {R: Shape, S: Shape,', 'dy: {dtype: U, shape: "[*S, *normalized_shape]"}', 'dy: {dtype: U, shape: "[*R, *S]"}', "{S: [4],", "{R: [], S: [4],", within="RMSNormBwdOp"),
        [
            ('backward', "ops.yaml:21: in RMSNormFwdOp.backward.inputs.dy: RMSNormBwdOp.dy has shape [*R, *S], which does not unify with [*B, *normalized_shape], the shape of grad(y): RMSNormBwdOp's S stands for [*B] (bound by x), and *B does not match *normalized_shape"),
        ],
        id="backward:shape-splat-bound-elsewhere",
    ),
    pytest.param(
        edit(FIXTURE, 'forall: {S: Shape,', 'forall: {R: Shape, V: Shape, S: Shape,', 'dy: {dtype: U, shape: "[*S, *normalized_shape]"}', 'dy: {dtype: U, shape: "[*R, *V]"}', "{S: [4],", "{R: [], V: [4, 8], S: [4],", within="RMSNormBwdOp"),
        [
            ('backward', 'ops.yaml:21: in RMSNormFwdOp.backward.inputs.dy: RMSNormBwdOp.dy has shape [*R, *V], which does not unify with [*B, *normalized_shape], the shape of grad(y): *R and *V are both unbound there, so the axes each stands for are ambiguous'),
            ('solvable', 'ops.yaml:29: in RMSNormBwdOp.signature.forall.R: forall index R is not solvable from the inputs: R does not appear where unification can read it (a bare axis, an affine axis like 2 * R + 1, or the only unknown-length *R of a required input)'),
            ('solvable', 'ops.yaml:29: in RMSNormBwdOp.signature.forall.V: forall index V is not solvable from the inputs: V does not appear where unification can read it (a bare axis, an affine axis like 2 * V + 1, or the only unknown-length *V of a required input)'),
        ],
        id="backward:shape-two-unbound-splats",
    ),
    pytest.param(
        edit(MINI, "    inputs:\n      dy", '    let: {L: P}\n    inputs:\n      dy', 'dw: {dtype: T, shape: "[Q]"', 'dw: {dtype: T, shape: "[L]"', within="OpBwd"),
        [
            ('backward', "ops.yaml:17: in Op.backward.grads.w: OpBwd.dw has shape [L], which does not unify with [N], the shape of the input w: OpBwd's P stands for M (bound by dy), but here for N"),
        ],
        id="backward:shape-through-a-let",
    ),
    pytest.param(
        edit(MINI, "    inputs:\n      dy", '    let:\n      L0: Q\n' + LETS + '    inputs:\n      dy', 'dw: {dtype: T, shape: "[Q]"', 'dw: {dtype: T, shape: "[L60]"', within="OpBwd"),
        [
            ('backward', 'ops.yaml:17: in Op.backward.grads.w: OpBwd.dw has shape [L60], which does not unify with [N], the shape of the input w: its lets nest deeper than 50 levels'),
        ],
        id="backward:shape-lets-nested-too-deep",
    ),
    pytest.param(
        edit(MINI, BWD_FORALL, 'forall: {P: Dim, Q: Dim, T: "DType[float16]"}'),
        [
            ('backward', "ops.yaml:16: in Op.backward.inputs.dy: OpBwd.dy has dtype T, which does not unify with T, the dtype of grad(y): OpBwd's T is DType[float16] and cannot stand for Op's T, which may be bfloat16"),
        ],
        id="backward:dtype-set-too-narrow",
    ),
    pytest.param(
        edit(MINI, 'dw: {dtype: T,', 'dw: {dtype: float16,'),
        [
            ('backward', 'ops.yaml:17: in Op.backward.grads.w: OpBwd.dw has dtype float16, which does not unify with T, the dtype of the input w: float16 does not match T'),
        ],
        id="backward:dtype-literal",
    ),
]


@pytest.mark.parametrize(("text", "expected"), FAILING)
def test_failing(text: str, expected: list[tuple[str, str]]) -> None:
    assert shown(diagnostics(text)) == expected


PASSING = {
    "backward": [
        ("lets-of-the-backward", edit(
            MINI, "    inputs:\n      dy", "    let: {R: '[P, Q]', Q1: Q}\n    inputs:\n      dy",
            'dx: {dtype: T, shape: "[P, Q]"}', 'dx: {dtype: T, shape: "[*R]"}',
            'dw: {dtype: T, shape: "[Q]"', 'dw: {dtype: T, shape: "[Q1]"', within="OpBwd")),
        # one-way: the backward's [P, Q] accepts the forward's square [M, M]
        ("a-more-general-backward", edit(
            MINI, 'forall: {M: Dim, N: Dim,', 'forall: {M: Dim,', '"[M, N]"', '"[M, M]"',
            '"[N]"', '"[M]"', '"[M, N]"', '"[M, M]"')),
        ("a-shared-param-widened-to-maybe", edit(
            MINI, "flag: {type: bool, default: false}", "flag: {type: bool | None, "
            "default: null}", within="OpBwd")),
        ("a-needs-param-without-a-default", edit(
            MINI, "grad_w: {type: bool, default: true}", "grad_w: {type: bool}")),
        ("an-optional-input-left-unfed", edit(
            MINI, FEEDS, 'inputs: {dy: "grad(y)", x: x}', SAVES, "saves: [x]",
            'w: {dtype: T, shape: "[Q]"}', 'w: {dtype: T, shape: "[Q]", optional: true}')),
        ("reaches-an-output", edit(MINI, NEEDS, NEEDS + "\n    reaches: {w: [y]}")),
        ("a-saved-output", edit(
            MINI, SAVES, "saves: [x, w, y]", 'w: {dtype: T, shape: "[Q]"}',
            'w: {dtype: T, shape: "[Q]"}\n      y: {dtype: T, shape: "[P, Q]"}',
            FEEDS, 'inputs: {dy: "grad(y)", x: x, w: w, y: y}')),
    ],
}


@pytest.mark.parametrize("text", [pytest.param(t, id=f"{r}:{n}") for r, cases in
                                  PASSING.items() for n, t in cases])
def test_passing(text: str) -> None:
    assert shown(diagnostics(text)) == []


BROADCAST = """\
families:
  t:
    status: implemented
MulTFwdOp:
  family: t
  signature:
    forall: {SA: Shape, SB: Shape, TA: "DType[bfloat16 | float32 | float64]", TB: "DType[bfloat16 | float32 | float64]"}
    inputs:
      a: {dtype: TA, shape: "[*SA]"}
      b: {dtype: TB, shape: "[*SB]"}
    let: {S: "broadcast(SA, SB)"}
    outputs:
      out: {dtype: "result_type(TA, len(SA), TB, len(SB))", shape: "[*S]"}
  backward:
    op: MulTBwdOp
    saves: [a, b]
    inputs: {dout: "grad(out)", a: a, b: b}
    grads: {a: da, b: db}
    needs: {a: grad_a, b: grad_b}
MulTBwdOp:
  family: t
  signature:
    forall: {SA: Shape, SB: Shape, TA: "DType[bfloat16 | float32 | float64]", TB: "DType[bfloat16 | float32 | float64]", TO: "DType[bfloat16 | float32 | float64]"}
    params:
      grad_a: {type: bool, default: true}
      grad_b: {type: bool, default: true}
    inputs:
      dout: {dtype: TO, shape: "[*S]"}
      a: {dtype: TA, shape: "[*SA]"}
      b: {dtype: TB, shape: "[*SB]"}
    let: {S: "broadcast(SA, SB)"}
    outputs:
      da: {dtype: TA, shape: "[*SA]", nullable: "not grad_a"}
      db: {dtype: TB, shape: "[*SB]", nullable: "not grad_b"}
"""


def test_a_forward_let_shape_unifies_through_its_definition() -> None:
    # the forward's [*S], S = broadcast(SA, SB), is the backward's [*S] of the same definition
    assert shown(diagnostics(BROADCAST)) == []
    # a backward let of another definition binds the indices the other way round
    text = BROADCAST[::-1].replace('"broadcast(SA, SB)"'[::-1], '"broadcast(SB, SA)"'[::-1],
                                   1)[::-1]
    got = shown(diagnostics(text))
    assert got[0] == (
        "backward", "ops.yaml:17: in MulTFwdOp.backward.inputs.a: MulTBwdOp.a has shape [*SA], "
                    "which does not unify with [*SA], the shape of the saved input a: "
                    "MulTBwdOp's SA stands for [*SB] (bound by dout), and *SB does not match "
                    "*SA")
    assert all(rule == "backward" for rule, _ in got)


def test_validate_entry_looks_the_backward_op_up_in_its_file() -> None:
    spec = load_spec_text(MINI, "ops.yaml")
    assert validate_entry("Op", spec.entries["Op"], spec=spec) == []
    (d,) = validate_entry("Op", spec.entries["Op"])
    assert str(d) == ("<entry>: in Op.backward.op: backward op 'OpBwd' is looked up among the "
                      "entries of the spec file, and none was given (validate the file, or "
                      "pass spec=)")
    assert d.rule == "backward"


def test_a_backward_op_that_did_not_load_is_reported_once() -> None:
    from tileops.spec.loader import load_spec_entries

    spec, errors = load_spec_entries(edit(MINI, "status: spec-only", "status: done",
                                          within="OpBwd"), "ops.yaml")
    assert [str(e) for e in errors] == [
        "ops.yaml:22: in OpBwd.status: invalid value 'done'; expected one of: 'implemented', "
        "'spec-only', 'planned'"]
    assert validate_spec_file(spec) == []


def test_every_error_of_a_file_is_reported() -> None:
    text = edit(FIXTURE, "op: RMSNormBwdOp", "op: RMSNormBwd", "residual: dx,",
                "residual: dweight,", "needs: {a: grad_a, b: grad_b}",
                "needs: {a: grad_a, b: grad_c}")
    assert [d.path for d in diagnostics(text)] == [
        "RMSNormFwdOp.backward.op", "GemmFwdOp.backward.needs.b",
        "FusedAddRMSNormFwdOp.backward.grads.residual"]


# --- properties ---------------------------------------------------------------------------------

SPEC = load_spec_text(FIXTURE, "ops.yaml")
BACKWARD_OF = {e.backward.op: n for n, e in SPEC.entries.items() if e.backward is not None}


def rename_node(node: expr.Node, names: dict[str, str]) -> expr.Node:
    """``node`` with every Name in ``names`` renamed, built from the AST."""
    if isinstance(node, expr.Name):
        return expr.Name(names.get(node.id, node.id))
    changes = {}
    for f in node.__struct_fields__:
        v = getattr(node, f)
        if isinstance(v, expr.Node):
            changes[f] = rename_node(v, names)
        elif isinstance(v, tuple):
            changes[f] = tuple(
                rename_node(x, names) if isinstance(x, expr.Node)
                else (x[0], rename_node(x[1], names)) if isinstance(x, tuple) else x
                for x in v)
    return msgspec.structs.replace(node, **changes)


def rename_entry(entry: OpEntry, names: dict[str, str]) -> OpEntry:
    """``entry`` with its forall indices renamed everywhere they are used."""
    def ex(e: Expr) -> Expr:
        return Expr.of(rename_node(e.node, names))

    def key(k: str) -> str:
        return names.get(k, k)

    sig = entry.signature
    sig = msgspec.structs.replace(
        sig,
        forall={key(k): v for k, v in sig.forall.items()},
        inputs={n: msgspec.structs.replace(d, dtype=ex(d.dtype), shape=ex(d.shape),
                                           optional=ex(d.optional), mutated=ex(d.mutated))
                for n, d in sig.inputs.items()},
        outputs={n: msgspec.structs.replace(d, dtype=ex(d.dtype), shape=ex(d.shape),
                                            nullable=ex(d.nullable))
                 for n, d in sig.outputs.items()},
        shape_rules=tuple(ex(r) for r in sig.shape_rules),
        let={n: ex(v) for n, v in sig.let.items()},
    )
    workloads = tuple(msgspec.structs.replace(
        w, values={key(k): v for k, v in w.values.items()},
        dtype_cases=tuple({key(k): v for k, v in c.items()} for c in w.dtype_cases))
        for w in entry.workloads)
    roofline = entry.roofline and msgspec.structs.replace(
        entry.roofline, flops=ex(entry.roofline.flops))
    return msgspec.structs.replace(entry, signature=sig, workloads=workloads, roofline=roofline)


def with_entries(**entries: OpEntry) -> SpecFile:
    return SpecFile(path=SPEC.path, entries={**SPEC.entries, **entries}, lines=SPEC.lines)


def fresh_names(n: int) -> st.SearchStrategy[list[str]]:
    # the i_ prefix keeps them apart from every other name of the fixture and from keywords
    return st.lists(st.from_regex(r"i_[a-z0-9_]{0,6}", fullmatch=True), min_size=n,
                    max_size=n, unique=True)


@st.composite
def renamings(draw: st.DrawFn, names: list[str]) -> dict[str, str]:
    return dict(zip(names, draw(fresh_names(len(names))), strict=True))


def _swaps() -> list[tuple[str, str, str, int, int]]:
    """(backward op, inputs/outputs, tensor, i, j): two distinct axes of a mapped tensor's
    shape (a list's items, or the two dims of a Mat application) that can trade places."""
    out = []
    for op in BACKWARD_OF:
        sig = SPEC.entries[op].signature
        for group, table in (("inputs", sig.inputs), ("outputs", sig.outputs)):
            for n, d in table.items():
                node = d.shape.node
                items = node.items if isinstance(node, expr.List) else node.index
                first = 0 if isinstance(node, expr.List) else 1  # a Mat's flag stays put
                out += [(op, group, n, i, j) for i in range(first, len(items))
                        for j in range(i + 1, len(items)) if items[i] != items[j]]
    return out


SWAPS = _swaps()


def swapped(entry: OpEntry, group: str, tensor: str, i: int, j: int) -> OpEntry:
    sig = entry.signature
    table = getattr(sig, group)
    node = table[tensor].shape.node
    field = "items" if isinstance(node, expr.List) else "index"
    items = list(getattr(node, field))
    items[i], items[j] = items[j], items[i]
    shape = Expr.of(msgspec.structs.replace(node, **{field: tuple(items)}))
    table = {**table, tensor: msgspec.structs.replace(table[tensor], shape=shape)}
    return msgspec.structs.replace(entry, signature=msgspec.structs.replace(sig, **{group: table}))


def test_the_swaps_cover_every_backward_op() -> None:
    assert {s[0] for s in SWAPS} == set(BACKWARD_OF)
    assert ("GemmBwdOp", "outputs", "da", 1, 2) in SWAPS


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_renaming_the_indices_of_a_backward_keeps_it_valid(data: st.DataObject) -> None:
    op = data.draw(st.sampled_from(sorted(BACKWARD_OF)))
    names = data.draw(renamings(list(SPEC.entries[op].signature.forall)))
    assert validate_spec_file(with_entries(**{op: rename_entry(SPEC.entries[op], names)})) == []


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_renaming_the_indices_of_a_forward_keeps_it_valid(data: st.DataObject) -> None:
    op = data.draw(st.sampled_from(sorted(BACKWARD_OF.values())))
    names = data.draw(renamings(list(SPEC.entries[op].signature.forall)))
    assert validate_spec_file(with_entries(**{op: rename_entry(SPEC.entries[op], names)})) == []


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_swapping_two_axes_of_one_backward_shape_breaks_only_the_block(
        data: st.DataObject) -> None:
    op, group, tensor, i, j = data.draw(st.sampled_from(SWAPS))
    names = data.draw(renamings(list(SPEC.entries[op].signature.forall)))
    entry = swapped(rename_entry(SPEC.entries[op], names), group, tensor, i, j)
    diags = validate_spec_file(with_entries(**{op: entry}))
    assert diags, (op, tensor, i, j)
    assert {d.rule for d in diags} == {"backward"}
    assert all(d.path.startswith(f"{BACKWARD_OF[op]}.backward.") for d in diags)


def test_the_readme_example_validates() -> None:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "packages" / "spec" / "README.md").read_text(
        encoding="utf-8")
    text = readme[readme.index("\n## Backward\n"):]
    text = text[text.index("```yaml\n") + 8:text.index("```\n")]
    spec = load_spec_text(text, "ops.yaml")
    assert validate_spec_file(spec) == []
    assert spec.entries["RMSNormFwdOp"].backward.needs == {"weight": "grad_weight"}
    # the validator table's example is what the validator says
    row = readme[readme.index("| `backward` |"):].split("\n")[0]
    message = row.split("`")[-2]
    text = edit(FIXTURE, 'da: {dtype: T, shape: "Mat[trans_a, M, K]"',
                'da: {dtype: T, shape: "Mat[trans_a, K, M]"', within="GemmBwdOp")
    assert [str(d) for d in diagnostics(text)] == [message]


def test_a_bound_shape_index_is_counted_as_the_axes_it_stands_for() -> None:
    text = edit(FIXTURE, 'dx: {dtype: U, shape: "[*S, *normalized_shape]"}',
                'dx: {dtype: U, shape: "[*S]"}', within="RMSNormBwdOp")
    assert shown(diagnostics(text)) == [(
        "backward",
        "ops.yaml:22: in RMSNormFwdOp.backward.grads.x: RMSNormBwdOp.dx has shape [*S], which "
        "does not unify with [*B, *normalized_shape], the shape of the input x: [*S] lists 1 "
        "item (its Shape indices spliced) and [*B, *normalized_shape] lists 2")]


# a unary function that takes integers (giving float32) and a float-only gradient of its output
UNARY_INT = """\
ExpOp:
  family: elementwise
  status: spec-only
  signature:
    forall: {S: Shape, T: "DType[int32 | float16 | bfloat16 | float32]"}
    inputs:
      x: {dtype: T, shape: "[*S]"}
    outputs:
      y: {dtype: promote_int_to_float(T), shape: "[*S]"}
  workloads:
  - {S: [4], dtype_cases: [{T: float32}], label: small}
  backward:
    op: ExpBwdOp
    saves: [x]
    inputs: {dy: "grad(y)", x: x}
    grads: {x: dx}

ExpBwdOp:
  family: elementwise
  status: spec-only
  signature:
    forall: {S: Shape, U: "DType[float16 | bfloat16 | float32]"}
    inputs:
      dy: {dtype: U, shape: "[*S]"}
      x: {dtype: U, shape: "[*S]"}
    outputs:
      dx: {dtype: U, shape: "[*S]"}
  workloads:
  - {S: [4], dtype_cases: [{U: float32}], label: small}
"""


def test_a_differentiated_input_agrees_with_its_gradient_over_its_floating_dtypes_only():
    # an int32 x never requires grad: promote_int_to_float(T) is T wherever x is floating, so
    # the saved x and its gradient unify with the gradient's U
    assert shown(diagnostics(UNARY_INT)) == []
    # where the gradient's dtype differs from its input's on a floating member, it is refused
    text = edit(UNARY_INT, "dx: {dtype: U", 'dx: {dtype: "promote(U, float32)"',
                within="ExpBwdOp")
    got = shown(diagnostics(text))
    assert len(got) == 1 and got[0][0] == "backward", got
    assert ("ExpBwdOp.dx has dtype promote(U, float32), which does not unify with T, the "
            "dtype of the input x") in got[0][1], got


# a sum: an integer x sums in int64, so its output's dtype is promote(T, int64); only a floating
# x has a gradient, and its output is then T; the backward reads x for its shape only
SUM_INT = """\
SumOp:
  family: reduction
  status: spec-only
  signature:
    forall: {S: Shape, T: "DType[int32 | bfloat16 | float32]"}
    inputs:
      x: {dtype: T, shape: "[*S]"}
    outputs:
      y: {dtype: "promote(T, int64)", shape: "[1]"}
  workloads:
  - {S: [4], dtype_cases: [{T: float32}], label: small}
  backward:
    op: SumBwdOp
    saves: [x]
    inputs: {dy: "grad(y)", x: x}
    grads: {x: dx}

SumBwdOp:
  family: reduction
  status: spec-only
  signature:
    forall: {S: Shape, U: "DType[bfloat16 | float32]"}
    inputs:
      dy: {dtype: U, shape: "[1]"}
      x: {dtype: U, shape: "[*S]", shape_only: true}
    outputs:
      dx: {dtype: U, shape: "[*S]"}
  workloads:
  - {S: [4], dtype_cases: [{U: float32}], label: small}
"""


def test_an_output_gradient_agrees_with_its_output_over_floating_dtypes_only():
    # y is int64 for an int32 x, which has no gradient: promote(T, int64) is T wherever y is
    # handed one, so grad(y) unifies with the backward's U
    assert shown(diagnostics(SUM_INT)) == []
    # where grad(y)'s dtype differs from the output's on a floating member, it is refused
    text = edit(SUM_INT, 'y: {dtype: "promote(T, int64)"', 'y: {dtype: "promote(T, float32)"')
    got = shown(diagnostics(text))
    assert got and all(rule == "backward" for rule, _ in got), got
    assert ("SumBwdOp.x has dtype U, which does not unify with T, the dtype of the saved input "
            "x: SumBwdOp's U stands for promote(T, float32) (bound by dy), but here for T"
            ) in got[0][1], got


def test_a_saved_output_agrees_with_the_backward_over_floating_dtypes_only():
    # amax's y is T, which may be an integer; its gradient runs only where x is floating, so a
    # float-only backward that reads y is accepted
    text = edit(SUM_INT, 'y: {dtype: "promote(T, int64)"', 'y: {dtype: T',
                "saves: [x]", "saves: [x, y]",
                'inputs: {dy: "grad(y)", x: x}', 'inputs: {dy: "grad(y)", x: x, y: y}',
                '      x: {dtype: U, shape: "[*S]", shape_only: true}',
                '      x: {dtype: U, shape: "[*S]"}\n      y: {dtype: U, shape: "[1]"}')
    assert shown(diagnostics(text)) == []
    # a backward whose y takes fewer floating dtypes than the forward's output is refused
    narrow = edit(text, '      y: {dtype: U, shape: "[1]"}', '      y: {dtype: V, shape: "[1]"}',
                  'forall: {S: Shape, U: "DType[bfloat16 | float32]"}',
                  'forall: {S: Shape, U: "DType[bfloat16 | float32]", V: "DType[float32]"}')
    got = shown(diagnostics(narrow))
    assert got and all(rule == "backward" for rule, _ in got), got
    assert "SumBwdOp.y has dtype V" in got[0][1], got


# a saved output whose dtype is an index of a non-differentiated input: that index is whatever
# the caller passes (an int32 s gives an int32 z), so z must agree over all of W's members
MIXED = """\
FOp:
  family: misc
  status: spec-only
  signature:
    forall: {S: Shape, T: "DType[float32 | float64]", W: "DType[int32 | float32]"}
    inputs:
      x: {dtype: T, shape: "[*S]"}
      s: {dtype: W, shape: "[*S]"}
    outputs:
      y: {dtype: T, shape: "[*S]"}
      z: {dtype: W, shape: "[*S]"}
  workloads:
  - {S: [4], dtype_cases: [{T: float32, W: float32}], label: small}
  backward:
    op: FBwdOp
    saves: [z]
    inputs: {dy: "grad(y)", z: z}
    grads: {x: dx}

FBwdOp:
  family: misc
  status: spec-only
  signature:
    forall: {S: Shape, T: "DType[float32 | float64]"}
    inputs:
      dy: {dtype: T, shape: "[*S]"}
      z: {dtype: float32, shape: "[*S]"}
    outputs:
      dx: {dtype: T, shape: "[*S]"}
  workloads:
  - {S: [4], dtype_cases: [{T: float32}], label: small}
"""


def test_a_saved_output_of_a_non_differentiated_index_agrees_over_all_its_dtypes():
    got = shown(diagnostics(MIXED))
    assert len(got) == 1 and got[0][0] == "backward", got
    assert "FBwdOp.z has dtype float32, which does not unify with W, the dtype of the saved " \
           "output z" in got[0][1], got
    # where W may only be floating, the backward's float32 serves it
    assert shown(diagnostics(edit(MIXED, 'W: "DType[int32 | float32]"', 'W: "DType[float32]"'))) \
        == []
