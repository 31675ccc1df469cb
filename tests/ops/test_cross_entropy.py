"""The cross-entropy ops on the CPU (the reference target): torch's loss and gradient in
float64 for every option (torch's own where it has the option, the closed forms of the z-loss
and the softcap otherwise), gradcheck with the integer target kept int64, the compiled
training step, the eager contender, and the refusals.

The generic gradient tests cast every input to float64, the class indices too; these tests
hold the gradient contract for an op with an integer input.
"""

import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from functorch.compile import make_boxed_func  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

from tileops.ops import CrossEntropyBwdOp, CrossEntropyFwdOp  # noqa: E402
from tileops.signature import ConstructionError, SignatureCallError  # noqa: E402


def _inputs(n, v, ignored=(), seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(n, v, generator=g, dtype=torch.float64)).to(dtype)
    t = torch.randint(0, v, (n,), generator=g)
    for i in ignored:
        t[i] = -100
    return x, t


def _torch_loss(x, t, *, reduction="mean", label_smoothing=0.0, lse_square_scale=0.0,
                softcap=None, ignore_index=-100):
    """The loss composed of torch functions in float64 (the z-loss and softcap in closed
    form: torch has neither)."""
    z = x if softcap is None else softcap * torch.tanh(x / softcap)
    rows = F.cross_entropy(z, t, reduction="none", ignore_index=ignore_index,
                           label_smoothing=label_smoothing)
    valid = t != ignore_index
    rows = rows + torch.where(valid, lse_square_scale * torch.logsumexp(z, -1) ** 2, 0.0)
    if reduction == "none":
        return rows
    return rows.sum() if reduction == "sum" else rows.sum() / valid.sum()


OPTIONS = st.fixed_dictionaries({
    "reduction": st.sampled_from(["none", "mean", "sum"]),
    "label_smoothing": st.sampled_from([0.0, 0.1, 1.0]),
    "lse_square_scale": st.sampled_from([0.0, 1e-2]),
    "softcap": st.sampled_from([None, 2.0]),
})


@settings(max_examples=40, deadline=None)
@given(options=OPTIONS, n=st.integers(1, 6), v=st.integers(1, 9), seed=st.integers(0, 99),
       ignored=st.sets(st.integers(0, 5)))
def test_loss_and_gradient_are_torchs(options, n, v, seed, ignored):
    x, t = _inputs(n, v, [i for i in ignored if i < n], seed)
    x.requires_grad_(True)
    got = CrossEntropyFwdOp(**options)(x, t)
    xe = x.detach().clone().requires_grad_(True)
    want = _torch_loss(xe, t, **options)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
    w = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (got * w).sum().backward()
    (want * w).sum().backward()
    if not want.isnan().any():
        torch.testing.assert_close(x.grad, xe.grad, rtol=1e-10, atol=1e-12)


def test_mean_over_no_rows_is_nan_as_torchs():
    x, t = _inputs(4, 5, ignored=range(4))
    assert CrossEntropyFwdOp()(x, t).isnan()
    assert F.cross_entropy(x, t).isnan()
    assert CrossEntropyFwdOp(reduction="sum")(x, t) == 0


@settings(max_examples=60, deadline=None)
@given(value=st.sampled_from([math.inf, -math.inf, math.nan]), col=st.integers(0, 4),
       reduction=st.sampled_from(["mean", "sum", "none"]),
       smoothing=st.sampled_from([0.0, 0.2]), zscale=st.sampled_from([0.0, 0.1]),
       softcap=st.sampled_from([None, 5.0]))
def test_an_inf_or_nan_logit_gives_torchs_loss_and_gradient(value, col, reduction, smoothing,
                                                             zscale, softcap):
    """A logit of inf, -inf or NaN: the loss and the gradient are NaN or inf where torch's
    are (a row holding +inf is NaN, as torch's log_softmax gives it; torch.logsumexp's inf
    gave the row a loss of inf); the rows without one are unchanged."""
    logits = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(col))
    logits[0, col] = value
    target = torch.tensor([1, 0, 2])
    op = CrossEntropyFwdOp(reduction=reduction, label_smoothing=smoothing,
                           lse_square_scale=zscale, softcap=softcap)
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got, want = op(ours, target), op.eager()(theirs, target)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
    (g,), (w,) = (torch.autograd.grad(o, x, torch.ones_like(o))
                  for o, x in ((got, ours), (want, theirs)))
    torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("offset", [1e3, 1e4, 1e5])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_the_loss_of_logits_far_from_zero_is_as_precise_as_torchs(offset, label_smoothing):
    """A common offset to every logit leaves the loss unchanged; float32 logits near 1e5 lose
    nothing more than torch's float32 loss (log_softmax subtracts the row's maximum first),
    where the log-sum-exp less the target's logit rounded to the offset's ulp."""
    x, t = _inputs(4, 8, seed=3, dtype=torch.float32)
    x = x + offset
    want = F.cross_entropy(x.double(), t, reduction="none", label_smoothing=label_smoothing)
    theirs = F.cross_entropy(x, t, reduction="none", label_smoothing=label_smoothing)
    got = CrossEntropyFwdOp(reduction="none", label_smoothing=label_smoothing)(x, t)
    bound = max(float((theirs.double() - want).abs().max()) * 4, 1e-6)
    assert float((got.double() - want).abs().max()) <= bound


def test_a_narrow_logits_dtype_gives_a_float32_loss():
    x, t = _inputs(3, 7, dtype=torch.bfloat16)
    loss = CrossEntropyFwdOp()(x, t)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, F.cross_entropy(x.double(), t).float(), rtol=1e-6,
                               atol=1e-6)
    assert CrossEntropyFwdOp(reduction="none")(x, t).shape == (3,)


@pytest.mark.parametrize("options", [{}, {"reduction": "none", "softcap": 3.0},
                                     {"reduction": "sum", "label_smoothing": 0.2,
                                      "lse_square_scale": 0.1}])
def test_gradcheck_float64(options):
    x, t = _inputs(3, 5, ignored=[1])
    x.requires_grad_(True)
    op = CrossEntropyFwdOp(**options)
    assert torch.autograd.gradcheck(lambda x: op(x, t), (x,))


def test_the_backward_reads_a_strided_upstream_gradient():
    x, t = _inputs(4, 6, ignored=[2])
    dloss = torch.randn(8, dtype=torch.float64)[::2]  # every other element
    got = CrossEntropyBwdOp(reduction="none")(x, t, dloss)
    xe = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(_torch_loss(xe, t, reduction="none"), xe, dloss)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_inplace_grad_writes_the_gradient_over_the_logits():
    x, t = _inputs(4, 7, ignored=[1])
    logits = x.clone().requires_grad_(True)
    z = logits * 1.0  # a non-leaf, as an LM head's output is
    CrossEntropyFwdOp(inplace_grad=True, label_smoothing=0.1)(z, t).backward()
    xe = x.clone().requires_grad_(True)
    F.cross_entropy(xe, t, label_smoothing=0.1).backward()
    torch.testing.assert_close(logits.grad, xe.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z.detach(), xe.grad, rtol=1e-12, atol=1e-12)  # overwritten


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_inplace_grad_through_the_backward_op_never_overwrites_a_leaf(reduction):
    """The backward op's path (the reference target, reduction none, a second backward):
    its inplace_grad writes a copy of a leaf, not the leaf; a non-leaf still holds the
    gradient afterwards."""
    x, t = _inputs(5, 7, ignored=[2])
    op = CrossEntropyFwdOp(inplace_grad=True, reduction=reduction, label_smoothing=0.1)
    xe = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(
        F.cross_entropy(xe, t, reduction=reduction, label_smoothing=0.1).sum(), xe)
    leaf = x.clone().requires_grad_(True)
    loss = op(leaf, t).sum()
    loss.backward(retain_graph=True)
    assert torch.equal(leaf.detach(), x)
    torch.testing.assert_close(leaf.grad, want, rtol=1e-12, atol=1e-12)
    loss.backward()  # again: the saved leaf is still the logits
    assert torch.equal(leaf.detach(), x)
    torch.testing.assert_close(leaf.grad, 2 * want, rtol=1e-12, atol=1e-12)
    z = x.clone().requires_grad_(True) * 1.0
    op(z, t).sum().backward()
    torch.testing.assert_close(z.detach(), want, rtol=1e-12, atol=1e-12)  # overwritten


def test_the_compiled_training_step_holds_both_ops_and_matches_eager():
    torch._dynamo.reset()
    x, t = _inputs(5, 7, ignored=[0])
    op = CrossEntropyFwdOp(label_smoothing=0.1)
    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return make_boxed_func(gm.forward)

    f = torch.compile(lambda x, t: op(x * 1.0, t), fullgraph=True,
                      backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    xc = x.clone().requires_grad_(True)
    (got,) = torch.autograd.grad(f(xc, t), xc)
    assert len(graphs) == 2
    assert any("cross_entropy_fwd" in s for s in graphs[0]), graphs[0]
    assert any("cross_entropy_bwd" in s for s in graphs[1]), graphs[1]
    xe = x.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(F.cross_entropy(xe, t, label_smoothing=0.1), xe)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("options", [{}, {"lse_square_scale": 0.1, "reduction": "none"},
                                     {"softcap": 2.0, "reduction": "sum"}])
def test_the_eager_contender_computes_the_loss(options):
    x, t = _inputs(4, 9, ignored=[3])
    op = CrossEntropyFwdOp(**options)
    torch.testing.assert_close(op.eager()(x, t), op(x, t), rtol=1e-12, atol=1e-12)  # float64


def test_refusals_name_the_op_the_argument_and_what_was_seen():
    with pytest.raises(ConstructionError) as info:
        CrossEntropyFwdOp(label_smoothing=1.5)
    lines = str(info.value).splitlines()
    assert lines[0] == ("CrossEntropyFwdOp: construction param label_smoothing does not match "
                        "the signature")
    assert lines[2] == "  seen:     label_smoothing = 1.5"
    with pytest.raises(ConstructionError) as info:
        CrossEntropyFwdOp(reduction="avg")
    assert "  because:  reduction must be one of 'none', 'mean', 'sum'" in str(info.value)
    with pytest.raises(SignatureCallError) as info:
        CrossEntropyFwdOp()(torch.randn(3, 7), torch.zeros(3))
    assert str(info.value).splitlines()[3] == ("  because:  target.dtype must be int64, but is "
                                               "float32")


def test_the_kernels_refuse_float64_naming_the_reference_target():
    op = CrossEntropyFwdOp()
    with pytest.raises(TypeError) as info:
        op._entry(torch.device("cuda"), None, torch.empty(2, 3, dtype=torch.float64, device="meta"))
    assert str(info.value) == (
        "CrossEntropyFwdOp: the in-tree cross-entropy kernels serve bfloat16, float16, "
        "float32, not float64; construct the op with target='reference' for float64")


# --- the kernels' launches, with torch stand-ins for the compiled programs -----------------------


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_kernels_launch_the_programs_the_reduction_needs(monkeypatch, reduction):
    """Each implementation's ``__call__`` with the row and finish programs replaced by torch
    functions of the same contract: the loss row program writes each row's loss, the finish
    program the mean (sum / rows not ignored) or the sum, the gradient row program each row's
    gradient scaled by ``G[row]`` or ``G[0]`` (the finish's ``dloss / count`` for the mean)."""
    from tileops.kernels import cross_entropy as C

    opts = {"label_smoothing": 0.1, "lse_square_scale": 1e-2, "softcap": 4.0}
    rows_ref = CrossEntropyFwdOp(reduction="none", **opts)
    grad_ref = CrossEntropyBwdOp(reduction="none", **opts)
    launched = []

    def rows(classes, dtype, options, grad, per_row_scale, sms, with_loss=False):
        def run(x, t, g, d=None):
            launched.append(("grad" if grad else "loss", per_row_scale))
            if not grad:
                g.copy_(rows_ref._loss(x.double(), t))
                return
            scale = g if per_row_scale else g.expand(x.shape[0])
            d.copy_(grad_ref._grad(x.double(), t, scale.double()))
        return run

    def finish(ignore_index, mean, grad):
        def run(a, b, out):
            launched.append(("finish", grad))
            target, first = (a, b) if grad else (b, a)
            count = (target != ignore_index).sum()
            total = first[0] if grad else first.sum()
            out.copy_(total / count if mean else total)
        return run

    monkeypatch.setattr(C, "build_rows_kernel", rows)
    monkeypatch.setattr(C, "build_finish_kernel", finish)
    spec = C.CrossEntropySpec(device=torch.device("cpu"), rows=6, classes=9, dtype="float32",
                              ignore_index=-100, reduction=C.Reduction(reduction), **opts)
    x, t = _inputs(6, 9, ignored=[1, 4], dtype=torch.float32)
    loss = torch.empty(6 if reduction == "none" else ())
    C.CrossEntropyFwdKernel(spec)(x, t, loss)
    want = _torch_loss(x.double(), t, reduction=reduction, **opts)
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-6)
    dloss = torch.rand(loss.shape) + 0.5
    dx = torch.empty_like(x)
    C.CrossEntropyBwdKernel(spec)(x, t, dloss, dx)
    xe = x.double().requires_grad_(True)
    (want_dx,) = torch.autograd.grad(_torch_loss(xe, t, reduction=reduction, **opts), xe,
                                     dloss.double())
    torch.testing.assert_close(dx.double(), want_dx, rtol=1e-5, atol=1e-7)
    assert launched == {
        "mean": [("loss", False), ("finish", False), ("finish", True), ("grad", False)],
        "sum": [("loss", False), ("finish", False), ("grad", False)],
        "none": [("loss", False), ("grad", True)]}[reduction]
    launched.clear()
    empty = torch.empty(0, 9)
    out = torch.empty(0 if reduction == "none" else ())
    C.CrossEntropyFwdKernel(spec)(empty, t[:0], out)  # no rows: nothing launches
    assert launched == []
    if reduction != "none":
        assert out.isnan() if reduction == "mean" else out == 0


# --- training with a 0-dim loss: the gradient kept by the forward -----------------------------


class _Launches:
    """Torch stand-ins for the compiled programs (the contracts of the row, finish and scale
    programs), recording each launch: ``(program, grad or with_loss)``; ``("scale", wrote)``."""

    def __init__(self, opts):
        self.rows_ref = CrossEntropyFwdOp(reduction="none", **opts)
        self.grad_ref = CrossEntropyBwdOp(reduction="none", **opts)
        self.launched = []

    def rows(self, classes, dtype, options, grad, per_row_scale, sms, with_loss=False):
        def run(x, t, *rest):
            self.launched.append(("train" if with_loss else "grad" if grad else "loss",
                                  per_row_scale))
            if not grad:  # (x, t, L)
                rest[0].copy_(self.rows_ref._loss(x.double(), t))
                return
            g, d = rest[0], rest[-1]  # (x, t, G, D) or, with_loss, (x, t, G, L, D)
            scale = g if per_row_scale else g.expand(x.shape[0])
            got = self.grad_ref._grad(x.double(), t, scale.double())
            if with_loss:  # both read before D, which may be x, is written
                rest[1].copy_(self.rows_ref._loss(x.double(), t))
            d.copy_(got)
        return run

    def finish(self, ignore_index, mean, grad):
        def run(a, b, out):
            self.launched.append(("finish", grad))
            target, first = (a, b) if grad else (b, a)
            count = (target != ignore_index).sum()
            total = first[0] if grad else first.sum()
            out.copy_(total / count if mean else total)
        return run

    def scale(self, classes, dtype, sms):
        def run(d, s):
            assert s.shape == (1,) and s.dtype == torch.float32
            self.launched.append(("scale", bool(s[0] != 1.0)))
            if s[0] != 1.0:
                d.mul_(s[0])
        return run


@pytest.fixture
def stand_ins(monkeypatch):
    """``make(**options) -> (op, launched)``: a CrossEntropyFwdOp whose slot is served on the
    CPU by the in-tree implementation over the stand-in programs."""
    from tileops.kernels import cross_entropy as C
    from tileops.runtime import Kernel

    class CpuFwd(C.CrossEntropyFwdKernel):
        devices = ("cpu",)

    made = {}

    def make(**options):
        opts = {k: v for k, v in options.items() if k not in ("reduction", "inplace_grad")}
        launches = made.setdefault("launches", _Launches(opts))
        for name in ("rows", "finish", "scale"):
            monkeypatch.setattr(C, f"build_{name}_kernel", getattr(launches, name))
        assert issubclass(CpuFwd, Kernel)
        return CrossEntropyFwdOp(kernel_map={"cross_entropy_fwd": CpuFwd}, **options), \
            launches.launched

    return make


@pytest.mark.parametrize("inplace_grad", [False, True])
@pytest.mark.parametrize(("reduction", "opts"), [
    ("mean", {}), ("sum", {"label_smoothing": 0.1, "lse_square_scale": 1e-2, "softcap": 4.0})])
def test_training_keeps_the_gradient_of_one_launch(stand_ins, reduction, opts, inplace_grad):
    op, launched = stand_ins(reduction=reduction, inplace_grad=inplace_grad, **opts)
    x, t = _inputs(6, 9, ignored=[1, 4], dtype=torch.float32)
    leaf = x.clone().requires_grad_(True)
    z = leaf * 1.0  # a non-leaf, as an LM head's output is
    loss = op(z, t)
    xe = x.double().requires_grad_(True)
    want = _torch_loss(xe, t, reduction=reduction, **opts)
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-6)
    (want_dx,) = torch.autograd.grad(want, xe)
    # one row launch writes the losses and the gradient; the mean's 1 / count comes first
    assert launched == ([("finish", True)] if reduction == "mean" else []) + [
        ("train", False), ("finish", False)]
    if inplace_grad:  # the logits hold the gradient once the loss is computed
        torch.testing.assert_close(z.detach().double(), want_dx, rtol=1e-5, atol=1e-7)
    else:
        assert torch.equal(z.detach(), x)
    launched.clear()
    loss.backward()
    assert launched == [("scale", False)]  # 1: nothing written, and no backward op
    assert not op._backward_ops
    torch.testing.assert_close(leaf.grad.double(), want_dx, rtol=1e-5, atol=1e-7)


def test_the_kept_gradient_is_scaled_by_the_upstream_gradient(stand_ins):
    op, launched = stand_ins()
    x, t = _inputs(5, 7, ignored=[2], dtype=torch.float32)
    leaf = x.clone().requires_grad_(True)
    (2.5 * op(leaf, t)).backward()
    assert launched[-1] == ("scale", True)
    xe = x.double().requires_grad_(True)
    (want,) = torch.autograd.grad(2.5 * F.cross_entropy(xe, t), xe)
    torch.testing.assert_close(leaf.grad.double(), want, rtol=1e-5, atol=1e-7)


def test_inplace_grad_never_overwrites_a_leaf(stand_ins):
    op, _ = stand_ins(inplace_grad=True)
    x, t = _inputs(4, 7, ignored=[0], dtype=torch.float32)
    leaf = x.clone().requires_grad_(True)
    op(leaf, t).backward()
    assert torch.equal(leaf.detach(), x) and leaf.grad is not None
    xe = x.double().requires_grad_(True)
    (want,) = torch.autograd.grad(F.cross_entropy(xe, t), xe)
    torch.testing.assert_close(leaf.grad.double(), want, rtol=1e-5, atol=1e-7)


# --- inplace_grad and the logits another node saved ------------------------------------------


class _SavesItsOutput(torch.autograd.Function):
    """An extension's exp that saves its output for its backward."""

    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class _HoldsItsOutput(torch.autograd.Function):
    """An exp that holds its output as an attribute of its context (torch checks nothing)."""

    @staticmethod
    def forward(ctx, x):
        ctx.y = x.exp()
        return ctx.y

    @staticmethod
    def backward(ctx, g):
        return g * ctx.y


def _tanh_op(z):
    import tileops.ops as ops

    return ops.TanhFwdOp()(z)


#: how the logits are made from ``h @ w.T``, and whether the node that made them saved them
#: (an exp's, a sigmoid's, a tanh's backward reads its output; a product's and a scale's do not)
PRODUCERS = {
    "product": (lambda h, w: h @ w.T, False),
    "softcap-of-product": (lambda h, w: 3.0 * torch.tanh(h @ w.T / 3.0), False),
    "view-of-product": (lambda h, w: (h @ w.T).view(h.shape[0], -1), False),
    "exp": (lambda h, w: torch.exp(h @ w.T / 4.0), True),
    "sigmoid": (lambda h, w: torch.sigmoid(h @ w.T), True),
    "tanh": (lambda h, w: torch.tanh(h @ w.T), True),
    "view-of-tanh": (lambda h, w: torch.tanh(h @ w.T).view(h.shape[0], -1), True),
    "columns-of-sigmoid": (lambda h, w: torch.sigmoid(h @ torch.cat([w, w]).T)[:, :w.shape[0]],
                           True),
    "tileops-tanh": (lambda h, w: _tanh_op(h @ w.T), True),
    "function-saved": (lambda h, w: _SavesItsOutput.apply(h @ w.T / 4.0), True),
    "function-attribute": (lambda h, w: _HoldsItsOutput.apply(h @ w.T / 4.0), True),
}


def _head(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(6, 4, dtype=torch.float64, generator=g).to(dtype)
    w = torch.randn(9, 4, dtype=torch.float64, generator=g).to(dtype)
    t = torch.tensor([0, 8, -100, 3, 2, 5])
    return h, w, t


def _head_grads(make, h0, w0, t, reduction, upstream, smoothing=0.1):
    """torch's gradients of h, w and the logits in float64."""
    h = h0.to(torch.float64, copy=True).requires_grad_()
    w = w0.to(torch.float64, copy=True).requires_grad_()
    z = make(h, w)
    loss = F.cross_entropy(z, t, reduction=reduction, label_smoothing=smoothing)
    return torch.autograd.grad((loss * upstream).sum(), (h, w, z))


def _check_inplace_grad(op, producer, dtype, reduction, tol):
    make, saved = PRODUCERS[producer]
    h0, w0, t = _head(dtype)
    upstream = (torch.rand(6, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype) \
        if reduction == "none" else torch.tensor(1.0, dtype=dtype)
    want_h, want_w, want_z = _head_grads(make, h0, w0, t, reduction, upstream.double())
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    z = make(h, w)
    before = z.detach().clone()
    (op(z, t) * upstream).sum().backward()  # no torch error: the gradient is right
    torch.testing.assert_close(h.grad.double(), want_h, **tol)
    torch.testing.assert_close(w.grad.double(), want_w, **tol)
    if saved:  # left as they were: the gradient had a tensor of its own
        assert torch.equal(z.detach(), before)
    else:  # written over: the gradient of the logits
        torch.testing.assert_close(z.detach().double(), want_z, **tol)


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("producer", list(PRODUCERS))
def test_inplace_grad_writes_over_logits_no_node_saved(producer, reduction):
    """The backward op's path (the reference target): the gradient is written over the saved
    logits where the node that made them did not save them, and into a copy where it did
    (whose backward reads them after this one: torch raised, or a kernel's write went unseen
    and that gradient was wrong); the gradients of h and w are torch's in float64 either way,
    and the op serves the next call, writing over a product's logits."""
    op = CrossEntropyFwdOp(inplace_grad=True, reduction=reduction, label_smoothing=0.1)
    exact = dict(rtol=1e-12, atol=1e-12)
    _check_inplace_grad(op, producer, torch.float64, reduction, exact)
    _check_inplace_grad(op, "product", torch.float64, reduction, exact)


@pytest.mark.parametrize("producer", list(PRODUCERS))
def test_training_keeps_over_logits_no_node_saved(stand_ins, producer):
    """The kept path (the forward's kernel writes the gradient): over the logits where no node
    saved them, into a tensor of its own where one did; the op serves the next call."""
    op, _ = stand_ins(inplace_grad=True, label_smoothing=0.1)
    tol = dict(rtol=1e-5, atol=1e-6)
    _check_inplace_grad(op, producer, torch.float32, "mean", tol)
    _check_inplace_grad(op, "product", torch.float32, "mean", tol)
    assert not op._backward_ops  # each gradient was the forward's


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_kernel_write_over_the_logits_is_counted_for_torchs_check(stand_ins, monkeypatch,
                                                                     reduction):
    """A kernel writes memory torch's version counter does not see; the op counts its write
    over the logits, so a node that read them before the loss and saved them (not reachable
    from the logits) raises torch's error at its backward instead of reading the gradient as
    its input."""
    op, _ = stand_ins(inplace_grad=True, reduction=reduction)
    from tileops.kernels import cross_entropy as C

    build = C.build_rows_kernel

    def unseen(*args, **kwargs):  # the stand-in writes as a kernel does: unseen by torch
        run = build(*args, **kwargs)
        return lambda x, t, *rest: run(x.data, t, *(r.data for r in rest))

    monkeypatch.setattr(C, "build_rows_kernel", unseen)
    h0, w0, t = _head(torch.float32)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    z = h @ w.T
    version = z._version
    square = (z * z).sum()  # saves z, unseen from it
    loss = op(z, t)
    assert z._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + 1e-3 * square).backward()
    # without that node: the gradient, written over the logits
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    z = h @ w.T
    op(z, t).backward()
    _, _, want = _head_grads(lambda a, b: a @ b.T, h0, w0, t, reduction, 1.0, smoothing=0.0)
    torch.testing.assert_close(z.detach().double(), want, rtol=1e-5, atol=1e-6)


def _second_backward_message(names="logits"):
    return ("CrossEntropyFwdOp: a second backward through the same call (a retained graph), "
            f"but the gradient was written over {names} in place (inplace_grad=True): what "
            f"the node saved of {names} is the gradient now, not the forward's values; "
            "construct the op with inplace_grad=False to run a backward more than once")


@pytest.mark.parametrize(("kept", "reduction"), [(False, "mean"), (False, "none"),
                                                  (True, "mean"), (True, "sum")])
def test_a_second_backward_over_written_logits_is_refused_by_name(stand_ins, kept, reduction):
    """The first backward (or, kept, the forward) wrote the gradient over the saved logits: a
    second backward through a retained graph would read the gradient as the logits (a
    kernel's write is unseen by torch) or name no op; it is refused by name, and the op serves
    the next call. Logits that were left as they were (a leaf's copy, a node saved them) still
    take a second backward."""
    op = stand_ins(inplace_grad=True, reduction=reduction)[0] if kept else \
        CrossEntropyFwdOp(inplace_grad=True, reduction=reduction)
    h0, w0, t = _head(torch.float64 if not kept else torch.float32)
    tol = dict(rtol=1e-5, atol=1e-6) if kept else dict(rtol=1e-12, atol=1e-12)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss = op(h @ w.T, t).sum()
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    with pytest.raises(RuntimeError) as exc:
        loss.backward()
    assert str(exc.value) == _second_backward_message()
    torch.testing.assert_close(h.grad, first, rtol=0, atol=0)  # nothing added
    want_h, _, _ = _head_grads(lambda a, b: a @ b.T, h0, w0, t, reduction, 1.0,
                               smoothing=0.0)
    torch.testing.assert_close(first.double(), want_h, **tol)
    # the op serves the next call, and logits it left as they were (a node saved them) take
    # a second backward
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    op(h @ w.T, t).sum().backward()
    torch.testing.assert_close(h.grad.double(), want_h, **tol)
    make = PRODUCERS["sigmoid"][0]
    _, want_w, _ = _head_grads(make, h0, w0, t, reduction, 1.0, smoothing=0.0)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    loss = op(make(h, w), t).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(w.grad.double(), 2 * want_w, **tol)


def test_a_mean_over_no_rows_keeps_torchs_zero_gradient(stand_ins):
    op, _ = stand_ins()
    x, t = _inputs(4, 7, ignored=range(4), dtype=torch.float32)
    leaf = x.clone().requires_grad_(True)
    loss = op(leaf, t)
    loss.backward()
    xe = x.clone().requires_grad_(True)
    want = F.cross_entropy(xe, t)
    want.backward()
    assert loss.isnan() and want.isnan()
    assert torch.equal(leaf.grad, xe.grad) and not xe.grad.any()  # torch's: zeros



def test_no_rows_launch_nothing_and_keep_an_empty_gradient(stand_ins):
    op, launched = stand_ins(reduction="sum")
    leaf = torch.empty(0, 7, requires_grad=True)
    loss = op(leaf, torch.empty(0, dtype=torch.long))
    assert loss == 0  # torch's sum of no rows
    loss.backward()
    assert launched == [] and leaf.grad.shape == (0, 7)


def test_a_second_backward_and_reduction_none_run_the_backward_op(stand_ins):
    op, launched = stand_ins()
    x, t = _inputs(5, 7, ignored=[3], dtype=torch.float32)
    leaf = x.clone().requires_grad_(True)
    loss = op(leaf, t)
    loss.backward(retain_graph=True)
    (2.0 * loss).backward()  # the kept gradient was used up: the backward op recomputes
    xe = x.double().requires_grad_(True)
    (want,) = torch.autograd.grad(3.0 * F.cross_entropy(xe, t), xe)
    torch.testing.assert_close(leaf.grad.double(), want, rtol=1e-5, atol=1e-7)
    launched.clear()
    none, launched = stand_ins(reduction="none")
    none(leaf, t).sum().backward()  # a per-row loss: nothing kept
    assert launched == [("loss", False)]


def test_a_kept_spec_needs_a_0_dim_loss():
    from tileops.kernels import cross_entropy as C

    with pytest.raises(ValueError) as info:
        C.CrossEntropySpec(device="cuda", rows=4, classes=7, dtype="bfloat16", ignore_index=-100,
                           reduction=C.Reduction.NONE, label_smoothing=0.0,
                           lse_square_scale=0.0, softcap=None, kept=True)
    assert str(info.value) == ("CrossEntropySpec.kept needs reduction mean or sum (a 0-dim "
                               "loss), got reduction none")


def test_a_target_outside_the_classes_is_refused_naming_the_row():
    import tileops.ops as ops

    logits = torch.randn(3, 5)
    for bad in (5, -1):
        target = torch.tensor([0, bad, 2])
        with pytest.raises(IndexError) as exc:
            ops.CrossEntropyFwdOp()(logits, target)
        assert str(exc.value) == (f"CrossEntropyFwdOp: target[1] is {bad}: not a class index "
                                  f"in [0, 5) (the logits have 5 classes) and not "
                                  f"ignore_index (-100)")
    with pytest.raises(IndexError, match=r"^FusedLinearCrossEntropyFwdOp: target\[1\] is 7"):
        ops.FusedLinearCrossEntropyFwdOp()(torch.randn(3, 4), torch.randn(5, 4),
                                           torch.tensor([0, 7, -100]))
    # ignore_index is no class, and the op stays usable
    got = ops.CrossEntropyFwdOp()(logits, torch.tensor([0, -100, 4]))
    torch.testing.assert_close(got, torch.nn.functional.cross_entropy(
        logits, torch.tensor([0, -100, 4])))
