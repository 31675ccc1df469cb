"""Cumulative scans: ``torch.cumsum`` and ``torch.cumprod`` along one dim.

:class:`ScanOp` is the family base. Every op of the family scans ``x`` along ``dim``, so the
base owns the forward flow they share:

- layout: ``x`` as a contiguous ``(outer, length, inner)`` view at a 16-byte aligned address
  (``length`` the scanned dim, ``outer`` and ``inner`` the products of the dims before and
  after it; a 0-dim tensor is one element); an input that is not one already is copied, and a
  bool input is viewed as uint8 (the kernels read bytes and write int64, as torch does);
- the call spec: :class:`~tileops.kernels.scan.ScanSpec` from those three sizes, the input's
  dtype and the op's :attr:`~ScanOp.kind`; which program a call gets (the row scan for the
  last dim, the strided walk otherwise, split into segments when the call alone would not fill
  the GPU) is the kernels' choice;
- the slot ``scan_fwd``.

A leaf op is its spec entry (``specs/scan.yaml``) plus its kind and its declared equivalents:
the reference and the torch eager function, read by the ``reference`` target, the tests,
``tileops run`` and ``tileops bench``.

Cumsum trains: :class:`CumsumBwdOp` is the sum scan of ``dy`` taken from the end of ``dim``,
run as the forward's program on ``dy`` flipped along ``dim``, its result flipped back into
``dx`` (the flips are torch copies: the scan programs walk one direction). Cumprod trains
through :class:`CumprodBwdOp`, torch's ops in torch's zero-safe form, no in-tree kernel.
"""

from __future__ import annotations

import math
from typing import ClassVar, get_args

import torch

from tileops.kernels.scan import (
    ScanDType,
    ScanInterface,
    ScanKind,
    ScanRowKernel,
    ScanSpec,
    ScanStridedKernel,
)
from tileops.runtime import Op

from ._dtypes import NAMES, refuse_unserved

__all__ = ["CumprodBwdOp", "CumprodFwdOp", "CumsumBwdOp", "CumsumFwdOp", "ScanOp"]

#: the input dtypes the in-tree scan kernels serve (bool through its uint8 view)
_KERNEL_DTYPES = frozenset({*get_args(ScanDType), "bool"})


class ScanOp(Op):
    """Family base of the cumulative scans (see the module docstring). A subclass sets
    :attr:`kind`."""

    kind: ClassVar[ScanKind]
    kernel_types = {ScanInterface: (ScanRowKernel, ScanStridedKernel)}

    def forward(self, call, x, y) -> None:
        shape = x.shape
        nd = len(shape)
        d = self.dim % nd if nd else 0
        length = shape[d] if nd else 1
        outer = math.prod(shape[:d])
        inner = math.prod(shape[d + 1:])
        dtype = x.dtype
        key = (call.device, dtype, outer, length, inner)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            refuse_unserved(self, dtype, _KERNEL_DTYPES, "scan")
            name = "uint8" if dtype == torch.bool else NAMES[dtype]
            entry = self.kernel_for(key, ScanInterface, lambda: ScanSpec(
                device=call.device, kind=self.kind, outer=outer, length=length, inner=inner,
                dtype=name))
        if not x.is_contiguous() or x.data_ptr() % 16:
            x = x.contiguous() if not x.is_contiguous() else x.clone()
        if dtype == torch.bool:
            x = x.view(torch.uint8)
        entry(x.view(outer, length, inner), y.view(outer, length, inner))

    def _scan(self, x: torch.Tensor) -> torch.Tensor:
        """The op's torch function of ``x`` along ``dim`` (in torch's output dtype)."""
        raise NotImplementedError

    def reference(self, call, x):
        # float32 for a narrower floating input, float64 as handed; integers scan in int64
        wide = x.float() if x.is_floating_point() and x.dtype != torch.float64 else x
        return (self._scan(wide),)

    def eager(self):
        return self._scan


class CumsumFwdOp(ScanOp):
    kind = ScanKind.SUM

    def _scan(self, x):  # torch.cumsum
        return torch.cumsum(x, self.dim)


class CumprodFwdOp(ScanOp):
    kind = ScanKind.PROD

    def _scan(self, x):  # torch.cumprod
        return torch.cumprod(x, self.dim)


class CumsumBwdOp(ScanOp):
    kind = ScanKind.SUM

    def forward(self, call, dy, dx) -> None:
        if not dy.dim():  # one element: its own sum
            dx.copy_(dy)
            return
        d = self.dim % dy.dim()
        flipped = torch.empty_like(dx)
        super().forward(call, dy.flip(d), flipped)
        dx.copy_(flipped.flip(d))

    def _scan(self, dy):  # torch's cumsum_backward
        if not dy.dim():
            return dy.clone()
        d = self.dim % dy.dim()
        return dy.flip(d).cumsum(d).flip(d)


class CumprodBwdOp(ScanOp):
    """The gradient of cumprod: ``dx[i] = sum over j >= i of dy[j] * prod(x[k] for k <= j,
    k != i)`` along ``dim``, in torch's zero-safe form (``cumprod_backward``). Before a run's
    first zero, the reversed cumulative sum of ``dy * y`` divided by ``x``; at the first zero,
    the sum of ``dy`` times the products with that zero taken as one, up to the second zero;
    after it, 0 (each product holds the zero). Each part reads ``dy`` over its own stretch
    only, so a NaN or inf of ``dy`` past it (``log(cumprod(x))`` past a zero) stays out, as in
    torch; a run of one element gives ``dy`` as handed. Torch's ops on a float32 copy of a narrower input (float64 as
    handed), its result rounded into ``dx``: no in-tree kernel."""

    kind = ScanKind.PROD

    def _grad(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The gradient in the tensors' dtype (the caller widens them)."""
        d = self.dim % x.dim() if x.dim() else 0
        if x.numel() <= 1 or x.shape[d] == 1:  # y = x: dy as handed (torch: no x / x)
            return dy.clone()
        xs, g = x.movedim(d, -1), dy.movedim(d, -1)
        n = xs.shape[-1]
        idx = torch.arange(n, device=x.device)
        zero = xs == 0
        first = torch.where(zero, idx, n).amin(-1, keepdim=True)  # n: no zero
        second = torch.where(zero & (idx > first), idx, n).amin(-1, keepdim=True)
        before, at = idx < first, idx == first
        one = torch.ones((), dtype=x.dtype, device=x.device)
        # before the first zero: the reversed sum of dy * y over that stretch only (past it y
        # is 0, and a NaN or inf of dy there must not reach the sum), divided by x
        tail = torch.where(before, g * xs.cumprod(-1), 0).flip(-1).cumsum(-1).flip(-1)
        grad = torch.where(before, tail / torch.where(before, xs, one), 0)
        # at the first zero: dy times the products with that zero taken as one, up to the
        # second zero (past it every product holds that zero)
        skip = torch.where(at, one, xs).cumprod(-1)
        span = (idx >= first) & (idx < second)
        at_zero = torch.where(span, g * skip, 0).sum(-1, keepdim=True)
        return torch.where(at, at_zero, grad).movedim(-1, d)

    @staticmethod
    def _wide(t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == torch.float64 else t.float()

    def forward(self, call, dy, x, dx) -> None:
        dx.copy_(self._grad(self._wide(dy), self._wide(x)))

    def reference(self, call, dy, x):
        return (self._grad(self._wide(dy), self._wide(x)),)

    def eager(self):
        return self._grad
