"""Compile the kernels of ops' spec workloads before a GPU run, in parallel processes.

TileLang caches compiled kernels on disk; building every configuration a test or benchmark
run needs here, spread over the host's cores, lets that run load them instead of compiling
one after another. Each case is an op's own workload row and dtype case, scaled down
(``--max-elements``; sizes are launch-time, so a scaled call builds what the full one uses),
called through the op on the GPU: exactly the kernels the ops select get built.

    python benchmarks/prebuild_ops.py --family elementwise [--workers N] [OP ...]
    python benchmarks/prebuild_ops.py --family elementwise --list   # the ops, as a pytest -k
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]


def _ops(family: str | None, names: list[str]) -> list[str]:
    sys.path[:0] = PATHS
    import tileops.ops
    from tileops.runtime import Op

    if names:
        return names
    out = []
    for name in tileops.ops.__all__:
        cls = getattr(tileops.ops, name)
        plan = getattr(cls, "_signature", None)
        if isinstance(cls, type) and issubclass(cls, Op) and plan is not None and \
                (family is None or plan.entry.family == family) and \
                plan.entry.status == "implemented":
            out.append(name)
    return out


def build(job: tuple[str, int]) -> tuple[str, float, str]:
    sys.path[:0] = PATHS
    import torch

    import tileops.ops
    from tileops.ops.workloads import cases_of, make_inputs

    name, cap = job
    cls = getattr(tileops.ops, name)
    t = time.perf_counter()
    done, wide, failed = 0, 0, []
    for case in cases_of(cls, max_elements=cap):
        try:
            op = cls(**case.params)
            op(*make_inputs(case, "cuda"))
            done += 1
        except tileops.ops.UnservedDtypeError:  # a row for the reference target: no kernel
            wide += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            failed.append(f"{case.label}/{case.dtype}: {type(exc).__name__}: {str(exc)[:200]}")
    torch.cuda.synchronize()
    status = "ok" if not failed else "; ".join(failed[:3])
    left = f", {wide} in dtypes left to the reference target" if wide else ""
    return f"{name} ({done} cases{left})", time.perf_counter() - t, status


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ops", nargs="*")
    ap.add_argument("--family")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--max-elements", type=int, default=1 << 16)
    ap.add_argument("--list", action="store_true",
                    help="print the ops' names, one line joined by ' or ' (a pytest -k), and "
                         "build nothing")
    args = ap.parse_args()
    names = _ops(args.family, args.ops)
    if args.list:
        print(" or ".join(names))
        return 0
    t = time.perf_counter()
    failed = 0
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        for what, secs, status in pool.map(build, [(n, args.max_elements) for n in names]):
            failed += status != "ok"
            print(f"{what} {secs:.1f}s {status}", flush=True)
    print(f"prebuilt {len(names)} ops in {time.perf_counter() - t:.0f}s, {failed} with failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
