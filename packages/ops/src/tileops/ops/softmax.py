"""Softmax and log-softmax over one axis, logsumexp over one or several, and their gradients.

:class:`SoftmaxFamilyOp` is the family base of the forward ops and :class:`SoftmaxGradOp` of
the gradients. Every op of the family reduces one axis ``dim`` of a tensor (logsumexp's axes
``dim`` become one, as the reductions merge theirs), so the bases own the flow they share:

- layout: the tensor as the ``(outer, R, inner)`` view of its contiguous form (``outer`` the
  product of the axes before ``dim``, ``inner`` of those after it). The kernels read that view
  in place, whichever axis is reduced (no transposing copy); an input that is not contiguous,
  or starts off a 16-byte boundary, is copied first (the kernels read 16-byte vectors);
- the call spec: :class:`~tileops.kernels.softmax.SoftmaxSpec` (or ``SoftmaxBwdSpec``) from
  the shape and dtype the signature check read and the op's :attr:`kind`; which kernel a view
  gets (rows held in registers, two passes over wide rows, the strided walk of an inner axis)
  is the kernels' choice;
- an empty tensor launches nothing (logsumexp over an empty axis fills its output with
  ``-inf``, as torch).

A leaf op is its spec entry (``specs/softmax.yaml``), its kind and its declared equivalents:
the reference, the torch eager function and the Liger-Kernel peer, each stated once here.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, get_args

import torch

from tileops.kernels.softmax import (
    LogSumExpBwdInterface,
    LogSumExpBwdRowsKernel,
    LogSumExpBwdSpec,
    LogSumExpBwdStridedKernel,
    SoftmaxBwdInterface,
    SoftmaxBwdLoopedKernel,
    SoftmaxBwdRegisterKernel,
    SoftmaxBwdSpec,
    SoftmaxBwdStridedKernel,
    SoftmaxDType,
    SoftmaxFwdInterface,
    SoftmaxKind,
    SoftmaxLoopedKernel,
    SoftmaxRegisterKernel,
    SoftmaxSpec,
    SoftmaxStridedKernel,
)
from tileops.runtime import Op

from ._dtypes import NAMES, refuse_unserved
from .reduction import reduced_axes, view_plan

__all__ = [
    "LogSoftmaxBwdOp",
    "LogSoftmaxFwdOp",
    "LogSumExpBwdOp",
    "LogSumExpFwdOp",
    "SoftmaxBwdOp",
    "SoftmaxFamilyOp",
    "SoftmaxFwdOp",
    "SoftmaxGradOp",
]

#: the dtypes the softmax kernels state they serve
_KERNEL_DTYPES = frozenset(get_args(SoftmaxDType))
#: Liger's softmax refuses rows wider than this (measured on the H200)
_LIGER_MAX_COLS = 65536


def view_of(shape: tuple[int, ...], dim: int) -> tuple[int, int, int]:
    """``(outer, r, inner)`` of a reduction over axis ``dim`` (already in range) of ``shape``;
    a 0-dim tensor is one element reduced over a length-1 axis, as torch treats it."""
    if not shape:
        return 1, 1, 1
    a = dim % len(shape)
    return math.prod(shape[:a]), shape[a], math.prod(shape[a + 1:])


def _in_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at a 16-byte aligned address: itself where it is, else a copy."""
    if t.is_contiguous() and (not t.storage_offset() or t.data_ptr() % 16 == 0):
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


class SoftmaxFamilyOp(Op):
    """Family base of the forward ops (see the module docstring). A subclass sets
    :attr:`kind`."""

    kind: ClassVar[SoftmaxKind]
    kernel_types = {SoftmaxFwdInterface: (SoftmaxRegisterKernel, SoftmaxLoopedKernel,
                                          SoftmaxStridedKernel)}

    def forward(self, call, x, y) -> None:
        shape = x.shape
        dtype = x.dtype
        key = (call.device, dtype, shape)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            if x.numel() == 0:  # an output element of an empty input is a sum of nothing
                y.fill_(-math.inf)
                return
            refuse_unserved(self, dtype, _KERNEL_DTYPES, "softmax")
            outer, r, inner = view_of(tuple(shape), self.dim)
            entry = self.kernel_for(key, SoftmaxFwdInterface, lambda: SoftmaxSpec(
                device=call.device, kind=self.kind, outer=outer, r=r, inner=inner,
                dtype=NAMES[dtype]))
        entry(_in_layout(x), y)


class SoftmaxFwdOp(SoftmaxFamilyOp):
    kind = SoftmaxKind.SOFTMAX

    def reference(self, call, x):
        return (torch.softmax(_wide(x), self.dim),)

    def eager(self):
        dim = self.dim

        def softmax(x):  # torch.softmax
            return torch.softmax(x, dim)

        return softmax

    peers = {"liger": lambda op: _liger_softmax(op)}


class LogSoftmaxFwdOp(SoftmaxFamilyOp):
    kind = SoftmaxKind.LOG_SOFTMAX

    def reference(self, call, x):
        return (torch.log_softmax(_wide(x), self.dim),)

    def eager(self):
        dim = self.dim

        def log_softmax(x):  # torch.log_softmax
            return torch.log_softmax(x, dim)

        return log_softmax


class LogSumExpFwdOp(SoftmaxFamilyOp):
    """``torch.logsumexp`` over one axis or several: the reduced axes become the middle of
    the ``(outer, R, inner)`` view as the reductions lay them out
    (:func:`~tileops.ops.reduction.view_plan`): read in place where they form one run, else
    ``x`` permuted once into rows, kept axes first (a copy)."""

    kind = SoftmaxKind.LOGSUMEXP

    def derive(self) -> None:
        #: (device, dtype, shape) -> the permutation a call of that shape takes first, for
        #: the shapes that take one (empty while none does: the cached call tests a dict)
        self._perms: dict[tuple, tuple[int, ...]] = {}

    def forward(self, call, x, lse) -> None:
        key = (call.device, x.dtype, x.shape)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            if x.numel() == 0:  # an output element of an empty input is a sum of nothing
                lse.fill_(-math.inf)
                return
            entry = _logsumexp_entry(self, key, x, SoftmaxFwdInterface, SoftmaxSpec)
        perm = self._perms.get(key) if self._perms else None
        entry(_in_layout(x) if perm is None else x.permute(perm).contiguous(), lse)

    def reference(self, call, x):
        return (torch.logsumexp(_wide(x), self.dim, self.keepdim),)

    def eager(self):
        dim, keepdim = self.dim, self.keepdim

        def logsumexp(x):  # torch.logsumexp
            return torch.logsumexp(x, dim, keepdim)

        return logsumexp


# --- gradients -----------------------------------------------------------------------------------


class SoftmaxGradOp(Op):
    """Family base of the gradients: ``dx`` from ``dy`` and the forward's output ``y``, each
    handed to the kernels as its contiguous ``(outer, R, inner)`` view (a gradient that is not
    contiguous, e.g. an expanded ``ones``, is copied). The references state each formula in
    closed form (a reference may run inside a compiled graph's custom op, where autograd does
    not record); the tests hold them to torch's autograd of the forward in float64."""

    kind: ClassVar[SoftmaxKind]
    kernel_types = {SoftmaxBwdInterface: (SoftmaxBwdRegisterKernel, SoftmaxBwdLoopedKernel,
                                          SoftmaxBwdStridedKernel)}

    def forward(self, call, dy, y, dx) -> None:
        shape = y.shape
        dtype = y.dtype
        key = (call.device, dtype, shape)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            if y.numel() == 0:
                return
            refuse_unserved(self, dtype, _KERNEL_DTYPES, "softmax")
            outer, r, inner = view_of(tuple(shape), self.dim)
            entry = self.kernel_for(key, SoftmaxBwdInterface, lambda: SoftmaxBwdSpec(
                device=call.device, kind=self.kind, outer=outer, r=r, inner=inner,
                dtype=NAMES[dtype]))
        entry(_in_layout(y), _in_layout(dy), dx)


class SoftmaxBwdOp(SoftmaxGradOp):
    kind = SoftmaxKind.SOFTMAX

    def reference(self, call, dy, y):
        dyf, yf = _wide(dy), _wide(y)
        return (yf * (dyf - (dyf * yf).sum(self.dim, keepdim=True)),)

    def eager(self):
        dim = self.dim

        def softmax_backward(dy, y):  # aten._softmax_backward_data
            return torch.ops.aten._softmax_backward_data(dy, y, dim, y.dtype)

        return softmax_backward


class LogSoftmaxBwdOp(SoftmaxGradOp):
    kind = SoftmaxKind.LOG_SOFTMAX

    def reference(self, call, dy, y):
        dyf, yf = _wide(dy), _wide(y)
        return (dyf - torch.exp(yf) * dyf.sum(self.dim, keepdim=True),)

    def eager(self):
        dim = self.dim

        def log_softmax_backward(dy, y):  # aten._log_softmax_backward_data
            return torch.ops.aten._log_softmax_backward_data(dy, y, dim, y.dtype)

        return log_softmax_backward


class LogSumExpBwdOp(Op):
    """logsumexp's gradient ``dx = dy * exp(x - lse)`` (the forward saves ``x`` and ``lse``;
    ``x`` comes first, binding the shape that ``dy``'s and ``lse``'s reduced one is read from):
    ``x`` and ``dx`` as the contiguous ``(outer, R, inner)`` view, ``dy`` and ``lse`` as the
    ``(outer, inner)`` one (a broadcast ``dy``, e.g. an expanded ``ones``, is copied)."""

    kernel_types = {LogSumExpBwdInterface: (LogSumExpBwdRowsKernel, LogSumExpBwdStridedKernel)}

    def derive(self) -> None:
        self._perms: dict[tuple, tuple[int, ...]] = {}  # as LogSumExpFwdOp's

    def forward(self, call, x, dy, lse, dx) -> None:
        key = (call.device, x.dtype, x.shape)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            if x.numel() == 0:
                return
            entry = _logsumexp_entry(self, key, x, LogSumExpBwdInterface, LogSumExpBwdSpec)
        perm = self._perms.get(key) if self._perms else None
        if perm is None:
            entry(_in_layout(dy), _in_layout(x), _in_layout(lse), dx)
            return
        # x permuted into rows as the forward read it; dx written in that order, then put back
        xp = x.permute(perm).contiguous()
        dxp = torch.empty_like(xp)
        entry(_in_layout(dy), xp, _in_layout(lse), dxp)
        dx.copy_(dxp.permute(_inverse(perm)))

    def reference(self, call, x, dy, lse):
        xf = _wide(x)
        return (_along(_wide(dy), xf, self.dim, self.keepdim)
                * torch.exp(xf - _along(_wide(lse), xf, self.dim, self.keepdim)),)

    def eager(self):
        dim, keepdim = self.dim, self.keepdim

        def logsumexp_backward(x, dy, lse):  # autograd's formula for torch.logsumexp
            return _along(dy, x, dim, keepdim) * torch.exp(x - _along(lse, x, dim, keepdim))

        return logsumexp_backward


def _logsumexp_entry(op: Any, key: tuple, x: torch.Tensor, interface: Any, spec: Any) -> Any:
    """The entry of logsumexp's forward or gradient for a call of ``x``'s shape over the op's
    axes, its permutation (if any) kept in ``op._perms``."""
    refuse_unserved(op, x.dtype, _KERNEL_DTYPES, "softmax")
    perm, outer, r, inner = view_plan(tuple(x.shape), reduced_axes(x.dim(), op.dim))
    if perm is not None:
        op._perms[key] = perm
    return op.kernel_for(key, interface, lambda: spec(
        device=key[0], kind=SoftmaxKind.LOGSUMEXP, outer=outer, r=r, inner=inner,
        dtype=NAMES[x.dtype]))


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def _along(t: torch.Tensor, x: torch.Tensor, dim: Any, keepdim: bool) -> torch.Tensor:
    """A reduced tensor ``t`` broadcastable against ``x`` along the axes ``dim``."""
    if keepdim:
        return t
    for a in reduced_axes(x.dim(), dim):  # increasing: each lands where it was in x
        t = t.unsqueeze(a)
    return t


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or as it is when it is float64 already."""
    return t if t.dtype == torch.float64 else t.float()


# --- Liger-Kernel peers (present when liger_kernel is installed) --------------------------------


def _liger_softmax(op: SoftmaxFwdOp) -> Any:
    try:
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except ImportError:
        return None
    if op.dim != -1:
        return None  # Liger's softmax reduces the last axis only

    def liger_softmax(x):
        if x.dim() == 0 or x.shape[-1] > _LIGER_MAX_COLS:
            raise NotImplementedError(f"Liger's softmax takes rows of at most "
                                      f"{_LIGER_MAX_COLS} columns")
        return LigerSoftmaxFunction.apply(x)

    return liger_softmax
