"""The gradients of the reductions (every reduction of one output that trains, found from the
ops, and var_mean): their in-tree call, run on the CPU with the elementwise slot served by a torch stand-in of the
family's scalar functions (the same operands, strides, forms and output buffers the CUDA
kernels get), against torch's autograd of the forward's torch equivalent in float64 and in the
16-bit dtypes, whose rounding each step follows.

The closed forms (the ``reference`` target) are checked by tests/ops/test_gradients.py; this file
checks the ``forward`` the kernels run, which the reference target never reaches."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import tileops.ops as ops
from tileops.kernels.elementwise import ElementwiseInterface
from tileops.runtime import REFERENCE, Kernel

_FORMS = {
    "mul": lambda xs, ps: xs[0] * xs[1],
    "div": lambda xs, ps: xs[0] / xs[1],
    "sub": lambda xs, ps: xs[0] - ps[0] * xs[1],
    "add": lambda xs, ps: xs[0] + ps[0] * xs[1],
    "eq": lambda xs, ps: xs[0] == xs[1],
    "masked_fill": lambda xs, ps: xs[0].masked_fill(xs[1], ps[0]),
    "where": lambda xs, ps: torch.where(xs[0], xs[1], xs[2]),
}
_WIDE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


class CpuElementwise(Kernel, ElementwiseInterface):
    """The slot on the CPU: each operand widened to the spec's compute dtype (bool kept), the
    function applied with torch's broadcasting, the result rounded once into the output."""

    devices = ("cpu",)
    calls: list = []

    @classmethod
    def region_refusal(cls, spec):
        return None

    def __call__(self, *tensors) -> None:
        spec = self.spec
        n = len(spec.in_dtypes)
        ins, outs = tensors[:n], tensors[n:]
        compute = getattr(torch, spec.compute)
        xs = [t if t.dtype == torch.bool else t.to(compute) for t in ins]
        CpuElementwise.calls.append(spec.fn)
        outs[0].copy_(_FORMS[spec.fn](xs, spec.params).expand(outs[0].shape))


def _in_tree(cls, **params):
    return cls(kernel_map={"elementwise": CpuElementwise}, **params)


#: the reductions of one output that train (their gradients found, not listed): the forward's
#: torch equivalent (``op.eager()``) is the reference of each
CASES = sorted(n for n in ops.__all__
               if isinstance(c := getattr(ops, n), type) and issubclass(c, ops.ReductionOp)
               and c._gradient is not None and len(c._signature.output_names) == 1)
DIMS = [(None, False), (1, True), ((0, 2), False), (-1, False)]


def _x(dtype, ties=False):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 5, generator=gen, dtype=torch.float64)
    if ties:  # ties of the extremum, a constant slice (std 0, a norm's zero row)
        x[0] = 0.0
        x[1, :, 0] = 3.0
    return x.to(dtype)


def test_the_cases_are_found():
    assert {"SumFwdOp", "MeanFwdOp", "AmaxFwdOp", "VarFwdOp", "L2NormFwdOp"} <= set(CASES)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize(("dim", "keepdim"), DIMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ties", [False, True])
def test_the_in_tree_gradient_matches_torch(name, dim, keepdim, dtype, ties):
    fwd = getattr(ops, name)(dim=dim, keepdim=keepdim)
    x = _x(dtype, ties).requires_grad_()
    y = fwd(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dy = dy.to(dtype)
    bwd = _in_tree(fwd._gradient.resolved()[0], dim=dim, keepdim=keepdim)
    saved = {"dy": dy, "x": x.detach(), "y": y.detach()}
    names = type(bwd)._signature.input_names
    got = bwd(*[saved[n] for n in names])
    assert bwd.serving_target != REFERENCE  # the in-tree forward ran
    (want,) = torch.autograd.grad(fwd.eager()(x), x, dy)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
    else:  # each step rounded as torch's: equal, or a rounding apart where torch's order differs
        torch.testing.assert_close(got.double(), want.double(), rtol=8e-3, atol=1e-3,
                                   equal_nan=True)


@pytest.mark.parametrize(("dim", "keepdim"), DIMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("given", ["both", "dvar", "dmean", "neither"])
def test_var_mean_in_tree_gradient_adds_what_is_given(dim, keepdim, dtype, given):
    x = _x(dtype).requires_grad_()
    dims = dim if dim is not None else (0, 1, 2)
    var, mean = torch.var_mean(x, dims, keepdim=keepdim)
    gen = torch.Generator().manual_seed(2)
    dvar = torch.randn(var.shape, generator=gen, dtype=torch.float64).to(dtype)
    dmean = torch.randn(mean.shape, generator=gen, dtype=torch.float64).to(dtype)
    use_var, use_mean = given in ("both", "dvar"), given in ("both", "dmean")
    bwd = _in_tree(ops.VarMeanBwdOp, dim=dim, keepdim=keepdim)
    CpuElementwise.calls.clear()
    got = bwd(x.detach(), dvar if use_var else None, dmean if use_mean else None)
    assert given == "neither" or CpuElementwise.calls
    loss = (var * dvar).sum() * use_var + (mean * dmean).sum() * use_mean
    want = torch.autograd.grad(loss, x, allow_unused=True)[0] if given != "neither" else None
    want = torch.zeros_like(x) if want is None else want
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(got.double(), want.double(), **tol)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize(("x", "dim"), [
    ([[0.5, -1.0, 2.0, 3.0]], 0),  # a batch of one: no degree of freedom, var is NaN
    ([[1.0, math.inf, 3.0], [1.0, 2.0, 3.0]], 1),  # an inf in a run
    ([[1.0, math.nan, 3.0], [1.0, 2.0, 3.0]], 1),
])
def test_var_mean_s_mean_alone_trains_as_torch_s(x, dim, compiled):
    # autograd hands the unused var's gradient over as absent, and the op skips that term:
    # zeros there would give 0 * NaN (torch's formula skips an undefined gradient)
    x = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    op = ops.VarMeanFwdOp(dim=dim)

    def loss(x):
        _, mean = op(x)
        return torch.where(mean.isfinite(), mean, 0).sum()

    if compiled:
        torch._dynamo.reset()
        loss = torch.compile(loss, backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's degrees-of-freedom warning
        (got,) = torch.autograd.grad(loss(x), x)
        _, mean = torch.var_mean(x, dim)
        (want,) = torch.autograd.grad(torch.where(mean.isfinite(), mean, 0).sum(), x)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("used", ["q", "k"])
def test_an_input_reaching_only_an_unused_output_gets_no_gradient(used, compiled):
    # RoPE's q reaches q_out alone and k k_out (the block's reaches): with one output used,
    # the other input's gradient is None, as torch's autograd gives it, and the used one's
    # is the rotation's transpose
    g = torch.Generator().manual_seed(6)
    q = torch.randn(1, 3, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 3, 1, 4, generator=g, dtype=torch.float64, requires_grad=True)
    op = ops.RopeNeoxFwdOp()
    w = torch.randn((q if used == "q" else k).shape, generator=g, dtype=torch.float64)

    def loss(q, k):
        q_out, k_out = op(q, k)
        return ((q_out if used == "q" else k_out) * w).sum()

    if compiled:
        torch._dynamo.reset()
        loss = torch.compile(loss, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(loss(q, k), (q, k), allow_unused=True)
    mine, other = got if used == "q" else got[::-1]
    assert other is None
    # the rotation's transpose: the gradient's norm per position and head is w's
    torch.testing.assert_close(mine.norm(dim=-1), w.norm(dim=-1))


@pytest.mark.parametrize("name", ["VarFwdOp", "StdFwdOp"])
@pytest.mark.parametrize(("shape", "dim", "correction"), [
    ((5,), None, 5.0), ((5,), None, 7.0), ((2, 3), None, 6.5),  # no degree of freedom left
    ((), None, 1.0), ((), 0, 2.0),  # a 0-dim x: torch's branch without a dim
    ((5,), 0, 7.0), ((2, 3), (0, 1), 6.0),  # with a dim: 2 / (n - correction), inf at 0
])
def test_var_and_std_without_degrees_of_freedom_follow_torch(name, shape, dim, correction):
    x = torch.tensor([1.0, 2.0, 4.0, 7.0, 3.0, 3.0], dtype=torch.float64)[:max(1, math.prod(
        shape))].reshape(shape).requires_grad_()
    fwd = getattr(ops, name)
    y = fwd(dim=dim, correction=correction)(x)
    dy = torch.full(y.shape, -1.5, dtype=torch.float64)
    fn = torch.var if name == "VarFwdOp" else torch.std
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns of the missing degrees of freedom
        want_y = fn(x, correction=correction) if dim is None else fn(x, dim,
                                                                      correction=correction)
    (want,) = torch.autograd.grad(want_y, x, dy)
    bwd = _in_tree(getattr(ops, name.replace("Fwd", "Bwd")), dim=dim, correction=correction)
    saved = {"dy": dy, "x": x.detach(), "y": y.detach()}
    got = bwd(*[saved[n] for n in type(bwd)._signature.input_names])
    torch.testing.assert_close(got, want, equal_nan=True)
    (through,) = torch.autograd.grad(y, x, dy)  # the reference target's closed form
    torch.testing.assert_close(through, want, equal_nan=True)


def test_the_constants_a_gradient_op_keeps_are_bounded():
    from tileops.ops._elementwise_base import MAX_CONSTS

    op = _in_tree(ops.MeanBwdOp, dim=-1)
    for n in range(1, 3 * MAX_CONSTS):  # a count per row length
        dy = torch.randn(2)
        torch.testing.assert_close(op(dy, torch.empty(2, n)), (dy / n)[:, None].expand(2, n))
        assert len(op._scalars) <= MAX_CONSTS


@pytest.mark.parametrize(("dim", "keepdim"), DIMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("zeros", [0, 1, 2])
def test_prod_in_tree_gradient_is_torch_s_with_zeros_in_x(dim, keepdim, dtype, zeros):
    # zeros in a reduced run: one zero leaves its own gradient the product of the others, two
    # leave every gradient of the run 0 (torch's zero-safe form; no division by them)
    x = (torch.rand(4, 6, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
         + 0.5)
    x.view(-1)[:zeros] = 0.0
    x.view(-1)[7:7 + zeros] = 0.0
    x = x.to(dtype).requires_grad_()
    fwd = ops.ProdFwdOp(dim=dim, keepdim=keepdim)
    y = fwd(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4),
                     dtype=torch.float64).to(dtype)
    got = _in_tree(ops.ProdBwdOp, dim=dim, keepdim=keepdim)(dy, x.detach())
    wide = x.detach().double().requires_grad_()
    want_y = fwd.eager()(wide)  # torch.prod over each axis in turn
    (want,) = torch.autograd.grad(want_y, wide, dy.double())
    assert got.dtype == dtype and got.shape == x.shape
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got.double(), want, **tol)


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize(("dim", "keepdim"), [*DIMS, (None, True), ((0, 1, 2), False)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("special", [
    (0.0, 0.0, _NAN), (0.0, 0.0, 0.0, _NAN), (0.0, _NAN), (_NAN,), (_INF,), (0.0, _INF),
    (0.0, 0.0, _INF), (_NAN, _INF), (0.0,)])
def test_prod_with_zeros_and_a_nan_or_inf_is_torch_s_forward_and_gradient(dim, keepdim, dtype,
                                                                          special):
    """Two or more zeros and a NaN (or an infinity) in x: the product and its gradient are
    torch's, NaN placement included. Over every axis that is torch.prod(x)'s gradient (no
    division where x holds zeros, zeros for two of them: torch gives no NaN there), over some
    axes torch's gradient of a product over each in turn (``dy * (y / x)`` where no element
    is 0, a NaN's run all NaN); in the tensors' dtype in-tree, and through the reference."""
    x = (torch.rand(4, 6, 5, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
         + 0.5).to(dtype)
    for i, v in enumerate(special):  # in one row of every reduction
        x.view(-1)[[1, 3, 8, 11, 17][i]] = v
    fwd = ops.ProdFwdOp(dim=dim, keepdim=keepdim)
    ours = x.clone().requires_grad_()
    y = fwd(ours)
    theirs = x.clone().requires_grad_()
    want_y = torch.prod(theirs) if dim is None and not keepdim else fwd.eager()(theirs)
    tol = {} if dtype != torch.bfloat16 else dict(rtol=3e-2, atol=3e-2)
    assert y.shape == want_y.shape and y.dtype == want_y.dtype
    assert torch.equal(y.isnan(), want_y.isnan())
    torch.testing.assert_close(y, want_y, equal_nan=True, **tol)  # bf16: rounded once here
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(6),
                     dtype=torch.float64).to(dtype)
    (want,) = torch.autograd.grad(want_y, theirs, dy)
    (got,) = torch.autograd.grad(y, ours, dy)  # the reference target on the CPU
    in_tree = _in_tree(ops.ProdBwdOp, dim=dim, keepdim=keepdim)(dy, x)
    for g in (got, in_tree):
        assert g.dtype == dtype and g.shape == x.shape
        assert torch.equal(g.isnan(), want.isnan()), (g, want)  # NaN where torch's is
        torch.testing.assert_close(g, want, equal_nan=True, **tol)
    torch.testing.assert_close(in_tree, want, equal_nan=True, rtol=0, atol=0)  # torch's ops
    if dim is None and not keepdim and special.count(0.0) >= 2:
        assert not want.isnan().any() and not want.any()  # torch: zeros


def test_the_torch_calls_of_top_k_s_and_the_step_functions_gradients_run_in_tree():
    # their in-tree forward (what CUDA runs) is torch's scatter and a fill: bound here through
    # a CPU stand-in of their family's slot, which they never call
    from tileops.kernels.topk import TopkInterface

    class CpuTopk(Kernel, TopkInterface):
        devices = ("cpu",)

        @classmethod
        def region_refusal(cls, spec):
            return None

    x = torch.randn(4, 9, dtype=torch.float32)
    values, indices = torch.topk(x, 3, dim=1)
    dv = torch.randn_like(values)
    op = ops.TopkBwdOp(k=3, dim=1, kernel_map={TopkInterface.slot: CpuTopk})
    got = op(dv, indices, x)
    assert op.serving_target != "reference"
    xr = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(torch.topk(xr, 3, dim=1)[0], xr, dv)
    torch.testing.assert_close(got, want)
    step = _in_tree(ops.StepBwdOp)
    dy = torch.randn(3, 5).expand(2, 3, 5)  # an expanded upstream gradient
    out = step(dy)
    assert step.serving_target != "reference"
    assert out.is_contiguous() and torch.equal(out, torch.zeros(2, 3, 5))
