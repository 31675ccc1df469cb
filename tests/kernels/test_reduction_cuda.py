"""The reduction kernels on a GPU against torch in float64, called through the slot as the op
calls it (a spec from the view, the implementation the slot selects, its entry), on fresh
random inputs: every kind on rows (a 16-byte row, an odd row, a tiny one, one long split row)
and columns (a split leading dim, a narrow odd inner, a middle dim), integer inputs of every
width and bool inputs,
NaN and ties for amax and the arg kinds, empty runs.

``python3 tests/kernels/test_reduction_cuda.py --prebuild --workers 15`` compiles exactly
the programs these tests use in spawned processes first, so the tests load them from
TileLang's disk cache.

Tolerances (``eps``: the output dtype's; sums accumulate in float32 over ``r`` elements of at
most ``amax`` in magnitude): exact for amax/amin, the arg kinds, all/any, integers and the
product (its inputs are +-1 and rare powers of two, so every partial product is exact); sum
``2 eps |ref| + 4e-6 sqrt(r) amax``, mean that over ``r``; the moments and the 2-norm
``4 eps |ref| + 1e-6 sqrt(r) |ref|`` (float32 sums of shifted squares).
"""

import math
import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]

import pytest

torch = pytest.importorskip("torch")

from tileops.kernels import reduction as K  # noqa: E402
from tileops.kernels.reduction import ReduceKind as RK  # noqa: E402
from tileops.runtime import select  # noqa: E402

pytestmark = pytest.mark.cuda
if __name__ != "__main__" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

KERNELS = (K.ReductionRowKernel, K.ReductionColumnKernel)
FLOAT_KINDS = list(RK)
INT_KINDS = [RK.SUM, RK.PROD, RK.AMAX, RK.AMIN, RK.ARGMAX, RK.ARGMIN, RK.ALL, RK.ANY]
BOOL_KINDS = [RK.SUM, RK.PROD, RK.AMAX, RK.AMIN, RK.ALL, RK.ANY]

#: (outer, r, inner, dtype, kinds): why each exists is on its line
CASES = [
    ((1024, 8192, 1), "bfloat16", FLOAT_KINDS),  # 16-byte rows, a CTA a row
    ((64, 4097, 1), "float16", FLOAT_KINDS),  # an odd row: one element a load
    ((3, 7, 1), "float32", FLOAT_KINDS),  # eight short rows a CTA
    ((1, 1 << 20, 1), "bfloat16", FLOAT_KINDS),  # one long row split across CTAs
    ((4, 100000, 1), "float32", [RK.VAR, RK.VAR_MEAN, RK.SUM]),  # shift from lane 0, split
    ((8, 1, 1), "float32", [RK.VAR, RK.STD, RK.VAR_MEAN]),  # divisor 0: NaN, as torch
    ((1, 8192, 4096), "bfloat16", FLOAT_KINDS),  # the leading dim: R split, finish
    ((4, 33, 7), "float16", FLOAT_KINDS),  # narrow odd inner: tcols < 32, predicated
    ((16, 1024, 512), "float32", FLOAT_KINDS),  # a middle dim
    ((70000, 3, 5), "float32", [RK.SUM, RK.ARGMAX]),  # outer past gridDim.y's 65535
    ((256, 1000, 1), "int32", INT_KINDS),  # int64 accumulation
    ((8, 300, 65), "int32", INT_KINDS),  # integer columns
    ((256, 1000, 1), "int8", INT_KINDS),  # 16 a 16-byte access, widened to int64
    ((8, 300, 65), "uint8", INT_KINDS),  # all/any keep uint8, as torch's
    ((64, 4097, 1), "int16", INT_KINDS),  # an odd row: one element a load
    ((64, 1000, 1), "bool", BOOL_KINDS),
    ((2, 100, 64), "bool", BOOL_KINDS),
]


def runs():
    for view, dtype, kinds in CASES:
        for kind in kinds:
            yield kind, view, dtype


def _correction(kind):
    return 1.0 if kind in (RK.VAR, RK.STD, RK.VAR_MEAN) else 0.0


def spec_of(kind, view, dtype, device):
    outer, r, inner = view
    return K.ReductionSpec(device=device, kind=kind, outer=outer, r=r, inner=inner,
                           dtype=dtype, correction=_correction(kind))


def _input(kind, view, dtype, gen):
    dt = getattr(torch, dtype)
    if dtype == "bool":
        x = torch.rand(view, generator=gen, device="cuda") > 0.002
        x[0] = True  # a column or row of every kind: all True, and some False
        return x
    if dtype in ("uint8", "int8", "int16", "int32"):
        # (an int64 product wraps as torch's does, in any order)
        hi = 3 if kind is RK.PROD else 100 if dtype.endswith("int8") else 1000
        lo = 0 if dtype == "uint8" else -hi
        return torch.randint(lo, hi, view, generator=gen, device="cuda", dtype=dt)
    if kind is RK.PROD:  # +-1 with rare 2 and 1/2: exact in every dtype, the product finite
        u = torch.rand(view, generator=gen, device="cuda")
        mag = torch.where(u < 1e-4, 2.0, torch.where(u < 2e-4, 0.5, 1.0))
        sign = torch.randint(0, 2, view, generator=gen, device="cuda") * 2 - 1
        return (mag * sign).to(dt)
    if kind in (RK.ARGMAX, RK.ARGMIN, RK.AMAX, RK.AMIN):
        x = torch.randint(-50, 50, view, generator=gen, device="cuda").to(dt)  # ties
        x.view(-1)[:: max(1, x.numel() // 5)] = float("nan")  # NaN in some runs
        return x
    if kind in (RK.ALL, RK.ANY):
        x = torch.randint(0, 2, view, generator=gen, device="cuda").to(dt)
        x[:, :, 0] = 1
        return x
    # an offset keeps the moments honest: the mean dominates the spread
    return (torch.randn(view, generator=gen, device="cuda") + 3).to(dt)


def _reference(kind, x):
    v = x.double() if x.is_floating_point() else x
    c = _correction(kind)
    return {
        RK.SUM: lambda: (v.sum(1),), RK.MEAN: lambda: (v.mean(1),),
        RK.PROD: lambda: (v.prod(1),), RK.AMAX: lambda: (v.amax(1),),
        RK.AMIN: lambda: (v.amin(1),), RK.VAR: lambda: (v.var(1, correction=c),),
        RK.STD: lambda: (v.std(1, correction=c),),
        RK.VAR_MEAN: lambda: torch.var_mean(v, 1, correction=c),
        RK.L2NORM: lambda: (torch.linalg.vector_norm(v, 2, 1),),
        RK.ALL: lambda: (v.all(1),), RK.ANY: lambda: (v.any(1),),
        RK.ARGMAX: lambda: (v.argmax(1),), RK.ARGMIN: lambda: (v.argmin(1),),
    }[kind]()


def _check(kind, x, got, want, name):
    r = x.shape[1]
    if not got.is_floating_point() or kind in (RK.AMAX, RK.AMIN, RK.PROD):
        g = got.double() if got.is_floating_point() else got
        w = want.to(got.dtype).to(g.dtype) if got.is_floating_point() else want
        same = (g == w) | (g.isnan() & w.isnan()) if g.is_floating_point() else g == w
        bad = (~same).nonzero()
        assert bad.numel() == 0, f"{name}: {bad.shape[0]} differ, first at {bad[0].tolist()}"
        return
    eps = torch.finfo(got.dtype).eps
    amax = x.double().abs().amax().item()
    g = got.double()
    if kind is RK.SUM:
        tol = 2 * eps * want.abs() + 4e-6 * math.sqrt(r) * amax
    elif kind is RK.MEAN:
        tol = 2 * eps * want.abs() + 4e-6 * amax / math.sqrt(r)
    else:
        tol = 4 * eps * want.abs() + 1e-6 * math.sqrt(r) * want.abs()
    err = (g - want).abs()
    bad = ((err > tol) | (g.isnan() != want.isnan())).nonzero()
    assert bad.numel() == 0, (f"{name}: {bad.shape[0]} out of tolerance, first at "
                              f"{bad[0].tolist()}: {g.view(-1)[bad[0, 0]].item()} vs "
                              f"{want.view(-1)[bad[0, 0]].item()}")


def _entry(spec):
    impl = select(K.ReductionInterface, KERNELS, spec)
    return impl.entry_for(spec, None)


def _ids(run):
    kind, view, dtype = run
    return f"{kind.value}-{'x'.join(map(str, view))}-{dtype}"


@pytest.mark.parametrize("run", list(runs()), ids=_ids)
def test_kernel_matches_float64(run) -> None:
    kind, view, dtype = run
    gen = torch.Generator(device="cuda").manual_seed(hash(_ids(run)) % (1 << 31))
    x = _input(kind, view, dtype, gen)
    spec = spec_of(kind, view, dtype, x.device)
    want = _reference(kind, x)
    outs = [torch.empty(view[0] * view[2], device="cuda",
                        dtype=getattr(torch, spec.out_dtype)) for _ in want]
    _entry(spec)(x, outs[0], outs[1] if len(outs) > 1 else None)
    for i, (g, w) in enumerate(zip(outs, want, strict=True)):
        _check(kind, x, g, w.reshape(-1), f"{_ids(run)} output {i}")


@pytest.mark.parametrize("kind", [RK.SUM, RK.PROD, RK.MEAN, RK.ALL, RK.ANY, RK.VAR_MEAN],
                         ids=lambda k: k.value)
def test_an_empty_run_gives_torchs_value(kind) -> None:
    x = torch.empty(3, 0, 5, device="cuda")
    spec = spec_of(kind, (3, 0, 5), "float32", x.device)
    want = _reference(kind, x)
    outs = [torch.full((15,), 7.0, device="cuda").to(getattr(torch, spec.out_dtype))
            for _ in want]
    _entry(spec)(x, outs[0], outs[1] if len(outs) > 1 else None)
    for g, w in zip(outs, want, strict=True):
        torch.testing.assert_close(g.double() if g.is_floating_point() else g,
                                   w.reshape(-1), equal_nan=True)


def test_the_bar_shapes_run_through_the_ops() -> None:
    """The 32768 x 8192 bfloat16 bars through the public ops (rows, the split leading dim), a
    permuted dims (0, 2) and a middle dim with keepdim."""
    from tileops.ops import AmaxFwdOp, MeanFwdOp, SumFwdOp

    x = torch.randn(32768, 8192, device="cuda", dtype=torch.bfloat16)
    for op, fn in ((SumFwdOp, torch.sum), (MeanFwdOp, torch.mean), (AmaxFwdOp, torch.amax)):
        for dim in (-1, 0):
            got = op(dim=dim)(x).double()
            want = fn(x.double(), dim)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2 * math.sqrt(x.shape[dim]))
    y = torch.randn(64, 512, 256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(SumFwdOp(dim=(0, 2))(y).double(), y.double().sum((0, 2)),
                               rtol=2e-2, atol=0.5)
    from tileops.ops import VarMeanFwdOp

    z = torch.randn(16, 1024, 512, device="cuda", dtype=torch.bfloat16)
    var, mean = VarMeanFwdOp(dim=1, keepdim=True)(z)
    want_var, want_mean = torch.var_mean(z.double(), 1, keepdim=True)
    assert var.shape == (16, 1, 512)
    torch.testing.assert_close(var.double(), want_var, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(mean.double(), want_mean, rtol=2e-2, atol=1e-3)


# --- the prebuild ----------------------------------------------------------------------------


def program_keys():
    """The distinct programs the file compiles: (builder name, its arguments), the row count
    left to the launch."""
    keys = {}

    def add(kind, view, dtype, c):
        outer, r, inner = view
        if inner == 1:
            splits = K.row_plan(outer, r, dtype)[-1]
            keys[("row", kind, r, dtype, c, splits)] = None
        else:
            splits = K.column_plan(outer, r, inner, dtype)[-1]
            keys[("column", kind, r, inner, dtype, c, splits)] = None
        if splits > 1:
            keys[("finish", kind, splits, dtype, r, c)] = None

    for kind, view, dtype in runs():
        add(kind, view, dtype, _correction(kind))
    for op_kind in (RK.SUM, RK.MEAN, RK.AMAX):  # test_the_bar_shapes_run_through_the_ops
        add(op_kind, (32768, 8192, 1), "bfloat16", 0.0)
        add(op_kind, (1, 32768, 8192), "bfloat16", 0.0)
    add(RK.SUM, (512, 64 * 256, 1), "bfloat16", 0.0)
    add(RK.VAR_MEAN, (16, 1024, 512), "bfloat16", 1.0)
    return list(keys)


_BUILDERS = {"row": "build_row_kernel", "column": "build_column_kernel",
             "finish": "build_finish_kernel"}


def _build(key):
    getattr(K, _BUILDERS[key[0]])(*key[1:])


def _describe(key) -> str:
    return f"{key[0]} {key[1].value} {key[2:]}"


def main(argv=None) -> int:
    from _prebuild import main as prebuild  # beside this file, which runs as a script here

    return prebuild(program_keys, _build, _describe, argv)


if __name__ == "__main__":
    sys.exit(main())
