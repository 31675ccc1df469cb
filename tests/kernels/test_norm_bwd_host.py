"""The row-norm backward kernels' whole calls run on the host (tests/kernels/_host_run.py's
HostProgram in place of each compiled program's launch): the main program on its persistent
grid, the fp32 workspace of column partials and the column-sum program after it, or the
one-row program storing the sums itself; against torch autograd in float64 for RMSNorm,
fused add + RMSNorm and LayerNorm, with and without the weight's and the bias's gradients."""

import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")

from tileops.kernels import norm_bwd as nb  # noqa: E402
from tileops.kernels.norm import RowNormKind  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _host_run import HostProgram  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling a kernel's source for the host needs nvcc")


@pytest.fixture
def on_host(monkeypatch):
    """The kernel classes building their programs for sm_90 and running them on the host, as
    on a 132-SM device."""
    register, looped, colsum = (nb.build_bwd_register_kernel, nb.build_bwd_looped_kernel,
                                nb.build_colsum_kernel)
    host = lambda build: lambda *a: HostProgram(build(*a[:7], "sm_90", *a[8:]))  # noqa: E731
    monkeypatch.setattr(nb.RowNormBwdRegisterKernel, "_build", staticmethod(host(register)))
    monkeypatch.setattr(nb.RowNormBwdLoopedKernel, "_build", staticmethod(host(looped)))
    monkeypatch.setattr(nb, "build_colsum_kernel",
                        lambda rpc, n, k, dtype, out_dtype=None:
                        HostProgram(colsum(rpc, n, k, dtype, "sm_90", out_dtype)))
    monkeypatch.setattr(nb, "sm_count", lambda device: 132)


def _reference(kind: str, x, w, b, dy, dres, eps: float):
    """dx, dweight, dbias of the forward in float64 by autograd (``x`` the normalized input:
    the fused add's saved residual_out)."""
    x = x.double().requires_grad_()
    w = w.double().requires_grad_() if w is not None else None
    b = b.double().requires_grad_() if b is not None else None
    if kind == "layer":
        y = torch.nn.functional.layer_norm(x, (x.shape[1],), w, b, eps)
    else:
        y = x * (x.pow(2).mean(1, keepdim=True) + eps).rsqrt()
        y = y * w if w is not None else y
    y.backward(dy.double())
    dx = x.grad + (dres.double() if dres is not None else 0)
    return dx, (w.grad if w is not None else None), (b.grad if b is not None else None)


def _close(got, want, dtype: str, scale: float = 1.0) -> None:
    tol = 1e-4 if dtype == "float32" else 2e-2
    err = float(((got.double() - want).abs() / (want.abs() + scale)).max())
    assert err <= tol, err


#: (kernel, kind, rows, n, dtype, weight, grad_weight, grad_bias)
CASES = [
    # the persistent grid over more rows than CTAs, partials in the workspace, the column sum
    pytest.param("register", "rms", 300, 1024, "bfloat16", True, True, False, id="rms"),
    pytest.param("register", "rms", 70, 40, "float32", True, True, False, id="rms-8-rows-a-cta"),
    pytest.param("register", "add_rms", 20, 2048, "float16", True, True, False, id="add-rms"),
    pytest.param("register", "layer", 33, 1027, "bfloat16", True, True, True, id="layer-odd"),
    # one row: the program stores the sums itself
    pytest.param("register", "layer", 1, 640, "float32", True, True, True, id="layer-one-row"),
    pytest.param("looped", "layer", 2, 33000, "bfloat16", True, True, True, id="layer-looped"),
]


@pytest.mark.parametrize(("kernel", "kind", "rows", "n", "dtype", "weight", "gw", "gb"), CASES)
def test_the_backward_is_autograd_s_on_the_host(on_host, kernel, kind, rows, n, dtype, weight,
                                                gw, gb):
    eps = 1e-5
    t = getattr(torch, dtype)
    g = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=g, dtype=torch.float64) * 2 + 0.5).to(t)
    dy = torch.randn(rows, n, generator=g, dtype=torch.float64).to(t)
    dres = torch.randn(rows, n, generator=g, dtype=torch.float64).to(t) \
        if kind == "add_rms" else None
    w = (1 + torch.randn(n, generator=g, dtype=torch.float64) / 4).to(t) if weight else None
    b = torch.zeros(n, dtype=t) if kind == "layer" else None  # the bias: its gradient only
    spec = nb.RowNormBwdSpec(device=torch.device("cpu"), kind=RowNormKind(kind), rows=rows,
                             n=n, dtype=dtype, eps=eps, has_weight=weight, grad_weight=gw,
                             grad_bias=gb)
    cls = nb.RowNormBwdRegisterKernel if kernel == "register" else nb.RowNormBwdLoopedKernel
    entry = cls(spec)
    dx = torch.full((rows, n), float("nan"), dtype=t)
    dw = torch.full((n,), float("nan"), dtype=t) if gw else None
    db = torch.full((n,), float("nan"), dtype=t) if gb else None
    entry(dy, dres, x, w, dx, dw, db)
    want_dx, want_dw, want_db = _reference(kind, x, w, b if gb else None, dy, dres, eps)
    _close(dx, want_dx, dtype)
    if gw:
        _close(dw, want_dw, dtype, scale=rows ** 0.5)  # a sum over the rows
    if gb:
        _close(db, want_db, dtype, scale=rows ** 0.5)


#: (kernel, kind, rows, n, dtype, grad_bias): a float32 weight's sums, stored in float32
F32_CASES = [
    pytest.param("register", "rms", 300, 1024, "bfloat16", False, id="rms-colsum"),
    pytest.param("register", "layer", 1, 640, "bfloat16", True, id="layer-one-row"),
    pytest.param("looped", "layer", 2, 33000, "float16", True, id="layer-looped"),
]


@pytest.mark.parametrize(("kernel", "kind", "rows", "n", "dtype", "gb"), F32_CASES)
def test_a_float32_weight_s_gradients_are_summed_and_stored_in_float32(on_host, kernel, kind,
                                                                       rows, n, dtype, gb):
    """The op hands the kernels a float32 weight cast to the storage dtype and asks for
    dweight and dbias in float32: the column sums are rounded once, to float32, and are as
    exact as float32 sums of the products (no rounding to the storage dtype on the way)."""
    eps = 1e-5
    t = getattr(torch, dtype)
    g = torch.Generator().manual_seed(rows * n + 1)
    x = (torch.randn(rows, n, generator=g, dtype=torch.float64) * 2 + 0.5).to(t)
    dy = torch.randn(rows, n, generator=g, dtype=torch.float64).to(t)
    w = (1 + torch.randn(n, generator=g, dtype=torch.float64) / 4).to(t)
    spec = nb.RowNormBwdSpec(device=torch.device("cpu"), kind=RowNormKind(kind), rows=rows,
                             n=n, dtype=dtype, eps=eps, has_weight=True, grad_weight=True,
                             grad_bias=gb, sum_dtype="float32")
    cls = nb.RowNormBwdRegisterKernel if kernel == "register" else nb.RowNormBwdLoopedKernel
    entry = cls(spec)
    dx = torch.full((rows, n), float("nan"), dtype=t)
    dw = torch.full((n,), float("nan"), dtype=torch.float32)
    db = torch.full((n,), float("nan"), dtype=torch.float32) if gb else None
    entry(dy, None, x, w, dx, dw, db)
    b = torch.zeros(n, dtype=t) if gb else None
    want_dx, want_dw, want_db = _reference(kind, x, w, b, dy, None, eps)
    _close(dx, want_dx, dtype)
    # float32 accuracy, where a sum stored in the storage dtype is off by about 2e-3
    err = float(((dw.double() - want_dw).abs() / (want_dw.abs() + 1)).max())
    assert err <= 2e-5, err
    if gb:
        err = float(((db.double() - want_db).abs() / (want_db.abs() + 1)).max())
        assert err <= 2e-5, err


def test_the_sums_are_stored_in_the_storage_dtype_or_float32_only():
    with pytest.raises(ValueError, match="sum_dtype must be the storage dtype"):
        nb.RowNormBwdSpec(device=torch.device("cpu"), kind=RowNormKind.RMS, rows=4, n=8,
                          dtype="bfloat16", eps=1e-5, has_weight=True, grad_weight=True,
                          grad_bias=False, sum_dtype="float16")
