"""Top-k: ``torch.topk`` along the last dim, returning ``(values, indices)``.

:class:`TopkOp` is the family base: it owns the forward flow of the selections along a row:

- layout: ``x`` as a contiguous ``(rows, n)`` view at a 16-byte aligned address (an input that
  is not one is copied), the outputs as ``(rows, k)`` views of the tensors the call allocated;
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

from ._dtypes import NAMES, refuse_unserved

__all__ = ["TopkFwdOp", "TopkOp"]

#: the dtypes the in-tree top-k kernels serve
_KERNEL_DTYPES = frozenset(get_args(TopkDType))


class TopkOp(Op):
    """Family base of the row selections (see the module docstring)."""

    kernel_types = {TopkInterface: (TopkRadixKernel,)}

    def derive(self) -> None:
        self._read_n = self.index_reader("N")

    def forward(self, call, x, values, indices) -> None:
        n = self._read_n(call)[0]
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


class TopkFwdOp(TopkOp):
    def reference(self, call, x):
        # a stable sort: by value, equal values by index (NaN above every number, -0.0 == 0.0)
        wide = x.float() if x.dtype != torch.float64 else x
        vals, idx = torch.sort(wide, dim=-1, descending=self.largest, stable=True)
        return vals[..., :self.k], idx[..., :self.k]

    def eager(self):
        k, dim, largest, sort = self.k, self.dim, self.largest, self.sorted

        def topk(x):  # torch.topk
            return tuple(torch.topk(x, k, dim=dim, largest=largest, sorted=sort))

        return topk
