"""GemmFwdOp on the reference target (CPU): against a float64 matmul over all four transpose
combinations, odd sizes, K = 1 and M = 1; and the signature's errors."""

import pytest

torch = pytest.importorskip("torch")

from tileops.ops import GemmFwdOp  # noqa: E402
from tileops.signature import SignatureCallError  # noqa: E402

TRANS = [(False, False), (False, True), (True, False), (True, True)]
SIZES = [(1, 1, 1), (1, 64, 32), (7, 13, 1), (33, 17, 65), (128, 96, 80)]


def _operands(m, n, k, ta, tb, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + 131 * m + 17 * n + k)
    a = torch.randn((k, m) if ta else (m, k), generator=g).to(dtype)
    b = torch.randn((n, k) if tb else (k, n), generator=g).to(dtype)
    return a, b


def _ref64(a, b, ta, tb):
    a, b = a.double(), b.double()
    return (a.T if ta else a) @ (b.T if tb else b)


@pytest.mark.parametrize(("trans_a", "trans_b"), TRANS, ids=["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize(("m", "n", "k"), SIZES, ids=[f"{m}x{n}x{k}" for m, n, k in SIZES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reference_against_float64(trans_a, trans_b, m, n, k, dtype):
    a, b = _operands(m, n, k, trans_a, trans_b, dtype)
    op = GemmFwdOp(trans_a=trans_a, trans_b=trans_b)
    c = op(a, b)
    assert op.serving_target == "reference"
    assert c.shape == (m, n) and c.dtype == dtype
    ref = _ref64(a, b, trans_a, trans_b)
    # one rounding of the output to the storage dtype (fp32 accumulation is far tighter)
    eps = torch.finfo(dtype).eps
    assert torch.allclose(c.double(), ref, rtol=eps, atol=eps * ref.abs().max().item() + 1e-30)
    # the reference target runs the op's declared reference (fp32), rounded once
    assert torch.equal(c, op.reference(op.last_call, a, b)[0].to(dtype))


def test_transposed_views_are_accepted():
    a, b = _operands(9, 11, 5, False, False, torch.bfloat16)
    op = GemmFwdOp(trans_a=True, trans_b=True)
    c = op(a.T, b.T)  # non-contiguous (K, M) and (N, K) views
    assert torch.equal(c, GemmFwdOp()(a, b))


def test_roofline():
    a, b = _operands(4, 6, 3, False, False, torch.float16)
    op = GemmFwdOp()
    op(a, b)
    assert op.eval_roofline()[0] == 2 * 4 * 6 * 3


def test_empty_and_k0():
    op = GemmFwdOp()
    assert op(torch.zeros(0, 3, dtype=torch.bfloat16),
              torch.zeros(3, 5, dtype=torch.bfloat16)).shape == (0, 5)
    c = op(torch.zeros(4, 0, dtype=torch.bfloat16), torch.zeros(0, 5, dtype=torch.bfloat16))
    assert c.shape == (4, 5) and not c.any()


@pytest.mark.parametrize(("trans_a", "trans_b"), TRANS, ids=["nn", "nt", "tn", "tt"])
def test_k_mismatch_names_the_axes(trans_a, trans_b):
    a, _ = _operands(8, 16, 32, trans_a, trans_b, torch.bfloat16)
    _, b = _operands(8, 16, 24, trans_a, trans_b, torch.bfloat16)
    with pytest.raises(SignatureCallError) as info:
        GemmFwdOp(trans_a=trans_a, trans_b=trans_b)(a, b)
    msg = str(info.value)
    a_axis = "a.shape[0]" if trans_a else "a.shape[1]"
    b_axis = "b.shape[1]" if trans_b else "b.shape[0]"
    assert f"K bound to 32 by {a_axis}, but {b_axis} is 24" in msg
    assert "Mat[trans_b, K, N]" in msg


def test_dtype_errors():
    a = torch.randn(4, 4).to(torch.int32)
    with pytest.raises(SignatureCallError, match="int32"):
        GemmFwdOp()(a, a)
    with pytest.raises(SignatureCallError):
        GemmFwdOp()(a.to(torch.bfloat16), a.to(torch.float16))


def test_rank_error():
    with pytest.raises(SignatureCallError):
        GemmFwdOp()(torch.zeros(2, 3, 4, dtype=torch.bfloat16),
                    torch.zeros(4, 5, dtype=torch.bfloat16))


def test_construction_rejects_non_bool():
    with pytest.raises(Exception):  # noqa: B017 - the construction check's own error type
        GemmFwdOp(trans_a="yes")


# --- the call spec the in-tree forward hands to kernel selection (no kernel runs) ----------------


@pytest.mark.parametrize(("m", "n", "k", "ta", "tb", "aligned"), [
    (128, 4096, 4096, False, False, True),
    (128, 4096, 4096, True, True, True),
    (333, 4097, 4096, False, False, False),  # c's and b's rows are odd
    (333, 4096, 4095, False, False, False),  # a's rows are odd
    (333, 4096, 4095, False, True, False),  # b stored (N, K): its rows are K long
    (333, 4096, 4096, True, False, False),  # a stored (K, M): its rows are M long
    (336, 4096, 4096, True, False, True),
    (1, 4096, 4096, False, True, True),
])
def test_forward_call_spec(m, n, k, ta, tb, aligned):

    from tileops.kernels.gemm import GemmFwdInterface, GemmSpec, m_bucket, plan_of

    op = GemmFwdOp(trans_a=ta, trans_b=tb)
    seen = []
    op.kernel = lambda iface, spec: seen.append((iface, spec)) or (lambda a, b, c: None)
    a, b = _operands(m, n, k, ta, tb, torch.bfloat16)
    call = op._point.check(a, b)  # the record the op's call would hand to forward
    op.forward(call, a, b, torch.empty(m, n, dtype=torch.bfloat16))
    (iface, spec), = seen
    assert iface is GemmFwdInterface and type(spec) is GemmSpec
    # the op states the call's exact sizes; the kernels derive the M bucket and alignment
    assert (spec.m, spec.n, spec.k, spec.dtype) == (m, n, k, "bfloat16")
    assert (spec.trans_a, spec.trans_b) == (ta, tb)
    plan = plan_of(spec)
    assert (plan.m, plan.aligned) == (m_bucket(m), aligned)


def test_the_output_is_always_the_ops_own_allocation():
    """forward takes ``c`` as contiguous and 16-byte aligned because the op allocates it: the
    spec gives no out= buffer. Declaring one would need forward to check the caller's."""
    op = GemmFwdOp()
    assert op._signature.buffer_outputs == ()
    a, b = _operands(16, 32, 64, False, False, torch.bfloat16)
    with pytest.raises(TypeError, match="unexpected argument 'c'"):
        op(a, b, c=torch.empty(16, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("m", [0, 1, 2, 3, 64, 65, 1000, 16384, 16385, 10 ** 6])
def test_m_bucket_is_the_next_power_of_two_up_to_16384(m):
    from tileops.kernels.gemm import m_bucket

    want = 1
    while want < min(m, 16384):
        want *= 2
    assert m_bucket(m) == want


def test_the_reference_target_keeps_float32_under_a_callers_autocast():
    """An autocast region of the caller does not reach the reference target's arithmetic:
    an op's values are those outside it (float32 products stay float32, as the in-tree
    kernels'), and a layer that autocasts its inputs as torch's does gives torch's value."""
    import torch.nn.functional as F

    import tileops.nn as tnn
    from tileops.ops import FusedLinearCrossEntropyFwdOp, GroupedQueryAttentionFwdOp

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 64, generator=g), torch.randn(16, 64, generator=g)
    h, w = torch.randn(4, 8, generator=g).bfloat16(), torch.randn(13, 8, generator=g).bfloat16()
    t = torch.randint(0, 13, (4,), generator=g)
    q, k, v = (torch.randn(1, 5, 2, 16, generator=g).bfloat16() for _ in range(3))
    calls = [lambda: GemmFwdOp(trans_b=True)(a, b),
             lambda: FusedLinearCrossEntropyFwdOp()(h, w, t),
             lambda: GroupedQueryAttentionFwdOp(is_causal=True)(q, k, v)]
    for call in calls:
        plain = call()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under = call()
        assert under.dtype == plain.dtype
        torch.testing.assert_close(under, plain, rtol=0, atol=0)
    h32, w32 = h.float(), w.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = tnn.FusedLinearCrossEntropyLoss()(h32, w32, t)
        want = F.cross_entropy(F.linear(h32, w32), t)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-6)
