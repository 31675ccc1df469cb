"""Time every tile configuration of a GEMM implementation side by side, per workload, to set
the heuristic in ``tileops.kernels.gemm.choose_config``.

    python benchmarks/sweep_gemm.py [--labels qo-m1,odd-1000] [--out DIR]
    python benchmarks/sweep_gemm.py --grid 1000,2999,8191 [--name gemm_grid]
    python benchmarks/sweep_gemm.py --shapes 5001x1000x1000,2999x1000x1000

``--grid`` sweeps every (M, N, K) of the given sizes instead of spec workloads (row-major
bf16 operands, labelled ``grid-MxNxK``): the unaligned grid the GEMM is held to against
cuBLAS; ``--shapes`` sweeps the given ``MxNxK`` the same way. The configuration the heuristic
picks is marked ``(default)``.

For each workload the candidates are the tuning candidates of the implementation that serves
it (the op's own selection: the one-row kernel, the small-M kernel for M <= 64, the Hopper
kernel above, the padded one for unaligned rows). Kernels are compiled first in
parallel processes (filling TileLang's disk cache); then every configuration runs on the
same inputs, checked against an fp64 reference (relative L2 error), and is timed from CUDA
graph replays with the inputs rotated past L2, with cuBLAS (``torch.matmul``) timed the same
way. Results: a table per workload on stdout, and gemm_sweep.{txt,json} under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
for _p in reversed(PATHS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _common import graph_events  # noqa: E402
from gemm import (  # noqa: E402
    _build,
    _device_arch,
    _spec_for,
    operand_sets,
    program_job,
    rotating,
    serving,
    workloads,
)

#: the workloads swept by default: those whose output tiles do not fill the SMs many times
DEFAULT_LABELS = ("qo-m1", "qo-m16", "qo-m128", "up-m1", "up-m16", "up-m128", "down-m1",
                  "down-m16", "down-m128", "lmhead-m1", "lmhead-m16", "linear-weight-nt-m1",
                  "odd-1000", "unaligned-4097")


def _spec(w: dict):
    return _spec_for(w["m"], w["n"], w["k"], w["trans_a"], w["trans_b"], w["dtype"])


def _impl(w: dict):
    return serving(_spec(w))


def _candidates(w: dict, default_only: bool = False) -> tuple:
    """The configurations swept for ``w``: its implementation's tuning candidates, or only the
    one its heuristic picks."""
    return (impl_default(w),) if default_only else _impl(w).tune_candidates


def _jobs(rows: list[dict], default_only: bool = False) -> list[tuple]:
    """benchmarks/gemm.py's compile jobs: every candidate of each row's implementation, for
    the program it runs (the padded sizes for the padded kernel)."""
    jobs = set()
    for w in rows:
        impl, p = _impl(w), _spec(w)
        for cfg in _candidates(w, default_only):
            jobs.add(program_job(impl, p, cfg))
    return sorted(jobs, key=repr)


def impl_default(w: dict):
    """The configuration the serving implementation's heuristic picks for ``w``."""
    return _impl(w).config_for(_spec(w))


def grid_rows(sizes: list[int]) -> list[dict]:
    """Row-major bf16 workloads over every (M, N, K) drawn from ``sizes``."""
    return shape_rows([(m, n, k) for m in sizes for n in sizes for k in sizes])


def shape_rows(shapes: list[tuple[int, int, int]]) -> list[dict]:
    """Row-major bf16 workloads of the given (M, N, K)."""
    return [{"label": f"grid-{m}x{n}x{k}", "m": m, "n": n, "k": k, "trans_a": False,
             "trans_b": False, "dtype": "bfloat16"} for m, n, k in shapes]


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``"5001x1000x1000,64x8x8"`` as (M, N, K) triples; each a positive integer."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"--shapes: {item!r} is not MxNxK of positive "
                                             f"integers")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def sweep_one(w: dict, default_only: bool = False) -> list[dict]:
    import torch

    m, n, k = w["m"], w["n"], w["k"]
    sets = operand_sets(w, seed=1)
    _, _, av, bv = sets[0]
    ref = torch.matmul(av.double(), bv.double())
    c = torch.empty(m, n, dtype=av.dtype, device="cuda")
    flops = 2 * m * n * k

    out = []
    default = impl_default(w)
    cublas_ms = graph_events(rotating(sets, lambda a, b, av, bv: torch.matmul(av, bv)), 50)
    out.append({"config": "cublas", "us": cublas_ms * 1e3,
                "tflops": flops / (cublas_ms * 1e-3) / 1e12, "rel_err": None})
    impl = _impl(w)
    # on the device the op would see (its compute capability decides programmatic launch)
    spec = msgspec.structs.replace(_spec(w),
                                   device=torch.device("cuda", torch.cuda.current_device()))
    for cfg in _candidates(w, default_only):
        row = {"config": cfg.label() + (" (default)" if cfg == default else ""),
               "cfg": list(cfg), "kernel": impl.__name__, "default": cfg == default}
        try:
            kern = impl(spec)
            kern.config, kern.program = cfg, kern._build(cfg)
            c.fill_(float("nan"))
            kern(sets[0][0], sets[0][1], c)
            row["rel_err"] = ((c.double() - ref).norm() / ref.norm()).item()
            ms = graph_events(rotating(sets, lambda a, b, av, bv, kern=kern: kern(a, b, c)), 50)
            row.update(us=ms * 1e3, tflops=flops / (ms * 1e-3) / 1e12, ratio=cublas_ms / ms)
        except Exception as exc:  # noqa: BLE001 - one failing candidate is reported
            row["error"] = f"{type(exc).__name__}: {str(exc)[-200:]}"
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", default=",".join(DEFAULT_LABELS))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--grid", help="comma-separated sizes: sweep every (M, N, K) of them")
    ap.add_argument("--shapes", type=parse_shapes,
                    help="comma-separated MxNxK: sweep these shapes (row-major bf16)")
    ap.add_argument("--name", default="gemm_sweep", help="the results' file name")
    ap.add_argument("--default-only", action="store_true",
                    help="time only the configuration the heuristic picks (against cuBLAS)")
    args = ap.parse_args(argv)
    if args.shapes:
        rows = shape_rows(args.shapes)
    elif args.grid:
        rows = grid_rows([int(v) for v in args.grid.split(",")])
    else:
        wanted = args.labels.split(",")
        rows = [w for w in workloads({"bfloat16"}) if w["label"] in wanted]
    jobs = _jobs(rows, args.default_only)
    t = time.perf_counter()
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        failed = [(j, s) for j, _, s in pool.map(_build, jobs, [_device_arch()] * len(jobs))
                  if s != "ok"]
    print(f"compiled {len(jobs)} kernels in {time.perf_counter() - t:.0f}s; failed: {failed}")

    import torch

    lines, results, summary = [], {}, []
    for w in rows:
        res = sweep_one(w, args.default_only)
        results[w["label"]] = res
        best = min((r for r in res[1:] if "us" in r), key=lambda r: r["us"], default=None)
        lines.append(f"{w['label']}  {w['m']}x{w['n']}x{w['k']}  "
                     f"{'NT'[w['trans_a']]}{'NT'[w['trans_b']]}  best: "
                     f"{best['config'] if best else '-'}")
        for r in res:
            if "us" in r:
                err = "" if r["rel_err"] is None else f"  err {r['rel_err']:.1e}"
                ratio = f"  x{r['ratio']:.3f}" if "ratio" in r else ""
                lines.append(f"  {r['config']:<18} {r['us']:9.1f} us {r['tflops']:7.1f} TF"
                             f"{ratio}{err}")
            else:
                lines.append(f"  {r['config']:<18} {r['error']}")
        print("\n".join(lines[-len(res) - 1:]), flush=True)
        chosen = next((r for r in res if r.get("default") and "us" in r), None)
        summary.append(f"{w['m']:>6} {w['n']:>6} {w['k']:>6}  cuBLAS {res[0]['us']:8.1f} us  "
                       f"default x{chosen['ratio'] if chosen else float('nan'):.3f}  best "
                       f"x{best['ratio'] if best else float('nan'):.3f} "
                       f"{best['config'] if best else '-'}")
    header = (f"GEMM tile sweep on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d')}; graph-replay times, inputs rotated past L2; "
              f"x = cuBLAS time / this time\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = ["     M      N      K  (x = cuBLAS time / ours)", *summary]
    print("\n".join(table))
    (out / f"{args.name}.txt").write_text(header + "\n".join(lines + [""] + table) + "\n")
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
