"""The row norms in training: forward + backward of RMSNorm, LayerNorm and fused add + RMSNorm
side by side with torch eager, torch.compile and Liger-Kernel, one shape at a time.

    python benchmarks/train_norm.py [--out DIR] [--ops NAMES] [-w LABEL]... [--against NAMES]
    python benchmarks/train_norm.py --prebuild [--workers N]     # build our kernels first
    python benchmarks/train_norm.py --dry-run [...]              # CPU, reference target, small

One cell times ``torch.autograd.grad(fn(*inputs), inputs, grad_outputs)``: the forward and the
backward with the gradients of the outputs given (for the fused add, of both ``y`` and
``residual_out``), every present input requiring grad (x, residual, weight, bias).
``autograd.grad`` rather than ``y.backward(dy)``: the two run the same kernels, but a second
``backward`` adds an accumulation into each ``.grad`` already held, traffic no contender's
kernels are responsible for.

- Shapes: the family grid (``families.norm.grids`` in ``specs/norm.yaml``, read through the
  spec loader and :func:`tileops.ops.workloads.cases_of`) in each row's dtype cases; the fused
  add's in-place workloads are not in it (an in-place op has no backward). The headline is
  32768 x 8192 bfloat16, a row of that grid; the run refuses to start without it.
- Contenders: ``tileops`` (the op, whose backward is its spec's backward op), ``torch`` (the
  op's declared eager function), ``torch.compile`` (that function compiled afresh per shape:
  ``torch._dynamo.reset()``, ``dynamic=False``; the first call, outside the timing, compiles
  forward and backward) and ``liger``: Liger-Kernel's autograd Functions
  (``LigerRMSNormFunction``, ``LigerLayerNormFunction``, ``LigerFusedAddRMSNormFunction``),
  casting mode ``llama`` as the declared peers use, ``in_place=False``: RMSNorm's default
  writes dx into dy, which the timed loop passes again. A peer the installed Liger lacks, or
  whose forward takes other parameters than these, is left out with a note.
- Gradients: once per shape, outside the timing, every contender's gradients are compared with
  torch eager's in float64 on the same (rounded) inputs and output gradients, with the eps the
  op resolves (RMSNorm's ``eps=None`` is the storage dtype's epsilon, which a float64 call of
  ``F.rms_norm`` would not use). Above the harness's tolerance for the dtype (relative L2,
  :data:`~tileops.ops.workloads.TOLERANCE`) a contender is marked ✗ and is nobody's best.
- Timing: :func:`tileops.ops.cli.timing.device_time` (what ``tileops bench`` and
  ``_common.graph_events`` use): the replay of a CUDA graph of ``--iters`` calls, median of 5,
  device time; CUDA events around back-to-back calls where capture fails (with a note); wall
  clock on the CPU. L2 is left warm, as ``tileops bench`` does for norms.
- "TB/s equivalent": bytes of the minimal fwd + bwd traffic over the time. RMSNorm and
  LayerNorm 5 M N itemsize (forward reads x, writes y; backward reads dy, x, writes dx); the
  fused add 7 M N itemsize (forward reads x, residual, writes y, residual_out; backward reads
  dy, d residual_out, residual_out, writes dx). Weight, bias and their gradients (length N)
  are not counted.
- Bars: RMSNorm at the headline at least 3.8 TB/s; every other row at least as fast as the
  faster of torch.compile and Liger, and at the headline (LayerNorm, fused add) 1.2x it.

Results: ``train_norm-<device>.json`` and ``.md`` under ``--out``; the table is printed last.
The exit status is 1 when a tileops cell failed, its gradients included.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    version,
    write_results,
)
from tileops.ops.cli.bench import fresh_compile  # noqa: E402
from tileops.ops.cli.timing import device_time, eager_time, sync  # noqa: E402
from tileops.ops.workloads import TOLERANCE, Case, as_outputs, cases_of, make_inputs, rel_l2  # noqa: E402
from tileops.runtime import default_specs  # noqa: E402

OPS = ("RMSNormFwdOp", "LayerNormFwdOp", "FusedAddRMSNormFwdOp")
CONTENDERS = ("tileops", "torch", "torch.compile", "liger")
#: the peers whose faster one sets the bar of a row (torch eager is shown, not a bar)
BAR_PEERS = ("torch.compile", "liger")
HEADLINE = ((32768, 8192), "bfloat16")


@dataclass(frozen=True)
class Traffic:
    """How an op's fwd + bwd is counted and which Liger Function is its peer: ``factor``
    tensors of M x N elements moved (``counts`` says which), and the Liger module, class, the
    leading parameters its ``forward`` must take and what this script passes after the
    tensors and eps."""

    factor: int
    counts: str
    liger: tuple[str, str, tuple[str, ...], tuple[Any, ...]]


TRAFFIC = {
    "RMSNormFwdOp": Traffic(5, "forward reads x, writes y; backward reads dy, x, writes dx", (
        "rms_norm", "LigerRMSNormFunction",
        ("X", "W", "eps", "offset", "casting_mode", "in_place"), (0.0, "llama", False))),
    "LayerNormFwdOp": Traffic(5, "as RMSNorm", (
        "layer_norm", "LigerLayerNormFunction", ("X", "W", "B", "eps"), ())),
    "FusedAddRMSNormFwdOp": Traffic(
        7, "forward reads x, residual, writes y, residual_out; backward reads dy, "
           "d residual_out, residual_out, writes dx", (
            "fused_add_rms_norm", "LigerFusedAddRMSNormFunction",
            ("X", "R", "W", "eps", "offset", "casting_mode", "in_place"), (0.0, "llama", False))),
}


def measure(step: Callable[[], Sequence[torch.Tensor]], refs: Sequence[torch.Tensor],
            names: Sequence[str], tol: float, dev: torch.device, iters: int) -> dict[str, Any]:
    """Call ``step`` once (its gradients against ``refs``, by name, within ``tol``), twice
    more (a compiled function's first calls cost more than the rest), then time it: the
    record of one contender on one shape."""
    cell = blank_cell()
    try:
        t0 = time.perf_counter()
        grads = step()
        sync(dev)
        cell["first_call_s"] = time.perf_counter() - t0
        cell["grad_err"] = {n: rel_l2(g, r) for n, g, r in zip(names, grads, refs, strict=True)}
        cell["grad_ok"] = max(cell["grad_err"].values()) <= tol
        for _ in range(2):
            step()
        sync(dev)
        timing = device_time(step, dev, iters=iters)
        cell.update(time_s=timing.seconds, method=timing.method, note=timing.note,
                    eager_s=eager_time(step, dev, iters=iters))
    except Exception as exc:  # noqa: BLE001 - the cell reports it
        cell["error"] = first_line(exc)
    return cell


def blank_cell(note: str | None = None) -> dict[str, Any]:
    """A contender's record before it ran (``note``: why it will not)."""
    return {"time_s": None, "method": None, "eager_s": None, "first_call_s": None,
            "grad_err": None, "grad_ok": None, "error": None, "note": note}


def fmt_ms(cell: dict[str, Any] | None) -> str:
    if cell is None or cell["error"] or cell["time_s"] is None:
        return "error" if cell is not None and cell["error"] else "-"
    return f"{cell['time_s'] * 1e3:.3f} ms" + (" ✗" if cell["grad_ok"] is False else "")


def ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}×" if num and den else "-"


def timed(cell: dict[str, Any] | None) -> float | None:
    """The time of a cell that ran and whose gradients matched, else None."""
    if cell is None or cell["error"] or not cell["grad_ok"]:
        return None
    return cell["time_s"]


# --- the norms ---------------------------------------------------------------------------------


def op_class(name: str) -> type:
    import tileops.ops as ops

    return getattr(ops, name)


def grid_cases(cls: type, max_elements: int | None = None,
               labels: Sequence[str] | None = None) -> list[Case]:
    """The op's workloads that are rows of its family's grids, every dtype case (scaled to
    ``max_elements``, those matching ``labels``)."""
    entry, spec_file, _ = default_specs().find(cls._signature.name)
    family = spec_file.families.get(entry.family)
    grid_labels = {row.label for g in (family.grids if family else {}).values() for row in g.rows}
    return [c for c in cases_of(cls, max_elements=max_elements, labels=labels or None)
            if c.label in grid_labels and not c.params.get("inplace")]


def headline_label(cls: type) -> str:
    """The label of the grid row that is the headline shape, in full size."""
    for c in grid_cases(cls):
        if c.inputs[0].shape == HEADLINE[0] and c.dtype == HEADLINE[1]:
            return c.label
    raise SystemExit(f"{cls.__name__}: its grid has no {HEADLINE[0][0]} x {HEADLINE[0][1]} "
                     f"{HEADLINE[1]} row, the shape the bars are stated at")


def resolved_eps(op: Any, dtype: torch.dtype) -> float:
    return op.eps if op.eps is not None else op.default_eps(dtype)


def liger_peer(name: str, eps: float) -> tuple[Callable[..., Any] | None, str | None]:
    """The Liger Function of ``name`` as ``fn(*tensors)``, or None and why it is left out."""
    module, cls_name, params, tail = TRAFFIC[name].liger
    try:
        mod = importlib.import_module(f"liger_kernel.ops.{module}")
    except ImportError as exc:
        return None, f"not run: liger_kernel.ops.{module} does not import ({first_line(exc)})"
    fn_cls = getattr(mod, cls_name, None)
    if fn_cls is None:
        return None, f"not run: liger-kernel {version('liger-kernel')} has no {module}.{cls_name}"
    got = tuple(list(inspect.signature(fn_cls.forward).parameters)[1:1 + len(params)])
    if got != params:
        return None, (f"not run: {cls_name}.forward takes ({', '.join(got)}, ...), not the "
                      f"({', '.join(params)}, ...) this script passes")

    def liger(*tensors: torch.Tensor | None) -> Any:
        if any(t is None for t in tensors):
            raise NotImplementedError(f"{cls_name} needs every affine tensor")
        return fn_cls.apply(*tensors, eps, *tail)

    return liger, None


def contender(name: str, op: Any, eps: float, args: argparse.Namespace,
              cls_name: str) -> tuple[Callable[..., Any] | None, str | None]:
    if name == "tileops":
        return op, None
    if name == "torch":
        return op.eager(), None
    if name == "torch.compile":
        return fresh_compile(op.eager(), backend=args.compile_backend,
                             mode=args.compile_mode), None
    return liger_peer(cls_name, eps)


def run_case(cls: type, case: Case, headline: bool, args: argparse.Namespace,
             dev: torch.device) -> dict[str, Any]:
    """Every contender of ``args.against`` on one shape: the row of the results."""
    kw = {"target": args.target} if args.target else {}
    op = cls(**case.params, **kw)
    dtype = getattr(torch, case.dtype)
    eps = resolved_eps(op, dtype)
    inputs = make_inputs(case, dev)
    names = [s.name for s, t in zip(case.inputs, inputs, strict=True) if t is not None]
    leaves = [t.requires_grad_() for t in inputs if t is not None]
    with torch.no_grad():
        outs = as_outputs(op.eager()(*inputs))
    gen = torch.Generator(device=dev).manual_seed(1)
    grad_out = [torch.randn(o.shape, dtype=o.dtype, device=dev, generator=gen) for o in outs]
    # float64: torch eager with the eps the op resolved for this dtype
    wide = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    ref_fn = cls(**{**case.params, "eps": eps}, **kw).eager()
    refs = torch.autograd.grad(as_outputs(ref_fn(*wide)), [t for t in wide if t is not None],
                               [g.double() for g in grad_out])
    x = case.inputs[0]
    rows_n = (math.prod(x.shape[:-1]), x.shape[-1])
    row: dict[str, Any] = {
        "op": cls.__name__, "workload": case.label, "dtype": case.dtype,
        "shape": list(x.shape), "scaled": {k: list(v) for k, v in case.scaled.items()},
        "headline": headline,
        "bytes": TRAFFIC[cls.__name__].factor * rows_n[0] * rows_n[1] * dtype.itemsize,
        "contenders": {}}
    for name in args.against:
        fn, note = contender(name, op, eps, args, cls.__name__)
        if fn is None:
            row["contenders"][name] = blank_cell(note)
            continue

        def step(fn=fn):
            return torch.autograd.grad(as_outputs(fn(*inputs)), leaves, grad_out)

        row["contenders"][name] = measure(step, refs, names, TOLERANCE[case.dtype], dev,
                                          args.iters)
    judge(row)
    return row


def judge(row: dict[str, Any]) -> None:
    """The row's best peer, its ratio, its bar and whether the bar is met (None: no peer of
    the bar could be timed)."""
    cells = row["contenders"]
    ours = timed(cells.get("tileops"))
    peers = {n: t for n, c in cells.items() if n != "tileops" and (t := timed(c))}
    best = min(peers, key=peers.get) if peers else None
    row["best_peer"] = best
    row["vs_best"] = peers[best] / ours if best and ours else None
    if row["op"] == "RMSNormFwdOp" and row["headline"]:
        row["bar"] = "≥ 3.8 TB/s"
        row["meets"] = bool(ours) and row["bytes"] / ours / 1e12 >= 3.8
        return
    need = 1.2 if row["headline"] else 1.0
    row["bar"] = f"≥ {need:.1f}× faster of torch.compile, liger"
    bar = [t for n, t in peers.items() if n in BAR_PEERS]
    row["meets"] = None if not bar else bool(ours) and min(bar) / ours >= need


def tbps(row: dict[str, Any], cell: dict[str, Any] | None) -> str:
    t = cell and not cell["error"] and cell["time_s"]
    return f"{row['bytes'] / t / 1e12:.3g}" if t else "-"


def op_table(op: str, rows: list[dict[str, Any]], against: Sequence[str]) -> list[str]:
    cols = ["workload", "dtype", "shape"]
    for n in against:
        cols += [n, "TB/s"]
    peers = [n for n in against if n != "tileops"]
    cols += [f"vs {n}" for n in peers] + ["vs best", "bar", "meets",
                                         f"grad rel err ({' / '.join(against)})"]
    body = []
    notes: dict[tuple[str, str], list[str]] = {}  # (contender, text) -> the rows it is of
    for r in rows:
        cells = r["contenders"]
        ours = timed(cells.get("tileops"))
        line = [r["workload"] + (" (headline)" if r["headline"] else ""), r["dtype"],
                "×".join(map(str, r["shape"])) + (" *" if r["scaled"] else "")]
        for n in against:
            line += [fmt_ms(cells.get(n)), tbps(r, cells.get(n))]
        line += [ratio(timed(cells.get(n)), ours) for n in peers]
        line += [f"{r['vs_best']:.2f}× {r['best_peer']}" if r["vs_best"] else "-", r["bar"],
                 {True: "yes", False: "NO", None: "-"}[r["meets"]]]
        errs = []
        for n in against:
            c = cells.get(n)
            errs.append(f"{max(c['grad_err'].values()):.1e}" if c and c["grad_err"] else "-")
        line.append(" / ".join(errs))
        body.append(line)
        for n, c in cells.items():
            for text in (c.get("error"), c.get("note")):
                if text:
                    notes.setdefault((n, text), []).append(f"{r['workload']} {r['dtype']}")
    return [f"## {op}", "", *md_table(cols, body), *([""] if notes else []),
            *note_lines(notes, len(rows)), ""]


def note_lines(notes: dict[tuple[str, str], list[str]], rows: int) -> list[str]:
    """One line per (contender, text): the rows it was seen on, or "every row"."""
    return [f"- {n}, {'every row' if len(where) == rows else ', '.join(where)}: {text}"
            for (n, text), where in notes.items()]


def markdown(head: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    t = head["timing"]
    lines = title(head, "Row norms, forward + backward")
    lines += [f"Timing: {t['method']}; L2 warm; torch.compile: a fresh `torch.compile(fn, "
              f"dynamic=False)` per shape (backend {t['compile_backend']}, mode "
              f"{t['compile_mode'] or 'default'}); target {head['target'] or 'by device'}.",
              "",
              "TB/s equivalent: RMSNorm and LayerNorm 5·M·N·itemsize bytes ("
              f"{TRAFFIC['RMSNormFwdOp'].counts}); fused add 7·M·N·itemsize "
              f"({TRAFFIC['FusedAddRMSNormFwdOp'].counts}); weight and bias not counted. "
              "vs X: X's time over tileops' (above 1: tileops faster).", "",
              "✗: a gradient off float64 by more than the dtype's tolerance (relative L2); such "
              "a contender is nobody's best.", ""]
    if any(r["scaled"] for r in rows):
        lines += [f"`*`: scaled down to at most {head['max_elements']} elements a tensor.", ""]
    for op in OPS:
        mine = [r for r in rows if r["op"] == op]
        if mine:
            lines += op_table(op, mine, head["against"])
    return "\n".join(lines).rstrip("\n") + "\n"


def _prebuild_one(job: tuple[str, Case, str, str | None]) -> tuple[str, float, str]:
    """Our op's forward and backward once on one shape (``(op name, case, device, target)``),
    at the size the run uses: the kernels a call selects depend on the row count."""
    name, case, device, target = job
    label = f"{name} {case.label} {case.dtype}"
    t = time.perf_counter()
    try:
        op = op_class(name)(**case.params, **({"target": target} if target else {}))
        inputs = [None if x is None else x.requires_grad_() for x in make_inputs(case, device)]
        outs = as_outputs(op(*inputs))
        torch.autograd.grad(outs, [x for x in inputs if x is not None],
                            [torch.ones_like(o) for o in outs])
        sync(torch.device(device))
        return label, time.perf_counter() - t, "ok"
    except Exception as exc:  # noqa: BLE001 - reported by the caller
        return label, time.perf_counter() - t, first_line(exc)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated (default: all three)")
    ap.add_argument("-w", "--workload", action="append", default=[], metavar="LABEL",
                    help="only grid rows whose label matches (shell pattern; repeatable)")
    ap.add_argument("--against", default=",".join(CONTENDERS[1:]),
                    help="peers, comma-separated (default: torch,torch.compile,liger)")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --dry-run)")
    ap.add_argument("--target", default=None, help="the op's target (default: by device)")
    ap.add_argument("--max-elements", type=int, default=None,
                    help="scale shapes down, rows first (default: none; 2^14 with --dry-run)")
    ap.add_argument("--iters", type=int, default=None,
                    help="calls per timed loop (default 20; 3 with --dry-run)")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--compile-mode", default=None)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU, the reference target, shapes scaled to 2^14 elements, 3 calls")
    ap.add_argument("--prebuild", action="store_true",
                    help="only build our kernels for every shape, in --workers processes")
    ap.add_argument("--workers", type=int, default=14)
    args = ap.parse_args(argv)
    ops = [n.strip() for n in args.ops.split(",") if n.strip()]
    unknown = [n for n in ops if n not in OPS]
    if unknown:
        ap.error(f"--ops: unknown op {unknown[0]!r}; valid: {', '.join(OPS)}")
    peers = [n.strip() for n in args.against.split(",") if n.strip()]
    bad = [n for n in peers if n not in CONTENDERS[1:]]
    if bad:
        ap.error(f"--against: unknown contender {bad[0]!r}; valid: {', '.join(CONTENDERS[1:])}")
    args.against = ["tileops", *peers]
    if args.dry_run:
        args.device = args.device or "cpu"
        args.target = args.target or "reference"
        args.max_elements = args.max_elements or 1 << 14
        args.iters = args.iters or 3
    args.iters = args.iters or 20
    classes = [op_class(n) for n in ops]
    dev = parse_device(args.device or "cuda")
    if args.prebuild:
        jobs = [(c.__name__, case, str(dev), args.target) for c in classes
                for case in grid_cases(c, args.max_elements, args.workload)]
        return prebuild(jobs, _prebuild_one, args.workers)
    heads = {c: headline_label(c) for c in classes}
    plan = [(c, case, case.label == heads[c] and case.dtype == HEADLINE[1])
            for c in classes for case in grid_cases(c, args.max_elements, args.workload)]
    if not plan:
        ap.error("no grid row matches the --workload patterns")
    method = ("CUDA graph replay of {n} fwd + bwd calls, median of 5 (device time)"
              if dev.type == "cuda" else "wall clock, the fastest of {n} calls")
    head = header("train_norm", dev, target=args.target, against=args.against,
                  max_elements=args.max_elements,
                  timing={"method": method.format(n=args.iters), "iters": args.iters,
                          "compile_backend": args.compile_backend,
                          "compile_mode": args.compile_mode})
    rows: list[dict[str, Any]] = []
    for i, (cls, case, headline) in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] {cls.__name__} {case.label} {case.dtype}", file=sys.stderr,
              flush=True)
        rows.append(run_case(cls, case, headline, args, dev))
        write_results(args.out, "train_norm", dev, {**head, "results": rows},
                      markdown(head, rows), echo=i == len(plan))
        if dev.type == "cuda":  # the float64 reference and graph pools of the largest shapes
            torch.cuda.empty_cache()
    failed = [r for r in rows if timed(r["contenders"]["tileops"]) is None]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
