"""An op of several outputs whose loss uses only some of them, on the CPU (the ``reference``
target): each gradient is torch's autograd of the same math, None where torch gives None, and
finite where torch's is finite though the unused output is not (an inf in the input, a row
whose norm is 0 under ``eps = 0``): the unused output's gradient reaches the backward op
absent, and the op skips its term instead of multiplying zeros by an inf. Eager and compiled,
in float64 and float32. (``tests/ops/test_gradients.py`` holds every such op to its eager
equivalent at finite draws.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tileops.ops as ops

DTYPES = [torch.float64, torch.float32]
MODES = ["eager", "compiled"]


def _maybe_compiled(fn, mode):
    if mode == "eager":
        return fn
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def _same(got, want, what, dtype):
    """One gradient against torch's: both None, or equal values (NaN nowhere in ours where
    torch's has none)."""
    assert (got is None) == (want is None), f"{what}: {got} where torch gives {want}"
    if want is None:
        return
    assert not (got.isnan() & ~want.isnan()).any(), f"{what} has NaN where torch's is finite"
    tol = {} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")


# --- fused add + RMSNorm: residual_out alone ----------------------------------------------------


def _add_norm_inputs(case, dtype):
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(8, generator=g, dtype=torch.float64)
    eps = 1e-6
    if case == "inf":
        x[0, 2] = math.inf
    elif case == "eps0-zero-row":
        x[1], r[1], eps = 0.0, 0.0, 0.0
    return x.to(dtype), r.to(dtype), w.to(dtype), eps


# a compiled step refuses an in-place op with grad (by name): in place runs eagerly
@pytest.mark.parametrize(("inplace", "mode"), [(False, "eager"), (False, "compiled"),
                                               (True, "eager")],
                         ids=["eager", "compiled", "inplace"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["finite", "inf", "eps0-zero-row"])
def test_fused_add_rms_norm_residual_out_alone(case, dtype, inplace, mode):
    x, r, w, eps = _add_norm_inputs(case, dtype)
    c = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=dtype)
    op = ops.FusedAddRMSNormFwdOp(eps=eps, inplace=inplace)

    def ours(x, r, w):
        # in place writes its inputs: non-leaf copies, as a training graph has
        _, s = op(x * 1, r * 1, w)
        return (s * c).sum()

    def torchs(x, r, w):
        s = x + r
        F.rms_norm(s, [s.shape[-1]], w, eps)  # y: computed, not used
        return (s * c).sum()

    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    got = torch.autograd.grad(_maybe_compiled(ours, mode)(*leaves), leaves, allow_unused=True)
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    want = torch.autograd.grad(torchs(*leaves), leaves, allow_unused=True)
    assert want[2] is None  # the weight reaches y alone
    for name, a, b in zip(("x", "residual", "weight"), got, want, strict=True):
        _same(a, b, f"grad of {name}", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["finite", "inf", "eps0-zero-row"])
def test_fused_add_rms_norm_y_used_too_is_torchs(case, dtype):
    # both outputs used: the norm term runs (NaN where torch's is NaN, the inf's row)
    x, r, w, eps = _add_norm_inputs(case, dtype)
    g = torch.Generator().manual_seed(3)
    cy, cs = (torch.randn(x.shape, generator=g, dtype=dtype) for _ in range(2))
    op = ops.FusedAddRMSNormFwdOp(eps=eps)
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    y, s = op(*leaves)
    got = torch.autograd.grad((y.nan_to_num() * cy).sum() + (s * cs).sum(), leaves)
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    s = leaves[0] + leaves[1]
    y = F.rms_norm(s, [s.shape[-1]], leaves[2], eps)
    want = torch.autograd.grad((y.nan_to_num() * cy).sum() + (s * cs).sum(), leaves)
    for name, a, b in zip(("x", "residual", "weight"), got, want, strict=True):
        tol = {} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-4}
        torch.testing.assert_close(a, b, equal_nan=True, **tol,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")


def test_fused_add_rms_norm_backward_without_dy_is_the_residual_gradient():
    # the backward op called on its own: dy left out, dx is dresidual_out and there is no
    # dweight, whatever the rows hold
    x, r, w, _ = _add_norm_inputs("inf", torch.float64)
    dres = torch.randn(3, 8, dtype=torch.float64)
    dx, dweight = ops.FusedAddRMSNormBwdOp()(dres, x + r, w)
    assert dweight is None and torch.equal(dx, dres)
    dy = torch.randn(3, 8, dtype=torch.float64)
    dx, dweight = ops.FusedAddRMSNormBwdOp()(dres, x + r, w, dy)  # the norm term
    assert dx[0].isnan().all() and dx[1:].isfinite().all() and dweight is not None
