"""Time the top-k kernel's plans side by side: the lean plan (the default), the earlier one, and
the lean plan's choices taken one at a time, on the spec's workloads.

    python benchmarks/sweep_topk.py [--out DIR] [--workers N] [--prebuild]

A plan tuple is :func:`tileops.kernels.topk.topk_plan`'s ``(threads, vec, pre, cap, sort,
lean)``, run as one program over the rows (the many-row shapes, which are not split); "lean"
and "earlier" are :class:`~tileops.kernels.topk.TopkRadixKernel` on either plan, split as the
entry splits (the few-row shapes); "torch" is ``torch.topk``. Every plan of a shape runs on
the same normal inputs and its answer is checked against ``torch.topk``'s values (the indices
of ties may differ). The programs are compiled first in parallel processes (filling
TileLang's disk cache), then timed one after another with CUDA events around 20 back-to-back
calls (median of 5); ``--prebuild`` only compiles. TB/s counts the input read once.
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

_EARLIER = (512, 8, 4, 4096, 128, False)
# (label, rows, n, k, dtype, largest, plans)
CASES = [
    ("vocab-k50", 4096, 128256, 50, "bfloat16", True, [
        _EARLIER,
        (256, 8, 8, 2048, 128, True),  # the lean plan
        (512, 8, 4, 4096, 128, True),  # the float filter alone
        (256, 8, 8, 2048, 128, False),  # 256 threads and 8 loads alone
        (256, 8, 4, 2048, 128, True),  # 4 loads in flight
        (128, 8, 16, 2048, 128, True),  # 128 threads holding 16
        (512, 8, 4, 2048, 128, True),
        "torch",
    ]),
    ("fp32-m1024-n32000", 1024, 32000, 50, "float32", True, ["earlier", "lean", "torch"]),
    ("smallest-k10", 1024, 32000, 10, "bfloat16", False, ["earlier", "lean", "torch"]),
    ("k1024-n131072", 64, 131072, 1024, "bfloat16", True, ["earlier", "lean", "torch"]),
    ("row-n262144", 1, 262144, 50, "bfloat16", True, ["earlier", "lean", "torch"]),
]


def _programs(rows, n, k, dt, largest, plan):
    """build_topk's arguments of what one plan of a case runs."""
    from tileops.kernels import topk

    if plan == "torch":
        return []
    if not isinstance(plan, str):
        return [(n, k, dt, largest, None, tuple(plan))]
    lean = plan == "lean"
    segs = topk.split_plan(rows, n, k)
    out = [(n // segs, k, dt, largest, None, topk.topk_plan(n // segs, k, dt, lean))]
    if segs > 1:
        out.append((segs * k, k, dt, largest, None, topk.topk_plan(segs * k, k, dt, lean)))
    return out


def _build(key):
    sys.path[:0] = PATHS
    from tileops.kernels import topk

    t = time.perf_counter()
    try:
        topk.build_topk(*key)
        return key, time.perf_counter() - t, "ok"
    except Exception as exc:  # noqa: BLE001 - reported, the others go on
        return key, time.perf_counter() - t, f"{type(exc).__name__}: {str(exc)[:300]}"


def _callable(rows, n, k, dt, largest, plan):
    """The call of one plan: ``f(x, values, indices)``."""
    import torch

    from tileops.kernels import topk

    if plan == "torch":
        def call(x, v, i):
            torch.topk(x, k, dim=-1, largest=largest, out=(v, i))
        return call
    if not isinstance(plan, str):
        return topk.build_topk(n, k, dt, largest, None, tuple(plan))
    spec = topk.TopkSpec(device="cuda", rows=rows, n=n, k=k, dtype=dt, largest=largest)
    return topk.TopkRadixKernel(spec, lean=plan == "lean")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--workers", type=int, default=15)
    ap.add_argument("--prebuild", action="store_true", help="compile the programs only")
    args = ap.parse_args()
    keys = list(dict.fromkeys(key for label, *case, plans in CASES for p in plans
                              for key in _programs(*case, p)))
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        for key, secs, status in pool.map(_build, keys):
            print(f"build {key} {secs:.1f}s {status}", flush=True)
    if args.prebuild:
        return 0
    import torch

    results = []
    for label, rows, n, k, dt, largest, plans in CASES:
        dtype = getattr(torch, dt)
        x = torch.randn(rows, n, device="cuda", dtype=dtype)
        want = torch.topk(x, k, dim=-1, largest=largest).values
        nbytes = x.numel() * x.element_size()
        for plan in plans:
            v = torch.empty(rows, k, dtype=dtype, device="cuda")
            i = torch.empty(rows, k, dtype=torch.int64, device="cuda")
            try:
                fn = _callable(rows, n, k, dt, largest, plan)
                fn(x, v, i)
                right = bool(torch.equal(v, want))
                for _ in range(3):  # warm-up
                    fn(x, v, i)
                ms = events(lambda fn=fn, x=x, v=v, i=i: fn(x, v, i), 20)
                tbs = nbytes / (ms * 1e-3) / 1e12
            except Exception as exc:  # noqa: BLE001 - reported, the others go on
                ms = tbs = right = None
                print("RUN", label, plan, type(exc).__name__, str(exc)[:200], flush=True)
            results.append({"case": label, "rows": rows, "n": n, "k": k, "dtype": dt,
                            "largest": largest, "plan": str(plan), "us": ms and ms * 1e3,
                            "tbs": tbs, "right": right})
            print(f"{label:18s} {str(plan):32s} "
                  f"{ms and round(ms * 1e3, 1)} us {tbs and round(tbs, 2)} TB/s"
                  f"{'' if right else '  WRONG VALUES'}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "topk_sweep.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
