"""The row scan's programs run on the host, every thread of a block a host thread meeting the
others at ``__syncthreads`` and its warp at each shuffle (tests/kernels/_host_run.py): the
scan of whole rows, and of a row cut into segments (the totals program, then the scan
starting each segment from the totals before it), against torch's cumulative sum and product
in float64."""

import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from tileops.kernels import scan as S  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _host_run import from_host as _from_host  # noqa: E402
from _host_run import host_array as _host_array  # noqa: E402
from _host_run import run_outputs as _run  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling a kernel's source for the host needs nvcc")


def _inputs(kind: str, m: int, n: int, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(m + n)
    if dtype in ("int32", "uint8"):
        x = torch.randint(0, 3 if kind == "prod" else 100, (m, n), generator=g)
        return x.to(torch.int32 if dtype == "int32" else torch.uint8)
    x = torch.randn(m, n, generator=g, dtype=torch.float64)
    if kind == "prod":
        x = 1 + x / (4 * n)  # a running product that stays finite
    return x.to({"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}[dtype])


def _reference(kind: str, x: torch.Tensor) -> torch.Tensor:
    w = x.double()
    return w.cumsum(1) if kind == "sum" else w.cumprod(1)


#: (kind, rows, row length, dtype, split): whole rows (one chunk, several chunks carried, a
#: row off the chunk), and rows cut into segments
ROWS = [
    pytest.param("sum", 3, 3000, "float32", False, id="sum-chunks"),
    pytest.param("sum", 5, 37, "bfloat16", False, id="sum-short-bf16"),
    pytest.param("prod", 2, 1000, "float32", False, id="prod"),
    pytest.param("sum", 2, 777, "int32", False, id="sum-int32-to-int64"),
    pytest.param("sum", 1, 20000, "float32", True, id="sum-segments"),
    pytest.param("prod", 2, 9000, "float16", True, id="prod-segments-f16"),
    pytest.param("sum", 1, 40001, "uint8", True, id="sum-segments-bytes"),
]


@pytest.mark.parametrize(("kind", "m", "n", "dtype", "split"), ROWS)
def test_the_row_scan_is_torch_s_on_the_host(kind, m, n, dtype, split):
    x = _inputs(kind, m, n, dtype)
    # a plan for as many rows as fill the GPU (whole rows), or for one row (segments)
    plan = S.row_plan(n, dtype, 1 if split else 1 << 20)
    segs = plan[3]
    assert (segs > 1) is split
    xs = _host_array(x)
    values = {"X": xs, "M": m}
    if split:
        tot = S.build_row_scan(kind, n, dtype, True, plan, "sm_90").get_kernel_source()
        values["Tot"] = _run(tot, values, (m * segs, 1), {"Tot": m * segs})["Tot"][0]
    src = S.build_row_scan(kind, n, dtype, False, plan, "sm_90").get_kernel_source()
    arr, ctype = _run(src, values, (m * segs, 1), {"Y": m * n})["Y"]
    got = _from_host(arr, ctype).view(m, n)
    want = _reference(kind, x)
    if dtype in ("int32", "uint8"):
        assert torch.equal(got, want)
    else:  # float32 accumulation: a sum's error scales with the magnitudes summed so far
        scale = x.double().abs().cumsum(1) if kind == "sum" else want.abs()
        # a product's relative error grows with its factors (float32 rounds each: 1000 of them
        # bound it by some 6e-5)
        tol = 1e-2 if dtype != "float32" else 1e-6 if kind == "sum" else 1e-4
        assert ((got - want).abs() <= tol * scale.clamp_min(1.0)).all()
