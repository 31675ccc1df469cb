"""Validated spec files as bytes, so a process can skip loading and validating files that were
validated before.

Loading and validating the shipped specs (YAML composition with line tracking, family blocks,
every rule, every workload instantiated) is most of what ``import tileops.ops`` costs beyond
torch; the result depends only on the files' bytes and on this package's code. :func:`key`
is a digest of exactly those; :func:`dump` writes the loaded files and ADTs with msgpack
(msgspec's typed encoder: no code is stored and nothing is unpickled), and :func:`load`
decodes them against the schema's types, so a record that does not have the schema's shape
is refused like any bad input. Expressions are stored as their text and parsed again on load
(each distinct text once): the parser is the one that read the YAML, so a stored expression
is the same tree.

A record starts with the SHA-256 of the rest of it, checked before anything is decoded: a
record changed after it was written (a damaged disk, a partial copy, an edit that keeps it
well formed, such as one rule's text) is refused as a miss rather than served as the validated
files. The check guards the bytes, not their author: whoever can write the cache could write
the checksum too, as they could edit the installed specs or code.

The caller owns where records live and treats any failure of :func:`load` as a miss (the
files are then loaded and validated as usual).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import msgspec

from .schema import AdtDef, Expr, SpecFile

__all__ = ["FORMAT", "dump", "key", "load"]

#: the record layout; a change of it changes every key
FORMAT = 2

#: the bytes of a record's checksum (SHA-256 of the payload after it)
_SUM = 32

_PACKAGE = Path(__file__).resolve().parent


class _Record(msgspec.Struct, frozen=True, array_like=True):
    key: str
    files: list[SpecFile]
    adts: dict[str, AdtDef]


def _code_digest() -> bytes:
    """A digest of this package's sources: the loader, the validator and the schema decide
    what a file loads to, so a record written by other code is not reused."""
    h = hashlib.sha256()
    for src in sorted(_PACKAGE.rglob("*.py")):
        h.update(str(src.relative_to(_PACKAGE)).encode())
        h.update(src.read_bytes())
    return h.digest()


def key(files: Iterable[Path], type_files: Iterable[Path]) -> str:
    """The digest of a load: the record format, this package's code, and each file's path as
    the load names it (a loaded file records the path it was read by) and bytes, spec files
    and ADT files apart. Raises OSError when a file cannot be read."""
    h = hashlib.sha256(f"tileops.spec stored {FORMAT}".encode())
    h.update(_code_digest())
    for tag, group in ((b"spec", files), (b"types", type_files)):
        for f in group:
            data = Path(f).read_bytes()
            h.update(tag)
            h.update(str(Path(f)).encode())
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    return h.hexdigest()


def _encode(obj: object) -> object:
    if isinstance(obj, Expr):
        return obj.text
    raise NotImplementedError(f"cannot store a {type(obj).__name__}")


def dump(digest: str, files: list[SpecFile], adts: dict[str, AdtDef]) -> bytes:
    """The record of validated ``files`` and ``adts`` under ``digest`` (from :func:`key`):
    the payload's checksum, then the payload."""
    payload = msgspec.msgpack.encode(_Record(digest, files, adts), enc_hook=_encode)
    return hashlib.sha256(payload).digest() + payload


def load(data: bytes, digest: str) -> tuple[list[SpecFile], dict[str, AdtDef]]:
    """The files and ADTs of a record written by :func:`dump` under ``digest``. Raises
    ``ValueError`` (msgspec's decode and validation errors are ValueErrors, as is an
    expression that does not parse) when the bytes are not such a record, do not match their
    checksum or were written under another digest."""
    if len(data) < _SUM or hashlib.sha256(data[_SUM:]).digest() != data[:_SUM]:
        raise ValueError("the record does not match its checksum (it changed after it was "
                         "written)")
    data = data[_SUM:]
    parsed: dict[str, Expr] = {}

    def decode(tp: type, obj: object) -> object:
        if tp is Expr and isinstance(obj, str):
            ex = parsed.get(obj)
            if ex is None:
                ex = parsed[obj] = Expr(obj)
            return ex
        raise msgspec.ValidationError(f"expected an expression's text, got {obj!r}")

    try:
        record = msgspec.msgpack.decode(data, type=_Record, dec_hook=decode)
    except RecursionError as err:  # a hostile record nested past the decoder's stack
        raise ValueError("the record nests too deeply") from err
    if record.key != digest:
        raise ValueError(f"the record was written under key {record.key[:12]}..., "
                         f"not {digest[:12]}...")
    return record.files, record.adts
