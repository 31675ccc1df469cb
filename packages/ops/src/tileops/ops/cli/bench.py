"""``tileops bench``: one op side by side with torch eager and torch.compile.

Every contender runs the same inputs (fresh copies, so in-place ops start from the same
values). The first call of each is timed apart (it builds or compiles); the rest are timed
as in ``tileops run``. A fresh ``torch.compile`` function is compiled per workload
(``dynamic=False``, after ``torch._dynamo.reset()``), since recompiles of one function
accumulate. Results: JSON, a Markdown table and a PNG roofline plot.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
import torch

from ..workloads import as_outputs, clone_inputs, compare
from .core import UsageProblem, closest, did_you_mean, split_list
from .declared import contenders as declared_contenders
from .driver import case_options, env_header, prepare, run_cases, usage
from .report import write_json, write_markdown, write_plot
from .runner import Ran
from .timing import peaks, sync, time_call

__all__ = ["CONTENDERS", "bench", "bench_contenders"]

#: contender names accepted by ``--against`` (``torch`` is eager)
CONTENDERS = {"eager": "eager", "torch": "eager", "compile": "compile"}


def bench_contenders(ran: Ran, against: Sequence[str], device: torch.device, *,
                     repeat: int, budget_s: float,
                     status: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Time each contender on the case ``ran`` ran; check it against the same reference."""
    say = status or (lambda _m: None)
    out: dict[str, dict[str, Any]] = {}
    res, op = ran.result, ran.op
    eager = declared_contenders(op).get("torch") if op is not None else None
    for name in against:
        row: dict[str, Any] = {"time_s": None, "first_call_s": None, "rel_err": None,
                               "error": None}
        out[name] = row
        if op is None:
            row["error"] = "the op could not be built"
            continue
        if eager is None:
            row["error"] = f"no torch eager equivalent of {res.op} is known"
            continue
        fn = eager
        if name == "compile":
            torch._dynamo.reset()
            fn = torch.compile(fn, dynamic=False)
        try:
            say(f"{name}: first call" + (" (compiling)" if name == "compile" else ""))
            args = clone_inputs(ran.inputs)
            t0 = time.perf_counter()
            with torch.no_grad():
                first = as_outputs(fn(*args))
            sync(device)
            row["first_call_s"] = time.perf_counter() - t0
            if ran.refs is not None:
                row["rel_err"] = compare(first, ran.refs)
            say(f"{name}: timing")
            args = clone_inputs(ran.inputs)
            with torch.no_grad():
                row["time_s"] = time_call(lambda f=fn, a=args: f(*a), device, repeat=repeat,
                                          budget_s=budget_s)
        except Exception as exc:  # noqa: BLE001 - reported in the results
            row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    return out


@click.command()
@click.argument("op", metavar="OP")
@click.option("--against", default="eager,compile", show_default=True,
              help="contenders, comma-separated: eager (or torch), compile")
@click.option("--device", default=None,
              help="cuda (the default) or a cuda:N; cpu runs the same comparison on the CPU")
@case_options
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("tileops-bench"), show_default=True,
              help="directory for <OP>-<device>.json, .md and .png")
@usage
def bench(op: str, against: str, device: str | None, dtypes: tuple[str, ...],
          workloads: tuple[str, ...], max_elements: int | None, repeat: int,
          target: str | None, out_dir: Path) -> None:
    """Benchmark OP against torch eager and torch.compile.

    On a CUDA GPU by default; on a machine without one it stops unless --device cpu is given
    (then the reference target runs against eager and compile on the CPU). Writes JSON, a
    Markdown table and a PNG roofline plot, and prints the table.
    """
    if device is None:
        if not torch.cuda.is_available():
            raise click.ClickException(
                "tileops bench compares ops with torch eager and torch.compile on a CUDA GPU, "
                "and this machine has none (torch.cuda.is_available() is False). Pass "
                "--device cpu to run the comparison on the CPU (the reference target against "
                "eager and compile).")
        device = "cuda"
    contenders = []
    for name in split_list([against]):
        found = CONTENDERS.get(name.lower())
        if found is None:
            raise UsageProblem(f"unknown contender {name!r}; valid: {', '.join(CONTENDERS)}"
                               f"{did_you_mean(closest(name, CONTENDERS))}")
        if found not in contenders:
            contenders.append(found)
    plan = prepare([op], device, dtypes, workloads, max_elements, target)
    dev, cap = plan.device, plan.max_elements
    p = peaks(dev)

    def per_case(ran, status):
        ran.result.extra["contenders"] = bench_contenders(
            ran, contenders, dev, repeat=repeat, budget_s=0.25, status=status)

    runs = run_cases(plan, repeat, 0.25, per_case=per_case)
    results = [r.result for r in runs]
    header = {**env_header(dev, p, cap), "op": plan.ops[0][0], "against": contenders}
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{plan.ops[0][0]}-{str(dev).replace(':', '')}"
    paths = [out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")]
    write_json(paths[0], header, results, p)
    write_markdown(paths[1], header, results, contenders)
    write_plot(paths[2], header, results, contenders, p)
    click.echo(paths[1].read_text(), nl=False)
    click.echo("wrote " + ", ".join(str(x) for x in paths))
    if any(not r.ok for r in results):
        sys.exit(1)
