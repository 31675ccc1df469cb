"""The pooling programs lower and compile for sm_90 on a machine without a GPU.

Each compiled configuration stands for code paths of the generated programs (why on its
line); the launch plan is checked over the space of calls without compiling, and the index
arithmetic against torch in tests/ops/test_pooling.py.
"""

import shutil

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tileops.kernels import pooling as P

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")


def spec(**kw):
    base = dict(device=None, kind=P.PoolKind.MAX, adaptive=False, layout=P.PoolLayout.PLANES,
                batch=32, channels=256, size_in=(1, 112, 112), size_out=(1, 55, 55),
                kernel=(1, 3, 3), stride=(1, 2, 2), padding=(0, 0, 0), dilation=(1, 1, 1),
                count_include_pad=True, divisor=0, indices=False, dtype="bfloat16")
    base.update(kw)
    return P.PoolSpec(**base)


FORWARD = [
    # ResNet's stem with indices: padded taps (bounds tests), the int64 index store, 4 a thread
    pytest.param(spec(channels=64, padding=(0, 1, 1), size_out=(1, 56, 56), indices=True),
                 id="max-stem-indices"),
    # channels-last 3-D average pooling (the output in that order too), the padding
    # excluded, float16, one output a thread (a small call)
    pytest.param(spec(kind=P.PoolKind.AVG, layout=P.PoolLayout.CHANNELS_LAST, batch=2,
                      channels=3, size_in=(7, 9, 11), size_out=(4, 5, 6), kernel=(3, 3, 3),
                      stride=(2, 2, 2), padding=(1, 1, 1), count_include_pad=False, divisor=0,
                      dtype="float16"), id="avg3d-channels-last-exclude-pad"),
    # adaptive max over windows of uneven length (masked taps), float32; 11 x 10 taps, over
    # the unrolled budget: the window loops
    pytest.param(spec(adaptive=True, batch=3, channels=5, size_in=(1, 37, 41),
                      size_out=(1, 4, 5), kernel=(1, 1, 1), stride=(1, 1, 1), indices=True,
                      dtype="float32"), id="adaptive-max-indices-looped"),
]

BACKWARD = [
    # max without indices: each window's maximum found again (the forward's scan, nested)
    pytest.param(spec(batch=2, channels=3, size_in=(7, 9, 11), size_out=(6, 4, 5),
                      kernel=(2, 3, 3), stride=(1, 2, 2), dilation=(1, 1, 1)),
                 id="max3d-rescan"),
    # max from the forward's indices, dilated
    pytest.param(spec(padding=(0, 1, 1), dilation=(1, 2, 2), size_out=(1, 55, 55),
                      indices=True), id="max-indices-dilated"),
    # adaptive average (its divisors): the run of windows holding an element (an output
    # larger than the input)
    pytest.param(spec(kind=P.PoolKind.AVG, adaptive=True, batch=2, channels=4,
                      size_in=(1, 5, 5), size_out=(1, 8, 8), kernel=(1, 1, 1),
                      stride=(1, 1, 1)), id="adaptive-avg-upsample"),
]


@needs_nvcc
@pytest.mark.parametrize("s", FORWARD)
def test_forward_compiles_for_sm90(s):
    src = P.build_pool_kernel(s, "sm_90").get_kernel_source()
    threads, _ = P.pool_plan(s)
    assert f"__launch_bounds__({threads}" in src
    assert ("int64_t* __restrict__ IDX" in src) is s.indices
    if s.kind is P.PoolKind.MAX:
        assert "isnan(" in src and "CUDART_INF_F" in src  # NaN wins; the scan starts at -inf
    else:
        assert " / ((float)" in src  # the sum over the divisor, in float32
    kd, kh, kw = P.taps(s)
    before = src.split(f"for (int tw = 0; tw < {kw}; ++tw)")[0].splitlines()[-2]
    assert ("#pragma unroll" in before) is (kd * kh * kw <= P._UNROLL_TAPS)  # long ones loop


@needs_nvcc
@pytest.mark.parametrize("s", BACKWARD)
def test_gradient_compiles_for_sm90(s):
    src = P.build_pool_kernel(s, "sm_90", backward=True).get_kernel_source()
    assert ("IDX" in src) is s.indices
    if s.kind is P.PoolKind.MAX and not s.indices:
        assert "isnan(" in src  # the forward's scan, found again
        kd, kh, kw = P.taps(s)
        gd, gh, gw = P.gather_taps(s)
        before = src.split(f"for (int uw = 0; uw < {kw}; ++uw)")[0].splitlines()[-2]
        nested = kd * kh * kw * gd * gh * gw  # 18 x 18 here: the scan inside loops
        assert ("#pragma unroll" in before) is (nested <= 4 * P._UNROLL_TAPS)
    assert "atomic" not in src  # a gather: every input element written once


@given(n=st.integers(1, 1 << 12), batch=st.integers(1, 1 << 12))
def test_plan_covers_every_element(n, batch):
    s = spec(batch=batch, channels=1, size_in=(1, 1, n), size_out=(1, 1, n), kernel=(1, 1, 1),
             stride=(1, 1, 1))
    threads, per = P.pool_plan(s)
    assert threads % 32 == 0 and per in (1, 4)
    assert (per == 4) == (n * batch >= 1 << 20)  # four outputs a thread where they abound
