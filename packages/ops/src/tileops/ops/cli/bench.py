"""``tileops bench OP [OP...]``: each op on its spec workloads, side by side with the
equivalents it declares, timed the same way on the same inputs.

The contenders of an op are what it declares (``contenders()``: ``"torch"``, its torch eager
equivalent, and peers such as ``"liger"`` where their library is installed and covers the op),
plus ``"torch.compile"``, which the harness derives from ``"torch"``: a fresh
``torch.compile(fn, dynamic=False)`` per workload after ``torch._dynamo.reset()``, since
recompiles of one function accumulate and a dynamic-shape kernel is not what a model with fixed
shapes gets.

Each workload is first run by :func:`~.runner.run_case` (the op built, called once and checked
against float64); then the op and every contender are timed by :func:`bench_case`:

- every callable gets its own copies of the inputs (an in-place op or contender writes them),
  is called once (its ``first_call_s``, which holds building or compiling, and its error
  against the same float64 reference), then timed by
  :func:`~.timing.device_time`: on CUDA the replay of a CUDA graph of ``--repeat`` calls,
  median of 5 (the device time; events around back-to-back calls where capture fails, with a
  note), plus :func:`~.timing.eager_time`, what an eager model sees, host launches included;
  elsewhere wall time.
- cold L2 (``--l2``): the calls rotate over input sets spanning 256 MB, so no call finds its
  operands left in L2 by the call before. ``auto`` does it for the families of
  :data:`COLD_L2_FAMILIES`: a GEMM's weight operand comes from HBM in a model (each weight is
  read once a step), while a norm's input was just written by the layer before it, so its
  benchmark, like the one it replaces, lets a tensor that fits stay in L2.

Results (:mod:`.report`): ``<name>-<device>.json``, ``.md`` and ``.png`` under ``--out``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch

from tileops.runtime import Op

from ..workloads import Case, as_outputs, clone_inputs, compare
from .core import UsageProblem, closest, did_you_mean, split_list, without_op
from .driver import Plan, case_options, env_header, prepare, run_cases, usage
from .report import (
    ContenderResult,
    contender_names,
    require_matplotlib,
    write_json,
    write_markdown,
    write_plot,
)
from .runner import Ran
from .timing import (
    MAX_GRAPH_CALLS,
    MIN_GRAPH_S,
    device_time,
    eager_time,
    input_sets,
    peaks,
    rotating,
    sync,
)

__all__ = ["ALIASES", "COLD_L2_FAMILIES", "COMPILED", "Settings", "bench", "bench_case",
           "fresh_compile"]

#: the contender the harness derives from ``"torch"``
COMPILED = "torch.compile"

#: other spellings ``--against`` accepts
ALIASES = {"eager": "torch", "compile": COMPILED}

#: op families timed with cold L2 under ``--l2 auto`` (see the module docstring)
COLD_L2_FAMILIES = frozenset({"gemm"})

#: what ``--l2`` takes
L2_POLICIES = ("auto", "cold", "warm")


@dataclass(frozen=True)
class Settings:
    """How :func:`bench_case` benchmarks: the contenders (None: every one the op declares,
    and torch.compile where it declares ``"torch"``), the L2 policy (``auto``, ``cold`` or
    ``warm``), calls per timed loop, and torch.compile's backend and mode."""

    against: tuple[str, ...] | None = None
    l2: str = "auto"
    iters: int = 20
    compile_backend: Any = "inductor"
    compile_mode: str | None = None

    def __post_init__(self) -> None:
        if self.l2 not in L2_POLICIES:
            raise ValueError(f"Settings.l2 must be one of {', '.join(L2_POLICIES)}, got "
                             f"{self.l2!r}")
        if self.iters < 1:
            raise ValueError(f"Settings.iters must be at least 1, got {self.iters!r}")


def fresh_compile(fn: Callable[..., Any], *, backend: Any = "inductor",
                  mode: str | None = None) -> Callable[..., Any]:
    """``torch.compile(fn, dynamic=False)`` after ``torch._dynamo.reset()``: a function that
    compiles anew for this workload, nothing left from the last one."""
    torch._dynamo.reset()
    options: dict[str, Any] = {"dynamic": False, "backend": backend}
    if mode is not None:
        options["mode"] = mode
    return torch.compile(fn, **options)


def cold_l2(cls: type[Op], policy: str) -> bool:
    """Whether ``cls``'s workloads rotate input sets past L2 under ``policy``."""
    if policy == "auto":
        return cls._signature.entry.family in COLD_L2_FAMILIES
    return policy == "cold"


def _first_line(op: str, exc: BaseException) -> str:
    """The type and first line of ``exc``, for a note under ``op``'s table (the op's name it
    may begin with left out: the table names the op)."""
    text = without_op(op, str(exc).strip())
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}" if text else type(exc).__name__


def _time(fn: Callable[..., Any], sets: Sequence[Sequence[Any]], device: torch.device,
          iters: int, row: ContenderResult) -> None:
    """Time ``fn`` over its own copies of ``sets`` into ``row``. Each set is called three
    times first: a compiled function's first calls on tensors it has not seen cost
    milliseconds more than the calls after them (measured on torch 2.13's CPU inductor with
    an in-place contender), which a short timed loop would otherwise count."""
    copies = [clone_inputs(s) for s in sets]
    call = rotating(copies, fn)
    with torch.no_grad():
        for _ in range(3 * len(copies)):
            call()
        sync(device)
        timing = device_time(call, device, iters=iters)
        row.eager_s = eager_time(call, device, iters=iters)
    row.time_s, row.method, row.note = timing.seconds, timing.method, timing.note


def _kernels(op: Op) -> list[str]:
    """The kernel entries the op built: each implementation's name, with its configuration's
    label where the entry has one (a tiled kernel's tile shape)."""
    out = []
    for entries in op.built_entries.values():
        for entry in entries.values():
            config = getattr(entry, "config", None)
            label = getattr(config, "label", None)
            out.append(type(entry).__name__ + (f" {label()}" if callable(label) else ""))
    return out


def bench_case(case: Case, ran: Ran, device: torch.device, settings: Settings,
               status: Callable[[str], None] | None = None) -> dict[str, ContenderResult]:
    """Time the op of ``ran`` (the run of ``case``) and its contenders on the same inputs;
    check each contender against the same float64 reference. The op's timing goes into
    ``ran.result`` (``time_s``, and ``extra["timing"]`` as a :class:`ContenderResult`); the
    contenders' results are returned by name."""
    say = status or (lambda _msg: None)
    res, op = ran.result, ran.op
    if op is None:
        return {n: ContenderResult(error="the op could not be built")
                for n in settings.against or ()}
    cold = cold_l2(type(op), settings.l2)
    sets = input_sets(case, device, ran.inputs) if cold else [ran.inputs]
    res.extra.update(l2="cold" if cold else "warm", sets=len(sets), kernels=_kernels(op))
    if res.error is None:
        say("tileops: timing")
        ours = ContenderResult(first_call_s=res.first_call_s, rel_err=res.rel_err)
        try:
            _time(op, sets, device, settings.iters, ours)
        except Exception as exc:  # noqa: BLE001 - the row reports it
            res.error = f"timing: {_first_line(res.op, exc)}"
        res.time_s = ours.time_s
        res.extra["timing"] = ours
    declared = op.contenders()
    names = list(settings.against) if settings.against is not None else [
        *declared, *([COMPILED] if "torch" in declared else [])]
    out: dict[str, ContenderResult] = {}
    for name in names:
        row = out[name] = ContenderResult()
        if name == COMPILED:
            if "torch" not in declared:
                row.error = f"{res.op} declares no torch equivalent to compile"
                continue
            fn = fresh_compile(declared["torch"], backend=settings.compile_backend,
                               mode=settings.compile_mode)
        elif name in declared:
            fn = declared[name]
        else:
            row.error = (f"{res.op} has no contender {name!r} here (it declares "
                         f"{', '.join(declared) or 'none'})")
            continue
        try:
            say(f"{name}: first call" + (" (compiling)" if name == COMPILED else ""))
            args = clone_inputs(ran.inputs)
            t0 = time.perf_counter()
            with torch.no_grad():
                first = as_outputs(fn(*args))
            sync(device)
            row.first_call_s = time.perf_counter() - t0
            if ran.refs is not None:
                row.rel_err = compare(first, ran.refs)
            say(f"{name}: timing")
            _time(fn, sets, device, settings.iters, row)
        except Exception as exc:  # noqa: BLE001 - reported in the results
            row.error = _first_line(res.op, exc)
    return out


def resolve_against(text: str | None, plan: Plan) -> tuple[str, ...] | None:
    """The contenders ``--against`` names (None: all), canonical and checked: a name must
    be ``torch``, ``torch.compile``, an alias, or declared by one of the ops here."""
    if text is None or text.strip().lower() == "all":
        return None
    known = {"torch", COMPILED}
    for _name, cls, cs in plan.ops:
        try:
            known.update(cls(**cs[0].params).contenders())
        except Exception:  # noqa: BLE001 - an op that cannot be built fails its own rows
            continue
    out: list[str] = []
    for name in split_list([text]):
        found = ALIASES.get(name.lower(), name)
        if found not in known:
            valid = ", ".join(sorted(known))
            aliases = ", ".join(f"{a} ({b})" for a, b in ALIASES.items())
            raise UsageProblem(f"unknown contender {name!r}; valid here: {valid}; aliases: "
                               f"{aliases}"
                               f"{did_you_mean(closest(name, [*sorted(known), *ALIASES]))}")
        if found not in out:
            out.append(found)
    return tuple(out)


@click.command()
@click.argument("ops", nargs=-1, required=True, metavar="OP [OP]...")
@click.option("--against", default=None, metavar="NAMES",
              help="contenders, comma-separated (default: all the op declares, and "
                   "torch.compile): torch (or eager), torch.compile (or compile), liger, ...")
@click.option("--device", default=None,
              help="cuda (the default) or a cuda:N; cpu runs the same comparison on the CPU")
@case_options
@click.option("--l2", type=click.Choice(L2_POLICIES), default="auto",
              show_default=True,
              help="rotate inputs past L2 (cold), reuse one set (warm), or by family (auto: "
                   "cold for GEMM)")
@click.option("--compile-mode", default=None, metavar="MODE",
              help="torch.compile mode of the torch.compile contender (default: torch's "
                   "default; e.g. max-autotune-no-cudagraphs)")
@click.option("--tune", is_flag=True, help="construct the ops with tune=True")
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("tileops-bench"), show_default=True,
              help="directory for <name>-<device>.json, .md and .png")
@click.option("--name", default=None,
              help="file name stem (default: the op's name, or 'bench' for several ops)")
@click.option("--no-plot", is_flag=True, help="write no PNG (needs no matplotlib)")
@usage
def bench(ops: tuple[str, ...], against: str | None, device: str | None,
          dtypes: tuple[str, ...], workloads: tuple[str, ...], max_elements: int | None,
          repeat: int, target: str | None, l2: str, compile_mode: str | None, tune: bool,
          out_dir: Path, name: str | None, no_plot: bool) -> None:
    """Benchmark OPs on their spec workloads against their contenders.

    Each OP runs every workload of its spec (or those -w and --dtype select), checked
    against float64, side by side with the equivalents it declares (torch eager, peers such
    as Liger where installed) and torch.compile of its torch equivalent, a fresh one per
    workload. On CUDA (the default; without a GPU pass --device cpu) device time comes from
    CUDA graph replays. Writes JSON, a Markdown table and a PNG plot, and prints the table;
    exits 1 if an op fails a workload.
    """
    if device is None:
        if not torch.cuda.is_available():
            raise click.ClickException(
                "tileops bench compares ops with their contenders on a CUDA GPU, and this "
                "machine has none (torch.cuda.is_available() is False). Pass --device cpu to "
                "run the comparison on the CPU (the reference target against the contenders).")
        device = "cuda"
    plan = prepare(ops, device, dtypes, workloads, max_elements, target)
    settings = Settings(resolve_against(against, plan), l2, repeat, compile_mode=compile_mode)
    # the arguments first (their errors are the caller's to fix before anything else), then
    # the plot's dependency, before any case runs
    if not no_plot:
        problem = require_matplotlib()
        if problem is not None:
            raise click.ClickException(problem)
    dev = plan.device
    p = peaks(dev)

    def per_case(case: Case, ran: Ran, status: Callable[[str], None]) -> None:
        ran.result.extra["contenders"] = bench_case(case, ran, dev, settings, status)

    results = run_cases(plan, repeat, 0.25, timed=False, tune=tune, per_case=per_case)
    names = [n for n, _, _ in plan.ops]
    header = {**env_header(dev, p, plan.max_elements, (r.dtype for r in results)), "ops": names,
              "against": contender_names(results),
              "timing": _timing_header(dev, settings, plan), "tuned": tune}
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{name or (names[0] if len(names) == 1 else 'bench')}-{str(dev).replace(':', '')}"
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    write_json(paths[0], header, results, p)
    write_markdown(paths[1], header, results, p)
    if not no_plot:
        paths.append(out_dir / f"{stem}.png")
        write_plot(paths[2], header, results, p)
    click.echo(paths[1].read_text(), nl=False)
    click.echo("wrote " + ", ".join(str(x) for x in paths))
    if any(not r.ok for r in results):
        sys.exit(1)


def _timing_header(dev: torch.device, settings: Settings, plan: Plan) -> dict[str, Any]:
    if dev.type == "cuda":
        method = (f"CUDA graph replay of {settings.iters} calls (of as many as fill "
                  f"{MIN_GRAPH_S * 1e6:.0f} us, up to {MAX_GRAPH_CALLS}, where those take less), "
                  f"median of 5 (device time); "
                  f"eager: CUDA events around {settings.iters} back-to-back calls")
    else:
        method = f"wall clock, the fastest of up to {settings.iters} calls"
    return {"method": method, "iters": settings.iters,
            "l2": {n: "cold" if cold_l2(cls, settings.l2) else "warm" for n, cls, _ in plan.ops},
            "compile": {"dynamic": False, "mode": settings.compile_mode,
                        "fresh_per_workload": True}}
