"""Where autograd meets the ops' edges, on the CPU (the ``reference`` target): ops whose
outputs are indices or masks serve inputs that require grad, as torch's argmax and eq do
(eager, the fused call of a second call, and compiled), while a forward-only op with a
floating output still refuses them by name; a gradient taken with ``create_graph=True`` and
then differentiated again raises naming the op, whichever way the second backward runs,
instead of silently dropping the second-order term; and an op keeps the params it checked,
not the caller's object (a list changed after construction, a NumPy integer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tileops.ops as ops


def _leaf(*shape):
    return torch.randn(shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize(("make", "call", "want"), [
    (lambda: ops.ArgmaxFwdOp(dim=1), lambda op, x: op(x), lambda x: torch.argmax(x, 1)),
    (lambda: ops.ArgminFwdOp(dim=0), lambda op, x: op(x), lambda x: torch.argmin(x, 0)),
    (lambda: ops.AllFwdOp(dim=1), lambda op, x: op(x), lambda x: torch.all(x, 1)),
    (lambda: ops.EqFwdOp(), lambda op, x: op(x, x[:1]), lambda x: torch.eq(x, x[:1])),
    (lambda: ops.GtFwdOp(), lambda op, x: op(x, 0.0), lambda x: torch.gt(x, 0.0)),
    (lambda: ops.IsnanFwdOp(), lambda op, x: op(x), torch.isnan),
])
def test_index_and_mask_outputs_serve_inputs_that_require_grad(make, call, want):
    op, x = make(), _leaf(3, 4)
    for _ in range(2):  # the second call takes the fused call
        got = call(op, x)
        assert not got.requires_grad and got.grad_fn is None
        assert torch.equal(got, want(x.detach()))
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: (call(op, t), (t * 2).sum()), fullgraph=True,
                             dynamic=False)
    got, loss = compiled(x)
    assert torch.equal(got, want(x.detach()))
    loss.backward()  # the graph's other outputs still train
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_a_forward_only_op_with_a_floating_output_still_refuses_grad():
    x = _leaf(3)
    with pytest.raises(RuntimeError, match=r"^SumFwdOp is forward-only \(it has no backward\), "
                                           r"but x requires grad"):
        ops.SumFwdOp(dim=0)(x)
    torch.testing.assert_close(ops.SumFwdOp(dim=0)(x.detach()), x.detach().sum(0))


@pytest.mark.parametrize("second", ["grad toward the input", "backward of everything"])
@pytest.mark.parametrize(("name", "loss"), [
    ("SiluFwdOp", lambda x: ops.SiluFwdOp()(x).sum()),
    ("MulFwdOp", lambda x: ops.MulFwdOp()(x, x).sum()),
    ("CrossEntropyFwdOp",
     lambda x: ops.CrossEntropyFwdOp()(x, torch.tensor([0, 2, 1]))),  # the loss itself
])
def test_a_double_backward_raises_naming_the_op(name, loss, second):
    x = _leaf(3, 4)
    out = loss(x)
    g, = torch.autograd.grad(out, x, create_graph=True)
    # the first-order gradient is the plain one
    x2 = x.detach().requires_grad_()
    torch.testing.assert_close(g.detach(), torch.autograd.grad(loss(x2), x2)[0])
    penalty = out + g.pow(2).sum()
    with pytest.raises(RuntimeError, match=rf"^{name}'s gradient is once-differentiable: "
                                           r"trying to differentiate it again"):
        if second == "grad toward the input":
            torch.autograd.grad(penalty, x)
        else:
            penalty.backward()


@pytest.mark.parametrize(("name", "fn"), [
    ("SoftmaxFwdOp", lambda x: ops.SoftmaxFwdOp()(x)),
    ("RMSNormFwdOp", lambda x: ops.RMSNormFwdOp(normalized_shape=4)(x, None)),
    ("ExpFwdOp", lambda x: ops.ExpFwdOp()(x)),
    ("MaxPool1dFwdOp", lambda x: ops.MaxPool1dFwdOp(kernel_size=2)(x[None])),
])
def test_a_jvp_by_double_backward_raises_naming_the_op(name, fn):
    """A jvp by double backward differentiates the gradient with respect to the upstream
    gradient, which no saved tensor leads to: it used to answer zero silently."""
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=rf"^{name}'s gradient is once-differentiable: "):
        torch.autograd.functional.jvp(fn, x, torch.randn_like(x))
    leaf = x.clone().requires_grad_()
    out = fn(leaf)
    v = torch.randn_like(out, requires_grad=True)
    g, = torch.autograd.grad(out, leaf, v, create_graph=True)
    with pytest.raises(RuntimeError, match=rf"^{name}'s gradient is once-differentiable: "):
        torch.autograd.grad(g.sum(), v, allow_unused=True)


def test_an_op_keeps_the_params_it_checked_not_the_callers_object():
    dims = [0]
    op = ops.SumFwdOp(dim=dims)
    dims.append(1)  # the caller's list, changed afterwards
    x = torch.arange(12.0).reshape(3, 4)
    assert op.dim == (0,)
    torch.testing.assert_close(op(x), x.sum(0))
    for cls in (ops.SumFwdOp, ops.ProdFwdOp, ops.AmaxFwdOp, ops.VarFwdOp, ops.AllFwdOp):
        op = cls(dim=np.int64(1))
        assert op.dim == 1 and type(op.dim) is int
        assert op(x).shape == (3,)
    # an int bound stays an int where the param is a float (torch's clamp keeps int32)
    got = ops.ClampFwdOp(max=7)(torch.arange(10, dtype=torch.int32))
    assert got.dtype == torch.int32 and int(got.max()) == 7


def test_torch_func_transforms_are_refused_by_name():
    op = ops.SoftmaxFwdOp(dim=1)
    x = torch.randn(3, 4, dtype=torch.float64)
    message = (r"^SoftmaxFwdOp: torch.func transforms \(vmap, grad, vjp, jacrev, ...\) do "
               r"not reach this op: its kernels and its gradient take plain tensors")
    with pytest.raises(RuntimeError, match=message):
        torch.func.grad(lambda t: op(t).pow(2).sum())(x)
    # vmap too, on the fast path of a warm op as on the first call: a sample's view of a
    # batched tensor is not the memory a kernel would read
    op(x)
    ops.AddFwdOp()(x, x)
    for fn, args in ((op, 1), (ops.CumsumFwdOp(dim=0), 1), (ops.AddFwdOp(), 2)):
        with pytest.raises(RuntimeError, match=message.replace("SoftmaxFwdOp",
                                                               type(fn).__name__)):
            torch.func.vmap(lambda t, fn=fn, args=args: fn(*[t] * args))(x)
    # the op is usable after, and torch.autograd differentiates it
    xr = x.clone().requires_grad_()
    g, = torch.autograd.grad(op(xr).pow(2).sum(), xr)
    xs = x.clone().requires_grad_()
    torch.testing.assert_close(g, torch.autograd.grad(torch.softmax(xs, 1).pow(2).sum(), xs)[0])


@pytest.mark.parametrize(("op", "args", "written"), [
    (lambda: ops.ReluFwdOp(inplace=True), lambda e: (e(4, 6),), "x"),
    (lambda: ops.ClampFwdOp(min=0.0, inplace=True), lambda e: (e(4, 6),), "x"),
    (lambda: ops.RopeNeoxFwdOp(inplace=True),
     lambda e: (e(2, 3, 4, 8), torch.randn(2, 3, 2, 8)), "q"),
    (lambda: ops.FusedAddRMSNormFwdOp(inplace=True),
     lambda e: (torch.randn(4, 6), e(4, 6), torch.ones(6)), "residual"),
    (lambda: ops.CrossEntropyBwdOp(inplace_grad=True),
     lambda e: (e(4, 6), torch.tensor([0, 1, 2, 3]), torch.tensor(1.0)), "logits"),
])
def test_an_input_written_in_place_whose_elements_share_memory_is_refused(op, args, written):
    """Every op that writes an input refuses one whose elements share memory (an expanded
    view), as torch does, naming the op and the input, before anything runs; on the warm fast
    path too, and the op serves the next call."""
    def expanded(*shape):
        return torch.randn(1, *shape[1:]).expand(*shape)

    def owned(*shape):
        return torch.randn(*shape)

    instance = op()
    instance(*args(owned))  # warm: the fast call is built
    bad = args(expanded)
    before = [t.clone() for t in bad]
    with pytest.raises(RuntimeError) as exc:
        instance(*bad)
    assert str(exc.value).startswith(f"{instance!r}: {written} is written in place, but its "
                                     f"elements share memory (an expanded or overlapping view")
    for t, b in zip(bad, before, strict=True):
        assert torch.equal(t, b)
    instance(*args(owned))
