"""The ``tileops`` command: run, benchmark and inspect the operators.

    tileops run [OP...]            every implemented op on its spec workloads, checked against
                                   float64, with times and the roofline
    tileops bench OP               side by side with torch eager and torch.compile
    tileops list                   ops, families, status, dtypes, the targets that serve them
    tileops explain OP [--code]    the signature, type families, effects, roofline (and the
                                   generated check code)
    tileops check [PATH...]        validate specs (file:line errors)
    tileops scaffold OP            write the op module skeleton for a spec entry
    tileops env                    versions, GPUs, the cache directory, environment knobs
    tileops cache clear            empty the cache directory

Also ``python -m tileops.ops.cli``. Exit status: 0 success, 1 a failed check (a mismatch, an
invalid spec, an op that failed), 2 bad usage (an unknown op, device, dtype or option).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import click

from .cli_core import UsageProblem

__all__ = ["main"]

_CPU_MAX_ELEMENTS = 1 << 20


def _usage(fn):
    """Turn :class:`UsageProblem` into click's usage error (exit status 2)."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UsageProblem as exc:
            raise click.UsageError(str(exc)) from None

    return wrapper


def _split(values: Iterable[str]) -> list[str]:
    """``("a,b", "c")`` -> ``["a", "b", "c"]``."""
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tileops-ops", prog_name="tileops",
                      message="%(prog)s %(version)s")
def main() -> None:
    """TileOPs: spec-driven GPU operators for PyTorch.

    `tileops run` runs every implemented op on its spec workloads (on the CPU through the
    reference target when there is no GPU) and checks each against float64.
    """


# --- run --------------------------------------------------------------------------------------

_DEVICE_HELP = "device to run on (default: cuda when available, else cpu)"


def _common_case_options(fn):
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
                           "of the best one available")(fn)
    return fn


def _prepare(names: Sequence[str], device: str | None, dtypes: Sequence[str],
             workloads: Sequence[str], max_elements: int | None, target: str | None):
    """Resolve ops, device, dtypes and target, and build every case."""
    from .cli_core import (
        default_device,
        parse_device,
        parse_dtype,
        parse_target,
        resolve_ops,
    )
    from .workloads import cases, entry_dtypes

    ops = resolve_ops(names)
    dev = parse_device(device or default_device())
    dts = [parse_dtype(d) for d in _split(dtypes)]
    tgt = parse_target(target)
    if max_elements is None:
        max_elements = _CPU_MAX_ELEMENTS if dev.type == "cpu" else 0
    plan = []
    for name, cls in ops:
        plan_entry = cls._signature
        adts = plan_entry.adts
        if dts:
            accepted = entry_dtypes(plan_entry.entry, adts)
            if not any(d in accepted for d in dts):
                if names:
                    raise UsageProblem(f"{name} accepts no {', '.join(dts)}; its dtypes: "
                                       f"{', '.join(accepted)}")
                continue
        cs = cases(name, plan_entry.entry, adts, dtypes=dts or None, labels=workloads or None,
                   max_elements=max_elements or None)
        if cs:
            plan.append((name, cls, cs))
    if not plan:
        if workloads:
            labels = sorted({w.label for _, c in ops for w in c._signature.entry.workloads})
            raise UsageProblem(f"no workload matches {', '.join(workloads)}; labels: "
                               f"{', '.join(labels)}")
        if dts:
            raise UsageProblem(f"no op takes {', '.join(dts)}")
        raise UsageProblem("nothing to run: no implemented op has a workload")
    return plan, dev, tgt, max_elements


def _progress(total: int):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    from .cli_format import console

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=console(stderr=True),
                    transient=True)


@contextlib.contextmanager
def _stdout_to_stderr():
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


def _run_cases(plan, dev, tgt, repeat: int, budget_s: float, per_case=None):
    """Run every case with a progress line; ``per_case(ran, status)`` runs after each."""
    with _stdout_to_stderr():
        return _run_cases_quietly(plan, dev, tgt, repeat, budget_s, per_case)


def _run_cases_quietly(plan, dev, tgt, repeat: int, budget_s: float, per_case=None):
    from .cli_core import run_case

    total = sum(len(cs) for _, _, cs in plan)
    out = []
    err = sys.stderr
    plain = not (hasattr(err, "isatty") and err.isatty())
    with _progress(total) as progress:
        task = progress.add_task("starting", total=total)
        for name, cls, cs in plan:
            if plain:
                click.echo(f"{name}: {len(cs)} case{'s' if len(cs) != 1 else ''} on {dev}",
                           err=True)
            for case in cs:
                head = f"{name} {case.label} {case.dtype}"

                def status(msg: str, head: str = head) -> None:
                    progress.update(task, description=f"{head}: {msg}")

                ran = run_case(cls, case, dev, target=tgt, repeat=repeat, budget_s=budget_s,
                               status=status)
                if per_case is not None:
                    per_case(ran, status)
                out.append(ran)
                progress.advance(task)
    return out


def _env_header(dev, peaks, max_elements: int) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "tileops": _version("tileops-ops", "tileops.ops"),
        "torch": torch.__version__,
        "device": str(dev),
        "peaks": {"bandwidth_Bps": peaks.bandwidth, "flops": peaks.flops,
                  "source": peaks.source},
        "max_elements": max_elements or None,
        "when": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        cap = torch.cuda.get_device_capability(dev)
        info["arch"] = f"sm_{cap[0]}{cap[1]}"
    return info


@main.command()
@click.argument("ops", nargs=-1, metavar="[OP]...")
@click.option("--device", default=None, help=_DEVICE_HELP)
@_common_case_options
@click.option("--json", "as_json", is_flag=True, help="print the results as JSON")
@_usage
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
    from .cli_core import peaks as measure_peaks

    plan, dev, tgt, cap = _prepare(ops, device, dtypes, workloads, max_elements, target)
    p = measure_peaks(dev)
    runs = _run_cases(plan, dev, tgt, repeat, 0.25)
    results = [r.result for r in runs]
    failed = [r for r in results if not r.ok]
    if as_json:
        doc = {**_env_header(dev, p, cap), "ok": not failed,
               "results": [r.as_dict(p) for r in results]}
        click.echo(json.dumps(doc, indent=2))
    else:
        _print_run_table(results, dev, p, cap)
    if failed:
        sys.exit(1)


def _print_run_table(results, dev, p, cap: int) -> None:
    from rich import box
    from rich.table import Table

    from .cli_format import console, fmt_err, fmt_frac, fmt_inputs, fmt_rate, fmt_time

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
        mb = r.flops is not None and p.memory_bound(r.flops, r.bytes or 0)
        table.add_row(r.op, r.workload, r.dtype, fmt_inputs(r.inputs, bool(r.scaled)), target,
                      fmt_err(r.rel_err), check, fmt_time(r.time_s),
                      fmt_rate(r.flops, r.bytes, r.time_s, mb), fmt_frac(r.roof_fraction(p)))
    con.print(table)
    notes = []
    if any(r.scaled for r in results):
        notes.append(f"* scaled down so no input or output holds more than {cap} elements "
                     f"(--max-elements; 0 runs the full sizes)")
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


# --- bench ------------------------------------------------------------------------------------


@main.command()
@click.argument("op", metavar="OP")
@click.option("--against", default="eager,compile", show_default=True,
              help="contenders, comma-separated: eager (or torch), compile")
@click.option("--device", default=None,
              help="cuda (the default) or a cuda:N; cpu runs the same comparison on the CPU")
@_common_case_options
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("tileops-bench"), show_default=True,
              help="directory for <OP>-<device>.json, .md and .png")
@_usage
def bench(op: str, against: str, device: str | None, dtypes: tuple[str, ...],
          workloads: tuple[str, ...], max_elements: int | None, repeat: int,
          target: str | None, out_dir: Path) -> None:
    """Benchmark OP against torch eager and torch.compile.

    On a CUDA GPU by default; on a machine without one it stops unless --device cpu is given
    (then the reference target runs against eager and compile on the CPU). Writes JSON, a
    Markdown table and a PNG roofline plot, and prints the table.
    """
    import torch

    from .cli_bench import CONTENDERS, bench_contenders, write_json, write_markdown, write_plot
    from .cli_core import closest, did_you_mean
    from .cli_core import peaks as measure_peaks

    if device is None:
        if not torch.cuda.is_available():
            raise click.ClickException(
                "tileops bench compares ops with torch eager and torch.compile on a CUDA GPU, "
                "and this machine has none (torch.cuda.is_available() is False). Pass "
                "--device cpu to run the comparison on the CPU (the reference target against "
                "eager and compile).")
        device = "cuda"
    contenders = []
    for name in _split([against]):
        found = CONTENDERS.get(name.lower())
        if found is None:
            raise UsageProblem(f"unknown contender {name!r}; valid: {', '.join(CONTENDERS)}"
                               f"{did_you_mean(closest(name, CONTENDERS))}")
        if found not in contenders:
            contenders.append(found)
    plan, dev, tgt, cap = _prepare([op], device, dtypes, workloads, max_elements, target)
    p = measure_peaks(dev)

    def per_case(ran, status):
        ran.result.extra["contenders"] = bench_contenders(
            ran, contenders, dev, repeat=repeat, budget_s=0.25, status=status)

    runs = _run_cases(plan, dev, tgt, repeat, 0.25, per_case)
    results = [r.result for r in runs]
    header = {**_env_header(dev, p, cap), "op": plan[0][0], "against": contenders}
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{plan[0][0]}-{str(dev).replace(':', '')}"
    paths = [out_dir / f"{stem}.{ext}" for ext in ("json", "md", "png")]
    write_json(paths[0], header, results, p)
    write_markdown(paths[1], header, results, contenders)
    write_plot(paths[2], header, results, contenders, p)
    click.echo(paths[1].read_text(), nl=False)
    click.echo("wrote " + ", ".join(str(x) for x in paths))
    if any(not r.ok for r in results):
        sys.exit(1)


# --- list / explain ---------------------------------------------------------------------------


def _entries() -> dict[str, tuple[Any, Any, dict, type | None]]:
    """name -> (entry, spec file, adts, op class or None): the process-wide specs, then ops
    whose entries come from elsewhere."""
    from tileops.runtime import default_specs

    from .cli_core import op_classes

    classes = op_classes()
    specs = default_specs()
    out: dict[str, tuple[Any, Any, dict, type | None]] = {}
    for name in specs.names():
        entry, file, adts = specs.find(name)
        cls = classes.get(name)
        out[name] = (entry, file, adts, cls if cls is not None and
                     cls._signature.entry is entry else None)
    for name, cls in classes.items():
        if name not in out:
            plan = cls._signature
            out[name] = (plan.entry, plan.spec, plan.adts, cls)
    return out


@main.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="print the list as JSON")
def list_ops(as_json: bool) -> None:
    """List ops: family, status, dtypes and the targets that can serve them here."""
    from rich import box
    from rich.table import Table

    from .cli_core import available_devices, targets_here
    from .cli_format import console
    from .workloads import entry_dtypes

    devices = available_devices()
    rows = []
    for name, (entry, _file, adts, cls) in _entries().items():
        rows.append({
            "op": name, "family": entry.family, "status": entry.status,
            "dtypes": entry_dtypes(entry, adts),
            "targets": targets_here(cls, devices) if cls is not None else [],
            "workloads": len(entry.workloads), "ref_api": entry.ref_api,
        })
    if as_json:
        click.echo(json.dumps({"devices": devices, "ops": rows}, indent=2))
        return
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("op", "family", "status", "dtypes", f"targets here ({', '.join(devices)})",
                "workloads"):
        table.add_column(col, no_wrap=True)
    for r in rows:
        table.add_row(r["op"], r["family"], r["status"], ", ".join(r["dtypes"]) or "-",
                      ", ".join(r["targets"]) or "-", str(r["workloads"]))
    console().print(table)


def _parse_params(items: Sequence[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise UsageProblem(f"--param takes NAME=VALUE, got {item!r}")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


@main.command()
@click.argument("op", metavar="OP")
@click.option("--code", is_flag=True, help="also print the generated check source")
@click.option("--param", "params", multiple=True, metavar="NAME=VALUE",
              help="a construction param for --code (JSON value; repeatable); required params "
                   "not given are taken from the first workload")
@_usage
def explain(op: str, code: bool, params: tuple[str, ...]) -> None:
    """Explain OP's signature: quantifiers, tensors, type families, effects and roofline.

    Written in the notation of the design documents. With --code, also the Python source the
    signature generates (the call checks, output inference, traffic and roofline) at one
    construction point.
    """
    from tileops.signature import SignaturePlan
    from tileops.signature import explain as explain_signature

    from .cli_core import closest, did_you_mean

    entries = _entries()
    if op not in entries:
        raise UsageProblem(f"unknown op {op!r}{did_you_mean(closest(op, entries))} "
                           f"(tileops list shows them all)")
    entry, file, adts, cls = entries[op]
    plan = cls._signature if cls is not None else SignaturePlan(op, entry, spec=file, adts=adts,
                                                               validate=False)
    head = f"# {op}: family {entry.family}, {entry.status}"
    if entry.ref_api:
        head += f", like {entry.ref_api}"
    lines = [head]
    if file is not None:
        lines.append(f"# spec: {file.path}:{file.line_of(op) or 1}")
    if entry.doc:
        lines.append(f"# {entry.doc.strip()}")
    lines.append(f"# {len(entry.workloads)} workloads; implemented by "
                 f"{cls.__module__ + '.' + cls.__qualname__ if cls is not None else 'nothing yet'}")
    text = explain_signature(plan)
    lines.append(text)
    if code:
        given = _parse_params(params)
        unknown = [k for k in given if k not in entry.signature.params]
        if unknown:
            raise UsageProblem(f"{op} has no param {unknown[0]!r}; params: "
                               f"{', '.join(entry.signature.params) or 'none'}")
        point = dict(given)
        source = None
        for n, prm in entry.signature.params.items():
            if n not in point and prm.required:
                row = next((w for w in entry.workloads if n in w.values), None)
                if row is None:
                    raise UsageProblem(f"{op}: give --param {n}=VALUE (it is required and no "
                                       f"workload gives it)")
                point[n] = row.values[n]
                source = source or row.label
        try:
            generated = plan.construct(**point).source()
        except Exception as exc:  # noqa: BLE001 - a construction check error, shown as usage
            raise UsageProblem(f"{op}: {exc}") from None
        shown = ", ".join(f"{k}={v!r}" for k, v in point.items()) or "defaults"
        lines.append("")
        lines.append(f"# generated code at ({shown})"
                     + (f", required params from workload {source!r}" if source else ""))
        lines.append(generated)
    click.echo("\n".join(lines))


# --- check / scaffold -------------------------------------------------------------------------


@main.command()
@click.argument("paths", nargs=-1, type=click.Path(exists=True, path_type=Path))
def check(paths: tuple[Path, ...]) -> None:
    """Validate spec files or folders (default: the shipped specs).

    Prints each error as file:line: message [rule] and exits 1 if there is any.
    """
    from tileops.spec import RULES, check_paths

    from . import SPEC_DIR

    targets = list(paths) or [SPEC_DIR]
    loaded, diags = check_paths(targets)
    for d in diags:
        click.echo(f"{d}  [{d.rule}]", err=True)
    entries = sum(len(s.entries) for s in loaded)
    if diags:
        click.echo(f"{len(diags)} error(s) in {entries} entries ({len(loaded)} files)", err=True)
        sys.exit(1)
    click.echo(f"ok: {entries} entries in {len(loaded)} files; rules checked: {', '.join(RULES)}")


@main.command()
@click.argument("op", metavar="OP")
@click.option("--spec", "spec_path", type=click.Path(exists=True, path_type=Path), default=None,
              help="spec file or folder holding OP's entry (default: the shipped specs)")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="module to write (default: ./<op_name>.py); never overwritten")
@_usage
def scaffold(op: str, spec_path: Path | None, out_path: Path | None) -> None:
    """Write the op module skeleton for OP's spec entry.

    The module defines OP as an Op subclass reading its entry from the spec file it came from:
    a constructor taking the entry's params, the kernel slot (a call spec and an interface)
    and a forward that runs the slot. Checks, output inference and roofline come from the
    entry. Refuses to overwrite an existing file.
    """
    import importlib.util

    from tileops.runtime import SpecSet
    from tileops.spec import SpecError

    from . import SPEC_DIR
    from .cli_core import closest, did_you_mean
    from .cli_scaffold import ScaffoldError, module_name_for, scaffold_source

    source_path = spec_path or SPEC_DIR
    try:
        specs = SpecSet.load(source_path)
    except SpecError as exc:
        for d in exc.diagnostics:
            click.echo(f"{d}  [{d.rule}]", err=True)
        raise click.ClickException(f"{source_path} does not pass the checks; fix it first "
                                   f"(tileops check {source_path})") from None
    found = specs.find(op)
    if found is None:
        raise UsageProblem(f"no entry {op!r} in {source_path}"
                           f"{did_you_mean(closest(op, specs.names()))}")
    entry, file, adts = found
    out = out_path or Path(f"{module_name_for(op)}.py")
    if out.exists():
        raise click.ClickException(f"{out} exists; refusing to overwrite it")
    try:
        text = scaffold_source(op, entry, adts, Path(file.path), out)
    except ScaffoldError as exc:
        raise click.ClickException(str(exc)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(out, "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise click.ClickException(f"{out} exists; refusing to overwrite it") from None
    # the result must import and define the op with its entry
    mod_name = f"_tileops_scaffold_{module_name_for(op)}"
    spec = importlib.util.spec_from_file_location(mod_name, out)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        cls = getattr(module, op)
        assert cls._signature is not None and cls._signature.name == op
    except Exception as exc:  # noqa: BLE001 - reported; the file stays for inspection
        raise click.ClickException(f"wrote {out}, but it does not import: "
                                   f"{type(exc).__name__}: {exc}") from None
    click.echo(f"wrote {out}: {op} ({entry.family}, {entry.status}) from {file.path}")
    click.echo(f"next: implement {op.removesuffix('Op') or op}Interface as a Kernel and list it "
               f"in {op}.kernel_types (or register a target builder), then import {op} in its "
               f"package's __init__ and __all__")


# --- env / cache ------------------------------------------------------------------------------


def _version(dist: str, module: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            return "not installed"
        version = getattr(mod, "__version__", None)
        return f"{version} (source tree)" if version else "source tree"


def _dir_size(path: Path) -> tuple[int, int]:
    files = size = 0
    for p in path.rglob("*"):
        if p.is_file() and not p.is_symlink():
            files += 1
            size += p.stat().st_size
    return files, size


def _env_info() -> dict[str, Any]:
    import torch

    from tileops.runtime import env, targets

    info: dict[str, Any] = {
        "tileops": {name: _version(f"tileops-{name}", f"tileops.{name}")
                    for name in ("spec", "signature", "runtime", "kernels", "ops")},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "tilelang": _version("tilelang", "tilelang"),
        "cuda_available": torch.cuda.is_available(),
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            prop = torch.cuda.get_device_properties(i)
            info["gpus"].append({"index": i, "name": prop.name,
                                 "arch": f"sm_{prop.major}{prop.minor}",
                                 "memory_GiB": round(prop.total_memory / 2**30, 1)})
    cache = env.cache_dir()
    files, size = _dir_size(cache) if cache.is_dir() else (0, 0)
    info["cache"] = {"dir": str(cache), "exists": cache.is_dir(), "files": files, "bytes": size}
    info["knobs"] = {k: os.environ.get(k) for k in env.KNOBS}
    import tileops.ops  # noqa: F401  (registers the reference target)

    info["targets"] = [targets.IN_TREE, *targets.targets()]
    info["default_target"] = targets.default_target() or "chosen by device"
    return info


@main.command(name="env")
@click.option("--json", "as_json", is_flag=True, help="print as JSON")
def env_cmd(as_json: bool) -> None:
    """Versions, GPUs and their architectures, the cache directory and the knobs."""
    from tileops.runtime import env

    info = _env_info()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    t = info["tileops"]
    lines = [f"tileops-ops {t['ops']}  (spec {t['spec']}, signature {t['signature']}, "
             f"runtime {t['runtime']}, kernels {t['kernels']})",
             f"python {info['python']} on {info['platform']}",
             f"torch {info['torch']} (CUDA build: {info['torch_cuda'] or 'none'})",
             f"tilelang {info['tilelang']}"]
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(f"gpu {g['index']}: {g['name']}, {g['arch']}, {g['memory_GiB']} GiB")
    else:
        lines.append("gpu: none (torch.cuda.is_available() is False): ops run on the "
                     "reference target")
    c = info["cache"]
    state = f"{c['files']} files, {c['bytes'] / 2**20:.1f} MiB" if c["exists"] else "not created"
    lines.append(f"cache: {c['dir']} ({state})")
    lines.append(f"targets: {', '.join(info['targets'])}; default: {info['default_target']}")
    lines.append("knobs:")
    width = max(map(len, info["knobs"]))
    for k, v in info["knobs"].items():
        shown = repr(v) if v is not None else "(unset)"
        lines.append(f"  {k:<{width}}  {shown:<10}  {env.KNOBS[k]}")
    click.echo("\n".join(lines))


@main.group()
def cache() -> None:
    """The cache directory (TILEOPS_CACHE_DIR): tuned configs and compiled kernels."""


def _unsafe_to_clear(path: Path) -> str | None:
    p = path.resolve()
    home = Path.home().resolve()
    if p == Path(p.anchor):
        return "it is a filesystem root"
    if p == home or p in home.parents:
        return "it is the home directory or holds it"
    if p == Path.cwd().resolve() or p in Path.cwd().resolve().parents:
        return "it is the working directory or holds it"
    return None


@cache.command(name="clear")
@click.option("--yes", "-y", is_flag=True, help="do not ask for confirmation")
def cache_clear(yes: bool) -> None:
    """Delete everything in the cache directory."""
    from tileops.runtime import env

    path = env.cache_dir()
    if not path.exists():
        click.echo(f"{path} does not exist; nothing to clear")
        return
    if not path.is_dir():
        raise click.ClickException(f"{path} is not a directory")
    why = _unsafe_to_clear(path)
    if why is not None:
        raise click.ClickException(f"refusing to clear {path}: {why} (check TILEOPS_CACHE_DIR)")
    files, size = _dir_size(path)
    if not yes:
        click.confirm(f"Delete {files} files ({size / 2**20:.1f} MiB) in {path}?", abort=True)
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
    click.echo(f"cleared {path} ({files} files, {size / 2**20:.1f} MiB)")


@cache.command(name="info")
def cache_info() -> None:
    """Where the cache directory is and what it holds."""
    from tileops.runtime import env

    path = env.cache_dir()
    if not path.is_dir():
        click.echo(f"{path} (not created)")
        return
    files, size = _dir_size(path)
    click.echo(f"{path} ({files} files, {size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main(prog_name="tileops")
