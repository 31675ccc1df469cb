"""The scan kernels on a GPU against torch in float64, called through the ops (the layout, the
slot, the implementation it selects): each code path of the two programs (the row scan with
one warp and with several, 16-byte and scalar accesses, a row split into segments; the strided
walk over a leading and a middle dim, split and not), each input dtype the kernels serve, an
empty input and a strided one, on fresh random values.

Tolerances: an integer output is exact (int64 wraps alike in any order). A floating one, per
element: ``|got - ref| <= ulp(out, ref) + bound``, where ``ulp`` is the spacing of the output
dtype at the float64 reference (the one rounding of the float32 accumulator) and ``bound`` the
float32 accumulation's: for a sum ``2^-18 * cumsum(|x|)`` (a carry or chunk total lost is off
by a whole partial sum, far above it), for a product ``8 * sqrt(k + 1) * 2^-24 * |ref|`` at
the k-th element (independent roundings of k multiplications).

``python3 tests/kernels/test_scan_cuda.py --prebuild --workers 15`` compiles exactly the
programs these tests use in spawned processes first, so the tests load them from TileLang's
disk cache.
"""

import math
import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]

import pytest

torch = pytest.importorskip("torch")

from tileops.kernels import scan as K  # noqa: E402

pytestmark = pytest.mark.cuda
if __name__ not in ("__main__", "__mp_main__") and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

#: (kind, shape, dim, dtype): why each exists is on its line
CASES = [
    ("sum", (1100, 16384), -1, torch.bfloat16),  # 16-byte loads, 512 threads, two chunks
    ("sum", (1100, 8193), 1, torch.bfloat16),  # scalar accesses, a predicated tail
    ("sum", (600, 8192), -1, torch.bfloat16),  # one chunk
    ("sum", (64, 65536), -1, torch.bfloat16),  # few rows: eight segments of a chunk each
    ("sum", (3, 7), 1, torch.float32),  # one warp, most of it idle
    ("prod", (3, 7), 1, torch.bfloat16),
    ("sum", (1, 1 << 20), -1, torch.bfloat16),  # one long row over 128 segments
    ("sum", (2, 3_000_001), -1, torch.float32),  # two chunks a segment, an odd tail
    ("prod", (3, 200003), 1, torch.float32),
    ("sum", (8192, 4096), 0, torch.bfloat16),  # a leading dim, segmented
    ("sum", (2048, 1000), 0, torch.float16),  # inner off the 16-byte vector
    ("prod", (16, 32, 64), 1, torch.float16),  # a middle dim
    ("sum", (16, 32, 64), 1, torch.float32),
    ("sum", (5, 7, 3), 1, torch.int64),  # tiny strided, int64
    ("sum", (64, 4096), 1, torch.int32),
    ("prod", (64, 4096), 1, torch.int32),
    ("sum", (33, 1000), 1, torch.bool),  # bool through its uint8 view
    ("sum", (4, 5000), 1, torch.uint8),
    ("prod", (300, 7), 0, torch.int8),
    ("sum", (4, 513, 2), 1, torch.int16),
    ("sum", (0, 5), 1, torch.bfloat16),  # empty
    ("sum", (70000, 3), 1, torch.float32),  # more rows than a grid's y or z dimension holds
    ("prod", (70000, 2, 3), 1, torch.float32),
]


def _ulp(dtype, ref):
    fi = torch.finfo(dtype)
    mag = ref.abs().clamp_min(fi.tiny)
    return fi.eps * torch.exp2(torch.floor(torch.log2(mag)))


def _inputs(kind, shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, device="cuda", generator=g) < 0.5
    if not dtype.is_floating_point:
        lo, hi = (-3, 4) if kind == "prod" else (-100, 100)
        if dtype == torch.uint8:
            lo, hi = 0, 100
        return torch.randint(lo, hi, shape, device="cuda", generator=g).to(dtype)
    x = torch.randn(shape, device="cuda", generator=g)
    return (1 + 0.01 * x if kind == "prod" else x).to(dtype)


def _check(kind, x, dim, got):
    fn = torch.cumsum if kind == "sum" else torch.cumprod
    want_dtype = torch.int64 if not x.dtype.is_floating_point else x.dtype
    assert got.dtype == want_dtype and got.shape == x.shape
    if not x.dtype.is_floating_point:
        assert torch.equal(got, fn(x, dim))
        return
    ref = fn(x.double(), dim)
    if kind == "sum":
        bound = 2.0 ** -18 * torch.cumsum(x.double().abs(), dim)
    else:
        d = dim % x.dim()
        k = torch.arange(x.shape[d], device=x.device, dtype=torch.float64)
        k = k.view([-1 if i == d else 1 for i in range(x.dim())])
        bound = 8 * torch.sqrt(k + 1) * 2.0 ** -24 * ref.abs()
    err = (got.double() - ref).abs()
    allowed = _ulp(got.dtype, ref) + bound
    bad = err > allowed
    if bad.any():
        worst = int((err - allowed).argmax())
        at = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), x.shape))
        raise AssertionError(f"{int(bad.sum())} of {x.numel()} elements off; the worst at {at}: "
                             f"{float(got.flatten()[worst])} against {float(ref.flatten()[worst])}"
                             f" (allowed {float(allowed.flatten()[worst]):.3g})")


def _op(kind, dim):
    from tileops.ops import CumprodFwdOp, CumsumFwdOp

    return (CumsumFwdOp if kind == "sum" else CumprodFwdOp)(dim=dim)


@pytest.mark.parametrize(("kind", "shape", "dim", "dtype"), CASES,
                         ids=lambda v: str(v).removeprefix("torch."))
def test_scan_matches_float64(kind, shape, dim, dtype):
    from tileops.runtime import targets

    op = _op(kind, dim)
    for seed in (0, 1):  # a second call reuses the entry on new values
        x = _inputs(kind, shape, dtype, seed)
        got = op(x)
        torch.cuda.synchronize()
        assert op.serving_target == targets.IN_TREE
        _check(kind, x, dim, got)


def test_a_transposed_input_is_scanned_as_torch_does():
    x = torch.randn(4096, 300, device="cuda").t()  # (300, 4096), strided
    got = _op("sum", 1)(x)
    _check("sum", x, 1, got)


# --- the prebuild ----------------------------------------------------------------------------


def _workloads():
    """``(kind, shape, dim, dtype name)`` of the ops' spec workloads at full size, so that the
    prebuild also covers the harness's and the benchmarks' calls."""
    from tileops.ops import CumprodFwdOp, CumsumFwdOp
    from tileops.ops.workloads import cases_of

    return [(cls.kind.value, tuple(c.inputs[0].shape), c.params["dim"], c.inputs[0].dtype)
            for cls in (CumsumFwdOp, CumprodFwdOp) for c in cases_of(cls)]


def program_keys():
    """The distinct programs the file and the spec workloads compile: ``(builder,
    arguments)``, deduplicated."""
    keys = {}
    cases = [(kind, shape, dim, str(dtype).removeprefix("torch."))
             for kind, shape, dim, dtype in CASES]
    cases += [("sum", (300, 4096), 1, "float32"), *_workloads()]
    for kind, shape, dim, name in cases:
        d = dim % len(shape)
        outer, length, inner = math.prod(shape[:d]), shape[d], math.prod(shape[d + 1:])
        name = "uint8" if name == "bool" else name
        if outer * length * inner == 0 or name not in K._SCAN_DTYPES:
            continue
        if inner == 1:
            plan = K.row_plan(length, name, outer)
            for totals in (False, True)[:1 + (plan[3] > 1)]:
                keys[("row", kind, length, name, totals, plan)] = None
        else:
            plan = K.strided_plan(length, inner, name, outer)
            for totals in (False, True)[:1 + (plan[2] > 1)]:
                keys[("strided", kind, length, inner, name, totals, plan)] = None
    return list(keys)


def _build(key):
    (K.build_row_scan if key[0] == "row" else K.build_strided_scan)(*key[1:])


def _describe(key) -> str:
    return f"{key[:-1]}"


def main(argv=None) -> int:
    from _prebuild import main as prebuild  # beside this file, which runs as a script here

    return prebuild(program_keys, _build, _describe, argv)


if __name__ == "__main__":
    sys.exit(main())
