"""The top-k kernel lowers and compiles for sm_90 on a machine without a GPU: one program for
each code path (why it exists is on its line), and what each must show in its source."""

import shutil

import pytest

from tileops.kernels import topk

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")


@needs_nvcc
@pytest.mark.parametrize(("n", "k", "dtype", "largest", "lean"), [
    pytest.param(128256, 50, "bfloat16", True, True, id="vocab-lean-float-filter"),
    pytest.param(128256, 50, "bfloat16", True, False, id="vocab-earlier-plan-key-filter"),
    pytest.param(131072, 1024, "bfloat16", True, True, id="k1024-piece-maxima-large-buffer"),
    pytest.param(7, 2, "float32", False, True, id="tiny-one-warp-32-bit-keys-smallest"),
    pytest.param(4096, 200, "bfloat16", True, True, id="lean-sort-above-threads-bitonic"),
])
def test_topk_compiles_for_sm90(n, k, dtype, largest, lean):
    plan = topk.topk_plan(n, k, dtype, lean)
    threads, vec, _, cap, sort, _ = plan
    src = topk.build_topk(n, k, dtype, largest, "sm_90", plan).get_kernel_source()
    assert f"__launch_bounds__({threads}" in src
    assert "AtomicAddRet" in src  # the buffer's and the sort array's appends
    assert "__shfl_up_sync" in src  # the bins' scan
    if vec * topk._ITEMSIZE[dtype] == 16:
        assert "uint4" in src
    # the bitonic stages, or (lean, no more entries than threads) each entry put at its rank
    ranked = lean and sort <= threads
    assert (f"for (int a = 1; a < {sort.bit_length()}; ++a)" in src) is not ranked
    assert "(uint)4294967295 -" in src  # the composite key's complemented index
    assert ("isnan(" in src) is lean  # the lean pass compares floats, NaN passing
    assert f"< {cap})" in src  # the buffer's bound on the appends
