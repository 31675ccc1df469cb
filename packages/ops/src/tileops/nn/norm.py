"""Normalization layers: :class:`RMSNorm`, :class:`LayerNorm` (subclasses of torch.nn's) and
:class:`FusedAddRMSNorm` (no torch.nn counterpart)."""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import nn

from tileops.ops import FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp

from ._holder import HoldsOp
from .functional import in_input_dtype

__all__ = ["FusedAddRMSNorm", "LayerNorm", "RMSNorm"]


class RMSNorm(HoldsOp, nn.RMSNorm):
    """``torch.nn.RMSNorm`` running :class:`~tileops.ops.RMSNormFwdOp`.

    Same constructor, parameters, init and ``state_dict`` as ``torch.nn.RMSNorm`` (it is one),
    plus ``target``, the op's. ``eps=None`` means the epsilon of the math's dtype (float32's
    for 16-bit inputs), as in torch. A float32 weight beside 16-bit activations (mixed
    precision) is taken as it is: the output has the input's dtype and the weight's gradient
    is computed in float32, as torch's; a weight of another dtype is cast to the input's
    (see :func:`~tileops.nn.functional.in_input_dtype`)."""

    op_class = RMSNormFwdOp
    op_attrs = ("normalized_shape", "eps")

    def __init__(self, normalized_shape: Any, eps: float | None = None,
                 elementwise_affine: bool = True, device: Any = None, dtype: Any = None, *,
                 target: str | None = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.target = target
        self._build_op()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.op(input, *in_input_dtype(input, self.weight))

    def extra_repr(self) -> str:
        return super().extra_repr() + self._target_repr()


class LayerNorm(HoldsOp, nn.LayerNorm):
    """``torch.nn.LayerNorm`` running :class:`~tileops.ops.LayerNormFwdOp`.

    Same constructor, parameters, init and ``state_dict`` as ``torch.nn.LayerNorm`` (it is
    one), plus ``target``, the op's."""

    op_class = LayerNormFwdOp
    op_attrs = ("normalized_shape", "eps")

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device: Any = None, dtype: Any = None, *,
                 target: str | None = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        self.target = target
        self._build_op()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.op(input, *in_input_dtype(input, self.weight, self.bias))

    def extra_repr(self) -> str:
        return super().extra_repr() + self._target_repr()


class FusedAddRMSNorm(HoldsOp, nn.Module):
    """``forward(x, residual) -> (y, residual_out)``: ``residual_out = x + residual`` and
    ``y = RMSNorm(residual_out)``, in one pass through
    :class:`~tileops.ops.FusedAddRMSNormFwdOp` (the pre-norm transformer block's "add the
    residual, then normalize").

    torch.nn has no counterpart. The parameter is ``RMSNorm``'s (``weight``, shape
    ``normalized_shape``, ones at init), so the ``state_dict`` of a ``torch.nn.RMSNorm`` (or
    of :class:`RMSNorm`) of the same shape loads into this layer and back. The op normalizes
    the last axis, so ``normalized_shape`` names one axis; ``eps`` defaults to the op's 1e-6
    and has no None (the op takes a number). With ``inplace``, ``y`` is written into ``x`` and
    ``residual_out`` into ``residual``, and those two are returned."""

    op_class = FusedAddRMSNormFwdOp
    op_attrs = ("eps", "inplace")

    def __init__(self, normalized_shape: Any, eps: float = 1e-6, elementwise_affine: bool = True,
                 inplace: bool = False, device: Any = None, dtype: Any = None, *,
                 target: str | None = None) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        shape = tuple(normalized_shape)
        if len(shape) != 1:
            raise ValueError(f"FusedAddRMSNorm: normalized_shape names the one axis "
                             f"FusedAddRMSNormFwdOp normalizes (the last); expected one size, "
                             f"seen {shape}")
        self.normalized_shape = shape
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.inplace = inplace
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()
        self.target = target
        self._build_op()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, residual: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        weight = self.weight
        if weight is None:
            # the op reads the row length off x; only a weight would tie it to this layer's
            self._check_row_length(x)
        return self.op(x, residual, *in_input_dtype(x, weight))

    def _check_row_length(self, x: Any) -> None:
        shape = getattr(x, "shape", None)
        if shape is None:  # not a tensor: the op's check says so
            return
        (n,) = self.normalized_shape
        if len(shape) == 0 or shape[-1] != n:
            seen = f"{str(x.dtype).removeprefix('torch.')}[{', '.join(map(str, shape))}]"
            raise ValueError(f"FusedAddRMSNorm: argument x expected [..., {n}] (its last axis "
                             f"is normalized_shape {self.normalized_shape}), seen {seen}")

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}"
                + (", inplace=True" if self.inplace else "") + self._target_repr())
