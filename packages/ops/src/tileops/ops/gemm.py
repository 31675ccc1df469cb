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

:class:`GemmAccumulateFwdOp` is the accumulating form, ``c += op(a) @ op(b)`` (torch's
``c.addmm_``): the same slot with the call spec's ``accumulate``, whose programs start their fp32
accumulator from ``c``'s tile, so ``c + op(a) @ op(b)`` is rounded once. Its entry declares
``c`` written and the result its alias, so the effect (``last_call``'s written inputs, ``c``
read and written in the traffic, the compile boundary's mutated argument) is the spec's. A
``c`` the kernels cannot write as it is (strided, or not 16-byte aligned) is accumulated in a
contiguous copy, written back; one whose elements share memory (an expanded view), or that
shares memory with ``a`` or ``b`` (the kernels read the operands while they write ``c``), is
refused by name before anything runs, on every target.
"""

from __future__ import annotations

from typing import get_args

import torch

from tileops.kernels.gemm import (
    GemmDType,
    GemmFwdInterface,
    GemmGemvKernel,
    GemmGeneralKernel,
    GemmHopperKernel,
    GemmPaddedKernel,
    GemmSmallMKernel,
    GemmSpec,
)
from tileops.runtime import Op
from tileops.runtime.memory import extent, has_data, is_dense

from ._dtypes import NAMES, refuse_unserved

__all__ = ["GemmAccumulateFwdOp", "GemmBwdOp", "GemmFwdOp", "GemmOp"]


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        return t.contiguous()
    return t.clone() if t.data_ptr() % 16 else t


class GemmOp(Op):
    """Family base of the dense GEMMs (see the module docstring)."""

    kernel_types = {GemmFwdInterface: (GemmHopperKernel, GemmSmallMKernel, GemmGemvKernel,
                                       GemmPaddedKernel, GemmGeneralKernel)}
    #: whether the op's products add into their output (the call spec's ``accumulate``)
    accumulate = False

    def derive(self) -> None:
        self._read_mnk = self.index_reader("M", "N", "K")

    def forward(self, call, a, b, c) -> None:
        m, n, k = self._read_mnk(call)
        self._product(call.device, call.d_a, a, b, c, m, n, k, self.trans_a, self.trans_b)

    def _product(self, device, dtype, a, b, c, m, n, k, trans_a, trans_b) -> None:
        """``c[m, n] = op(a) @ op(b)`` through the slot's entry for that product."""
        if not a.is_contiguous() or a.data_ptr() % 16:
            a = _kernel_layout(a)
        if not b.is_contiguous() or b.data_ptr() % 16:
            b = _kernel_layout(b)
        key = (device, dtype, m, n, k, trans_a, trans_b)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            refuse_unserved(self, dtype, _KERNEL_DTYPES, "GEMM")
            entry = self.kernel_for(key, GemmFwdInterface, lambda: GemmSpec(
                device=device, m=m, n=n, k=k, dtype=NAMES[dtype], trans_a=trans_a,
                trans_b=trans_b, accumulate=self.accumulate))
        entry(a, b, c)


#: the dtypes the GEMM kernels state they serve (their call spec's)
_KERNEL_DTYPES = frozenset(get_args(GemmDType))


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


class GemmAccumulateFwdOp(GemmOp):
    """``c += op(a) @ op(b)`` in place (see the module docstring)."""

    accumulate = True

    def forward(self, call, c, a, b, d) -> None:
        _refuse_unwritable(self, c, a, b)
        m, n, k = self._read_mnk(call)
        out = c
        if not c.is_contiguous() or c.data_ptr() % 16:
            out = _kernel_layout(c)  # a copy holding c's values, written back below
        self._product(call.device, call.d_c, a, b, out, m, n, k, self.trans_a, self.trans_b)
        if out is not c:
            c.copy_(out)

    def reference(self, call, c, a, b):
        _refuse_unwritable(self, c, a, b)
        wide = torch.float64 if c.dtype == torch.float64 else torch.float32
        am, bm = a.to(wide), b.to(wide)
        prod = torch.matmul(am.T if self.trans_a else am, bm.T if self.trans_b else bm)
        return (c.to(wide) + prod,)  # rounded once, into c

    def eager(self):
        trans_a, trans_b = self.trans_a, self.trans_b

        def addmm_(c, a, b):  # torch.Tensor.addmm_ (cuBLAS on CUDA)
            return c.addmm_(a.T if trans_a else a, b.T if trans_b else b)

        return addmm_


def _share_an_element(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether two non-empty views of one storage whose byte ranges meet share an element.
    Two dense views always do; otherwise (interleaved strided views: a buffer's left and
    right column blocks) each one's elements are marked in a scratch of the union of their
    element ranges and the other's read back (a device pass and one sync: only calls whose
    operands interleave in one storage pay it)."""
    if is_dense(tuple(x.shape), x.stride()) and is_dense(tuple(y.shape), y.stride()):
        return True
    if x.itemsize != y.itemsize or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return True  # judged by bytes alone (no sync while a CUDA graph is captured)
    lo = min(x.storage_offset(), y.storage_offset())
    (_, x1), (_, y1) = extent(x), extent(y)
    hi = (max(x1, y1) - x.untyped_storage().data_ptr()) // x.itemsize
    marks = torch.zeros(hi - lo, dtype=torch.bool, device=x.device)
    marks.as_strided(x.shape, x.stride(), x.storage_offset() - lo).fill_(True)
    return bool(marks.as_strided(y.shape, y.stride(), y.storage_offset() - lo).any())


def _refuse_unwritable(op: GemmOp, c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """Refuse, naming the op and ``c``, a ``c`` that shares an element with ``a`` or ``b``,
    which the kernels read while they write ``c`` (and torch would read after its first
    writes; a ``c`` whose own elements share memory the runtime refuses for every written
    input). Views of one storage that interleave without a common element (a buffer's
    column blocks) are served, as torch's ``addmm_`` serves them."""
    name = type(op).__name__
    if c.numel() == 0:
        return
    if not has_data(c):  # no memory to compare (fake tensors: tracing, shape checks)
        return
    storage = c.untyped_storage().data_ptr()
    for other, t in (("a", a), ("b", b)):
        if t.numel() == 0 or t.untyped_storage().data_ptr() != storage:
            continue
        (c0, c1), (t0, t1) = extent(c), extent(t)
        if c0 < t1 and t0 < c1 and _share_an_element(c, t):
            raise RuntimeError(
                f"{name}: c is written in place, but it shares memory with {other} (bytes "
                f"[{c0 - storage}, {c1 - storage}) and [{t0 - storage}, {t1 - storage}) of one "
                f"storage), which the product reads while c is written; pass a copy of {other} "
                f"({other}.clone())")


class GemmBwdOp(GemmOp):
    """The gradient of :class:`GemmFwdOp`: two products of the same slot, each written in its
    operand's layout (``da`` is ``[K, M]`` when ``trans_a``, ``db`` ``[N, K]`` when
    ``trans_b``), so no transpose is ever materialised:

    ======== ==================================== ====================================
    trans    da                                   db
    ======== ==================================== ====================================
    a false  dc @ op(b)^T: (dc, b), tb = not tb   (false) op(a)^T @ dc: (a, dc), ta = not ta
    a true   op(b) @ dc^T: (b, dc), (tb, true)    (true) dc^T @ op(a): (dc, a), (true, ta)
    ======== ==================================== ====================================
    """

    def forward(self, call, dc, a, b, da, db) -> None:
        m, n, k = self._read_mnk(call)
        dev, dt, ta, tb = call.device, call.d_dc, self.trans_a, self.trans_b
        if da is not None:
            if ta:
                self._product(dev, dt, b, dc, da, k, m, n, tb, True)
            else:
                self._product(dev, dt, dc, b, da, m, k, n, False, not tb)
        if db is not None:
            if tb:
                self._product(dev, dt, dc, a, db, n, k, m, True, ta)
            else:
                self._product(dev, dt, a, dc, db, k, n, m, not ta, False)

    def reference(self, call, dc, a, b):
        wide = torch.float64 if dc.dtype == torch.float64 else torch.float32
        dc, a, b = dc.to(wide), a.to(wide), b.to(wide)
        opb = b.T if self.trans_b else b  # [K, N]
        opa = a.T if self.trans_a else a  # [M, K]
        da = db = None
        if self.grad_a:
            da = dc @ opb.T  # [M, K]
            da = da.T if self.trans_a else da
        if self.grad_b:
            db = opa.T @ dc  # [K, N]
            db = db.T if self.trans_b else db
        return da, db
