"""Norm ops side by side on the GPU: TileOPs, torch eager, torch.compile, Liger-Kernel.

    python benchmarks/norm.py [--ops rms,fused,layer] [--set bar|full] [--out DIR]

Timing: every contender runs the same inputs; each measurement is the median of several
trials. Device time per call: rows * N * itemsize small enough to sit in L2 (or any launch-bound
size) are measured by CUDA-graph replay of 20 calls (no launch gaps, fair to everyone); larger
ones with CUDA events around 20 back-to-back calls after warm-up. A fresh ``torch.compile``
function is compiled per shape (``dynamic=False``), since a dynamic-shape recompile can run
much slower. GB/s counts the roofline bytes of the op (each input read once, each output
written once) from the op's own ``SignatureCall``; the fraction is against the measured
device-to-device copy bandwidth (bytes read + written).

Also reported: the op's host cost per cached eager call on 1 x 4096 against launching the
kernel directly, and the first call's wall time in a fresh process with the compile caches
cold and warm.

Results: a table on stdout, and JSON + Markdown under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in sorted((ROOT / "packages").glob("*/src")):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _common import events, graph_events, version  # noqa: E402
from tileops.ops import FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp  # noqa: E402

BAR = {  # (rows, N): the sizes the project's bars name, plus decode and odd rows
    "rms": [(32768, 8192), (16384, 4097), (1, 4096), (2048, 4096), (32768, 4096),
            (32768, 16384), (128, 8192), (3, 7), (2048, 16384), (64, 65536)],
    "fused": [(32768, 8192), (16384, 4097), (1, 4096), (2048, 4096), (128, 8192), (3, 7)],
    "layer": [(32768, 8192), (16384, 4097), (1, 4096), (2048, 4096), (128, 8192), (3, 7)],
}
FULL_ROWS = (1, 128, 2048, 32768)
FULL_NS = (4096, 8192, 16384)


def _liger():
    try:
        from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward
        from liger_kernel.ops.layer_norm import layer_norm_forward
        from liger_kernel.ops.rms_norm import rms_norm_forward
    except Exception:  # noqa: BLE001 - Liger is optional
        return None
    return {
        "rms": lambda x, w, eps: rms_norm_forward(x, w, eps, 0.0, "llama", None)[0],
        "fused": lambda x, r, w, eps: fused_add_rms_norm_forward(x, r, w, eps, 0.0, "llama")[:2],
        "layer": lambda x, w, b, eps: layer_norm_forward(x, w, b, eps)[0],
    }


def copy_bandwidth() -> float:
    n = 1 << 30  # 2 GiB of bf16
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ms = events(lambda: b.copy_(a), 10)
    return 2 * a.numel() * a.element_size() / (ms * 1e-3) / 1e9


def time_call(fn, nbytes: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    if nbytes <= 64 << 20:
        try:
            return graph_events(fn, 20)
        except Exception:  # noqa: BLE001 - a contender that cannot be captured
            torch.cuda.synchronize()
    return events(fn, 20)


def _case(kind: str, m: int, n: int, dtype):
    g = torch.Generator(device="cuda").manual_seed(m * 7919 + n)
    x = torch.randn(m, n, dtype=dtype, device="cuda", generator=g)
    w = torch.randn(n, dtype=dtype, device="cuda", generator=g)
    if kind == "rms":
        op = RMSNormFwdOp(normalized_shape=[n], eps=1e-6)
        ours = lambda: op(x, w)  # noqa: E731
        eager = lambda: F.rms_norm(x, [n], w, 1e-6)  # noqa: E731
        ref = lambda: F.rms_norm(x.double(), [n], w.double(), 1e-6)  # noqa: E731
        args = (x, w)
    elif kind == "fused":
        r = torch.randn(m, n, dtype=dtype, device="cuda", generator=g)
        op = FusedAddRMSNormFwdOp(eps=1e-6)

        def eager():
            s = x + r
            return F.rms_norm(s, [n], w, 1e-6), s

        ours = lambda: op(x, r, w)  # noqa: E731
        ref = lambda: F.rms_norm((x.double() + r.double()).to(dtype).double(), [n],  # noqa: E731
                                 w.double(), 1e-6)
        args = (x, r, w)
    else:
        b = torch.randn(n, dtype=dtype, device="cuda", generator=g)
        op = LayerNormFwdOp(normalized_shape=[n], eps=1e-5)
        ours = lambda: op(x, w, b)  # noqa: E731
        eager = lambda: F.layer_norm(x, [n], w, b, 1e-5)  # noqa: E731
        ref = lambda: F.layer_norm(x.double(), [n], w.double(), b.double(), 1e-5)  # noqa: E731
        args = (x, w, b)
    return op, ours, eager, ref, args


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def bench_one(kind: str, m: int, n: int, dtype, liger, copy_bw: float) -> dict:
    op, ours, eager, ref, args = _case(kind, m, n, dtype)
    out = _first(ours())
    torch.cuda.synchronize()
    r = ref()
    err = ((out.double() - r).norm() / r.norm()).item()
    nbytes = op.eval_roofline()[1]
    row = {"op": kind, "rows": m, "n": n, "dtype": str(dtype)[6:], "bytes": nbytes,
           "rel_err": err}
    torch._dynamo.reset()
    compiled = torch.compile(eager, dynamic=False)
    contenders = {"tileops": ours, "eager": eager, "compile": compiled}
    if liger is not None:
        lf = liger[kind]
        contenders["liger"] = lambda: lf(*args, 1e-6 if kind != "layer" else 1e-5)
    for name, fn in contenders.items():
        try:
            ms = time_call(fn, nbytes)
            row[f"{name}_us"] = ms * 1e3
            row[f"{name}_gbs"] = nbytes / (ms * 1e-3) / 1e9
        except Exception as exc:  # noqa: BLE001 - report, do not hide
            row[f"{name}_us"] = None
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    row["tileops_frac_copy"] = row["tileops_gbs"] / copy_bw if row.get("tileops_gbs") else None
    best = min((row[f"{c}_us"] for c in contenders if c != "tileops" and row.get(f"{c}_us")),
               default=None)
    row["speedup_vs_best_peer"] = best / row["tileops_us"] if best and row["tileops_us"] else None
    return row


def host_overhead() -> dict:
    """Host microseconds per cached eager call on 1 x 4096 bf16 (wall clock, synchronising
    every 200 calls): the op, the kernel entry called directly, F.rms_norm."""
    x = torch.randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    op = RMSNormFwdOp(normalized_shape=[4096], eps=1e-6)
    y = op(x, w)
    from tileops.kernels.norm import RowNormFwdInterface, RowNormKind, RowNormSpec

    entry = op.kernel(RowNormFwdInterface, RowNormSpec(
        device=x.device, kind=RowNormKind.RMS, rows=1, n=4096, dtype="bfloat16", eps=1e-6,
        has_weight=True, has_bias=False))

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
print(time.perf_counter() - t)
"""


def first_call() -> dict:
    """Seconds from import to the first result, in a fresh process: cold (empty TileLang
    cache) then warm (the cache the cold run filled)."""
    paths = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
    code = _FIRST_CALL.format(paths=paths)
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TILELANG_CACHE_DIR=cache)
        for label in ("cold", "warm"):
            res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, timeout=300)
            try:
                out[label] = float(res.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                out[label] = None
                out[f"{label}_error"] = res.stderr[-500:]
    return out


def _versions() -> dict:
    v = version
    return {"python": platform.python_version(), "torch": torch.__version__,
            "tilelang": v("tilelang"), "liger_kernel": v("liger-kernel"), "triton": v("triton"),
            "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", default="rms,fused,layer")
    ap.add_argument("--set", choices=("bar", "full"), default="bar")
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--no-first-call", action="store_true")
    ap.add_argument("--host-only", action="store_true",
                    help="only the host cost per call (prints JSON; writes nothing)")
    args = ap.parse_args(argv)
    if args.host_only:
        print(json.dumps(host_overhead(), indent=1))
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    liger = _liger()
    copy_bw = copy_bandwidth()
    rows = []
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    for kind in args.ops.split(","):
        shapes = BAR[kind] if args.set == "bar" else [(m, n) for n in FULL_NS for m in FULL_ROWS]
        for m, n in shapes:
            for dt in dtypes:
                row = bench_one(kind, m, n, dt, liger, copy_bw)
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"date": _dt.date.today().isoformat(), "versions": _versions(),
              "copy_bandwidth_gbs": copy_bw, "rows": rows, "host_us": host_overhead()}
    if not args.no_first_call:
        result["first_call_s"] = first_call()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "norm.json").write_text(json.dumps(result, indent=1))
    md = _markdown(result)
    (out / "norm.md").write_text(md)
    print(md)
    return 0


def _markdown(result: dict) -> str:
    v = result["versions"]
    lines = [f"# Norm ops on {v['gpu']} ({result['date']})", "",
             f"torch {v['torch']}, TileLang {v['tilelang']}, Liger {v['liger_kernel']}, "
             f"CUDA {v['cuda']}, Python {v['python']}. Copy bandwidth (read + write): "
             f"{result['copy_bandwidth_gbs']:.0f} GB/s.", "",
             "| op | rows x N | dtype | TileOPs GB/s | eager | compile | Liger | frac copy | "
             "vs best peer | rel err |", "|---|---|---|---|---|---|---|---|---|---|"]

    def g(row, k):
        x = row.get(f"{k}_gbs")
        return f"{x:.0f}" if x else "-"

    for r in result["rows"]:
        frac = r.get("tileops_frac_copy")
        sp = r.get("speedup_vs_best_peer")
        lines.append(f"| {r['op']} | {r['rows']} x {r['n']} | {r['dtype']} | {g(r, 'tileops')} | "
                     f"{g(r, 'eager')} | {g(r, 'compile')} | {g(r, 'liger')} | "
                     f"{frac:.2f} | {sp:.2f}x | {r['rel_err']:.1e} |" if frac and sp else
                     f"| {r['op']} | {r['rows']} x {r['n']} | {r['dtype']} | {g(r, 'tileops')} | "
                     f"{g(r, 'eager')} | {g(r, 'compile')} | {g(r, 'liger')} | - | - | "
                     f"{r['rel_err']:.1e} |")
    h = result["host_us"]
    lines += ["", "Host, 1 x 4096 bf16, microseconds per cached eager call: "
              + ", ".join(f"{k} {val:.1f}" if "over" not in k else f"{k} {val:.2f}x"
                          for k, val in h.items())]
    if "first_call_s" in result:
        fc = result["first_call_s"]
        lines.append(f"First call in a fresh process (import to result): cold {fc.get('cold')} s, "
                     f"warm {fc.get('warm')} s")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
