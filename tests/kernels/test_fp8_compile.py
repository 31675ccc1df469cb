"""The fp8 kernels on a CPU host: their launch plans over the input space, the call specs'
checks, the implementations' regions, the calls that launch nothing, and a handful of programs
compiled for Hopper (nvcc, no GPU): every program of each quantising granularity's plans (a
ragged K, float16 and float32 inputs, e5m2; rows held and rows in steps; the tensor's one-CTA
program and its pair), each without a spill or a stack frame (ptxas), the row bar's program
reading and writing each element once (its SASS), and the GEMM's epilogue-scaled,
block-scaled, decode and unaligned programs."""

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels import fp8_gemm as G
from tileops.kernels import fp8_quant as Q
from tileops.kernels.fp8_gemm import (
    FP8_CONFIGS,
    GemmFp8BlockKernel,
    GemmFp8ScaledKernel,
    GemmFp8Spec,
    Scaling,
    choose_fp8_config,
)
from tileops.kernels.fp8_quant import Fp8QuantKernel, Fp8QuantSpec, Granularity, quant_plan

sys.path.append(str(Path(__file__).parent))  # the ptxas, SASS and host-run helpers, beside this file
from _host_run import HostProgram  # noqa: E402
from _ptxas import assert_asynchronous, ptxas_report, spills  # noqa: E402
from _sass import functions, memory, needs_cuobjdump, sass  # noqa: E402

HOPPER = "sm_90a"
CPU = torch.device("cpu")
#: shared memory an sm_90 CTA may use
SMEM = 227 * 1024


def _have_compiler() -> bool:
    try:
        import tilelang  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/bin/nvcc")


needs_nvcc = pytest.mark.skipif(not _have_compiler(), reason="needs tilelang and nvcc")


def gemm_spec(m=4096, n=4096, k=4096, dtype="float8_e4m3fn", out="bfloat16",
              scaling=Scaling.ROW, bias=False):
    return GemmFp8Spec(device=CPU, m=m, n=n, k=k, a_dtype=dtype, b_dtype=dtype, out_dtype=out,
                       scaling=scaling, has_bias=bias)


def quant_spec(m=100, k=4096, dtype="bfloat16", fp8="float8_e4m3fn", g=Granularity.GROUP):
    return Fp8QuantSpec(device=CPU, m=m, k=k, dtype=dtype, fp8_dtype=fp8, granularity=g)


# --- plans ------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(m=st.integers(0, 20000), n=st.integers(1, 140000), k=st.integers(1, 20000),
       scaling=st.sampled_from(list(Scaling)),
       out=st.sampled_from(["bfloat16", "float16", "float32"]))
def test_gemm_plan_over_the_input_space(m, n, k, scaling, out):
    spec = gemm_spec(m, n, k, out=out, scaling=scaling)
    cfg = choose_fp8_config(spec)
    # TMA exactly where every row is 16-byte aligned
    size = {"bfloat16": 2, "float16": 2, "float32": 4}[out]
    assert cfg.tma == (k % 16 == 0 and n * size % 16 == 0)
    if scaling is Scaling.BLOCK:  # one K step is one scale block, a column tile in one block
        assert cfg.block_k == 128 and 128 % cfg.block_n == 0
    if G.takes_swapped_decode(spec):  # the swapped decode tile: b's 64 rows, a's 16
        assert (cfg.block_m, cfg.block_n) == (16, 64) and cfg.swap
    elif m <= G.DECODE_M:  # decode: 64-row tiles, b streamed by many CTAs
        assert cfg.block_m == 64 and cfg.block_n == 64
    if out == "float32":
        assert cfg.block_m * cfg.block_n <= 128 * 128


@pytest.mark.parametrize(("m", "n", "scaling", "out", "tile"), [
    (8192, 8192, Scaling.ROW, "bfloat16", (128, 256)),  # 16 waves of the largest tile
    (2048, 128256, Scaling.TENSOR, "bfloat16", (128, 256)),
    (128, 4096, Scaling.ROW, "bfloat16", (64, 64)),  # 16 CTAs of 128 x 256 would idle the SMs
    (2048, 4096, Scaling.TENSOR, "float32", (128, 128)),  # no 128 x 256 staged fp32 tile
    (8192, 8192, Scaling.BLOCK, "bfloat16", (128, 128)),
    (256, 4096, Scaling.BLOCK, "bfloat16", (64, 128)),
    (16, 8192, Scaling.BLOCK, "bfloat16", (16, 64)),  # the swapped decode tile
    (17, 8192, Scaling.BLOCK, "bfloat16", (64, 64)),
])
def test_the_wave_model_picks(m, n, scaling, out, tile):
    cfg = choose_fp8_config(gemm_spec(m, n, 4096, out=out, scaling=scaling))
    assert (cfg.block_m, cfg.block_n) == tile


@settings(max_examples=200, deadline=None)
@given(m=st.integers(0, 16), n=st.integers(1, 140000), k=st.integers(1, 40000),
       scaling=st.sampled_from(list(Scaling)))
def test_swapped_decode_plan_over_the_input_space(m, n, k, scaling):
    """The served swapped tile: 16 x 64, two CTAs an SM within the shared memory (and the
    registers ptxas is capped to), K never split (each split ran slower on the GPU); taken
    exactly where the rows are TMA's and the tiles whole."""
    spec = gemm_spec(m, n, k, scaling=scaling)
    cfg = G.swapped_decode_config(spec)
    assert cfg.swap and (cfg.block_m, cfg.block_n, cfg.threads) == (16, 64, 128)
    block = scaling is Scaling.BLOCK
    assert (cfg.block_k, cfg.stages) == ((128, 8) if block else (256, 4))
    assert cfg.resident == 2 and (16 + 64) * cfg.block_k * cfg.stages <= SMEM // 2 - 2 * 1024
    assert cfg.split == 1
    whole = n % 64 == 0 and k % cfg.block_k == 0
    assert G.takes_swapped_decode(spec) == (whole and G.fp8_tma_aligned(n, k, "bfloat16"))
    assert choose_fp8_config(spec).swap == G.takes_swapped_decode(spec)


def test_swapped_decode_is_served_where_the_tiles_are_whole(monkeypatch):
    """On by default: calls of at most 16 rows, every scaling, whose rows meet TMA's
    alignment and whose N and K are whole tiles; the others keep the tiles they took, and
    switched off every call does."""
    assert G.SWAPPED_DECODE
    for spec in (gemm_spec(16, 8192, 8192), gemm_spec(1, 4096, 4096, scaling=Scaling.TENSOR),
                 gemm_spec(16, 14336, 4096, scaling=Scaling.BLOCK)):
        assert choose_fp8_config(spec) == G.swapped_decode_config(spec)
    assert not choose_fp8_config(gemm_spec(17, 8192, 8192)).swap
    assert not choose_fp8_config(gemm_spec(16, 8192 + 16, 8192)).swap  # a part tile of N
    assert not choose_fp8_config(gemm_spec(16, 8192, 8192 + 128)).swap  # a part K step
    assert choose_fp8_config(gemm_spec(16, 8192, 8192 + 128, scaling=Scaling.BLOCK)).swap
    assert choose_fp8_config(gemm_spec(16, 4097, 4095)) == FP8_CONFIGS["decode"]._replace(
        tma=False)
    monkeypatch.setattr(G, "SWAPPED_DECODE", False)
    assert choose_fp8_config(gemm_spec(16, 8192, 8192)) == FP8_CONFIGS["decode"]
    assert choose_fp8_config(gemm_spec(16, 8192, 8192, scaling=Scaling.BLOCK)) == \
        FP8_CONFIGS["block-decode"]


def test_swapped_tiles_are_checked():
    swapped = G.Fp8Config(16, 64, 256, 4, 128, 0, swap=True)
    for bad in (swapped._replace(block_n=96), swapped._replace(block_m=12),
                swapped._replace(block_m=128), swapped._replace(promote=True)):
        with pytest.raises(ValueError, match=r"^a swapped tile is block_n rows of b"):
            G.fp8_gemm_program(4096, 4096, "float8_e4m3fn", "float8_e4m3fn", "bfloat16",
                               Scaling.ROW, False, bad)
    with pytest.raises(ValueError, match=r"^split and resident are the swapped tile's, got "
                                         r"64x64x256/st4s2$"):
        G.fp8_gemm_program(4096, 4096, "float8_e4m3fn", "float8_e4m3fn", "bfloat16",
                           Scaling.ROW, False, FP8_CONFIGS["decode"]._replace(split=2))


@settings(max_examples=200, deadline=None)
@given(m=st.integers(0, 100000), k=st.integers(0, 40000), g=st.sampled_from(list(Granularity)),
       dtype=st.sampled_from(["bfloat16", "float16", "float32"]))
def test_quant_plan_over_the_input_space(m, k, g, dtype):
    plan = quant_plan(quant_spec(m, k, dtype=dtype, g=g))
    chunks = -(-k // 128)
    if g in (Granularity.GROUP, Granularity.BLOCK):
        assert (plan.rows * 128) % plan.threads == 0  # a tile spreads evenly over the threads
        assert 1 <= plan.tiles <= max(chunks, 1)
        if g is Granularity.BLOCK:
            assert (plan.rows, plan.tiles) == (128, 1)  # the tile is the block
        return
    item = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    # the accesses divide the row, cover it, and none lies wholly past it
    assert k % plan.vec == 0 or k == 0
    assert plan.vec * item <= 16
    n = max(k, 1)
    assert plan.tpr * plan.per * plan.vec * plan.steps >= n
    assert plan.tpr * plan.per * plan.vec * (plan.steps - 1) < n
    assert plan.tpr * (plan.per - 1) * plan.vec < n
    # whole warps a CTA; a row of several warps in one CTA of at most ROW_THREADS threads
    assert plan.threads % 32 == 0 and plan.threads <= Q.ROW_THREADS
    assert plan.rpc == 1 or plan.tpr * plan.rpc == 256
    if plan.steps == 1:  # held: at most HELD_BYTES a thread, all of the row read once
        assert plan.per * plan.vec * item <= Q.HELD_BYTES
    else:  # too long to hold with ROW_THREADS threads
        assert n * item > Q.ROW_THREADS * Q.HELD_BYTES or plan.vec * item < 16
        assert plan.tpr == Q.ROW_THREADS and plan.per * plan.vec * item <= Q.STEP_BYTES
    if g is Granularity.TENSOR:
        for sms in (1, 132):
            p = Q.tensor_partials(m, plan, sms)
            assert 1 <= p <= min(Q.TENSOR_PARTIALS, Q.AMAX_CTAS_PER_SM * sms)
            assert p <= max(1, -(-m // plan.rpc))  # no CTA without a row group
        assert Q.tensor_span(k, dtype, plan) >= 1


@pytest.mark.parametrize(("k", "dtype", "plan"), [
    # the bars: a row of 4096 / 8192 bf16 over four warps, four / eight 16-byte accesses each
    (4096, "bfloat16", Q.RowPlan(128, 1, 8, 4, 1)),
    (8192, "bfloat16", Q.RowPlan(128, 1, 8, 8, 1)),
    (4096, "float32", Q.RowPlan(128, 1, 4, 8, 1)),
    # the longest rows held: 512 threads of 128 bytes
    (32768, "bfloat16", Q.RowPlan(512, 1, 8, 8, 1)),
    (16384, "float32", Q.RowPlan(512, 1, 4, 8, 1)),
    # one past them: steps of 64 bytes a thread, read twice
    (32776, "bfloat16", Q.RowPlan(512, 1, 8, 4, 3)),
    (65536, "bfloat16", Q.RowPlan(512, 1, 8, 4, 4)),
    # rows off the vector, and rows shorter than a warp's share, packed 256 threads a CTA
    (4095, "bfloat16", Q.RowPlan(256, 1, 1, 16, 1)),
    (7, "float32", Q.RowPlan(1, 256, 1, 7, 1)),
    (64, "bfloat16", Q.RowPlan(1, 256, 8, 8, 1)),
    (1000, "bfloat16", Q.RowPlan(16, 16, 8, 8, 1)),
])
def test_the_row_plans(k, dtype, plan):
    assert Q.row_plan(k, dtype) == plan


def test_the_programs_of_each_granularity():
    """A row and a group or block: one program; the tensor: the partial maxima and the
    quantiser, and the one-CTA program where a row fits it (64 KiB)."""
    for g in (Granularity.ROW, Granularity.GROUP, Granularity.BLOCK):
        assert [key[0] for key in Q.program_keys(quant_spec(k=4096, g=g))] == ["quant"]
    t = Granularity.TENSOR
    assert [key[0] for key in Q.program_keys(quant_spec(k=4096, g=t))] == [
        "quant", "amax", "tensor_one"]
    assert [key[0] for key in Q.program_keys(quant_spec(k=32768, g=t))] == [
        "quant", "amax", "tensor_one"]
    assert [key[0] for key in Q.program_keys(quant_spec(k=32769, g=t))] == ["quant", "amax"]
    assert [key[0] for key in Q.program_keys(quant_spec(k=16385, dtype="float32", g=t))] == [
        "quant", "amax"]
    assert Q.program_keys(quant_spec(k=0, g=t)) == []
    # the call's choice: the one-CTA program up to 64 KiB of x
    assert Q.one_cta_serves(8, 4096, "bfloat16") and not Q.one_cta_serves(9, 4096, "bfloat16")
    assert Q.one_cta_serves(1, 4096, "bfloat16") and Q.one_cta_serves(3, 7, "float16")
    assert not Q.one_cta_serves(8192, 8192, "bfloat16")


def test_gemm_call_spec_checks():
    with pytest.raises(ValueError, match=r"^GemmFp8Spec: a and b must share one fp8 dtype, "
                                         r"got float8_e4m3fn and float8_e5m2$"):
        GemmFp8Spec(device=CPU, m=1, n=2, k=3, a_dtype="float8_e4m3fn",
                    b_dtype="float8_e5m2", out_dtype="bfloat16", scaling=Scaling.ROW,
                    has_bias=False)
    with pytest.raises(ValueError, match=r"^GemmFp8Spec.out_dtype must be one of bfloat16, "
                                         r"float16, float32, got 'int8'$"):
        gemm_spec(out="int8")
    with pytest.raises(ValueError, match=r"^Fp8QuantSpec.dtype must be one of bfloat16, "
                                         r"float16, float32, got 'float64'$"):
        quant_spec(dtype="float64")


def test_block_scales_need_128_deep_steps():
    with pytest.raises(ValueError, match=r"^block scales need 128-deep K tiles and block_n "
                                         r"dividing 128, got 128x256x128/st3$"):
        G.fp8_gemm_program(4096, 4096, "float8_e4m3fn", "float8_e4m3fn", "bfloat16",
                           Scaling.BLOCK, False, FP8_CONFIGS["128x256"])


def test_a_persistent_grid_serves_epilogue_scales_through_tma():
    with pytest.raises(ValueError, match=r"^a persistent grid serves per-tensor and row-wise "
                                         r"scales through TMA, got block scales and "
                                         r"128x128x128/st4pr$"):
        G.fp8_gemm_program(4096, 4096, "float8_e4m3fn", "float8_e4m3fn", "bfloat16",
                           Scaling.BLOCK, False, FP8_CONFIGS["block"]._replace(persistent=True))
    with pytest.raises(ValueError, match=r"got row scales and 128x256x128/st3/plainp$"):
        G.fp8_gemm_program(4097, 4095, "float8_e4m3fn", "float8_e4m3fn", "bfloat16",
                           Scaling.ROW, False,
                           FP8_CONFIGS["128x256"]._replace(persistent=True, tma=False))


def test_promotion_is_for_one_cta_a_tile_epilogue_scales():
    with pytest.raises(ValueError, match=r"^promote is for one-CTA-a-tile programs of "
                                         r"per-tensor and row-wise scales \(block scales always "
                                         r"promote\), got block scales and 128x128x128/st4r\+$"):
        G.fp8_gemm_program(4096, 4096, "float8_e4m3fn", "float8_e4m3fn", "bfloat16",
                           Scaling.BLOCK, False, FP8_CONFIGS["block"]._replace(promote=True))
    with pytest.raises(ValueError, match=r"got row scales and 128x256x128/st3p\+$"):
        G.fp8_gemm_program(4096, 4096, "float8_e4m3fn", "float8_e4m3fn", "bfloat16",
                           Scaling.ROW, False,
                           FP8_CONFIGS["128x256"]._replace(persistent=True, promote=True))


def test_each_gemm_kernel_states_its_scalings():
    assert GemmFp8ScaledKernel.region_refusal(gemm_spec(scaling=Scaling.BLOCK)) == (
        "serves per-tensor and row-wise scales (block scales change along K)")
    assert GemmFp8ScaledKernel.region_refusal(gemm_spec(scaling=Scaling.TENSOR)) is None
    assert GemmFp8BlockKernel.region_refusal(gemm_spec(scaling=Scaling.ROW)) == (
        "serves block scales (1 x 128 groups of a, 128 x 128 blocks of b)")
    assert GemmFp8BlockKernel.region_refusal(gemm_spec(scaling=Scaling.BLOCK)) is None


def test_calls_that_launch_nothing():
    # K = 0: the empty sum plus the bias; no program is built
    kern = GemmFp8ScaledKernel(gemm_spec(m=3, n=5, k=0, bias=True))
    assert kern.program is None
    c = torch.full((3, 5), 7.0, dtype=torch.bfloat16)
    bias = torch.arange(5, dtype=torch.bfloat16)
    a, b = torch.empty(3, 0, dtype=torch.float8_e4m3fn), torch.empty(5, 0, dtype=torch.float8_e4m3fn)
    kern(a, b, torch.ones(3, 1), torch.ones(5, 1), bias, c)
    assert torch.equal(c, bias.expand(3, 5))
    # no element to quantise: every scale block is empty, its scale the floor's
    quant = Fp8QuantKernel(quant_spec(m=4, k=0, g=Granularity.ROW))
    scale = torch.zeros(4, 1)
    quant(torch.empty(4, 0), torch.empty(4, 0, dtype=torch.float8_e4m3fn), scale)
    assert scale.flatten().tolist() == [pytest.approx(1e-12 / 448.0)] * 4


# --- programs compiled for sm_90 ---------------------------------------------------------------

QUANTS = [
    # (label, M, K, dtype, fp8 dtype, granularity): each plan of each granularity's programs
    # ragged K (a last tile of 127 columns) from float16
    ("group-ragged-fp16", 333, 4095, "float16", "float8_e4m3fn", Granularity.GROUP),
    ("block-e5m2", 4096, 4096, "bfloat16", "float8_e5m2", Granularity.BLOCK),
    # the row bar: held in registers, 16-byte accesses
    ("row-held", 8192, 4096, "bfloat16", "float8_e4m3fn", Granularity.ROW),
    ("row-fp32-short", 3, 7, "float32", "float8_e4m3fn", Granularity.ROW),
    ("row-odd-e5m2", 333, 4095, "bfloat16", "float8_e5m2", Granularity.ROW),
    ("row-longest-held", 16, 32768, "bfloat16", "float8_e4m3fn", Granularity.ROW),
    ("row-long", 16, 65536, "bfloat16", "float8_e4m3fn", Granularity.ROW),
    # the tensor: two programs and the one-CTA program, each plan
    ("tensor", 8192, 8192, "bfloat16", "float8_e4m3fn", Granularity.TENSOR),
    ("tensor-one-row", 1, 4096, "bfloat16", "float8_e4m3fn", Granularity.TENSOR),
    ("tensor-tiny-e5m2", 3, 7, "float16", "float8_e5m2", Granularity.TENSOR),
    ("tensor-long", 16, 65536, "bfloat16", "float8_e4m3fn", Granularity.TENSOR),
]


@pytest.fixture(scope="module")
def ptxas_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fp8_ptxas")


@needs_nvcc
@pytest.mark.parametrize(("m", "k", "dtype", "fp8", "g"), [q[1:] for q in QUANTS],
                         ids=[q[0] for q in QUANTS])
def test_quant_program_compiles(ptxas_dir, m, k, dtype, fp8, g):
    """Each program of the entry (:func:`program_keys`) lowers and compiles for sm_90a, and
    ptxas keeps it in registers: no spill, no stack frame (a held row indexed by a loop ptxas
    did not unroll would live in local memory)."""
    spec = quant_spec(m=m, k=k, dtype=dtype, fp8=fp8, g=g)
    plan = quant_plan(spec)
    keys = Q.program_keys(spec)
    assert keys and keys[0][0] == "quant"
    q_type = "fp8_e5_t* __restrict__ Q" if fp8 == "float8_e5m2" else "fp8_e4_t* __restrict__ Q"
    for key in keys:
        src = Q.BUILDERS[key[0]](*key[1:], HOPPER).get_kernel_source()
        if key[0] != "amax":
            assert q_type in src
        if g in (Granularity.GROUP, Granularity.BLOCK):
            assert "< M" in src  # rows past M are neither read nor written
            if k % 128:
                assert f"< {k}" in src  # nor columns past K
            elif dtype != "float32":
                assert "uint4" in src  # 16-byte loads
            # each thread holds its share of the tile, not the tile (64 floats at most)
            assert f"float xf[{plan.rows * 128 // plan.threads}];" in src
        else:
            # the row (or the step) held in the input's dtype; 16-byte loads where K allows
            ctype = {"bfloat16": "bfloat16_t", "float16": "half_t", "float32": "float"}[dtype]
            assert f"{ctype} held[{plan.per * plan.vec}];" in src or key[0] == "amax"
            assert ("uint4" in src) == (plan.vec * (4 if dtype == "float32" else 2) == 16)
            if key[0] == "quant" and g is Granularity.TENSOR:
                assert "PART[" in src
            if key[0] == "amax":
                assert "PART[" in src
            if key[0] == "tensor_one":
                assert "gridDim" not in src and "blockIdx" not in src  # one CTA
        report = ptxas_report(src, ptxas_dir, f"{key[0]}-{g.value}-{k}-{dtype}")
        found = spills(report)
        assert found and all(f == (0, 0) for f in found), report
        assert "0 bytes stack frame" in report, report


GEMMS = [
    ("row-bias-128x256", 4096, 4096, 4096, "float8_e4m3fn", "bfloat16", Scaling.ROW, True),
    ("block-128x128", 4096, 4096, 4096, "float8_e4m3fn", "bfloat16", Scaling.BLOCK, False),
    ("decode-row-e5m2", 16, 8192, 8192, "float8_e5m2", "float16", Scaling.ROW, False),
    ("tensor-64x128-fp32", 256, 4096, 4096, "float8_e4m3fn", "float32", Scaling.TENSOR, False),
    ("block-64x128", 256, 4096, 4096, "float8_e4m3fn", "bfloat16", Scaling.BLOCK, False),
    ("block-unaligned-bias", 333, 4097, 4095, "float8_e4m3fn", "bfloat16", Scaling.BLOCK,
     True),
]


@needs_nvcc
@pytest.mark.parametrize(("m", "n", "k", "dtype", "out", "scaling", "bias"),
                         [g[1:] for g in GEMMS], ids=[g[0] for g in GEMMS])
def test_gemm_program_compiles(m, n, k, dtype, out, scaling, bias):
    spec = gemm_spec(m=m, n=n, k=k, dtype=dtype, out=out, scaling=scaling, bias=bias)
    cfg = choose_fp8_config(spec)
    src = G.build_fp8_gemm_kernel(n, k, dtype, dtype, out, scaling, bias, cfg,
                                  HOPPER).get_kernel_source()
    kind = "kFloat8_e5m2" if dtype == "float8_e5m2" else "kFloat8_e4m3"
    assert f"wgmma_ss<tl::DataType::{kind}, tl::DataType::{kind}, tl::DataType::kFloat32" in src
    assert ("tma_load" in src) == cfg.tma
    assert ("BIAS[" in src) == bias
    if scaling is Scaling.BLOCK:
        # each step's partial is promoted: a second accumulator, the step's b block scale
        assert src.count("float acc[") == 1 and "SB[" in src
    if not cfg.tma:  # rows past M and N predicated (K's bound moves with the pipeline)
        assert "< M" in src and f"< {n}" in src


SWAPPED = [
    # (id, m, n, k, out, scaling, bias, cfg)
    ("row-bias", 16, 8192, 8192, "bfloat16", Scaling.ROW, True,
     G.Fp8Config(16, 64, 256, 4, 128, 0, swap=True, resident=2)),
    ("tensor-split2", 16, 8192, 8192, "bfloat16", Scaling.TENSOR, False,
     G.Fp8Config(16, 64, 256, 4, 128, 0, swap=True, split=2, resident=2)),
    ("row-split3-x3", 16, 14336, 4096, "float16", Scaling.ROW, False,
     G.Fp8Config(16, 64, 256, 3, 128, 0, swap=True, split=3, resident=3)),
    ("block-split2", 16, 8192, 8192, "bfloat16", Scaling.BLOCK, True,
     G.Fp8Config(16, 64, 128, 8, 128, 0, swap=True, split=2, resident=2)),
    ("block-fp32", 16, 4096, 4096, "float32", Scaling.BLOCK, False,
     G.Fp8Config(16, 64, 128, 8, 128, 0, swap=True, resident=2)),
    ("tensor-128-split4", 16, 8192, 8192, "bfloat16", Scaling.TENSOR, False,
     G.Fp8Config(16, 128, 256, 3, 128, 0, swap=True, split=4, resident=2)),
    ("row-eight-stages", 16, 8192, 8192, "bfloat16", Scaling.ROW, False,
     G.Fp8Config(16, 64, 256, 8, 128, 0, swap=True)),
]


@needs_nvcc
@pytest.mark.parametrize(("m", "n", "k", "out", "scaling", "bias", "cfg"),
                         [c[1:] for c in SWAPPED], ids=[c[0] for c in SWAPPED])
def test_swapped_program_compiles(m, n, k, out, scaling, bias, cfg, tmp_path):
    """The tile transposed: one 64 x 16 wgmma a 32-deep slice (b's rows the 64), TMA loads of
    a's 16 rows (no zero fill), the load warpgroup keeping its registers (no setmaxnreg) and
    ptxas capped for ``resident`` CTAs; unsplit the scales and bias applied and the tile
    stored through shared memory, split the float32 partial stored and nothing scaled (block
    scales: each step promoted, the step's factor read from SA and SB). ptxas: no serialized
    wgmma, no injected wait, no spill."""
    src = G.build_fp8_gemm_kernel(n, k, "float8_e4m3fn", "float8_e4m3fn", out, scaling, bias,
                                  cfg, HOPPER).get_kernel_source()
    wgmma = "tl::DataType::kFloat8_e4m3, tl::DataType::kFloat8_e4m3, tl::DataType::kFloat32, "
    assert f"wgmma_ss<{wgmma}64, 16, 32" in src
    assert "tma_load(A_desc" in src and "tma_load(B_desc" in src
    assert "warpgroup_reg_alloc" not in src and "warpgroup_reg_dealloc" not in src
    assert f"__launch_bounds__(256, {cfg.resident})" in src if cfg.resident > 1 else \
        "__launch_bounds__(256, 1)" in src
    block = scaling is Scaling.BLOCK
    assert ("float acc[" in src) == block
    if cfg.split > 1:
        assert "float* __restrict__ C" in src and "C_desc" not in src and "BIAS[" not in src
        assert ("SA[" in src) == block  # the epilogue scales are the reduction's
    else:
        assert "tma_store(C_desc" in src and ("BIAS[" in src) == bias and "SA[" in src
    report = ptxas_report(src, tmp_path)
    assert_asynchronous(report)


REDUCES = [("row-bias-bf16", 8192, 8192, "bfloat16", Scaling.ROW, True, 2),
           ("tensor-fp32-odd", 4097, 4095, "float32", Scaling.TENSOR, True, 3),
           ("block-fp16", 1000, 1000, "float16", Scaling.BLOCK, False, 4)]


@needs_nvcc
@pytest.mark.parametrize(("n", "k", "out", "scaling", "bias", "split"),
                         [r[1:] for r in REDUCES], ids=[r[0] for r in REDUCES])
def test_split_reduction_on_the_host(n, k, out, scaling, bias, split):
    """The split call's second program, its CUDA run on the host (tests/kernels/_host_run.py)
    against torch: the partials summed in split order in float32, scaled by a's row and b's
    column factor (the two scalars per tensor, none for block scales), the bias added and one
    rounding; rows past M and columns past N (4097, 1000: no whole tile) left unwritten; 16-byte
    loads of the partials where N allows them."""
    kern = G.build_fp8_reduce_kernel(n, k, out, scaling, bias, split, HOPPER)
    src = kern.get_kernel_source()
    assert ("float4" in src) == (n % 4 == 0)
    m = 5
    g = torch.Generator().manual_seed(n + split)
    dt = getattr(torch, out)
    work = torch.randn(split, m, n, generator=g)
    kb = -(-k // 128)
    sa_shape, sb_shape = {Scaling.TENSOR: ((1,), (1,)), Scaling.ROW: ((m, 1), (n, 1)),
                          Scaling.BLOCK: ((m, kb), (-(-n // 128), kb))}[scaling]
    sa = torch.rand(sa_shape, generator=g) + 0.5
    sb = torch.rand(sb_shape, generator=g) + 0.5
    bv = torch.randn(n, generator=g).to(dt)
    c = torch.full((m, n), 7.0).to(dt)
    HostProgram(kern)(work, sa, sb, bv, c)
    acc = work[0].clone()
    for s in range(1, split):
        acc += work[s]
    if scaling is Scaling.ROW:
        acc = acc * (sa * sb.view(1, n))
    elif scaling is Scaling.TENSOR:
        acc = acc * (sa * sb)
    if bias:
        acc = acc + bv.float()
    assert torch.equal(c, acc.to(dt))


@needs_nvcc
def test_promoting_program_compiles():
    """Each step's partial added into a second accumulator, the row scales after the loop."""
    cfg = G.Fp8Config(128, 128, 128, 4, 256, policy="row", promote=True)
    src = G.build_fp8_gemm_kernel(4096, 4096, "float8_e4m3fn", "float8_e4m3fn", "bfloat16",
                                  Scaling.ROW, True, cfg, HOPPER).get_kernel_source()
    assert src.count("float acc[64];") == 1 and "float C_l[64];" in src
    assert "tl::DataType::kFloat32, 64, 128, 32" in src  # one 64 x 128 wgmma a warpgroup
    assert src.index("SA[") > src.rindex("wgmma_ss<")  # the row scales in the epilogue


@needs_nvcc
def test_persistent_program_compiles():
    """132 CTAs walking the tiles; the load warp's registers go to the math warpgroups, which
    scale each tile (rows and columns past M and N scaled by 0) and add the bias."""
    cfg = FP8_CONFIGS["128x256"]._replace(persistent=True)
    src = G.build_fp8_gemm_kernel(4096, 4096, "float8_e4m3fn", "float8_e4m3fn", "bfloat16",
                                  Scaling.ROW, True, cfg, HOPPER).get_kernel_source()
    assert ") / 132)" in src and "blockIdx.y" not in src
    assert "warpgroup_reg_alloc<232>" in src and "warpgroup_reg_dealloc<40>" in src
    assert "SA[" in src and "SB +" in src and "BIAS +" in src and "< M)" in src


def test_the_sweep_candidates_are_valid_programs():
    """benchmarks/fp8.py's candidates: within shared memory, 128-deep steps and block_n
    dividing 128 for block scales, persistent ones only for epilogue scales; the heuristic's
    choice of each swept shape is among them (so the sweep marks it)."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        spec = importlib.util.spec_from_file_location("_fp8_sweep", bench / "fp8.py")
        sweep = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sweep)
    finally:
        sys.path.remove(str(bench))
    for region, cands in [*sweep.CANDIDATES.items(), *sweep.SWAPPED.items()]:
        for cfg in cands:
            smem = (cfg.block_m + cfg.block_n) * cfg.block_k * cfg.stages
            # the resident CTAs' stages (and the staged output tile) within the SM's
            assert (smem + cfg.block_m * cfg.block_n * 2) * cfg.resident <= SMEM, (region, cfg)
            if cfg.swap:  # one math warpgroup: b's 64 or 128 rows, a's 16
                assert cfg.threads == 128 and cfg.block_m == 16, (region, cfg)
            else:  # one math warpgroup for a 64-row tile, two above (wgmma's 64-row forms)
                assert cfg.threads == (128 if cfg.block_m == 64 else 256), (region, cfg)
            if region.startswith("block"):
                assert cfg.block_k == 128 and 128 % cfg.block_n == 0 and not cfg.persistent
    for _, m, n, k in sweep.SHAPES:
        for scaling in Scaling:
            spec = gemm_spec(m, n, k, scaling=scaling)
            chosen = choose_fp8_config(spec)
            cands = sweep.candidates(m, n, k, scaling)
            assert chosen in cands, (m, n, k, scaling)
            if m <= G.SWAP_M:  # the swapped tile the heuristic would take is swept too
                assert G.swapped_decode_config(spec) in cands
    assert [s[0] for s in sweep._shapes("decode")] == [
        "decode-m16-8k", "decode-m16-up", "decode-m1-qo", "decode-m1-up"]


@needs_nvcc
@needs_cuobjdump
def test_the_row_bar_s_program_reads_and_writes_each_element_once(tmp_path):
    """The 8192 x 4096 bf16 row program's SASS: four 16-byte loads a thread (its share of the
    row), four 8-byte stores of the quotients and one of the scale, and nothing else in global
    or local memory: the row is read once and held."""
    plan = quant_plan(quant_spec(m=8192, k=4096, g=Granularity.ROW))
    src = Q.build_quant_kernel(4096, "bfloat16", "float8_e4m3fn", Granularity.ROW, plan,
                               HOPPER).get_kernel_source()
    (ins,) = functions(sass(src, tmp_path, "row")).values()
    got = {op: n for op, n in memory(ins).items() if op.startswith(("LDG", "STG", "LDL", "STL"))}
    assert got == {"LDG.E.128.CONSTANT": 4, "STG.E.64": 4, "STG.E": 1}, got
