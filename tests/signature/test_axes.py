"""The ``Axes`` kind and the reduction primitives in the generated checks: ``dim: int |
tuple[int, ...] | None`` normalised at construction, ``reduce_shape`` and ``axis`` computing
an output's shape or a wrapped axis at the call, the refusals naming the op, the argument, the
range and what was given, and hypothesis over shapes and axis sets against torch's own
reductions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.signature import ConstructionError, SignatureCallError, SignaturePlan
from tileops.spec import load_spec_text
from tileops.spec.expr import parse
from tileops.spec.kinds import AxesK, MaybeK, kind_from_expr

torch = pytest.importorskip("torch")

SPEC = """\
SumOp:
  family: test
  status: spec-only
  signature:
    forall: {S: Shape, T: "DType[float32 | int32]"}
    params:
      dim: {type: "int | tuple[int, ...] | None", default: null}
      keepdim: {type: bool, default: false}
    inputs:
      x: {dtype: T, shape: "[*S]"}
    let: {R: "reduce_shape(S, dim, keepdim)"}
    outputs:
      y: {dtype: T, shape: "[*R]"}
  roofline:
    flops: "prod(S)"
SoftmaxOp:
  family: test
  status: spec-only
  signature:
    forall: {S: Shape, T: "DType[float32]"}
    params:
      dim: {type: int, default: -1}
    inputs:
      x: {dtype: T, shape: "[*S]"}
    let: {A: "axis(dim, len(S))"}
    outputs:
      y: {dtype: T, shape: "[*S]"}
  roofline:
    flops: "prod(S) * (A + 1)"
TargetsOp:
  family: test
  status: spec-only
  signature:
    forall: {N: Dim, V: Dim}
    inputs:
      logits: {dtype: float32, shape: "[N, V]"}
      target: {dtype: int64, shape: "[N]", values: "class_targets(N, V, 2, -100)"}
    outputs:
      loss: {dtype: float32, shape: "[N]"}
  workloads:
  - {N: 6, V: 5, label: six}
"""
FILE = load_spec_text(SPEC, "axes.yaml")


def point(name: str = "SumOp", **params):
    return SignaturePlan(name, FILE.entries[name], spec=FILE).construct(**params)


@pytest.mark.parametrize("text", ["Axes", "int | tuple[int, ...]", "tuple[int, ...] | int",
                                  "int | list[int] | tuple[int, ...]"])
def test_the_kind_is_spelled_as_torch_types_dim(text: str) -> None:
    assert kind_from_expr(parse(text)) == AxesK()
    assert kind_from_expr(parse(f"{text} | None")) == MaybeK(AxesK())
    assert str(AxesK()) == "Axes"


def test_construction_keeps_an_int_and_makes_a_list_a_tuple() -> None:
    assert point(dim=1).params["dim"] == 1
    assert point(dim=[0, -1]).params["dim"] == (0, -1)
    assert point().params["dim"] is None
    with pytest.raises(ConstructionError) as info:
        point(dim=[0, "a"])
    assert "dim must be an int or a tuple of ints (axes), or None" in str(info.value)
    with pytest.raises(ConstructionError):
        point(dim=1.5)


def test_reduce_shape_at_the_call() -> None:
    x = torch.zeros(2, 3, 4)
    assert point(dim=1).check(x).output_shapes == ((2, 4),)
    assert point(dim=(0, -1), keepdim=True).check(x).output_shapes == ((1, 3, 1),)
    assert point().check(x).output_shapes == ((),)
    assert point(dim=()).check(x).output_shapes == ((),)
    assert point(dim=0).check(torch.zeros(())).output_shapes == ((),)


def test_an_axis_out_of_range_is_refused_naming_the_op_the_range_and_the_value() -> None:
    with pytest.raises(SignatureCallError) as info:
        point(dim=3).check(torch.zeros(2, 3, 4))
    text = str(info.value)
    assert text.startswith("SumOp: ")
    assert "dim 3 is out of range for a tensor of rank 3 (expected an axis in [-3, 2])" in text
    with pytest.raises(SignatureCallError) as info:
        point(dim=(1, -2)).check(torch.zeros(2, 3, 4))
    assert "dim 1 appears more than once in the dims (1, -2)" in str(info.value)
    # the op stays usable
    assert point(dim=(1, -1)).check(torch.zeros(2, 3, 4)).output_shapes == ((2,),)


def test_axis_wraps_and_refuses() -> None:
    op = point("SoftmaxOp", dim=-1)
    assert op.check(torch.zeros(2, 5)).output_shapes == ((2, 5),)
    with pytest.raises(SignatureCallError) as info:
        point("SoftmaxOp", dim=2).check(torch.zeros(2, 5))
    assert "dim 2 is out of range for a tensor of rank 2 (expected an axis in [-2, 1])" in \
        str(info.value)


def test_class_targets_fill_a_workload_tensor() -> None:
    from tileops.spec.primitives import class_targets

    out = class_targets(6, 5, 2, -100)
    assert out.count(-100) == 2 and all(0 <= v < 5 for v in out if v != -100)
    assert len(set(class_targets(64, 1000, 0, -1))) == 64  # spread, not repeated
    assert max(class_targets(3, 128256, 0, -1)) == 128255  # reaches the last class


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=0, max_size=4).flatmap(
    lambda shape: st.tuples(st.just(shape),
                            st.none() | st.lists(st.integers(-max(len(shape), 1),
                                                             max(len(shape), 1) - 1),
                                                 unique_by=lambda d: d % max(len(shape), 1),
                                                 max_size=max(len(shape), 1)),
                            st.booleans())))
def test_reduce_shape_is_torchs(case) -> None:
    shape, dim, keepdim = case
    x = torch.zeros(shape)
    dims = tuple(dim) if dim is not None else None
    want = torch.amax(x, dim=dims if dims is not None else (), keepdim=keepdim).shape \
        if x.numel() else None
    got = point(dim=dims, keepdim=keepdim).check(x).output_shapes[0]
    if want is not None:
        assert got == tuple(want)


def test_replace_axis_and_size_at_are_torch_topks_shape() -> None:
    from tileops.spec.primitives import PrimitiveError, replace_axis, size_at

    for shape in [(5,), (4, 7), (2, 3, 6)]:
        x = torch.zeros(shape)
        for d in range(-len(shape), len(shape)):
            k = min(2, shape[d])
            assert replace_axis(shape, d, k) == tuple(torch.topk(x, k, dim=d).values.shape)
            assert size_at(shape, d) == x.shape[d]
    assert size_at((), 0) == size_at((), -1) == 1
    # a 0-dim tensor: torch.topk's result is 0-dim for k of 0 or 1 (its one element)
    for d in (0, -1):
        for k in (0, 1):
            assert replace_axis((), d, k) == tuple(torch.topk(torch.tensor(2.0), k, dim=d)
                                                   .values.shape) == ()
    with pytest.raises(PrimitiveError, match="a length of 2 does not fit"):
        replace_axis((), 0, 2)
    with pytest.raises(PrimitiveError, match=r"expected an axis in \[-1, 0\]"):
        replace_axis((), 1, 1)
    with pytest.raises(PrimitiveError, match=r"expected an axis in \[-2, 1\]"):
        replace_axis((2, 3), 2, 1)
