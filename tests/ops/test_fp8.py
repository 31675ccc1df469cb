"""The fp8 family on the CPU: the scale convention of Fp8QuantFwdOp (scale shapes per
granularity, amax / fp8_max, the floor, saturation), GemmFp8FwdOp's reference against a float64
product of the dequantised operands written out element by element, quantise -> GEMM round
trips, the checks' messages for scales of the wrong granularity and dtype params, and the
torch._scaled_mm peer against the reference (it runs on the CPU too). The generic harness covers
the workloads, the bad-input corpus and fake tensors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.ops import Fp8QuantFwdOp, GemmFp8FwdOp, dequantise
from tileops.signature import SignatureCallError

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
GRANULARITIES = ("tensor", "row", "group", "block")


def _scale_shape(g: str, r: int, c: int) -> tuple[int, ...]:
    return {"tensor": (), "row": (r, 1), "group": (r, math.ceil(c / 128)),
            "block": (math.ceil(r / 128), math.ceil(c / 128))}[g]


def _block_of(g: str, i: int, j: int) -> tuple[int, int]:
    """The scale index of element ``(i, j)``."""
    return {"tensor": (0, 0), "row": (i, 0), "group": (i, j // 128),
            "block": (i // 128, j // 128)}[g]


def _amax_by_loop(x: torch.Tensor, g: str) -> dict[tuple[int, int], float]:
    out: dict[tuple[int, int], float] = {}
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            key = _block_of(g, i, j)
            out[key] = max(out.get(key, 0.0), abs(float(x[i, j])))
    return out


@pytest.mark.parametrize("g", GRANULARITIES)
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
def test_quantise_follows_the_scale_convention(g, fp8):
    # 130 x 260: blocks and groups that overhang both extents
    torch.manual_seed(0)
    x = torch.randn(130, 260, dtype=torch.float32) * 3
    x[5, 7] = 1000.0  # one block's maximum far above the rest
    q, scale = Fp8QuantFwdOp(granularity=g, fp8_dtype=fp8).fp64_reference(x)
    assert scale.shape == _scale_shape(g, 130, 260)
    amax = _amax_by_loop(x, g)
    flat = scale.reshape(-1, 1) if g == "tensor" else scale
    for (bi, bj), a in amax.items():
        assert flat[bi, bj].item() == pytest.approx(a / FMAX[fp8], rel=1e-12)
    assert q.abs().max().item() <= FMAX[fp8]
    # the maximum of each block lands on +-fp8_max exactly
    assert q[5, 7].item() == pytest.approx(FMAX[fp8], rel=1e-12)
    # q * scale gives x back (the reference's q is unrounded in float64)
    torch.testing.assert_close(dequantise(q, scale, g), x.double(), rtol=1e-12, atol=1e-12)


def test_quantise_through_the_reference_target_rounds_to_fp8():
    x = torch.randn(64, 384, dtype=torch.bfloat16)
    q, scale = Fp8QuantFwdOp(granularity="group")(x)
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (64, 3)
    # one fp8 rounding: e4m3 keeps 3 mantissa bits, a relative error of at most 2^-4
    err = (dequantise(q, scale, "group") - x.float()).abs()
    assert bool((err <= x.float().abs() * 2**-4 + scale.repeat_interleave(128, 1) * 2**-9).all())


def test_an_all_zero_block_has_the_floored_scale_and_zeros():
    x = torch.zeros(3, 200, dtype=torch.float32)
    x[:, 128:] = 1.0
    q, scale = Fp8QuantFwdOp(granularity="group").fp64_reference(x)
    assert scale[:, 0].tolist() == [pytest.approx(1e-12 / 448.0, rel=1e-12)] * 3
    assert scale[:, 1].tolist() == [pytest.approx(1 / 448.0, rel=1e-12)] * 3
    assert bool((q[:, :128] == 0).all()) and bool((q[:, 128:] == 448.0).all())


def test_empty_inputs_give_floored_scales():
    q, scale = Fp8QuantFwdOp(granularity="tensor").fp64_reference(torch.zeros(0, 5))
    assert q.shape == (0, 5) and scale.shape == () and scale.item() == pytest.approx(1e-12 / 448)
    q, scale = Fp8QuantFwdOp(granularity="row").fp64_reference(torch.zeros(4, 0))
    assert scale.shape == (4, 1)
    q, scale = Fp8QuantFwdOp(granularity="group").fp64_reference(torch.zeros(4, 0))
    assert scale.shape == (4, 0)


def _dequantised_by_loop(q: torch.Tensor, scale: torch.Tensor, g: str) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float64)
    s = scale.reshape(1, 1) if g == "tensor" else scale
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            out[i, j] = float(q[i, j]) * float(s[_block_of(g, i, j)])
    return out


_OPERAND = {"tensor": ("tensor", "tensor"), "row": ("row", "row"), "block": ("group", "block")}


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 70), k=st.integers(1, 270),
       scaling=st.sampled_from(["tensor", "row", "block"]),
       fp8=st.sampled_from([(E4M3, E4M3), (E5M2, E5M2)]),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_gemm_reference_is_the_product_of_the_dequantised_operands(m, n, k, scaling, fp8,
                                                                   bias, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).to(fp8[0])
    b = torch.randn(n, k, generator=gen).to(fp8[1])
    ga, gb = _OPERAND[scaling]
    sa = torch.rand(_scale_shape(ga, m, k), generator=gen) + 0.5
    sb = torch.rand(_scale_shape(gb, n, k), generator=gen) + 0.5
    bv = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    op = GemmFp8FwdOp(scaling=scaling)
    (c,) = op.fp64_reference(a, b, sa, sb, bv)
    want = _dequantised_by_loop(a, sa, ga) @ _dequantised_by_loop(b, sb, gb).T
    if bias:
        want += bv.double()
    torch.testing.assert_close(c, want, rtol=1e-12, atol=1e-12)
    out = op(a, b, sa, sb, bv)  # the reference target: float32, one rounding to bfloat16
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    torch.testing.assert_close(out.double(), want, rtol=2**-7, atol=1e-3 * want.abs().max().item())


@pytest.mark.parametrize("scaling", ["tensor", "row", "block"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_quantise_then_gemm_approximates_the_full_precision_product(scaling, out_dtype):
    torch.manual_seed(1)
    x = torch.randn(40, 384, dtype=torch.bfloat16)
    w = torch.randn(136, 384, dtype=torch.bfloat16)
    ga, gb = _OPERAND[scaling]
    qa, sa = Fp8QuantFwdOp(granularity=ga)(x)
    qb, sb = Fp8QuantFwdOp(granularity=gb)(w)
    c = GemmFp8FwdOp(scaling=scaling, out_dtype=out_dtype)(qa, qb, sa, sb)
    assert c.dtype == out_dtype
    want = x.double() @ w.double().T
    rel = (c.double() - want).norm() / want.norm()
    # two fp8 roundings of e4m3 (u = 2^-4, about 0.45 u each in L2 over random values)
    assert rel.item() < 0.06


def test_a_scale_of_another_granularity_is_refused_by_name():
    a = torch.randn(4, 300).to(E4M3)
    b = torch.randn(5, 300).to(E4M3)
    with pytest.raises(SignatureCallError) as exc:
        GemmFp8FwdOp(scaling="block")(a, b, torch.ones(4, 1), torch.ones(1, 3))
    text = str(exc.value)
    assert text.startswith("GemmFp8FwdOp: argument a_scale does not match the signature\n"
                           "  expected: a_scale: Tensor[float32, [M, ceil_div(K, 128)]]  "
                           "(declared AScale[scaling, M, K])\n"
                           "  seen:     a_scale: f32[4, 1]\n"
                           "  because:  a_scale.shape[1] must be ceil_div(K, 128) = 3, but is 1")
    with pytest.raises(SignatureCallError) as exc:
        GemmFp8FwdOp(scaling="row")(a, b, torch.ones(4, 1), torch.ones(5, 1), torch.ones(5))
    assert "  because:  bias.dtype must be bfloat16, but is float32\n" in str(exc.value)


def test_the_operands_must_be_fp8_of_one_dtype():
    a = torch.randn(4, 32).to(E4M3)
    with pytest.raises(SignatureCallError) as exc:
        GemmFp8FwdOp()(a, torch.randn(5, 32, dtype=torch.bfloat16), torch.tensor(1.0),
                       torch.tensor(1.0))
    assert "  because:  T bound to float8_e4m3fn by a.dtype, but b.dtype is bfloat16\n" in str(exc.value)
    with pytest.raises(SignatureCallError) as exc:
        GemmFp8FwdOp()(a, torch.randn(5, 32).to(E5M2), torch.tensor(1.0), torch.tensor(1.0))
    assert ("  because:  T bound to float8_e4m3fn by a.dtype, but b.dtype is float8_e5m2\n"
            in str(exc.value))


def test_dtype_params_take_torch_dtypes_or_names():
    op = GemmFp8FwdOp(scaling="row", out_dtype=torch.float16)
    assert op.out_dtype == "float16" and repr(op) == "GemmFp8FwdOp(scaling='row', out_dtype='float16')"
    assert Fp8QuantFwdOp(fp8_dtype=E5M2).fp8_dtype == "float8_e5m2"
    with pytest.raises(Exception, match="out_dtype must be one of bfloat16, float16, float32"):
        GemmFp8FwdOp(out_dtype=torch.int8)


@pytest.mark.parametrize("scaling", ["tensor", "row"])
def test_the_scaled_mm_peer_matches_the_reference(scaling):
    op = GemmFp8FwdOp(scaling=scaling)
    peers = op.contenders()
    assert "scaled_mm_blockwise" not in peers
    torch.manual_seed(2)
    a = torch.randn(24, 64).to(E4M3)
    b = torch.randn(32, 64).to(E4M3)
    sa, sb = ((torch.tensor(0.5), torch.tensor(2.0)) if scaling == "tensor"
              else (torch.rand(24, 1) + 0.5, torch.rand(32, 1) + 0.5))
    bias = torch.randn(32).to(torch.bfloat16)
    (want,) = op.fp64_reference(a, b, sa, sb, bias)
    for name in ("torch._scaled_mm", "torch._scaled_mm_fast"):
        got = peers[name](a, b, sa, sb, bias)
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-2)
    # torch's eager equivalent rounds the dequantised operands to bfloat16 before its matmul
    eager = peers["torch"](a, b, sa, sb, bias)
    assert ((eager.double() - want).norm() / want.norm()).item() < 1e-2


def test_block_scaling_has_no_scaled_mm_peer():
    peers = GemmFp8FwdOp(scaling="block").contenders()
    assert "torch._scaled_mm" not in peers and "torch._scaled_mm_fast" not in peers


def test_the_torch_contenders_survive_torch_compile():
    # the contenders spread scales by a gather: torch.compile (inductor, torch 2.13)
    # miscomputed repeat_interleave(...)[:, :c] and the fp8 cast of a padded view's slice
    # where c is not a whole number of blocks (the last group read as zeros)
    torch.manual_seed(3)
    x = torch.randn(6, 300, dtype=torch.bfloat16)
    quant = Fp8QuantFwdOp(granularity="group").eager()
    (q, s), (q0, s0) = torch.compile(quant, dynamic=False)(x), quant(x)
    assert torch.equal(q.float(), q0.float()) and torch.equal(s, s0)
    b, sb = Fp8QuantFwdOp(granularity="block")(torch.randn(130, 300, dtype=torch.bfloat16))
    gemm = GemmFp8FwdOp(scaling="block").eager()
    got = torch.compile(gemm, dynamic=False)(q, b, s, sb)
    torch.testing.assert_close(got, gemm(q, b, s, sb), rtol=0, atol=0)
