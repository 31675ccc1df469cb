"""What the ops ask of a tensor's memory: whether it holds data to read (not a fake or meta
tensor, as tracing and shape inference pass), the byte range its elements lie in, whether
its strides lay it out densely, and torch's partial-overlap test of an in-place write against
another operand."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["extent", "has_data", "is_dense", "partially_overlap"]


def has_data(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values to read (not a fake or meta tensor)."""
    return not (t.is_meta or is_fake(t))


def extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[first, last)`` the elements of a non-empty ``t`` lie in (torch's
    strides are never negative)."""
    span = sum((size - 1) * step for size, step in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (span + 1) * t.itemsize


def partially_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch's partial-overlap test: two non-overlapping, dense views of one storage whose
    byte ranges meet without being the same range (views that are not dense are not judged,
    as in torch)."""
    if a is b or not a.numel() or not b.numel() or not has_data(a) or not has_data(b):
        return False
    if not (is_dense(tuple(a.shape), a.stride()) and is_dense(tuple(b.shape), b.stride())):
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = extent(a), extent(b)
    return (a0, a1) != (b0, b1) and a0 < b1 and b0 < a1


def is_dense(shape: tuple, strides: tuple) -> bool:
    """Whether ``strides`` lay ``shape`` out non-overlapping and dense (a permutation of a
    contiguous layout; extent-1 dims' strides address nothing)."""
    expected = 1
    for d in sorted((d for d, n in enumerate(shape) if n != 1), key=lambda d: strides[d]):
        if strides[d] != expected:
            return False
        expected *= shape[d]
    return True
