"""What ``tileops run`` and ``tileops bench`` share: their case options, the plan of cases they
resolve from them, running every case behind a progress line, and the header of their results
(where, when and with what it ran).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import os
import platform
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import click
import torch
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from tileops.runtime import Op, targets

from ..workloads import Case, cases, entry_dtypes
from .core import (
    UsageProblem,
    default_device,
    parse_device,
    parse_dtype,
    parse_target,
    resolve_ops,
    serving_problem,
    split_list,
    version,
)
from .formatting import console
from .runner import CaseResult, Ran, run_case
from .timing import Peaks, measured_flops

__all__ = ["CPU_MAX_ELEMENTS", "Plan", "case_options", "env_header", "prepare", "run_cases",
           "usage"]

#: the default ``--max-elements`` on the CPU: what a small CI machine runs in seconds
CPU_MAX_ELEMENTS = 1 << 20

#: the libraries whose versions head a result, by distribution name (None: not installed)
VERSIONED = ("tilelang", "triton", "liger-kernel")


def usage(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn :class:`UsageProblem` into click's usage error (exit status 2)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UsageProblem as exc:
            raise click.UsageError(str(exc)) from None

    return wrapper


def case_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--dtype``, ``-w/--workload``, ``--max-elements``, ``--repeat`` and ``--target``."""
    fn = click.option("--dtype", "dtypes", multiple=True, metavar="T",
                      help="run every workload in dtype T instead of its own dtype cases "
                           "(repeatable or comma-separated; bf16, fp16, fp32 accepted)")(fn)
    fn = click.option("-w", "--workload", "workloads", multiple=True, metavar="LABEL",
                      help="only workloads whose label matches (shell pattern; repeatable)")(fn)
    fn = click.option("--max-elements", type=click.IntRange(min=0), default=None,
                      help="scale workloads down (rows first) so no input or output holds "
                           "more elements than this (default: 2^20 on cpu, no cap on cuda; "
                           "0: no cap)")(fn)
    fn = click.option("--repeat", type=click.IntRange(min=1), default=20, show_default=True,
                      help="timed calls per case at most")(fn)
    fn = click.option("--target", default=None,
                      help="serve every op from this target (tileops, reference, ...) instead "
                           "of the best one available; an op it cannot serve on the device is "
                           "refused if named, else left out")(fn)
    return fn


@dataclass
class Plan:
    """The resolved cases of a run: each op with its cases, on one device and target;
    ``max_elements`` is the scaling cap in force (0: none); ``left_out`` says why each op
    of an unnamed run (every shipped op) is not in it."""

    ops: list[tuple[str, type[Op], list[Case]]]
    device: torch.device
    target: str | None
    max_elements: int
    left_out: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(len(cs) for _, _, cs in self.ops)


def prepare(names: Sequence[str], device: str | None, dtypes: Sequence[str],
            workloads: Sequence[str], max_elements: int | None, target: str | None) -> Plan:
    """Resolve ops, device, dtypes and target, and build every case.

    An op named that takes none of the dtypes, or that the ``--target`` given cannot serve on
    the device (in-tree kernels on a machine without CUDA, say), is bad usage, refused before
    any case runs: running each case to fail it tells the caller the same thing once a case.
    Left unnamed (every shipped op), such an op is left out and ``left_out`` says why; when
    that leaves nothing, the run is refused with every reason."""
    ops = resolve_ops(names)
    dev = parse_device(device or default_device())
    accepted_any: dict[str, None] = {}
    for _name, cls in ops:
        accepted_any.update(dict.fromkeys(entry_dtypes(cls._signature.entry,
                                                       cls._signature.adts)))
    dts = [parse_dtype(d, list(accepted_any)) for d in split_list(dtypes)]
    if dtypes and not dts:  # --dtype ',' or --dtype '': not "every workload's own dtypes"
        raise UsageProblem(f"--dtype {' '.join(repr(d) for d in dtypes)} names no dtype; "
                           f"give one or more, comma-separated (bf16, fp16, fp32, ...), or "
                           f"leave --dtype out for each workload's own dtype cases")
    tgt = parse_target(target)
    if max_elements is None:
        max_elements = CPU_MAX_ELEMENTS if dev.type == "cpu" else 0
    planned = []
    left_out: dict[str, str] = {}
    unserved: dict[str, list[str]] = {}  # why the target cannot serve -> the ops
    for name, cls in ops:
        plan_entry = cls._signature
        adts = plan_entry.adts
        why = serving_problem(cls, tgt, dev) if tgt is not None else None
        if why is not None:
            if names:
                raise UsageProblem(f"--target {tgt} cannot serve {name} on {dev}: {why}"
                                   f"{_others(cls, tgt, dev)}")
            unserved.setdefault(why, []).append(name)
            left_out[name] = f"--target {tgt} cannot serve it on {dev}: {why}"
            continue
        if dts:
            accepted = entry_dtypes(plan_entry.entry, adts)
            if not any(d in accepted for d in dts):
                if names:
                    raise UsageProblem(f"{name} accepts no {', '.join(dts)}; its dtypes: "
                                       f"{', '.join(accepted)}")
                left_out[name] = f"it accepts no {', '.join(dts)}"
                continue
        cs = cases(name, plan_entry.entry, adts, dtypes=dts or None, labels=workloads or None,
                   max_elements=max_elements or None)
        if cs:
            planned.append((name, cls, cs))
    if not planned:
        if sum(map(len, unserved.values())) == len(ops):
            raise UsageProblem(f"--target {tgt} cannot serve any op on {dev}: " + "; ".join(
                f"{_some(ns)}: {why}" for why, ns in unserved.items()))
        if workloads:
            labels = sorted({w.label for _, c in ops for w in c._signature.entry.workloads})
            raise UsageProblem(f"no workload matches {', '.join(workloads)}; labels: "
                               f"{', '.join(labels)}")
        if dts:
            raise UsageProblem(f"no op takes {', '.join(dts)}")
        raise UsageProblem("nothing to run: no implemented op has a workload")
    return Plan(planned, dev, tgt, max_elements, left_out)


def _others(cls: type[Op], target: str, device: torch.device) -> str:
    """``"; targets that can: reference"`` (empty when none can)."""
    can = [t for t in (targets.IN_TREE, *targets.targets())
           if t != target and serving_problem(cls, t, device) is None]
    return f"; targets that can: {', '.join(can)}" if can else ""


def _progress() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=console(stderr=True),
                    transient=True)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send what the run prints to stdout (kernel compilers log there) to stderr, so that
    stdout holds only the table or the JSON document: at the Python level and, where stdout
    is the process's file descriptor 1, at the descriptor level too."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        fd = None
    if fd != 1:
        with contextlib.redirect_stdout(sys.stderr):
            yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(sys.stderr.fileno(), 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_cases(plan: Plan, repeat: int, budget_s: float, *, timed: bool = True,
              tune: bool = False,
              per_case: Callable[[Case, Ran, Callable[[str], None]], None] | None = None,
              ) -> list[CaseResult]:
    """Run every case of ``plan`` (:func:`~.runner.run_case`) behind a progress line on
    stderr, with stdout sent there too; ``per_case(case, ran, status)`` runs after each. Only
    the results are kept: a case's inputs and float64 reference are let go before the next
    case is built (kept, the large workloads of a whole run would not fit in GPU memory)."""
    with stdout_to_stderr():
        out = []
        err = sys.stderr
        plain = not (hasattr(err, "isatty") and err.isatty())
        for name, why in plan.left_out.items():
            click.echo(f"left out {name}: {why}", err=True)
        with _progress() as progress:
            task = progress.add_task("starting", total=plan.total)
            for name, cls, cs in plan.ops:
                if plain:
                    click.echo(f"{name}: {len(cs)} case{'s' if len(cs) != 1 else ''} on "
                               f"{plan.device}", err=True)
                for case in cs:
                    head = f"{name} {case.label} {case.dtype}"

                    def status(msg: str, head: str = head) -> None:
                        progress.update(task, description=f"{head}: {msg}")

                    ran = run_case(cls, case, plan.device, target=plan.target, repeat=repeat,
                                   budget_s=budget_s, timed=timed, tune=tune, status=status)
                    if per_case is not None:
                        per_case(case, ran, status)
                    out.append(ran.result)
                    del ran
                    progress.advance(task)
    return out


def env_header(dev: torch.device, peaks: Peaks, max_elements: int,
               dtypes: Iterable[str] = ()) -> dict[str, Any]:
    """Where, when and with what a run ran: versions (``versions`` holds the libraries of
    :data:`VERSIONED` that are installed), the device and GPU, the roofline peaks (the matmul
    peak of each math class the results' ``dtypes`` are judged by), the cap."""
    for d in dtypes:
        peaks.for_dtype(d)
    info: dict[str, Any] = {
        "tileops": version("tileops-ops", "tileops.ops") or "not installed",
        "torch": torch.__version__,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "cuda": torch.version.cuda,
                     **{d: v for d in VERSIONED if (v := version(d)) is not None}},
        "device": str(dev),
        "peaks": {"bandwidth_Bps": peaks.bandwidth, "flops": peaks.flops,
                  "source": peaks.source, "flops_by_math": measured_flops(dev)},
        "max_elements": max_elements or None,
        "when": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        cap = torch.cuda.get_device_capability(dev)
        info["arch"] = f"sm_{cap[0]}{cap[1]}"
    return info


def _some(names: list[str], shown: int = 6) -> str:
    """``names`` joined, the first ``shown`` of a longer list and how many more."""
    if len(names) <= shown:
        return ", ".join(names)
    return f"{', '.join(names[:shown])} and {len(names) - shown} more"
