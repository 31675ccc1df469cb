"""Row normalizations: RMSNorm, fused add + RMSNorm, LayerNorm.

Each op is its spec entry (``specs/norm.yaml``) plus a constructor and a ``forward`` that
flattens the normalized axes into rows and runs the ``row_norm_fwd`` slot; the checks, output
inference, effects and roofline come from the entry. Non-contiguous inputs are copied to a
contiguous layout first (the kernels read rows with unit stride).
"""

import math
from collections.abc import Sequence

import torch

from tileops.kernels.norm import (
    FEW_ROWS,
    RowNormFwdInterface,
    RowNormLoopedKernel,
    RowNormRegisterKernel,
    RowNormSpec,
)
from tileops.runtime import Op

from ._dtypes import NAMES

__all__ = ["FusedAddRMSNormFwdOp", "LayerNormFwdOp", "RMSNormFwdOp"]

_ROW_NORM_KERNELS = {RowNormFwdInterface: (RowNormRegisterKernel, RowNormLoopedKernel)}


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as contiguous ``(rows, n)`` at a 16-byte aligned address; no view when it
    already is one (a view costs microseconds of host time, as much as the rest of a small
    call). The kernels read 16-byte vectors, so a view starting mid-vector is copied."""
    if not t.is_contiguous():
        t = t.contiguous()
    elif t.storage_offset() and t.data_ptr() % 16:
        t = t.clone()
    return t if t.dim() == 2 else t.view(-1, n)


def _flat(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if t is None:
        return None
    if not t.is_contiguous():
        t = t.contiguous()
    elif t.storage_offset() and t.data_ptr() % 16:
        t = t.clone()
    return t if t.dim() == 1 else t.view(n)


class RMSNormFwdOp(Op):
    """``y = x * rsqrt(mean(x**2) + eps) * weight`` over the trailing ``normalized_shape``.

    Args:
        normalized_shape: the trailing axes normalized over.
        eps: added to the mean square; None means ``torch.finfo(x.dtype).eps``, as
            ``torch.nn.functional.rms_norm``.
        target, kernel_map, tune: see :class:`tileops.runtime.Op`.
    """

    kernel_types = _ROW_NORM_KERNELS

    def __init__(self, *, normalized_shape: Sequence[int] | int, eps: float | None = None,
                 target: str | None = None, kernel_map=None, tune: bool = False) -> None:
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        super().__init__(normalized_shape=normalized_shape, eps=eps, target=target,
                         kernel_map=kernel_map, tune=tune)
        self.n = math.prod(self.normalized_shape)

    def forward(self, call, x, weight, y) -> None:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        n = self.n
        # the common case (contiguous (rows, N) at offset 0) needs no view and no copy
        if x.dim() != 2 or not x.is_contiguous() or x.storage_offset():
            x, y = _rows(x, n), _rows(y, n)
        if weight is not None and (weight.dim() != 1 or not weight.is_contiguous()
                                   or weight.storage_offset()):
            weight = _flat(weight, n)
        spec = RowNormSpec(call.device, "rms", n, NAMES[x.dtype], eps, weight is not None,
                           False, x.shape[0] < FEW_ROWS)
        self.kernel(RowNormFwdInterface, spec)(x, None, weight, None, y, None)


class FusedAddRMSNormFwdOp(Op):
    """``residual_out = x + residual``; ``y = rmsnorm(residual_out) * weight``.

    With ``inplace=True`` the results are written into ``x`` (``y``) and ``residual``
    (``residual_out``), which are returned.
    """

    kernel_types = _ROW_NORM_KERNELS

    def __init__(self, *, eps: float = 1e-6, inplace: bool = False, target: str | None = None,
                 kernel_map=None, tune: bool = False) -> None:
        super().__init__(eps=eps, inplace=inplace, target=target, kernel_map=kernel_map,
                         tune=tune)

    def forward(self, call, x, residual, weight, y, residual_out) -> None:
        n = x.shape[-1]
        spec = RowNormSpec(call.device, "add_rms", n, NAMES[x.dtype], self.eps,
                           weight is not None, False, x.numel() // max(n, 1) < FEW_ROWS)
        if self.inplace and not (x.is_contiguous() and residual.is_contiguous()
                                 and x.data_ptr() % 16 == 0 and residual.data_ptr() % 16 == 0):
            raise ValueError(
                f"{type(self).__name__}(inplace=True) writes into x and residual, so both must be "
                f"contiguous and start at a 16-byte aligned address; got x strides "
                f"{tuple(x.stride())} at offset {x.data_ptr() % 16}, residual strides "
                f"{tuple(residual.stride())} at offset {residual.data_ptr() % 16}")
        self.kernel(RowNormFwdInterface, spec)(
            _rows(x, n), _rows(residual, n), _flat(weight, n), None, _rows(y, n),
            _rows(residual_out, n))


class LayerNormFwdOp(Op):
    """``y = (x - mean) * rsqrt(var + eps) * weight + bias`` over ``normalized_shape``."""

    kernel_types = _ROW_NORM_KERNELS

    def __init__(self, *, normalized_shape: Sequence[int] | int, eps: float = 1e-5,
                 target: str | None = None, kernel_map=None, tune: bool = False) -> None:
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        super().__init__(normalized_shape=normalized_shape, eps=eps, target=target,
                         kernel_map=kernel_map, tune=tune)
        self.n = math.prod(self.normalized_shape)

    def forward(self, call, x, weight, bias, y) -> None:
        spec = RowNormSpec(call.device, "layer", self.n, NAMES[x.dtype], self.eps,
                           weight is not None, bias is not None,
                           x.numel() // max(self.n, 1) < FEW_ROWS)
        self.kernel(RowNormFwdInterface, spec)(
            _rows(x, self.n), None, _flat(weight, self.n), _flat(bias, self.n),
            _rows(y, self.n), None)
