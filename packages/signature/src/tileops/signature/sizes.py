"""What a size is, for every place one enters: an axis of an input's shape, a ``Dim`` or
``Shape`` construction param, an entry of a ``PerAxis`` param.

A size is a non-negative integer. "Integer" means what :func:`operator.index` accepts (a
Python ``int``, a numpy integer scalar, anything with ``__index__``), minus ``bool``: ``True``
is an ``int`` to Python, but a shape ``(True, 8)`` or ``normalized_shape=[True]`` is a mistake,
never a size of 1. A float is not a size even when it is whole (``8.0``): a shape that holds
one came from arithmetic that went wrong, and accepting it would hide that. Accepted values are
normalised to ``int``, so a record, an index value or a point's params never hold a numpy
scalar.

The call check applies this to the shapes of objects it cannot vouch for. The arrays of the
adapter's library (``DTypeAdapter.arrays``: ``torch.Tensor``, ``numpy.ndarray``, their
subclasses) have sizes by construction: their shape is checked by the library when the array
is made, so the hot path pays one set lookup of the input's exact type for them
(``DTypeAdapter.admitted``) and reads no entry (a fake or traced tensor's symbolic sizes are
never forced to a value). Any other object with
``.shape`` and ``.dtype`` has its shape read entry by entry and normalised.
"""

from __future__ import annotations

import operator
from typing import Any

__all__ = ["SIZE", "as_int", "as_size", "normalize_shape", "not_a_size", "shape_problem"]

#: what the messages say a size is
SIZE = "a size is a non-negative int"


def as_size(v: Any) -> int | None:
    """``v`` as an ``int`` when it is a size, else None."""
    i = as_int(v)
    return i if i is not None and i >= 0 else None


def as_int(v: Any) -> int | None:
    """``v`` as an ``int`` when it is an integer (any sign; not a bool), else None."""
    if type(v) is int:
        return v
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def normalize_shape(shape: Any) -> tuple[int, ...] | None:
    """``shape`` as a tuple of ints when it is a tuple (or list) of sizes, else None. A tuple
    (or a tuple subclass: a ``torch.Size``) of plain ints is returned as it is (no copy)."""
    if isinstance(shape, tuple):
        for v in shape:
            if type(v) is not int or v < 0:
                break
        else:
            return shape
    elif not isinstance(shape, tuple | list):
        return None
    out = []
    for v in shape:
        i = as_size(v)
        if i is None:
            return None
        out.append(i)
    return tuple(out)


def not_a_size(what: str, v: Any) -> str:
    """Why ``v``, seen at ``what``, is refused: ``x.shape[1] is True (bool), not a size``."""
    shown = repr(v) if type(v) is int else f"{v!r} ({type(v).__name__})"
    return f"{what} is {shown}, not a size: {SIZE}"


def shape_problem(name: str, shape: Any) -> str:
    """Why ``shape``, the ``.shape`` of ``name``, is not a tuple of sizes."""
    if not isinstance(shape, tuple | list):
        return (f"{name}.shape is {shape!r} ({type(shape).__name__}), not a tuple of sizes: "
                f"{SIZE}")
    for i, v in enumerate(shape):
        if as_size(v) is None:
            return not_a_size(f"{name}.shape[{i}]", v)
    return f"{name}.shape is a tuple of sizes"  # pragma: no cover - called on a refusal only
