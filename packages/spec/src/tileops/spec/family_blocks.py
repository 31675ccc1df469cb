"""Family-level spec pieces: a spec file's ``families:`` block, and the workload items of its
entries that expand a grid of their family.

Beside its entries, a spec file may declare what the entries of a family share::

    families:
      norm:
        status: implemented
        grids:
          rows-by-hidden:
            rows:
            - {rows: 1, hidden: 4096, dtype_cases: [{T: bfloat16}], label: m1-n4096}
            - ...

An entry of that family without a ``status`` of its own takes the family's, and a workload
item ``{grid: rows-by-hidden, map: {B: "[rows]", normalized_shape: "[hidden]"}, some:
[weight]}`` stands for one workload per row of the grid. The loader expands the item where
it is written, so an entry holds plain :class:`~tileops.spec.schema.Workload` rows and every
consumer (the validator, ``tileops explain`` and ``tileops run``, the workload builders)
reads it as if it were written out.

Decisions:

- ``map`` gives each index or param it feeds an expression of the spec's language over the
  row's variables, parsed like every expression field and evaluated by
  :mod:`tileops.spec.evaluate`: ``"[rows]"`` makes a one-axis Shape of a Dim, ``hidden`` passes
  the value as it is. Nothing is substituted into text.
- Every variable of the grid is read by the map. A variable nothing reads is a mistake (an
  entry that silently drops the hidden size), so it is an error, not a default.
- One source for each value: an index fed by the map and also given as a value, or dtype
  cases given by both the row and the item, is an error rather than an override. An entry's
  own ``status``, by contrast, wins over its family's (a planned op in an implemented family).
- The label is a template: ``{label}`` is the row's label and ``{name}`` a grid variable (a
  number or a string); the default ``"{label}"`` keeps the row's label.
- The expanded workloads are numbered as the entry's list now reads (an error says
  ``Op.workloads[15]`` for the 16th workload), and each path's line is where its value was
  written: the item's line for the workload and its mapped and added values, the grid row's
  for the row's label and dtype cases.
- A family block no entry uses, and a grid no item expands, are errors: dead data in a spec
  is as misleading as dead code.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from .convert import convert, fail, plain
from .errors import Diagnostic
from .evaluate import EvalError, Scope, evaluate
from .expr import is_name
from .kinds import DTYPES
from .schema import FamilyDef, Grid, GridRow, GridUse, OpEntry, Workload

__all__ = [
    "LineSource",
    "check_families_used",
    "expand_grid",
    "load_families",
    "relocate_lines",
]

_ROW_RESERVED = ("label", "dtype_cases")
_USE_RESERVED = ("grid", "map", "label", "some", "dtype_cases")

#: where the line of one path of an expanded workload comes from: (written path, the path
#: below the workload it becomes, whether the written path's own sub-paths come along)
LineSource = tuple[str, str, bool]


# --- the families block -----------------------------------------------------------------------


def load_families(raw: Any, file: str, lines: Mapping[str, int]) -> dict[str, FamilyDef]:
    """The ``families:`` block: family name -> :class:`FamilyDef`."""
    if not isinstance(raw, dict):
        raise fail(file, lines, "families", "families is a mapping of family name -> what "
                   "the entries of that family share (status, grids)")
    out: dict[str, FamilyDef] = {}
    for name, block in raw.items():
        path = f"families.{name}"
        if not isinstance(name, str):
            raise fail(file, lines, "families", f"a family name is a string, got {name!r}")
        if not isinstance(block, dict):
            raise fail(file, lines, path, f"a family block is a mapping, got "
                       f"{type(block).__name__}")
        block = dict(block)
        grids = block.pop("grids", None)
        family = convert(block, FamilyDef, path, file, lines)
        if grids is not None:
            family = msgspec.structs.replace(family, grids=_grids(grids, path, file, lines))
        out[name] = family
    return out


def _grids(raw: Any, family_path: str, file: str, lines: Mapping[str, int]) -> dict[str, Grid]:
    path = f"{family_path}.grids"
    if not isinstance(raw, dict):
        raise fail(file, lines, path, "grids is a mapping of grid name -> {rows: [...]}")
    out: dict[str, Grid] = {}
    for name, block in raw.items():
        gpath = f"{path}.{name}"
        if not isinstance(block, dict):
            raise fail(file, lines, gpath, f"a grid is a mapping with rows, got "
                       f"{type(block).__name__}")
        block = dict(block)
        rows = block.pop("rows", None)
        grid = convert({**block, "rows": []}, Grid, gpath, file, lines)
        out[str(name)] = msgspec.structs.replace(grid, rows=_rows(rows, gpath, file, lines))
    return out


def _rows(raw: Any, grid_path: str, file: str, lines: Mapping[str, int]) -> tuple[GridRow, ...]:
    path = f"{grid_path}.rows"
    if not isinstance(raw, list) or not raw:
        raise fail(file, lines, path if raw is not None else grid_path,
                   "a grid has rows: a list of at least one row of plain values")
    rows: list[GridRow] = []
    for i, row in enumerate(raw):
        rpath = f"{path}[{i}]"
        if not isinstance(row, dict):
            raise fail(file, lines, rpath, f"a grid row is a mapping, got {type(row).__name__}")
        reserved = {k: row[k] for k in _ROW_RESERVED if k in row}
        values = {k: plain(v) for k, v in row.items() if k not in _ROW_RESERVED}
        for k in values:
            if not isinstance(k, str) or not is_name(k):
                raise fail(file, lines, f"{rpath}.{k}", f"grid variable {k!r} is not a name an "
                           f"expression can read")
        converted = convert({**reserved, "values": values}, GridRow, rpath, file, lines)
        if rows and set(converted.values) != set(rows[0].values):
            raise fail(file, lines, rpath, f"row {converted.label!r} gives the variables "
                       f"{_names(converted.values)}, but the first row gives "
                       f"{_names(rows[0].values)}; every row of a grid gives the same "
                       f"variables")
        rows.append(converted)
    return tuple(rows)


def _names(names: Iterable[str]) -> str:
    return ", ".join(names) or "none"


# --- expanding a grid item --------------------------------------------------------------------


def expand_grid(
    raw: Mapping[str, Any],
    path: str,
    name: str,
    entry: OpEntry,
    families: Mapping[str, FamilyDef],
    file: str,
    lines: Mapping[str, int],
) -> list[tuple[Workload, list[LineSource]]]:
    """The workloads the grid item ``raw`` (written at ``path``, in entry ``name``) stands
    for, one per row, each with where the lines of its paths come from."""
    reserved = {k: raw[k] for k in _USE_RESERVED if k in raw}
    values = {k: plain(v) for k, v in raw.items() if k not in _USE_RESERVED}
    use = convert({**reserved, "values": values}, GridUse, path, file, lines)
    family = families.get(entry.family)
    if family is None or not family.grids:
        raise fail(file, lines, f"{path}.grid", f"unknown grid {use.grid!r}: family "
                   f"{entry.family} declares no grids (families.{entry.family}.grids)")
    grid = family.grids.get(use.grid)
    if grid is None:
        raise fail(file, lines, f"{path}.grid", f"unknown grid {use.grid!r} of family "
                   f"{entry.family}; its grids: {_names(family.grids)}")
    gpath = f"families.{entry.family}.grids.{use.grid}"
    variables = list(grid.rows[0].values)
    _check_map(use, path, name, entry, variables, file, lines)
    fields = _label_fields(use, path, variables, file, lines)

    out = []
    for j, row in enumerate(grid.rows):
        rpath = f"{gpath}.rows[{j}]"
        if row.dtype_cases and use.dtype_cases:
            raise fail(file, lines, f"{path}.dtype_cases", f"grid {use.grid}'s row "
                       f"{row.label!r} gives dtype_cases already; give them in the rows or "
                       f"in the item, not both")
        scope = Scope({k: _scope_value(v) for k, v in row.values.items()})
        mapped: dict[str, Any] = {}
        for target, ex in use.map.items():
            try:
                mapped[target] = _yaml_value(evaluate(ex.node, scope))
            except EvalError as exc:
                raise fail(file, lines, f"{path}.map.{target}", f"{ex.text!r} for row "
                           f"{row.label!r} of grid {use.grid}: {exc}") from None
        label = _render_label(use, row, fields, path, file, lines)
        workload = Workload(label=label, values={**mapped, **use.values},
                            dtype_cases=row.dtype_cases or use.dtype_cases, some=use.some)
        sources: list[LineSource] = [(path, "", False)]
        sources += [(f"{path}.map.{t}", f".{t}", True) for t in use.map]
        sources += [(f"{path}.{k}", f".{k}", True) for k in (*use.values, "some")]
        sources.append((f"{path}.label", ".label", True) if "label" in raw
                       else (f"{rpath}.label", ".label", True))
        sources.append((f"{rpath}.dtype_cases", ".dtype_cases", True) if row.dtype_cases
                       else (f"{path}.dtype_cases", ".dtype_cases", True))
        out.append((workload, sources))
    return out


def _check_map(use: GridUse, path: str, name: str, entry: OpEntry, variables: list[str],
               file: str, lines: Mapping[str, int]) -> None:
    sig = entry.signature
    fed = {*sig.forall, *sig.params, *sig.data}
    read: set[str] = set()
    for target, ex in use.map.items():
        tpath = f"{path}.map.{target}"
        if target not in fed:
            hint = " (let values are computed, not given)" if target in sig.let else ""
            raise fail(file, lines, tpath, f"map feeds {target!r}, which is not an index or a "
                       f"param of {name}{hint}")
        if target in use.values:
            raise fail(file, lines, f"{path}.{target}", f"{target} is given by map and as a "
                       f"value; give it once")
        for n in ex.names():
            if n not in variables and n not in DTYPES:
                raise fail(file, lines, tpath, f"{ex.text!r}: unknown name {n!r}; the "
                           f"variables of grid {use.grid} are {_names(variables)}")
            read.add(n)
    unread = [v for v in variables if v not in read]
    if unread:
        raise fail(file, lines, f"{path}.map", f"map does not read grid {use.grid}'s "
                   f"variable {unread[0]!r}; every variable of a grid feeds an index or a "
                   f"param of the entry")


def _label_fields(use: GridUse, path: str, variables: list[str], file: str,
                  lines: Mapping[str, int]) -> list[tuple[str, str | None]]:
    """The label template as (literal text, placeholder name or None) pieces."""
    lpath = f"{path}.label"
    try:
        pieces = list(string.Formatter().parse(use.label))
    except ValueError as exc:
        raise fail(file, lines, lpath, f"label template {use.label!r}: {exc}") from None
    out: list[tuple[str, str | None]] = []
    for literal, field, spec, conversion in pieces:
        if field is not None and (spec or conversion or not field.isidentifier()):
            raise fail(file, lines, lpath, f"label template {use.label!r}: a placeholder is "
                       f"a bare name ({{label}} or a grid variable), without a conversion or "
                       f"a format")
        if field is not None and field != "label" and field not in variables:
            raise fail(file, lines, lpath, f"label template {use.label!r}: {field!r} is not "
                       f"the row's label or a variable of grid {use.grid} "
                       f"({_names(variables)})")
        out.append((literal, field))
    return out


def _render_label(use: GridUse, row: GridRow, fields: list[tuple[str, str | None]],
                  path: str, file: str, lines: Mapping[str, int]) -> str:
    text = []
    for literal, field in fields:
        text.append(literal)
        if field is None:
            continue
        v = row.label if field == "label" else row.values[field]
        if isinstance(v, bool) or not isinstance(v, int | str):
            raise fail(file, lines, f"{path}.label", f"label template {use.label!r}: "
                       f"{field} of row {row.label!r} is {v!r}; a label reads only numbers "
                       f"and strings")
        text.append(str(v))
    return "".join(text)


def _scope_value(v: Any) -> Any:
    """A YAML value as the evaluator holds it: lists are tuples (Shapes)."""
    if isinstance(v, list | tuple):
        return tuple(_scope_value(x) for x in v)
    return v


def _yaml_value(v: Any) -> Any:
    """An evaluated value as a workload row holds it, like the YAML it replaces: lists."""
    if isinstance(v, list | tuple):
        return [_yaml_value(x) for x in v]
    return v


# --- after the entries ------------------------------------------------------------------------


def check_families_used(families: Mapping[str, FamilyDef], entries: Mapping[str, OpEntry],
                        used_grids: set[tuple[str, str]], file: str,
                        lines: Mapping[str, int]) -> list[Diagnostic]:
    """Every family block belongs to a family some entry of the file has, and every grid is
    expanded by some workload item: one diagnostic for each that is not."""
    have = list(dict.fromkeys(e.family for e in entries.values()))
    found: list[Diagnostic] = []
    for name, family in families.items():
        if name not in have:
            found += fail(file, lines, f"families.{name}", f"no entry of this file has family "
                          f"{name!r} (the entries' families: {_names(have)})").diagnostics
            continue
        for grid in family.grids:
            if (name, grid) not in used_grids:
                found += fail(file, lines, f"families.{name}.grids.{grid}", f"grid {grid} of "
                              f"family {name} is expanded by no workload item").diagnostics
    return found


def relocate_lines(lines: dict[str, int], path: str, sources: list[list[LineSource]],
                   scope: Iterable[str] | None = None) -> None:
    """Rewrite the line table's ``{path}[i]...`` entries for the expanded workload list:
    ``sources[k]`` says where the lines of workload ``k``'s paths were written. Sources lie
    under this list or a family block's grid rows; ``scope``, where given, is the table's
    paths that can hold them (the entry's and the family blocks'), so an entry's relocation
    does not scan the whole file's table."""
    prefix = f"{path}["
    candidates = [p for p in (lines if scope is None else scope) if p in lines]
    written = {p: lines[p] for p in candidates if p.startswith(prefix)}
    for p in written:
        del lines[p]
    snapshot = {p: lines[p] for p in candidates if p in lines}
    snapshot.update(written)
    # each path under every deep source that is an ancestor of it (split where a key or an
    # index starts), built once: a source's descendants are then one lookup, not a scan of
    # the table per workload
    roots = {src for srcs in sources for src, _, deep in srcs if deep}
    below: dict[str, list[tuple[str, int]]] = {}
    for p, n in snapshot.items():
        if not (p.startswith(prefix) or p.startswith("families.")):
            continue
        for i, ch in enumerate(p):
            if ch in ".[" and p[:i] in roots:
                below.setdefault(p[:i], []).append((p[i:], n))
    for k, srcs in enumerate(sources):
        base = f"{path}[{k}]"
        for src, rel, deep in srcs:
            if src in snapshot:
                lines.setdefault(base + rel, snapshot[src])
            if deep:
                for tail, n in below.get(src, ()):
                    lines.setdefault(base + rel + tail, n)
