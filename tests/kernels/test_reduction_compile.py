"""The reduction kernels lower and compile for sm_90 on a machine without a GPU: one program
for each code path the CPU can check (why it exists is on its line), and what its source must
hold; ten programs, each compile seconds. The GPU tests' prebuild compiles the rest (odd rows,
integer and bool columns, every kind)."""

import re
import shutil

import pytest

from tileops.kernels import reduction as K
from tileops.kernels.reduction import ReduceKind as RK

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")


#: a 16-byte vector access, as CUDA spells it for each element type
WIDE = re.compile(r"\*\((uint4|float4|int4|longlong2)\*\)\(X")


def _src(kernel) -> str:
    return kernel.get_kernel_source()


@needs_nvcc
@pytest.mark.parametrize(("kind", "m", "n", "dtype", "wants"), [
    # the bar: a CTA a row, 16-byte loads, cross-warp partials in shared memory
    pytest.param(RK.SUM, 32768, 8192, "bfloat16", ("*(uint4*)(X", "__shfl_xor_sync",
                                                   "__syncthreads"),
                 id="sum-16B-rows"),
    # eight short rows a CTA (a warp each), bool read as bytes
    pytest.param(RK.ALL, 3, 7, "bool", ("const uchar* __restrict__ X", "(uchar)acc"), id="all-bool-tiny"),
    # NaN tests through isnan, the index carried
    pytest.param(RK.ARGMAX, 64, 4096, "float16", ("isnan", "int64_t"), id="argmax"),
    # moments with the shift broadcast from lane 0 (n mod 2^16 >= 2^15)
    pytest.param(RK.VAR_MEAN, 64, 100000, "float32", ("__shfl_sync",), id="var-mean-spread"),
    # one element, correction 1: the divisor is 0, M2 * inf instead of a constant division
    pytest.param(RK.VAR_MEAN, 4, 1, "float32", ("CUDART_INF_F",), id="var-no-freedom"),
])
def test_row_programs_compile_for_sm90(kind, m, n, dtype, wants) -> None:
    src = _src(K.build_row_kernel(kind, m, n, dtype, 1.0 if kind is RK.VAR_MEAN else 0.0,
                                  "sm_90"))
    for w in wants:
        assert w in src, w


@needs_nvcc
@pytest.mark.parametrize(("kind", "outer", "r", "inner", "dtype"), [
    pytest.param(RK.SUM, 1, 32768, 8192, "bfloat16", id="sum-dim0-split"),  # the bar
    pytest.param(RK.ARGMIN, 4, 33, 7, "float16", id="argmin-narrow"),  # tcols < 32
    pytest.param(RK.VAR, 16, 1024, 512, "float32", id="var-middle-dim"),
])
def test_column_programs_compile_for_sm90(kind, outer, r, inner, dtype) -> None:
    src = _src(K.build_column_kernel(kind, outer, r, inner, dtype, 1.0 if kind is RK.VAR
                                     else 0.0, "sm_90"))
    assert "__syncthreads" in src  # the groups' partials meet in shared memory
    wide = K.column_plan(outer, r, inner, dtype)[2] * K._ITEMSIZE[K._storage(dtype)] == 16
    assert bool(WIDE.search(src)) == wide


@needs_nvcc
@pytest.mark.parametrize(("kind", "p", "splits", "dtype"), [
    pytest.param(RK.ARGMAX, 1, 528, "bfloat16", id="argmax-one-row"),
    pytest.param(RK.VAR_MEAN, 3, 2, "float32", id="var-mean-two-outputs"),
])
def test_finish_programs_compile_for_sm90(kind, p, splits, dtype) -> None:
    src = _src(K.build_finish_kernel(kind, p, splits, dtype, 4097,
                                     1.0 if kind is RK.VAR_MEAN else 0.0, "sm_90"))
    assert "__shfl_xor_sync" in src
