"""What the runtime and the ops ask of a tensor's memory: whether it holds data to read (not a
fake or meta tensor, as tracing and shape inference pass) and whether a cache may keep it, the
byte range its elements lie in,
whether its strides lay it out densely, torch's overlap tests of an in-place write against
another operand (partial overlap, and any shared element), and the first index out of range in
an integer tensor (the references' data checks)."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["extent", "first_outside", "has_data", "is_dense", "keepable", "partially_overlap",
           "share_memory"]



def has_data(t: torch.Tensor) -> bool:
    """Whether ``t`` holds values to read (not a fake or meta tensor)."""
    return not (t.is_meta or is_fake(t))


def keepable(t: torch.Tensor) -> bool:
    """Whether a cache may keep ``t``, a tensor an op just made (a constant, a table): it holds
    data, and it was not made while the current CUDA stream is captured into a graph, whose
    kernels (the fill or copy that gave ``t`` its values) run only when the graph is replayed,
    so a later eager call would read it unwritten."""
    if not has_data(t):
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


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


def share_memory(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two tensors share an element, judged as torch judges in-place overlap: the
    same view twice, or two dense views whose byte ranges meet. Views with gaps (packed q and
    k slices of one qkv tensor) are not judged: their ranges may interleave without a common
    element. Fake and meta tensors hold no memory and share none."""
    if a is None or b is None or not a.numel() or not b.numel():
        return False
    if not (has_data(a) and has_data(b)):
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    if a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride():
        return True
    if not (is_dense(tuple(a.shape), a.stride()) and is_dense(tuple(b.shape), b.stride())):
        return False
    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a0 < b1 and b0 < a1


def first_outside(t: torch.Tensor, low: int, high: int) -> tuple[tuple[int, ...], int] | None:
    """The first element of an integer tensor outside ``[low, high)``, as (its index, its
    value), where the tensor holds data (one device sync: the references' data checks);
    None where every element is inside, or there is nothing to read."""
    if not t.numel() or not has_data(t):
        return None
    bad = ((t < low) | (t >= high)).nonzero()
    if not bad.numel():
        return None
    at = tuple(int(i) for i in bad[0])
    return at, int(t[at])
