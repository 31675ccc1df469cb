"""``tileops run``: ops on their spec workloads, checked against float64 and timed."""

from __future__ import annotations

import json
import sys

import click
import torch
from rich import box
from rich.table import Table

from .driver import case_options, env_header, prepare, run_cases, usage
from .formatting import console, fmt_err, fmt_frac, fmt_inputs, fmt_rate, fmt_time
from .runner import CaseResult
from .timing import Peaks, peaks

__all__ = ["print_run_table", "run"]


@click.command()
@click.argument("ops", nargs=-1, metavar="[OP]...")
@click.option("--device", default=None,
              help="device to run on (default: cuda when available, else cpu)")
@case_options
@click.option("--json", "as_json", is_flag=True, help="print the results as JSON")
@usage
def run(ops: tuple[str, ...], device: str | None, dtypes: tuple[str, ...],
        workloads: tuple[str, ...], max_elements: int | None, repeat: int,
        target: str | None, as_json: bool) -> None:
    """Run ops on their spec workloads, check them and time them.

    Every implemented op (or the OPs named) runs each workload of its spec on the best target
    available (the in-tree TileLang kernels on CUDA, else the reference target), is checked
    against a float64 reference (relative L2 error within 1e-2 for bfloat16, 2e-3 for
    float16, 1e-5 for float32) and timed. Prints op, workload, target, error, time, the
    achieved GB/s or TFLOP/s (of the op's roofline bytes and flops) and the fraction of the
    device's roofline. Exits 1 on any mismatch or failure.
    """
    plan = prepare(ops, device, dtypes, workloads, max_elements, target)
    dev, cap = plan.device, plan.max_elements
    p = peaks(dev)
    results = run_cases(plan, repeat, 0.25)
    failed = [r for r in results if not r.ok]
    if as_json:
        doc = {**env_header(dev, p, cap, (r.dtype for r in results)), "ok": not failed,
               "results": [r.as_dict(p) for r in results]}
        click.echo(json.dumps(doc, indent=2))
    else:
        print_run_table(results, dev, p, cap)
    if failed:
        sys.exit(1)


def print_run_table(results: list[CaseResult], dev: torch.device, p: Peaks, cap: int) -> None:
    """The table of ``tileops run`` and its notes (scaling, targets, roofline, totals)."""
    con = console()
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col, just in [("op", "left"), ("workload", "left"), ("dtype", "left"),
                      ("inputs", "right"), ("target", "left"), ("rel err", "right"),
                      ("check", "left"), ("time", "right"), ("achieved", "right"),
                      ("roofline", "right")]:
        table.add_column(col, justify=just, no_wrap=True)
    for r in results:
        if r.error:
            check = "[red]error[/red]"
        elif not r.checked:
            check = "-"
        else:
            check = "ok" if r.ok else "[red]MISMATCH[/red]"
        target = (r.target or "-") + ("†" if r.note else "")
        mb = r.flops is not None and p.for_dtype(r.dtype).memory_bound(r.flops, r.bytes or 0)
        table.add_row(r.op, r.workload, r.dtype, fmt_inputs(r.inputs, bool(r.scaled)), target,
                      fmt_err(r.rel_err), check, fmt_time(r.time_s),
                      fmt_rate(r.flops, r.bytes, r.time_s, mb), fmt_frac(r.roof_fraction(p)))
    con.print(table)
    notes = []
    if any(r.scaled for r in results):
        notes.append(f"* scaled down, rows first, toward at most {cap} elements in any input "
                     f"or output (--max-elements; sizes the workload's rules need are kept; 0 "
                     f"runs the full sizes)")
    seen: dict[str, int] = {}
    for r in results:
        if r.note:
            seen[r.note] = seen.get(r.note, 0) + 1
            if seen[r.note] == 1 and len(seen) <= 5:
                notes.append(f"† {r.op} {r.workload} {r.dtype}: {r.note}")
    repeats = sum(seen.values()) - min(len(seen), 5)
    if repeats:
        notes.append(f"† ... and {repeats} more (--json has every note)")
    if p.bandwidth is None:
        notes.append(f"roofline: - ({p.source})")
    else:
        notes.append(f"roofline: {p.bandwidth / 1e9:.0f} GB/s, {p.flops / 1e12:.0f} TFLOP/s "
                     f"({p.source})")
    ok = sum(r.ok for r in results)
    checked = sum(r.checked for r in results)
    bad = [r for r in results if not r.ok]
    notes.append(f"{len(results)} cases on {dev}: {ok} ok, {len(bad)} failed "
                 f"({checked} checked against float64)")
    for r in bad:
        why = r.error or f"relative L2 error {fmt_err(r.rel_err)} > {r.tol:g}"
        notes.append(f"FAILED {r.op} {r.workload} {r.dtype}: {why}")
    for n in notes:
        con.print(n, markup=False)
