"""Reductions: sum, mean, prod, amax, amin, var, std, var_mean, the 2-norm, all, any, argmax,
argmin, over any set of dims with torch's calling conventions.

:class:`ReductionOp` is the family base. Every op of the family reduces ``x`` over ``dim``, so
the base owns the forward flow they share:

- layout: the reduced axes become the middle of a contiguous ``(outer, R, inner)`` view.
  Axes of size 1 are dropped, then adjacent reduced axes merge into one and adjacent kept axes
  into one; when the reduced axes then form one run (the last dims, the leading dims, one dim,
  every dim), the view is ``x`` itself (copied only where ``x`` is not contiguous or not
  16-byte aligned). When they do not (``dim=(0, 2)`` of a 3-D tensor), ``x`` is permuted once,
  kept axes first and reduced axes last, into a contiguous copy that is reduced as rows. One
  permute copy rather than reducing twice: a second reduction of a partial result is not the
  reduction for the moments (var of a var) nor for argmax, and the copy keeps every kind on
  the same two kernels; it costs a write and a read of ``x`` more.
- the call spec: :class:`~tileops.kernels.reduction.ReductionSpec` from the view's three sizes,
  the input's dtype and the op's :attr:`~ReductionOp.kind` (plus ``correction`` for the
  moments); which program serves it (rows for ``inner == 1``, columns otherwise, split across
  CTAs when the output alone would not fill the GPU) is the kernels' choice;
- the slot ``reduction``, ``forward(x, out, out2)``: the outputs as flat views of the
  ``reduce_shape(S, dim, keepdim)`` tensors the signature allocated.

The layout of a shape is computed once per (device, dtype, shape) and kept with its kernel
entry, so a cached call is one dictionary lookup and the kernel.

A leaf op is its spec entry (``specs/reduction.yaml``) plus its kind and its torch function,
which is both the eager contender and, on float32 or float64 copies (integers as they are),
the reference.

The gradients of sum and mean (:class:`SumBwdOp`, :class:`MeanBwdOp`) are a broadcast, not a
reduction: ``dy`` spread back over the reduced axes (divided by the count of elements reduced
into each, for mean). They run on the elementwise family's kernels (:class:`ReductionBwdOp`
derives its call from :class:`~tileops.ops._elementwise_base.ElementwiseOp`): ``dy`` viewed
with the reduced axes kept as 1s and expanded to ``x``'s shape, so the kernel reads it with
stride 0 along them and writes ``dx`` once. ``x`` is declared ``shape_only``: the forward's
autograd node keeps a one-element stand-in of it, not its memory. The gradients of amax and amin
(:class:`AmaxBwdOp`, :class:`AminBwdOp`) follow torch's rule, ``dy / count * mask`` with ``mask``
the elements equal to the extremum: the mask (an elementwise compare), its count over the
reduced axes (the sum's kernels, a delegate), the share ``dy / count`` in ``dy``'s dtype (the
count rounded to it first, as torch's division of a 16-bit tensor by an int64 one rounds it),
then the share spread and multiplied by the mask into ``dx`` (so a NaN extremum, which no
element equals, gives NaN as torch's does). The gradients of var and std (:class:`VarBwdOp`,
:class:`StdBwdOp`) are torch's formulas step by step, each rounded to the tensors' dtype as
torch's are: the mean (a delegate), ``x - mean``, the scaled ``dy`` (for std first ``dy / (2
y)``, 0 where ``y`` is 0), their product; var_mean's (:class:`VarMeanBwdOp`) adds the mean's share of ``dmean`` to var's of
``dvar``, each where given. Prod's (:class:`ProdBwdOp`) is torch's ``prod_backward`` of the
forward's torch function, in torch's ops: ``dy * (y / x)`` without zeros, the product of the
others (exclusive products from both ends) with them, and zeros for two zeros over every axis.
The 2-norm's (:class:`L2NormBwdOp`) is torch's ``x * (dy / y)``, the quotient 0
where the norm is.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, get_args

import torch

from tileops.kernels.reduction import (
    ReduceKind,
    ReductionColumnKernel,
    ReductionDType,
    ReductionInterface,
    ReductionRowKernel,
    ReductionSpec,
)
from tileops.runtime import Op
from tileops.spec.primitives import reduce_shape

from ._dtypes import NAMES, refuse_unserved
from ._elementwise_base import ElementwiseOp

__all__ = [
    "AllFwdOp",
    "AmaxBwdOp",
    "AmaxFwdOp",
    "AminBwdOp",
    "AminFwdOp",
    "AnyFwdOp",
    "ArgmaxFwdOp",
    "ArgminFwdOp",
    "L2NormBwdOp",
    "L2NormFwdOp",
    "MeanBwdOp",
    "MeanFwdOp",
    "ProdBwdOp",
    "ProdFwdOp",
    "ReductionBwdOp",
    "ReductionOp",
    "StdBwdOp",
    "StdFwdOp",
    "SumBwdOp",
    "SumFwdOp",
    "VarBwdOp",
    "VarFwdOp",
    "VarMeanBwdOp",
    "VarMeanFwdOp",
]

#: the input dtypes the in-tree reduction kernels serve (bool through its uint8 view)
_KERNEL_DTYPES = frozenset(get_args(ReductionDType))


def reduced_axes(rank: int, dim: Any) -> tuple[int, ...]:
    """The axes ``dim`` names, wrapped, in increasing order (None or ``()``: every axis; a 0-dim
    tensor's ``0`` / ``-1`` name no axis). The signature has checked the range and repeats."""
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return tuple(range(rank))
    if rank == 0:
        return ()
    dims = (dim,) if isinstance(dim, int) else dim
    return tuple(sorted(d % rank for d in dims))


def view_plan(shape: tuple[int, ...], axes: tuple[int, ...]
              ) -> tuple[tuple[int, ...] | None, int, int, int]:
    """``(perm, outer, r, inner)``: the ``(outer, r, inner)`` view that reduces ``axes`` of a
    contiguous tensor of ``shape`` over ``r``, and the permutation to apply first (a copy)
    where the reduced axes do not form one run once axes of size 1 are dropped (None where
    they do)."""
    red = set(axes)
    runs: list[list[Any]] = []  # [reduced, size], adjacent equal flags merged
    for i, n in enumerate(shape):
        if n == 1:
            continue
        flag = i in red
        if runs and runs[-1][0] == flag:
            runs[-1][1] *= n
        else:
            runs.append([flag, n])
    reduced = [i for i, (flag, _) in enumerate(runs) if flag]
    if not reduced:  # nothing but size-1 axes reduced: every output is one element
        return None, 1, 1, math.prod(shape)
    if len(reduced) == 1:
        at = reduced[0]
        return (None, math.prod(n for _, n in runs[:at]), runs[at][1],
                math.prod(n for _, n in runs[at + 1:]))
    kept = tuple(i for i in range(len(shape)) if i not in red)
    r = math.prod(shape[i] for i in axes)
    return (*kept, *axes), math.prod(shape[i] for i in kept), r, 1


class ReductionOp(Op):
    """Family base of the reductions (see the module docstring). A subclass sets :attr:`kind`
    and :meth:`_torch`."""

    kind: ClassVar[ReduceKind]
    kernel_types = {ReductionInterface: (ReductionRowKernel, ReductionColumnKernel)}

    def derive(self) -> None:
        #: (device, dtype, shape) -> (entry, perm, (outer, r, inner))
        self._layouts: dict[tuple, tuple] = {}

    def _correction(self) -> float:
        return 0.0

    def forward(self, call, x, out, out2=None) -> None:
        key = (call.device, x.dtype, x.shape)
        hit = self._layouts.get(key)  # the cached call: one lookup
        if hit is None:
            hit = self._layouts[key] = self._plan(call, x)
        entry, perm, view = hit
        if entry is None:  # an empty output: nothing to write
            return
        if perm is not None:
            x = x.permute(perm).contiguous()
        elif not x.is_contiguous() or x.data_ptr() % 16:
            x = x.contiguous() if not x.is_contiguous() else x.clone()
        entry(x.view(view), out.view(-1), None if out2 is None else out2.view(-1))

    def _plan(self, call, x) -> tuple:
        dtype = x.dtype
        refuse_unserved(self, dtype, _KERNEL_DTYPES, "reduction")
        if not math.prod(reduce_shape(tuple(x.shape), self.dim, self.keepdim)):
            return None, None, None
        perm, outer, r, inner = view_plan(tuple(x.shape), reduced_axes(x.dim(), self.dim))
        correction = self._correction()
        entry = self.kernel_for(
            (call.device, dtype, outer, r, inner), ReductionInterface,
            lambda: ReductionSpec(device=call.device, kind=self.kind, outer=outer, r=r,
                                  inner=inner, dtype=NAMES[dtype], correction=correction))
        return entry, perm, (outer, r, inner)

    def _dims(self, x: torch.Tensor) -> Any:
        """``dim`` as torch's functions take it: None, and the empty tuple, as every axis
        spelled out (``torch.amax`` and the moments have no None of their own; all and any,
        whose ``()`` torch reads as no axis, refuse it in their entries)."""
        if self.dim is None or self.dim == ():
            return tuple(range(x.dim()))
        return self.dim

    def _torch(self, x: torch.Tensor) -> Any:
        """The op's torch function of ``x`` (its outputs: a tensor or a tuple)."""
        raise NotImplementedError

    def reference(self, call, x):
        # float32 for a narrower floating input, float64 as handed; integers and bool as given
        wide = x.float() if x.is_floating_point() and x.dtype != torch.float64 else x
        out = self._torch(wide)
        return out if isinstance(out, tuple) else (out,)

    def eager(self):
        return self._torch


class SumFwdOp(ReductionOp):
    kind = ReduceKind.SUM

    def _torch(self, x):  # torch.sum
        return torch.sum(x, self._dims(x), keepdim=self.keepdim)


class MeanFwdOp(ReductionOp):
    kind = ReduceKind.MEAN

    def _torch(self, x):  # torch.mean
        return torch.mean(x, self._dims(x), keepdim=self.keepdim)


class ProdFwdOp(ReductionOp):
    kind = ReduceKind.PROD

    def _torch(self, x):  # torch.prod takes one dim: a product over each in turn
        dims = reduced_axes(x.dim(), self.dim)
        if x.dim() == 0 or len(dims) == x.dim():  # every axis: torch.prod(x)'s gradient too
            y = torch.prod(x)
            return y.reshape((1,) * x.dim()) if self.keepdim else y
        out = x
        for d in sorted(dims, reverse=True):
            out = torch.prod(out, d, keepdim=True)
        if not self.keepdim and dims:
            out = out.squeeze(dims)
        return out


class AmaxFwdOp(ReductionOp):
    kind = ReduceKind.AMAX

    def _torch(self, x):  # torch.amax
        return torch.amax(x, self._dims(x), keepdim=self.keepdim)


class AminFwdOp(ReductionOp):
    kind = ReduceKind.AMIN

    def _torch(self, x):  # torch.amin
        return torch.amin(x, self._dims(x), keepdim=self.keepdim)


class _MomentsOp(ReductionOp):
    def _correction(self) -> float:
        return 1.0 if self.correction is None else float(self.correction)  # None: torch's 1


class VarFwdOp(_MomentsOp):
    kind = ReduceKind.VAR

    def _torch(self, x):  # torch.var
        return torch.var(x, self._dims(x), correction=self.correction, keepdim=self.keepdim)


class StdFwdOp(_MomentsOp):
    kind = ReduceKind.STD

    def _torch(self, x):  # torch.std
        return torch.std(x, self._dims(x), correction=self.correction, keepdim=self.keepdim)


class VarMeanFwdOp(_MomentsOp):
    kind = ReduceKind.VAR_MEAN

    def _torch(self, x):  # torch.var_mean
        return torch.var_mean(x, self._dims(x), correction=self.correction,
                              keepdim=self.keepdim)


class L2NormFwdOp(ReductionOp):
    kind = ReduceKind.L2NORM

    def _torch(self, x):  # torch.linalg.vector_norm(x, 2, dim, keepdim)
        return torch.linalg.vector_norm(x, 2, self.dim, keepdim=self.keepdim)


class AllFwdOp(ReductionOp):
    kind = ReduceKind.ALL

    def _torch(self, x):  # torch.all
        return torch.all(x, self._dims(x), keepdim=self.keepdim)


class AnyFwdOp(ReductionOp):
    kind = ReduceKind.ANY

    def _torch(self, x):  # torch.any
        return torch.any(x, self._dims(x), keepdim=self.keepdim)


class ArgmaxFwdOp(ReductionOp):
    kind = ReduceKind.ARGMAX

    def _torch(self, x):  # torch.argmax
        return torch.argmax(x, self.dim, keepdim=self.keepdim)


class ArgminFwdOp(ReductionOp):
    kind = ReduceKind.ARGMIN

    def _torch(self, x):  # torch.argmin
        return torch.argmin(x, self.dim, keepdim=self.keepdim)


# --- the gradients ------------------------------------------------------------------------------


class ReductionBwdOp(ElementwiseOp):
    """Base of the reductions' gradients, which run on the elementwise kernels (see the module
    docstring). Its own call is sum's and mean's: ``dx`` is ``dy`` broadcast back over the
    axes ``dim`` reduced, combined with one 0-dim operand by the leaf's :attr:`fn` (its
    :meth:`_operand`), ``x`` read for its shape only; the other leaves write their own
    ``forward`` from the same pieces (``_spread``, ``_count``, ``_const``, ``_quotient``)."""

    def constants(self) -> tuple:
        return ()

    def output_layout(self, inputs: tuple, shape: tuple) -> tuple[int, ...] | None:
        return None  # dx is contiguous: x's stand-in has no layout to follow

    def _spread(self, dy: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """``dy`` with the reduced axes kept as 1s, expanded to ``shape`` (a view where dy's
        strides allow it)."""
        return dy.reshape(reduce_shape(tuple(shape), self.dim, True)).expand(shape)

    def _count(self, shape: torch.Size) -> int:
        """How many elements were reduced into each output."""
        return math.prod(shape[a] for a in reduced_axes(len(shape), self.dim))

    def _operand(self, dy: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        raise NotImplementedError

    def _quotient(self, call, num: torch.Tensor, den: torch.Tensor, y: torch.Tensor
                  ) -> torch.Tensor:
        """``(num / den).masked_fill(y == 0, 0)`` in ``num``'s dtype (std's and the 2-norm's
        share of ``dy``; tensors of the kept shape)."""
        share = torch.empty(num.shape, dtype=num.dtype, device=num.device)
        self._launch(call, [num, den], (share,), ("div", ()))
        at_zero = torch.empty(y.shape, dtype=torch.bool, device=y.device)
        self._launch(call, [y, self._const(0.0, y)], (at_zero,), ("eq", ()))
        out = torch.empty(num.shape, dtype=num.dtype, device=num.device)
        self._launch(call, [share, at_zero], (out,), ("masked_fill", (0.0,)))
        return out

    def forward(self, call, dy, x, dx) -> None:
        self._launch(call, [self._spread(dy, x.shape), self._operand(dy, x.shape)], (dx,))

    def _grad(self, dy: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        raise NotImplementedError

    def reference(self, call, dy, x):
        wide = dy if dy.dtype == torch.float64 else dy.float()
        return (self._grad(wide, x.shape),)

    def eager(self):
        def eager(dy, x):  # torch's own backward: the expanded gradient, then its copy
            return self._grad(dy, x.shape).contiguous()
        return eager


class SumBwdOp(ReductionBwdOp):
    fn = "mul"  # dy * 1: exact, signed zeros and NaN included

    def _operand(self, dy, shape):
        return self._const(1.0, dy)

    def _grad(self, dy, shape):  # torch: sum_backward
        return self._spread(dy, shape)


class MeanBwdOp(ReductionBwdOp):
    fn = "div"  # dy / n in float32 (float64 for float64), rounded once, as torch's

    def _operand(self, dy, shape):
        wide = torch.float64 if dy.dtype == torch.float64 else torch.float32
        return self._const(float(self._count(shape)), dy, wide)

    def _grad(self, dy, shape):  # torch: mean_backward, grad.expand(sizes) / numel
        return self._spread(dy, shape) / self._count(shape)


class _ExtremumBwdOp(ReductionBwdOp):
    """The gradient of amax or amin (see the module docstring)."""

    fn = "mul"
    delegate_types = {"count": SumFwdOp}

    def forward(self, call, dy, x, y, dx) -> None:
        shape = x.shape
        keep = reduce_shape(tuple(shape), self.dim, True)
        mask = torch.empty(shape, dtype=torch.bool, device=x.device)
        self._launch(call, [x, y.reshape(keep).expand(shape)], (mask,), ("eq", ()))
        with self.stage("count"):
            count = self.delegate_for("count", dim=self.dim, keepdim=True)(mask)
        share = torch.empty(keep, dtype=dy.dtype, device=dy.device)
        self._launch(call, [dy.reshape(keep), count], (share,), ("div", ()))
        self._launch(call, [share.expand(shape), mask], (dx,), ("mul", ()))

    def _closed_form(self, dy, x, y):
        keep = reduce_shape(tuple(x.shape), self.dim, True)
        mask = x == y.reshape(keep)
        count = mask.sum(reduced_axes(x.dim(), self.dim), keepdim=True)
        return dy.reshape(keep) / count * mask

    def reference(self, call, dy, x, y):
        wide = [t if t.dtype == torch.float64 else t.float() for t in (dy, x, y)]
        return (self._closed_form(*wide),)

    def eager(self):
        def eager(dy, x, y):  # torch's amax_backward in the tensors' dtype
            return self._closed_form(dy, x, y)
        return eager


class AmaxBwdOp(_ExtremumBwdOp):
    pass


class AminBwdOp(_ExtremumBwdOp):
    pass


class _MomentBwdOp(ReductionBwdOp):
    """The gradient of var or std (see the module docstring)."""

    fn = "mul"
    delegate_types = {"mean": MeanFwdOp}

    def _dof(self, shape: torch.Size) -> float:
        return self._count(shape) - (1.0 if self.correction is None else float(self.correction))

    def _scale(self, shape: torch.Size) -> float:
        """``2 / (n - correction)``: inf where that is 2 / 0, as torch's."""
        dof = self._dof(shape)
        return math.inf if dof == 0 else 2.0 / dof

    def _no_dof(self, x: torch.Tensor) -> bool:
        """torch's other branch: without a dim (None, or a 0-dim x) and no degree of freedom
        left (``n - correction <= 0``), the gradient is ``g * where(x == mean, nan, inf)``."""
        return (self.dim is None or x.dim() == 0) and self._dof(x.shape) <= 0

    def _var_grad(self, call, g: torch.Tensor, x: torch.Tensor, dx: torch.Tensor) -> None:
        """``dx = (2 / (n - correction)) * g * (x - mean)``, ``g`` of the kept shape."""
        shape = x.shape
        with self.stage("mean"):
            mean = self.delegate_for("mean", dim=self.dim, keepdim=True)(x)
        if self._no_dof(x):
            at_mean = torch.empty(shape, dtype=torch.bool, device=x.device)
            self._launch(call, [x, mean.expand(shape)], (at_mean,), ("eq", ()))
            nan = self._const(math.nan, dx)
            inf = self._const(math.inf, dx)
            self._launch(call, [at_mean, nan, inf], (dx,), ("where", ()))
            self._launch(call, [g.expand(shape), dx], (dx,), ("mul", ()))
            return
        diff = torch.empty(shape, dtype=x.dtype, device=x.device)
        self._launch(call, [x, mean.expand(shape)], (diff,), ("sub", (1.0,)))
        wide = torch.float64 if g.dtype == torch.float64 else torch.float32
        scaled = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        self._launch(call, [g, self._const(self._scale(shape), g, wide)], (scaled,),
                     ("mul", ()))
        self._launch(call, [scaled.expand(shape), diff], (dx,), ("mul", ()))

    def _closed_form(self, dy, x, y=None):
        keep = reduce_shape(tuple(x.shape), self.dim, True)
        g = dy.reshape(keep)
        if y is not None:  # std: torch's std_backward
            y = y.reshape(keep)
            g = (g / (y * 2)).masked_fill(y == 0, 0)
        mean = x.mean(reduced_axes(x.dim(), self.dim), keepdim=True)
        if self._no_dof(x):
            return g * torch.where(x == mean, math.nan, math.inf).to(g.dtype)
        return self._scale(x.shape) * g * (x - mean)

    def reference(self, call, dy, x, y=None):
        wide = [None if t is None else t if t.dtype == torch.float64 else t.float()
                for t in (dy, x, y)]
        return (self._closed_form(*wide),)

    def eager(self):
        return self._closed_form


class VarBwdOp(_MomentBwdOp):
    def forward(self, call, dy, x, dx) -> None:
        keep = reduce_shape(tuple(x.shape), self.dim, True)
        self._var_grad(call, dy.reshape(keep), x, dx)


class StdBwdOp(_MomentBwdOp):
    def forward(self, call, dy, x, y, dx) -> None:
        keep = reduce_shape(tuple(x.shape), self.dim, True)
        y = y.reshape(keep)
        twice = torch.empty(keep, dtype=y.dtype, device=y.device)
        self._launch(call, [y, self._const(2.0, y)], (twice,), ("mul", ()))
        self._var_grad(call, self._quotient(call, dy.reshape(keep), twice, y), x, dx)


class L2NormBwdOp(ReductionBwdOp):
    """The gradient of the 2-norm (see the module docstring)."""

    fn = "mul"

    def forward(self, call, dy, x, y, dx) -> None:
        keep = reduce_shape(tuple(x.shape), self.dim, True)
        y = y.reshape(keep)
        share = self._quotient(call, dy.reshape(keep), y, y)
        self._launch(call, [x, share.expand(x.shape)], (dx,), ("mul", ()))

    def _closed_form(self, dy, x, y):  # torch's norm_backward for p = 2
        keep = reduce_shape(tuple(x.shape), self.dim, True)
        y = y.reshape(keep)
        return x * (dy.reshape(keep) / y).masked_fill(y == 0, 0)

    def reference(self, call, dy, x, y):
        wide = [t if t.dtype == torch.float64 else t.float() for t in (dy, x, y)]
        return (self._closed_form(*wide),)

    def eager(self):
        return self._closed_form


class VarMeanBwdOp(_MomentBwdOp):
    """The gradient of var_mean: var's of ``dvar`` plus mean's of ``dmean`` (torch's
    var_mean_backward), each where given."""

    def forward(self, call, x, dvar, dmean, dx) -> None:
        keep = reduce_shape(tuple(x.shape), self.dim, True)
        if dvar is not None:
            self._var_grad(call, dvar.reshape(keep), x, dx)
        if dmean is None:
            if dvar is None:
                dx.zero_()
            return
        wide = torch.float64 if dmean.dtype == torch.float64 else torch.float32
        count = self._const(float(self._count(x.shape)), dmean, wide)
        if dvar is None:
            self._launch(call, [dmean.reshape(keep).expand(x.shape), count], (dx,), ("div", ()))
            return
        share = torch.empty(keep, dtype=dmean.dtype, device=dmean.device)
        self._launch(call, [dmean.reshape(keep), count], (share,), ("div", ()))
        self._launch(call, [dx, share.expand(x.shape)], (dx,), ("add", (1.0,)))

    def _both(self, x, dvar, dmean):
        keep = reduce_shape(tuple(x.shape), self.dim, True)
        out = None
        if dvar is not None:
            out = self._closed_form(dvar, x)
        if dmean is not None:
            mean = (dmean.reshape(keep) / self._count(x.shape)).expand(x.shape)
            out = mean if out is None else out + mean
        return torch.zeros_like(x) if out is None else out

    def reference(self, call, x, dvar=None, dmean=None):
        wide = [None if t is None else t if t.dtype == torch.float64 else t.float()
                for t in (x, dvar, dmean)]
        return (self._both(*wide),)

    def eager(self):
        def eager(x, dvar=None, dmean=None):
            return self._both(x, dvar, dmean)
        return eager


def _others_along(x: torch.Tensor, d: int) -> torch.Tensor:
    """The product of the other elements along axis ``d``, from exclusive cumulative products
    taken from both ends (torch's ``prod_safe_zeros_backward``: no division)."""
    n = x.shape[d]
    ones = torch.ones_like(x.narrow(d, 0, 1))
    before = torch.cat([ones, x.narrow(d, 0, n - 1)], d).cumprod(d)
    after = torch.cat([ones, x.narrow(d, 1, n - 1).flip(d)], d).cumprod(d).flip(d)
    return before * after


def _prod_grad_all(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """torch's gradient of ``torch.prod(x)`` over every element (``prod_backward`` without a
    dim): ``dy * (y / x)`` where ``x`` holds no zero (a NaN or an infinity then gives NaN
    where it is, as the division does), the product of the others where it holds one zero,
    and zeros where it holds more (whatever NaN the others hold), as a backward computes it;
    chosen by a 0-dim count, without reading it on the host."""
    flat = x.reshape(-1)
    g = dy.reshape(())
    zeros = (flat == 0).sum()
    plain = g * (flat.prod() / flat)
    safe = g * _others_along(flat, 0)
    return torch.where(zeros == 0, plain,
                       torch.where(zeros == 1, safe, torch.zeros_like(safe))).reshape(x.shape)


def _prod_grad_dim(g: torch.Tensor, x: torch.Tensor, y: torch.Tensor, d: int) -> torch.Tensor:
    """torch's gradient of ``torch.prod(x, d, keepdim=True)`` (``y``; ``g`` of its shape):
    ``g * (y / x)`` where ``x`` holds no zero at all, else the product of the others along
    ``d`` (for every run, as torch's ``prod_backward`` decides on the whole tensor)."""
    return torch.where((x == 0).any(), g * _others_along(x, d), g * (y / x))


class ProdBwdOp(ReductionBwdOp):
    """The gradient of prod (see the module docstring): torch's ``prod_backward`` of the
    forward's torch function, in torch's ops (no in-tree kernel). Over every axis that is
    ``torch.prod(x)``'s (:func:`_prod_grad_all`); over some axes, torch's gradient of a
    product over each axis in turn, the last axis first (:func:`_prod_grad_dim` for each,
    from the last product back). Where the product holds a NaN or an infinity, torch's
    division places NaN where it does (``x = [1, nan, 2]`` gives ``[nan, nan, nan]``, not
    the product of the others at the NaN), and two zeros give zeros."""

    fn = "mul"  # no kernel runs: torch's ops

    def _others(self, dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """torch's gradient, in the tensors' dtype."""
        axes = reduced_axes(x.dim(), self.dim)
        if not axes:
            return dy.reshape(x.shape).clone()
        if not x.numel():
            return torch.zeros(x.shape, dtype=dy.dtype, device=dy.device)
        if len(axes) == x.dim():
            return _prod_grad_all(dy, x)
        steps = sorted(axes, reverse=True)  # the forward's order (ProdFwdOp._torch)
        products = [x]
        for d in steps:
            products.append(torch.prod(products[-1], d, keepdim=True))
        g = dy.reshape(products[-1].shape)
        for k in reversed(range(len(steps))):
            g = _prod_grad_dim(g, products[k], products[k + 1], steps[k])
        return g

    def forward(self, call, dy, x, dx) -> None:
        dx.copy_(self._others(dy, x))

    def reference(self, call, dy, x):
        wide = [t if t.dtype == torch.float64 else t.float() for t in (dy, x)]
        return (self._others(*wide),)

    def eager(self):
        return self._others
