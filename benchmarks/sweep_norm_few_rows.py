"""RMSNorm with fewer rows than SMs: the kernels the op picks beside the cluster kernel at
every split it can take (2, 4 and 8 CTAs a row, also where the CTAs outnumber the SMs), the
split kernel's two programs at 4-128 CTAs a row and torch.compile, to choose where each
serves.

    python benchmarks/sweep_norm_few_rows.py [--out DIR] [--workers N] [--rows 8,16]
        [--ns 262144,1048576]

bf16 with a weight, eps 1e-6. The cluster programs are compiled first in parallel processes;
every candidate is checked against float32 ``F.rms_norm`` and timed from CUDA-graph replays
(device time). TB/s counts one read of ``x`` and one write of ``y``. Writes
``norm_few_rows.txt`` under ``--out``.
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
sys.path[:0] = PATHS

from _common import graph_events  # noqa: E402
from tileops.kernels.norm import SPLITS  # noqa: E402  (every split the split kernel takes)

ROWS = (8, 16, 33, 48, 64, 96, 128)
NS = (65536, 131072, 262144)
CLUSTERS = (2, 4, 8)


def _jobs(rows_list=ROWS, ns=NS) -> list[tuple]:
    from tileops.kernels import norm

    jobs = {}
    for rows in rows_list:
        for n in ns:
            for c in CLUSTERS:
                plan = norm.cluster_plan(rows, n, "bfloat16", c)
                if plan is not None:
                    jobs[(n, plan)] = None
            for sp in SPLITS:
                plan = norm.split_plan(rows, n, "bfloat16", sp)
                if plan is not None:
                    for part in ("partial", "scale"):
                        jobs[(n, plan, part)] = None
    return list(jobs)


def _build(job: tuple) -> str:
    sys.path[:0] = PATHS
    from tileops.kernels import norm

    n, plan, *part = job
    try:
        if part:
            norm.build_split_kernel(n, "bfloat16", 1e-6, True, part[0], None, plan)
        else:
            norm.build_cluster_kernel("rms", n, "bfloat16", 1e-6, True, False, None, plan)
        return "ok"
    except Exception as exc:  # noqa: BLE001 - reported, the rest go on
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def _row(rows: int, n: int) -> str:
    """One table row: every candidate at ``rows`` x ``n``."""
    import torch
    import torch.nn.functional as F

    from tileops.kernels import norm
    from tileops.ops import RMSNormFwdOp

    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = F.rms_norm(x.float(), (n,), w.float(), 1e-6)
    tb = 2 * x.numel() * x.element_size() / 1e12
    y = torch.empty_like(x)
    op = RMSNormFwdOp(normalized_shape=[n], eps=1e-6)
    cands = {"op": lambda: op(x, w)}
    for c in CLUSTERS:
        plan = norm.cluster_plan(rows, n, "bfloat16", c)
        if plan is not None:
            prog = norm.build_cluster_kernel("rms", n, "bfloat16", 1e-6, True, False, None,
                                             plan)
            cands[f"c{c}"] = lambda prog=prog: (prog(x, w, y), y)[1]
    for sp in SPLITS:
        plan = norm.split_plan(rows, n, "bfloat16", sp)
        if plan is not None:
            first, second = (norm.build_split_kernel(n, "bfloat16", 1e-6, True, part, None, plan)
                             for part in ("partial", "scale"))
            parts = torch.empty(rows, sp, device="cuda", dtype=torch.float32)
            cands[f"s{sp}"] = lambda a=first, b=second, p=parts: (a(x, p), b(x, p, w, y), y)[2]
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: F.rms_norm(t, (n,), w, 1e-6), dynamic=False)
    cands["compile"] = lambda: compiled(x)
    cells, rates = [], {}
    for name in ("op", "c2", "c4", "c8", *(f"s{sp}" for sp in SPLITS), "compile"):
        fn = cands.get(name)
        if fn is None:
            cells.append(f"{'-':>7}")
            continue
        ok = ((fn().float() - want).norm() / want.norm()).item() < 1e-2
        rates[name] = tb / (graph_events(fn, 20) * 1e-3)
        cells.append(f"{rates[name]:7.2f}{'' if ok else '!'}")
    return f"{rows:>5} {n:>7} " + " ".join(cells) + f"  {max(rates, key=rates.get)}"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--rows", type=_ints, default=ROWS, help="row counts, comma-separated")
    ap.add_argument("--ns", type=_ints, default=NS, help="row lengths, comma-separated")
    args = ap.parse_args(argv)
    jobs = _jobs(args.rows, args.ns)
    t = time.perf_counter()
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        failed = [(j, s) for j, s in zip(jobs, pool.map(_build, jobs), strict=True) if s != "ok"]
    print(f"compiled {len(jobs)} cluster and split programs in {time.perf_counter() - t:.0f}s; "
          f"failed: {failed}", flush=True)

    import torch

    lines = [f"RMSNorm bf16, fewer rows than SMs, on {torch.cuda.get_device_name()}, torch "
             f"{torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; TB/s of one read + one "
             "write (CUDA-graph replay); op: the kernels the op picks; cN: the cluster kernel "
             "split over N CTAs a row; sN: the split kernel's two programs over N CTAs a row; ! "
             "marks a wrong result",
             f"{'rows':>5} {'N':>7} " + " ".join(
                 f"{c:>7}" for c in ("op", "c2", "c4", "c8", *(f"s{sp}" for sp in SPLITS)))
             + f" {'compile':>7}  best"]
    print(lines[-1], flush=True)
    for n in args.ns:
        for rows in args.rows:
            lines.append(_row(rows, n))
            print(lines[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "norm_few_rows.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
