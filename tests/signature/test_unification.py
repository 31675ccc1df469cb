"""Unification beyond one input at a time: axes that cannot be read where they stand.

An axis with two unknowns (``H + W``), a form that is not affine in its unknown (``H * H``,
``H // 2``) or a ``let`` (``H_out``, as in the gradient input of a backward op) binds
nothing. The validator accepts such an entry when later inputs solve the indices; the
generated check then solves what it can from the later inputs, and checks the remaining axes
once every index (and let) has a value.
"""

from __future__ import annotations

import textwrap

import pytest

from tileops.signature import DTypeAdapter, SignatureCallError, SignaturePlan
from tileops.spec import Expr, InputDecl, OpEntry, OutputDecl, Signature, load_spec_text

ADAPTER = DTypeAdapter("names", {"float32": "float32"})


class T:
    def __init__(self, *shape: int) -> None:
        self.shape, self.dtype = shape, "float32"


def point(a: str, b: str, *, out: str = "[H]"):
    dims = [n for n in ("H", "W") if n in a + b]
    entry = OpEntry(family="x", status="spec-only", signature=Signature(
        forall={**{n: Expr("Dim") for n in dims}, "T": Expr("DType[float32]")},
        inputs={"a": InputDecl(dtype=Expr("T"), shape=Expr(a)),
                "b": InputDecl(dtype=Expr("T"), shape=Expr(b))},
        outputs={"y": OutputDecl(dtype=Expr("T"), shape=Expr(out))}))
    return SignaturePlan("UnifyOp", entry, adapter=ADAPTER).construct()


@pytest.mark.parametrize(("a", "b", "good", "bad", "because"), [
    # two unknowns: both come from b, a's axis is checked
    ("[H + W]", "[H, W]", (T(5), T(2, 3)), (T(6), T(2, 3)), "a.shape[0] must be H + W = 5, but is 6"),
    # H * H is not affine in H: H comes from b (reading it off a would give H = 9)
    ("[H * H]", "[H]", (T(9), T(3)), (T(8), T(3)), "a.shape[0] must be H * H = 9, but is 8"),
    ("[H // 2]", "[H]", (T(3), T(7)), (T(4), T(7)), "a.shape[0] must be H // 2 = 3, but is 4"),
    # W * H has two unknowns in a; once b binds H it is affine in W, and W is read off a
    ("[W * H]", "[H]", (T(6), T(3)), (T(7), T(3)), "a.shape[0] is 7, but W * H has no solution "
                                                   "W >= 0 there"),
])
def test_axes_solved_or_checked_after_later_inputs(a, b, good, bad, because) -> None:
    p = point(a, b)
    call = p.check(*good)
    assert call.tensors["a"] == (good[0].shape, "float32")
    assert call.indices["H"] == good[1].shape[0]
    with pytest.raises(SignatureCallError) as info:
        p.check(*bad)
    assert info.value.because == because
    assert info.value.argument == "a"


def test_w_times_h_binds_w() -> None:
    assert point("[W * H]", "[H]").check(T(6), T(3)).indices == {"H": 3, "W": 2,
                                                                 "T": "float32"}


SPEC = """\
MaxPool1dBwdOp:
  family: pool
  status: spec-only
  signature:
    forall: {N: Dim, H: Dim, T: "DType[float32]"}
    params:
      kernel: {type: int, default: 2}
    let:
      H_out: "(H - kernel) // kernel + 1"
    inputs:
      grad_output: {dtype: T, shape: "[N, H_out]"}
      input: {dtype: T, shape: "[N, H]"}
    outputs:
      grad_input: {dtype: T, shape: "[N, H]"}
"""


def test_an_input_shaped_by_a_let_is_checked() -> None:
    # the gradient of a pooling op has the forward output's shape: a let of the input's
    spec = load_spec_text(SPEC, "bwd.yaml")
    p = SignaturePlan("MaxPool1dBwdOp", spec.entries["MaxPool1dBwdOp"], spec=spec,
                      adapter=ADAPTER).construct(kernel=2)
    call = p.check(T(4, 5), T(4, 10))
    assert call.indices == {"kernel": 2, "N": 4, "H": 10, "T": "float32", "H_out": 5}
    with pytest.raises(SignatureCallError) as info:
        p.check(T(4, 6), T(4, 10))
    assert str(info.value) == textwrap.dedent("""\
        MaxPool1dBwdOp: argument grad_output does not match the signature
          expected: grad_output: Tensor[T, [N, H_out]]
          seen:     grad_output: f32[4, 6]
          because:  H_out bound to 5 by let H_out = (H - kernel) // kernel + 1, but grad_output.shape[1] is 6
          call:     grad_output: f32[4, 6], input: f32[4, 10]
          bound:    T = float32, N = 4, H = 10, H_out = 5
          spec:     bwd.yaml:11 (MaxPool1dBwdOp.signature.inputs.grad_output)""")


OPTIONAL_INDEX = """\
BoundedOp:
  family: x
  status: spec-only
  signature:
    forall: {S: Shape, SB: Shape, T: "DType[float32]"}
    inputs:
      x: {dtype: T, shape: "[*S]"}
      bound: {dtype: T, shape: "[*SB]", optional: true}
    outputs:
      y: {dtype: T, shape: "[*S]"}
    shape_rules:
    - "not present(bound) or expands_to(SB, S)"
"""


def test_an_index_only_an_optional_input_gives_is_bound_where_it_is_given() -> None:
    spec = load_spec_text(OPTIONAL_INDEX, "opt.yaml")
    p = SignaturePlan("BoundedOp", spec.entries["BoundedOp"], spec=spec,
                      adapter=ADAPTER).construct()
    assert p.check(T(2, 3), T(3)).indices == {"S": (2, 3), "SB": (3,), "T": "float32"}
    assert p.check(T(2, 3), T(2, 1)).indices["SB"] == (2, 1)
    # absent: the index has no value, and the guarded rule is folded away
    absent = p.check(T(2, 3), None)
    assert absent.indices == {"S": (2, 3), "T": "float32"}
    assert absent.values[1] is None and absent.output_shapes == ((2, 3),)
    # the roofline and traffic run on either call (an absent index is not sliced)
    assert p.roofline(absent) == (0, 2 * 6 * 4) and p.roofline(p.check(T(2, 3), T(3)))[1] == 60
    assert "SB" not in p.source().split("if t_bound is None:")[1].split("else:")[0]
    for bad in (T(4), T(1, 2, 3)):
        with pytest.raises(SignatureCallError) as info:
            p.check(T(2, 3), bad)
        assert info.value.argument == "bound"
        assert info.value.because.startswith(
            "refinement 'not present(bound) or expands_to(SB, S)' does not hold")
