"""Row normalizations: RMSNorm, fused add + RMSNorm, LayerNorm.

:class:`RowNormOp` is the family base. Every op of the family normalizes the rows of an
``(rows, n)`` view of its inputs, so the base owns the forward flow they share:

- layout: each row tensor as a contiguous ``(rows, n)`` view at a 16-byte aligned address (the
  kernels read 16-byte vectors with unit stride), each affine tensor as a contiguous ``(n,)``;
  a tensor that is not one already is copied, and an output that had to be copied (an in-place
  op writing a non-contiguous input) is copied back after the kernel;
- the call spec: :class:`~tileops.kernels.norm.RowNormSpec` from the record (the row count
  and dtype the signature check read, which optional inputs are present) and the op's
  :attr:`~RowNormOp.kind`; which launch plan a row count gets is the kernel's choice;
- the slot ``row_norm_fwd``, whose arguments ``(x, residual, weight, bias, y, residual_out)``
  are the family's tensor names: an op's inputs and outputs fill the ones they name;
- the affine tensors' dtype: the entries take a weight (and bias) in x's dtype or in float32,
  as torch's norms do; the kernels read them in x's dtype, so a float32 one is handed over as
  a copy in x's dtype, and the backward stores dweight and dbias in the weight's dtype
  (summed in fp32 and rounded once).

A leaf op is its spec entry (``specs/norm.yaml``) plus its kind, what is genuinely its own
(RMSNorm's ``eps=None`` meaning the epsilon of the math's dtype) and its declared equivalents: the
reference (:meth:`~tileops.runtime.Op.reference`), the torch eager function and the
Liger-Kernel peer, each stated once here and read by the ``reference`` target, the tests,
``tileops run`` and ``tileops bench``.
"""

from __future__ import annotations

import math
from operator import itemgetter
from typing import Any, ClassVar, get_args

import torch
import torch.nn.functional as F

from tileops.kernels.norm import (
    RowNormClusterKernel,
    RowNormDType,
    RowNormFwdInterface,
    RowNormKind,
    RowNormLoopedKernel,
    RowNormRegisterKernel,
    RowNormSpec,
    RowNormSplitKernel,
)
from tileops.kernels.norm_bwd import (
    RowNormBwdInterface,
    RowNormBwdLoopedKernel,
    RowNormBwdRegisterKernel,
    RowNormBwdSpec,
)
from tileops.runtime import Op

from ._dtypes import NAMES, refuse_unserved

__all__ = [
    "FusedAddRMSNormBwdOp",
    "FusedAddRMSNormFwdOp",
    "LayerNormBwdOp",
    "LayerNormFwdOp",
    "RMSNormBwdOp",
    "RMSNormFwdOp",
    "RowNormBwdOp",
    "RowNormOp",
]

#: the slot's arguments, in its forward's order
_SLOT_ARGS = ("x", "residual", "weight", "bias", "y", "residual_out")
#: the rank each slot argument is handed at: rows (rows, n), affine tensors (n,)
_DIMS = (2, 2, 1, 1, 2, 2)
#: no rank is a slot argument's layout as it stands (see ``_RowSlotOp.derive``)
_NO_DIMS = (-1,) * len(_DIMS)
#: eps None: the epsilon of the dtype the math runs in, as torch's rms_norm takes it (float32's
#: for float16 and bfloat16, whose own would swamp a row of small values)
_FINFO_EPS = {torch.float16: torch.finfo(torch.float32).eps,
              torch.bfloat16: torch.finfo(torch.float32).eps,
              torch.float32: torch.finfo(torch.float32).eps,
              torch.float64: torch.finfo(torch.float64).eps}


class _RowSlotOp(Op):
    """What the two family bases (:class:`RowNormOp`, :class:`RowNormBwdOp`) share, all of
    it settled at class definition or construction: the slot's argument positions by the
    entries' tensor names (:attr:`_slot_args`), the gatherer that picks them from
    ``(*inputs, *outputs, None)`` in one C call, the row length from ``normalized_shape`` or
    ``N``, the ``int`` spelling of ``normalized_shape``, and ``eps=None``'s refusal where the
    entry does not say what it means. The per-call lines stay in each ``forward`` (a shared
    helper would be one more call on the cached path)."""

    #: slot argument position of each tensor name an entry may use
    _slot_args: ClassVar[dict[str, int]]
    _slot_name: ClassVar[str]

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        plan = cls._signature
        if plan is None:
            return
        names = (*plan.input_names, *plan.output_names)
        unknown = [n for n in names if n not in cls._slot_args]
        if unknown:
            raise TypeError(f"{cls.__name__}: tensor {unknown[0]!r} of its entry is not an "
                            f"argument of the {cls._slot_name} slot "
                            f"({', '.join(cls._slot_args)})")
        order = [len(names)] * (max(cls._slot_args.values()) + 1)  # absent: the trailing None
        for i, n in enumerate(names):
            order[cls._slot_args[n]] = i
        cls._gather = itemgetter(*order)

    @classmethod
    def normalize_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        # an int normalized_shape is a one-axis shape, as torch.nn.functional takes it
        shape = params.get("normalized_shape")
        if isinstance(shape, int) and not isinstance(shape, bool):
            params = {**params, "normalized_shape": (shape,)}
        return params

    def derive(self) -> None:
        shape = getattr(self, "normalized_shape", None)
        #: the row length when the params fix it, else the reader of the call's N
        self._n = None if shape is None else math.prod(shape)
        self._read_n = self.index_reader("N") if shape is None else None
        #: the rank of each slot argument that is the slot's layout as it is: a rows tensor
        #: of rank 2 is ``(rows, n)`` only where the row is one axis; under a normalized
        #: shape of several axes (x ``(H, W)`` normalized over both is one row of ``H * W``)
        #: no rank is, and every call lays its tensors out
        self._laid_dims = _DIMS if shape is None or len(shape) == 1 else _NO_DIMS

    def default_eps(self, dtype: torch.dtype) -> float:
        """The epsilon of a call in ``dtype`` whose ``eps`` param is None (only an op whose
        entry allows None says what it means)."""
        raise ValueError(f"{type(self).__name__}: eps is None")


class RowNormOp(_RowSlotOp):
    """Family base of the row normalizations (see the module docstring). A subclass sets
    :attr:`kind`."""

    kind: ClassVar[RowNormKind]
    kernel_types = {RowNormFwdInterface: (RowNormSplitKernel, RowNormClusterKernel,
                                          RowNormRegisterKernel, RowNormLoopedKernel)}
    _slot_args = {a: p for p, a in enumerate(_SLOT_ARGS)}
    _slot_name = "row_norm_fwd"

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        plan = cls._signature
        if plan is None:
            return
        cls._out_slots = tuple(p for p, a in enumerate(_SLOT_ARGS)
                               if a in plan.output_names)
        # the slots whose layout a call checks: the inputs (an output the op allocates is laid
        # out like x, one that aliases an input is that input), and the outputs too where the
        # entry lets the caller supply one (out=)
        cls._checked_slots = tuple(p for p, a in enumerate(_SLOT_ARGS)
                                   if a in plan.input_names or a in plan.buffer_outputs)

    def forward(self, call, *tensors) -> None:
        args = self._gather((*tensors, None))
        x = args[0]
        n = self._n
        if n is None:
            n = self._read_n(call)[0]
        rows = x.numel() // n if n else 0
        dtype = x.dtype
        eps = self.eps
        if eps is None:
            eps = self.default_eps(dtype)
        w, b = args[2], args[3]
        has_w = w is not None
        has_b = b is not None
        if has_w and w.dtype is not dtype or has_b and b.dtype is not dtype:
            # a float32 weight (and bias) of a narrower x: the kernels read the affine
            # tensors in x's dtype, so they get a copy of its n elements in it
            args = (*args[:2], w if not has_w else w.to(dtype),
                    b if not has_b else b.to(dtype), *args[4:])
        key = (call.device, dtype, rows, n, eps, has_w, has_b)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            refuse_unserved(self, dtype, _KERNEL_DTYPES, "row-norm")
            entry = self.kernel_for(key, RowNormFwdInterface, lambda: RowNormSpec(
                device=call.device, kind=self.kind, rows=rows, n=n, dtype=NAMES[dtype],
                eps=eps, has_weight=has_w, has_bias=has_b))
        for p in self._checked_slots:
            t = args[p]
            # the common case: already (rows, n) / (n,), contiguous, at offset 0
            if t is not None and (t.dim() != self._laid_dims[p] or not t.is_contiguous()
                                  or t.storage_offset() and t.data_ptr() % 16):
                self._run_on_copies(entry, args, rows, n)
                return
        entry(*args)

    def _run_on_copies(self, entry: Any, args: tuple, rows: int, n: int) -> None:
        """Run with every tensor in the kernels' layout: a view where one is, else a copy; an
        output that had to be copied (an in-place op on a strided or misaligned view) is
        written back into the caller's tensor after the kernel."""
        laid = [None if t is None else _layout(t, d, rows, n)
                for t, d in zip(args, _DIMS, strict=True)]
        entry(*laid)
        for p in self._out_slots:
            t, v = args[p], laid[p]
            if v is not t and v is not None and v.data_ptr() != t.data_ptr():
                t.copy_(v.view(t.shape))


#: the dtypes the row-norm kernels state they serve (both slots' call specs)
_KERNEL_DTYPES = frozenset(get_args(RowNormDType))


def _layout(t: torch.Tensor, dims: int, rows: int, n: int) -> torch.Tensor:
    """``t`` as a contiguous ``(rows, n)`` (``dims`` 2) or ``(n,)`` tensor at a 16-byte
    aligned address: ``t`` itself where it is one, a view where it can be, else a copy (a view
    starting mid-vector is copied as a strided one is). The views take their sizes as
    integers, which torch parses faster than a tuple."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        if dims == 1:
            return t if t.dim() == 1 else t.view(n)
        return t if t.dim() == 2 and t.size(1) == n else t.view(rows, n)
    t = t.contiguous() if not t.is_contiguous() else t.clone()
    return t.view(rows, n) if dims == 2 else t.view(n)


class RMSNormFwdOp(RowNormOp):
    kind = RowNormKind.RMS

    def default_eps(self, dtype: torch.dtype) -> float:
        # the entry: eps None means the epsilon of the math's dtype, as torch's rms_norm
        return _FINFO_EPS.get(dtype) or torch.finfo(dtype).eps

    def reference(self, call, x, weight):
        return (_rms(x, weight, len(self.normalized_shape), self.eps if self.eps is not None else self.default_eps(call.d_x)),)

    def eager(self):
        shape, eps = list(self.normalized_shape), self.eps

        def rms_norm(x, weight=None):  # torch.nn.functional.rms_norm
            return F.rms_norm(x, shape, weight, eps)

        return rms_norm

    peers = {"liger": lambda op: _liger_rms(op)}


class FusedAddRMSNormFwdOp(RowNormOp):
    kind = RowNormKind.ADD_RMS

    def reference(self, call, x, residual, weight):
        # residual_out is rounded to the storage dtype, and y normalizes that rounded value
        s = _wide(x) + _wide(residual)
        s = s.to(call.d_x).to(s.dtype)
        return _rms(s, weight, 1, self.eps), s

    def eager(self):
        eps, inplace = self.eps, self.inplace

        def fused_add_rms_norm(x, residual, weight=None):  # add, then F.rms_norm
            if inplace:
                residual.add_(x)
                x.copy_(F.rms_norm(residual, [x.shape[-1]], weight, eps))
                return x, residual
            s = x + residual
            return F.rms_norm(s, [x.shape[-1]], weight, eps), s

        return fused_add_rms_norm

    peers = {"liger": lambda op: _liger_fused_add(op)}


class LayerNormFwdOp(RowNormOp):
    kind = RowNormKind.LAYER

    def reference(self, call, x, weight, bias):
        dims = len(self.normalized_shape)
        xf = _wide(x)
        axes = tuple(range(-dims, 0))
        mean = xf.mean(dim=axes, keepdim=True)
        var = (xf - mean).pow(2).mean(dim=axes, keepdim=True)
        out = (xf - mean) * torch.rsqrt(var + self.eps)
        if weight is not None:
            out = out * _wide(weight)
        if bias is not None:
            out = out + _wide(bias)
        return (out,)

    def eager(self):
        shape, eps = list(self.normalized_shape), self.eps

        def layer_norm(x, weight=None, bias=None):  # torch.nn.functional.layer_norm
            return F.layer_norm(x, shape, weight, bias, eps)

        return layer_norm

    peers = {"liger": lambda op: _liger_layer(op)}


# --- gradients -----------------------------------------------------------------------------------


class RowNormBwdOp(_RowSlotOp):
    """Family base of the row normalizations' gradients: the slot ``row_norm_bwd``, whose
    arguments ``(dy, dres, x, weight, dx, dweight, dbias)`` the entries' tensors fill by name
    (the fused add's ``dresidual_out`` is ``dres`` and its ``residual_out`` is ``x``), each
    row tensor handed over as a contiguous 16-byte-aligned ``(rows, n)`` view (a gradient
    that is not one, e.g. an expanded ``ones``, is copied) and each affine one as ``(n,)``.
    The references state each formula in closed form (a reference may run inside a compiled
    graph's custom op, where autograd does not record); the tests hold them to torch's
    autograd of the forward in float64."""

    kind: ClassVar[RowNormKind]
    kernel_types = {RowNormBwdInterface: (RowNormBwdRegisterKernel, RowNormBwdLoopedKernel)}
    #: the fused add's ``dresidual_out`` is ``dres`` and its ``residual_out`` is ``x``
    #: LayerNorm's ``bias`` (read for its dtype only, that of ``dbias``) is not a slot
    #: argument: it is gathered after them and dropped
    _slot_args = {"dy": 0, "dresidual_out": 1, "x": 2, "residual_out": 2, "weight": 3,
                  "dx": 4, "dweight": 5, "dbias": 6, "bias": 7}
    _slot_name = "row_norm_bwd"

    def forward(self, call, *tensors) -> None:
        args = self._gather((*tensors, None))
        dy = args[0]
        n = self._n
        if n is None:
            n = self._read_n(call)[0]
        rows = dy.numel() // n if n else 0
        dtype = dy.dtype
        eps = self.eps
        if eps is None:
            eps = self.default_eps(dtype)
        w, dw, db = args[3], args[5], args[6]
        has_w = w is not None
        grad_w = dw is not None
        grad_b = db is not None
        # the sums' dtype: the weight's (and the bias's), x's or float32
        sums = dw if grad_w else db
        sum_dtype = dtype if sums is None else sums.dtype
        key = (call.device, dtype, rows, n, eps, has_w, grad_w, grad_b, sum_dtype)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            refuse_unserved(self, dtype, _KERNEL_DTYPES, "row-norm")
            entry = self.kernel_for(key, RowNormBwdInterface, lambda: RowNormBwdSpec(
                device=call.device, kind=self.kind, rows=rows, n=n, dtype=NAMES[dtype],
                eps=eps, has_weight=has_w, grad_weight=grad_w, grad_bias=grad_b,
                sum_dtype=None if sum_dtype is dtype else NAMES[sum_dtype]))
        if has_w and w.dtype is not dtype:  # a float32 weight: a copy in x's dtype
            args = (*args[:3], w.to(dtype), *args[4:])
        laid = [None if t is None else _layout(t, 2 if p in _BWD_ROWS else 1, rows, n)
                for p, t in enumerate(args[:7])]
        entry(*laid)


#: the slot arguments that are rows (the rest are (n,) vectors)
_BWD_ROWS = frozenset({0, 1, 2, 4})


class RMSNormBwdOp(RowNormBwdOp):
    kind = RowNormKind.RMS
    default_eps = RMSNormFwdOp.default_eps

    def reference(self, call, dy, x, weight):
        eps = self.eps if self.eps is not None else self.default_eps(call.d_x)
        return _rms_bwd(dy, x, weight, len(self.normalized_shape), eps, self.grad_weight)


class FusedAddRMSNormBwdOp(RowNormBwdOp):
    """Without ``dy`` (y's result unused) the gradient is ``dresidual_out`` as it is, with no
    norm term and no dweight (the entry's nullable): zeros through the norm's backward would
    give ``0 * inf`` on a row with an inf, or an all-zero row under ``eps = 0``, where torch
    gives the residual's gradient alone. No kernel runs for it."""

    kind = RowNormKind.ADD_RMS

    def forward(self, call, dresidual_out, residual_out, weight, dy, dx, dweight) -> None:
        if dy is None:
            dx.copy_(dresidual_out)
            return
        super().forward(call, dresidual_out, residual_out, weight, dy, dx, dweight)

    def reference(self, call, dresidual_out, residual_out, weight, dy):
        if dy is None:
            return _wide(dresidual_out), None
        ds, dw = _rms_bwd(dy, residual_out, weight, 1, self.eps, self.grad_weight)
        return ds + _wide(dresidual_out), dw


class LayerNormBwdOp(RowNormBwdOp):
    kind = RowNormKind.LAYER

    def reference(self, call, dy, x, weight, bias):
        dims = len(self.normalized_shape)
        axes = tuple(range(-dims, 0))
        rows = tuple(range(x.dim() - dims))
        xf, dyf = _wide(x), _wide(dy)
        mean = xf.mean(dim=axes, keepdim=True)
        rstd = torch.rsqrt((xf - mean).pow(2).mean(dim=axes, keepdim=True) + self.eps)
        xhat = (xf - mean) * rstd
        g = dyf if weight is None else dyf * _wide(weight)
        dx = rstd * (g - g.mean(dim=axes, keepdim=True)
                     - xhat * (g * xhat).mean(dim=axes, keepdim=True))
        dw = _row_sum(dyf * xhat, rows) if self.grad_weight and weight is not None else None
        db = _row_sum(dyf, rows) if self.grad_bias and bias is not None else None
        return dx, dw, db


def _rms_bwd(dy, x, weight, dims: int, eps: float, grad_weight: bool) -> tuple:
    """``(dx, dweight)`` of ``y = x * rstd * weight``: with ``g = dy * weight`` and
    ``xhat = x * rstd``, ``dx = rstd * (g - xhat * mean(g * xhat))``, ``dweight`` the row sum
    of ``dy * xhat``."""
    axes = tuple(range(-dims, 0))
    xf, dyf = _wide(x), _wide(dy)
    rstd = torch.rsqrt(xf.pow(2).mean(dim=axes, keepdim=True) + eps)
    xhat = xf * rstd
    g = dyf if weight is None else dyf * _wide(weight)
    dx = rstd * (g - xhat * (g * xhat).mean(dim=axes, keepdim=True))
    dw = None
    if grad_weight and weight is not None:
        dw = _row_sum(dyf * xhat, tuple(range(x.dim() - dims)))
    return dx, dw


# --- shared by the references ------------------------------------------------------------------


def _row_sum(t: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """``t`` summed over its row axes ``rows``; an unbatched ``t`` (no row axes) is its own
    sum (torch's ``sum(dim=())`` would sum every axis)."""
    return t.sum(dim=rows) if rows else t


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or as it is when it is float64 already."""
    return t if t.dtype == torch.float64 else t.float()


def _rms(x: torch.Tensor, weight: torch.Tensor | None, dims: int, eps: float) -> torch.Tensor:
    xf = _wide(x)
    axes = tuple(range(-dims, 0))
    out = xf * torch.rsqrt(xf.pow(2).mean(dim=axes, keepdim=True) + eps)
    if weight is not None:
        out = out * _wide(weight)
    return out


# --- Liger-Kernel peers (present when liger_kernel is installed) --------------------------------


def _liger_rms(op: RMSNormFwdOp) -> Any:
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError:
        return None
    if len(op.normalized_shape) != 1:
        return None  # Liger normalizes the last axis only
    eps = op.eps

    def liger_rms_norm(x, weight=None):
        if weight is None:
            raise NotImplementedError("Liger's RMSNorm needs a weight")
        return LigerRMSNormFunction.apply(x, weight, eps if eps is not None
                                          else torch.finfo(x.dtype).eps)

    return liger_rms_norm


def _liger_fused_add(op: FusedAddRMSNormFwdOp) -> Any:
    try:
        from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward
    except ImportError:
        return None
    if op.inplace:
        return None  # Liger's fused add writes new tensors
    eps = op.eps

    def liger_fused_add_rms_norm(x, residual, weight=None):
        if weight is None:
            raise NotImplementedError("Liger's fused add + RMSNorm needs a weight")
        y, s = fused_add_rms_norm_forward(x, residual, weight, eps, 0.0, "llama")[:2]
        return y, s

    return liger_fused_add_rms_norm


def _liger_layer(op: LayerNormFwdOp) -> Any:
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    except ImportError:
        return None
    if len(op.normalized_shape) != 1:
        return None
    eps = op.eps

    def liger_layer_norm(x, weight=None, bias=None):
        if weight is None or bias is None:
            raise NotImplementedError("Liger's LayerNorm needs a weight and a bias")
        return LigerLayerNormFunction.apply(x, weight, bias, eps)

    return liger_layer_norm
