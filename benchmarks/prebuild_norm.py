"""Compile the norm kernels a test or benchmark run will need, in parallel processes.

TileLang caches compiled kernels on disk (``~/.tilelang/cache``); compiling each configuration
once here, spread over the host's cores, lets the run that follows load them instead of
compiling one after another. Every configuration is reached through the ops themselves (a
3-row call), so exactly the kernels the ops select get built.

    python benchmarks/prebuild_norm.py [--workers N]
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]

NS = (1, 7, 128, 512, 4096, 4097, 8192, 16384, 65536)
DTYPES = ("bfloat16", "float16", "float32")


def cases() -> list[tuple]:
    out = []
    for n, dt in itertools.product(NS, DTYPES):
        out += [("rms", n, dt, True, 1e-6), ("layer", n, dt, True, 1e-5),
                ("fused", n, dt, True, 1e-6)]
    for dt in DTYPES:
        out += [("rms", 4096, dt, False, None), ("layer", 512, dt, False, 1e-5)]
    return out


def build(case: tuple) -> tuple[tuple, float, str]:
    sys.path[:0] = PATHS
    import torch

    from tileops.ops import FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp

    kind, n, dt, affine, eps = case
    dtype = getattr(torch, dt)
    t = time.perf_counter()
    try:
        for rows in (3, 256):  # the latency plan (few rows) and the bandwidth plan
            x = torch.randn(rows, n, dtype=dtype, device="cuda")
            w = torch.randn(n, dtype=dtype, device="cuda") if affine else None
            if kind == "rms":
                RMSNormFwdOp(normalized_shape=[n], eps=eps)(x, w)
            elif kind == "layer":
                LayerNormFwdOp(normalized_shape=[n], eps=eps)(x, w, w)
            else:
                FusedAddRMSNormFwdOp(eps=eps)(x, x.clone(), w)
        torch.cuda.synchronize()
        return case, time.perf_counter() - t, "ok"
    except Exception as exc:  # noqa: BLE001 - reported by the caller
        return case, time.perf_counter() - t, f"{type(exc).__name__}: {str(exc)[:300]}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=12)
    args = ap.parse_args()
    t = time.perf_counter()
    failed = 0
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        for case, secs, status in pool.map(build, cases()):
            if status != "ok":
                failed += 1
            print(f"{case} {secs:.1f}s {status}", flush=True)
    print(f"prebuilt {len(cases())} configurations in {time.perf_counter() - t:.0f}s, "
          f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
