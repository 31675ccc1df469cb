"""The softmax kernels on a GPU against torch in float64, called through the slots as the ops
call them (a spec from the view, the implementation the slot selects, its entry).

Grid (why each point exists): row lengths 1 (one element a row), 7 (a thread a row, 256 rows
a CTA), 1024 (a half warp a row), 4097 (no vector divides it: one-element accesses), 8192
(16-byte accesses on four warps), 32000 (16 warps, the cross-warp reduction), 65536 and 128256
(rows too wide to hold: the two-pass kernel) and 262144 in float32 (1 MiB rows), each at row
counts 3 (a partial CTA of short rows) and 129 or 1000; every kind in every storage dtype;
views with an inner axis: dim 0 of 1024 x 4096 (one outer index: the narrowed vector), dim 1
of 8 x 512 x 1024, 3 x 5 x 7, and in bfloat16 more odd ones (an R of 1, an inner of 3 or 2)
and random views. Inputs are fresh random values (scaled by 4, so the exponentials span a wide range),
and the outputs are poisoned with NaN, so an element never written fails. A masked case puts
``-inf`` in a third of the elements and one row of only ``-inf`` (torch: softmax NaN,
logsumexp ``-inf``).

logsumexp's gradient runs on the same grid, from the lse of the input rounded to its dtype.

Tolerance: one rounding of the output to its dtype (``rtol`` = its epsilon) on top of the fp32
arithmetic (``exp2`` within 2 ulp, sums of up to 2**18 terms): float32 is held to 2e-5. The
softmax gradients are held to an element-wise bound of their fp32 arithmetic instead
(:func:`gradient_bound`): ``dy - sum(dy * y)`` cancels where one ``y`` is near 1, so the
fp32 error of a correct kernel can be the whole of a row's largest ``|dx|`` (a bound relative
to it failed an exact fp32 emulation of the kernel in 1 of 60 rows of 7). The bound's CPU
tests (not marked ``cuda``) hold such an emulation within it over a space of views and
dominant rows, and show that a wrong row sum (a neighbour row's, a group's missing, an element
left out) breaks it.

``python3 tests/kernels/test_softmax_cuda.py --prebuild --workers 15`` compiles every program
these tests use in spawned processes first, so the tests load them from TileLang's disk cache.
"""

import random
import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from tileops.kernels import softmax as S  # noqa: E402
from tileops.runtime import select  # noqa: E402

cuda = pytest.mark.cuda  # every test but the bound's (tests/conftest.py skips them on a CPU)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
RTOL = {torch.bfloat16: 2 ** -8 + 2e-5, torch.float16: 2 ** -11 + 2e-5, torch.float32: 2e-5}
#: absolute floors: softmax outputs are at most 1; log-softmax and lse are sums of O(10) terms
ATOL = {"softmax": 1e-6, "log_softmax": 2e-5, "logsumexp": 2e-5}
FWD_KINDS = ("softmax", "log_softmax", "logsumexp")
BWD_KINDS = ("softmax", "log_softmax")
FWD_KERNELS = (S.SoftmaxRegisterKernel, S.SoftmaxLoopedKernel, S.SoftmaxStridedKernel)
BWD_KERNELS = (S.SoftmaxBwdRegisterKernel, S.SoftmaxBwdLoopedKernel, S.SoftmaxBwdStridedKernel)
LSE_BWD_KERNELS = (S.LogSumExpBwdRowsKernel, S.LogSumExpBwdStridedKernel)

ROWS = [(3, 1), (1000, 1), (3, 7), (1000, 7), (3, 1024), (1000, 1024), (3, 4097), (129, 4097),
        (3, 8192), (129, 8192), (3, 32000), (129, 32000), (3, 65536), (129, 65536),
        (3, 128256), (64, 128256)]
WIDE = [(16, 262144)]  # float32 only: 1 MiB rows
VIEWS = [(1, 1024, 4096), (8, 512, 1024), (3, 5, 7), (4, 1, 33), (2, 300, 3), (7, 1000, 2)]
_rng = random.Random(1234)
RANDOM_VIEWS = [(_rng.randint(1, 40), _rng.randint(1, 3000), _rng.choice([1, _rng.randint(2, 600)]))
                for _ in range(6)]


def cases():
    """(outer, r, inner, dtype) of every forward and gradient test."""
    out = []
    for dtype in DTYPES:  # every row length in every dtype; the odd views in bfloat16
        out += [(m, n, 1, dtype) for m, n in ROWS]
        out += [v + (dtype,) for v in (VIEWS + RANDOM_VIEWS if dtype is torch.bfloat16
                                       else VIEWS[:3])]
    out += [(m, n, 1, torch.float32) for m, n in WIDE]
    return out


def _device():
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cuda", 0)


def fwd_spec(kind, outer, r, inner, dtype):
    return S.SoftmaxSpec(device=_device(), kind=S.SoftmaxKind(kind), outer=outer, r=r,
                         inner=inner, dtype=NAMES[dtype])


def lse_bwd_spec(outer, r, inner, dtype):
    return S.LogSumExpBwdSpec(device=_device(), kind=S.SoftmaxKind.LOGSUMEXP, outer=outer, r=r,
                              inner=inner, dtype=NAMES[dtype])


def bwd_spec(kind, outer, r, inner, dtype):
    return S.SoftmaxBwdSpec(device=_device(), kind=S.SoftmaxKind(kind), outer=outer, r=r,
                            inner=inner, dtype=NAMES[dtype])


def _entry(interface, kernels, spec):
    impl = select(interface, kernels, spec)
    return impl.entry_for(spec, None)


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def _check(got, ref, dtype, kind, what):
    got = got.double()
    ok = torch.isclose(got, ref, rtol=RTOL[dtype], atol=ATOL[kind], equal_nan=True)
    if not bool(ok.all()):
        bad = (~ok).nonzero()[:3].tolist()
        idx = tuple(bad[0])
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.numel()} elements off, e.g. "
                             f"at {idx}: got {got[idx].item()!r}, want {ref[idx].item()!r} "
                             f"(first: {bad})")


def _reference(kind, x):
    xd = x.double()
    if kind == "softmax":
        return torch.softmax(xd, 1)
    if kind == "log_softmax":
        return torch.log_softmax(xd, 1)
    return torch.logsumexp(xd, 1)


#: fp32's unit roundoff, and each storage dtype's (half its epsilon) and the absolute error
#: of its smallest values: float16's subnormal spacing; fp32's smallest normal for the others
#: (fast math may flush fp32 subnormals to 0)
U32 = 2.0 ** -24
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: U32}
TINY = {torch.bfloat16: 2.0 ** -126, torch.float16: 2.0 ** -24, torch.float32: 2.0 ** -126}


def gradient_bound(kind, y, dy):
    """``(ref, bound)``: the float64 gradient from the stored ``y`` and ``dy`` (reduced over
    dim 1) and an element-wise bound on ``|dx - ref|`` for any kernel that computes ``dx`` in
    fp32 from them and rounds it once to their dtype.

    The fp32 row sum, in any order, is off by at most ``(r + 1) u`` times the sum of its terms'
    magnitudes (``r`` products, ``r - 1`` additions); softmax's ``y * (dy - s)`` adds two
    roundings a element, log-softmax's ``dy - exp(y) * S`` the exponential's (``exp2f`` within
    2 ulp of ``exp2`` of ``y * log2(e)``, whose rounding costs ``|y| u`` relative) and two.
    Each arithmetic term is taken 4 times over (a margin, not a fudge: a row sum that is wrong
    by a term is off by far more); the output's rounding is ``UNIT |dx| + TINY``."""
    yd, dyd = y.double(), dy.double()
    r = y.shape[1]
    g = 4 * (r + 1) * U32
    if kind == "softmax":
        terms = dyd * yd
        ref = yd * (dyd - terms.sum(1, keepdim=True))
        mag = terms.abs().sum(1, keepdim=True)
        arith = yd.abs() * (g * mag + 12 * U32 * (dyd.abs() + mag))
    else:
        total = dyd.sum(1, keepdim=True)
        mag = dyd.abs().sum(1, keepdim=True)
        e = yd.exp()
        arith = e * (g * mag + 4 * (2 * yd.abs() + 8) * U32 * mag) + 12 * U32 * (
            dyd.abs() + e * mag)
        ref = dyd - e * total
    unit, tiny = UNIT[y.dtype], TINY[y.dtype]
    return ref, unit * ref.abs() + (1 + unit) * arith + tiny


def _check_gradient(kind, y, dy, dx, what):
    """``dx`` within :func:`gradient_bound` everywhere; the message names the worst element."""
    ref, bound = gradient_bound(kind, y.cpu(), dy.cpu())
    got = dx.cpu().double()
    assert not torch.isnan(got).any(), f"{what}: an output element was never written"
    ratio = (got - ref).abs() / bound
    worst = int(ratio.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), ratio.shape))
    assert ratio.max().item() <= 1, (
        f"{what}: |dx - ref| is {ratio.max().item():.3g} times the bound at {idx}: got "
        f"{got[idx].item()!r}, want {ref[idx].item()!r}")


def _run_fwd(kind, x):
    outer, r, inner = x.shape
    out_shape = (outer, inner) if kind == "logsumexp" else (outer, r, inner)
    out = _poisoned(out_shape, x.dtype)
    _entry(S.SoftmaxFwdInterface, FWD_KERNELS, fwd_spec(kind, outer, r, inner, x.dtype))(x, out)
    torch.cuda.synchronize()
    return out


@cuda
@pytest.mark.parametrize("kind", FWD_KINDS)
@pytest.mark.parametrize(("outer", "r", "inner", "dtype"), cases())
def test_forward_matches_float64(kind, outer, r, inner, dtype):
    x = (torch.randn(outer, r, inner, device="cuda") * 4).to(dtype)
    got = _run_fwd(kind, x)
    _check(got, _reference(kind, x), dtype, kind, f"{kind} {outer}x{r}x{inner} {dtype}")


@cuda
@pytest.mark.parametrize("kind", FWD_KINDS)
@pytest.mark.parametrize(("outer", "r", "inner"), [(8, 4097, 1), (4, 8192, 1), (4, 128256, 1),
                                                   (3, 64, 40)])
def test_masked_rows_follow_torch(kind, outer, r, inner):
    x = torch.randn(outer, r, inner, device="cuda")
    x[torch.rand_like(x) < 1 / 3] = float("-inf")
    x[1] = float("-inf")  # one whole outer index masked: NaN softmax, -inf logsumexp
    got = _run_fwd(kind, x)
    _check(got, _reference(kind, x), torch.float32, kind, f"masked {kind} {outer}x{r}x{inner}")


@cuda
@pytest.mark.parametrize("kind", BWD_KINDS)
@pytest.mark.parametrize(("outer", "r", "inner", "dtype"), cases())
def test_gradient_matches_float64(kind, outer, r, inner, dtype):
    x = torch.randn(outer, r, inner, device="cuda") * 4
    y = (torch.softmax(x, 1) if kind == "softmax" else torch.log_softmax(x, 1)).to(dtype)
    dy = torch.randn(outer, r, inner, device="cuda").to(dtype)
    dx = _poisoned((outer, r, inner), dtype)
    _entry(S.SoftmaxBwdInterface, BWD_KERNELS, bwd_spec(kind, outer, r, inner, dtype))(y, dy, dx)
    torch.cuda.synchronize()
    _check_gradient(kind, y, dy, dx, f"{kind} grad {outer}x{r}x{inner} {dtype}")


@cuda
@pytest.mark.parametrize(("outer", "r", "inner", "dtype"), cases())
def test_logsumexp_gradient_matches_float64(outer, r, inner, dtype):
    x = (torch.randn(outer, r, inner, device="cuda") * 4).to(dtype)
    lse = torch.logsumexp(x.float(), 1).to(dtype)
    dy = torch.randn(outer, inner, device="cuda").to(dtype)
    dx = _poisoned((outer, r, inner), dtype)
    _entry(S.LogSumExpBwdInterface, LSE_BWD_KERNELS, lse_bwd_spec(outer, r, inner, dtype))(
        dy, x, lse, dx)
    torch.cuda.synchronize()
    ref = dy.double()[:, None] * (x.double() - lse.double()[:, None]).exp()
    _check(dx, ref, dtype, "softmax", f"logsumexp grad {outer}x{r}x{inner} {dtype}")


#: the launch plans the selection does not (yet) give, which gpu_softmax.sh's sweep times:
#: (layout, kind, rows, n, dtype, plan), each against float64 like the selected ones
PLANS = [
    (S.Layout.LOOPED, "softmax", 64, 128256, torch.bfloat16,
     S.looped_staged_plan(S.SoftmaxKind.SOFTMAX, 128256, "bfloat16")),  # the whole row on chip
    (S.Layout.LOOPED, "log_softmax", 3, 128256, torch.bfloat16, (1024, 8, 2, 4, 2)),  # 2 of 6
    (S.Layout.LOOPED, "softmax", 16, 131072, torch.float32,
     S.looped_staged_plan(S.SoftmaxKind.SOFTMAX, 131072, "float32")),  # 6 staged, 8 re-read
    (S.Layout.LOOPED, "log_softmax", 5, 65537, torch.bfloat16,
     S.looped_staged_plan(S.SoftmaxKind.LOG_SOFTMAX, 65537, "bfloat16")),  # scalar, 17 chunks
    (S.Layout.LOOPED, "softmax", 7, 65544, torch.float16,
     S.looped_staged_plan(S.SoftmaxKind.SOFTMAX, 65544, "float16")),  # a partial last chunk
    (S.Layout.LOOPED, "softmax", 64, 128256, torch.bfloat16,
     (*S.looped_staged_plan(S.SoftmaxKind.SOFTMAX, 128256, "bfloat16"), True)),  # early copies
    (S.Layout.LOOPED, "log_softmax", 5, 65537, torch.bfloat16,
     (*S.looped_staged_plan(S.SoftmaxKind.LOG_SOFTMAX, 65537, "bfloat16"), True)),
    (S.Layout.LOOPED, "softmax", 16, 131072, torch.float32,
     (*S.looped_staged_plan(S.SoftmaxKind.SOFTMAX, 131072, "float32"), True)),  # then a walk
    (S.Layout.LOOPED, "softmax", 129, 32000, torch.bfloat16, (512, 8, 2, 4, 2, True, 2)),
    (S.Layout.LOOPED, "log_softmax", 129, 32000, torch.bfloat16, (256, 8, 4, 4, 3, True, 3)),
    (S.Layout.REGISTER, "softmax", 129, 8192, torch.bfloat16, (256, 1, 8, 4, True)),
    (S.Layout.REGISTER, "softmax", 129, 32000, torch.bfloat16, (512, 1, 8, 8, False, 2)),
    (S.Layout.REGISTER, "log_softmax", 129, 32000, torch.float16, (1024, 1, 8, 4, False)),
    (S.Layout.REGISTER, "softmax", 1000, 1024, torch.bfloat16, (32, 8, 8, 4, True)),
    (S.Layout.REGISTER, "softmax", 1000, 1024, torch.bfloat16, (64, 4, 8, 2, True)),
    (S.Layout.REGISTER, "logsumexp", 1000, 1024, torch.float32, (64, 4, 4, 4, False)),
]


@cuda
@pytest.mark.parametrize(("layout", "kind", "m", "n", "dtype", "plan"), PLANS)
def test_other_plans_match_float64(layout, kind, m, n, dtype, plan):
    x = (torch.randn(m, n, device="cuda") * 4).to(dtype)
    x[1, n // 3] = float("-inf")  # a masked element in a staged or held part of a row
    out = _poisoned((m,) if kind == "logsumexp" else (m, n), dtype)
    S.build_fwd(layout, kind, n, 1, NAMES[dtype], plan)(x, out)
    torch.cuda.synchronize()
    ref = _reference(kind, x[:, :, None])
    _check(out, ref[:, 0] if kind == "logsumexp" else ref[:, :, 0], dtype, kind,
           f"{kind} {m}x{n} {dtype} plan {plan}")


# --- the bound's own tests, on the CPU -----------------------------------------------------


def _emulated(kind, y, dy, total=None):
    """The gradient kernels' arithmetic in fp32 on the CPU (torch's summation order, not the
    kernels': the bound holds for any), rounded once to the dtype; ``total`` replaces the
    row sum, to stand for a kernel that sums the wrong elements."""
    yf, df = y.float(), dy.float()
    if total is None:
        total = (df * yf if kind == "softmax" else df).sum(1, keepdim=True)
    dx = yf * (df - total) if kind == "softmax" else df - yf.exp() * total
    return dx.to(y.dtype)


def _inputs(kind, outer, r, inner, dtype, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(outer, r, inner, generator=gen, dtype=torch.float64) * scale
    y = (torch.softmax(x, 1) if kind == "softmax" else torch.log_softmax(x, 1)).to(dtype)
    return y, torch.randn(outer, r, inner, generator=gen).to(dtype)


def _within(kind, y, dy, dx):
    ref, bound = gradient_bound(kind, y, dy)
    return bool(((dx.double() - ref).abs() <= bound).all())


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(BWD_KINDS), outer=st.integers(1, 40), r=st.integers(1, 600),
       inner=st.sampled_from([1, 1, 2, 7]), dtype=st.sampled_from(DTYPES),
       scale=st.sampled_from([1.0, 4.0, 30.0]), seed=st.integers(0, 2 ** 31))
def test_bound_holds_for_fp32_arithmetic(kind, outer, r, inner, dtype, scale, seed):
    """A correct fp32 kernel is within the bound: scale 30 makes rows whose one ``y`` is 1
    and the rest underflow, where ``dy - sum(dy * y)`` cancels to nothing."""
    y, dy = _inputs(kind, outer, r, inner, dtype, scale, seed)
    assert _within(kind, y, dy, _emulated(kind, y, dy))


@pytest.mark.parametrize(("outer", "r", "inner", "dtype"), [
    (1000, 7, 1, torch.float16), (1000, 7, 1, torch.float32), (3, 5, 7, torch.float32),
    (8, 512, 64, torch.float32), (129, 4097, 1, torch.float32), (1000, 7, 1, torch.bfloat16)])
@pytest.mark.parametrize("kind", BWD_KINDS)
def test_bound_catches_a_wrong_row_sum(kind, outer, r, inner, dtype):
    """The classes of bug a row sum has (the neighbour row's, a group of its terms missing,
    its last element left out) each break the bound; the right sum keeps it (the cases that
    failed a bound relative to the row's largest ``|dx|``, a 4097 row, and bfloat16: in a
    wide bfloat16 row one element's ``exp(y) dy`` is below the output's rounding, seen by no
    test)."""
    y, dy = _inputs(kind, outer, r, inner, dtype, 4.0, 7)
    yf, df = y.float(), dy.float()
    terms = df * yf if kind == "softmax" else df
    total = terms.sum(1, keepdim=True)
    assert _within(kind, y, dy, _emulated(kind, y, dy, total))
    wrong = {
        "the next row's": total.roll(1, 0) if outer > 1 else total.roll(1, 2),
        "a group missing": terms[:, : r // 2].sum(1, keepdim=True),
        "the last left out": terms[:, :-1].sum(1, keepdim=True),
    }
    for what, bad in wrong.items():
        if r == 1 and what != "the next row's":
            continue  # a row of one has no group or other element to leave out
        if what == "the last left out" and kind == "log_softmax" and r > 512:
            continue  # one |dy| of thousands is within the sum's worst case, (r + 1) u sum|dy|
        assert not _within(kind, y, dy, _emulated(kind, y, dy, bad)), what


# --- the prebuild ----------------------------------------------------------------------------


def program_keys():
    """The distinct programs this file compiles: (which builder, the build key); the builder
    is True for the forward, False for the softmax gradients, None for logsumexp's."""
    keys = {}
    specs = [(True, fwd_spec(k, o, r, i, d)) for k in FWD_KINDS for o, r, i, d in cases()]
    specs += [(False, bwd_spec(k, o, r, i, d)) for k in BWD_KINDS for o, r, i, d in cases()]
    specs += [(None, lse_bwd_spec(o, r, i, d)) for o, r, i, d in cases()]
    slots = {True: (S.SoftmaxFwdInterface, FWD_KERNELS),
             False: (S.SoftmaxBwdInterface, BWD_KERNELS),
             None: (S.LogSumExpBwdInterface, LSE_BWD_KERNELS)}
    for fwd, spec in specs:
        impl = select(*slots[fwd], spec)
        inner = spec.inner if impl.layout is S.Layout.STRIDED else 1
        keys[(fwd, impl.layout, spec.kind.value, spec.r, inner, spec.dtype,
              S.plan_of(impl.layout, spec))] = None
    for layout, kind, _, n, dtype, plan in PLANS:
        keys[(True, layout, kind, n, 1, NAMES[dtype], plan)] = None
    return list(keys)


def _build(key):
    fwd, *args = key
    {True: S.build_fwd, False: S.build_bwd, None: S.build_lse_bwd}[fwd](*args)


def _describe(key) -> str:
    fwd, *args = key
    return (f"{ {True: 'fwd', False: 'bwd', None: 'lse-bwd'}[fwd]} {args[0].value} {args[1]} "
            f"{args[2]}x{args[3]} {args[4]}")


def main(argv=None) -> int:
    from _prebuild import main as prebuild  # beside this file, which runs as a script here

    return prebuild(program_keys, _build, _describe, argv)


if __name__ == "__main__":
    sys.exit(main())
