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
    a = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 3, dtype=torch.float64)
    op = ops.GemmAccumulateFwdOp()
    with pytest.raises(RuntimeError, match=r"^GemmAccumulateFwdOp is forward-only \(it has no "
                                           r"backward\), but a requires grad"):
        op(torch.zeros(2, 3, dtype=torch.float64), a, b)
    torch.testing.assert_close(op(torch.zeros(2, 3, dtype=torch.float64), a.detach(), b),
                               a.detach() @ b)


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


@pytest.mark.parametrize("which", ["rope", "fused_add_rms_norm"])
def test_an_in_place_op_of_two_outputs_trains_on_views(which):
    """torch refuses an autograd.Function that writes a view in place and returns more than
    one tensor; q and k as views of a projection (tnn.Attention's) are the common case. The
    op still writes and returns the views, and every gradient is the out-of-place op's."""
    g = torch.Generator().manual_seed(0)

    def leaves():
        if which == "rope":
            return [torch.randn(1, 3, 8, dtype=torch.float64, generator=g).requires_grad_()
                    for _ in range(2)]
        return [torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_()
                for shape in ((6, 4), (6, 4), (4,))]

    def run(op, ls):
        if which == "rope":
            q, k = ((t * 1).view(1, 3, 2, 4) for t in ls)
            outs = op(q, k)
            return (q, k), outs
        x, r = (ls[0] * 1)[:, :], (ls[1] * 1)[:, :]
        outs = op(x, r, ls[2])
        return (x, r), outs

    ls = leaves()
    ref_ls = [t.detach().clone().requires_grad_() for t in ls]
    make = (lambda inplace: ops.RopeNeoxFwdOp(inplace=inplace)) if which == "rope" else \
        (lambda inplace: ops.FusedAddRMSNormFwdOp(inplace=inplace))
    written, outs = run(make(True), ls)
    assert all(o is w for o, w in zip(outs, written, strict=True))
    _, ref = run(make(False), ref_ls)
    for o, r in zip(outs, ref, strict=True):
        torch.testing.assert_close(o, r, rtol=0, atol=0)
    w = [torch.randn(o.shape, dtype=torch.float64, generator=g) for o in outs]
    sum((o * c).sum() for o, c in zip(outs, w, strict=True)).backward()
    sum((o * c).sum() for o, c in zip(ref, w, strict=True)).backward()
    for a, b in zip(ls, ref_ls, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    # a view of a leaf that requires grad is refused by name, as torch refuses it
    leaf = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"is a view of a leaf tensor that requires grad"):
        ops.ReluFwdOp(inplace=True)(leaf[:, :2])


def test_two_inputs_written_in_place_that_share_memory_are_refused():
    a, b, w = torch.randn(6, 4), torch.randn(6, 4), torch.ones(4)
    op = ops.FusedAddRMSNormFwdOp(inplace=True)
    op(a, b, w)  # warm: the fast call is built
    for x, r in ((a, a), (a[:3], a[2:5])):
        before = a.clone()
        with pytest.raises(RuntimeError) as exc:
            op(x, r, w)
        assert str(exc.value) == (f"{op!r}: x and residual are both written in place and share "
                                  "memory (the same tensor, or overlapping views of one), so "
                                  "each write would overwrite the other's; pass tensors that "
                                  "do not share memory")
        assert torch.equal(a, before)
    # views with gaps whose elements are apart (packed q and k of one qkv tensor) are served
    qkv = torch.randn(1, 3, 4, 8)
    want = ops.RopeNeoxFwdOp()(qkv[:, :, :2].clone(), qkv[:, :, 2:].clone())
    rope = ops.RopeNeoxFwdOp(inplace=True)
    q, k = qkv[:, :, :2], qkv[:, :, 2:]
    rope(q, k)
    for got, ref in zip((q, k), want, strict=True):
        torch.testing.assert_close(got, ref)


def test_under_torch_compile_a_construction_is_refused_by_name():
    """Tracing cannot follow an op's construction (generated code, locks): refused with the
    op's own message, which torch.compile carries in its error."""
    torch._dynamo.reset()
    op = ops.SoftmaxFwdOp()
    x = torch.randn(3, 4)
    with pytest.raises(Exception, match="SoftmaxFwdOp: an op cannot be constructed inside "
                                        "torch.compile"):
        torch.compile(lambda a: ops.SoftmaxFwdOp(dim=0)(a), fullgraph=True)(x)
    torch.testing.assert_close(torch.compile(op, fullgraph=True)(x), torch.softmax(x, -1))
