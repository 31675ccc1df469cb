"""The softmax family's and the row norms' programs run on the host, every thread of a block a
host thread meeting the others at ``__syncthreads`` and its warp at each shuffle
(tests/kernels/_host_run.py), against torch in float64: softmax, log_softmax and logsumexp in
the register layout (a row in registers: 16-byte rows over several warps, rows shorter than a
warp packed into a CTA, a row off the vector) and the looped one (a row walked in chunks), and
RMSNorm, fused add + RMSNorm and LayerNorm in the register and looped kernels, with and
without their affine tensors."""

import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from tileops.kernels import norm as N  # noqa: E402
from tileops.kernels import softmax as S  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _host_run import HostProgram  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling a kernel's source for the host needs nvcc")


def _tol(dtype: str) -> float:
    return 1e-5 if dtype == "float32" else 1e-2  # the output's rounding


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: str) -> None:
    err = (got - want).abs() / want.abs().clamp_min(1.0)
    assert float(err.max()) <= _tol(dtype), float(err.max())


#: (kind, layout, rows, row length, dtype)
SOFTMAX = [
    pytest.param("softmax", S.Layout.REGISTER, 3, 4096, "bfloat16", id="softmax-16B-rows"),
    pytest.param("log_softmax", S.Layout.REGISTER, 11, 37, "float32", id="log-softmax-short"),
    pytest.param("logsumexp", S.Layout.REGISTER, 4, 1003, "float16", id="logsumexp-odd"),
    pytest.param("softmax", S.Layout.LOOPED, 2, 70001, "float32", id="softmax-looped"),
    pytest.param("logsumexp", S.Layout.LOOPED, 2, 70000, "bfloat16", id="logsumexp-looped"),
]


@pytest.mark.parametrize(("kind", "layout", "m", "n", "dtype"), SOFTMAX)
def test_the_softmax_forward_is_torch_s_on_the_host(kind, layout, m, n, dtype):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(m, n, generator=g, dtype=torch.float64) * 4).to(getattr(torch, dtype))
    x[0, n // 2] = 40.0  # a large logit: the max is subtracted first
    k = S.SoftmaxKind(kind)
    plan = S.plan_of(layout, S.SoftmaxSpec(device=None, kind=k, outer=m, r=n, inner=1,
                                           dtype=dtype))
    program = HostProgram(S.build_fwd(layout, kind, n, 1, dtype, plan, "sm_90"))
    y = torch.full((m,) if k is S.SoftmaxKind.LOGSUMEXP else (m, n), float("nan"),
                   dtype=x.dtype)
    program(x, y)
    w = x.double()
    want = {"softmax": lambda: w.softmax(1), "log_softmax": lambda: w.log_softmax(1),
            "logsumexp": lambda: w.logsumexp(1)}[kind]()
    _assert_close(y.double(), want, dtype)


#: (kind, kernel, rows, row length, dtype, weight, bias)
NORMS = [
    pytest.param("rms", "register", 3, 4096, "bfloat16", True, False, id="rms-16B-rows"),
    pytest.param("rms", "register", 9, 40, "float32", False, False, id="rms-short-no-weight"),
    pytest.param("layer", "register", 2, 1027, "float16", True, True, id="layer-odd"),
    pytest.param("add_rms", "register", 2, 2048, "bfloat16", True, False, id="add-rms"),
    pytest.param("rms", "looped", 2, 70001, "float32", True, False, id="rms-looped"),
    pytest.param("layer", "looped", 2, 70000, "bfloat16", True, True, id="layer-looped"),
]


@pytest.mark.parametrize(("kind", "kernel", "m", "n", "dtype", "weight", "bias"), NORMS)
def test_the_row_norms_are_torch_s_on_the_host(kind, kernel, m, n, dtype, weight, bias):
    eps = 1e-5
    g = torch.Generator().manual_seed(n + m)
    t = getattr(torch, dtype)
    x = (torch.randn(m, n, generator=g, dtype=torch.float64) * 3 + 1).to(t)
    res = torch.randn(m, n, generator=g, dtype=torch.float64).to(t)
    wt = (1 + torch.randn(n, generator=g, dtype=torch.float64) / 4).to(t)
    bs = torch.randn(n, generator=g, dtype=torch.float64).to(t)
    build = N.build_register_kernel if kernel == "register" else N.build_looped_kernel
    program = HostProgram(build(kind, n, dtype, eps, weight, bias, "sm_90"))
    y = torch.full((m, n), float("nan"), dtype=t)
    ro = torch.full((m, n), float("nan"), dtype=t) if kind == "add_rms" else None
    # the tensors present, in the programs' order: x, [residual], [weight], [bias], y, [ro]
    program(*(v for v in (x, res if ro is not None else None, wt if weight else None,
                          bs if bias else None, y, ro) if v is not None))
    s = (x.double() + res.double()).to(t).double() if kind == "add_rms" else x.double()
    if kind == "layer":
        want = (s - s.mean(1, keepdim=True)) / (s.var(1, correction=0, keepdim=True)
                                               + eps).sqrt()
    else:
        want = s / (s.pow(2).mean(1, keepdim=True) + eps).sqrt()
    if weight:
        want = want * wt.double()
    if bias:
        want = want + bs.double()
    _assert_close(y.double(), want, dtype)
    if kind == "add_rms":  # the sum, rounded to the storage dtype
        assert torch.equal(ro.double(), s)


@pytest.mark.parametrize(("m", "n", "dtype", "weight", "splits"), [
    pytest.param(2, 65536, "bfloat16", True, 4, id="rms-split-4-bf16"),
    pytest.param(1, 32768, "float32", False, 8, id="rms-split-8-f32-no-weight"),
    pytest.param(2, 40001, "float16", True, 4, id="rms-split-4-predicated-f16"),
])
def test_the_split_rms_norm_is_torch_s_on_the_host(m, n, dtype, weight, splits):
    """The split kernel's two programs: each CTA's sum of squares, then each CTA adds its row's
    partials (read as 16-byte vectors) and writes its share."""
    eps = 1e-6
    g = torch.Generator().manual_seed(n + m)
    t = getattr(torch, dtype)
    x = (torch.randn(m, n, generator=g, dtype=torch.float64) * 3 + 1).to(t)
    wt = (1 + torch.randn(n, generator=g, dtype=torch.float64) / 4).to(t)
    plan = N.split_plan(m, n, dtype, splits)
    partial, scale = (HostProgram(N.build_split_kernel(n, dtype, eps, weight, part, "sm_90",
                                                       plan)) for part in ("partial", "scale"))
    for program, name in ((partial, "partial_kernel("), (scale, "scale_kernel(")):
        program.source = program.source.replace(name, "main_kernel(")  # the name the runner finds
    parts = torch.full((m, splits), float("nan"), dtype=torch.float32)
    partial(x, parts)
    y = torch.full((m, n), float("nan"), dtype=t)
    scale(*(v for v in (x, parts, wt if weight else None, y) if v is not None))
    s = x.double()
    want = s / (s.pow(2).mean(1, keepdim=True) + eps).sqrt()
    if weight:
        want = want * wt.double()
    _assert_close(y.double(), want, dtype)
