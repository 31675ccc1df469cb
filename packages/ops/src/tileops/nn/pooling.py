"""Pooling layers: :class:`MaxPool1d`, :class:`MaxPool2d`, :class:`MaxPool3d`,
:class:`AvgPool1d`, :class:`AvgPool2d`, :class:`AvgPool3d`, :class:`AdaptiveAvgPool2d` and
:class:`AdaptiveMaxPool2d`, subclasses of their ``torch.nn`` namesakes running TileOPs' pooling
ops (same constructor, attributes and ``isinstance``, one more keyword, ``target``).

The ops return what torch.nn's layers return (the output alone, or ``(output, indices)``
with ``return_indices``), so each layer's forward is its op's call.
"""

from __future__ import annotations

import torch
from torch import nn

from tileops.ops import (
    AdaptiveAvgPool2dFwdOp,
    AdaptiveMaxPool2dFwdOp,
    AvgPool1dFwdOp,
    AvgPool2dFwdOp,
    AvgPool3dFwdOp,
    MaxPool1dFwdOp,
    MaxPool2dFwdOp,
    MaxPool3dFwdOp,
)
from tileops.runtime import Op

from ._holder import HoldsOp

__all__ = ["AdaptiveAvgPool2d", "AdaptiveMaxPool2d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
           "MaxPool1d", "MaxPool2d", "MaxPool3d"]

_MAX_ATTRS = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_AVG_ATTRS = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")


class _Pool(HoldsOp):
    """What the layers share: torch.nn's constructor, then the op from its attributes; the
    input through the op, torch's repr plus the target."""

    def __init__(self, *args, target: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.target = target
        self._build_op()

    def forward(self, input: torch.Tensor):
        return self.op(input)

    def extra_repr(self) -> str:
        return super().extra_repr() + self._target_repr()  # type: ignore[misc]


class MaxPool1d(_Pool, nn.MaxPool1d):
    """``torch.nn.MaxPool1d`` running :class:`~tileops.ops.MaxPool1dFwdOp`."""

    op_class, op_attrs = MaxPool1dFwdOp, _MAX_ATTRS


class MaxPool2d(_Pool, nn.MaxPool2d):
    """``torch.nn.MaxPool2d`` running :class:`~tileops.ops.MaxPool2dFwdOp`."""

    op_class, op_attrs = MaxPool2dFwdOp, _MAX_ATTRS


class MaxPool3d(_Pool, nn.MaxPool3d):
    """``torch.nn.MaxPool3d`` running :class:`~tileops.ops.MaxPool3dFwdOp`."""

    op_class, op_attrs = MaxPool3dFwdOp, _MAX_ATTRS


class AvgPool1d(_Pool, nn.AvgPool1d):
    """``torch.nn.AvgPool1d`` running :class:`~tileops.ops.AvgPool1dFwdOp`."""

    op_class, op_attrs = AvgPool1dFwdOp, _AVG_ATTRS


class AvgPool2d(_Pool, nn.AvgPool2d):
    """``torch.nn.AvgPool2d`` running :class:`~tileops.ops.AvgPool2dFwdOp`."""

    op_class, op_attrs = AvgPool2dFwdOp, (*_AVG_ATTRS, "divisor_override")


class AvgPool3d(_Pool, nn.AvgPool3d):
    """``torch.nn.AvgPool3d`` running :class:`~tileops.ops.AvgPool3dFwdOp`."""

    op_class, op_attrs = AvgPool3dFwdOp, (*_AVG_ATTRS, "divisor_override")


class _Adaptive(_Pool):
    """An adaptive layer: an ``output_size`` with a None component (torch's "the input's size
    along that axis") is resolved from each call's input, and the op of each resolved size is
    built once and kept (the components given are checked at construction, by the op of the
    resolved size 1)."""

    def _open(self) -> bool:
        size = self.output_size
        return isinstance(size, (tuple, list)) and any(s is None for s in size)

    def _sized_op(self, size: tuple) -> Op:
        params = {a: getattr(self, a) for a in self.op_attrs}
        return self.op_class(**{**params, "output_size": size}, **self.op_fixed,
                             target=self.target)

    def _build_op(self) -> Op:
        if not self._open():
            self.__dict__["_sized"] = None
            return super()._build_op()
        op = self._sized_op(tuple(1 if s is None else s for s in self.output_size))
        self.__dict__["_sized"] = {}
        self.__dict__["_op"] = op
        return op

    def forward(self, input: torch.Tensor):
        op = self.op  # built (or rebuilt after an assignment) first
        sized = self.__dict__.get("_sized")
        if sized is None:
            return op(input)
        shape = input.shape[-2:]
        size = tuple(shape[i] if s is None else s for i, s in enumerate(self.output_size))
        op = sized.get(size)
        if op is None:
            op = sized[size] = self._sized_op(size)
        return op(input)

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_sized", None)
        return state


class AdaptiveAvgPool2d(_Adaptive, nn.AdaptiveAvgPool2d):
    """``torch.nn.AdaptiveAvgPool2d`` running :class:`~tileops.ops.AdaptiveAvgPool2dFwdOp`
    (a None component of ``output_size`` is the input's size there, as torch's)."""

    op_class, op_attrs = AdaptiveAvgPool2dFwdOp, ("output_size",)


class AdaptiveMaxPool2d(_Adaptive, nn.AdaptiveMaxPool2d):
    """``torch.nn.AdaptiveMaxPool2d`` running :class:`~tileops.ops.AdaptiveMaxPool2dFwdOp`
    (a None component of ``output_size`` is the input's size there, as torch's)."""

    op_class, op_attrs = AdaptiveMaxPool2dFwdOp, ("output_size", "return_indices")
