"""The scan kernels lower and compile for sm_90 on a machine without a GPU: one program for each
code path (why it exists is on its line), and what each path must show in its source."""

import shutil

import pytest

from tileops.kernels import scan

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")


@needs_nvcc
@pytest.mark.parametrize(("kind", "n", "dtype", "rows"), [
    pytest.param("sum", 4097, "int32", 4097, id="odd-scalar-predicated-into-int64"),
    pytest.param("prod", 7, "float32", 3, id="one-warp-tiny"),
    pytest.param("sum", 1 << 20, "float32", 1, id="long-row-segmented-16B-cross-warp"),
])
def test_row_scan_compiles_for_sm90(kind, n, dtype, rows):
    plan = scan.row_plan(n, dtype, rows)
    threads, vec, _, segs, _ = plan
    src = scan.build_row_scan(kind, n, dtype, False, plan, "sm_90").get_kernel_source()
    assert f"__launch_bounds__({threads}" in src
    assert "__shfl_up_sync" in src  # the warp scan of the thread totals
    if threads > 32:
        assert "__syncthreads" in src  # across warps
    if vec * scan._ITEMSIZE[dtype] == 16:
        assert "uint4" in src or "int4" in src or "float4" in src  # 16-byte loads
    if dtype == "int32":
        assert "int64_t* __restrict__ Y" in src
    if segs > 1:
        tot = scan.build_row_scan(kind, n, dtype, True, plan, "sm_90").get_kernel_source()
        assert "Tot" in tot and "Tot" in src


@needs_nvcc
@pytest.mark.parametrize(("kind", "length", "inner", "dtype", "outer"), [
    pytest.param("sum", 8192, 4096, "bfloat16", 1, id="dim0-segmented"),
    pytest.param("sum", 7, 3, "int64", 5, id="tiny-scalar"),
])
def test_strided_scan_compiles_for_sm90(kind, length, inner, dtype, outer):
    plan = scan.strided_plan(length, inner, dtype, outer)
    threads, _, segs, _ = plan
    src = scan.build_strided_scan(kind, length, inner, dtype, False, plan,
                                  "sm_90").get_kernel_source()
    assert f"__launch_bounds__({threads}" in src
    if segs > 1:
        tot = scan.build_strided_scan(kind, length, inner, dtype, True, plan,
                                      "sm_90").get_kernel_source()
        assert "Tot" in tot
