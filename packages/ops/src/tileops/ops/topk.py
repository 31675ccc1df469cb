"""Top-k: ``torch.topk`` along any dim, returning ``(values, indices)``.

:class:`TopkOp` is the family base: it owns the forward flow of the selections along a row:

- layout: ``x`` as a contiguous ``(rows, n)`` view at a 16-byte aligned address (an input that
  is not one is copied), the outputs as ``(rows, k)`` views of the tensors the call allocated;
  a ``dim`` that is not the last is moved last by one transposing copy of ``x`` (the kernels
  read rows with unit stride), and the selections are written back along ``dim``;
- the call spec: :class:`~tileops.kernels.topk.TopkSpec` from the row count and length the
  signature solved, ``k``, the dtype and which end is kept;
- the slot ``topk_fwd``.

Ties resolve one way (the spec entry says which): the k kept are the greatest by value and
then by lowest index, returned in that order whatever ``sorted`` says (torch leaves the order
of an unsorted result, and which of equal values are kept, open). The reference is a stable
sort, which gives exactly that answer; the eager contender is ``torch.topk`` itself.
"""

from __future__ import annotations

from typing import get_args

import torch

from tileops.kernels.topk import TopkDType, TopkInterface, TopkRadixKernel, TopkSpec
from tileops.runtime import Op
from tileops.runtime.memory import first_outside, has_data

from ._dtypes import NAMES, refuse_unserved

__all__ = ["TopkBwdOp", "TopkFwdOp", "TopkOp"]

#: the dtypes the in-tree top-k kernels serve
_KERNEL_DTYPES = frozenset(get_args(TopkDType))


class TopkOp(Op):
    """Family base of the row selections (see the module docstring)."""

    kernel_types = {TopkInterface: (TopkRadixKernel,)}

    def forward(self, call, x, values, indices) -> None:
        if x.dim() == 0:  # torch.topk's 0-dim result: the element at index 0, k 0 or 1
            values.copy_(x)
            indices.zero_()
            return
        axis = self.dim % x.dim()
        if axis != x.dim() - 1:  # one transposing copy: the kernels read rows
            v, i = self.forward_last(call, x.movedim(axis, -1).contiguous())
            values.copy_(v.movedim(-1, axis))
            indices.copy_(i.movedim(-1, axis))
            return
        self.forward_last(call, x, values, indices)

    def forward_last(self, call, x, values=None, indices=None):
        """The selection along the last axis of ``x``, into ``values``/``indices`` (fresh
        tensors of x's shape with k last where not given); returns them."""
        n = x.shape[-1]
        if values is None:
            shape = (*x.shape[:-1], self.k)
            values = torch.empty(shape, dtype=x.dtype, device=x.device)
            indices = torch.empty(shape, dtype=torch.int64, device=x.device)
        rows = x.numel() // n if n else 0
        dtype = x.dtype
        key = (call.device, dtype, rows, n)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            refuse_unserved(self, dtype, _KERNEL_DTYPES, "top-k")
            entry = self.kernel_for(key, TopkInterface, lambda: TopkSpec(
                device=call.device, rows=rows, n=n, k=self.k, dtype=NAMES[dtype],
                largest=self.largest))
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.contiguous() if not x.is_contiguous() else x.clone()
        entry(x.view(rows, n), values.view(rows, self.k), indices.view(rows, self.k))
        return values, indices


class TopkFwdOp(TopkOp):
    def reference(self, call, x):
        # a stable sort: by value, equal values by index (NaN above every number, -0.0 == 0.0);
        # integers as they are (float32 does not hold every int32 or int64)
        wide = x.float() if x.is_floating_point() and x.dtype != torch.float64 else x
        if x.dim() == 0:  # torch.topk's 0-dim result: the element at index 0, k 0 or 1
            return wide.clone(), torch.zeros((), dtype=torch.int64, device=x.device)
        vals, idx = torch.sort(wide, dim=self.dim, descending=self.largest, stable=True)
        return vals.narrow(self.dim, 0, self.k), idx.narrow(self.dim, 0, self.k)

    def eager(self):
        k, dim, largest, sort = self.k, self.dim, self.largest, self.sorted

        def topk(x):  # torch.topk
            return tuple(torch.topk(x, k, dim=dim, largest=largest, sorted=sort))

        return topk


class TopkBwdOp(TopkOp):
    """The gradient of the values: ``dvalues`` put back at ``indices`` along ``dim``, 0
    elsewhere (torch's ``zeros.scatter(dim, indices, grad)``); ``x`` is read for its shape
    only. A fill and torch's scatter: no in-tree kernel. The indices are the forward's,
    distinct positions along ``dim``: a call made directly has them checked on the host
    (:meth:`~tileops.runtime.Op.checks_indices`, the reference always), an index outside
    ``[0, size)`` or one twice in a run refused by name, where torch's scatter would raise
    naming neither (on a GPU, a device-side assert) or keep one of the two values."""

    def forward(self, call, dvalues, indices, x, dx) -> None:
        if self.checks_indices(indices):
            self._refuse_bad_indices(indices, x)
        if dx.dim() == 0:  # a 0-dim x: its one element was the value
            dx.copy_(dvalues)
            return
        dx.zero_()
        dx.scatter_(self.dim % dx.dim(), indices, dvalues)

    def _refuse_bad_indices(self, indices: torch.Tensor, x: torch.Tensor) -> None:
        """Refuse, by name, an index that is no position along ``dim`` of ``x``, or a position
        named twice in one run (torch.topk returns distinct ones)."""
        if not indices.numel() or not has_data(indices):
            return
        if x.dim() == 0:  # one element: index 0, nothing to repeat
            if int(indices) != 0:
                raise IndexError(f"{type(self).__name__}: argument indices is {int(indices)}; "
                                 f"expected 0, the one position of a 0-dim x")
            return
        d = self.dim % x.dim()
        n = x.shape[d]
        where = f"x's dim {self.dim} (x is {list(x.shape)})"
        bad = first_outside(indices, 0, n)
        if bad is not None:
            at, value = bad
            raise IndexError(
                f"{type(self).__name__}: argument indices holds {value} at indices"
                f"[{', '.join(map(str, at))}]; expected positions along {where} in [0, {n}), "
                f"as torch.topk returns them")
        ordered = indices.sort(d).values
        same = ordered.narrow(d, 1, self.k - 1) == ordered.narrow(d, 0, self.k - 1)
        twice = same.nonzero()
        if twice.numel():
            at = tuple(int(i) for i in twice[0])
            run = ", ".join(":" if a == d else str(i) for a, i in enumerate(at))
            raise IndexError(
                f"{type(self).__name__}: argument indices holds {int(ordered[at])} twice in "
                f"indices[{run}]; expected distinct positions along {where} in each run, as "
                f"torch.topk returns them (the scatter would keep one of the two values)")

    def _scattered(self, dvalues, indices, shape):
        if len(shape) == 0:  # a 0-dim x: its one element was the value
            return dvalues.clone()
        out = torch.zeros(shape, dtype=dvalues.dtype, device=dvalues.device)
        return out.scatter(self.dim % out.dim(), indices, dvalues)

    def reference(self, call, dvalues, indices, x):
        self._refuse_bad_indices(indices, x)
        wide = dvalues if dvalues.dtype == torch.float64 else dvalues.float()
        return (self._scattered(wide, indices, x.shape),)

    def eager(self):
        def eager(dvalues, indices, x):
            return self._scattered(dvalues, indices, x.shape)
        return eager
