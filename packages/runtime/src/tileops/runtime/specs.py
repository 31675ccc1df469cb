"""Where op classes find their spec entries.

A :class:`SpecSet` is a validated collection of spec files plus the shared ADTs. An op class
names the set it reads (``class MyOp(Op, specs=my_specs)``) or reads the process-wide set that
packages add their specs to with :func:`register_specs`. The entry is found by class name.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from pathlib import Path

from tileops.spec import AdtDef, OpEntry, SpecError, SpecFile, check_paths

__all__ = ["SpecSet", "default_specs", "register_specs"]


class SpecSet:
    """Validated spec files: ``find(name)`` gives ``(entry, file, adts)``."""

    def __init__(self, files: Iterable[SpecFile] = (), adts: dict[str, AdtDef] | None = None):
        self.files: list[SpecFile] = []
        self.adts: dict[str, AdtDef] = dict(adts or {})
        self._where: dict[str, SpecFile] = {}
        for f in files:
            self.add_file(f)

    @classmethod
    def load(cls, *paths: str | Path) -> SpecSet:
        """Load and validate files or folders (a ``types.yaml`` among or beside them gives
        the ADTs). Raises :class:`tileops.spec.SpecError` with every diagnostic."""
        loaded, diags = check_paths(paths)
        if diags:
            raise SpecError(diags)
        out = cls()
        out.adts.update(_adts_for(paths))
        for f in loaded:
            out.add_file(f)
        return out

    def add_file(self, f: SpecFile) -> None:
        for name in f.entries:
            if name in self._where and self._where[name] is not f:
                raise ValueError(f"op {name} is declared in {self._where[name].path} and "
                                 f"{f.path}")
            self._where[name] = f
        self.files.append(f)

    def find(self, name: str) -> tuple[OpEntry, SpecFile, dict[str, AdtDef]] | None:
        f = self._where.get(name)
        return None if f is None else (f.entries[name], f, self.adts)

    def names(self) -> list[str]:
        return list(self._where)

    def merge(self, other: SpecSet) -> None:
        self.adts.update(other.adts)
        for f in other.files:
            self.add_file(f)


def _adts_for(paths: Iterable[str | Path]) -> dict[str, AdtDef]:
    from tileops.spec import load_types_file

    out: dict[str, AdtDef] = {}
    seen: set[Path] = set()
    for p in map(Path, paths):
        candidates = [p / "types.yaml"] if p.is_dir() else [p] if p.name == "types.yaml" \
            else [p.parent / "types.yaml"]
        for c in candidates:
            if c.is_file() and c not in seen:
                seen.add(c)
                out.update(load_types_file(c)[0].adts)
    return out


_default = SpecSet()
_lock = threading.Lock()


def default_specs() -> SpecSet:
    return _default


def register_specs(*paths: str | Path) -> SpecSet:
    """Load, validate and add spec files to the process-wide set. Returns what was added."""
    added = SpecSet.load(*paths)
    with _lock:
        _default.merge(added)
    return added
