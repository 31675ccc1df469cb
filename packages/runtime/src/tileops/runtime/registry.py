"""What the op base, its fused call and its compile boundary share, in one module none of
them is imported by: the weak registry of live op instances (the compile boundary finds an
instance by its string key), the "no target bound yet" sentinel, and the output allocation
from a call's record."""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from tileops.signature import SignatureCall

    from .op import Op

__all__ = ["UNRESOLVED", "empty_from_record", "instance_for_key", "register_instance"]


class _Unresolved:
    def __repr__(self) -> str:
        return "<unresolved>"


#: the binding group's initial ``_target_builder``: no target chosen yet
UNRESOLVED: Any = _Unresolved()
_counter = itertools.count()
_instances: weakref.WeakValueDictionary[str, Op] = weakref.WeakValueDictionary()


def register_instance(op: Op) -> str:
    """Register a new op instance; returns its key (``Class@n``, never reused)."""
    key = f"{type(op).__qualname__}@{next(_counter)}"
    _instances[key] = op
    return key


def instance_for_key(key: str) -> Op:
    """The live op instance registered under ``key`` (used by the compile boundary)."""
    op = _instances.get(key)
    if op is None:
        raise LookupError(f"no live TileOPs op instance for key {key!r}")
    return op


def empty_from_record(call: SignatureCall) -> Any:
    """The first output, allocated from the shape and dtype the record derives (once)."""
    _, shapes, dtypes = call.derived()
    return torch.empty(shapes[0], dtype=dtypes[0], device=call.device)
