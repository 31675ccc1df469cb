"""An op of several outputs whose loss uses only some of them, on the CPU (the ``reference``
target): each gradient is torch's autograd of the same math, None where torch gives None, and
finite where torch's is finite though the unused output is not (an inf in the input, a row
whose norm is 0 under ``eps = 0``): the unused output's gradient reaches the backward op
absent, and the op skips its term instead of multiplying zeros by an inf. Eager and compiled,
in float64 and float32: the fused add + RMSNorm's residual_out alone, attention's log-sum-exp
alone, RoPE's q or k alone (var_mean's: ``tests/ops/test_reduction_grads.py``;
``tests/ops/test_gradients.py`` holds every such op to its eager equivalent at finite
draws)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tileops.ops as ops
from tileops.signature import SignatureCallError

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


# --- attention: the log-sum-exp alone -----------------------------------------------------------


def _qkv(dtype, h_kv, case, layout="bshd"):
    g = torch.Generator().manual_seed(4)
    b, s_q, s_kv, h, d = 2, 5, 7, 4, 8
    q = torch.randn(b, s_q, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s_kv, h_kv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s_kv, h_kv, d, generator=g, dtype=torch.float64)
    if case == "inf-in-v":
        v[0, 3, 0, 1] = math.inf
    elif case == "nan-in-v":
        v[1, 0, -1, 0] = math.nan
    if layout == "bhsd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return [t.to(dtype) for t in (q, k, v)]


def _torch_lse(q, k, *, scale, softcap, is_causal, layout):
    """The rows' log-sum-exp of the capped, causally masked (bottom-right) scores in torch's
    ops ([B, H, S_q]); v takes no part."""
    if layout == "bshd":
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if is_causal:
        s_q, s_kv = s.shape[-2], s.shape[-1]
        seen = torch.arange(s_kv)[None, :] <= torch.arange(s_q)[:, None] + (s_kv - s_q)
        s = s.masked_fill(~seen, -math.inf)
    return torch.logsumexp(s, dim=-1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["finite", "inf-in-v", "nan-in-v"])
@pytest.mark.parametrize(("cls", "h_kv", "kw"), [
    (ops.MultiHeadAttentionFwdOp, 4, {}),
    (ops.GroupedQueryAttentionFwdOp, 2, {"is_causal": True, "softcap": 3.0}),
    (ops.GroupedQueryAttentionFwdOp, 1, {"is_causal": True, "layout": "bhsd"}),
], ids=["mha", "gqa-causal-softcap", "mqa-bhsd"])
def test_attention_log_sum_exp_alone(cls, h_kv, kw, case, dtype, mode):
    # o unused: dq and dk are the log-sum-exp's (dS = P dlse), finite though v holds an inf
    # or a NaN (o does too), and v has no gradient
    layout = kw.get("layout", "bshd")
    q, k, v = _qkv(dtype, h_kv, case, layout)
    c = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(5), dtype=dtype)
    op = cls(return_lse=True, **kw)

    def ours(q, k, v):
        _, lse = op(q, k, v)
        return (lse * c).sum()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(_maybe_compiled(ours, mode)(*leaves), leaves, allow_unused=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    lse = _torch_lse(*leaves[:2], scale=1 / math.sqrt(q.shape[-1]), softcap=kw.get("softcap"),
                     is_causal=kw.get("is_causal", False), layout=layout)
    want = torch.autograd.grad((lse * c).sum(), leaves, allow_unused=True)
    assert want[2] is None
    for name, a, b in zip("qkv", got, want, strict=True):
        _same(a, b, f"grad of {name}", dtype)


@pytest.mark.parametrize("case", ["finite", "inf-in-v"])
def test_attention_output_used_too_is_torchs(case):
    # both outputs used: dout's terms run, as torch's (NaN where its own is, the inf's rows)
    q, k, v = _qkv(torch.float64, 2, case)
    g = torch.Generator().manual_seed(6)
    op = ops.GroupedQueryAttentionFwdOp(return_lse=True, is_causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = op(*leaves)
    co, cl = torch.randn(o.shape, generator=g, dtype=o.dtype), torch.randn(lse.shape,
                                                                          generator=g)
    got = torch.autograd.grad((o * co).sum() + (lse * cl.double()).sum(), leaves)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = op.eager()(*leaves)
    want = torch.autograd.grad((o * co).sum() + (lse * cl.double()).sum(), leaves)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, equal_nan=True)


def test_attention_backward_without_dout():
    # the backward op called on its own: dout left out gives dS = P dlse and no dv; neither
    # upstream gradient gives zeros
    q, k, v = _qkv(torch.float64, 2, "inf-in-v")
    fwd = ops.GroupedQueryAttentionFwdOp(return_lse=True, is_causal=True)
    o, lse = fwd(q, k, v)
    assert not o.isfinite().all()
    bwd = ops.GroupedQueryAttentionBwdOp(is_causal=True)
    dlse = torch.randn(lse.shape, dtype=lse.dtype)
    dq, dk, dv = bwd(q, k, v, o, lse, None, dlse)
    assert dv is None and dq.isfinite().all() and dk.isfinite().all()
    leaves = [t.clone().requires_grad_() for t in (q, k)]
    want = torch.autograd.grad(_torch_lse(*leaves, scale=1 / math.sqrt(8), softcap=None,
                                          is_causal=True, layout="bshd"), leaves, dlse)
    torch.testing.assert_close(dq, want[0])
    torch.testing.assert_close(dk, want[1])
    dq, dk, dv = bwd(q, k, v, o, lse)
    assert dv is None and not dq.any() and not dk.any()
    # the old order (dout first) is refused by the signature check, naming a tensor
    with pytest.raises(SignatureCallError, match=r"^GroupedQueryAttentionBwdOp: argument \w+ "
                                                 r"does not match the signature"):
        bwd(torch.randn_like(o), q, k, v, o, lse)


def test_attention_gradient_slot_without_dout_reads_zeros_for_dout_o_and_v():
    # the in-tree path, through a CPU stand-in of the gradients' slot doing FlashAttention's
    # backward math (delta = rowsum(dout o) - dlse, dP = dout v^T, dV = P^T dout): with o's
    # result unused it is handed zeros for dout, o and v, so an inf of v (and of o) gives no
    # 0 * inf, and dq, dk are the log-sum-exp's
    from tileops.kernels.attention import AttentionLayout
    from tileops.kernels.attention_bwd import AttentionBwdInterface
    from tileops.runtime import Kernel

    seen = []

    class FlashMath(Kernel, AttentionBwdInterface):
        devices = ("cpu",)
        general = True

        def __call__(self, dout, q, k, v, o, lse, dlse, dq, dk, dv):
            seen.append((dout, o, v))
            bshd = self.spec.layout is AttentionLayout.BSHD
            qd, kd, vd, od, dod = (t.double().transpose(1, 2) if bshd else t.double()
                                   for t in (q, k, v, o, dout))
            g = qd.shape[1] // kd.shape[1]
            kf, vf = kd.repeat_interleave(g, dim=1), vd.repeat_interleave(g, dim=1)
            p = torch.exp(torch.matmul(qd, kf.transpose(-1, -2)) * self.spec.scale
                          - lse.double()[..., None])
            delta = (dod * od).sum(-1) - (0 if dlse is None else dlse.double())
            ds = p * (torch.matmul(dod, vf.transpose(-1, -2)) - delta[..., None])
            grads = (self.spec.scale * torch.matmul(ds, kf),
                     self.spec.scale * torch.matmul(ds.transpose(-1, -2), qd),
                     torch.matmul(p.transpose(-1, -2), dod))
            b, h_kv = kd.shape[0], kd.shape[1]
            for out, t, grouped in zip((dq, dk, dv), grads, (False, True, True), strict=True):
                if grouped and g > 1:
                    t = t.view(b, h_kv, g, *t.shape[2:]).sum(2)
                out.copy_(t.transpose(1, 2) if bshd else t)

    q, k, v = _qkv(torch.float64, 2, "inf-in-v")
    o, lse = ops.GroupedQueryAttentionFwdOp(return_lse=True)(q, k, v)  # the reference's
    q, k, v, o = (t.to(torch.float16) for t in (q, k, v, o))
    lse, dlse = lse.float(), torch.randn(lse.shape)
    bwd = ops.GroupedQueryAttentionBwdOp(kernel_map={AttentionBwdInterface: FlashMath})
    dq, dk, dv = bwd(q, k, v, o, lse, None, dlse)
    (dout_in, o_in, v_in), = seen
    assert not dout_in.any() and not o_in.any() and not v_in.any()
    assert dv is None and dq.isfinite().all() and dk.isfinite().all()
    want = ops.GroupedQueryAttentionBwdOp()(*(t.double() for t in (q, k, v, o, lse)), None,
                                            dlse.double())
    torch.testing.assert_close(dq.double(), want[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(dk.double(), want[1], rtol=2e-3, atol=2e-3)
    # with dout the slot reads the tensors as handed
    dout = torch.randn(o.shape).half()
    bwd(q, k, v, o, lse, dout, dlse)
    assert torch.equal(seen[-1][0], dout) and torch.equal(seen[-1][2], v)


# --- RoPE: one rotated tensor alone -----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("used", ["q", "k"])
def test_rope_one_output_alone(used, dtype, mode):
    # the other tensor has no gradient (None, as torch's), though it holds an inf; the used
    # one's is torch's rotation back
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 5, 4, 8, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(2, 5, 2, 8, generator=g, dtype=torch.float64).to(dtype)
    (k if used == "q" else q)[0, 1, 0, 2] = math.inf
    c = torch.randn((q if used == "q" else k).shape, generator=g, dtype=torch.float64).to(dtype)
    op = ops.RopeNeoxFwdOp()

    def loss(fn):
        def f(q, k):
            q_out, k_out = fn(q, k)
            return ((q_out if used == "q" else k_out) * c).sum()
        return f

    leaves = [t.clone().requires_grad_() for t in (q, k)]
    got = torch.autograd.grad(_maybe_compiled(loss(op), mode)(*leaves), leaves,
                              allow_unused=True)
    leaves = [t.clone().requires_grad_() for t in (q, k)]
    want = torch.autograd.grad(loss(op.eager())(*leaves), leaves, allow_unused=True)
    assert want[1 if used == "q" else 0] is None
    for name, a, b in zip("qk", got, want, strict=True):
        _same(a, b, f"grad of {name}", dtype)
