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
            assert t is None or (t.dim() == 2 and t.is_contiguous() and t.data_ptr() % 16 == 0)
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
