"""The norm ops on CPU through the reference target, over the same grid as the GPU tests.

Row lengths 1, 7, 128, 4096, 4097, 8192 and 65536 and row counts 1, 3 and 2048 (32768-row
cases run on the GPU only: the CPU grid keeps each case under a few million elements), every
storage dtype, against a float64 reference computed independently here. Also: batch dims,
absent affine tensors, the in-place fused form, and bad calls leaving the op usable.
"""

import pytest

torch = pytest.importorskip("torch")

from tileops.ops import FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp  # noqa: E402
from tileops.signature import SignatureCallError  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _grid():
    for n in (1, 7, 128, 4096, 4097, 8192, 65536):
        for m in (1, 3, 2048):
            if m * n > 1 << 22:
                continue
            for dt in (torch.bfloat16, torch.float16, torch.float32):
                yield pytest.param(m, n, dt, id=f"m{m}-n{n}-{str(dt)[6:]}")


def _rel(out, ref):
    out = out.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _rms64(x, w, eps):
    x = x.double()
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.double()


@pytest.mark.parametrize(("m", "n", "dtype"), list(_grid()))
def test_reference_target_grid(m, n, dtype):
    g = torch.Generator().manual_seed(m * 131 + n)
    x = torch.randn(m, n, generator=g).to(dtype)
    r = torch.randn(m, n, generator=g).to(dtype)
    w = torch.randn(n, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)

    rms = RMSNormFwdOp(normalized_shape=[n], eps=1e-6)
    y = rms(x, w)
    assert rms.serving_target == "reference" and y.dtype == dtype and y.shape == x.shape
    assert _rel(y, _rms64(x, w, 1e-6)) < TOL[dtype]

    layer = LayerNormFwdOp(normalized_shape=n)
    y = layer(x, w, b)
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    ref = (xd - mean) / torch.sqrt((xd - mean).pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = ref * w.double() + b.double()
    assert _rel(y, ref) < TOL[dtype]

    fused = FusedAddRMSNormFwdOp(eps=1e-6)
    y, s = fused(x, r, w)
    s_ref = (x.double() + r.double()).to(dtype)
    assert torch.equal(s, s_ref)
    assert _rel(y, _rms64(s_ref, w, 1e-6)) < TOL[dtype]


def test_batch_dims_multi_axis_and_absent_affine():
    x = torch.randn(2, 3, 5, 64)
    y = RMSNormFwdOp(normalized_shape=[5, 64])(x)
    xd = x.double()
    ref = xd / torch.sqrt(xd.pow(2).mean((-2, -1), keepdim=True) + torch.finfo(x.dtype).eps)
    assert y.shape == x.shape and _rel(y, ref) < 1e-6
    y = LayerNormFwdOp(normalized_shape=64)(x)
    assert _rel(y, torch.nn.functional.layer_norm(xd, [64])) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_eps_none_is_the_maths_epsilon_as_torchs_rms_norm(dtype):
    # small rows: the storage dtype's epsilon (bfloat16's 0.0078) would swamp their mean square
    x = (torch.randn(4, 64) * 1e-2).to(dtype)
    y = RMSNormFwdOp(normalized_shape=64)(x)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x, (64,)), rtol=0, atol=0)
    xd = x.double()
    ref = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)
    assert _rel(y, ref) < 1e-2


@pytest.mark.parametrize("cls", ["RMSNormFwdOp", "LayerNormFwdOp"])
def test_an_unbatched_input_gets_per_element_weight_gradients(cls):
    # x is exactly normalized_shape: no row axes to sum the weight's gradient over
    import tileops.ops as ops

    for shape in ((6,), (3, 4)):
        x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        w = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        dy = torch.randn(shape, dtype=torch.float64)
        got = torch.autograd.grad(getattr(ops, cls)(normalized_shape=shape, eps=1e-5)(x, w),
                                  (x, w), dy)
        fn = (torch.nn.functional.rms_norm if cls == "RMSNormFwdOp" else
              torch.nn.functional.layer_norm)
        want = torch.autograd.grad(fn(x, shape, w, eps=1e-5), (x, w), dy)
        for g, r in zip(got, want, strict=True):
            torch.testing.assert_close(g, r)


def test_inplace_fused_writes_and_returns_its_inputs():
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    x0, r0 = x.clone(), r.clone()
    op = FusedAddRMSNormFwdOp(inplace=True)
    y, s = op(x, r)
    assert y is x and s is r
    assert torch.equal(r, x0 + r0)
    assert _rel(x, _rms64(x0 + r0, None, 1e-6)) < 1e-6
    assert op.last_call.written_inputs == ("x", "residual")


def test_bad_call_names_the_argument_and_leaves_the_op_usable():
    op = RMSNormFwdOp(normalized_shape=[64], eps=1e-6)
    good = op(torch.randn(2, 64))
    with pytest.raises(SignatureCallError) as info:
        op(torch.randn(2, 64), torch.randn(32))
    msg = str(info.value)
    assert "argument weight" in msg and "weight.shape[0] must be 64, but is 32" in msg
    assert op.last_call.tensors["x"] == ((2, 64), "float32")
    torch.testing.assert_close(op(torch.ones(1, 64)), torch.ones(1, 64))
    assert good.shape == (2, 64)


def test_construction_errors_are_clear():
    from tileops.signature import ConstructionError

    with pytest.raises(ConstructionError, match="eps"):
        RMSNormFwdOp(normalized_shape=[8], eps=-1.0)
    with pytest.raises(ConstructionError, match="normalized_shape"):
        RMSNormFwdOp(normalized_shape=[])


def test_eps_zero_is_taken_as_torch_takes_it():
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(LayerNormFwdOp(normalized_shape=8, eps=0.0)(x),
                               torch.nn.functional.layer_norm(x, (8,), eps=0.0))
    torch.testing.assert_close(RMSNormFwdOp(normalized_shape=8, eps=0.0)(x),
                               torch.nn.functional.rms_norm(x, (8,), eps=0.0))
    with pytest.raises(Exception, match=r"^LayerNormFwdOp: construction param eps"):
        LayerNormFwdOp(normalized_shape=8, eps=-1e-5)
