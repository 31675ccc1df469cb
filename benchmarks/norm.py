"""Host cost and first-call time of the norm ops on the GPU: what the side-by-side benchmark
does not measure.

    python benchmarks/norm.py [--out DIR] [--no-first-call]
    python benchmarks/norm.py --host-only          # prints JSON; writes nothing

The ops against torch eager, torch.compile and Liger-Kernel on their spec workloads are
``tileops bench RMSNormFwdOp FusedAddRMSNormFwdOp LayerNormFwdOp`` (``benchmarks/gpu_norm.sh``
runs it): the harness owns the workloads (the specs') and the timing method. What stays here
is measured on one deliberate call, not a workload:

- host microseconds per cached eager call on 1 x 4096 bf16 (wall clock, synchronising every
  200 calls, best of 5): the op; the kernel entry it built, called directly (output
  preallocated, then with the op's allocation); the op through its ``torch.library`` custom op
  (the route torch.compile traces); ``F.rms_norm``.
- the first call's wall time in a fresh process (import to result, 2048 x 4096 bf16) with
  every cache cold, then warm (the kernel loaded from the kernel store, TileLang not
  imported), then with only TileLang's own cache warm.

Results: JSON + Markdown (norm_host.json, norm_host.md) under --out.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
for _p in reversed(PATHS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _common import versions  # noqa: E402


def host_overhead() -> dict:
    """Host microseconds per cached eager call on 1 x 4096 bf16 (see the module docstring);
    ``op_over_direct_plus_alloc`` is the op layer's cost as a ratio."""
    import torch
    import torch.nn.functional as F

    from tileops.ops import RMSNormFwdOp

    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    op = RMSNormFwdOp(normalized_shape=[4096], eps=1e-6)
    y = op(x, w)
    # the entry the op built for this call: the kernel without the op layer around it
    (entry,) = [e for es in op.built_entries.values() for e in es.values()]

    def direct():
        entry(x, None, w, None, y, None)

    def direct_alloc():
        entry(x, None, w, None, torch.empty_like(x), None)

    boundary = getattr(torch.ops.tileops, op._boundary.name)  # the torch.library route

    out = {}
    for name, fn in (("op", lambda: op(x, w)), ("kernel_direct", direct),
                     ("op_through_custom_op", lambda: boundary(x, w, op._instance_key)),
                     ("kernel_direct_plus_alloc", direct_alloc),
                     ("F.rms_norm", lambda: F.rms_norm(x, [4096], w, 1e-6))):
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t) / 200 * 1e6)
        out[name] = best
    out["op_over_direct_plus_alloc"] = out["op"] / out["kernel_direct_plus_alloc"]
    return out


_FIRST_CALL = r"""
import sys, time, torch
sys.path[:0] = {paths!r}
x = torch.randn(2048, 4096, dtype=torch.bfloat16, device="cuda")
w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
torch.cuda.synchronize()
t = time.perf_counter()
from tileops.ops import RMSNormFwdOp
op = RMSNormFwdOp(normalized_shape=[4096], eps=1e-6)
op(x, w)
torch.cuda.synchronize()
print(time.perf_counter() - t, "tilelang" in sys.modules)
"""


def first_call() -> dict:
    """Seconds from import to the first result, in a fresh process, and whether it imported
    TileLang: cold (an empty cache), warm (the cache the cold run filled: the kernel loads from
    the kernel store), then warm with the kernel store emptied (TileLang's own cache only, so
    TileLang is imported to load it)."""
    code = _FIRST_CALL.format(paths=PATHS)
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        # every cache of the library (TileLang's compiled kernels included) follows
        # TILEOPS_CACHE_DIR, which points TileLang's own variable under it
        env = dict(os.environ, TILEOPS_CACHE_DIR=cache)
        for label in ("cold", "warm", "warm_tilelang_cache_only"):
            if label == "warm_tilelang_cache_only":
                shutil.rmtree(os.path.join(cache, "kernels"), ignore_errors=True)
            res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, timeout=300)
            try:
                seconds, imported = res.stdout.strip().splitlines()[-1].split()
                out[label] = float(seconds)
                out[f"{label}_imports_tilelang"] = imported == "True"
            except (ValueError, IndexError):
                out[label] = None
                out[f"{label}_error"] = res.stderr[-500:]
    return out


def _markdown(result: dict) -> str:
    v = result["versions"]
    h = result["host_us"]
    lines = [f"# Norm ops: host cost and first call on {v['gpu']} ({result['date']})", "",
             ", ".join(f"{k} {val}" for k, val in v.items() if val and k != "gpu") + ".", "",
             "Host, 1 x 4096 bf16, microseconds per cached eager call: "
             + ", ".join(f"{k} {val:.1f}" if "over" not in k else f"{k} {val:.2f}x"
                         for k, val in h.items())]
    if "first_call_s" in result:
        fc = result["first_call_s"]
        lines.append("First call in a fresh process (import to result), seconds: " + ", ".join(
            f"{k} {fc.get(k)}" + (" (TileLang imported)"
                                  if fc.get(f"{k}_imports_tilelang") else " (no TileLang)")
            for k in ("cold", "warm", "warm_tilelang_cache_only")))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--no-first-call", action="store_true")
    ap.add_argument("--host-only", action="store_true",
                    help="only the host cost per call (prints JSON; writes nothing)")
    args = ap.parse_args(argv)
    if args.host_only:
        print(json.dumps(host_overhead(), indent=1))
        return 0
    result = {"date": _dt.date.today().isoformat(), "versions": versions(),
              "host_us": host_overhead()}
    if not args.no_first_call:
        result["first_call_s"] = first_call()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "norm_host.json").write_text(json.dumps(result, indent=1))
    md = _markdown(result)
    (out / "norm_host.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
