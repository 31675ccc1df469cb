"""Time every tile configuration of a GEMM implementation side by side, per workload, to set
the heuristic in ``tileops.kernels.gemm.choose_config``.

    python benchmarks/sweep_gemm.py [--labels qo-m1,odd-1000] [--out DIR]
    python benchmarks/sweep_gemm.py --grid 1000,2999,8191 [--name gemm_grid]
    python benchmarks/sweep_gemm.py --shapes 5001x1000x1000,2999x1000x1000
    python benchmarks/sweep_gemm.py --shapes llama-step --name gemm_llama_step
    python benchmarks/sweep_gemm.py --shapes 5001x1000x1000 --configs 128x256x64/st3sk

``--grid`` sweeps every (M, N, K) of the given sizes instead of spec workloads (row-major
bf16 operands, labelled ``grid-MxNxK``): the unaligned grid the GEMM is held to against
cuBLAS; ``--shapes`` sweeps the given ``MxNxK`` the same way, each with an optional layout
(``:tn``: ``a`` stored transposed; ``llama-step``: the products of benchmarks/llama.py's
training step). The configuration the heuristic
picks is marked ``(default)``. ``--configs`` names the configurations to time (their labels,
as the tables print them: ``128x256x64/st3sk`` is the stream-K grid, ``128x256x64/st3p`` the
persistent one), the heuristic's pick always among them; every candidate without it.

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


def _candidates(w: dict, default_only: bool = False, labels: set | None = None) -> tuple:
    """The configurations swept for ``w``: its implementation's tuning candidates (those
    whose label is in ``labels`` where given, and the heuristic's pick), or only the one its
    heuristic picks."""
    if default_only:
        return (impl_default(w),)
    cands = _impl(w).tune_candidates
    if labels is None:
        return cands
    default = impl_default(w)
    return tuple(c for c in cands if c.label() in labels or c == default)


def _jobs(rows: list[dict], default_only: bool = False,
          labels: set | None = None) -> list[tuple]:
    """benchmarks/gemm.py's compile jobs: every candidate of each row's implementation, for
    the program it runs (the padded sizes for the padded kernel)."""
    jobs = set()
    for w in rows:
        impl, p = _impl(w), _spec(w)
        for cfg in _candidates(w, default_only, labels):
            jobs.add(program_job(impl, p, cfg))
    return sorted(jobs, key=repr)


def impl_default(w: dict):
    """The configuration the serving implementation's heuristic picks for ``w``."""
    return _impl(w).config_for(_spec(w))


def grid_rows(sizes: list[int]) -> list[dict]:
    """Row-major bf16 workloads over every (M, N, K) drawn from ``sizes``."""
    return shape_rows([(m, n, k) for m in sizes for n in sizes for k in sizes])


def shape_rows(shapes: list[tuple]) -> list[dict]:
    """bf16 workloads of the given ``(M, N, K)`` or ``(M, N, K, trans_a, trans_b)``."""
    rows = []
    for m, n, k, *layout in shapes:
        ta, tb = layout or (False, False)
        tag = "" if not (ta or tb) else "-" + "nt"[ta] + "nt"[tb]
        rows.append({"label": f"grid-{m}x{n}x{k}{tag}", "m": m, "n": n, "k": k,
                     "trans_a": ta, "trans_b": tb, "dtype": "bfloat16"})
    return rows


#: the products of a training step of the Llama-3-8B-shaped stack (benchmarks/llama.py: 8 x
#: 4096 tokens, hidden 4096, MLP 14336, vocabulary 128256): the MLP's projections forward
#: (``x @ W.T``), their input gradients (``dy @ W``) and weight gradients (``dy.T @ x``), and
#: the fused linear cross-entropy's per block of 1024 rows (logits, dhidden, dweight)
LLAMA_STEP = ("32768x14336x4096:nt,32768x4096x14336:nt,32768x4096x14336:nn,"
              "32768x14336x4096:nn,14336x4096x32768:tn,4096x14336x32768:tn,"
              "1024x128256x4096:nt,1024x4096x128256:nn,128256x4096x1024:tn")


def parse_shapes(text: str) -> list[tuple]:
    """``"5001x1000x1000,64x8x8:tn"`` as (M, N, K, trans_a, trans_b): positive integers and an
    optional layout, ``nn`` (the default), ``nt``, ``tn`` or ``tt`` (``t``: that operand
    stored transposed, ``a`` as ``[K, M]``, ``b`` as ``[N, K]``); ``llama-step`` stands for
    :data:`LLAMA_STEP`."""
    shapes = []
    for item in text.replace("llama-step", LLAMA_STEP).split(","):
        dims, _, layout = item.strip().lower().partition(":")
        parts = dims.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"--shapes: {item!r} is not MxNxK of positive "
                                             f"integers")
        if layout not in ("", "nn", "nt", "tn", "tt"):
            raise argparse.ArgumentTypeError(f"--shapes: {item!r}: the layout after ':' must "
                                             f"be nn, nt, tn or tt, got {layout!r}")
        layout = layout or "nn"
        shapes.append((*(int(p) for p in parts), layout[0] == "t", layout[1] == "t"))
    return shapes


def sweep_one(w: dict, default_only: bool = False, labels: set | None = None) -> list[dict]:
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
    for cfg in _candidates(w, default_only, labels):
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
    ap.add_argument("--labels", default=",".join(DEFAULT_LABELS),
                    help="comma-separated spec workload labels (without --shapes or --grid)")
    ap.add_argument("--configs", default=None,
                    help="comma-separated configuration labels to time (default: every "
                         "candidate), e.g. 128x256x64/st3sk")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--grid", help="comma-separated sizes: sweep every (M, N, K) of them")
    ap.add_argument("--shapes", type=parse_shapes,
                    help="comma-separated MxNxK[:nn|nt|tn|tt]: sweep these shapes (bf16; "
                         "'llama-step': the Llama training step's products)")
    ap.add_argument("--name", default="gemm_sweep", help="the results' file name")
    ap.add_argument("--default-only", action="store_true",
                    help="time only the configuration the heuristic picks (against cuBLAS)")
    args = ap.parse_args(argv)
    if args.shapes or args.grid:
        rows = (shape_rows(args.shapes) if args.shapes
                else grid_rows([int(v) for v in args.grid.split(",")]))
    else:
        wanted = args.labels.split(",")
        rows = [w for w in workloads({"bfloat16"}) if w["label"] in wanted]
    labels = None  # configuration labels: every candidate
    if args.configs:
        labels = set(args.configs.split(","))
        known = {c.label() for w in rows for c in _impl(w).tune_candidates}
        if labels - known:
            ap.error(f"--configs: no candidate configuration is labelled "
                     f"{sorted(labels - known)} (known: {sorted(known)})")
    jobs = _jobs(rows, args.default_only, labels)
    t = time.perf_counter()
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        failed = [(j, s) for j, _, s in pool.map(_build, jobs, [_device_arch()] * len(jobs))
                  if s != "ok"]
    print(f"compiled {len(jobs)} kernels in {time.perf_counter() - t:.0f}s; failed: {failed}")

    import torch

    lines, results, summary = [], {}, []
    for w in rows:
        res = sweep_one(w, args.default_only, labels)
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
