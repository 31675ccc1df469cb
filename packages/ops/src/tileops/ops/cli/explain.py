"""The commands that read the specs: ``tileops list``, ``tileops explain`` and
``tileops check``."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich import box
from rich.table import Table

from tileops.runtime import default_specs
from tileops.signature import SignaturePlan
from tileops.signature import explain as explain_signature
from tileops.spec import RULES, check_paths

from .. import SPEC_DIR
from ..workloads import entry_dtypes
from .core import UsageProblem, available_devices, closest, did_you_mean, op_classes, targets_here
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


@click.command()
@click.argument("op", metavar="OP")
@click.option("--code", is_flag=True, help="also print the generated check source")
@click.option("--param", "params", multiple=True, metavar="NAME=VALUE",
              help="a construction param for --code (JSON value; repeatable); required params "
                   "not given are taken from the first workload")
@usage
def explain(op: str, code: bool, params: tuple[str, ...]) -> None:
    """Explain OP's signature: quantifiers, tensors, type families, effects and roofline.

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
