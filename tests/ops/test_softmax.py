"""The softmax family's in-tree path on the CPU: how each op hands its call to the
``softmax_fwd`` / ``softmax_bwd`` slots (the ``(outer, R, inner)`` view of the reduced axis,
the layout of the tensors it passes, the kind), run through stand-in implementations of the
slots that compute with torch over exactly the view the spec states. The kernels' own
numerics are tested on the GPU (tests/kernels/test_softmax_cuda.py); the generic harness
covers the references, the bad-input corpus, compile and the gradients."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tileops.ops as ops
from tileops.kernels import softmax as K
from tileops.ops.softmax import view_of
from tileops.runtime import Kernel

launched: list[K.SoftmaxSpec] = []


def _check_view(spec, *tensors):
    for t in tensors:
        assert t.is_contiguous() and t.data_ptr() % 16 == 0
        assert t.numel() == spec.outer * spec.r * spec.inner


class TorchFwdSlot(Kernel, K.SoftmaxFwdInterface):
    """The forward slot on the CPU: torch over the spec's (outer, R, inner) view."""

    devices = ("cpu",)
    general = True

    @classmethod
    def entry_for(cls, spec, op):
        def run(x, out):
            launched.append(spec)
            _check_view(spec, x)
            v = x.view(spec.outer, spec.r, spec.inner).float()
            if spec.kind is K.SoftmaxKind.SOFTMAX:
                got = torch.softmax(v, 1)
            elif spec.kind is K.SoftmaxKind.LOG_SOFTMAX:
                got = torch.log_softmax(v, 1)
            else:
                got = torch.logsumexp(v, 1)
            out.copy_(got.reshape(out.shape))

        return run


class TorchBwdSlot(Kernel, K.SoftmaxBwdInterface):
    """The gradient slot on the CPU: the closed forms over the spec's view."""

    devices = ("cpu",)
    general = True

    @classmethod
    def entry_for(cls, spec, op):
        def run(y, dy, dx):
            launched.append(spec)
            _check_view(spec, y, dy)
            yv = y.view(spec.outer, spec.r, spec.inner).float()
            dv = dy.view(spec.outer, spec.r, spec.inner).float()
            if spec.kind is K.SoftmaxKind.SOFTMAX:
                got = yv * (dv - (dv * yv).sum(1, keepdim=True))
            else:
                got = dv - yv.exp() * dv.sum(1, keepdim=True)
            dx.copy_(got.reshape(dx.shape))

        return run


class TorchLseBwdSlot(Kernel, K.LogSumExpBwdInterface):
    """logsumexp's gradient slot on the CPU: dy * exp(x - lse) over the spec's view."""

    devices = ("cpu",)
    general = True

    @classmethod
    def entry_for(cls, spec, op):
        def run(dy, x, lse, dx):
            launched.append(spec)
            _check_view(spec, x)
            for t in (dy, lse):
                assert t.is_contiguous() and t.numel() == spec.outer * spec.inner
            xv = x.view(spec.outer, spec.r, spec.inner).float()
            got = dy.view(spec.outer, 1, spec.inner) * (xv - lse.view(spec.outer, 1,
                                                                       spec.inner)).exp()
            dx.copy_(got.reshape(dx.shape))

        return run


_SLOTS = {"softmax_fwd": TorchFwdSlot, "softmax_bwd": TorchBwdSlot,
          "logsumexp_bwd": TorchLseBwdSlot}


def _in_tree(cls, **params):
    """``cls`` with its slot served by the stand-in."""
    slot = next(iter(cls.kernel_types)).slot
    return cls(kernel_map={slot: _SLOTS[slot]}, **params)


def _rand(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
def test_the_view_reduces_the_axis_torch_reduces(shape, data):
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = _rand(*shape).double()
    outer, r, inner = view_of(tuple(shape), dim)
    assert outer * r * inner == x.numel() and r == shape[dim]
    torch.testing.assert_close(torch.softmax(x.view(outer, r, inner), 1).view(shape),
                               torch.softmax(x, dim), rtol=1e-14, atol=0)


@pytest.mark.parametrize("name", ["SoftmaxFwdOp", "LogSoftmaxFwdOp"])
@pytest.mark.parametrize(("shape", "dim", "view"), [
    pytest.param((6, 10), -1, (6, 10, 1), id="rows"),
    pytest.param((6, 10), 0, (1, 6, 10), id="leading-axis"),
    pytest.param((2, 3, 4, 5), 1, (2, 3, 20), id="middle-axis"),
    pytest.param((2, 3, 4, 5), -2, (6, 4, 5), id="negative-dim"),
    pytest.param((), 0, (1, 1, 1), id="0-dim"),
])
def test_forward_hands_the_view_of_dim_to_the_slot(name, shape, dim, view):
    cls = getattr(ops, name)
    x = _rand(*shape)
    got = _in_tree(cls, dim=dim)(x)
    spec = launched.pop()
    assert (spec.outer, spec.r, spec.inner) == view and spec.dtype == "float32"
    assert spec.kind is cls.kind
    torch.testing.assert_close(got, cls(dim=dim, target="reference")(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("name", "fwd"), [("SoftmaxBwdOp", torch.softmax),
                                           ("LogSoftmaxBwdOp", torch.log_softmax)])
@pytest.mark.parametrize(("shape", "dim"), [((6, 10), -1), ((4, 6, 5), 1), ((4, 6, 5), 0)])
def test_gradient_hands_the_view_of_dim_to_the_slot(name, fwd, shape, dim):
    cls = getattr(ops, name)
    x = _rand(*shape, seed=1)
    dy = _rand(*shape, seed=2)
    y = fwd(x, dim)
    got = _in_tree(cls, dim=dim)(dy, y)
    spec = launched.pop()
    assert spec.r == shape[dim] and spec.kind is cls.kind
    xr = x.double().requires_grad_()
    want, = torch.autograd.grad(fwd(xr, dim), xr, dy.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("shape", "dim", "keepdim"), [((6, 10), -1, False), ((4, 6, 5), 1, True),
                                                      ((4, 6, 5), 0, False)])
def test_logsumexp_gradient_hands_the_views_to_the_slot(shape, dim, keepdim):
    x = _rand(*shape, seed=1)
    lse = torch.logsumexp(x, dim, keepdim)
    # a transposed upstream gradient where the output has two axes (copied for the kernels)
    dy = _rand(*lse.shape[::-1], seed=2).t() if lse.dim() == 2 else _rand(*lse.shape, seed=2)
    got = _in_tree(ops.LogSumExpBwdOp, dim=dim, keepdim=keepdim)(x, dy, lse)
    spec = launched.pop()
    assert isinstance(spec, K.LogSumExpBwdSpec) and spec.r == shape[dim]
    xr = x.double().requires_grad_()
    want, = torch.autograd.grad(torch.logsumexp(xr, dim, keepdim), xr, dy.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), keepdim=st.booleans(),
       data=st.data())
def test_logsumexp_over_several_axes_hands_one_reduced_run_to_the_slots(shape, keepdim, data):
    rank = len(shape)
    axes = data.draw(st.lists(st.integers(0, rank - 1), min_size=1, max_size=rank, unique=True))
    # each axis spelled either way round, in any order
    dim = tuple(a - rank if data.draw(st.booleans()) else a for a in axes)
    x = _rand(*shape, seed=3)
    got = _in_tree(ops.LogSumExpFwdOp, dim=dim, keepdim=keepdim)(x)
    spec = launched.pop()
    # the reduced axes are the view's R, whether read in place or permuted into rows
    assert spec.r == math.prod(shape[a] for a in axes)
    assert spec.outer * spec.r * spec.inner == x.numel()
    want = torch.logsumexp(x.double(), dim, keepdim)
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    # the gradient, with an upstream gradient that is not contiguous where it can be made so
    dy = _rand(*want.shape, seed=4)
    if dy.dim() >= 2:
        dy = _rand(*want.shape[::-1], seed=4).permute(*range(dy.dim() - 1, -1, -1))
    gx = _in_tree(ops.LogSumExpBwdOp, dim=dim, keepdim=keepdim)(x, dy, got)
    assert launched.pop().r == spec.r
    xr = x.double().requires_grad_()
    gw, = torch.autograd.grad(torch.logsumexp(xr, dim, keepdim), xr, dy.double())
    torch.testing.assert_close(gx.double(), gw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("shape", "dim", "view"), [
    pytest.param((4, 6, 5), (1, 2), (4, 30, 1), id="last-two-in-place"),
    pytest.param((4, 6, 5), (0, 1), (1, 24, 5), id="leading-two-in-place"),
    pytest.param((4, 1, 5), (0, 2), (1, 20, 1), id="a-size-1-axis-between"),
    pytest.param((4, 6, 5), (0, 2), (6, 20, 1), id="apart-permuted-into-rows"),
    pytest.param((2, 3, 4, 5), (3, 1), (8, 15, 1), id="apart-out-of-order"),
])
def test_logsumexp_axes_take_the_reductions_view(shape, dim, view):
    got = _in_tree(ops.LogSumExpFwdOp, dim=dim)(_rand(*shape))
    spec = launched.pop()
    assert (spec.outer, spec.r, spec.inner) == view
    assert got.shape == torch.logsumexp(_rand(*shape), dim).shape


def test_logsumexp_axes_torch_refuses_are_refused_by_name():
    x = torch.zeros(3, 4)
    with pytest.raises(Exception) as e:
        ops.LogSumExpFwdOp(dim=())
    msg = str(e.value)
    assert msg.startswith("LogSumExpFwdOp: construction param dim does not match the signature")
    assert "because:  refinement 'naxes(dim) > 0' does not hold" in msg
    with pytest.raises(Exception, match=r"LogSumExpFwdOp: .*\n.*\n.*\n.*dim 0 appears more than "
                                        r"once in the dims \(0, -2\)"):
        ops.LogSumExpFwdOp(dim=(0, -2))(x)
    with pytest.raises(Exception, match=r"LogSumExpBwdOp: construction param dim"):
        ops.LogSumExpBwdOp(dim=())
    with pytest.raises(Exception, match=r"LogSumExpFwdOp: construction param dim .*\n"
                                        r".*\n.*\n.*dim must be an int or a tuple of ints"):
        ops.LogSumExpFwdOp(dim=None)


def test_strided_and_misaligned_inputs_are_handed_over_contiguous():
    base = _rand(9, 12)
    op = _in_tree(ops.SoftmaxFwdOp, dim=0)
    # transposed, strided, and contiguous but starting 4 bytes into a 16-byte vector
    for x in (base.t(), base[:, 1:], base.view(-1)[1:97].view(8, 12)):
        got = op(x)
        launched.pop()  # _check_view held the handed tensor to the kernels' layout
        torch.testing.assert_close(got, torch.softmax(x, 0), rtol=1e-6, atol=1e-6)
    dy = _rand(12, 9).t()
    y = torch.softmax(base, 1)
    got = _in_tree(ops.SoftmaxBwdOp, dim=1)(dy, y)
    launched.pop()
    want = y * (dy - (dy * y).sum(1, keepdim=True))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("shape", "dim", "keepdim", "view"), [
    pytest.param((6, 10), -1, False, (6, 10, 1), id="rows"),
    pytest.param((6, 10), 0, True, (1, 6, 10), id="leading-axis-keepdim"),
    pytest.param((2, 3, 4, 5), 2, False, (6, 4, 5), id="middle-axis"),
    pytest.param((), -1, False, (1, 1, 1), id="0-dim"),
])
def test_logsumexp_hands_the_view_and_an_output_of_outer_by_inner(shape, dim, keepdim, view):
    x = _rand(*shape)
    got = _in_tree(ops.LogSumExpFwdOp, dim=dim, keepdim=keepdim)(x)
    spec = launched.pop()
    assert (spec.outer, spec.r, spec.inner) == view
    want = torch.logsumexp(x, dim, keepdim)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_an_empty_tensor_launches_nothing():
    for shape, dim in (((0, 8), -1), ((4, 0), -1), ((4, 0, 3), 1)):
        got = _in_tree(ops.SoftmaxFwdOp, dim=dim)(torch.empty(shape))
        assert got.shape == shape and not launched
    # logsumexp over an empty axis is the log of an empty sum, as torch: -inf
    got = _in_tree(ops.LogSumExpFwdOp, dim=1)(torch.empty(4, 0, 3))
    assert not launched
    torch.testing.assert_close(got, torch.logsumexp(torch.empty(4, 0, 3), 1))
    assert got.shape == (4, 3) and bool((got == float("-inf")).all())


def test_a_dim_out_of_range_is_refused_naming_the_op_the_rule_and_the_values():
    x = torch.zeros(3, 4)
    with pytest.raises(Exception) as e:
        ops.SoftmaxFwdOp(dim=2)(x)
    msg = str(e.value)
    assert isinstance(e.value, IndexError)  # as torch's
    assert msg.startswith("SoftmaxFwdOp: argument x does not match the signature")
    assert ("because:  let dim_axis = axis(dim, len(S)) fails on these sizes: dim 2 is out of "
            "range for a tensor of rank 2 (expected an axis in [-2, 1])") in msg
    with pytest.raises(IndexError, match=r"LogSoftmaxBwdOp: .*\n.*\n.*\n.*dim -3 is out of "
                                         r"range for a tensor of rank 2"):
        ops.LogSoftmaxBwdOp(dim=-3)(x, x)
    with pytest.raises(Exception, match=r"LogSumExpFwdOp: .*\n.*\n.*\n.*dim 1 is out of "
                                        r"range for a tensor of rank 0 \(expected an axis in "
                                        r"\[-1, 0\]\)"):
        ops.LogSumExpFwdOp(dim=1)(torch.tensor(1.0))


def test_float64_on_the_in_tree_kernels_is_refused_pointing_at_the_reference_target():
    with pytest.raises(TypeError, match="SoftmaxFwdOp: the in-tree softmax kernels serve "
                                        "bfloat16, float16, float32, not float64; construct "
                                        "the op with target='reference' for float64"):
        _in_tree(ops.SoftmaxFwdOp)(torch.zeros(2, 3, dtype=torch.float64))
