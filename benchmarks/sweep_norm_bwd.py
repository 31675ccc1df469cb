"""Time launch plans of the row-norm backward's register kernel side by side, to set
:func:`tileops.kernels.norm_bwd.bwd_register_plan` from measurement.

    python benchmarks/sweep_norm_bwd.py [--shapes layer-2048x8192,...] [--out DIR]
    python benchmarks/sweep_norm_bwd.py --dry-run [--shapes ...]   # list candidates (CPU)

Shapes: :data:`SHAPES`, bf16, with a weight (and for LAYER a bias), dweight (and dbias)
wanted. Candidates, per shape: every :class:`~tileops.kernels.norm_bwd.BwdRegisterPlan` with
``tpr`` threads a row in :data:`TPRS` dividing the row's 16-byte vectors, ``per = vectors /
tpr`` accesses a thread in :data:`PERS`, one row a CTA, the partials in registers or shared
memory, ``resident`` threads an SM in :data:`RESIDENTS`; plus the default plan (marked).
A candidate is left out (and listed, with why) when it cannot run as planned:

- its CTA has more threads than ``resident`` (the plan would be one CTA an SM, the program
  of ``resident = threads``), or more than 32 CTAs would share an SM;
- the planned CTAs' shared memory exceeds the SM's 228 KiB (227 KiB a CTA, 1 KiB reserved
  each);
- by the register heuristic :func:`registers`: the estimate exceeds :data:`SPILL_SLACK` times
  the registers a thread that ``resident`` leaves (``min(255, 65536 // resident)``), so the
  thread would spill a large share of its held row or partials to local memory.

The default plan is never left out. The count stays at or under :data:`MAX_CANDIDATES` a
shape; programs depend on (kind, n, plan) only, so shapes of one row length share them.

Run: every program (and the column sum) is compiled first in ``--workers`` processes,
filling TileLang's disk cache; then, in this process, each candidate runs as
``_RowNormBwdKernel.__call__`` runs its entry (the entry class takes no plan, so the
builders' programs are called directly): the main program with the workspace the entry
would allocate (``(G_max, rpc, sums * n)`` fp32, a call using its first
:func:`~tileops.kernels.norm_bwd.grid_ctas` rows), then the column sum. Each candidate's dx,
dweight and dbias are checked once against float64 torch autograd on the same bf16 inputs
(relative L2 within :data:`~tileops.ops.workloads.TOLERANCE`, else marked WRONG and nobody's
best), then timed by CUDA-graph replay (``max(20, sets)`` calls, median of 5 replays), each
call on the next of several input sets spanning at least 256 MB (cold L2: the H200's is
50 MB). GB/s counts the backward's floor traffic: reads dy and x (and dres), writes dx,
plus ``2 n`` elements for the weight read and dweight written; the workspace is not counted.

Output: per shape, a table sorted by time with the default's rank, candidates that failed to
compile or run, then one line a shape (best, its time, the default's, the speedup); written
to ``sweep_norm_bwd.txt`` under ``--out`` when run on CUDA.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
for _p in reversed(PATHS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from tileops.kernels.norm import _ITEMSIZE, FEW_ROWS, _vec  # noqa: E402
from tileops.kernels.norm_bwd import (  # noqa: E402
    BwdRegisterPlan,
    bwd_register_plan,
    ctas_per_sm,
    grid_ctas,
)

DTYPE = "bfloat16"
EPS = 1e-6


class Shape(NamedTuple):
    kind: str  # a RowNormKind value: "rms", "add_rms", "layer"
    rows: int
    n: int

    @property
    def label(self) -> str:
        return f"{self.kind}-{self.rows}x{self.n}"

    @property
    def sums(self) -> int:
        """Column sums wanted: dweight, and dbias for LAYER."""
        return 2 if self.kind == "layer" else 1


SHAPES = (
    Shape("layer", 128, 8192), Shape("layer", 2048, 8192), Shape("layer", 32768, 8192),
    Shape("layer", 2048, 16384), Shape("layer", 128, 16384), Shape("layer", 2048, 4096),
    Shape("add_rms", 32768, 8192), Shape("add_rms", 2048, 8192),
    Shape("rms", 128, 4096), Shape("rms", 128, 8192),
)
TPRS = (64, 128, 256, 512, 1024)
PERS = (1, 2, 4, 8)
RESIDENTS = (256, 512, 1024, 2048)
MAX_CANDIDATES = 40
#: a candidate whose register estimate exceeds this many times its cap is left out (1.5
#: keeps LAYER four accesses with register partials at 512 threads an SM, ~192 estimated
#: and 416 bytes spilled, in the sweep as the measured edge of spilling)
SPILL_SLACK = 1.5
#: registers a thread beyond the held row and partials (indices, sums, addresses)
BASE_REGISTERS = 32
_SM_THREADS, _SM_CTAS, _SM_REGISTERS = 2048, 32, 65536
_SMEM_SM, _SMEM_CTA, _SMEM_RESERVED = 228 << 10, 227 << 10, 1 << 10
_WARP = 32


class Candidate(NamedTuple):
    plan: BwdRegisterPlan
    default: bool


def label(plan: BwdRegisterPlan) -> str:
    """``tpr x per, where the partials live, resident threads``: ``256x4 smem r512``."""
    rpc = f" {plan.rpc}rows" if plan.rpc != 1 else ""
    return (f"{plan.tpr}x{plan.per}{rpc} {'smem' if plan.smem_partials else 'regs'} "
            f"r{plan.resident}")


def register_cap(resident: int) -> int:
    """Registers a thread when ``resident`` threads share an SM's 64 K (at most 255)."""
    return min(255, _SM_REGISTERS // resident)


def registers(kind: str, plan: BwdRegisterPlan, sums: int, dtype: str = DTYPE) -> int:
    """Estimated registers a thread of the register program wants (the heuristic that prunes).

    :data:`BASE_REGISTERS`, plus the held row in the storage dtype (``x`` and ``dy``; RMS's
    weight; the fused add's ``dres``: ``per * vec * itemsize / 4`` words each), plus for
    LAYER the fp32 ``x`` and ``g`` nvcc keeps live across the second reduction (a word per
    held element each), plus the fp32 partials where they are in registers (a word per held
    element and sum). It reproduces the ptxas counts the kernel's docstrings quote at the
    128-register cap: RMS 8192 on 256 x 4 112 (no spills), the fused add 128 (4 bytes
    spilled), LAYER two accesses with register partials 112 (106 and 118 measured), LAYER
    four accesses 128 with shared partials (no spills) and 192 with register partials
    (416 bytes spilled)."""
    held = plan.per * plan.vec
    words = held * _ITEMSIZE[dtype] // 4
    streams = 2 + (kind == "rms" or kind == "add_rms") + (kind == "add_rms")
    fp32_live = 2 * held if kind == "layer" else 0
    partials = 0 if plan.smem_partials else sums * held
    return BASE_REGISTERS + streams * words + fp32_live + partials


def shared_bytes(kind: str, plan: BwdRegisterPlan, sums: int) -> int:
    """Shared memory of one CTA: the cross-warp reduction buffers and any shared partials."""
    threads = plan.tpr * plan.rpc
    nred = 4 if kind == "layer" else 2
    wpr = plan.tpr // _WARP
    red = 2 * nred * plan.rpc * wpr * 4 if wpr > 1 else 4
    return red + (plan.per * plan.vec * threads * 4 * sums if plan.smem_partials else 0)


def refusal(kind: str, plan: BwdRegisterPlan, sums: int) -> str | None:
    """Why ``plan`` is left out of the sweep, or None (see the module docstring)."""
    threads = plan.tpr * plan.rpc
    if threads > plan.resident:
        return f"a {threads}-thread CTA exceeds {plan.resident} resident threads"
    ctas = ctas_per_sm(threads, plan.resident)
    if ctas > _SM_CTAS:
        return f"{ctas} CTAs an SM exceed {_SM_CTAS}"
    smem = shared_bytes(kind, plan, sums)
    if smem > _SMEM_CTA or ctas * (smem + _SMEM_RESERVED) > _SMEM_SM:
        return f"{ctas} CTAs of {smem >> 10} KiB shared memory exceed the SM's 228 KiB"
    est, cap = registers(kind, plan, sums), register_cap(plan.resident)
    if est > SPILL_SLACK * cap:
        return f"~{est} registers a thread, {plan.resident} resident threads leave {cap}"
    return None


def default_plan(shape: Shape) -> BwdRegisterPlan | None:
    return bwd_register_plan(shape.n, DTYPE, shape.rows < FEW_ROWS, shape.kind)


def candidates(shape: Shape) -> tuple[list[Candidate], list[tuple[BwdRegisterPlan, str]]]:
    """The plans swept for ``shape`` (the default marked, last) and those left out, with
    why."""
    vec = _vec(shape.n, DTYPE)
    nv = -(-shape.n // vec)
    default = default_plan(shape)
    kept: list[Candidate] = []
    left: list[tuple[BwdRegisterPlan, str]] = []
    for tpr in TPRS:
        if nv % tpr or nv // tpr not in PERS:
            continue
        for smem in (False, True):
            for resident in RESIDENTS:
                plan = BwdRegisterPlan(tpr, 1, vec, nv // tpr, resident, smem)
                if plan == default:
                    continue
                why = refusal(shape.kind, plan, shape.sums)
                if why:
                    left.append((plan, why))
                else:
                    kept.append(Candidate(plan, False))
    if default is not None:
        kept.append(Candidate(default, True))
    return kept, left


def traffic(shape: Shape) -> int:
    """Bytes of the backward's floor: dy, x (and dres) read, dx written, 2 n weight-ish."""
    item = _ITEMSIZE[DTYPE]
    streams = 4 if shape.kind == "add_rms" else 3
    return shape.rows * shape.n * item * streams + 2 * shape.n * item


# --- compile (worker processes) ---------------------------------------------------------------


def compile_jobs(shapes) -> list[tuple]:
    """One job a distinct program: ``("main", kind, n, plan)`` and ``("colsum", rpc, n, k)``."""
    jobs = set()
    for s in shapes:
        for c in candidates(s)[0]:
            jobs.add(("main", s.kind, s.n, tuple(c.plan)))
            jobs.add(("colsum", c.plan.rpc, s.n, s.sums))
    return sorted(jobs, key=repr)


def build(job: tuple):
    """The compiled program of a job, with the arguments the entry passes its builders."""
    from tileops.kernels.norm_bwd import build_bwd_register_kernel, build_colsum_kernel

    if job[0] == "colsum":
        _, rpc, n, k = job
        return build_colsum_kernel(rpc, n, k, DTYPE)
    _, kind, n, plan = job
    return build_bwd_register_kernel(kind, n, DTYPE, EPS, True, True, kind == "layer", None,
                                     BwdRegisterPlan(*plan))


def _compile(job: tuple) -> tuple[tuple, float, str]:
    sys.path[:0] = PATHS
    t = time.perf_counter()
    try:
        build(job)
        return job, time.perf_counter() - t, "ok"
    except Exception as exc:  # noqa: BLE001 - reported per candidate
        return job, time.perf_counter() - t, f"{type(exc).__name__}: {str(exc)[-300:]}"


# --- run (this process) -----------------------------------------------------------------------


def input_sets(shape: Shape, device, span: int) -> tuple[list[dict], dict]:
    """Input sets (dy, x, [dres], and the outputs dx, dweight, [dbias]) spanning ``span``
    bytes, and the shared weight and bias."""
    import torch

    kind, m, n = shape
    dt = getattr(torch, DTYPE)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*size):
        return torch.randn(*size, generator=gen, device=device, dtype=torch.float32).to(dt)

    common = {"weight": (1 + 0.5 * randn(n).float()).to(dt), "bias": randn(n)}
    count = max(1, math.ceil(span / traffic(shape)))
    sets = []
    for _ in range(count):
        s = {"dy": randn(m, n), "x": randn(m, n), "dx": torch.empty(m, n, dtype=dt, device=device),
             "dweight": torch.empty(n, dtype=dt, device=device)}
        if kind == "add_rms":
            s["dres"] = randn(m, n)
        if kind == "layer":
            s["dbias"] = torch.empty(n, dtype=dt, device=device)
        sets.append(s)
    return sets, common


def reference(shape: Shape, s: dict, common: dict) -> dict:
    """dx, dweight (and dbias) by torch autograd in float64 on the set's bf16 values."""
    import torch
    import torch.nn.functional as F

    n = shape.n
    x = s["x"].double().requires_grad_()
    w = common["weight"].double().requires_grad_()
    dy = s["dy"].double()
    if shape.kind == "layer":
        b = common["bias"].double().requires_grad_()
        y = F.layer_norm(x, (n,), w, b, EPS)
        dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
        return {"dx": dx, "dweight": dw, "dbias": db}
    dx, dw = torch.autograd.grad(F.rms_norm(x, (n,), w, EPS), (x, w), dy)
    if shape.kind == "add_rms":
        dx = dx + s["dres"].double()
    return {"dx": dx, "dweight": dw}


def entry(shape: Shape, plan: BwdRegisterPlan, sms: int, device):
    """``call(set)``: the main program and the column sum as the entry runs them, with the
    workspace it would allocate (made here once, shared by every call)."""
    import torch

    program = build(("main", shape.kind, shape.n, tuple(plan)))
    colsum = build(("colsum", plan.rpc, shape.n, shape.sums))
    threads = plan.tpr * plan.rpc
    g_max = grid_ctas(1 << 62, plan.rpc, threads, sms, plan.resident)
    ws_all = torch.empty((g_max, plan.rpc, shape.sums * shape.n), dtype=torch.float32,
                         device=device)
    ws = ws_all[:grid_ctas(shape.rows, plan.rpc, threads, sms, plan.resident)]

    def call(s: dict, w) -> None:
        if shape.kind == "add_rms":
            program(s["dy"], s["dres"], s["x"], w, s["dx"], ws)
        else:
            program(s["dy"], s["x"], w, s["dx"], ws)
        if shape.kind == "layer":
            colsum(ws, s["dweight"], s["dbias"])
        else:
            colsum(ws, s["dweight"])

    return call


def sweep_shape(shape: Shape, sms: int, device, failed_builds: dict) -> list[dict]:
    """Every candidate of ``shape`` checked and timed: one row each (``us`` or ``error``)."""
    import torch

    from _common import graph_events
    from tileops.ops.cli.timing import ROTATE_BYTES
    from tileops.ops.workloads import TOLERANCE, rel_l2

    sets, common = input_sets(shape, device, ROTATE_BYTES)
    ref = reference(shape, sets[0], common)
    tol = TOLERANCE[DTYPE]
    iters = max(20, len(sets))
    out = []
    for cand in candidates(shape)[0]:
        row = {"plan": cand.plan, "default": cand.default}
        out.append(row)
        job = ("main", shape.kind, shape.n, tuple(cand.plan))
        if job in failed_builds:
            row["error"] = f"compile: {failed_builds[job]}"
            continue
        try:
            call = entry(shape, cand.plan, sms, device)
            s0 = sets[0]
            for name in ref:
                s0[name].fill_(float("nan"))
            call(s0, common["weight"])
            torch.cuda.synchronize()
            row["err"] = {name: rel_l2(s0[name], r) for name, r in ref.items()}
            row["ok"] = all(e <= tol for e in row["err"].values())
            turn = [0]

            def step(call=call, turn=turn) -> None:
                call(sets[turn[0] % len(sets)], common["weight"])
                turn[0] += 1

            ms = graph_events(step, iters)
            row["us"] = ms * 1e3
            row["gbs"] = traffic(shape) / (ms * 1e-3) / 1e9
        except Exception as exc:  # noqa: BLE001 - one failing candidate is reported
            torch.cuda.synchronize()
            row["error"] = f"{type(exc).__name__}: {str(exc).strip()[-200:]}"
    return out


# --- report -----------------------------------------------------------------------------------


def _best(rows: list[dict]) -> dict | None:
    return min((r for r in rows if "us" in r and r["ok"]), key=lambda r: r["us"], default=None)


def table(shape: Shape, rows: list[dict]) -> list[str]:
    """The shape's lines: timed candidates by time (WRONG where a gradient is off float64),
    the default's rank, then the candidates that failed."""
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    default = next((r for r in rows if r["default"]), None)
    lines = [f"{shape.label}  bf16  {len(rows)} candidates  default "
             f"{label(default['plan']) if default else '-'}"]
    lines.append(f"  {'#':>3} {'plan':<20} {'us':>9} {'GB/s':>7}  {'x default':>9}  check")
    for i, r in enumerate(timed, 1):
        ratio = (f"{default['us'] / r['us']:9.3f}" if default and "us" in default
                 else f"{'-':>9}")
        worst = max(r["err"].values())
        check = f"ok {worst:.1e}" if r["ok"] else "WRONG " + " ".join(
            f"{k} {e:.1e}" for k, e in r["err"].items())
        mark = "  <- default" if r["default"] else ""
        lines.append(f"  {i:>3} {label(r['plan']):<20} {r['us']:9.1f} {r['gbs']:7.0f}  "
                     f"{ratio}  {check}{mark}")
    if default is None or "us" not in default:
        lines.append("  default: not timed")
    else:
        lines.append(f"  default rank: {timed.index(default) + 1} of {len(timed)}")
    for r in rows:
        if "error" in r:
            lines.append(f"  FAILED {label(r['plan']):<20} {r['error']}")
    return lines


def summary(shape: Shape, rows: list[dict]) -> str:
    """One line: the best correct plan, its time, the default's time, the speedup."""
    best = _best(rows)
    default = next((r for r in rows if r["default"]), None)
    d_us = default.get("us") if default else None
    if best is None:
        return f"{shape.label:<20} no correct candidate timed"
    speed = f"{d_us / best['us']:.3f}x" if d_us else "-"
    d_txt = f"{d_us:.1f} us" if d_us else "not timed"
    return (f"{shape.label:<20} best {label(best['plan']):<20} {best['us']:9.1f} us  "
            f"default {d_txt:>12}  speedup {speed}")


def listing(shapes) -> list[str]:
    """The ``--dry-run`` text: per shape the candidates (estimated registers against the cap,
    shared memory a CTA, grid) and those left out with why; then the programs to compile."""
    lines = []
    for s in shapes:
        kept, left = candidates(s)
        lines.append(f"{s.label}: {len(kept)} candidates, {len(left)} left out")
        for c in kept:
            p = c.plan
            threads = p.tpr * p.rpc
            lines.append(f"  {label(p):<20} ~{registers(s.kind, p, s.sums):>3}/"
                         f"{register_cap(p.resident):<3} regs  "
                         f"{shared_bytes(s.kind, p, s.sums) >> 10:>4} KiB smem  grid "
                         f"{grid_ctas(s.rows, p.rpc, threads, 132, p.resident):>5}"
                         f"{'  default' if c.default else ''}")
        for p, why in left:
            lines.append(f"  left out {label(p):<20} {why}")
    lines.append(f"{len(compile_jobs(shapes))} programs to compile (grids for 132 SMs)")
    return lines


def parse_shapes(text: str | None) -> list[Shape]:
    if not text:
        return list(SHAPES)
    known = {s.label: s for s in SHAPES}
    wanted = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in wanted if w not in known]
    if bad or not wanted:
        raise ValueError(f"sweep_norm_bwd: --shapes expects labels among "
                         f"{', '.join(known)}; got {', '.join(bad) or repr(text)}")
    return [known[w] for w in wanted]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", help="comma-separated labels, e.g. layer-2048x8192")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--dry-run", action="store_true",
                    help="list the candidates per shape (CPU, nothing compiled)")
    args = ap.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as exc:
        ap.error(str(exc))
    if args.dry_run:
        print("\n".join(listing(shapes)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("sweep_norm_bwd: needs a CUDA device (--dry-run lists the candidates)",
              file=sys.stderr)
        return 2
    start = time.perf_counter()
    jobs = compile_jobs(shapes)
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
        results = list(pool.map(_compile, jobs))
    failed = {j: s for j, _, s in results if s != "ok"}
    print(f"compiled {len(jobs)} programs in {time.perf_counter() - start:.0f} s "
          f"({len(failed)} failed)", flush=True)
    device = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    lines, ends = [], []
    for s in shapes:
        rows = sweep_shape(s, sms, device, failed)
        part = table(s, rows)
        print("\n".join(part), flush=True)
        lines += part
        ends.append(summary(s, rows))
        torch.cuda.empty_cache()
    for job, why in failed.items():
        if job[0] == "colsum":
            lines.append(f"FAILED colsum {job[1:]}: {why}")
    wall = time.perf_counter() - start
    tail = ["", "best per shape:", *ends, f"wall {wall:.0f} s"]
    print("\n".join(tail))
    from _common import versions

    v = versions()
    header = (f"Row-norm backward register plans on {v['gpu']} ({sms} SMs), torch {v['torch']}, "
              f"tilelang {v['tilelang']}, {time.strftime('%Y-%m-%d')}; entry = main program + "
              f"column sum; CUDA-graph replay, inputs rotated past 256 MB (cold L2); GB/s of "
              f"dy, x[, dres] read, dx written, 2n weight-ish; x default = default time / "
              f"this time")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_norm_bwd.txt").write_text("\n".join([header, "", *lines, *tail]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
