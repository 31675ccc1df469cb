"""The row-norm family base's forward on CPU, through a plain-PyTorch implementation of its
slot installed with ``kernel_map``: the typed call spec it states, the layout it hands the
kernel, and results written back into the caller's tensors when an in-place op runs on a
copy (a strided or misaligned view); and the fused add's gradient without dy, which runs no
kernel."""

from __future__ import annotations

import inspect

import pytest
import torch

from tileops.kernels.norm import RowNormFwdInterface, RowNormKind, RowNormSpec
from tileops.kernels.norm_bwd import RowNormBwdInterface
from tileops.ops import (
    FusedAddRMSNormBwdOp,
    FusedAddRMSNormFwdOp,
    LayerNormFwdOp,
    RMSNormFwdOp,
)
from tileops.runtime import Kernel

SEEN: list = []


class TorchRowNorm(Kernel, RowNormFwdInterface):
    """The slot in plain PyTorch, on CPU; asserts the layout the base promises."""

    devices = ("cpu",)
    general = True

    def __call__(self, x, residual, weight, bias, y, residual_out):
        s = self.spec
        SEEN.append(s)
        for t in (x, residual, y, residual_out):
            assert t is None or (t.shape == (s.rows, s.n) and t.is_contiguous()
                                 and t.data_ptr() % 16 == 0)
        for t in (weight, bias):
            assert t is None or (t.shape == (s.n,) and t.is_contiguous())
        xf = x.float()
        if s.kind is RowNormKind.ADD_RMS:
            xf = (xf + residual.float()).to(x.dtype)
            residual_out.copy_(xf)
            xf = xf.float()
        if s.kind is RowNormKind.LAYER:
            xf = xf - xf.mean(-1, keepdim=True)
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + s.eps)
        if weight is not None:
            out = out * weight.float()
        if bias is not None:
            out = out + bias.float()
        y.copy_(out)


KMAP = {"row_norm_fwd": TorchRowNorm}


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_the_call_spec_states_the_calls_facts():
    SEEN.clear()
    op = RMSNormFwdOp(normalized_shape=(2, 8), kernel_map=KMAP)
    x = torch.randn(3, 5, 2, 8)
    op(x)
    spec = SEEN[-1]
    assert spec == RowNormSpec(device=x.device, kind=RowNormKind.RMS, rows=15, n=16,
                               dtype="float32", eps=torch.finfo(torch.float32).eps,
                               has_weight=False, has_bias=False)
    assert spec.few_rows
    lay = LayerNormFwdOp(normalized_shape=16, kernel_map=KMAP)  # an int shape, as torch takes
    lay(torch.randn(200, 16), None, torch.randn(16))
    assert (SEEN[-1].kind, SEEN[-1].rows, SEEN[-1].has_bias, SEEN[-1].few_rows) == \
        (RowNormKind.LAYER, 200, True, False)


@pytest.mark.parametrize("shape", [(2, 8), (3, 2, 8), (1, 2, 8)])
@pytest.mark.parametrize("weight", [False, True])
def test_a_row_of_several_axes_is_handed_over_as_one_row(shape, weight):
    """Normalized over (2, 8), an x of rank 2 is one row of 16, not two rows of 8: the kernel
    gets ``(rows, 16)`` whatever x's rank, with or without a weight of rank 2."""
    x = torch.randn(shape)
    w = torch.randn(2, 8) if weight else None
    y = RMSNormFwdOp(normalized_shape=(2, 8), eps=1e-6, kernel_map=KMAP)(x, w)
    want = x * torch.rsqrt(x.pow(2).mean((-2, -1), keepdim=True) + 1e-6) * (1 if w is None else w)
    assert y.shape == x.shape and _rel(y, want) < 1e-6


@pytest.mark.parametrize("view", ["strided", "misaligned", "transposed"])
def test_non_contiguous_inputs_are_copied_and_in_place_results_written_back(view):
    n = 16
    base = torch.randn(4 * 2 * n + 8)
    if view == "strided":
        x = base[: 4 * 2 * n].view(4, 2 * n)[:, ::2]
    elif view == "misaligned":
        x = base[1: 1 + 4 * n].view(4, n)  # 4 bytes past a 16-byte boundary
    else:
        x = base[: 4 * n].view(n, 4).T
    r = torch.randn(4, n)
    w = torch.randn(n)
    want_s = x + r
    want_y = want_s * torch.rsqrt(want_s.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    y, s = FusedAddRMSNormFwdOp(kernel_map=KMAP)(x, r, w)  # out of place
    assert _rel(y, want_y) < 1e-6 and _rel(s, want_s) < 1e-6
    x_before = x.clone()
    yi, si = FusedAddRMSNormFwdOp(inplace=True, kernel_map=KMAP)(x, r, w)
    assert yi is x and si is r  # the results live in the caller's tensors
    assert _rel(x, want_y) < 1e-6 and _rel(r, want_s) < 1e-6
    assert not torch.equal(x, x_before)


def test_the_first_call_reaches_the_launch_in_at_most_8_hops():
    """From ``op(x)`` to the kernel's ``__call__``, on the first call (which also binds the
    target and builds the entry on the way): named functions in between, at most 8."""
    stacks = []

    class Recording(TorchRowNorm):
        def __call__(self, *args):
            stacks.append([f.function for f in inspect.stack()])
            super().__call__(*args)

    op = RMSNormFwdOp(normalized_shape=16, kernel_map={"row_norm_fwd": Recording})
    op(torch.randn(4, 16), torch.randn(16))
    op(torch.randn(4, 16), torch.randn(16))  # the cached (fused) call
    for frames in stacks:
        test = frames.index("test_the_first_call_reaches_the_launch_in_at_most_8_hops")
        hops = frames[1:test]  # between the launch and the test's op(x)
        assert len(hops) <= 8, hops


# the kernel the ops choose on sm_90, by region (each region measured on the H200)
@pytest.mark.parametrize(("kind", "rows", "n", "chosen"), [
    ("rms", 33, 131072, "RowNormSplitKernel"),
    ("rms", 64, 262144, "RowNormSplitKernel"),
    ("rms", 1, 1048576, "RowNormSplitKernel"),
    ("rms", 33, 524288, "RowNormSplitKernel"),
    ("rms", 8, 131072, "RowNormClusterKernel"),
    ("rms", 96, 131072, "RowNormLoopedKernel"),
    ("layer", 33, 131072, "RowNormClusterKernel"),
    ("rms", 33, 4096, "RowNormRegisterKernel"),
])
def test_the_ops_choice_among_the_row_norm_kernels(monkeypatch, kind, rows, n, chosen):
    from tileops.kernels import norm
    from tileops.ops.norm import RowNormOp
    from tileops.runtime import kernel as runtime_kernel

    dev = torch.device("cuda", 5)
    monkeypatch.setitem(runtime_kernel._ARCH_CACHE, dev, (9, 0))
    spec = norm.RowNormSpec(device=dev, kind=norm.RowNormKind(kind), rows=rows, n=n,
                            dtype="bfloat16", eps=1e-6, has_weight=True,
                            has_bias=kind == "layer")
    candidates = RowNormOp.kernel_types[norm.RowNormFwdInterface]
    assert runtime_kernel.select(norm.RowNormFwdInterface, candidates,
                                 spec).__name__ == chosen


class TorchRowNormBwd(Kernel, RowNormBwdInterface):
    """The gradient slot in plain PyTorch, on CPU (the fused add's form: dres given)."""

    devices = ("cpu",)
    general = True
    calls = 0

    def __call__(self, dy, dres, x, weight, dx, dweight, dbias):
        TorchRowNormBwd.calls += 1
        xf, dyf = x.double(), dy.double()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.eps)
        xhat = xf * rstd
        g = dyf if weight is None else dyf * weight.double()
        dx.copy_(rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True)) + dres.double())
        if dweight is not None:
            dweight.copy_((dyf * xhat).sum(0))


def test_the_fused_add_gradient_without_dy_runs_no_kernel():
    # y's result unused: dx is dresidual_out as handed (no norm term, whose zeros times a
    # row's inf would be NaN), no dweight, and the slot is not called
    op = FusedAddRMSNormBwdOp(kernel_map={"row_norm_bwd": TorchRowNormBwd})
    s, dres, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    s[1, 3] = float("inf")
    TorchRowNormBwd.calls = 0
    dx, dweight = op(dres, s, w)
    assert TorchRowNormBwd.calls == 0 and dweight is None and torch.equal(dx, dres)
    dy = torch.randn(4, 16)
    dx, dweight = op(dres, s, w, dy)  # with dy: the kernel
    assert TorchRowNormBwd.calls == 1 and dweight is not None
    want, want_w = FusedAddRMSNormBwdOp()(dres, s, w, dy)  # the reference
    torch.testing.assert_close(dx, want, equal_nan=True)
    torch.testing.assert_close(dweight, want_w, equal_nan=True)


# --- a float32 weight beside 16-bit inputs ------------------------------------------------------


class TorchRowNormBwdAny(Kernel, RowNormBwdInterface):
    """The gradient slot in plain PyTorch for RMS and LAYER (no dres), on CPU: records the
    call spec and the dtypes it is handed."""

    devices = ("cpu",)
    general = True

    def __call__(self, dy, dres, x, weight, dx, dweight, dbias):
        SEEN.append((self.spec, None if weight is None else weight.dtype,
                     None if dweight is None else dweight.dtype,
                     None if dbias is None else dbias.dtype))
        xf, dyf = x.double(), dy.double()
        if self.spec.kind is RowNormKind.LAYER:
            xf = xf - xf.mean(-1, keepdim=True)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.eps)
        xhat = xf * rstd
        g = dyf if weight is None else dyf * weight.double()
        if self.spec.kind is RowNormKind.LAYER:
            g = g - g.mean(-1, keepdim=True)
        dx.copy_(rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True)))
        if dweight is not None:
            dweight.copy_((dyf * xhat).sum(0))
        if dbias is not None:
            dbias.copy_(dyf.sum(0))


def _mixed_case(name, x_dtype, w_dtype, target=None, kernel_map=None):
    """(forward op, its inputs, torch's function of them) for a weight (and bias) of
    ``w_dtype`` beside ``x`` of ``x_dtype``."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 32, generator=g).to(x_dtype)
    w = (1 + torch.randn(32, generator=g) / 4).to(w_dtype)
    b = torch.randn(32, generator=g).to(w_dtype)
    kw = {"target": target} if target else {"kernel_map": kernel_map}
    if name == "rms":
        return RMSNormFwdOp(normalized_shape=32, **kw), (x, w), \
            lambda x, w: torch.nn.functional.rms_norm(x, (32,), w)
    if name == "layer":
        return LayerNormFwdOp(normalized_shape=32, **kw), (x, w, b), \
            lambda x, w, b: torch.nn.functional.layer_norm(x, (32,), w, b)
    r = torch.randn(64, 32, generator=g).to(x_dtype)

    def add_rms_norm(x, r, w):  # residual_out rounded to x's dtype, as the op's
        s = x + r
        s = s + (s.to(x_dtype).to(s.dtype) - s).detach()
        return torch.nn.functional.rms_norm(s, (32,), w, 1e-6)

    return FusedAddRMSNormFwdOp(**kw), (x, r, w), add_rms_norm




@pytest.mark.parametrize("name", ["rms", "layer", "add"])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_a_float32_weight_beside_16_bit_inputs(name, x_dtype):
    """The ops take a float32 weight (and bias) beside 16-bit x, as torch's norms: y in x's
    dtype, as torch's within its rounding; the weight's and bias's gradients in float32,
    summed in float32 (within float32's accuracy of float64), x's in x's dtype."""
    op, inputs, torch_fn = _mixed_case(name, x_dtype, torch.float32, "reference")
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = op(*leaves)
    y = out[0] if isinstance(out, tuple) else out
    assert y.dtype == x_dtype
    want = torch_fn(*inputs)
    torch.testing.assert_close(y.float(), want.float(), rtol=1.6e-2, atol=1.6e-2)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).to(x_dtype)
    y.backward(dy)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    torch_fn(*wide).backward(dy.double())
    for mine, ref, t in zip(leaves, wide, inputs, strict=True):
        assert mine.grad.dtype == t.dtype
        if t.dtype == torch.float32:  # the affine tensors: float32 sums of 64 rows
            err = float((mine.grad.double() - ref.grad).abs().max())
            assert err <= 1e-5 * (1 + float(ref.grad.abs().max())), err


@pytest.mark.parametrize("name", ["rms", "layer"])
def test_the_kernels_get_the_weight_in_x_s_dtype_and_store_the_sums_in_float32(name):
    """Through the slots: the forward and the backward kernels are handed a float32 weight
    (and bias) as a copy in x's dtype, and the backward's call spec asks for dweight and
    dbias in float32, which the op returns."""
    from tileops.ops import LayerNormBwdOp, RMSNormBwdOp

    SEEN.clear()
    op, inputs, torch_fn = _mixed_case(name, torch.bfloat16, torch.float32, None,
                                       {"row_norm_fwd": TorchRowNormAffine})
    y = op(*inputs)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), torch_fn(*inputs).float(), rtol=1.6e-2,
                               atol=1.6e-2)
    assert SEEN[-2] == ("fwd", torch.bfloat16, torch.bfloat16 if name == "layer" else None)
    x, w = inputs[0], inputs[1]
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    kmap = {"row_norm_bwd": TorchRowNormBwdAny}
    if name == "rms":
        dx, dw = RMSNormBwdOp(normalized_shape=32, kernel_map=kmap)(dy, x, w)
        db = None
    else:
        dx, dw, db = LayerNormBwdOp(normalized_shape=32, kernel_map=kmap)(dy, x, w, inputs[2])
    spec, w_dt, dw_dt, db_dt = SEEN[-1]
    assert (spec.dtype, spec.sum_dtype, spec.out_dtype) == ("bfloat16", "float32", "float32")
    assert (w_dt, dw_dt, db_dt) == (torch.bfloat16, torch.float32,
                                    torch.float32 if name == "layer" else None)
    assert (dx.dtype, dw.dtype) == (torch.bfloat16, torch.float32)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    torch_fn(*wide).backward(dy.double())
    torch.testing.assert_close(dw.double(), wide[1].grad, rtol=1e-5, atol=1e-5)
    if db is not None:
        assert db.dtype == torch.float32
        torch.testing.assert_close(db.double(), wide[2].grad, rtol=1e-5, atol=1e-5)


class TorchRowNormAffine(TorchRowNorm):
    """The forward slot, recording the dtypes of the affine tensors it is handed."""

    def __call__(self, x, residual, weight, bias, y, residual_out):
        SEEN.append(("fwd", None if weight is None else weight.dtype,
                     None if bias is None else bias.dtype))
        super().__call__(x, residual, weight, bias, y, residual_out)


@pytest.mark.parametrize("name", ["rms", "layer", "add"])
@pytest.mark.parametrize("how", ["reference", "kernel"])
def test_a_weight_neither_in_x_s_dtype_nor_float32_is_refused(name, how):
    kmap = {"row_norm_fwd": TorchRowNorm}
    op, inputs, _ = _mixed_case(name, torch.bfloat16, torch.float16,
                                *(("reference", None) if how == "reference" else (None, kmap)))
    with pytest.raises(ValueError, match=r"W == T or W == float32.*\n.*\n.*W = torch.float16"):
        op(*inputs)


def test_the_weight_s_dtype_is_the_gradients_on_the_reference_target():
    """dweight and dbias of the backward ops are in the weight's dtype: float32 beside
    bfloat16 dy and x, bfloat16 beside bfloat16."""
    from tileops.ops import LayerNormBwdOp, RMSNormBwdOp

    x, dy = torch.randn(8, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    for wdt in (torch.float32, torch.bfloat16):
        w = torch.randn(16, dtype=wdt)
        dx, dw = RMSNormBwdOp(normalized_shape=16, target="reference")(dy, x, w)
        assert (dx.dtype, dw.dtype) == (torch.bfloat16, wdt)
        dx, dw, db = LayerNormBwdOp(normalized_shape=16, target="reference")(dy, x, w, w)
        assert (dx.dtype, dw.dtype, db.dtype) == (torch.bfloat16, wdt, wdt)
        dx, dw, db = LayerNormBwdOp(normalized_shape=16, target="reference")(dy, x, w)
        assert db is None  # no bias, no gradient of one
