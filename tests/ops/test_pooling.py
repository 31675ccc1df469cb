"""The pooling family on CPU: what the ops accept is what torch accepts, and the kernels'
index arithmetic and scan rule (``emulate``, the CPU mirror of the programs) give torch's
outputs, indices and gradients over the space of windows, strides, paddings, dilations and
ceil_mode (ties and NaNs included). The generic harness covers the workloads' numerics, the
bad-input corpus, compile, fake tensors and gradients through the reference target.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import tileops.ops as O
from tileops.kernels import pooling as K
from tileops.ops.pooling import _layout, per_axis
from tileops.runtime import IN_TREE, Kernel
from tileops.signature import ConstructionError, SignatureCallError
from tileops.spec.primitives import pool_out

MAX = {1: O.MaxPool1dFwdOp, 2: O.MaxPool2dFwdOp, 3: O.MaxPool3dFwdOp}
AVG = {1: O.AvgPool1dFwdOp, 2: O.AvgPool2dFwdOp, 3: O.AvgPool3dFwdOp}
MAX_BWD = {1: O.MaxPool1dBwdOp, 2: O.MaxPool2dBwdOp, 3: O.MaxPool3dBwdOp}
AVG_BWD = {1: O.AvgPool1dBwdOp, 2: O.AvgPool2dBwdOp, 3: O.AvgPool3dBwdOp}
F_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
F_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}

REFUSED = (ConstructionError, SignatureCallError)


@st.composite
def windows(draw, max_pool: bool, valid: bool = True):
    """``(nd, sizes, params)``: a pooling call's spatial sizes and the op's params, each an
    int or a tuple per axis. ``valid``: inside torch's rules (padding at most half the
    kernel, a positive output, and for 3-D average pooling no input axis shorter than the
    kernel); else anything small, for comparing refusals."""
    nd = draw(st.integers(1, 3))
    sizes = tuple(draw(st.integers(1 if valid else 0, 9)) for _ in range(nd))
    k = tuple(draw(st.integers(1, 4)) for _ in range(nd))
    s = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    hi = [kk // 2 for kk in k] if valid else [kk for kk in k]
    p = tuple(draw(st.integers(0, h)) for h in hi)
    d = tuple(draw(st.integers(1, 2)) for _ in range(nd)) if max_pool else (1,) * nd
    ceil = draw(st.booleans())
    if valid:
        outs = [pool_out(n, *w, ceil) for n, *w in zip(sizes, k, s, p, d,
                                                                 strict=True)]
        assume(all(o > 0 for o in outs))
        if nd == 3 and not max_pool:  # avg_pool3d's own rule
            assume(all(n >= kk for n, kk in zip(sizes, k, strict=True)))

    def spell(t):  # an int where every axis agrees, half the time
        return t[0] if len(set(t)) == 1 and draw(st.booleans()) else t

    params = {"kernel_size": spell(k), "padding": spell(p), "ceil_mode": ceil}
    if draw(st.booleans()):
        params["stride"] = spell(s)
    elif valid:  # stride None: the kernel size
        outs = [pool_out(n, kk, kk, pp, dd, ceil)
                for n, kk, pp, dd in zip(sizes, k, p, d, strict=True)]
        assume(all(o > 0 for o in outs))
    if max_pool:
        params["dilation"] = spell(d)
    return nd, sizes, params


def values(shape, draw_nan: bool, seed: int) -> torch.Tensor:
    """Small integers (many ties in a window), and a few NaNs where asked: float32 values
    that every comparison and sum of the tests holds exactly."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, shape, generator=g).float()
    if draw_nan:
        x[torch.rand(shape, generator=g) < 0.1] = math.nan
    return x


def spec_of(op, x, y, indices=False) -> K.PoolSpec:
    return op._spec(None, x.dtype, tuple(x.shape), tuple(y.shape), K.PoolLayout.PLANES,
                    indices)


# --- the ops accept what torch accepts ----------------------------------------------------------


@settings(max_examples=36, deadline=None)
@given(w=windows(max_pool=True, valid=False), batch=st.sampled_from([(), (0,), (2,)]),
       channels=st.sampled_from([0, 3]), avg=st.booleans())
@example(w=(2, (1, 1), {"kernel_size": (1, 2), "padding": (0, 1), "ceil_mode": False,
                        "dilation": (1, 2)}), batch=(), channels=3, avg=False)
def test_refused_exactly_where_torch_refuses(w, batch, channels, avg):
    """Windows, paddings and sizes (empty ones included) that torch refuses are refused; and
    max pooling also refuses, by name, exactly the calls where torch gives a window whose taps
    all fall in the padding -inf (of finite inputs -inf comes from no other window)."""
    nd, sizes, params = w
    x = torch.randn((*batch, channels, *sizes))
    if avg:
        params = {k: v for k, v in params.items() if k != "dilation"}
        op_cls, fn = AVG[nd], F_AVG[nd]
    else:
        op_cls, fn = MAX[nd], F_MAX[nd]
    try:
        want = fn(x, **params)
    except RuntimeError:
        want = None
    if not avg and want is not None and torch.isneginf(fn(torch.zeros(1, 1, *sizes),
                                                          **params)).any():
        # (checked by shape, so with no batch entry or channel too)
        with pytest.raises(ValueError, match=r"has every tap in the padding"):
            op_cls(**params)(x)
        return
    try:
        got = op_cls(**params)(x)
    except REFUSED:
        got = None
    assert (got is None) == (want is None), (params, x.shape)
    if want is not None:  # the output alone, as torch's
        assert got.shape == want.shape  # the lets over pool.out are torch's output sizes
        torch.testing.assert_close(got, want)


@settings(max_examples=25, deadline=None)
@given(batch=st.sampled_from([(), (0,), (2,)]), channels=st.sampled_from([0, 3]),
       h=st.integers(0, 4), w=st.integers(0, 4), out=st.integers(2, 3), avg=st.booleans())
def test_adaptive_refused_exactly_where_torch_refuses(batch, channels, h, w, out, avg):
    """(An output of 1 is left out: torch's adaptive_avg_pool2d takes it as a mean over the
    spatial axes, without the checks of its other sizes.)"""
    x = torch.randn((*batch, channels, h, w))
    op_cls, fn = ((O.AdaptiveAvgPool2dFwdOp, F.adaptive_avg_pool2d) if avg else
                  (O.AdaptiveMaxPool2dFwdOp, F.adaptive_max_pool2d))
    try:
        want = fn(x, out)
    except RuntimeError:
        want = None
    try:
        got = op_cls(output_size=out)(x)
    except REFUSED:
        got = None
    assert (got is None) == (want is None), x.shape
    if want is not None:
        assert got.shape == want.shape


def test_padding_over_half_the_kernel_is_refused_by_name():
    with pytest.raises(ConstructionError) as e:
        O.MaxPool2dFwdOp(kernel_size=3, padding=2)
    assert str(e.value).splitlines()[:4] == [
        "MaxPool2dFwdOp: construction param padding, kernel_size does not match the signature",
        "  expected: 0 <= pH <= kH // 2 and 0 <= pW <= kW // 2",
        "  seen:     pH = 2, kH = 3, pW = 2, kW = 3",
        "  because:  refinement '0 <= pH <= kH // 2 and 0 <= pW <= kW // 2' does not hold",
    ]


@pytest.mark.parametrize(("cls", "params"), [
    (O.MaxPool2dFwdOp, dict(kernel_size=2, stride=2**31)),
    (O.MaxPool1dFwdOp, dict(kernel_size=2, dilation=2**31)),
    (O.AvgPool3dFwdOp, dict(kernel_size=(2, 2, 2**31))),
    (O.MaxPool2dBwdOp, dict(kernel_size=2, stride=(1, 2**40))),
    (O.AdaptiveAvgPool2dFwdOp, dict(output_size=2**40)),
    (O.AdaptiveMaxPool2dFwdOp, dict(output_size=(3, 2**31))),
])
def test_window_params_past_int32_are_refused_at_construction(cls, params):
    """torch's kernels take the window (and an adaptive output size) as C ints and refuse
    more with a bare message; here the spec's rule names the op and the params, before any
    call (an adaptive output size past it reached the output's allocation)."""
    with pytest.raises(ConstructionError) as exc:
        cls(**params)
    assert str(exc.value).startswith(f"{cls.__name__}: construction param ")
    assert "< 2147483648" in str(exc.value).splitlines()[1]
    wide = {k: (2**31 - 1 if v == 2**31 else v) for k, v in params.items()
            if not isinstance(v, tuple)}
    if wide and cls is O.MaxPool2dFwdOp:  # the largest C int is served, as torch serves it
        x = torch.randn(1, 1, 4, 4)
        torch.testing.assert_close(cls(**wide)(x), F.max_pool2d(x, **wide))


def test_an_empty_output_is_refused_by_name():
    with pytest.raises(SignatureCallError) as e:
        O.AvgPool2dFwdOp(kernel_size=5)(torch.randn(1, 2, 4, 9))
    lines = str(e.value).splitlines()
    assert lines[0] == "AvgPool2dFwdOp: argument input does not match the signature"
    assert lines[3] == ("  because:  refinement 'H_out > 0 and W_out > 0' does not hold "
                        "(H_out = 0, W_out = 1)")


def test_a_second_batch_axis_is_refused_by_name():
    with pytest.raises(SignatureCallError) as e:
        O.MaxPool1dFwdOp(kernel_size=2)(torch.randn(2, 2, 3, 8))
    assert "refinement 'len(B) <= 1' does not hold (B = [2, 2])" in str(e.value)


def test_a_zero_divisor_override_is_refused_by_name():
    with pytest.raises(ConstructionError) as e:
        O.AvgPool2dFwdOp(kernel_size=2, divisor_override=0)
    assert ("refinement 'not present(divisor_override) or divisor_override.value != 0' does "
            "not hold") in str(e.value)


def test_window_params_as_torch_spells_them():
    x = torch.randn(2, 3, 10, 12)
    # a list, an int, stride None (the kernel), a one-element tuple
    got = O.MaxPool2dFwdOp(kernel_size=[3, 2], padding=(1,))(x)
    torch.testing.assert_close(got, F.max_pool2d(x, [3, 2], padding=(1,)), rtol=0, atol=0)
    op = O.AvgPool3dFwdOp(kernel_size=(1, 2, 3), stride=[1, 2, 1])
    assert op._kernel == (1, 2, 3) and op._stride == (1, 2, 1)
    assert MAX[1](kernel_size=3)._kernel == (1, 1, 3)
    assert per_axis(None, 2, (3, 2)) == (3, 2) and per_axis((4,), 3) == (4, 4, 4)


def test_max_pool_returns_indices_when_asked():
    x = torch.randn(2, 3, 9, 9)
    y, idx = O.MaxPool2dFwdOp(kernel_size=3, stride=2, return_indices=True)(x)
    ry, ridx = F.max_pool2d(x, 3, 2, return_indices=True)
    assert torch.equal(y, ry) and torch.equal(idx, ridx) and idx.dtype == torch.int64
    op = O.MaxPool2dFwdOp(kernel_size=3, stride=2)
    y = op(x)  # the output alone without return_indices, as torch's
    assert isinstance(y, torch.Tensor) and torch.equal(y, ry)
    assert op.returned_outputs == ("output",) and op.eager()(x).shape == ry.shape


# --- the kernels' arithmetic is torch's ----------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(w=windows(max_pool=True), nan=st.booleans(), seed=st.integers(0, 2**16))
def test_max_scan_gives_torchs_values_and_indices(w, nan, seed):
    """Ties take the first maximum in scan order, a NaN wins (the last NaN's position)."""
    nd, sizes, params = w
    x = values((2, 3, *sizes), nan, seed)
    op = MAX[nd](**params)
    want, want_idx = F_MAX[nd](x, **params, return_indices=True)
    y, idx = K.emulate(spec_of(op, x, want, True), x)
    assert torch.equal(idx.reshape(want.shape), want_idx)
    torch.testing.assert_close(y.reshape(want.shape), want, rtol=0, atol=0, equal_nan=True)


@settings(max_examples=30, deadline=None)
@given(w=windows(max_pool=False), include=st.booleans(), divisor=st.sampled_from([None, 3]),
       seed=st.integers(0, 2**16))
def test_average_divisors_are_torchs(w, include, divisor, seed):
    nd, sizes, params = w
    params["count_include_pad"] = include
    if nd > 1:
        params["divisor_override"] = divisor
    x = values((2, 3, *sizes), False, seed)
    want = F_AVG[nd](x.double(), **params)
    y, _ = K.emulate(spec_of(AVG[nd](**params), x, want), x)
    torch.testing.assert_close(y.reshape(want.shape).double(), want)


@settings(max_examples=25, deadline=None)
@given(h=st.integers(1, 12), w=st.integers(1, 12), ho=st.integers(1, 8), wo=st.integers(1, 8),
       nan=st.booleans(), seed=st.integers(0, 2**16))
def test_adaptive_windows_are_torchs(h, w, ho, wo, nan, seed):
    x = values((2, 3, h, w), nan, seed)
    want, want_idx = F.adaptive_max_pool2d(x, (ho, wo), return_indices=True)
    spec = spec_of(O.AdaptiveMaxPool2dFwdOp(output_size=(ho, wo)), x, want, True)
    y, idx = K.emulate(spec, x)
    assert torch.equal(idx.reshape(want.shape), want_idx)
    torch.testing.assert_close(y.reshape(want.shape), want, rtol=0, atol=0, equal_nan=True)
    want = F.adaptive_avg_pool2d(x.double(), (ho, wo))
    y, _ = K.emulate(spec_of(O.AdaptiveAvgPool2dFwdOp(output_size=(ho, wo)), x, want), x)
    torch.testing.assert_close(y.reshape(want.shape).double(), want, equal_nan=True)


@settings(max_examples=25, deadline=None)
@given(h=st.integers(1, 12), w=st.integers(1, 12), ho=st.integers(1, 8), wo=st.integers(1, 8),
       given_indices=st.booleans(), seed=st.integers(0, 2**16))
def test_adaptive_gradient_gathers_are_torchs(h, w, ho, wo, given_indices, seed):
    """An input element's windows are the run floor(i * Out / In) to ceil((i + 1) * Out /
    In): windows that overlap (Out > In / 2) and outputs larger than the input included."""
    x = values((2, 3, h, w), False, seed).double().requires_grad_()
    dy = torch.randn(2, 3, ho, wo, dtype=torch.float64)
    y, idx = F.adaptive_max_pool2d(x, (ho, wo), return_indices=True)
    (want,) = torch.autograd.grad(y, x, dy)
    op = O.AdaptiveMaxPool2dBwdOp(output_size=(ho, wo))
    got = K.emulate_bwd(spec_of(op, x.detach().float(), y.float(), given_indices), dy,
                        x.detach().float(), idx if given_indices else None)
    torch.testing.assert_close(got.reshape(want.shape), want)
    (want,) = torch.autograd.grad(F.adaptive_avg_pool2d(x, (ho, wo)), x, dy)
    op = O.AdaptiveAvgPool2dBwdOp(output_size=(ho, wo))
    got = K.emulate_bwd(spec_of(op, x.detach().float(), y.float()), dy, x.detach().float())
    torch.testing.assert_close(got.reshape(want.shape), want)


def test_adaptive_taps_cover_the_longest_window():
    assert K.adaptive_taps(37, 5) == 9  # [14, 23)
    assert K.adaptive_taps(5, 8) == 2  # an output larger than the input: windows of 1 and 2
    assert K.adaptive_taps(7, 1) == 7


@settings(max_examples=25, deadline=None)
@given(w=windows(max_pool=True), given_indices=st.booleans(), seed=st.integers(0, 2**16))
def test_max_gradient_gather_is_torchs(w, given_indices, seed):
    """Each window's gradient lands on its maximum, found from the indices or by the scan.
    (A dilated window wholly in the padding is left out: its output is -inf, and torch adds
    its gradient at its index, an element outside the window, which the gather drops.)"""
    nd, sizes, params = w
    x = values((2, 3, *sizes), False, seed).double().requires_grad_()
    y, idx = F_MAX[nd](x, **params, return_indices=True)
    assume(not y.isinf().any())
    dy = torch.randn_like(y)
    (want,) = torch.autograd.grad(y, x, dy)
    op = MAX_BWD[nd](**params)
    got = K.emulate_bwd(spec_of(op, x.detach().float(), y.float(), given_indices), dy,
                        x.detach().float(), idx if given_indices else None)
    torch.testing.assert_close(got.reshape(want.shape), want)


@settings(max_examples=25, deadline=None)
@given(w=windows(max_pool=False), include=st.booleans(), divisor=st.sampled_from([None, 3]),
       seed=st.integers(0, 2**16))
def test_average_gradient_gather_is_torchs(w, include, divisor, seed):
    nd, sizes, params = w
    params["count_include_pad"] = include
    if nd > 1:
        params["divisor_override"] = divisor
    x = values((2, 3, *sizes), False, seed).double().requires_grad_()
    y = F_AVG[nd](x, **params)
    dy = torch.randn_like(y)
    (want,) = torch.autograd.grad(y, x, dy)
    op = AVG_BWD[nd](**params)
    got = K.emulate_bwd(spec_of(op, x.detach().float(), y.float()), dy, x.detach().float())
    torch.testing.assert_close(got.reshape(want.shape), want)


# --- the ops' own flow ---------------------------------------------------------------------------


def test_layouts_read_in_place():
    x = torch.randn(2, 3, 5, 7)
    assert _layout(x, 2) == (x, K.PoolLayout.PLANES)
    cl = x.to(memory_format=torch.channels_last)
    got, layout = _layout(cl, 2)
    assert got is cl and layout is K.PoolLayout.CHANNELS_LAST
    cl3 = torch.randn(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d)
    assert _layout(cl3, 3)[1] is K.PoolLayout.CHANNELS_LAST
    # an unbatched 3-D input of channels-last strides: no channels-last form, copied (torch's
    # max_pool3d refuses it; the op pools its values)
    assert _layout(cl, 3)[1] is K.PoolLayout.PLANES
    y = O.MaxPool3dFwdOp(kernel_size=2)(cl)
    assert y.is_contiguous() and torch.equal(y, F.max_pool3d(cl.contiguous(), 2))
    strided = x[..., ::2]
    got, layout = _layout(strided, 2)
    assert layout is K.PoolLayout.PLANES and got.is_contiguous() and torch.equal(got, strided)


@pytest.mark.parametrize("cls,params,shape", [
    (O.MaxPool2dFwdOp, {"kernel_size": 3, "stride": 2, "return_indices": True}, (2, 4, 9, 11)),
    (O.AvgPool3dFwdOp, {"kernel_size": 2}, (2, 4, 4, 6, 6)),
    (O.AdaptiveMaxPool2dFwdOp, {"output_size": (3, 4), "return_indices": True},
     (2, 4, 9, 11)),
], ids=["max2d", "avg3d", "adaptive-max"])
def test_outputs_follow_a_channels_last_input(cls, params, shape):
    """As torch's: the outputs of a channels-last input are channels last (3-D average
    pooling's contiguous), eagerly and as the compiled graph's fake outputs; a contiguous
    input's are contiguous."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}[len(shape)]
    x = torch.randn(shape).to(memory_format=fmt)
    op = cls(**params)
    outs = op(x)
    outs = outs if isinstance(outs, tuple) else (outs,)
    want = _TORCH_FWD[cls](x, **params)
    want = want if isinstance(want, tuple) else (want,)
    for got, w in zip(outs, want, strict=True):
        assert got.stride() == w.stride() and torch.equal(got, w)
    assert all(o.is_contiguous() for o in as_tuple(op(x.contiguous())))
    traced = torch.compile(lambda t: as_tuple(op(t))[0].stride(), fullgraph=True,
                           backend="eager")
    assert traced(x) == want[0].stride()


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


_TORCH_FWD = {O.MaxPool2dFwdOp: F.max_pool2d, O.AvgPool3dFwdOp: F.avg_pool3d,
              O.AdaptiveMaxPool2dFwdOp: F.adaptive_max_pool2d}


def test_a_call_is_three_axes_to_the_kernels():
    x = torch.randn(3, 17)  # unbatched 1-D: one batch, three channels
    op = O.MaxPool1dFwdOp(kernel_size=3, stride=2, padding=1, dilation=2, return_indices=True)
    y, _ = op(x)
    s = op._spec("cpu", torch.bfloat16, tuple(x.shape), tuple(y.shape),
                 K.PoolLayout.PLANES, True)
    assert (s.batch, s.channels, s.size_in, s.size_out) == (1, 3, (1, 1, 17), (1, 1, 8))
    assert (s.kernel, s.stride, s.padding, s.dilation) == ((1, 1, 3), (1, 1, 2), (0, 0, 1),
                                                           (1, 1, 2))
    avg = O.AvgPool2dFwdOp(kernel_size=2, divisor_override=3, count_include_pad=False)
    s = avg._spec("cpu", torch.float16, (2, 4, 6, 6), (2, 4, 3, 3), K.PoolLayout.PLANES, False)
    assert (s.divisor, s.count_include_pad, s.dtype) == (3, False, "float16")


def test_kernels_hand_the_programs_flat_views():
    """The programs take flat tensors: channels-last ones are read and written in place as
    the contiguous (N, H, W, C) their strides are; nothing is copied."""
    cl = torch.channels_last
    x = torch.randn(2, 3, 5, 7).to(memory_format=cl)
    y = torch.empty(2, 3, 2, 3).to(memory_format=cl)
    idx = torch.empty(2, 3, 2, 3, dtype=torch.int64).to(memory_format=cl)
    seen = []
    kernel = K.PoolKernel.__new__(K.PoolKernel)
    kernel.program = lambda *flat: seen.extend(flat)
    kernel._indices, kernel._channels_last = True, True
    kernel(x, y, idx)
    assert [t.shape for t in seen] == [(210,), (36,), (36,)]
    assert [t.data_ptr() for t in seen] == [x.data_ptr(), y.data_ptr(), idx.data_ptr()]
    assert torch.equal(seen[0], x.permute(0, 2, 3, 1).flatten())
    grad = K.PoolBwdKernel.__new__(K.PoolBwdKernel)
    seen.clear()
    grad.program, grad._indices = (lambda *flat: seen.extend(flat)), False
    grad._forward = None
    dx = torch.empty(2, 3, 5, 7)
    grad(y.contiguous(), x.contiguous(), None, dx)
    assert [t.shape for t in seen] == [(36,), (210,), (210,)]
    assert seen[2].data_ptr() == dx.data_ptr()
    # two passes (a large max gradient without indices): the forward writes indices into a
    # workspace, and the gather reads them
    seen.clear()
    first = []
    grad._forward, grad._indices = (lambda *flat: first.extend(flat)), True
    dy, xc = y.contiguous(), x.contiguous()
    grad(dy, xc, None, dx)
    assert [t.shape for t in first] == [(210,), (36,), (36,)]
    assert first[0].data_ptr() == xc.data_ptr() and first[2].dtype == torch.int64
    assert [t.shape for t in seen] == [(36,), (210,), (36,), (210,)]
    assert seen[2].data_ptr() == first[2].data_ptr() and seen[3].data_ptr() == dx.data_ptr()
    assert seen[0].data_ptr() == dy.data_ptr() and seen[1].data_ptr() == xc.data_ptr()


def test_kernels_refuse_float64_by_name():
    op = O.MaxPool2dFwdOp(kernel_size=2)
    with pytest.raises(TypeError) as e:
        op.forward(op._point.check(torch.randn(1, 1, 4, 4, dtype=torch.float64)),
                   torch.randn(1, 1, 4, 4, dtype=torch.float64), torch.empty(1, 1, 2, 2), None)
    assert str(e.value) == ("MaxPool2dFwdOp: the in-tree pooling kernels serve bfloat16, "
                            "float16, float32, not float64; construct the op with "
                            "target='reference' for float64")


def test_call_spec_refuses_what_no_program_serves():
    base = dict(device=None, kind=K.PoolKind.AVG, adaptive=False, layout=K.PoolLayout.PLANES,
                batch=1, channels=1, size_in=(1, 4, 4), size_out=(1, 2, 2), kernel=(1, 2, 2),
                stride=(1, 2, 2), padding=(0, 0, 0), dilation=(1, 1, 1),
                count_include_pad=True, divisor=0, indices=False, dtype="float32")
    with pytest.raises(ValueError, match=r"PoolSpec.indices: only max pooling has indices"):
        K.PoolSpec(**{**base, "indices": True})
    with pytest.raises(ValueError, match=r"PoolSpec.dilation: average pooling has none"):
        K.PoolSpec(**{**base, "dilation": (1, 2, 2)})
    with pytest.raises(ValueError, match=r"PoolSpec.size_in must be three sizes"):
        K.PoolSpec(**{**base, "size_in": (4, 4)})
    big = K.PoolSpec(**{**base, "batch": 2**16, "channels": 2**16})
    assert K.PoolKernel.region_refusal(big).startswith("indexes its tensors with int32")
    assert K.PoolBwdKernel.region_refusal(K.PoolSpec(**{
        **base, "layout": K.PoolLayout.CHANNELS_LAST})).startswith("reads its tensors in the")


def test_gradient_through_max_pool_with_indices():
    x = torch.randn(2, 3, 7, 8, dtype=torch.float64, requires_grad=True)
    op = O.MaxPool2dFwdOp(kernel_size=3, stride=2, padding=1, return_indices=True)
    assert torch.autograd.gradcheck(lambda t: op(t)[0], (x,))
    y, _ = op(x)
    (got,) = torch.autograd.grad(y.sum(), x)
    (want,) = torch.autograd.grad(F.max_pool2d(x, 3, 2, 1).sum(), x)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["AdaptiveAvgPool2dFwdOp", "AdaptiveMaxPool2dFwdOp"])
def test_an_adaptive_output_size_of_one_item_is_refused_as_torch_refuses_it(name):
    x = torch.randn(1, 2, 6, 6)
    with pytest.raises(RuntimeError, match="output_size must be 2"):
        torch.nn.functional.adaptive_avg_pool2d(x, (3,))
    for size in ((3,), [3], (3, 4, 5)):
        with pytest.raises(ConstructionError) as exc:
            getattr(O, name)(output_size=size)
        text = str(exc.value)
        assert text.startswith(f"{name}: construction param output_size does not match")
        assert "expected: output_size: an int or a tuple of 2 ints" in text
    got = getattr(O, name)(output_size=3)(x)
    assert got.shape == (1, 2, 3, 3)


def test_an_empty_stride_is_the_window_as_torch_reads_it():
    x = torch.randn(1, 2, 9, 9)
    for stride in ((), []):
        got = O.MaxPool2dFwdOp(kernel_size=3, stride=stride)(x)
        torch.testing.assert_close(got, F.max_pool2d(x, 3, stride=stride))
        got = O.AvgPool2dFwdOp(kernel_size=2, stride=stride)(x)
        torch.testing.assert_close(got, F.avg_pool2d(x, 2, stride=stride))


@pytest.mark.parametrize(("cls", "params", "nd"), [
    (O.MaxPool2dBwdOp, dict(kernel_size=2), 2), (O.MaxPool1dBwdOp, dict(kernel_size=2), 1),
    (O.AdaptiveMaxPool2dBwdOp, dict(output_size=3), 2)])
def test_indices_outside_their_plane_are_refused_by_name(cls, params, nd):
    """The gradient scatters dy at the indices the forward returned: one that is not a
    position of its plane is refused naming the op, the index and the range (torch's scatter
    raised a bare message); the op serves the next call."""
    x = torch.randn(1, 2, *(6,) * nd)
    fwd = {1: F.max_pool1d, 2: F.max_pool2d}[nd]
    y, idx = (F.adaptive_max_pool2d(x, 3, return_indices=True) if "output_size" in params
              else fwd(x, 2, return_indices=True))
    dy = torch.randn_like(y)
    op = cls(**params)
    plane = 6 ** nd
    for bad, value in ((idx + plane, int(idx.flatten()[0]) + plane), (idx - plane, None)):
        with pytest.raises(IndexError) as exc:
            op(dy, x, bad)
        assert str(exc.value).startswith(f"{cls.__name__}: indices[{', '.join(['0'] * (nd + 2))}]"
                                         f" is ")
        assert str(exc.value).endswith(f"= {plane} elements: [0, {plane}))")
        if value is not None:
            assert f" is {value}: " in str(exc.value)
    torch.testing.assert_close(op(dy, x, idx), op(dy, x))


class _ScatterStandIn(Kernel, K.PoolBwdInterface):
    """The gradient slot on the CPU: dy added at the indices (its planes' flat positions)."""

    devices = ("cpu",)
    general = True
    calls = 0

    def __call__(self, dy, x, indices, dx) -> None:
        from tileops.ops.pooling import _scatter_max

        type(self).calls += 1
        dx.copy_(_scatter_max(dy, x.shape, indices, x.dim() - 2))


@pytest.mark.parametrize(("cls", "params", "nd"), [
    (O.MaxPool2dBwdOp, dict(kernel_size=2), 2), (O.MaxPool1dBwdOp, dict(kernel_size=2), 1),
    (O.AdaptiveMaxPool2dBwdOp, dict(output_size=3), 2)])
def test_indices_outside_their_plane_are_refused_in_tree_where_called_directly(cls, params, nd):
    """The in-tree gradient called directly (not by its forward's gradient, whose indices are
    the forward's own): an index outside its plane is refused on the host by name before the
    kernel, which would write out of bounds, runs; the op serves the next call. The forward's
    own gradient reads no index on the host."""
    stand_in = _ScatterStandIn
    stand_in.calls = 0
    x = torch.randn(1, 2, *(6,) * nd)
    fwd = {1: F.max_pool1d, 2: F.max_pool2d}[nd]
    y, idx = (F.adaptive_max_pool2d(x, 3, return_indices=True) if "output_size" in params
              else fwd(x, 2, return_indices=True))
    dy = torch.randn_like(y)
    op = cls(**params, target=IN_TREE, kernel_map={K.PoolBwdInterface: stand_in})
    plane = 6 ** nd
    with pytest.raises(IndexError) as exc:
        op(dy, x, idx + plane)
    assert str(exc.value).startswith(f"{cls.__name__}: indices[{', '.join(['0'] * (nd + 2))}]"
                                     f" is {int(idx.flatten()[0]) + plane}: not a position")
    assert stand_in.calls == 0
    torch.testing.assert_close(op(dy, x, idx), cls(**params, target="reference")(dy, x, idx))
    assert stand_in.calls == 1
    assert op.checks_indices(idx) and not op.checks_indices(idx.to("meta"))
    op._fed_by_forward = True  # as the op a forward builds for its gradient
    assert not op.checks_indices(idx)


def test_a_window_wholly_in_the_padding_is_refused_by_name():
    """A dilation wider than a short axis can put every tap of a window in the padding: torch
    gives it -inf and an index outside the input (its backward then writes through it); the op
    refuses the call naming the window, the axis and the params, and serves the next one."""
    x = torch.randn(1, 1, 4, 1, dtype=torch.float64, requires_grad=True)
    op = O.MaxPool2dFwdOp(kernel_size=(1, 2), padding=(0, 1), dilation=(1, 2), stride=1)
    with pytest.raises(ValueError) as err:
        op(x)
    assert str(err.value) == (
        "MaxPool2dFwdOp: window 0 along axis 1 of x's last 2 (1 elements) has every tap in the "
        "padding (kernel_size=(1, 2), stride=1, padding=(0, 1), dilation=(1, 2): taps -1 to 1 "
        "every 2), where max pooling has no element to take; a dilation of at most 1 or less "
        "padding along that axis leaves none")
    wide = torch.randn(1, 1, 4, 3, dtype=torch.float64)
    torch.testing.assert_close(op(wide), F.max_pool2d(wide, (1, 2), 1, (0, 1), (1, 2)))


def test_windows_in_the_padding_are_refused_exactly_where_torch_gives_minus_inf():
    """Over a grid of short axes and every kernel, dilation, stride, padding (at most half
    the kernel) and ceil_mode: the op refuses a call exactly where torch's max_pool1d gives a
    finite input a -inf output (a window with no element), and otherwise matches it."""
    g = torch.Generator().manual_seed(0)
    checked = 0
    for n in range(1, 6):
        x = torch.randn(1, 2, n, generator=g, dtype=torch.float64)
        for k in range(1, 5):
            for d in range(1, 5):
                for s in range(1, 4):
                    for p in range(k // 2 + 1):
                        for ceil in (False, True):
                            try:
                                want = F.max_pool1d(x, k, s, p, d, ceil)
                            except RuntimeError:  # no output: refused by the spec as well
                                continue
                            op = O.MaxPool1dFwdOp(kernel_size=k, stride=s, padding=p,
                                                  dilation=d, ceil_mode=ceil)
                            if bool(torch.isinf(want).any()):
                                with pytest.raises(ValueError, match="every tap in the padding"):
                                    op(x)
                            else:
                                torch.testing.assert_close(op(x), want, rtol=0, atol=0)
                            checked += 1
    assert checked > 400
