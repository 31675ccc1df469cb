"""What ``tileops bench`` writes: a JSON document, a Markdown table per op and a PNG plot.

The JSON document (``schema`` :data:`SCHEMA`) is the header of the run (versions, GPU, date,
peaks, timing method, L2 policy per op, the cap) and ``results``: one row per (op, workload,
dtype), the row ``tileops run --json`` prints (``time_s`` being the device time here) plus
``timing`` (how the op was timed), ``l2``, ``sets``, ``kernels`` and ``contenders``: by name,
each a :class:`ContenderResult` with its achieved ``gbps`` and ``tflops``. Speedups are
contender time over the op's time: above 1, TileOPs is faster.

The plot needs matplotlib, an optional dependency (the ``plot`` extra):
:func:`require_matplotlib` says how to get it, and ``tileops bench`` asks before running
anything, so a long run never ends without its plot.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .formatting import fmt_err, fmt_frac, fmt_inputs, fmt_rate, fmt_time
from .runner import CaseResult
from .timing import Peaks, math_class

__all__ = ["SCHEMA", "ContenderResult", "document", "geomean", "markdown", "require_matplotlib",
           "speedups", "write_json", "write_markdown", "write_plot"]

#: the version of the JSON document's layout
SCHEMA = "tileops-bench/1"

#: the extra of tileops-ops that installs matplotlib
PLOT_EXTRA = "tileops-ops[plot]"


@dataclass
class ContenderResult:
    """One contender on one workload: device time per call and how it was measured
    (``method``, with ``note`` where it fell back), eager back-to-back time (CUDA only), the
    first call (building or compiling included), the error against float64, or why it could
    not run (``error``)."""

    time_s: float | None = None
    method: str | None = None
    eager_s: float | None = None
    first_call_s: float | None = None
    rel_err: float | None = None
    note: str | None = None
    error: str | None = None

    def as_dict(self, flops: int | None, nbytes: int | None) -> dict[str, Any]:
        d = asdict(self)
        if d["rel_err"] is not None and not math.isfinite(d["rel_err"]):
            d["rel_err"] = str(d["rel_err"])
        t = self.time_s
        d["gbps"] = nbytes / t / 1e9 if t and nbytes is not None else None
        d["tflops"] = flops / t / 1e12 if t and flops is not None else None
        return d


def require_matplotlib() -> str | None:
    """None when matplotlib imports; otherwise what to do about it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (f"tileops bench draws its PNG plot with matplotlib, which is not installed; "
                f"install it with the plot extra (pip install '{PLOT_EXTRA}') or pass "
                f"--no-plot")
    return None


def _contenders(r: CaseResult) -> dict[str, ContenderResult]:
    return r.extra.get("contenders", {})


def contender_names(results: Iterable[CaseResult]) -> list[str]:
    """Every contender name in the results, in the order first seen."""
    out: dict[str, None] = {}
    for r in results:
        out.update(dict.fromkeys(_contenders(r)))
    return list(out)


def document(header: dict[str, Any], results: Sequence[CaseResult],
             peaks: Peaks) -> dict[str, Any]:
    """The JSON document of a run (see the module docstring)."""
    rows = []
    for r in results:
        d = r.as_dict(peaks)
        timing = r.extra.get("timing")
        d["timing"] = timing.as_dict(r.flops, r.bytes) if timing is not None else None
        for k in ("l2", "sets", "kernels"):
            d[k] = r.extra.get(k)
        d["contenders"] = {n: c.as_dict(r.flops, r.bytes) for n, c in _contenders(r).items()}
        rows.append(d)
    return {"schema": SCHEMA, **header, "results": rows}


def write_json(path: Path, header: dict[str, Any], results: Sequence[CaseResult],
               peaks: Peaks) -> None:
    path.write_text(json.dumps(document(header, results, peaks), indent=2) + "\n")


def speedups(results: Iterable[CaseResult], name: str) -> list[tuple[CaseResult, float]]:
    """``(row, contender time / op time)`` for each row where both were timed."""
    out = []
    for r in results:
        c = _contenders(r).get(name)
        if r.time_s and c is not None and c.time_s and r.error is None:
            out.append((r, c.time_s / r.time_s))
    return out


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _best_other(r: CaseResult, attr: str) -> float | None:
    times = [t for c in _contenders(r).values() if (t := getattr(c, attr))]
    return min(times) if times else None


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.2f}×" if num and den else "-"


def _op_table(op: str, rows: list[CaseResult], peaks: Peaks) -> list[str]:
    names = contender_names(rows)
    target = next((r.target for r in rows if r.target), None)
    ours = "tileops" if target in (None, "tileops") else f"tileops ({target})"
    kernels = any(r.extra.get("kernels") for r in rows)
    eager = any((t := r.extra.get("timing")) is not None and t.eager_s for r in rows)
    lines = [f"## {op}", ""]
    summary = []
    for n in names:
        sp = speedups(rows, n)
        if sp:
            worst = min(sp, key=lambda x: x[1])
            summary.append(f"{n} {geomean([s for _, s in sp]):.3f}× over {len(sp)} "
                           f"(lowest {worst[1]:.3f}×, {worst[0].workload} {worst[0].dtype})")
    if summary:
        lines += ["Speedup (contender time / TileOPs time; above 1: TileOPs faster), geometric "
                  "mean: " + "; ".join(summary) + ".", ""]
    cols = ["workload", "dtype", "inputs", *(["kernel"] if kernels else []), ours, "achieved",
            "roofline"]
    for n in names:
        cols += [n, "achieved"]
    cols += ["vs best other", *(["eager vs best other"] if eager else []),
             "rel err (" + " / ".join(["tileops", *names]) + ")"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        mb = r.flops is not None and peaks.for_dtype(r.dtype).memory_bound(r.flops,
                                                                           r.bytes or 0)
        cells = [r.workload, r.dtype, fmt_inputs(r.inputs, bool(r.scaled))]
        if kernels:
            cells.append(", ".join(r.extra.get("kernels") or []) or "-")
        if r.error:
            cells += ["error", "-", "-"]
        else:
            cells += [fmt_time(r.time_s), fmt_rate(r.flops, r.bytes, r.time_s, mb),
                      fmt_frac(r.roof_fraction(peaks))]
        errs = [fmt_err(r.rel_err)]
        for n in names:
            c = _contenders(r).get(n)
            if c is None:  # not a contender of this workload's op (see the notes)
                cells += ["-", "-"]
                errs.append("-")
                continue
            if c.error:
                cells += ["error", "-"]
            else:
                cells += [fmt_time(c.time_s), fmt_rate(r.flops, r.bytes, c.time_s, mb)]
            errs.append(fmt_err(c.rel_err))
        timing = r.extra.get("timing")
        cells.append(_ratio(_best_other(r, "time_s"), None if r.error else r.time_s))
        if eager:
            cells.append(_ratio(_best_other(r, "eager_s"),
                                timing.eager_s if timing is not None else None))
        cells.append(" / ".join(errs))
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for r in rows:
        where = f"{r.workload} {r.dtype}"
        if r.error:
            notes.append(f"- {where} tileops: {r.error}")
        if r.note:
            notes.append(f"- {where} tileops: {r.note}")
        timing = r.extra.get("timing")
        if timing is not None and timing.note:
            notes.append(f"- {where} tileops: {timing.note}")
        for n, c in _contenders(r).items():
            for text in (c.error, c.note):
                if text:
                    notes.append(f"- {where} {n}: {text}")
            if c.rel_err is not None and r.tol is not None and not c.rel_err <= r.tol:
                notes.append(f"- {where} {n}: its result is off the float64 reference (rel err "
                             f"{fmt_err(c.rel_err)} against the op's tolerance "
                             f"{fmt_err(r.tol)}); its time still counts as a contender's")
        for n in names:
            if n not in _contenders(r) and not r.error:
                notes.append(f"- {where} {n}: not a contender here (the workload's op does not "
                             "declare it, e.g. a peer without an in-place form)")
    l2 = {r.extra.get("l2") for r in rows} - {None}
    if l2 == {"cold"}:
        notes.append("- cold L2: every timed loop rotates over input sets spanning 256 MB "
                     "(`--l2`)")
    if notes:
        lines += ["", *notes]
    return lines


def markdown(header: dict[str, Any], results: Sequence[CaseResult], peaks: Peaks) -> str:
    """The results as Markdown: a header (where, when, versions, timing), then per op its
    speedup summary, its table (times per call, achieved rate of the op's roofline bytes or
    flops, roofline fraction) and its notes."""
    where = header.get("gpu") or header["device"]
    versions = ", ".join(f"{k} {v}" for k, v in header["versions"].items() if v)
    roofs = {}  # the roofline of each math class the rows are judged by, bf16's first
    for dtype in ["bfloat16", *(r.dtype for r in results)]:
        roof = peaks.for_dtype(dtype)
        roofs.setdefault(roof.math, roof)
    roof_text = peaks.source if len(roofs) == 1 else "; ".join(
        f"{cls} workloads: {p.source}" for cls, p in roofs.items())
    lines = [f"# tileops bench on {where} ({header['when']})", "",
             f"tileops {header['tileops']}; {versions}.", "",
             f"Timing: {header['timing']['method']}; torch.compile: a fresh "
             f"`torch.compile(fn, dynamic=False)` per workload (mode "
             f"{header['timing']['compile']['mode'] or 'default'}). Roofline: "
             f"{roof_text}.", ""]
    if any(r.scaled for r in results):
        lines += [f"`*`: scaled down to at most {header['max_elements']} elements per input or "
                  f"output (`--max-elements`).", ""]
    by_op: dict[str, list[CaseResult]] = {}
    for r in results:
        by_op.setdefault(r.op, []).append(r)
    for op, rows in by_op.items():
        lines += [*_op_table(op, rows, peaks), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def write_markdown(path: Path, header: dict[str, Any], results: Sequence[CaseResult],
                   peaks: Peaks) -> None:
    path.write_text(markdown(header, results, peaks))


_MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def _time_of(r: CaseResult, name: str) -> float | None:
    if name == "tileops":
        return None if r.error else r.time_s
    c = _contenders(r).get(name)
    return c.time_s if c is not None else None


def write_plot(path: Path, header: dict[str, Any], results: Sequence[CaseResult],
               peaks: Peaks) -> None:
    """One row of two panels per op. Left: the roofline (arithmetic intensity against
    achieved FLOP/s, under the measured bandwidth and matmul roofs where the device has
    them). Right: per workload, the speedup over each contender (its time over the op's, on a
    log scale around 1)."""
    from matplotlib.figure import Figure

    by_op: dict[str, list[CaseResult]] = {}
    for r in results:
        by_op.setdefault(r.op, []).append(r)
    widest = max(len(rows) for rows in by_op.values())
    fig = Figure(figsize=(max(13.0, 4 + 0.3 * widest), 5.5 * len(by_op)), layout="constrained")
    axes = fig.subplots(len(by_op), 2, width_ratios=[1, 1.6], squeeze=False)
    where = header.get("gpu") or header["device"]
    for (op, rows), (ax, bars) in zip(by_op.items(), axes, strict=True):
        names = ["tileops", *contender_names(rows)]
        xs_all: list[float] = []
        for i, name in enumerate(names):
            pts = [(r.flops / r.bytes, r.flops / t / 1e9) for r in rows
                   if (t := _time_of(r, name)) and r.flops and r.bytes]
            xs_all += [x for x, _ in pts]
            if pts:
                ax.scatter([x for x, _ in pts], [y for _, y in pts],
                           marker=_MARKERS[i % len(_MARKERS)], label=name, alpha=0.75)
        # the roof of the op's math class where its rows share one (else the bf16 matmul's)
        classes = {math_class(r.dtype) for r in rows}
        roof = peaks.for_dtype(rows[0].dtype) if len(classes) == 1 else peaks
        if xs_all and roof.bandwidth and roof.flops:
            lo = min(xs_all) / 4
            hi = max(max(xs_all) * 4, roof.flops / roof.bandwidth * 4)
            grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
            ax.plot(grid, [min(roof.flops, roof.bandwidth * x) / 1e9 for x in grid], "k-",
                    lw=1, label=f"roof: {roof.bandwidth / 1e9:.0f} GB/s, "
                               f"{roof.flops / 1e12:.0f} TFLOP/s ({roof.math})")
        elif not (roof.bandwidth and roof.flops):
            ax.text(0.02, 0.02, roof.source, transform=ax.transAxes, fontsize=8)
        if xs_all:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (FLOP / byte)")
        ax.set_ylabel("achieved GFLOP/s")
        ax.set_title(f"{op} roofline on {where}")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)

        others = names[1:]
        width = 0.8 / max(len(others), 1)
        for i, name in enumerate(others):
            vals = []
            for r in rows:
                ours, theirs = _time_of(r, "tileops"), _time_of(r, name)
                vals.append(theirs / ours if ours and theirs else float("nan"))
            # bars grow from 1 (even): up where TileOPs is faster, down where it is slower
            bars.bar([j + i * width for j in range(len(rows))], [v - 1 for v in vals], width,
                     bottom=1.0, label=name)
        bars.axhline(1.0, color="k", lw=1)
        bars.set_xticks([j + width * (len(others) - 1) / 2 for j in range(len(rows))],
                        [f"{r.workload}\n{r.dtype}" for r in rows], rotation=60, ha="right",
                        fontsize=7)
        bars.set_yscale("log")
        bars.set_ylabel("contender time / TileOPs time (above 1: TileOPs faster)")
        bars.set_title(f"{op}: speedup per workload")
        if others:
            bars.legend(fontsize=8)
    fig.savefig(path, dpi=110)
