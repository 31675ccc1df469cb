"""The softmax family's and the row norms' programs run on the host, every thread of a block a
host thread meeting the others at ``__syncthreads`` and its warp at each shuffle
(tests/kernels/_host_run.py), against torch in float64: softmax, log_softmax and logsumexp in
the register layout (a row in registers: 16-byte rows over several warps, rows shorter than a
warp packed into a CTA, a row off the vector) and the looped one (a row walked in chunks), and
RMSNorm, fused add + RMSNorm and LayerNorm in the register and looped kernels, with and
without their affine tensors."""

import re
import shutil
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from tileops.kernels import norm as N  # noqa: E402
from tileops.kernels import softmax as S  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _host_run import from_host as _from_host  # noqa: E402
from _host_run import host_array as _host_array  # noqa: E402
from _host_run import run_outputs as _run  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling a kernel's source for the host needs nvcc")

_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _tol(dtype: str) -> float:
    return 1e-5 if dtype == "float32" else 1e-2  # the output's rounding


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: str) -> None:
    err = (got - want).abs() / want.abs().clamp_min(1.0)
    assert float(err.max()) <= _tol(dtype), float(err.max())


def _blocks(src: str, m: int) -> int:
    """The grid a program launches for ``m`` rows: its rows a CTA from the source's grid
    expression (``(M + rpc - 1) / rpc``, TileLang's ceildiv), or a CTA a row."""
    rpc = re.search(r"\(\(M \+ (\d+)\) (?:>>|/) (\d+)\)", src)
    if rpc is None:
        return m
    add, by = int(rpc.group(1)), int(rpc.group(2))
    div = 1 << by if ">>" in rpc.group(0) else by
    assert add == div - 1
    return -(-m // div)


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
    x = (torch.randn(m, n, generator=g, dtype=torch.float64) * 4).to(_TORCH[dtype])
    x[0, n // 2] = 40.0  # a large logit: the max is subtracted first
    k = S.SoftmaxKind(kind)
    plan = S.plan_of(layout, S.SoftmaxSpec(device=None, kind=k, outer=m, r=n, inner=1,
                                           dtype=dtype))
    src = S.build_fwd(layout, kind, n, 1, dtype, plan, "sm_90").get_kernel_source()
    size = m if k is S.SoftmaxKind.LOGSUMEXP else m * n
    arr, ctype = _run(src, {"X": _host_array(x), "M": m}, (_blocks(src, m), 1),
                      {"Y": size})["Y"]
    w = x.double()
    want = {"softmax": lambda: w.softmax(1), "log_softmax": lambda: w.log_softmax(1),
            "logsumexp": lambda: w.logsumexp(1)}[kind]()
    _assert_close(_from_host(arr, ctype).view(want.shape), want, dtype)


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
    t = _TORCH[dtype]
    x = (torch.randn(m, n, generator=g, dtype=torch.float64) * 3 + 1).to(t)
    res = torch.randn(m, n, generator=g, dtype=torch.float64).to(t)
    wt = (1 + torch.randn(n, generator=g, dtype=torch.float64) / 4).to(t)
    bs = torch.randn(n, generator=g, dtype=torch.float64).to(t)
    build = N.build_register_kernel if kernel == "register" else N.build_looped_kernel
    src = build(kind, n, dtype, eps, weight, bias, "sm_90").get_kernel_source()
    values = {"X": _host_array(x), "M": m}
    if kind == "add_rms":
        values["R"] = _host_array(res)
    if weight:
        values["W"] = _host_array(wt)
    if bias:
        values["B"] = _host_array(bs)
    outs = {"Y": m * n, **({"RO": m * n} if kind == "add_rms" else {})}
    got = _run(src, values, (_blocks(src, m), 1), outs)
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
    _assert_close(_from_host(*got["Y"]).view(m, n), want, dtype)
    if kind == "add_rms":  # the sum, rounded to the storage dtype
        assert torch.equal(_from_host(*got["RO"]).view(m, n), s)
