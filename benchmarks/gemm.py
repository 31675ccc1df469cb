"""GemmFwdOp against torch.matmul (cuBLAS) and torch.compile on the GPU, one run.

    python benchmarks/gemm.py [--out DIR] [--dtypes bfloat16] [--tune] [--compile MODE]
    python benchmarks/gemm.py --prebuild [--workers N]

Workloads: the spec's (specs/gemm.yaml): 8192^3, 4096^3, LLM projections (M in 1, 16, 128,
2048, 8192 with (N, K) in (4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)), the
nn.Linear layout and transposed inputs. Both contenders get the same inputs (cuBLAS
computes ``op(a) @ op(b)`` through transposed views, which it reads without a copy), rotated
over up to 8 sets spanning 256 MB so that the operands are not served from L2. Timing, median
of 5 trials of 20 (large) or 100 (small) calls with CUDA events: ``graph`` replays a CUDA
graph of the calls (the device time: what the kernels cost, without the launch gaps);
``eager`` issues them back to back from Python (what an eager model sees: for small shapes the
host's per-call cost, not the kernel, sets this figure). TFLOP/s counts ``2 * M * N * K``
over the graph time; the ratio is cuBLAS time over ours (above 1: ours is faster), the graph
ratio first; the summary is the geometric mean of the ratios.

``--compile MODE`` adds torch.compile of ``a @ b`` as a third contender, a fresh compiled
function per workload (``dynamic=False``; a recompiled dynamic-shape kernel would not be what a
model with fixed shapes gets). ``default`` lowers a plain matmul to the same cuBLAS call (plus
Inductor's wrapper); ``max-autotune-no-cudagraphs`` also benchmarks Inductor's Triton GEMM
templates and keeps the fastest (5-15 s of compiling and autotuning per shape on the H200
host). Its compile time is
reported; its ratio is its time over ours, as for cuBLAS. ``none`` (the default) leaves it out.

``--prebuild`` compiles, in parallel processes, every kernel the GPU tests
(tests/ops/test_gemm_cuda.py) and this benchmark select, so the runs that follow load them
from TileLang's disk cache.

Results: a table on stdout, and JSON + Markdown (gemm.json, gemm.md) under --out.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
for _p in reversed(PATHS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _common import events, graph_events, version  # noqa: E402

SPEC = ROOT / "packages" / "ops" / "src" / "tileops" / "ops" / "specs" / "gemm.yaml"


def workloads(dtypes: set[str] | None = None) -> list[dict]:
    """Rows of (label, M, N, K, trans_a, trans_b, dtype) from the spec's workloads."""
    import yaml

    entry = yaml.safe_load(SPEC.read_text())["GemmFwdOp"]
    out = []
    for w in entry["workloads"]:
        for case in w.get("dtype_cases", [{"T": "bfloat16"}]):
            if dtypes and case["T"] not in dtypes:
                continue
            out.append({"label": w["label"], "m": w["M"], "n": w["N"], "k": w["K"],
                        "trans_a": bool(w.get("trans_a", False)),
                        "trans_b": bool(w.get("trans_b", False)), "dtype": case["T"]})
    return out


# --- prebuild ------------------------------------------------------------------------------------

TRANS = [(False, False), (False, True), (True, False), (True, True)]


def _test_cases() -> list[tuple]:
    """(m, n, k, ta, tb, dtype) of tests/ops/test_gemm_cuda.py (kept in step by hand)."""
    sizes = [(1, 4096, 4096), (48, 256, 512), (128, 4096, 4096), (1000, 1000, 1000),
             (2048, 4096, 4096), (333, 4097, 4095), (7, 13, 1), (1, 1, 1)]
    out = [(m, n, k, ta, tb, "bfloat16") for m, n, k in sizes for ta, tb in TRANS]
    for m, n, k in [(1, 4096, 4096), (2048, 4096, 4096), (333, 4097, 4095)]:
        out += [(m, n, k, False, False, "float16"), (m, n, k, False, True, "float16")]
    out += [(64, 256, 256, False, False, "bfloat16")]  # the offset view (unaligned)
    out += [(256, 512, 384, True, True, "bfloat16")]
    return out


def _spec_for(m, n, k, ta, tb, dtype, aligned=None):
    from tileops.kernels.gemm import GemmPlan, m_bucket

    if aligned is None:  # fresh contiguous tensors: only the row strides can break it
        rows = [m if ta else k, k if tb else n, n]
        aligned = all(r % 8 == 0 for r in rows)
    return GemmPlan("cuda", m_bucket(m), n, k, dtype, ta, tb, aligned)


def serving(spec):
    """The implementation that serves ``spec`` on a device of the current kind (the op's own
    selection over its kernel types)."""
    from tileops.kernels.gemm import GemmFwdInterface
    from tileops.ops import GemmFwdOp
    from tileops.runtime.kernel import select

    return select(GemmFwdInterface, GemmFwdOp.kernel_types[GemmFwdInterface], spec)


def program_job(impl, spec, cfg) -> tuple:
    """``(kind, n, k, dtype, trans_a, trans_b, config)``: the program ``impl`` compiles for
    ``spec`` with ``cfg`` (kind "gemv" for the one-row kernel; the padded kernel's sizes)."""
    from tileops.kernels.gemm import GemmGemvKernel, GemmPaddedKernel

    if impl is GemmPaddedKernel:
        spec = GemmPaddedKernel.padded_spec(spec)
    kind = "gemv" if impl is GemmGemvKernel else "gemm"
    return (kind, spec.n, spec.k, spec.dtype, spec.trans_a, spec.trans_b, cfg)


def _program_job(spec) -> tuple:
    """The job of the program that serves ``spec`` with the configuration it picks."""
    impl = serving(spec)
    return program_job(impl, spec, impl.config_for(spec))


def prebuild_jobs() -> list[tuple]:
    from tileops.kernels.gemm import GemmHopperKernel

    jobs = set()
    for m, n, k, ta, tb, dt in _test_cases():
        if m == 64 and n == 256:
            spec = _spec_for(m, n, k, ta, tb, dt, aligned=False)
        else:
            spec = _spec_for(m, n, k, ta, tb, dt)
        if k:
            jobs.add(_program_job(spec))
    for cfg in GemmHopperKernel.tune_candidates:  # test_tune_times_and_caches's candidates
        jobs.add(("gemm", 4096, 4096, "bfloat16", False, False, cfg))
    for param in _test_params("_split_cases") + _test_params("_tile_order_cases"):
        cfg, m, n, k, ta, tb = param.values
        jobs.add(("gemm", n, k, "bfloat16", ta, tb, cfg))
    for param in _test_params("_gemv_cases"):
        cfg, m, n, k, ta, dtype = param.values
        dt = str(dtype).split(".")[1]
        spec = _spec_for(m, n, k, ta, True, dt)
        jobs.add(_program_job(spec) if cfg is None else ("gemv", n, k, dt, ta, True, cfg))
    for w in workloads():
        spec = _spec_for(w["m"], w["n"], w["k"], w["trans_a"], w["trans_b"], w["dtype"])
        jobs.add(_program_job(spec))
    return sorted(jobs, key=repr)


def _test_params(generator: str) -> list:
    """The parameters of tests/ops/test_gemm_cuda.py's ``generator`` (imported: pytest is
    on the GPU host)."""
    sys.path.insert(0, str(ROOT / "tests" / "ops"))
    try:
        import test_gemm_cuda
    except ImportError:  # no pytest or torch here: nothing to prebuild for them
        return []
    finally:
        sys.path.pop(0)
    return list(getattr(test_gemm_cuda, generator)())


def _device_arch() -> tuple[int, int] | None:
    import torch

    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def _build(job: tuple, arch: tuple[int, int] | None = None) -> tuple[tuple, float, str]:
    """Compile one job as the kernels will on a device of compute capability ``arch``."""
    sys.path[:0] = PATHS
    import torch

    from tileops.kernels.gemm import (
        build_gemm_kernel,
        build_gemv_kernel,
        build_reduce_kernel,
        program_sms,
        uses_pdl,
    )

    kind, n, k, dtype, ta, tb, cfg = job
    t = time.perf_counter()
    try:
        if kind == "gemv":
            build_gemv_kernel(n, k, dtype, ta, cfg, None, arch is not None and arch >= (9, 0))
        else:
            pdl = uses_pdl(cfg, arch)
            device = torch.device("cuda") if arch is not None else None
            build_gemm_kernel(n, k, dtype, ta, tb, cfg, None, pdl, program_sms(cfg, device))
            if cfg.split > 1:
                build_reduce_kernel(n, dtype, cfg.split, None, pdl)
        return job, time.perf_counter() - t, "ok"
    except Exception as exc:  # noqa: BLE001 - reported by the caller
        return job, time.perf_counter() - t, f"{type(exc).__name__}: {str(exc)[-400:]}"


def prebuild(workers: int) -> int:
    jobs = prebuild_jobs()
    arch = _device_arch()
    t = time.perf_counter()
    failed = 0
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        for job, secs, status in pool.map(_build, jobs, [arch] * len(jobs)):
            failed += status != "ok"
            print(f"{job[:6]} {tuple(job[6])[:5]} {secs:.1f}s {status}", flush=True)
    print(f"prebuilt {len(jobs)} kernels in {time.perf_counter() - t:.0f}s, {failed} failed")
    return 1 if failed else 0


# --- timing --------------------------------------------------------------------------------------


#: input sets are rotated until they span this many bytes, so that repeated calls do not
#: find the operands in the 50 MB L2 (what a model's next layer would not)
ROTATE_BYTES = 256 << 20


def operand_sets(w: dict, seed: int = 0) -> list[tuple]:
    """``(a, b, op(a), op(b))`` sets of fresh random operands for workload ``w``, as many as
    span :data:`ROTATE_BYTES` (at most 8); ``op(x)`` is the transposed view where stored so."""
    import torch

    m, n, k, ta, tb = w["m"], w["n"], w["k"], w["trans_a"], w["trans_b"]
    dtype = getattr(torch, w["dtype"])
    g = torch.Generator(device="cuda").manual_seed(m * 7919 + n * 31 + k + seed)
    nbytes = (m * k + k * n) * torch.finfo(dtype).bits // 8
    sets = []
    for _ in range(max(1, min(8, -(-ROTATE_BYTES // nbytes)))):
        a = torch.randn((k, m) if ta else (m, k), dtype=dtype, device="cuda", generator=g)
        b = torch.randn((n, k) if tb else (k, n), dtype=dtype, device="cuda", generator=g)
        sets.append((a, b, a.T if ta else a, b.T if tb else b))
    return sets


def rotating(sets: list[tuple], fn):
    """A callable running ``fn(*set)`` on the next operand set each call."""
    turn = [0]

    def call():
        s = sets[turn[0] % len(sets)]
        turn[0] += 1
        return fn(*s)

    return call


def bench_one(w: dict, tune: bool, compile_mode: str = "none") -> dict:
    import torch

    from tileops.ops import GemmFwdOp

    m, n, k = w["m"], w["n"], w["k"]
    sets = operand_sets(w)
    op = GemmFwdOp(trans_a=w["trans_a"], trans_b=w["trans_b"], tune=tune)
    ours = rotating(sets, lambda a, b, av, bv: op(a, b))
    cublas = rotating(sets, lambda a, b, av, bv: torch.matmul(av, bv))
    c = op(*sets[0][:2])
    _, _, av, bv = sets[0]
    ref = torch.matmul(av.double(), bv.double())
    err = ((c.double() - ref).norm() / ref.norm()).item()
    entries = [e for es in op.built_entries.values() for e in es.values()]
    entry = entries[0] if entries else None
    row = dict(w, rel_err=err, sets=len(sets), kernel=type(entry).__name__ if entry else None,
               config=list(entry.config) if entry else None)
    contenders = [("tileops", ours), ("cublas", cublas)]
    if compile_mode != "none":
        torch._dynamo.reset()  # a fresh function per shape: no recompiled dynamic kernel
        mm = torch.compile(lambda x, y: x @ y, mode=None if compile_mode == "default"
                           else compile_mode, dynamic=False, fullgraph=True)
        t0 = time.perf_counter()
        cc = mm(av, bv)
        torch.cuda.synchronize()
        row["compile_s"] = time.perf_counter() - t0
        row["compile_rel_err"] = ((cc.double() - ref).norm() / ref.norm()).item()
        contenders.append(("compile", rotating(sets, lambda a, b, av, bv: mm(av, bv))))
    flops = 2 * m * n * k
    iters = 20 if flops > 1e11 else 100
    for name, fn in contenders:
        for _ in range(3):
            fn()
        eager = events(fn, iters)
        graph = graph_events(fn, iters)
        row[f"{name}_us"] = graph * 1e3
        row[f"{name}_eager_us"] = eager * 1e3
        row[f"{name}_tflops"] = flops / (graph * 1e-3) / 1e12
    row["ratio"] = row["cublas_us"] / row["tileops_us"]
    row["eager_ratio"] = row["cublas_eager_us"] / row["tileops_eager_us"]
    if "compile_us" in row:
        row["compile_ratio"] = row["compile_us"] / row["tileops_us"]
        row["compile_eager_ratio"] = row["compile_eager_us"] / row["tileops_eager_us"]
    return row


def _versions() -> dict:
    import torch

    v = version

    return {"python": platform.python_version(), "torch": torch.__version__,
            "tilelang": v("tilelang"), "cuda": torch.version.cuda,
            "cublas": torch.backends.cuda.preferred_blas_library().name
            if hasattr(torch.backends.cuda, "preferred_blas_library") else None,
            "gpu": torch.cuda.get_device_name()}


def _markdown(result: dict) -> str:
    from tileops.kernels.gemm import GemmConfig

    v = result["versions"]
    s = result["summary"]
    comp = any("compile_ratio" in r for r in result["rows"])
    mode = result.get("compile_mode", "none")
    lines = [f"# GEMM on {v['gpu']} ({result['date']})", "",
             f"torch {v['torch']}, TileLang {v['tilelang']}, CUDA {v['cuda']}, Python "
             f"{v['python']}. Ratio = cuBLAS time / TileOPs time (above 1: TileOPs faster), "
             "from CUDA-graph replays (device time); eager: back-to-back calls from Python. "
             f"Tuned: {result['tuned']}."
             + (f" torch.compile (mode {mode}): its time over TileOPs', a fresh compiled "
                "function per workload." if comp else ""), "",
             f"Geometric mean ratio {s['geomean_ratio']:.3f} (graph) / "
             f"{s['geomean_eager_ratio']:.3f} "
             f"(eager); lowest {s['min_ratio']:.3f} ({s['min_label']}); square-8k "
             f"{s.get('square_8k_ratio')}; below 0.9: {', '.join(s['below_0_9']) or 'none'}."
             + (f" Against torch.compile: geometric mean {s['geomean_compile_ratio']:.3f} "
                f"(graph) / {s['geomean_compile_eager_ratio']:.3f} (eager), lowest "
                f"{s['min_compile_ratio']:.3f}." if comp else ""),
             ""]
    head = ["workload", "M x N x K", "trans", "dtype", "kernel", "tile (p: persistent)",
            "TileOPs TFLOP/s",
            "cuBLAS TFLOP/s", "ratio"]
    if comp:
        head += ["compile TFLOP/s", "compile ratio"]
    head += ["TileOPs eager us", "cuBLAS eager us", "eager ratio"]
    if comp:
        head += ["compile eager us", "compile eager ratio"]
    head += ["rel err"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        tile = GemmConfig(*r["config"]).label() if r.get("config") else "-"
        trans = ("T" if r["trans_a"] else "N") + ("T" if r["trans_b"] else "N")
        cells = [r["label"], f"{r['m']} x {r['n']} x {r['k']}", trans, r["dtype"], r["kernel"],
                 tile, f"{r['tileops_tflops']:.1f}", f"{r['cublas_tflops']:.1f}",
                 f"{r['ratio']:.3f}"]
        if comp:
            cells += [f"{r['compile_tflops']:.1f}", f"{r['compile_ratio']:.3f}"]
        cells += [f"{r['tileops_eager_us']:.1f}", f"{r['cublas_eager_us']:.1f}",
                  f"{r['eager_ratio']:.3f}"]
        if comp:
            cells += [f"{r['compile_eager_us']:.1f}", f"{r['compile_eager_ratio']:.3f}"]
        cells += [f"{r['rel_err']:.1e}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _geomean(values) -> float:
    logs = [math.log(v) for v in values]
    return math.exp(sum(logs) / len(logs))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--dtypes", default=None, help="comma list (default: all in the spec)")
    ap.add_argument("--labels", default=None, help="comma list of workload labels")
    ap.add_argument("--tune", action="store_true", help="construct the ops with tune=True")
    ap.add_argument("--compile", default="none",
                    choices=["none", "default", "max-autotune-no-cudagraphs", "max-autotune"],
                    help="add torch.compile of a @ b in this mode as a contender")
    ap.add_argument("--prebuild", action="store_true")
    ap.add_argument("--workers", type=int, default=14)
    args = ap.parse_args(argv)
    if args.prebuild:
        return prebuild(args.workers)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    wanted = set(args.labels.split(",")) if args.labels else None
    for w in workloads(set(args.dtypes.split(",")) if args.dtypes else None):
        if wanted and w["label"] not in wanted:
            continue
        try:
            row = bench_one(w, args.tune, args.compile)
        except Exception as exc:  # noqa: BLE001 - report, do not hide
            row = dict(w, error=f"{type(exc).__name__}: {str(exc)[-300:]}")
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    ok = [r for r in rows if "ratio" in r]
    summary = {}
    if ok:
        worst = min(ok, key=lambda r: r["ratio"])
        summary = {"geomean_ratio": _geomean(r["ratio"] for r in ok),
                   "geomean_eager_ratio": _geomean(r["eager_ratio"] for r in ok),
                   "min_ratio": worst["ratio"], "min_label": f"{worst['label']}/{worst['dtype']}",
                   "below_0_9": [f"{r['label']}/{r['dtype']}" for r in ok if r["ratio"] < 0.9],
                   "failed": [f"{r['label']}/{r['dtype']}" for r in rows if "ratio" not in r]}
        comp = [r for r in ok if "compile_ratio" in r]
        if comp:
            summary.update({
                "geomean_compile_ratio": _geomean(r["compile_ratio"] for r in comp),
                "geomean_compile_eager_ratio": _geomean(r["compile_eager_ratio"] for r in comp),
                "min_compile_ratio": min(r["compile_ratio"] for r in comp)})
        sq = [r["ratio"] for r in ok if r["label"] == "square-8k"]
        summary["square_8k_ratio"] = round(min(sq), 3) if sq else None
    result = {"date": _dt.date.today().isoformat(), "versions": _versions(),
              "tuned": args.tune, "compile_mode": args.compile, "summary": summary, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm.json").write_text(json.dumps(result, indent=1))
    if ok:
        md = _markdown(dict(result, rows=ok))
        (out / "gemm.md").write_text(md)
        print(md)
    print(json.dumps(summary))
    return 0 if ok and not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
