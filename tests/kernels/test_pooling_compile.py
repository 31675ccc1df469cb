"""The pooling programs lower and compile for sm_90 on a machine without a GPU.

Each compiled configuration stands for code paths of the generated programs (why on its
line); the launch plan is checked over the space of calls without compiling, and the index
arithmetic against torch in tests/ops/test_pooling.py.
"""

import math
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
    # max without indices: each window's maximum found again (the forward's scan, nested):
    # 18 taps in each of 2 x 2 x 2 windows, unrolled; at a stride of 1, 18 x 18, looped
    pytest.param(spec(batch=2, channels=3, size_in=(7, 9, 11), size_out=(6, 4, 5),
                      kernel=(2, 3, 3), stride=(1, 2, 2), dilation=(1, 1, 1)),
                 id="max3d-rescan"),
    pytest.param(spec(batch=2, channels=3, size_in=(7, 9, 11), size_out=(6, 7, 9),
                      kernel=(2, 3, 3), stride=(1, 1, 1), dilation=(1, 1, 1)),
                 id="max3d-rescan-looped"),
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
        before = src.split(f"for (int tw = 0; tw < {kw}; ++tw)")[0].splitlines()[-2]
        nested = kd * kh * kw * gd * gh * gw
        assert ("#pragma unroll" in before) is (nested <= 4 * P._UNROLL_TAPS)
    assert "atomic" not in src  # a gather: every input element written once


@given(n=st.integers(1, 1 << 12), batch=st.integers(1, 1 << 12))
def test_plan_covers_every_element(n, batch):
    s = spec(batch=batch, channels=1, size_in=(1, 1, n), size_out=(1, 1, n), kernel=(1, 1, 1),
             stride=(1, 1, 1))
    threads, per = P.pool_plan(s)
    assert threads % 32 == 0 and per in (1, 4)
    assert (per == 4) == (n * batch >= 1 << 20)  # four outputs a thread where they abound


# --- the programs run on the host, against torch's CPU pooling ------------------------------------


def _host_run():
    """tests/kernels/_host_run.py, beside this file (the test modules import as files)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import _host_run

    return _host_run


def _host_pool(s, tensors, backward=False, plan=None):
    """Run the program of ``s`` (under ``plan``, else the default) on the host
    (tests/kernels/_host_run.py) over the numpy arrays ``tensors`` (by the program's names:
    X, Y, IDX; DY, X, IDX, DX), every thread of its launch in a forked child; the outputs land
    in those arrays (shared memory)."""
    src = P.build_pool_kernel(s, "sm_90", backward=backward, plan=plan).get_kernel_source()
    threads, per, *rest = plan or P.pool_plan(s)
    n = P._inputs(s) // P.gradient_run(s) if backward else P._outputs(s) // (
        1 if rest and rest[0] else P.forward_run(s))
    grid = (max(1, -(-n // (threads * per))), 1)
    if rest and rest[0]:  # a plane a row of the grid
        positions = math.prod(s.size_out)
        grid = (-(-positions // (threads * per)), s.batch * s.channels)
    crashed = _host_run().run_kernel(src, tensors, grid, threads)
    assert crashed is None, (s, crashed)


def _host_forward(s, x, y, idx, channels_last, np):
    """Run the forward of ``s`` on the host over ``x`` (stored channels last where asked) and
    hold it to torch's ``y`` (max: exactly, with the int64 indices ``idx`` where given;
    average: within a float32 rounding of the sum's order). Returns the input and the indices
    as the program read and wrote them (None without indices)."""
    shared_array = _host_run().shared_array
    perm = (0, *range(2, x.dim()), 1)
    xs = x.permute(perm) if channels_last else x  # channels-last memory order
    X = np.ascontiguousarray(xs.numpy())
    Y = shared_array(np, y.numel(), np.float32, np.nan)
    tensors = {"X": X, "Y": Y}
    IDX = None
    if idx is not None:
        IDX = shared_array(np, idx.numel(), np.int64, -1)
        tensors["IDX"] = IDX
    _host_pool(s, tensors)
    want = (y.permute(perm) if channels_last else y).contiguous().numpy().reshape(-1)
    if s.kind is P.PoolKind.MAX:
        assert np.array_equal(Y, want, equal_nan=True)
        want_idx = None if idx is None else (idx.permute(perm) if channels_last else
                                             idx).contiguous().numpy()
        assert idx is None or np.array_equal(IDX, want_idx.reshape(-1))
    else:
        assert np.allclose(Y, want, rtol=2e-6, atol=1e-7)
    return X, IDX


POOLS = [
    # (kind, dims, kwargs, channels-last): ResNet's stem with indices; dilated, ceil_mode and
    # channels-last; average pooling without the padding, with ceil_mode; a divisor override;
    # every window whole (a constant divisor of 9, multiplied by its reciprocal and
    # corrected); 3-D; 1-D; adaptive windows of uneven length
    ("max", 2, dict(kernel_size=3, stride=2, padding=1, return_indices=True), False),
    ("max", 2, dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 1), dilation=(2, 1),
                    ceil_mode=True, return_indices=True), True),
    ("avg", 2, dict(kernel_size=3, stride=2, padding=1, ceil_mode=True,
                    count_include_pad=False), False),
    ("avg", 2, dict(kernel_size=(3, 2), stride=2, padding=(1, 0), divisor_override=5), True),
    ("avg", 2, dict(kernel_size=3, stride=2), False),
    ("max", 3, dict(kernel_size=(2, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1),
                    return_indices=True), False),
    ("avg", 1, dict(kernel_size=4, stride=3, padding=2, ceil_mode=True), False),
    ("adaptive_max", 2, dict(output_size=(4, 5), return_indices=True), False),
    ("adaptive_avg", 2, dict(output_size=(8, 3)), False),
]


def _pool_case(kind, dims, kw, channels_last, torch, size=None):
    """The PoolSpec of a torch call over a random float32 input (of ``size``, else the
    dims' own), and torch's result."""
    F = torch.nn.functional
    if size is None:
        size = {1: (11, 37), 2: (3, 5, 13, 17), 3: (2, 3, 7, 9, 11)}[dims]
        if dims == 1:
            size = (2,) + size  # N, C, L
    gen = torch.Generator().manual_seed(3)
    if "max" in kind:  # small integers: ties, where torch keeps the first maximum; a NaN
        x = torch.randint(-3, 4, size, generator=gen).float()
        x.view(-1)[size[-1] + 2] = float("nan")
    else:
        x = torch.randn(size, generator=gen)
    fn = getattr(F, f"{kind}_pool{dims}d")
    got = fn(x, **kw)
    y, idx = got if isinstance(got, tuple) else (got, None)
    pad3 = lambda v, fill: (fill,) * (3 - dims) + (  # noqa: E731
        tuple(v) if isinstance(v, (tuple, list)) else (v,) * dims)
    adaptive = kind.startswith("adaptive")
    s = P.PoolSpec(
        device=None, kind=P.PoolKind.MAX if "max" in kind else P.PoolKind.AVG,
        adaptive=adaptive,
        layout=P.PoolLayout.CHANNELS_LAST if channels_last else P.PoolLayout.PLANES,
        batch=size[0], channels=size[1], size_in=pad3(size[2:], 1),
        size_out=pad3(tuple(y.shape[2:]), 1),
        kernel=(1, 1, 1) if adaptive else pad3(kw["kernel_size"], 1),
        stride=(1, 1, 1) if adaptive else pad3(kw.get("stride", kw["kernel_size"]), 1),
        padding=(0, 0, 0) if adaptive else pad3(kw.get("padding", 0), 0),
        dilation=(1, 1, 1) if adaptive else pad3(kw.get("dilation", 1), 1),
        count_include_pad=kw.get("count_include_pad", True),
        divisor=kw.get("divisor_override") or 0, indices=idx is not None, dtype="float32")
    return s, x, y, idx


#: (kind, dims, kwargs, size): forwards whose threads take two neighbouring windows (the
#: output's W even): the stem's max with indices over ties and a NaN, its average, ceil_mode
#: without the padding in the divisor, 1-D, 3-D, a divisor override
FORWARD_RUNS = [
    ("max", 2, dict(kernel_size=3, stride=2, padding=1, return_indices=True), (2, 3, 12, 16)),
    ("max", 2, dict(kernel_size=3, stride=2, padding=1), (2, 3, 13, 15)),
    ("avg", 2, dict(kernel_size=3, stride=2, padding=1), (2, 3, 12, 16)),
    ("avg", 2, dict(kernel_size=3, stride=2, padding=1, ceil_mode=True,
                    count_include_pad=False), (2, 3, 11, 18)),
    ("avg", 1, dict(kernel_size=4, stride=3, padding=2), (2, 3, 35)),
    ("max", 3, dict(kernel_size=(2, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1),
                    return_indices=True), (2, 3, 5, 7, 12)),
    ("avg", 2, dict(kernel_size=(3, 4), stride=(2, 3), divisor_override=7), (2, 3, 9, 20)),
]


@needs_nvcc
@pytest.mark.parametrize(("kind", "dims", "kw", "size"), FORWARD_RUNS)
def test_forward_runs_along_w_match_torch_on_the_host(kind, dims, kw, size, monkeypatch):
    """The forward a thread two neighbouring windows (from any size here: the threshold is
    lowered), run on the host: torch's values, and its int64 indices where asked."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(P, "_FORWARD_RUN_FROM", 0)

    s, x, y, idx = _pool_case(kind, dims, kw, False, torch, size=size)
    assert P.forward_run(s) == 2
    _host_forward(s, x, y, idx, False, np)


def test_forward_runs_only_for_large_calls_of_overlapping_windows():
    stem = dict(kind=P.PoolKind.MAX, adaptive=False, layout=P.PoolLayout.PLANES, batch=32,
                channels=64, size_in=(1, 112, 112), size_out=(1, 56, 56), kernel=(1, 3, 3),
                stride=(1, 2, 2), padding=(0, 1, 1), dilation=(1, 1, 1),
                count_include_pad=True, divisor=0, indices=False, dtype="bfloat16")
    assert P.forward_run(P.PoolSpec(device=None, **stem)) == 2
    for change in (dict(batch=1), dict(kernel=(1, 2, 2)), dict(size_out=(1, 56, 55)),
                   dict(layout=P.PoolLayout.CHANNELS_LAST), dict(dilation=(1, 1, 2))):
        assert P.forward_run(P.PoolSpec(device=None, **{**stem, **change})) == 1, change


#: (kind, dims, kwargs, size, run): gradients a thread a run of W's stride (W a multiple of
#: it): the bar's 3 x 3 at a stride of 2, padded with ceil_mode (windows past W's end), the
#: stem's with indices, 2 x 2 (a window a run), a stride of 3 over windows of 4 (a window past
#: both ends), clipped windows' divisors, 3-D, and W odd (no run)
RUNS = [
    ("avg", 2, dict(kernel_size=3, stride=2), (3, 5, 13, 18), 2),
    ("avg", 2, dict(kernel_size=3, stride=2, padding=1, ceil_mode=True,
                    count_include_pad=False), (2, 3, 11, 16), 2),
    ("max", 2, dict(kernel_size=3, stride=2, padding=1, return_indices=True), (2, 3, 12, 16),
     2),
    ("avg", 2, dict(kernel_size=2, stride=2, divisor_override=3), (2, 3, 8, 14), 2),
    ("max", 2, dict(kernel_size=2, stride=2, return_indices=True), (2, 3, 8, 14), 2),
    ("avg", 1, dict(kernel_size=4, stride=3, padding=2, ceil_mode=True), (2, 3, 36), 3),
    ("max", 1, dict(kernel_size=4, stride=3, padding=2, return_indices=True), (2, 3, 36), 3),
    ("avg", 3, dict(kernel_size=(2, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1)),
     (2, 3, 5, 7, 10), 2),
    ("avg", 2, dict(kernel_size=3, stride=2), (3, 5, 13, 17), 1),
]


@needs_nvcc
@pytest.mark.parametrize(("kind", "dims", "kw", "size", "run"), RUNS)
def test_gradient_runs_along_w_match_torch_on_the_host(kind, dims, kw, size, run):
    """The gradient a thread a run of W's stride, run on the host: torch autograd's gradient
    (max through the forward's indices, over small integers: ties and a NaN)."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    shared_array = _host_run().shared_array

    s, x, y, idx = _pool_case(kind, dims, kw, False, torch, size=size)
    assert P.gradient_run(s) == run
    xg = x.clone().requires_grad_()
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    got = getattr(torch.nn.functional, f"{kind}_pool{dims}d")(xg, **kw)
    (got[0] if isinstance(got, tuple) else got).backward(dy)
    DX = shared_array(np, x.numel(), np.float32, np.nan)
    grads = {"DY": np.ascontiguousarray(dy.numpy()).reshape(-1),
             "X": np.ascontiguousarray(x.numpy()).reshape(-1), "DX": DX}
    if idx is not None:
        grads["IDX"] = np.ascontiguousarray(idx.numpy()).reshape(-1)
    _host_pool(s, grads, backward=True)
    assert np.allclose(DX, xg.grad.numpy().reshape(-1), rtol=2e-6, atol=1e-6, equal_nan=True), (
        float(np.nanmax(np.abs(DX - xg.grad.numpy().reshape(-1)))))


@needs_nvcc
@pytest.mark.parametrize(("kind", "dims", "kw", "channels_last"), POOLS)
def test_programs_match_torch_on_the_host(kind, dims, kw, channels_last):
    """The generated forward (and, in planes, the gradient) run on the host thread by thread:
    max pooling's values and int64 indices exactly torch's (inputs of small integers, so
    windows tie and the first maximum must win, and a NaN), average pooling's values within a
    float32 rounding of the sum's order, the gradients torch autograd's (max through the
    forward's indices or by finding each window's maximum again)."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    shared_array = _host_run().shared_array

    s, x, y, idx = _pool_case(kind, dims, kw, channels_last, torch)
    X, IDX = _host_forward(s, x, y, idx, channels_last, np)
    if channels_last:
        return  # the gradient program serves the planes layout
    xg = x.clone().requires_grad_()
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    got = getattr(torch.nn.functional, f"{kind}_pool{dims}d")(xg, **kw)
    (got[0] if isinstance(got, tuple) else got).backward(dy)
    for with_indices in ({True, False} if idx is not None else {False}):
        sb = P.PoolSpec(**{**{f: getattr(s, f) for f in P._SPEC_FIELDS}, "device": None,
                           "indices": with_indices})
        DX = shared_array(np, x.numel(), np.float32, np.nan)
        grads = {"DY": np.ascontiguousarray(dy.numpy()).reshape(-1), "X": X.reshape(-1),
                 "DX": DX}
        if with_indices:
            grads["IDX"] = IDX
        _host_pool(sb, grads, backward=True)
        assert np.allclose(DX, xg.grad.numpy().reshape(-1), rtol=2e-6, atol=1e-6,
                           equal_nan=True), (
            with_indices, float(np.nanmax(np.abs(DX - xg.grad.numpy().reshape(-1)))))


@needs_nvcc
@pytest.mark.parametrize(("kind", "dims", "kw", "channels_last"),
                         [c for c in POOLS if "max" in c[0]])
def test_max_without_indices_matches_torch_on_the_host(kind, dims, kw, channels_last):
    """Max pooling without indices keeps no position: the running maximum is fmaxf and a flag
    says whether the window held a NaN. The values are torch's (ties, a NaN, padding, a
    dilated window, adaptive windows of uneven length, channels last)."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    shared_array = _host_run().shared_array
    s, x, y, _ = _pool_case(kind, dims, kw, channels_last, torch)
    s = P.PoolSpec(**{**{f: getattr(s, f) for f in P._SPEC_FIELDS}, "device": None,
                      "indices": False})
    perm = (0, *range(2, x.dim()), 1)
    xs = x.permute(perm) if channels_last else x
    Y = shared_array(np, y.numel(), np.float32, -7.0)
    _host_pool(s, {"X": np.ascontiguousarray(xs.numpy()), "Y": Y})
    want = (y.permute(perm) if channels_last else y).contiguous().numpy().reshape(-1)
    assert np.isnan(want).any()  # the case's NaN is in some window
    assert np.array_equal(Y, want, equal_nan=True)


@needs_nvcc
@pytest.mark.parametrize("ceil_mode", [False, True])
def test_max_without_indices_reads_clamped_taps_unmasked_on_the_host(ceil_mode):
    """Without indices and without dilation, a tap in the padding reads the input's edge
    unmasked: that edge element is a tap of the same window, and a duplicate changes no
    maximum. Edges of +inf, -inf and NaN, and a window whose only large value is its edge,
    give torch's values."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    shared_array = _host_run().shared_array
    x = torch.randint(-3, 4, (2, 3, 8, 9), generator=torch.Generator().manual_seed(7)).float()
    x[0, 0, 0, :] = math.inf
    x[0, 1, :, -1] = -math.inf
    x[1, 2, -1, 4] = math.nan
    x[1, 1, 0, 0] = 50.0
    kw = dict(kernel_size=3, stride=2, padding=1, ceil_mode=ceil_mode)
    y = torch.nn.functional.max_pool2d(x, **kw)
    s = P.PoolSpec(device=None, kind=P.PoolKind.MAX, adaptive=False,
                   layout=P.PoolLayout.PLANES, batch=2, channels=3, size_in=(1, 8, 9),
                   size_out=(1, *y.shape[2:]), kernel=(1, 3, 3), stride=(1, 2, 2),
                   padding=(0, 1, 1), dilation=(1, 1, 1), count_include_pad=True, divisor=0,
                   indices=False, dtype="float32")
    src = P.build_pool_kernel(s, "sm_90").get_kernel_source()
    # every tap keeps its value: the mask a constant all-ones, computed from no condition
    assert "& -1) | (-8388608 & (~-1))" in src and "condval = -1" not in src
    Y = shared_array(np, y.numel(), np.float32, 7.0)
    _host_pool(s, {"X": np.ascontiguousarray(x.numpy()), "Y": Y})
    assert np.array_equal(Y, y.numpy().reshape(-1), equal_nan=True)


@needs_nvcc
@pytest.mark.parametrize("kw", [dict(kernel_size=3, stride=2), dict(kernel_size=2),
                                dict(kernel_size=3, stride=2, divisor_override=5)])
def test_average_of_infinities_and_nan_is_torch_s_on_the_host(kw):
    """A constant divisor's multiplication and correction keep IEEE division's answers where
    the sum is not finite: +inf and -inf windows give infinities, a window with both or a NaN
    gives NaN; the finite windows are torch's within float32 rounding. The gradient's division
    of dy (infinite there too) is held the same way."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    shared_array = _host_run().shared_array
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 9, 11, generator=gen)
    x[0, 0, 0, 0], x[0, 1, 4, 4], x[1, 2, 2, 6] = math.inf, -math.inf, math.nan
    x[1, 0, 0, 0], x[1, 0, 0, 1] = math.inf, -math.inf
    y = torch.nn.functional.avg_pool2d(x, **kw)
    s = P.PoolSpec(device=None, kind=P.PoolKind.AVG, adaptive=False,
                   layout=P.PoolLayout.PLANES, batch=2, channels=3, size_in=(1, 9, 11),
                   size_out=(1, *y.shape[2:]), kernel=(1, *[kw["kernel_size"]] * 2),
                   stride=(1, *[kw.get("stride", kw["kernel_size"])] * 2), padding=(0, 0, 0),
                   dilation=(1, 1, 1), count_include_pad=True,
                   divisor=kw.get("divisor_override", 0), indices=False, dtype="float32")
    Y = shared_array(np, y.numel(), np.float32, 7.0)
    _host_pool(s, {"X": np.ascontiguousarray(x.numpy()), "Y": Y})
    want = y.numpy().reshape(-1)
    assert not np.isfinite(want).all()
    assert np.array_equal(np.isnan(Y), np.isnan(want))
    assert np.array_equal(Y[np.isinf(want)], want[np.isinf(want)])
    ok = np.isfinite(want)
    assert np.allclose(Y[ok], want[ok], rtol=2e-6, atol=1e-7)
    dy = torch.randn(y.shape, generator=gen)
    dy[0, 0, 0, 0], dy[1, 1, 1, 1] = math.inf, -math.inf
    xg = torch.zeros_like(x, requires_grad=True)
    torch.nn.functional.avg_pool2d(xg, **kw).backward(dy)
    DX = shared_array(np, x.numel(), np.float32, 7.0)
    _host_pool(s, {"DY": dy.numpy().reshape(-1), "X": np.ascontiguousarray(x.numpy()),
                   "DX": DX}, backward=True)
    want = xg.grad.numpy().reshape(-1)
    assert np.array_equal(np.isinf(DX), np.isinf(want)) and not np.isfinite(want).all()
    assert np.array_equal(DX[np.isinf(want)], want[np.isinf(want)])
    ok = np.isfinite(want)
    assert np.allclose(DX[ok], want[ok], rtol=2e-6, atol=1e-6)


@needs_nvcc
@pytest.mark.parametrize("channels_last", [False, True])
def test_taps_outside_the_input_read_nothing_on_the_host(channels_last):
    """A tap outside the input loads the position clamped into it (every load of a window in
    flight at once) and reads as -inf: with a dilation of 2 and a padding of 1, each window's
    taps fall on odd rows and columns, the taps left of and below the input clamp to even ones,
    and every even row and column holds NaN or +inf, which no window holds. The values and
    indices are torch's."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    shared_array = _host_run().shared_array
    x = torch.randint(-3, 4, (1, 2, 7, 9), generator=torch.Generator().manual_seed(5)).float()
    x[..., ::2, :] = float("nan")
    x[..., 1::2, ::2] = float("inf")
    kw = dict(kernel_size=3, stride=2, padding=1, dilation=2, return_indices=True)
    y, idx = torch.nn.functional.max_pool2d(x, **kw)
    assert y.isfinite().all()  # no window holds an even row or column
    s = P.PoolSpec(device=None, kind=P.PoolKind.MAX, adaptive=False,
                   layout=P.PoolLayout.CHANNELS_LAST if channels_last else P.PoolLayout.PLANES,
                   batch=1, channels=2, size_in=(1, 7, 9), size_out=(1, *y.shape[2:]),
                   kernel=(1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), dilation=(1, 2, 2),
                   count_include_pad=True, divisor=0, indices=True, dtype="float32")
    perm = (0, 2, 3, 1) if channels_last else (0, 1, 2, 3)
    Y = shared_array(np, y.numel(), np.float32, np.nan)
    IDX = shared_array(np, idx.numel(), np.int64, -1)
    _host_pool(s, {"X": np.ascontiguousarray(x.permute(perm).numpy()), "Y": Y, "IDX": IDX})
    assert np.array_equal(Y, y.permute(perm).contiguous().numpy().reshape(-1))
    assert np.array_equal(IDX, idx.permute(perm).contiguous().numpy().reshape(-1))
    # without indices, the NaN flag sees only the taps inside the input
    s = P.PoolSpec(**{**{f: getattr(s, f) for f in P._SPEC_FIELDS}, "device": None,
                      "indices": False})
    Y = shared_array(np, y.numel(), np.float32, np.nan)
    _host_pool(s, {"X": np.ascontiguousarray(x.permute(perm).numpy()), "Y": Y})
    assert np.array_equal(Y, y.permute(perm).contiguous().numpy().reshape(-1))


@needs_nvcc
@pytest.mark.parametrize(("kind", "dims", "kw", "channels_last"),
                         [c for c in POOLS if not c[3]])
@pytest.mark.parametrize("plan", [(256, 2, True), (64, 4, True)])
def test_programs_with_a_plane_a_grid_row_match_torch_on_the_host(kind, dims, kw,
                                                                  channels_last, plan):
    """The forward with a plane a row of the grid (the sweep's ``(threads, per, True)``): a
    thread divides its index into the plane's positions only; the values and indices are the
    default program's, torch's."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    shared_array = _host_run().shared_array
    s, x, y, idx = _pool_case(kind, dims, kw, channels_last, torch)
    Y = shared_array(np, y.numel(), np.float32, np.nan)
    tensors = {"X": np.ascontiguousarray(x.numpy()), "Y": Y}
    if idx is not None:
        tensors["IDX"] = IDX = shared_array(np, idx.numel(), np.int64, -1)
    _host_pool(s, tensors, plan=plan)
    want = y.contiguous().numpy().reshape(-1)
    if s.kind is P.PoolKind.MAX:
        assert np.array_equal(Y, want, equal_nan=True)
        assert idx is None or np.array_equal(IDX, idx.contiguous().numpy().reshape(-1))
    else:
        assert np.allclose(Y, want, rtol=2e-6, atol=1e-7)


@needs_nvcc
@pytest.mark.parametrize("dims", [1, 2])
def test_two_pass_gradient_matches_torch_on_the_host(dims, monkeypatch):
    """A max gradient without indices over a large call (here any call: the threshold set to
    0) runs :func:`P.gradient_programs`' two programs: the forward with indices, then the
    gather from them; the gradient is torch's."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    shared_array = _host_run().shared_array
    monkeypatch.setattr(P, "_TWO_PASS_INPUTS", 0)
    kw = (dict(kernel_size=4, stride=3, padding=2, ceil_mode=True) if dims == 1
          else dict(kernel_size=3, stride=2, padding=1))
    s, x, y, _ = _pool_case("max", dims, {**kw, "return_indices": True}, False, torch)
    s = P.PoolSpec(**{**{f: getattr(s, f) for f in P._SPEC_FIELDS}, "device": None,
                      "indices": False})
    assert P.two_pass(s)
    (fwd, first), (bwd, second) = P.gradient_programs(s)
    assert (first, second) == (False, True) and fwd.indices and bwd.indices
    X = np.ascontiguousarray(x.numpy()).reshape(-1)
    Y = shared_array(np, y.numel(), np.float32, np.nan)
    IDX = shared_array(np, y.numel(), np.int64, -1)
    _host_pool(fwd, {"X": X, "Y": Y, "IDX": IDX})
    DX = shared_array(np, x.numel(), np.float32, np.nan)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(6))
    _host_pool(bwd, {"DY": dy.numpy().reshape(-1), "X": X, "IDX": IDX, "DX": DX},
               backward=True)
    xg = x.clone().requires_grad_()
    getattr(torch.nn.functional, f"max_pool{dims}d")(xg, **kw).backward(dy)
    assert np.allclose(DX, xg.grad.numpy().reshape(-1), rtol=2e-6, atol=1e-6)


@given(n=st.integers(1, 1 << 20), kind=st.sampled_from(list(P.PoolKind)),
       indices=st.booleans())
def test_two_passes_only_for_large_max_gradients_without_indices(n, kind, indices):
    s = spec(kind=kind, indices=indices and kind is P.PoolKind.MAX, batch=1, channels=1,
             size_in=(1, 1, n), size_out=(1, 1, n), kernel=(1, 1, 1), stride=(1, 1, 1))
    programs = P.gradient_programs(s)
    large = n >= P._TWO_PASS_INPUTS
    assert P.two_pass(s) is (kind is P.PoolKind.MAX and not s.indices and large)
    assert programs == ([(P.with_indices(s), False), (P.with_indices(s), True)]
                        if P.two_pass(s) else [(s, True)])
