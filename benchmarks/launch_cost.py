"""Host cost of launching one compiled TileLang program, per execution backend.

    python benchmarks/launch_cost.py

A small GEMM program (TMA + wgmma, 256 x 256 x 256: a few microseconds on the device) and a
row-norm program are compiled for each of TileLang's execution backends that builds here and
called back to back from Python; microseconds per call by the host clock over 3000 calls
(best of 5), next to the device time of the same calls replayed from a CUDA graph. Where the
host figure exceeds the device figure, the launch path sets the eager speed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]

from _common import graph_events  # noqa: E402

BACKENDS = ("tvm_ffi", "cython", "nvrtc")


def host_us(fn, calls: int = 3000, trials: int = 5) -> float:
    import torch

    best = float("inf")
    for _ in range(trials):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def main() -> int:
    import tilelang
    import torch

    from tileops.kernels import gemm as G

    cfg = G.HOPPER_CONFIGS["64x64"][0]
    m = n = k = 256
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
    ref = a.float() @ b.float()
    print(f"{'program':10} {'backend':8} {'host us':>8} {'device us':>9}  note")
    rows = []
    for backend in BACKENDS:
        for pdl in (False, True):
            try:
                prog = G.gemm_program(n, k, "bfloat16", False, False, cfg, pdl)
                kern = tilelang.compile(prog, execution_backend=backend)
                c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                kern(a, b, c)
                err = ((c.float() - ref).norm() / ref.norm()).item()
                h = host_us(lambda kern=kern, c=c: kern(a, b, c))
                d = graph_events(lambda kern=kern, c=c: kern(a, b, c), 50) * 1e3
                rows.append((f"gemm{'+pdl' if pdl else ''}", backend, h, d, f"err {err:.1e}"))
            except Exception as exc:  # noqa: BLE001 - a backend that fails here is reported
                rows.append((f"gemm{'+pdl' if pdl else ''}", backend, float("nan"),
                             float("nan"), f"{type(exc).__name__}: {str(exc)[:120]}"))
            print("{:10} {:8} {:8.2f} {:9.2f}  {}".format(*rows[-1]), flush=True)
    for fn_name, fn in (("torch.mm", lambda: torch.mm(a, b)),
                        ("empty", lambda: torch.empty(m, n, dtype=torch.bfloat16,
                                                      device="cuda"))):
        print(f"{fn_name:10} {'-':8} {host_us(fn):8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
