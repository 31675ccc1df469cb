"""Sizes and dtypes that are not what they claim to be.

A size is a non-negative integer (a Python int or a numpy integer scalar; never a bool, never a
float, however whole): in an input's shape, an ``out=`` buffer's shape, a Dim, Shape or
PerAxis construction param. An array of the adapter's library has sizes by construction; any
other object with ``.shape`` and ``.dtype`` has each entry checked, and refused by name. A
dtype the adapter does not map is shown by its repr and type, and said to be one the adapter
does not map, never by a name that reads like an accepted one.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# the torch adapter is among the adapters compared: tests(signature) runs without torch (the
# package needs none), tests(runtime) runs this file with it
torch = pytest.importorskip("torch")

from tileops.signature import (  # noqa: E402
    ConstructionError,
    DTypeAdapter,
    SignatureCallError,
    SignaturePlan,
    numpy_adapter,
    torch_adapter,
)
from tileops.spec import load_spec_text  # noqa: E402

SPEC = """\
SizesOp:
  family: misc
  status: spec-only
  signature:
    forall: {B: Shape, N: Dim, T: "DType[float16 | float32]"}
    params:
      width: {type: Dim, default: 4}
      shift: {type: int, default: 0}
      dims: {type: "list[int]", default: [1]}
      kernel: {type: "int | tuple[int, int]", default: 1}
      acc: {type: "float16 | float32", default: float32}
    inputs:
      x: {dtype: T, shape: "[*B, N]"}
      w: {dtype: T, shape: "[N]"}
    outputs:
      out: {dtype: T, shape: "[*B, N]", buffer: true}
"""


class Array:
    """Not an array of any adapter's library: a shape and a dtype of one's choosing."""

    def __init__(self, shape, dtype, device=None) -> None:
        self.shape, self.dtype = shape, dtype
        if device is not None:
            self.device = device


@pytest.fixture(scope="module")
def spec():
    return load_spec_text(SPEC, "sizes.yaml")


_plans: dict = {}


def plan(spec, adapter=None) -> SignaturePlan:
    """One plan per adapter (points are cached by their plan)."""
    key = id(adapter)
    if key not in _plans:
        _plans[key] = SignaturePlan("SizesOp", spec.entries["SizesOp"], spec=spec,
                                    adapter=adapter)
    return _plans[key]


#: an adapter of a library whose arrays the plan knows nothing of (no ``arrays``)
MYLIB = DTypeAdapter("mylib", {"float32": "f32", "float16": "f16"})


def adapters():
    """numpy's, torch's and MYLIB."""
    return [numpy_adapter(), torch_adapter(), MYLIB]


def f32(ad: DTypeAdapter):
    return ad.native("float32")


def device(ad: DTypeAdapter):
    return torch.device("cpu") if ad.device else None


# --- an input's shape ------------------------------------------------------------------------

NOT_SIZES = st.one_of(st.booleans(), st.integers(max_value=-1),
                      st.floats(allow_nan=True, allow_infinity=True),
                      st.sampled_from(["2", None, b"2", np.float64(2.0), np.bool_(True)]))
SIZES = st.one_of(st.integers(0, 2**40), st.integers(0, 2**31).map(np.int64),
                  st.integers(0, 255).map(np.uint8))


@settings(max_examples=60, deadline=None)
@given(b=st.lists(SIZES, max_size=3), n=SIZES)
def test_sizes_pass_and_are_ints_in_the_record(spec, b, n) -> None:
    for ad in adapters():
        x = Array((*b, n), f32(ad), device(ad))
        w = Array((n,), f32(ad), device(ad))
        for check in (plan(spec, ad).construct().check, plan(spec, ad).construct().check_exact):
            call = check(x, w)
            assert call.indices["B"] == tuple(int(v) for v in b)
            assert call.indices["N"] == int(n)
            assert all(type(v) is int for s in call.input_shapes for v in s)
            assert all(type(v) is int for v in call.output_shapes[0])


@settings(max_examples=80, deadline=None)
@given(shape=st.lists(st.one_of(SIZES, NOT_SIZES), min_size=1, max_size=4), data=st.data())
def test_a_non_size_anywhere_in_a_shape_is_refused_by_name(spec, shape, data) -> None:
    at = data.draw(st.integers(0, len(shape) - 1))
    bad = data.draw(NOT_SIZES)
    shape[at] = bad
    first = next(i for i, v in enumerate(shape)
                 if isinstance(v, bool | np.bool_) or not hasattr(v, "__index__")
                 or int(v) < 0)
    v = shape[first]
    shown = repr(v) if type(v) is int else f"{v!r} ({type(v).__name__})"
    for ad in adapters():
        x = Array(tuple(shape), f32(ad), device(ad))
        w = Array((4,), f32(ad), device(ad))
        point = plan(spec, ad).construct()
        for check in (point.check, point.check_exact, point.check_symbolic):
            with pytest.raises(SignatureCallError) as info:
                check(x, w)
            assert info.value.argument == "x"
            assert info.value.because == (f"x.shape[{first}] is {shown}, not a size: a size "
                                          f"is a non-negative int")


def test_the_whole_message_of_a_non_size(spec) -> None:
    point = plan(spec, numpy_adapter()).construct()
    with pytest.raises(SignatureCallError) as info:
        point.check(Array((2, True), np.dtype("float32")), np.zeros(4, "float32"))
    assert str(info.value) == textwrap.dedent("""\
        SizesOp: argument x does not match the signature
          expected: x: Tensor[T, [*B, N]]
          seen:     x: f32[2, True]
          because:  x.shape[1] is True (bool), not a size: a size is a non-negative int
          call:     x: f32[2, True], w: f32[4]
          bound:    (nothing)
          spec:     sizes.yaml:13 (SizesOp.signature.inputs.x)""")
    with pytest.raises(SignatureCallError) as info:
        point.check(np.zeros((2, 4), "float32"), Array((-4,), np.dtype("float32")))
    assert info.value.because == "w.shape[0] is -4, not a size: a size is a non-negative int"
    assert info.value.bound == {"T": "float32", "B": (2,), "N": 4}
    with pytest.raises(SignatureCallError) as info:
        point.check(Array("2x4", np.dtype("float32")), np.zeros(4, "float32"))
    assert info.value.because == ("x.shape is '2x4' (str), not a tuple of sizes: a size is a "
                                  "non-negative int")


def test_the_librarys_own_arrays_keep_their_shape_objects(spec) -> None:
    # a tensor's shape holds sizes by construction: the record keeps the torch.Size read
    point = plan(spec).construct()
    call = point.check(torch.empty(2, 4), torch.empty(4))
    assert type(call.input_shapes[0]) is torch.Size
    assert type(call.output_shapes[0]) is torch.Size


def test_an_out_buffer_must_hold_sizes(spec) -> None:
    point = plan(spec, numpy_adapter()).construct()
    x, w = np.zeros((2, 4), "float32"), np.zeros(4, "float32")
    assert point.check(x, w, out=np.zeros((2, 4), "float32")).out_given
    for shape, because in (((2, 4.0), "out.shape[1] is 4.0 (float), not a size"),
                           ((True, 4), "out.shape[0] is True (bool), not a size")):
        for check in (point.check, point.check_exact):
            with pytest.raises(SignatureCallError) as info:
                check(x, w, out=Array(shape, np.dtype("float32")))
            assert info.value.argument == "out"
            assert info.value.because == because + ": a size is a non-negative int"


# --- construction params -----------------------------------------------------------------------


def construction_error(spec, **params) -> ConstructionError:
    with pytest.raises(ConstructionError) as info:
        plan(spec).construct(**params)
    return info.value


@settings(max_examples=60, deadline=None)
@given(v=SIZES)
def test_size_params_take_ints_and_numpy_integers(spec, v) -> None:
    point = plan(spec).construct(width=v, dims=[v, v], kernel=(v, v), shift=v)
    assert point.params["width"] == int(v) and type(point.params["width"]) is int
    assert point.params["dims"] == (int(v), int(v))
    assert all(type(d) is int for d in (*point.params["dims"], *point.params["kernel"]))
    assert type(point.params["shift"]) is int
    # equal values are one point, whatever their type
    assert point is plan(spec).construct(width=int(v), dims=(int(v), int(v)),
                                         kernel=(int(v), int(v)), shift=int(v))


@settings(max_examples=60, deadline=None)
@given(v=NOT_SIZES)
def test_size_params_refuse_what_is_not_a_size(spec, v) -> None:
    negative = type(v) is int and v < 0
    shown = f"{v!r} ({type(v).__name__})"
    e = construction_error(spec, width=v)
    assert (e.argument, e.expected, e.seen) == ("width", "width: Dim", shown)
    assert e.because == ("width is a Dim and must be >= 0" if negative
                         else "width is a Dim: a size is a non-negative int")
    e = construction_error(spec, dims=[1, v])
    assert (e.argument, e.seen) == ("dims", f"[1, {v!r}] (list)")
    assert e.because == "dims[1] is " + (repr(v) if negative else shown) + \
        ", not a size: a size is a non-negative int"
    if not negative:  # an Int (and an Int per axis) may be negative, never a bool or a float
        e = construction_error(spec, shift=v)
        assert (e.argument, e.because) == ("shift", "shift must be an int")
        e = construction_error(spec, kernel=(1, v))
        assert (e.argument, e.because) == ("kernel", "kernel must be an int or a tuple of 2 ints")


def test_int_params_may_be_negative(spec) -> None:
    point = plan(spec).construct(shift=np.int32(-3), kernel=(-1, np.int8(-2)))
    assert point.params["shift"] == -3 and point.params["kernel"] == (-1, -2)


# --- dtypes the adapter does not map -------------------------------------------------------------


def test_an_array_of_another_library_is_refused_for_its_dtype(spec) -> None:
    point = plan(spec).construct()  # torch
    with pytest.raises(SignatureCallError) as info:
        point.check(np.zeros((2, 4), "float32"), np.zeros(4, "float32"))
    assert str(info.value) == textwrap.dedent("""\
        SizesOp: argument x does not match the signature
          expected: x: Tensor[T, [*B, N]]
          seen:     x: dtype('float32')[2, 4]
          because:  x.dtype is dtype('float32') (numpy.dtypes.Float32DType), not a dtype the \
torch adapter maps; T must be one of float16, float32
          call:     x: dtype('float32')[2, 4], w: dtype('float32')[4]
          bound:    (nothing)
          spec:     sizes.yaml:13 (SizesOp.signature.inputs.x)""")
    # the second input: after a torch tensor bound T
    with pytest.raises(SignatureCallError) as info:
        point.check(torch.empty(2, 4), Array((4,), np.dtype("float32"), torch.device("cpu")))
    assert info.value.because == ("w.dtype is dtype('float32') (numpy.dtypes.Float32DType), "
                                  "not a dtype the torch adapter maps; T is bound to float32 "
                                  "by x.dtype")
    # and a torch tensor handed to the numpy adapter
    with pytest.raises(SignatureCallError) as info:
        plan(spec, numpy_adapter()).construct().check(torch.empty(2, 4), torch.empty(4))
    assert info.value.because == ("x.dtype is torch.float32 (torch.dtype), not a dtype the "
                                  "numpy adapter maps; T must be one of float16, float32")


def test_a_dtype_the_torch_adapter_has_no_name_for_says_so(spec) -> None:
    x = torch.empty(2, 4, dtype=torch.uint16)
    with pytest.raises(SignatureCallError) as info:
        plan(spec).construct().check(x, torch.empty(4))
    assert info.value.because == ("x.dtype is torch.uint16 (torch.dtype), not a dtype the "
                                  "torch adapter maps; T must be one of float16, float32")


def test_an_unhashable_dtype_is_described_not_crashed_on(spec) -> None:
    ad = adapters()[2]
    with pytest.raises(SignatureCallError) as info:
        plan(spec, ad).construct().check(Array((4,), ["f32"]), Array((4,), "f32"))
    assert info.value.argument == "x"
    assert info.value.seen == "x: ['f32'][4]"
    e = construction_error(spec, acc=["float32"])
    assert e.because == ("acc is ['float32'] (builtins.list), not a dtype the torch adapter "
                         "maps; acc must be one of float16, float32")


def test_a_dtype_param_of_another_library(spec) -> None:
    e = construction_error(spec, acc=np.dtype("float16"))
    assert (e.argument, e.expected) == ("acc", "acc: DType[float16 | float32]")
    assert e.seen == "dtype('float16') (numpy.dtypes.Float16DType)"
    assert e.because == ("acc is dtype('float16') (numpy.dtypes.Float16DType), not a dtype the "
                         "torch adapter maps; acc must be one of float16, float32")
    assert plan(spec).construct(acc=torch.float16).params["acc"] == "float16"


def test_an_object_without_a_device_for_the_torch_adapter(spec) -> None:
    with pytest.raises(SignatureCallError) as info:
        plan(spec).construct().check(Array((2, 4), torch.float32), torch.empty(4))
    assert info.value.because == (f"x has no .device (a {Array.__module__}.Array): the torch "
                                  f"adapter reads each tensor's device there")
