"""Where op classes find their spec entries.

A :class:`SpecSet` is a validated collection of spec files plus the shared ADTs. An op class
names the set it reads (``class MyOp(Op, specs=my_specs)``) or reads the process-wide set that
packages add their specs to with :func:`register_specs`. The entry is found by class name.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterable
from pathlib import Path

from tileops.spec import AdtDef, OpEntry, SpecError, SpecFile, check_paths, stored
from tileops.spec.validate import spec_paths

from . import log
from .env import cache_part

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
        the ADTs). Raises :class:`tileops.spec.SpecError` with every diagnostic.

        Files validated before are read from the ``specs`` part of the cache
        (:func:`_stored_load`): the record is keyed by the files' bytes and the spec
        package's code, so an edited file or another version of the validator misses."""
        hit = _stored_load(paths)
        if hit is not None:
            loaded, adts = hit
        else:
            loaded, diags = check_paths(paths)
            if diags:
                raise SpecError(diags)
            adts = _adts_for(paths)
            _stored_save(paths, loaded, adts)
        out = cls()
        out.adts.update(adts)
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


def _stored_key(paths: Iterable[str | Path]) -> str | None:
    files, type_files = spec_paths(paths)
    try:
        # the paths as given: a loaded file records the path it was read by (its diagnostics
        # name it), so a record serves loads that name the same files the same way
        return stored.key(files, type_files)
    except OSError:
        return None  # a file that cannot be read: the validator reports it


def _stored_load(paths: Iterable[str | Path]) -> tuple[list[SpecFile], dict[str, AdtDef]] | None:
    """The files and ADTs of ``paths`` from their record in the cache, or None when there is
    none or it does not decode to the schema's types under this load's key (it is then
    rebuilt)."""
    digest = _stored_key(paths)
    if digest is None:
        return None
    path = cache_part("specs") / f"{digest}.msgpack"
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block, a device never end
            _unusable(path, "it is not a regular file")
            return None
        with path.open("rb") as f:
            data = f.read(MAX_RECORD_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as err:
        _unusable(path, f"{type(err).__name__}: {err}")
        return None
    if len(data) > MAX_RECORD_BYTES:
        _unusable(path, f"it is more than {MAX_RECORD_BYTES} bytes")
        return None
    try:
        return stored.load(data, digest)
    except (ValueError, SpecError) as err:
        _unusable(path, str(err))
        return None


#: a record past this size is not one this library wrote (the shipped specs' is some 1 MB)
MAX_RECORD_BYTES = 64 << 20
#: records and folders already warned about: a process warns once for each
_warned: set[Path] = set()
#: the records this process added to the cache, then the folders it made for them
_written: list[Path] = []


def own_records_removed() -> None:
    """Take back what this process added to the cache by writing spec records: the records
    that were not there before it, then the folders it made for them, where they are empty.
    The ``tileops cache`` command runs it first, so that it describes and clears the cache as
    it was before the command started (importing the ops, as every command does, validates
    the specs and records them)."""
    for path in _written:
        try:
            if path.suffix == ".msgpack":
                path.unlink(missing_ok=True)
            else:
                path.rmdir()  # only where empty: another writer's files stay
        except OSError:
            pass
    _written.clear()


def _unusable(path: Path, why: str) -> None:
    """One warning a record: it is not used, and the files are validated again (and the
    record rewritten, where it can be)."""
    if path not in _warned:
        _warned.add(path)
        log.warning("the spec record %s is not usable (%s); validating the spec files again",
                    path, why)


def _stored_save(paths: Iterable[str | Path], loaded: list[SpecFile],
                 adts: dict[str, AdtDef]) -> None:
    """Write the record of a validated load (atomically: a reader sees the whole record or
    none). A cache that cannot be written costs the next process the validation, nothing
    more."""
    digest = _stored_key(paths)
    if digest is None:
        return
    folder = cache_part("specs")
    tmp = folder / f".{digest}.{os.getpid()}.{threading.get_ident()}.tmp"
    record = folder / f"{digest}.msgpack"
    # what this write adds to the cache (the folders it makes, the record if new): the
    # cache command takes its own start's trace back before it looks (own_records_removed)
    new = [d for d in (folder.parent, folder) if not d.exists()]
    try:
        existed = record.exists()
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(stored.dump(digest, loaded, adts))
        os.replace(tmp, record)
        if not existed:
            _written.extend([record, *reversed(new)])
    except OSError as err:
        try:  # a record that could not take its place leaves no temporary file behind
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if folder not in _warned:
            _warned.add(folder)
            log.warning("cannot write the spec record under %s (%s: %s); each process "
                        "validates the spec files again (set TILEOPS_CACHE_DIR to a writable "
                        "directory)", folder, type(err).__name__, err)


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
