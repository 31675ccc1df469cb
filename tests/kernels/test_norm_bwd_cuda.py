"""The row-norm backward kernels on the GPU: dx, dweight and dbias against float64 autograd
through the forward formula.

Grid: every kind with each set of affine tensors and wanted gradients, every storage dtype,
row lengths N that exercise each code path (7: narrower than a warp, several rows a CTA;
4096/8192/16384: 16-byte accesses on 128/256/512 threads; 4097: no vector divides it;
65536: the looped kernel), row counts 1 (the direct program: the sums stored without the
workspace), 3 (the few-rows plan), 128 (the boundary of that plan), 2048 and 32768 (the
persistent grid walking many rows per CTA) where the fp64 reference fits; plus random row
lengths up to 2**20. Inputs are fresh random values and the outputs are poisoned (the
allocator hands back memory just filled with NaN), so an element never written fails.
"""

import random

import pytest

torch = pytest.importorskip("torch")

from tileops.kernels import norm_bwd as nb  # noqa: E402
from tileops.kernels.norm import RowNormKind  # noqa: E402

pytestmark = pytest.mark.cuda

# relative L2 error bounds: one rounding of each output dominates (bf16 8 bits, fp16 11 bits);
# fp32 leaves the fp32 sums of up to 2**20 terms
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NS = (7, 4096, 4097, 8192, 16384, 65536)
ROWS = (1, 3, 128, 2048, 32768)
#: fp64 reference tensors of at most this many elements (a few of them, 4 GiB each, at once)
MAX_ELEMENTS = 2**29
#: the affine sets: (has_weight, grad_weight, has_bias/grad_bias)
AFFINE = {
    "rms": [(True, True, False), (True, False, False), (False, False, False)],
    "add_rms": [(True, True, False), (True, False, False), (False, False, False)],
    "layer": [(True, True, True), (True, True, False), (False, False, True),
              (True, False, True), (False, False, False)],
}
EPS = 1e-5


def reference(kind, x, dy, dres, weight, bias, eps):
    """``(dx, dweight, dbias)`` in fp64: autograd through the forward formula."""
    x = x.double().requires_grad_()
    w = weight.double().requires_grad_() if weight is not None else None
    b = bias.double().requires_grad_() if bias is not None else None
    if kind == "layer":
        mean = x.mean(-1, keepdim=True)
        y = (x - mean) * torch.rsqrt((x - mean).pow(2).mean(-1, keepdim=True) + eps)
    else:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    leaves = [t for t in (x, w, b) if t is not None]
    grads = list(torch.autograd.grad(y, leaves, dy.double()))
    dx = grads.pop(0)
    if dres is not None:  # the fused add: residual_out's gradient joins the norm's
        dx = dx + dres.double()
    dw = grads.pop(0) if w is not None else None
    db = grads.pop(0) if b is not None else None
    return dx, dw, db


def _poisoned(shape, dtype):
    out = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    return out


def _rel(out, ref) -> float:
    out = out.double()
    assert not torch.isnan(out).any(), "an output element was never written"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _entry(kind, m, n, dtype, has_weight, grad_weight, grad_bias):
    spec = nb.RowNormBwdSpec(device=torch.device("cuda", torch.cuda.current_device()),
                             kind=RowNormKind(kind), rows=m, n=n, dtype=str(dtype)[6:],
                             eps=EPS, has_weight=has_weight, grad_weight=grad_weight,
                             grad_bias=grad_bias)
    fits = nb.RowNormBwdRegisterKernel.refusal(spec) is None
    cls = nb.RowNormBwdRegisterKernel if fits else nb.RowNormBwdLoopedKernel
    return cls.entry_for(spec, None)


def check(kind, m, n, dtype, has_weight, grad_weight, has_bias):
    grad_bias = has_bias
    x = torch.randn(m, n, dtype=dtype, device="cuda") * 2 + (0.5 if kind == "layer" else 0)
    dy = torch.randn(m, n, dtype=dtype, device="cuda")
    dres = torch.randn(m, n, dtype=dtype, device="cuda") if kind == "add_rms" else None
    w = torch.randn(n, dtype=dtype, device="cuda") if has_weight else None
    b = torch.randn(n, dtype=dtype, device="cuda") if has_bias else None
    dx = _poisoned((m, n), dtype)
    dw = _poisoned((n,), dtype) if grad_weight else None
    db = _poisoned((n,), dtype) if grad_bias else None
    entry = _entry(kind, m, n, dtype, has_weight, grad_weight, grad_bias)
    entry(dy, dres, x, w, dx, dw, db)
    torch.cuda.synchronize()
    rdx, rdw, rdb = reference(kind, x, dy, dres, w, b, EPS)
    tol = TOL[dtype]
    assert _rel(dx, rdx) < tol, "dx"
    if grad_weight:
        assert _rel(dw, rdw) < tol, "dweight"
    if grad_bias:
        assert _rel(db, rdb) < tol, "dbias"
    return entry


def _grid():
    for kind, sets in AFFINE.items():
        for hw, gw, hb in sets:
            for dt in DTYPES:
                for n in NS:
                    # the full row sweep with every gradient wanted; the other affine sets on
                    # one row (the direct program), one few-rows and one many-rows count
                    rows = ROWS if sets.index((hw, gw, hb)) == 0 else (1, 3, 2048)
                    for m in rows:
                        if m * n > MAX_ELEMENTS:
                            continue
                        tag = f"{kind}-w{int(hw)}{int(gw)}-b{int(hb)}-{str(dt)[6:]}-m{m}-n{n}"
                        yield pytest.param(kind, m, n, dt, hw, gw, hb, id=tag)


@pytest.mark.parametrize(("kind", "m", "n", "dtype", "hw", "gw", "hb"), list(_grid()))
def test_backward_against_fp64_autograd(kind, m, n, dtype, hw, gw, hb):
    check(kind, m, n, dtype, hw, gw, hb)
    torch.cuda.empty_cache()


_rng = random.Random(20261201)
RANDOM_NS = sorted({_rng.randint(1, 1 << 20) for _ in range(4)} | {100000, (1 << 20) - 1})


@pytest.mark.parametrize("n", RANDOM_NS)
@pytest.mark.parametrize("kind", ["rms", "add_rms", "layer"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_row_lengths(n, kind, dtype):
    check(kind, 64, n, dtype, True, True, kind == "layer")
    torch.cuda.empty_cache()


def test_an_entry_serves_row_counts_of_its_plan_with_one_workspace():
    """Successive calls of one entry with different row counts (so different grids) give the
    right sums: every workspace row a call reads was written by that call."""
    entry = None
    for m in (32768, 2048, 300, 32768):
        torch.manual_seed(m)
        x = torch.randn(m, 4096, dtype=torch.bfloat16, device="cuda")
        dy = torch.randn_like(x)
        w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        if entry is None:
            entry = _entry("rms", m, 4096, torch.bfloat16, True, True, False)
        entry(dy, None, x, w, dx, dw, None)
        rdx, rdw, _ = reference("rms", x, dy, None, w, None, EPS)
        assert _rel(dx, rdx) < 1e-2 and _rel(dw, rdw) < 1e-2


def test_no_rows_gives_zero_column_sums():
    for n in (4096, 65536):
        entry = _entry("layer", 0, n, torch.float32, True, True, True)
        empty = torch.empty(0, n, device="cuda")
        dw = _poisoned((n,), torch.float32)
        db = _poisoned((n,), torch.float32)
        entry(empty, None, empty, torch.ones(n, device="cuda"), torch.empty_like(empty), dw,
              db)
        assert not dw.any() and not db.any()
