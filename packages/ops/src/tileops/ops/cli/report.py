"""What ``tileops bench`` writes: JSON, a Markdown table and a PNG roofline plot."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .formatting import fmt_err, fmt_inputs, fmt_time
from .timing import Peaks

__all__ = ["write_json", "write_markdown", "write_plot"]


def _gbps(nbytes: int | None, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if nbytes is not None and seconds else None


def rows_for_json(results: list, peaks: Peaks) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        d = r.as_dict(peaks)
        contenders = r.extra.get("contenders", {})
        d["contenders"] = {}
        for name, c in contenders.items():
            c = dict(c)
            c["gbps"] = _gbps(r.bytes, c["time_s"])
            if c["rel_err"] is not None and not math.isfinite(c["rel_err"]):
                c["rel_err"] = str(c["rel_err"])
            d["contenders"][name] = c
        rows.append(d)
    return rows


def write_json(path: Path, header: dict[str, Any], results: list, peaks: Peaks) -> None:
    doc = {**header, "results": rows_for_json(results, peaks)}
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _speedup(r, contenders: Sequence[str]) -> str:
    peers = [c["time_s"] for n, c in r.extra.get("contenders", {}).items()
             if n in contenders and c["time_s"]]
    if not r.time_s or not peers:
        return "-"
    return f"{min(peers) / r.time_s:.2f}×"


def markdown(header: dict[str, Any], results: list, contenders: Sequence[str]) -> str:
    """The results as a Markdown table (times per call; GB/s of the op's roofline bytes)."""
    target = next((r.target for r in results if r.target), None)
    ours = "tileops" if target in (None, "tileops") else f"tileops ({target})"
    cols = ["workload", "dtype", "inputs", ours, "GB/s"]
    for c in contenders:
        cols += [c, "GB/s"]
    cols += ["speedup vs best other", "rel err (tileops" + "".join(f" / {c}" for c in contenders)
             + ")"]
    lines = [f"# {header['op']} on {header['device']}", "",
             f"{header['when']}; torch {header['torch']}; "
             f"{header['peaks']['source']}.", "",
             "| " + " | ".join(cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for r in results:
        cells = [r.workload, r.dtype, fmt_inputs(r.inputs, bool(r.scaled)), fmt_time(r.time_s),
                 _fmt_gbps(_gbps(r.bytes, r.time_s))]
        errs = [fmt_err(r.rel_err)]
        for c in contenders:
            row = r.extra.get("contenders", {}).get(c, {})
            if row.get("error"):
                cells += ["error", "-"]
            else:
                cells += [fmt_time(row.get("time_s")), _fmt_gbps(_gbps(r.bytes, row.get("time_s")))]
            errs.append(fmt_err(row.get("rel_err")))
        cells += [_speedup(r, contenders), " / ".join(errs)]
        if r.error:
            cells[3] = "error"
        lines.append("| " + " | ".join(cells) + " |")
    notes = [f"- {r.workload} {r.dtype}: {r.error}" for r in results if r.error]
    for r in results:
        for c, row in r.extra.get("contenders", {}).items():
            if row.get("error"):
                notes.append(f"- {r.workload} {r.dtype} {c}: {row['error']}")
    if any(r.scaled for r in results):
        notes.append(f"- `*`: scaled down to at most {header['max_elements']} elements per "
                     f"input or output (`--max-elements`)")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def _fmt_gbps(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def write_markdown(path: Path, header: dict[str, Any], results: list,
                   contenders: Sequence[str]) -> None:
    path.write_text(markdown(header, results, contenders))


def write_plot(path: Path, header: dict[str, Any], results: list, contenders: Sequence[str],
               peaks: Peaks) -> None:
    """Left: the roofline (arithmetic intensity against achieved FLOP/s, with the measured
    bandwidth and matmul roofs where the device has them). Right: achieved GB/s per workload."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 5.5), layout="constrained")
    ax, bars = fig.subplots(1, 2, width_ratios=[1, 1.4])
    names = ["tileops", *contenders]
    markers = {"tileops": "o", "eager": "s", "compile": "^"}
    xs_all: list[float] = []
    for name in names:
        xs, ys = [], []
        for r in results:
            t = r.time_s if name == "tileops" else \
                r.extra.get("contenders", {}).get(name, {}).get("time_s")
            if not t or not r.flops or not r.bytes:
                continue
            xs.append(r.flops / r.bytes)
            ys.append(r.flops / t / 1e9)
        xs_all += xs
        if xs:
            ax.scatter(xs, ys, marker=markers.get(name, "x"), label=name, alpha=0.75)
    if xs_all and peaks.bandwidth and peaks.flops:
        lo, hi = min(xs_all) / 4, max(max(xs_all) * 4, peaks.flops / peaks.bandwidth * 4)
        grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(grid, [min(peaks.flops, peaks.bandwidth * x) / 1e9 for x in grid], "k-",
                lw=1, label=f"roof: {peaks.bandwidth / 1e9:.0f} GB/s, "
                           f"{peaks.flops / 1e12:.0f} TFLOP/s")
    elif not (peaks.bandwidth and peaks.flops):
        ax.text(0.02, 0.02, peaks.source, transform=ax.transAxes, fontsize=8)
    if xs_all:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(f"{header['op']} roofline on {header['device']}")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)

    labels = [f"{r.workload}\n{r.dtype}" for r in results]
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        vals = []
        for r in results:
            t = r.time_s if name == "tileops" else \
                r.extra.get("contenders", {}).get(name, {}).get("time_s")
            vals.append(_gbps(r.bytes, t) or 0.0)
        bars.bar([j + i * width for j in range(len(results))], vals, width, label=name)
    bars.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(results))], labels,
                    rotation=60, ha="right", fontsize=7)
    shown = [v for r in results for v in [_gbps(r.bytes, r.time_s)] if v]
    if shown and max(shown) / min(shown) > 100:
        bars.set_yscale("log")
    bars.set_ylabel("achieved GB/s (roofline bytes / time)")
    bars.set_title("per workload")
    bars.legend(fontsize=8)
    fig.savefig(path, dpi=110)
