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

__all__ = ["UNRESOLVED", "backward_key", "empty_from_record", "instance_for_key",
           "register_instance"]


class _Unresolved:
    def __repr__(self) -> str:
        return "<unresolved>"


#: the binding group's initial ``_target_builder``: no target chosen yet
UNRESOLVED: Any = _Unresolved()
_counter = itertools.count()
_instances: weakref.WeakValueDictionary[str, Op] = weakref.WeakValueDictionary()


def register_instance(op: Op, key: str | None = None) -> str:
    """Register an op instance under ``key``, by default a new ``Class@n`` (never reused);
    returns the key."""
    if key is None:
        key = f"{type(op).__qualname__}@{next(_counter)}"
    _instances[key] = op
    return key


def backward_key(forward_key: str, needs: tuple[bool, ...]) -> str:
    """The key of the backward op a forward instance builds for ``needs``: derived from the
    forward's, so a compiled backward names its op by the forward instance that a traced
    graph, and any cache of its compiled code, already names. A cached backward loaded in
    another process finds its op through the forward (:func:`instance_for_key`), though no
    backward op was built there yet."""
    return f"{forward_key}>{''.join('1' if n else '0' for n in needs)}"


def instance_for_key(key: str) -> Op:
    """The live op instance registered under ``key`` (used by the compile boundary); a
    backward key (:func:`backward_key`) of a live forward instance builds its backward op."""
    op = _instances.get(key)
    if op is None:
        forward, sep, bits = key.rpartition(">")
        # (no bits: a gradient without needs params, e.g. SiLU's, has one backward op)
        fwd = _instances.get(forward) if sep and set(bits) <= {"0", "1"} else None
        if fwd is not None and fwd._gradient is not None:
            return fwd._backward_op(tuple(b == "1" for b in bits))
        raise LookupError(f"no live TileOPs op instance for key {key!r}")
    return op


def empty_from_record(call: SignatureCall) -> Any:
    """The first output, allocated from the shape and dtype the record derives (once)."""
    _, shapes, dtypes = call.derived()
    return torch.empty(shapes[0], dtype=dtypes[0], device=call.device)
