"""The top-k kernel lowers and compiles for sm_90 on a machine without a GPU: one program for
each code path (why it exists is on its line), and what each must show in its source."""

import shutil

import pytest

from tileops.kernels import topk

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")


@needs_nvcc
@pytest.mark.parametrize(("n", "k", "dtype", "largest"), [
    pytest.param(128256, 50, "bfloat16", True, id="vocab-16B-thread-maxima"),
    pytest.param(131072, 1024, "bfloat16", True, id="k1024-piece-maxima-large-buffer"),
    pytest.param(7, 2, "float32", False, id="tiny-one-warp-32-bit-keys-smallest"),
])
def test_topk_compiles_for_sm90(n, k, dtype, largest):
    threads, vec, _, cap, sort = topk.topk_plan(n, k, dtype)
    src = topk.build_topk(n, k, dtype, largest, "sm_90").get_kernel_source()
    assert f"__launch_bounds__({threads}" in src
    assert "AtomicAddRet" in src  # the buffer's and the sort array's appends
    assert "__shfl_up_sync" in src  # the bins' scan
    if vec * topk._ITEMSIZE[dtype] == 16:
        assert "uint4" in src
    assert f"for (int a = 1; a < {sort.bit_length()}; ++a)" in src  # the bitonic stages
    assert "(uint)4294967295 -" in src  # the composite key's complemented index
