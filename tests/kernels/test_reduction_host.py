"""The reduction kernels' row programs run on the host, every thread of a block a host thread
meeting the others at ``__syncthreads`` and its warp at each shuffle (tests/kernels/_host_run.py):
each kind's output against torch's in float64 over rows with the edges the programs handle
(a row shorter than a warp, eight rows a CTA, a row over several warps whose partials cross
in shared memory, the tail of a row off the vector and the pass, NaNs, ties), and a split row
(partial states, then the finish program) against the unsplit result."""

import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from tileops.kernels import reduction as K  # noqa: E402
from tileops.kernels.reduction import ReduceKind as RK  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import _host_run as H  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling a kernel's source for the host needs nvcc")

_host_array, _from_host, _run = H.host_array, H.from_host, H.run_outputs


def _reference(kind: RK, x: torch.Tensor, correction: float):
    """torch's result in float64 (the arg kinds: the first index of the extreme, a NaN's
    where one is present, as torch's)."""
    w = x.double()
    if kind is RK.SUM:
        return w.sum(1)
    if kind is RK.MEAN:
        return w.mean(1)
    if kind is RK.PROD:
        return w.prod(1)
    if kind is RK.AMAX:
        return w.amax(1)
    if kind is RK.AMIN:
        return w.amin(1)
    if kind is RK.VAR:
        return w.var(1, correction=correction)
    if kind is RK.STD:
        return w.std(1, correction=correction)
    if kind is RK.VAR_MEAN:
        return torch.var_mean(w, 1, correction=correction)
    if kind is RK.L2NORM:
        return w.norm(dim=1)
    if kind is RK.ALL:
        return x.bool().all(1).double()
    if kind is RK.ANY:
        return x.bool().any(1).double()
    if kind is RK.ARGMAX:
        return x.argmax(1).double()
    return x.argmin(1).double()


def _inputs(kind: RK, m: int, n: int, dtype: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == "bool":
        return torch.rand(m, n, generator=g) < (0.97 if kind is RK.ALL else 0.03)
    if dtype in ("int32", "int16", "int8"):
        if kind is RK.PROD:  # factors of -2, -1, 1, 2: a product that stays within int64
            pick = torch.randint(0, 4, (m, n), generator=g)
            return torch.tensor([-2, -1, 1, 2], dtype=getattr(torch, dtype))[pick]
        return torch.randint(-50, 50, (m, n), generator=g, dtype=getattr(torch, dtype))
    if dtype == "uint8":  # zeros among them, for all and any
        return torch.randint(0, 200, (m, n), generator=g, dtype=torch.uint8) // 4
    x = torch.randn(m, n, generator=g, dtype=torch.float64)
    if kind is RK.PROD:
        x = 1 + x / (4 * n)  # a product that stays finite
    x = x.to(getattr(torch, dtype))
    if kind in (RK.ARGMAX, RK.ARGMIN, RK.AMAX, RK.AMIN) and n > 3:
        x[0, 1] = x[0, n - 1] = x[0].max() if kind in (RK.ARGMAX, RK.AMAX) else x[0].min()
        x[-1, n // 2] = float("nan")  # the NaN is the extreme, as in torch
    return x


#: (kind, rows, row length, dtype, correction): each path of the row program
ROWS = [
    # a row over four warps of 16-byte loads: partials cross in shared memory
    pytest.param(RK.SUM, 3, 4096, "bfloat16", 0.0, id="sum-bf16-4096"),
    # a row off the vector and the pass (predicated columns), 128 threads a row
    pytest.param(RK.MEAN, 5, 1003, "float32", 0.0, id="mean-odd"),
    # rows shorter than a warp: eight rows a CTA, the last CTA partly past the rows
    pytest.param(RK.AMAX, 11, 37, "float16", 0.0, id="amax-short-rows-nan"),
    # ties and a NaN: the first index, as torch
    pytest.param(RK.ARGMAX, 4, 5000, "bfloat16", 0.0, id="argmax-ties-nan"),
    pytest.param(RK.ARGMIN, 9, 33, "float32", 0.0, id="argmin-short"),
    # Welford's moments over a shift, two outputs
    pytest.param(RK.VAR_MEAN, 3, 2049, "float32", 1.0, id="var-mean"),
    pytest.param(RK.STD, 2, 300, "bfloat16", 0.0, id="std"),
    pytest.param(RK.PROD, 2, 64, "float32", 0.0, id="prod"),
    pytest.param(RK.L2NORM, 2, 8192, "float16", 0.0, id="l2norm"),
    # integers widen to int64; bools read as bytes
    pytest.param(RK.SUM, 3, 777, "int32", 0.0, id="sum-int32"),
    pytest.param(RK.ALL, 10, 7, "bool", 0.0, id="all-bool"),
    pytest.param(RK.ANY, 2, 4100, "bool", 0.0, id="any-bool"),
    # the 8- and 16-bit integers read as themselves (16 and 8 to an access), widened to int64;
    # a uint8 input's all keeps uint8, bool's amax is bool
    pytest.param(RK.SUM, 3, 4099, "int8", 0.0, id="sum-int8"),
    pytest.param(RK.PROD, 2, 24, "int16", 0.0, id="prod-int16"),
    pytest.param(RK.ARGMAX, 5, 1000, "int16", 0.0, id="argmax-int16"),
    pytest.param(RK.AMIN, 4, 70, "uint8", 0.0, id="amin-uint8"),
    pytest.param(RK.ALL, 10, 7, "uint8", 0.0, id="all-uint8"),
    pytest.param(RK.AMAX, 9, 40, "bool", 0.0, id="amax-bool"),
]


def _tolerance(kind: RK, dtype: str, out_ctype: str) -> float:
    if kind in (RK.ALL, RK.ANY, RK.ARGMAX, RK.ARGMIN, RK.AMAX, RK.AMIN) or dtype in (
            "int32", "int16", "int8", "uint8"):
        return 0.0  # exact
    if out_ctype in ("bfloat16_t", "half_t"):
        return 1e-2  # the output's rounding
    return 1e-5


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    nan = want.isnan()
    if not torch.equal(got.isnan(), nan):
        return False
    got, want = got[~nan], want[~nan]
    if tol == 0:
        return torch.equal(got, want)
    return bool(((got - want).abs() <= tol * want.abs().clamp_min(1.0)).all())


@pytest.mark.parametrize(("kind", "m", "n", "dtype", "correction"), ROWS)
def test_the_row_program_is_torch_s_reduction_on_the_host(kind, m, n, dtype, correction):
    x = _inputs(kind, m, n, dtype, seed=m * n)
    rpc = K.row_shape(n, dtype)[1]  # rows a CTA
    src = K.build_row_kernel(kind, n, dtype, correction, 1, "sm_90").get_kernel_source()
    outs = {"Y0": m, **({"Y1": m} if kind is RK.VAR_MEAN else {})}
    got = _run(src, {"X": _host_array(x), "M": m}, (-(-m // rpc), 1), outs)
    want = _reference(kind, x, correction)
    wants = want if kind is RK.VAR_MEAN else (want,)
    for (arr, ctype), ref in zip((got[name] for name in outs), wants, strict=True):
        out = _from_host(arr, ctype)
        assert _close(out, ref, _tolerance(kind, dtype, ctype)), (out, ref)


@pytest.mark.parametrize(("kind", "dtype"), [
    pytest.param(RK.SUM, "float32", id="sum"),
    pytest.param(RK.VAR_MEAN, "float32", id="var-mean"),  # the shift as a third part
    pytest.param(RK.ARGMIN, "bfloat16", id="argmin"),  # the indices' own workspace
])
def test_a_split_row_and_its_finish_are_the_unsplit_result_on_the_host(kind, dtype):
    """A row split over four CTAs writes partial states; the finish program merges them into
    torch's result."""
    m, n, splits, correction = 2, 9000, 4, 1.0 if kind is RK.VAR_MEAN else 0.0
    x = _inputs(kind, m, n, dtype, seed=7)
    rpc = K.row_shape(n, dtype)[1]
    src = K.build_row_kernel(kind, n, dtype, correction, splits, "sm_90").get_kernel_source()
    ar = K._Arith(kind, dtype, n, correction)
    parts = ar.nparts + (1 if kind in (RK.VAR, RK.STD, RK.VAR_MEAN) else 0)
    outs = {"Y0": parts * splits * m, **({"Y1": splits * m} if ar.arg else {})}
    work = _run(src, {"X": _host_array(x), "M": m}, (-(-m // rpc), splits), outs)
    fin = K.build_finish_kernel(kind, splits, dtype, n, correction, "sm_90").get_kernel_source()
    final = {"Y0": m, **({"Y1": m} if kind is RK.VAR_MEAN else {})}
    values = {"W": work["Y0"][0], "P": m, **({"WI": work["Y1"][0]} if ar.arg else {})}
    got = _run(fin, values, (-(-m // K._FINISH_PER_CTA), 1), final)
    want = _reference(kind, x, correction)
    wants = want if kind is RK.VAR_MEAN else (want,)
    for (arr, ctype), ref in zip((got[name] for name in final), wants, strict=True):
        assert _close(_from_host(arr, ctype), ref, _tolerance(kind, dtype, ctype))


#: (kind, outer, reduced, inner, dtype, correction): the column program over (outer, r, inner)
COLUMNS = [
    # a warp over 32 vectors of a row of inner: coalesced reads, threads over r combined in
    # shared memory
    pytest.param(RK.SUM, 2, 300, 256, "bfloat16", 0.0, id="sum-wide-inner"),
    # inner narrower than a warp's vectors: more of the threads over r; columns off the block
    pytest.param(RK.ARGMIN, 3, 33, 7, "float16", 0.0, id="argmin-narrow"),
    pytest.param(RK.VAR_MEAN, 2, 1000, 40, "float32", 1.0, id="var-mean"),
    pytest.param(RK.ANY, 2, 65, 100, "bool", 0.0, id="any-bool"),
    pytest.param(RK.SUM, 2, 70, 48, "int8", 0.0, id="sum-int8"),
    pytest.param(RK.AMAX, 2, 33, 20, "bool", 0.0, id="amax-bool"),
]


@pytest.mark.parametrize(("kind", "outer", "r", "inner", "dtype", "correction"), COLUMNS)
def test_the_column_program_is_torch_s_reduction_on_the_host(kind, outer, r, inner, dtype,
                                                            correction):
    x3 = _inputs(kind, outer * inner, r, dtype, seed=r + inner)  # rows of r: each a column
    x = x3.view(outer, inner, r).transpose(1, 2).contiguous()  # (outer, r, inner)
    tcols, ty, vec, per = K.column_shape(inner, dtype)
    src = K.build_column_kernel(kind, r, inner, dtype, correction, 1,
                                "sm_90").get_kernel_source()
    size = outer * inner
    outs = {"Y0": size, **({"Y1": size} if kind is RK.VAR_MEAN else {})}
    blocks = -(-inner // (tcols * vec))
    got = _run(src, {"X": _host_array(x), "outer": outer}, (blocks * outer, 1), outs)
    flat = x.transpose(1, 2).reshape(outer * inner, r)  # each output's column as a row
    want = _reference(kind, flat, correction)
    wants = want if kind is RK.VAR_MEAN else (want,)
    for (arr, ctype), ref in zip((got[name] for name in outs), wants, strict=True):
        out = _from_host(arr, ctype)
        assert _close(out, ref, _tolerance(kind, dtype, ctype)), (out, ref)
