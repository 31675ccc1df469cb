"""GEMM in training: the backward (dA and dB) of ``c = op(a) @ op(b)`` against cuBLAS doing the
same two products, and forward + backward through autograd against torch's, one shape at a
time.

    python benchmarks/train_gemm.py [--out DIR] [-w LABEL]...
    python benchmarks/train_gemm.py --prebuild [--workers N]     # build our kernels first
    python benchmarks/train_gemm.py --dry-run [...]              # CPU, reference target, small

With ``A = op(a)`` (M x K), ``B = op(b)`` (K x N) and ``dC`` given, the backward is
``dA = dC @ B^T`` and ``dB = A^T @ dC``, each returned in its operand's stored layout (``da``
is K x M when ``trans_a``, ``db`` N x K when ``trans_b``). Four contenders per shape:

- ``tileops``: ``GemmFwdOp(trans_a=, trans_b=)`` forward, then ``torch.autograd.grad`` through
  the op's backward (its spec's backward op); ``torch``: the same with ``torch.matmul`` on the
  transposed views (cuBLAS forward and backward through autograd). 6 M N K flops.
- ``tileops bwd``: ``GemmBwdOp(trans_a=, trans_b=)(dc, a, b)`` alone, where tileops.ops has
  that class; ``cuBLAS bwd``: the two products with ``torch.matmul`` on views (no copies), each
  written in the stored layout (``da = B @ dC^T`` when ``trans_a``, ``db = dC^T @ A`` when
  ``trans_b``). 4 M N K flops.

Shapes: the spec's GemmFwdOp workloads (:func:`tileops.ops.workloads.cases_of`) with M of at
least 2048 (as written, before any ``--max-elements`` scaling); 8192^3 bfloat16, the headline,
is one of them and the run refuses to start without it. Each contender's gradients are compared
with float64 autograd of ``torch.matmul`` on the same inputs once per shape, outside the timing
(relative L2 against the dtype's tolerance, ✗ above it). Timing as ``train_norm.py``
(:func:`tileops.ops.cli.timing.device_time`) with cold L2, as ``tileops bench`` times GEMM: the
calls rotate over input sets spanning :data:`~tileops.ops.cli.timing.ROTATE_BYTES` (at most
:data:`~tileops.ops.cli.timing.MAX_SETS`), since a weight comes from HBM in a training step.

Results: ``train_gemm-<device>.json`` and ``.md`` under ``--out``; the table is printed last.
The exit status is 1 when a tileops cell failed, its gradients included.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PATHS = [str(p) for p in sorted((ROOT / "packages").glob("*/src"))]
for _p in reversed(PATHS):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

from _common import (  # noqa: E402
    first_line,
    header,
    md_table,
    parse_device,
    prebuild,
    title,
    write_results,
)
from tileops.ops import GemmFwdOp  # noqa: E402
from tileops.ops.cli.timing import MAX_SETS, ROTATE_BYTES, rotating, sync  # noqa: E402
from tileops.ops.workloads import TOLERANCE, Case, cases_of, make_inputs  # noqa: E402
from train_norm import blank_cell, fmt_ms, measure, note_lines, ratio, timed  # noqa: E402

CONTENDERS = ("tileops", "torch", "tileops bwd", "cuBLAS bwd")
#: the pairs compared: ours, theirs
PAIRS = (("tileops", "torch"), ("tileops bwd", "cuBLAS bwd"))
#: flops per M N K of each contender: forward + backward 3 products, backward 2
FLOPS = {"tileops": 6, "torch": 6, "tileops bwd": 4, "cuBLAS bwd": 4}
MIN_M = 2048
HEADLINE = ((8192, 8192, 8192), "bfloat16")


def gemm_bwd_class() -> type | None:
    import tileops.ops as ops

    return getattr(ops, "GemmBwdOp", None)


def original(case: Case, index: str) -> int:
    """The value of ``index`` as the workload wrote it (before scaling)."""
    return case.scaled[index][0] if index in case.scaled else case.values[index]


def training_cases(max_elements: int | None = None,
                   labels: Sequence[str] | None = None) -> list[Case]:
    return [c for c in cases_of(GemmFwdOp, max_elements=max_elements, labels=labels or None)
            if original(c, "M") >= MIN_M]


def headline_label() -> str:
    for c in training_cases():
        if (c.values["M"], c.values["N"], c.values["K"]) == HEADLINE[0] \
                and c.dtype == HEADLINE[1]:
            return c.label
    raise SystemExit("GemmFwdOp: its workloads have no 8192^3 bfloat16 row, the headline")


def reference_grads(a: torch.Tensor, b: torch.Tensor, dc: torch.Tensor, ta: bool,
                    tb: bool) -> tuple[torch.Tensor, ...]:
    """``(da, db)`` in float64 through autograd of ``torch.matmul`` on the transposed views."""
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    c = torch.matmul(a64.T if ta else a64, b64.T if tb else b64)
    return torch.autograd.grad(c, (a64, b64), dc.double())


def cublas_bwd(ta: bool, tb: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``(da, db)`` as two ``torch.matmul`` calls on views, each in its operand's layout."""

    def backward(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
        big_a = a.T if ta else a
        big_b = b.T if tb else b
        da = torch.matmul(big_b, dc.T) if ta else torch.matmul(dc, big_b.T)
        db = torch.matmul(dc.T, big_a) if tb else torch.matmul(big_a.T, dc)
        return da, db

    return backward


def steps(case: Case, sets: list[list[torch.Tensor]],
          target: str | None) -> dict[str, tuple[Callable[[], Any] | None, str | None]]:
    """Each contender as a callable over the rotated ``(a, b, dc)`` sets, or None and why."""
    ta, tb = bool(case.values["trans_a"]), bool(case.values["trans_b"])
    kw = {"target": target} if target else {}
    op = GemmFwdOp(trans_a=ta, trans_b=tb, **kw)
    eager = op.eager()

    def through_autograd(fn):
        return rotating(sets, lambda a, b, dc: torch.autograd.grad(fn(a, b), (a, b), dc))

    out: dict[str, tuple[Callable[[], Any] | None, str | None]] = {
        "tileops": (through_autograd(op), None), "torch": (through_autograd(eager), None)}
    # the backward alone takes the operands as plain tensors (no graph is recorded)
    plain = [[t.detach() for t in s] for s in sets]
    bwd_cls = gemm_bwd_class()
    if bwd_cls is None:
        out["tileops bwd"] = (None, "not run: tileops.ops has no GemmBwdOp")
    else:
        bwd = bwd_cls(trans_a=ta, trans_b=tb, **kw)
        out["tileops bwd"] = (rotating(plain, lambda a, b, dc: bwd(dc, a, b)), None)
    back = cublas_bwd(ta, tb)
    out["cuBLAS bwd"] = (rotating(plain, lambda a, b, dc: back(dc, a, b)), None)
    return out


def input_sets(case: Case, dev: torch.device) -> list[list[torch.Tensor]]:
    """``[a, b, dc]`` sets (seeds 0, 1, ...), ``a`` and ``b`` requiring grad, as many as span
    the harness's rotation bytes."""
    m, n = case.values["M"], case.values["N"]
    dtype = getattr(torch, case.dtype)
    one = sum(math.prod(s.shape) for s in case.inputs) + m * n
    count = max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / (one * dtype.itemsize))))
    sets = []
    for seed in range(count):
        a, b = (t.requires_grad_() for t in make_inputs(case, dev, seed=seed))
        gen = torch.Generator(device=dev).manual_seed(1000 + seed)
        sets.append([a, b, torch.randn(m, n, dtype=dtype, device=dev, generator=gen)])
    return sets


def run_case(case: Case, headline: bool, args: argparse.Namespace,
             dev: torch.device) -> dict[str, Any]:
    v = case.values
    ta, tb = bool(v["trans_a"]), bool(v["trans_b"])
    sets = input_sets(case, dev)
    refs = reference_grads(*sets[0], ta, tb)
    mnk = v["M"] * v["N"] * v["K"]
    row: dict[str, Any] = {
        "workload": case.label, "dtype": case.dtype, "m": v["M"], "n": v["N"], "k": v["K"],
        "trans_a": ta, "trans_b": tb, "scaled": {k: list(x) for k, x in case.scaled.items()},
        "headline": headline, "sets": len(sets),
        "flops": {n: FLOPS[n] * mnk for n in CONTENDERS}, "contenders": {}}
    for name, (step, note) in steps(case, sets, args.target).items():
        row["contenders"][name] = (blank_cell(note) if step is None else measure(
            step, refs, ("a", "b"), TOLERANCE[case.dtype], dev, args.iters))
    for ours, theirs in PAIRS:
        a, b = timed(row["contenders"][ours]), timed(row["contenders"][theirs])
        row[f"{ours} vs {theirs}"] = b / a if a and b else None
    return row


def tflops(row: dict[str, Any], name: str) -> str:
    c = row["contenders"][name]
    t = not c["error"] and c["time_s"]
    return f"{row['flops'][name] / t / 1e12:.3g}" if t else "-"


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in values) / len(values))


def markdown(head: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = title(head, "GEMM backward and forward + backward")
    lines += [f"Timing: {head['timing']['method']}; cold L2 (input sets rotated past "
              f"{ROTATE_BYTES >> 20} MB); target {head['target'] or 'by device'}.", "",
              "TFLOP/s: 6·M·N·K for forward + backward (tileops, torch), 4·M·N·K for the "
              "backward's two products (tileops bwd, cuBLAS bwd). vs X: X's time over ours "
              "(above 1: tileops faster). ✗: a gradient off float64 by more than the dtype's "
              "tolerance (relative L2).", ""]
    if any(r["scaled"] for r in rows):
        lines += [f"`*`: scaled down to at most {head['max_elements']} elements a tensor "
                  f"(the M >= {MIN_M} selection reads the sizes as written).", ""]
    summary = []
    for ours, theirs in PAIRS:
        vals = [x for r in rows if (x := r[f"{ours} vs {theirs}"])]
        if vals:
            low = min(rows, key=lambda r: r[f"{ours} vs {theirs}"] or math.inf)
            summary.append(f"{ours} vs {theirs} {geomean(vals):.3f}× over {len(vals)} (lowest "
                           f"{low[f'{ours} vs {theirs}']:.3f}×, {low['workload']} "
                           f"{low['dtype']})")
    if summary:
        lines += ["Geometric mean: " + "; ".join(summary) + ".", ""]
    cols = ["workload", "dtype", "M×N×K", "trans"]
    for ours, theirs in PAIRS:
        cols += [ours, "TFLOP/s", theirs, "TFLOP/s", f"vs {theirs}"]
    cols.append(f"grad rel err ({' / '.join(CONTENDERS)})")
    body = []
    notes: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        cells = r["contenders"]
        line = [r["workload"] + (" (headline)" if r["headline"] else ""), r["dtype"],
                f"{r['m']}×{r['n']}×{r['k']}" + (" *" if r["scaled"] else ""),
                ("T" if r["trans_a"] else "N") + ("T" if r["trans_b"] else "N")]
        for ours, theirs in PAIRS:
            x = r[f"{ours} vs {theirs}"]
            line += [fmt_ms(cells[ours]), tflops(r, ours), fmt_ms(cells[theirs]),
                     tflops(r, theirs), f"{x:.2f}×" if x else ratio(None, None)]
        line.append(" / ".join(f"{max(c['grad_err'].values()):.1e}" if c["grad_err"] else "-"
                               for c in (cells[n] for n in CONTENDERS)))
        body.append(line)
        for n, c in cells.items():
            for text in (c["error"], c["note"]):
                if text:
                    notes.setdefault((n, text), []).append(f"{r['workload']} {r['dtype']}")
    lines += [*md_table(cols, body), *([""] if notes else []), *note_lines(notes, len(rows))]
    return "\n".join(lines).rstrip("\n") + "\n"


def _prebuild_one(job: tuple[Case, str, str | None]) -> tuple[str, float, str]:
    """Every contender once on one shape (``(case, device, target)``): our forward, backward
    through autograd and backward op build their kernels."""
    case, device, target = job
    label = f"{case.label} {case.dtype}"
    t = time.perf_counter()
    try:
        sets = input_sets(case, torch.device(device))[:1]
        for step, _ in steps(case, sets, target).values():
            if step is not None:
                step()
        sync(torch.device(device))
        return label, time.perf_counter() - t, "ok"
    except Exception as exc:  # noqa: BLE001 - reported by the caller
        return label, time.perf_counter() - t, first_line(exc)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("-w", "--workload", action="append", default=[], metavar="LABEL",
                    help="only workloads whose label matches (shell pattern; repeatable)")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --dry-run)")
    ap.add_argument("--target", default=None, help="the ops' target (default: by device)")
    ap.add_argument("--max-elements", type=int, default=None,
                    help="scale shapes down (default: none; 2^14 with --dry-run)")
    ap.add_argument("--iters", type=int, default=None,
                    help="calls per timed loop (default 20; 3 with --dry-run)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, the reference target, shapes scaled to 2^14 elements, 3 calls")
    ap.add_argument("--prebuild", action="store_true",
                    help="only build our kernels for every shape, in --workers processes")
    ap.add_argument("--workers", type=int, default=14)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device = args.device or "cpu"
        args.target = args.target or "reference"
        args.max_elements = args.max_elements or 1 << 14
        args.iters = args.iters or 3
    args.iters = args.iters or 20
    dev = parse_device(args.device or "cuda")
    if args.prebuild:
        jobs = [(c, str(dev), args.target) for c in training_cases(args.max_elements,
                                                                     args.workload)]
        return prebuild(jobs, _prebuild_one, args.workers)
    head_label = headline_label()
    plan = training_cases(args.max_elements, args.workload)
    if not plan:
        ap.error(f"no workload with M >= {MIN_M} matches the --workload patterns")
    method = ("CUDA graph replay of {n} calls, median of 5 (device time)"
              if dev.type == "cuda" else "wall clock, the fastest of {n} calls")
    head = header("train_gemm", dev, target=args.target, max_elements=args.max_elements,
                  contenders=list(CONTENDERS),
                  timing={"method": method.format(n=args.iters), "iters": args.iters,
                          "l2": "cold"})
    rows: list[dict[str, Any]] = []
    for i, case in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] GemmFwdOp {case.label} {case.dtype}", file=sys.stderr,
              flush=True)
        rows.append(run_case(case, case.label == head_label and case.dtype == HEADLINE[1],
                             args, dev))
        write_results(args.out, "train_gemm", dev, {**head, "results": rows},
                      markdown(head, rows), echo=i == len(plan))
        if dev.type == "cuda":  # the float64 reference and graph pools of the largest shapes
            torch.cuda.empty_cache()
    failed = [r for r in rows for n in ("tileops", "tileops bwd")
              if r["contenders"][n]["note"] is None and timed(r["contenders"][n]) is None]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
