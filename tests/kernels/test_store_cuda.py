"""The kernel store on a GPU: a kernel compiled in one process is loaded by the next without
importing TileLang, and computes the same result (each process fresh, its cache a temporary
folder): row programs, and a Hopper GEMM whose TMA descriptors are encoded through TileLang's
runtime library on every launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.cuda

_PATHS = [p for p in sys.path if p.endswith("/src")]

_CALL = r"""
import json, sys, time
sys.path[:0] = {paths!r}
import torch
g = torch.Generator(device="cuda").manual_seed(0)
x = torch.randn(33, 4097, device="cuda", dtype=torch.bfloat16, generator=g)
w = torch.randn(4097, device="cuda", dtype=torch.bfloat16, generator=g)
t = time.perf_counter()
from tileops.ops import GemmFwdOp, RMSNormFwdOp, SoftmaxFwdOp
y = RMSNormFwdOp(normalized_shape=4097)(x, w)
s = SoftmaxFwdOp(dim=-1)(x)
# a Hopper GEMM: TMA copies, whose descriptors the library encodes through TileLang's own
# runtime library on every launch
a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16, generator=g)
c = GemmFwdOp()(a, a)
torch.cuda.synchronize()
# eps None is torch's: the input dtype's machine epsilon
ref = torch.nn.functional.rms_norm(x.double(), [4097], w.double(),
                                   eps=torch.finfo(torch.bfloat16).eps)
print(json.dumps({{"s": time.perf_counter() - t, "tilelang": "tilelang" in sys.modules,
                   "rms": ((y.double() - ref).abs() / ref.abs().clamp_min(1)).max().item(),
                   "softmax": (s.double() - torch.softmax(x.double(), -1)).abs().max().item(),
                   "gemm": ((c.double() - a.double() @ a.double()).norm()
                            / (a.double() @ a.double()).norm()).item(),
                   "sum": [y.double().sum().item(), s.double().sum().item(),
                           c.double().sum().item()]}}))
"""


def _run(cache):
    env = dict(os.environ, TILEOPS_CACHE_DIR=str(cache))
    res = subprocess.run([sys.executable, "-c", _CALL.format(paths=_PATHS)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_a_stored_kernel_loads_without_tilelang_and_computes_the_same(tmp_path):
    first = _run(tmp_path)
    assert first["tilelang"]  # it compiled
    entries = sorted(p.name for p in (tmp_path / "kernels").iterdir())
    assert len(entries) >= 3 and all(len(e) == 64 for e in entries)  # one per program
    second = _run(tmp_path)
    assert not second["tilelang"], "the second process imported TileLang"
    assert second["sum"] == first["sum"]  # bit for bit the same kernels
    # and right, against float64: within bf16's ulp (relative above 1, absolute below)
    assert second["rms"] < 8e-3 and second["softmax"] < 4e-3 and second["gemm"] < 1e-2
