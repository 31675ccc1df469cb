"""The fp8 quantiser's row and tensor programs run on the host (tests/kernels/_host_run.py's
HostProgram in place of each compiled program's launch), through the kernel class's whole call:
a row held in registers (a row over four warps, rows shorter than a warp packed 256 threads a
CTA, a row off the 16-byte vector), a row too long to hold (its first step held, the rest read
twice), the tensor in one CTA and in two programs (the partial maxima over a grid smaller than
the row groups, then the quantiser walking them from the end). The scales must be the float64
``max(amax, 1e-12) / fp8_max`` to float32 rounding and ``q`` torch's cast of ``x / scale``
(float32 division, as the programs divide), an all-zero row included; outputs are filled with
a pattern first, so an element never written fails."""

import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("numpy")

from tileops.kernels import fp8_quant as Q  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _host_run import HostProgram  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling a kernel's source for the host needs nvcc")

CPU = torch.device("cpu")
G = Q.Granularity


@pytest.fixture
def on_host(monkeypatch):
    """The kernel class building its programs for sm_90 and running them on the host, as on a
    device of ``sms`` SMs (2: a grid of partial maxima smaller than the row groups)."""
    def hosted(build):
        return lambda *args: HostProgram(build(*args, "sm_90"))

    monkeypatch.setattr(Q, "BUILDERS", {name: hosted(b) for name, b in Q.BUILDERS.items()})
    monkeypatch.setattr(Q, "sm_count", lambda device: 2)


def _quantise(g, m, k, dtype, fp8, seed, zero_row=True):
    torch.manual_seed(seed)
    x = (torch.randn(m, k) * torch.rand(m, 1) * 8).to(getattr(torch, dtype))
    if zero_row and m > 2:
        x[2] = 0
    kern = Q.Fp8QuantKernel(Q.Fp8QuantSpec(device=CPU, m=m, k=k, dtype=dtype, fp8_dtype=fp8,
                                           granularity=g))
    q = torch.full((m, k), 0x7F, dtype=torch.uint8).view(getattr(torch, fp8))  # NaN in e4m3
    scale = torch.full((m, 1) if g is G.ROW else (), float("nan"))
    kern(x, q, scale)
    return kern, x, q, scale


def _check(g, x, q, scale, fp8):
    fmax = Q.FP8_MAX[fp8]
    xd = x.double()
    amax = xd.abs().amax(1, keepdim=True) if g is G.ROW else xd.abs().amax()
    want = amax.clamp_min(Q.AMAX_FLOOR) / fmax
    torch.testing.assert_close(scale.double(), want, rtol=2 ** -23, atol=0)
    quot = (x.float() / scale.float()).clamp(-fmax, fmax)  # the programs' float32 quotient
    want_q = quot.to(getattr(torch, fp8))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


#: (granularity, rows, row length, dtype, fp8 dtype): each plan of the row programs
CASES = [
    # a row over four warps of 16-byte accesses, one row a CTA; the all-zero row's floor
    pytest.param(G.ROW, 5, 4096, "bfloat16", "float8_e4m3fn", id="row-4096"),
    # rows of 7 elements, one thread each, 256 rows a CTA (the last CTA mostly past M)
    pytest.param(G.ROW, 300, 7, "float32", "float8_e4m3fn", id="row-short"),
    # a row off the 16-byte vector: 2-byte accesses over 256 threads, the last predicated
    pytest.param(G.ROW, 3, 4095, "float16", "float8_e5m2", id="row-odd"),
    # too long to hold: the first step in registers, three more read twice
    pytest.param(G.ROW, 2, 65536, "bfloat16", "float8_e4m3fn", id="row-long"),
    # one row, one CTA; and 3 x 7 in one CTA of 256 threads
    pytest.param(G.TENSOR, 1, 4096, "bfloat16", "float8_e4m3fn", id="tensor-one-row"),
    pytest.param(G.TENSOR, 3, 7, "float16", "float8_e5m2", id="tensor-tiny"),
    # 17 rows of 4096 bf16 (136 KiB): two programs, 16 partials of 17 row groups, the
    # quantiser's CTAs of 4 groups from the end (the first CTA's group 16, the last's 0)
    pytest.param(G.TENSOR, 17, 4096, "bfloat16", "float8_e4m3fn", id="tensor-two-programs"),
    # long rows in two programs: steps of the walk and the one-row program not built
    pytest.param(G.TENSOR, 3, 65536, "bfloat16", "float8_e4m3fn", id="tensor-long"),
]


@pytest.mark.parametrize(("g", "m", "k", "dtype", "fp8"), CASES)
def test_the_row_programs_quantise_as_torch_on_the_host(on_host, g, m, k, dtype, fp8):
    kern, x, q, scale = _quantise(g, m, k, dtype, fp8, seed=m * k)
    _check(g, x, q, scale, fp8)
    if g is G.TENSOR:  # the program the call took
        assert (kern.one is not None) == Q.one_cta_serves(1, k, dtype)
        assert Q.one_cta_serves(m, k, dtype) == (m * k * 2 <= Q.TENSOR_ONE_CTA_BYTES)


def test_the_tensor_s_largest_element_may_be_in_any_partial(on_host):
    """The maximum in the first row group, read by the first partial's CTA and quantised by the
    last CTA of the quantiser; and in the last."""
    for row in (0, 16):
        torch.manual_seed(row)
        x = torch.randn(17, 4096).to(torch.bfloat16)
        x[row, 4095] = -1000.0
        kern = Q.Fp8QuantKernel(Q.Fp8QuantSpec(device=CPU, m=17, k=4096, dtype="bfloat16",
                                               fp8_dtype="float8_e4m3fn", granularity=G.TENSOR))
        q = torch.empty(17, 4096, dtype=torch.float8_e4m3fn)
        scale = torch.empty(())
        kern(x, q, scale)
        _check(G.TENSOR, x, q, scale, "float8_e4m3fn")
        assert q[row, 4095].float().item() == -448.0
