"""Dense GEMM: ``c = op(a) @ op(b)`` with ``op`` a transpose when ``trans_a`` / ``trans_b``.

:class:`GemmOp` is the family base: it owns the forward flow of the dense products, whose
entries give ``a`` and ``b`` the shapes ``Mat[trans_a, M, K]`` and ``Mat[trans_b, K, N]``
(``[M, K]`` or ``[K, M]``):

- layout: the kernels read row-major contiguous operands in the declared layout at 16-byte
  aligned addresses, so a non-contiguous input is copied to that layout first, and a view
  starting mid-vector is copied too (TileLang vectorizes copies on that assumption); ``c`` is
  the op's own allocation;
- the call spec: :class:`~tileops.kernels.gemm.GemmSpec` from the sizes ``M``, ``N``, ``K`` the
  signature solved and the dtype it read; the kernels derive their own launch facts from it
  (the bucket of ``M``, TMA alignment);
- the slot ``gemm_fwd``.

:class:`GemmFwdOp` is its spec entry (``specs/gemm.yaml``) plus its reference and its torch
equivalent (``torch.matmul``, i.e. cuBLAS), declared once here.
"""

from __future__ import annotations

import torch

from tileops.kernels.gemm import (
    GemmFwdInterface,
    GemmGemvKernel,
    GemmGeneralKernel,
    GemmHopperKernel,
    GemmPaddedKernel,
    GemmSmallMKernel,
    GemmSpec,
)
from tileops.runtime import Op

from ._dtypes import NAMES

__all__ = ["GemmFwdOp", "GemmOp"]


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        return t.contiguous()
    return t.clone() if t.data_ptr() % 16 else t


class GemmOp(Op):
    """Family base of the dense GEMMs (see the module docstring)."""

    kernel_types = {GemmFwdInterface: (GemmHopperKernel, GemmSmallMKernel, GemmGemvKernel,
                                       GemmPaddedKernel, GemmGeneralKernel)}

    def derive(self) -> None:
        self._read_mnk = self.index_reader("M", "N", "K")

    def forward(self, call, a, b, c) -> None:
        if not a.is_contiguous() or a.data_ptr() % 16:
            a = _kernel_layout(a)
        if not b.is_contiguous() or b.data_ptr() % 16:
            b = _kernel_layout(b)
        m, n, k = self._read_mnk(call)
        dtype = call.d_a
        key = (call.device, dtype, m, n, k)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            entry = self.kernel_for(key, GemmFwdInterface, lambda: GemmSpec(
                device=call.device, m=m, n=n, k=k, dtype=NAMES[dtype], trans_a=self.trans_a,
                trans_b=self.trans_b))
        entry(a, b, c)


class GemmFwdOp(GemmOp):
    def reference(self, call, a, b):
        wide = torch.float64 if a.dtype == torch.float64 else torch.float32
        am, bm = a.to(wide), b.to(wide)
        return (torch.matmul(am.T if self.trans_a else am, bm.T if self.trans_b else bm),)

    def eager(self):
        trans_a, trans_b = self.trans_a, self.trans_b

        def matmul(a, b):  # torch.matmul (cuBLAS on CUDA)
            return torch.matmul(a.T if trans_a else a, b.T if trans_b else b)

        return matmul
