"""Time launch plans of the row-norm kernels side by side, to choose the plan heuristics.

    python benchmarks/sweep_norm.py [--out DIR]

Every plan of a shape runs on the same inputs; kernels are compiled first in parallel
processes (filling TileLang's disk cache), then timed one after another with CUDA events
around 20 back-to-back launches (median of 5). GB/s counts each input read once and each
output written once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
sys.path[:0] = PATHS

from _common import events  # noqa: E402

# (kind, rows, N, dtype): plans to compare; "looped" is the general kernel
CASES = [
    ("rms", 32768, 8192, "bfloat16",
     [(256, 1, 8, 4), (512, 1, 8, 2), (128, 1, 8, 8), (1024, 1, 8, 1), "looped"]),
    ("rms", 32768, 16384, "bfloat16",
     [(512, 1, 8, 4), (1024, 1, 8, 2), (256, 1, 8, 8), "looped"]),
    ("rms", 16384, 4097, "bfloat16",
     [(1024, 1, 1, 5), (512, 1, 1, 9), (256, 1, 1, 17), (128, 1, 1, 33), "looped"]),
    ("rms", 32768, 4096, "bfloat16",
     [(128, 1, 8, 4), (256, 1, 8, 2), (64, 2, 8, 8), (512, 1, 8, 1)]),
    ("rms", 32768, 128, "bfloat16", [(32, 4, 8, 1), (32, 8, 8, 1), (32, 2, 8, 1)]),
    ("add_rms", 32768, 8192, "bfloat16", [(256, 1, 8, 4), (512, 1, 8, 2), (128, 1, 8, 8)]),
    ("add_rms", 2048, 4096, "bfloat16", [(128, 1, 8, 4), (256, 1, 8, 2), (512, 1, 8, 1)]),
    ("add_rms", 16384, 4097, "bfloat16", [(512, 1, 1, 9), (256, 1, 1, 17), (128, 1, 1, 33)]),
    ("layer", 32768, 8192, "bfloat16", [(256, 1, 8, 4), (512, 1, 8, 2), (128, 1, 8, 8)]),
    ("layer", 16384, 4097, "bfloat16", [(512, 1, 1, 9), (256, 1, 1, 17), (128, 1, 1, 33)]),
]


def _build(job):
    sys.path[:0] = PATHS
    from tileops.kernels import norm

    kind, n, dt, plan = job
    t = time.perf_counter()
    try:
        if plan == "looped":
            norm.build_looped_kernel(kind, n, dt, 1e-6, True, kind == "layer")
        else:
            norm.build_register_kernel(kind, n, dt, 1e-6, True, kind == "layer", None,
                                       tuple(plan))
        return job, time.perf_counter() - t, "ok"
    except Exception as exc:  # noqa: BLE001
        return job, time.perf_counter() - t, f"{type(exc).__name__}: {str(exc)[:300]}"


def _time(fn) -> float:
    for _ in range(3):  # warm-up
        fn()
    return events(fn, 20)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    jobs = [(k, n, dt, p) for k, m, n, dt, plans in CASES for p in plans]
    with ProcessPoolExecutor(14, mp_context=get_context("spawn")) as pool:
        for job, _secs, status in pool.map(_build, jobs):
            if status != "ok":
                print("BUILD", job, status, flush=True)
    import torch

    from tileops.kernels import norm

    rows = []
    for kind, m, n, dt, plans in CASES:
        dtype = getattr(torch, dt)
        x = torch.randn(m, n, dtype=dtype, device="cuda")
        r = torch.randn(m, n, dtype=dtype, device="cuda")
        w = torch.randn(n, dtype=dtype, device="cuda")
        y = torch.empty_like(x)
        ro = torch.empty_like(x)
        add = kind == "add_rms"
        nbytes = m * n * x.element_size() * (4 if add else 2)
        for plan in plans:
            try:
                if plan == "looped":
                    k = norm.build_looped_kernel(kind, n, dt, 1e-6, True, kind == "layer")
                else:
                    k = norm.build_register_kernel(kind, n, dt, 1e-6, True, kind == "layer",
                                                   None, tuple(plan))
                # the programs take only the tensors present: x, [r], w, [b], y, [ro]
                args = ((x, r, w, y, ro) if add else (x, w, w, y) if kind == "layer"
                        else (x, w, y))
                ms = _time(lambda k=k, args=args: k(*args))
                gbs = nbytes / (ms * 1e-3) / 1e9
            except Exception as exc:  # noqa: BLE001
                ms, gbs = None, None
                print("RUN", kind, m, n, plan, type(exc).__name__, str(exc)[:200], flush=True)
            rows.append({"kind": kind, "rows": m, "n": n, "dtype": dt, "plan": str(plan),
                         "us": ms and ms * 1e3, "gbs": gbs})
            print(f"{kind:8s} {m:6d} x {n:6d} {str(plan):18s} "
                  f"{gbs and round(gbs)} GB/s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "norm_sweep.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
