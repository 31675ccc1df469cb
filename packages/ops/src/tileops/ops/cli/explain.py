"""The commands that read the specs: ``tileops list``, ``tileops explain`` and
``tileops check``."""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich import box
from rich.table import Table

from tileops.runtime import Op, default_specs
from tileops.signature import SignaturePlan
from tileops.signature import explain as explain_signature
from tileops.spec import RULES, check_paths

from .. import SPEC_DIR
from ..workloads import entry_dtypes
from .core import (
    UsageProblem,
    available_devices,
    closest,
    did_you_mean,
    op_classes,
    targets_here,
    without_op,
)
from .driver import usage
from .formatting import console

__all__ = ["check", "explain", "list_ops"]


def _entries() -> dict[str, tuple[Any, Any, dict, type | None]]:
    """name -> (entry, spec file, adts, op class or None): the process-wide specs, then ops
    whose entries come from elsewhere."""
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


@click.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="print the list as JSON")
def list_ops(as_json: bool) -> None:
    """List ops: family, status, dtypes and the targets that can serve them here."""
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


def _parse_value(raw: str) -> Any:
    """A ``--param`` value: JSON (``7``, ``[4096]``, ``1.0e-6``, ``null``), else a Python
    literal (``(4096,)``, ``None``), else the text itself (an enum member such as ``fast``).
    An int stays an int: the op class decides what it means (``normalized_shape=7`` is the
    one-axis shape ``(7,)`` to the row norms, as to torch)."""
    try:
        return json.loads(raw)
    except ValueError:  # not JSON (JSONDecodeError), or an int past Python's digit limit
        pass
    try:
        return ast.literal_eval(raw)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return raw


def _parse_params(items: Sequence[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise UsageProblem(f"--param takes NAME=VALUE, got {item!r}")
        out[key.strip()] = _parse_value(raw)
    return out


def _workload_lines(entry: Any) -> list[str]:
    """Each workload of the entry as the loader expanded it (a family grid's rows included):
    label, values, the optional inputs it gives (where the entry has any), dtype cases."""
    optional = [n for n, d in entry.signature.inputs.items() if d.optional.text != "False"]
    rows = []
    for w in entry.workloads:
        cells = [w.label, ", ".join(f"{k}={v!r}" for k, v in w.values.items()) or "-"]
        if optional:
            cells.append("with " + (", ".join(w.some) if w.some else "no " + " or ".join(optional)))
        cells.append(" | ".join(", ".join(f"{k}={v}" for k, v in c.items())
                                for c in w.dtype_cases) or "-")
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)] if rows else []
    out = [f"  workloads ({len(rows)}):" if rows else "  workloads: none"]
    for r in rows:
        cells = [c.ljust(n) for c, n in zip(r[:-1], widths, strict=True)]
        out.append("    " + "  ".join([*cells, r[-1]]))
    return out


def _generated_source(op: str, cls: type[Op] | None, plan: SignaturePlan,
                      point: dict[str, Any]) -> str:
    """The generated check source at ``point``. An op with a class is constructed through it,
    so a spelling the class accepts beyond the spec's type (``Op.normalize_params``) works as
    it does from Python, and a refusal is the one Python gives."""
    try:
        if cls is None:
            return plan.construct(**point).source()
        return cls(**point)._point.source()
    except Exception as exc:  # noqa: BLE001 - a construction error, shown as usage
        raise UsageProblem(f"{op}: {without_op(op, str(exc))}") from None


@click.command()
@click.argument("op", metavar="OP")
@click.option("--code", is_flag=True, help="also print the generated check source")
@click.option("--param", "params", multiple=True, metavar="NAME=VALUE",
              help="a construction param for --code (a JSON value or Python literal; "
                   "repeatable); required params not given are taken from the first workload "
                   "that gives them")
@usage
def explain(op: str, code: bool, params: tuple[str, ...]) -> None:
    """Explain OP's signature: quantifiers, tensors, type families, effects, roofline and
    every workload (family grids expanded).

    Written in the notation of the design documents. With --code, also the Python source the
    signature generates (the call checks, output inference, traffic and roofline) at one
    construction point.
    """
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
    lines.append(f"# implemented by "
                 f"{cls.__module__ + '.' + cls.__qualname__ if cls is not None else 'nothing yet'}")
    lines.append(explain_signature(plan))
    lines += _workload_lines(entry)
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
        generated = _generated_source(op, cls, plan, point)
        shown = ", ".join(f"{k}={v!r}" for k, v in point.items()) or "defaults"
        lines.append("")
        lines.append(f"# generated code at ({shown})"
                     + (f", required params from workload {source!r}" if source else ""))
        lines.append(generated)
    click.echo("\n".join(lines))


@click.command()
@click.argument("paths", nargs=-1, type=click.Path(exists=True, path_type=Path))
def check(paths: tuple[Path, ...]) -> None:
    """Validate spec files or folders (default: the shipped specs).

    Prints each error as file:line: message [rule] and exits 1 if there is any.
    """
    targets = list(paths) or [SPEC_DIR]
    loaded, diags = check_paths(targets)
    for d in diags:
        click.echo(f"{d}  [{d.rule}]", err=True)
    entries = sum(len(s.entries) for s in loaded)
    if diags:
        click.echo(f"{len(diags)} error(s) in {entries} entries ({len(loaded)} files)", err=True)
        sys.exit(1)
    click.echo(f"ok: {entries} entries in {len(loaded)} files; rules checked: {', '.join(RULES)}")
