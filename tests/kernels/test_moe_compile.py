"""The mixture-of-experts kernels on a machine without a GPU: the launch facts each
implementation derives from a call (the tile, which calls share a built entry, the region) over
the input space, and one program for each code path lowering and compiling for sm_90 (why it
exists is on its line) with what its source must show."""

import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels import grouped_gemm as G
from tileops.kernels import moe as K

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")

CONTIGUOUS, MASKED = G.GroupedLayoutKind.CONTIGUOUS, G.GroupedLayoutKind.MASKED


def _spec(**kw):
    base = dict(device="cpu", m=4096, e=8, n=256, k=512, dtype="bfloat16", trans_b=True,
                layout=CONTIGUOUS)
    return G.GroupedGemmSpec(**{**base, **kw})


# --- launch facts -----------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(m=st.integers(0, 1 << 17), e=st.integers(1, 512), max_m=st.integers(1, 1024),
       masked=st.booleans())
def test_the_tile_follows_the_rows_an_expert(m, e, max_m, masked) -> None:
    spec = _spec(m=m, e=e, layout=MASKED if masked else CONTIGUOUS,
                 max_m=max_m if masked else 0)
    cfg = G.choose_config(spec)
    rows = max_m if masked else m // e
    assert cfg.block_m == (128 if rows >= 128 else 64)
    assert cfg.threads == 2 * cfg.block_m  # a warpgroup a 64-row half
    # a contiguous call's rows matter only through the tile: one entry serves every M of it
    if not masked and m:
        same = G.GroupedGemmKernel.identity(_spec(m=(m // e) * e or 1, e=e))
        other = G.GroupedGemmKernel.identity(spec)
        assert (same == other) == (G.choose_config(_spec(m=(m // e) * e or 1, e=e)) == cfg)


def test_per_row_metadata_is_outside_the_kernel_region() -> None:
    refusal = G.GroupedGemmKernel.region_refusal(_spec(per_row=True))
    assert refusal == ("serves offsets or masked metadata (an expert per row is served by the "
                       "reference target)")
    assert G.GroupedGemmKernel.region_refusal(_spec()) is None


@pytest.mark.parametrize(("kw", "error", "text"), [
    (dict(dtype="float32"), ValueError,
     "GroupedGemmSpec.dtype must be one of bfloat16, float16, got 'float32'"),
    (dict(layout="masked"), TypeError,
     "GroupedGemmSpec.layout must be a GroupedLayoutKind, got 'masked'"),
    (dict(layout=MASKED), ValueError,
     "GroupedGemmSpec.max_m is the masked block's rows (> 0) and 0 for contiguous, got 0 for "
     "masked"),
    (dict(k=-1), ValueError, "GroupedGemmSpec.k must be a size (an int >= 0), got -1"),
])
def test_a_bad_grouped_gemm_spec_is_refused(kw, error, text) -> None:
    with pytest.raises(error) as info:
        _spec(**kw)
    assert str(info.value) == text


def test_a_gating_spec_checks_its_groups() -> None:
    with pytest.raises(ValueError) as info:
        K.MoeGatingSpec(device="cpu", e=10, top_k=2, dtype="bfloat16", scoring="softmax",
                        renormalize=True, num_groups=4, topk_groups=1, scale=1.0, bias=False)
    assert str(info.value) == "MoeGatingSpec.num_groups must divide e = 10, got 4"


@given(h=st.integers(1, 1 << 16), dtype=st.sampled_from(["bfloat16", "float16"]))
def test_rows_move_in_16_byte_vectors_where_they_divide(h, dtype) -> None:
    assert K.row_vector(h, dtype) == (8 if h % 8 == 0 else 1)


# --- programs ---------------------------------------------------------------------------------


@needs_nvcc
@pytest.mark.parametrize(("e", "n", "k", "dtype", "trans_b", "layout", "max_m", "cfg"), [
    # the bar's shape: contiguous offsets walked by the scheduler, 128-row tiles, cp.async
    pytest.param(64, 2048, 4096, "bfloat16", True, CONTIGUOUS, 0, G._WIDE, id="contiguous-nt"),
    # masked blocks of an odd K (no 16-byte rows): 64-row tiles, b stored (E, K, N)
    pytest.param(8, 200, 7, "float16", False, MASKED, 96, G._NARROW, id="masked-nn-odd-k"),
])
def test_grouped_gemm_compiles_for_sm90(e, n, k, dtype, trans_b, layout, max_m, cfg):
    src = G.build_grouped_gemm(e, n, k, dtype, trans_b, layout, max_m, cfg,
                               "sm_90").get_kernel_source()
    assert f"__launch_bounds__({cfg.threads}, 1)" in src
    assert "wgmma" in src  # T.gemm lowers to warpgroup MMA
    assert "tma_load" not in src  # the plain pipeline (the tile's rows are known late)
    if layout is CONTIGUOUS:
        assert f"for (int g = 0; g < {e}; ++g)" in src  # the scheduler's walk of the offsets
        assert "int M)" in src  # the rows are a launch-time size
    else:
        assert "min(max(Meta[" in src  # the block's count, clamped


@needs_nvcc
def test_gating_compiles_for_sm90():
    # DeepSeek-V3's routing: sigmoid scores, a correction bias, 8 groups of 32, top-4 groups
    src = K.build_gating(256, 8, "float32", "sigmoid", True, 8, 4, 2.5, True,
                         "sm_90").get_kernel_source()
    assert "__launch_bounds__(128, 1)" in src
    assert "float choice[256]" in src and "int kept[8]" in src
    assert "Bias[" in src and "expf(" in src


@needs_nvcc
@pytest.mark.parametrize(("e", "k", "dtype", "scoring", "renormalize", "scale"), [
    # Mixtral's: softmax over 8 (the row's max and exponential sum), renormalised top-2
    pytest.param(8, 2, "bfloat16", "softmax", True, 1.0, id="mixtral-softmax"),
    # DeepSeek-V3's: sigmoid over 256, renormalised top-8 scaled by 2.5
    pytest.param(256, 8, "float32", "sigmoid", True, 2.5, id="deepseek-sigmoid"),
])
def test_gating_gradient_compiles_for_sm90(e, k, dtype, scoring, renormalize, scale):
    src = K.build_gating_bwd(e, k, dtype, scoring, renormalize, scale,
                             "sm_90").get_kernel_source()
    assert "__launch_bounds__(128, 1)" in src
    # only the picks are held (no row of E in local memory); each column finds its picks
    assert f"float picked[{k}]" in src and f"float g[{k}]" in src and f"[{e}]" not in src
    assert "Ids[" in src and "expf(" in src
    assert ("max(acc[0]" in src) is (scoring == "softmax")  # only softmax reads the row's max


@needs_nvcc
@pytest.mark.parametrize(("h", "dtype", "vector"), [
    pytest.param(7168, "bfloat16", True, id="16-byte-rows"),
    pytest.param(4097, "float16", False, id="odd-row-elementwise"),
])
def test_permutations_compile_for_sm90(h, dtype, vector):
    unperm = K.build_unpermute(h, 8, dtype, "sm_90").get_kernel_source()
    assert "__launch_bounds__(128, 1)" in unperm
    assert ("uint4" in unperm) is vector
    assert "if (0 <= src)" in unperm  # a dropped pick contributes nothing
    if vector:  # the gather (its element-wise path is the unpermutation's) and the gates'
        perm = K.build_permute(h, dtype, "sm_90").get_kernel_source()
        assert "uint4" in perm and "Src[" in perm  # the gather reads each row's token
        # the gates' gradient: a warp a token, its sums reduced by shuffles
        grad = K.build_gate_grad(h, 8, dtype, "sm_90").get_kernel_source()
        assert "__launch_bounds__(32, 1)" in grad and "__shfl_down_sync" in grad
        assert "uint4" in grad
