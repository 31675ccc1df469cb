"""Validating whole files: a loaded spec file, and spec files and folders from disk."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from ..errors import Diagnostic, SpecError
from ..loader import load_spec_file_entries, load_types_file
from ..schema import AdtDef, SpecFile
from .adts import validate_types
from .entry import validate_entry

__all__ = ["check_paths", "spec_paths", "validate_spec_file"]


def validate_spec_file(spec: SpecFile, adts: Mapping[str, AdtDef] | None = None,
                       known_ops: Iterable[str] | None = None) -> list[Diagnostic]:
    """Every rule on every entry of a loaded file; ``known_ops`` are the ops a composition
    may name (by default the file's own)."""
    out: list[Diagnostic] = []
    known = set(known_ops) if known_ops is not None else set(spec.entries)
    for name, entry in spec.entries.items():
        out += validate_entry(name, entry, spec=spec, adts=adts, known_ops=known)
    return out


def spec_paths(paths: Iterable[str | Path]) -> tuple[list[Path], list[Path]]:
    """``(files, type_files)``: the spec files ``paths`` name (a folder's ``*.yaml``, sorted)
    and the ``types.yaml`` files giving their ADTs (among them, else beside them)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(q for q in p.rglob("*.yaml") if q.is_file())
        else:
            files.append(p)
    type_files = [f for f in files if f.name == "types.yaml"]
    if not type_files:
        for f in files:
            beside = f.parent / "types.yaml"
            if beside.is_file() and beside not in type_files:
                type_files.append(beside)
    return files, type_files


def check_paths(paths: Iterable[str | Path]) -> tuple[list[SpecFile], list[Diagnostic]]:
    """Load and validate spec files and folders. A ``types.yaml`` found among them (or beside
    them) provides the shared ADTs. Returns the loaded files and every diagnostic."""
    files, type_files = spec_paths(paths)
    diags: list[Diagnostic] = []
    adts: dict[str, AdtDef] = {}
    for tf in type_files:
        try:
            types, lines = load_types_file(tf)
        except SpecError as err:
            diags += err.diagnostics
            continue
        found = validate_types(types, str(tf), lines)
        diags += found
        # An ADT with an error (reported above, at its line) is withheld from the entries:
        # reading its broken field kinds would fail inside every rule that uses it.
        broken = {d.path.split(".")[1] for d in found if d.path.startswith("adts.")}
        adts.update((n, a) for n, a in types.adts.items() if n not in broken)
    loaded: list[SpecFile] = []
    for f in files:
        if f.name == "types.yaml":
            continue
        try:
            spec, errors = load_spec_file_entries(f)
            loaded.append(spec)
            diags += errors
        except SpecError as err:
            diags += err.diagnostics
        except OSError as err:
            diags.append(Diagnostic(str(f), None, "", f"cannot read: {err.strerror}", "io"))
    known = {n for s in loaded for n in s.entries}
    seen: dict[str, str] = {}
    for s in loaded:
        for n in s.entries:
            if n in seen:
                diags.append(Diagnostic(s.path, s.line_of(n), n,
                                        f"op {n} is also declared in {seen[n]}", "index-source"))
            seen.setdefault(n, s.path)
        diags += validate_spec_file(s, adts, known)
    return loaded, diags
