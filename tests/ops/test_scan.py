"""The scan family on the CPU: how the ops hand a call to the ``scan_fwd`` slot (the
``(outer, length, inner)`` view of the scanned dim, the copy of a strided or misaligned input,
bool as uint8, the dtypes refused by name), and the kernels' launch plans: every plan covers
its axis exactly, in whole chunks, and few rows are split into segments. The programs compile in
tests/kernels/test_scan_compile.py and run on a GPU in tests/kernels/test_scan_cuda.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tileops.ops as ops
from tileops.kernels import scan as K
from tileops.runtime import Kernel

launched: list[tuple] = []


class TorchScanSlot(Kernel, K.ScanInterface):
    """The slot on the CPU: checks what the op hands over against the spec and the slot's
    contract, then scans the middle axis with torch."""

    devices = ("cpu",)
    general = True

    @classmethod
    def entry_for(cls, spec, op):
        def run(x, y):
            launched.append((spec.kind, spec.outer, spec.length, spec.inner, spec.dtype))
            assert tuple(x.shape) == tuple(y.shape) == (spec.outer, spec.length, spec.inner)
            assert x.is_contiguous() and y.is_contiguous() and x.data_ptr() % 16 == 0
            assert K._ITEMSIZE[spec.dtype] == x.element_size()
            assert str(x.dtype).removeprefix("torch.") == spec.dtype
            assert str(y.dtype).removeprefix("torch.") == K.out_dtype(spec.dtype)
            acc = getattr(torch, K.acc_dtype(spec.dtype))
            fn = torch.cumsum if spec.kind is K.ScanKind.SUM else torch.cumprod
            y.copy_(fn(x.to(acc), 1))

        return run


def _in_tree(cls, **params):
    return cls(kernel_map={"scan_fwd": TorchScanSlot}, **params)


@pytest.mark.parametrize("name", ["CumsumFwdOp", "CumprodFwdOp"])
@pytest.mark.parametrize(("shape", "dim", "view"), [
    ((5, 7), 1, (5, 7, 1)),  # the last dim: rows
    ((5, 7), -1, (5, 7, 1)),
    ((5, 7), 0, (1, 5, 7)),  # a leading dim: inner = the row length
    ((2, 3, 4, 5), 2, (6, 4, 5)),  # a middle dim
    ((2, 3, 4, 5), -3, (2, 3, 20)),
    ((), 0, (1, 1, 1)),  # a 0-dim tensor is one element, as torch scans it
    ((), -1, (1, 1, 1)),
    ((4, 0, 3), 1, (4, 0, 3)),  # empty
])
def test_the_scanned_dim_is_the_middle_axis_of_the_view(name, shape, dim, view):
    cls = getattr(ops, name)
    x = torch.rand(shape) + 0.5
    got = _in_tree(cls, dim=dim)(x)
    assert launched.pop() == (cls.kind, *view, "float32")
    torch.testing.assert_close(got, getattr(torch, name[:-5].lower())(x, dim))


@pytest.mark.parametrize(("dtype", "handed"), [
    (torch.bool, "uint8"), (torch.uint8, "uint8"), (torch.int8, "int8"),
    (torch.int16, "int16"), (torch.int32, "int32"), (torch.int64, "int64"),
])
def test_bool_and_integer_inputs_scan_into_int64(dtype, handed):
    x = torch.randint(-3 if dtype.is_signed else 0, 4, (3, 9)).to(dtype)
    for name in ("CumsumFwdOp", "CumprodFwdOp"):
        got = _in_tree(getattr(ops, name), dim=1)(x)
        assert launched.pop()[-1] == handed
        want = getattr(torch, name[:-5].lower())(x, 1)
        assert got.dtype == want.dtype == torch.int64
        assert torch.equal(got, want)


def test_a_strided_or_misaligned_input_is_copied_and_the_caller_keeps_its_tensor():
    base = torch.randn(8, 12)
    for x in (base.t(), base[:, 2:], base.view(-1)[1:61].view(6, 10)):
        before = x.clone()
        got = _in_tree(ops.CumsumFwdOp, dim=1)(x)
        launched.pop()
        torch.testing.assert_close(got, torch.cumsum(x, 1))
        assert torch.equal(x, before)


def test_float64_is_refused_by_name_on_the_in_tree_kernels():
    with pytest.raises(TypeError) as err:
        _in_tree(ops.CumsumFwdOp, dim=0)(torch.zeros(3, dtype=torch.float64))
    assert str(err.value) == (
        "CumsumFwdOp: the in-tree scan kernels serve bfloat16, bool, float16, float32, int16, "
        "int32, int64, int8, uint8, not float64; construct the op with target='reference' "
        "for float64")
    assert not launched


def test_a_dim_out_of_range_is_refused_naming_the_rule_and_the_sizes():
    with pytest.raises(Exception) as err:
        ops.CumsumFwdOp(dim=2)(torch.zeros(3, 4))
    text = str(err.value)
    assert isinstance(err.value, IndexError)  # as torch's
    assert text.startswith("CumsumFwdOp: argument x does not match the signature")
    assert ("because:  let dim_axis = axis(dim, len(S)) fails on these sizes: dim 2 is out of "
            "range for a tensor of rank 2 (expected an axis in [-2, 1])") in text


def test_the_call_spec_refuses_a_bad_field_by_name():
    with pytest.raises(TypeError, match=r"ScanSpec.kind must be a ScanKind, got 'sum'"):
        K.ScanSpec(device="cuda", kind="sum", outer=1, length=2, inner=1, dtype="float32")
    with pytest.raises(ValueError, match="dtype"):
        K.ScanSpec(device="cuda", kind=K.ScanKind.SUM, outer=1, length=2, inner=1,
                   dtype="float64")


def test_the_row_kernel_claims_the_last_dim_and_the_strided_walk_the_rest():
    from tileops.runtime import select

    def chosen(inner):
        spec = K.ScanSpec(device="cuda", kind=K.ScanKind.SUM, outer=4, length=64, inner=inner,
                          dtype="bfloat16")
        return select(K.ScanInterface, (K.ScanRowKernel, K.ScanStridedKernel), spec)

    assert chosen(1) is K.ScanRowKernel
    assert chosen(3) is K.ScanStridedKernel
    assert K.ScanRowKernel.region_refusal(K.ScanSpec(
        device="cuda", kind=K.ScanKind.SUM, outer=4, length=64, inner=3, dtype="bfloat16"
    )) == "the scanned axis is not the last (inner 3)"


# --- the plans -------------------------------------------------------------------------------

_DTYPES = ["uint8", "int32", "int64", "float16", "bfloat16", "float32"]


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 1 << 22), rows=st.integers(1, 1 << 16), dtype=st.sampled_from(_DTYPES))
def test_a_row_plan_covers_the_row_in_whole_chunks(n, rows, dtype):
    threads, vec, per, segs, seg_len = K.row_plan(n, dtype, rows)
    assert threads & (threads - 1) == 0 and 32 <= threads <= 512
    assert n % vec == 0 and per % vec == 0 and vec * K._ITEMSIZE[dtype] <= 16
    assert seg_len % (threads * per) == 0
    assert (segs - 1) * seg_len < n <= segs * seg_len  # every segment holds some of the row
    if rows >= K._WANT_CTAS:
        assert segs == 1


@settings(max_examples=300, deadline=None)
@given(length=st.integers(1, 1 << 16), inner=st.integers(2, 1 << 16),
       outer=st.integers(1, 4096), dtype=st.sampled_from(_DTYPES))
def test_a_strided_plan_covers_the_axis_in_unrolled_steps(length, inner, outer, dtype):
    threads, vec, segs, seg_len = K.strided_plan(length, inner, dtype, outer)
    assert threads & (threads - 1) == 0 and 32 <= threads <= 128
    assert inner % vec == 0 and vec * K._ITEMSIZE[dtype] <= 16
    assert seg_len % K._UNROLL == 0
    assert (segs - 1) * seg_len < length <= segs * seg_len
    if segs > 1:
        assert seg_len >= K._MIN_SEGMENT_ROWS


def test_few_rows_are_split_and_many_are_not():
    assert K.row_plan(1 << 20, "bfloat16", 1)[3] == 128  # a 2^20 row over 128 CTAs
    assert K.row_plan(8192, "bfloat16", 4096)[3] == 1
    assert K.row_plan(3_000_001, "float32", 2)[3:] == (367, 8192)  # two chunks a segment
    assert K.strided_plan(8192, 4096, "bfloat16", 1)[2:] == (256, 32)  # dim 0 of 8192 x 4096
    assert K.strided_plan(32, 64, "float16", 16)[2] == 2


@pytest.mark.parametrize(("cls", "sizes"), [
    (K.ScanRowKernel, (0, 64, 1)), (K.ScanRowKernel, (4, 0, 1)),
    (K.ScanStridedKernel, (0, 64, 3)), (K.ScanStridedKernel, (4, 0, 3)),
    (K.ScanStridedKernel, (4, 64, 0)),
])
def test_an_empty_call_builds_nothing_and_shares_no_entry_with_a_full_one(cls, sizes):
    def spec(outer, length, inner):
        return K.ScanSpec(device="cuda", kind=K.ScanKind.SUM, outer=outer, length=length,
                          inner=inner, dtype="float32")

    empty = spec(*sizes)
    kernel = cls(empty)  # would compile otherwise (and fails to without nvcc and a GPU)
    assert kernel.program is None and kernel.totals is None
    kernel(torch.empty(sizes), torch.empty(sizes))  # returns at once
    full = spec(*(s or 4 for s in sizes))
    assert cls.identity(empty) != cls.identity(full)


@pytest.mark.parametrize(("shape", "dim"), [((5, 7), 1), ((5, 7), 0), ((2, 3, 4, 5), -3),
                                            ((), 0), ((4, 0, 3), 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cumsum_trains_through_the_reversed_scan(shape, dim, dtype):
    # the gradient is the scan of dy from the end of dim: the forward's program on dy flipped
    x = torch.randn(shape, dtype=torch.float64).to(dtype).requires_grad_()
    dy = torch.randn(shape, dtype=torch.float64).to(dtype)
    launched.clear()
    got = _in_tree(ops.CumsumBwdOp, dim=dim)(dy)
    assert shape == () or 0 in shape or launched
    (want,) = torch.autograd.grad(torch.cumsum(x, dim), x, dy)
    tol = {} if dtype == torch.float32 else dict(rtol=8e-3, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    # through autograd (the forward and its gradient op on the reference target here)
    (g,) = torch.autograd.grad(ops.CumsumFwdOp(dim=dim)(x), x, dy)
    torch.testing.assert_close(g, want, **tol)


@pytest.mark.parametrize(("shape", "dim"), [((5, 7), 1), ((5, 7), 0), ((2, 3, 4, 5), -3),
                                            ((2, 3, 4, 5), 3), ((), 0), ((4, 0, 3), 1)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zeros", [(), (2,), (2, 5), (0, 1, 6)])
def test_cumprod_trains_with_torch_s_gradient_at_zeros(shape, dim, dtype, zeros):
    # zeros in a run: before the first one the reversed sum over x, at it the products with it
    # taken as one, after it 0 (torch's cumprod_backward); flat positions put some zeros in
    # one run and some in others
    g = torch.Generator().manual_seed(5)
    x = torch.rand(shape, generator=g, dtype=torch.float64) + 0.5
    for i in zeros:
        if i < x.numel():
            x.view(-1)[i] = 0.0
    x = x.to(dtype).requires_grad_()
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    got = _in_tree(ops.CumprodBwdOp, dim=dim)(dy, x.detach())
    wide = x.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(torch.cumprod(wide, dim), wide, dy.double())
    assert got.dtype == dtype and got.shape == x.shape
    tol = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=1e-5, atol=1e-5),
           torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2)}[dtype]
    torch.testing.assert_close(got.double(), want, **tol)
    # through autograd (the forward and its gradient op on the reference target here)
    (through,) = torch.autograd.grad(ops.CumprodFwdOp(dim=dim)(x), x, dy)
    torch.testing.assert_close(through.double(), want, **tol)


def test_cumprod_s_gradient_refuses_what_its_spec_refuses_by_name():
    op = ops.CumprodBwdOp(dim=2)
    with pytest.raises(Exception) as e:
        op(torch.zeros(3, 4), torch.zeros(3, 4))
    assert "CumprodBwdOp" in str(e.value) and "dim" in str(e.value)
    with pytest.raises(Exception) as e:
        op(torch.zeros(3, 4, 5), torch.zeros(3, 4, 6))
    assert "CumprodBwdOp" in str(e.value) and "x" in str(e.value)
    assert torch.equal(op(torch.ones(1, 1, 2), torch.ones(1, 1, 2)), torch.tensor([[[2., 1.]]]))


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize(("dy", "x"), [
    (_t(1, 1, math.nan, 1), _t(2, 0, 3, 4)),  # NaN past the first zero
    (_t(1, 1, 1, 1, math.nan), _t(2, 0, 3, 0, 5)),  # past the second zero
    (_t(1, 1, 1, 1, 1), _t(2, 0, 3, 0, math.inf)),  # an inf of x past the second zero
    (_t(1, 1, 1, 1, 1), _t(2, 0, 3, 0, math.nan)),
    (_t(0.3), _t(1e-320)),  # one element: dy as handed, no x / x
    (_t(1e10), _t(1e300)),
    (_t(1.0), _t(math.inf)),
    (_t(0.3, 1.0).view(2, 1), _t(1e-320, math.inf).view(2, 1)),  # runs of one
])
def test_cumprod_s_gradient_keeps_non_finite_values_where_torch_keeps_them(dy, x):
    # each part reads dy (and x) over its own stretch only, as torch's cumprod_backward does
    dim = x.dim() - 1 if x.dim() == 1 else 1
    got = _in_tree(ops.CumprodBwdOp, dim=dim)(dy, x)
    wide = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(torch.cumprod(wide, dim), wide, dy)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0, equal_nan=True)


def test_the_log_of_cumprod_past_a_zero_trains_as_torch_s():
    # dy = 1 / y is inf past the zero: the gradient before it stays finite
    x = _t(2, 0, 3).requires_grad_()
    ops.CumprodFwdOp(dim=0)(x).log().sum().backward()
    wide = x.detach().clone().requires_grad_()
    torch.cumprod(wide, 0).log().sum().backward()
    torch.testing.assert_close(x.grad, wide.grad)
    assert x.grad[0] == 0.5
