""":class:`Linear`, a subclass of ``torch.nn.Linear`` running :class:`~tileops.ops.GemmFwdOp`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tileops.ops import GemmFwdOp

from ._holder import HoldsOp
from .functional import linear_with

__all__ = ["Linear"]


class Linear(HoldsOp, nn.Linear):
    """``torch.nn.Linear`` running ``GemmFwdOp(trans_b=True)``: ``y = x @ weight.T + bias``,
    with the weight in its ``[out_features, in_features]`` layout (the op reads it transposed;
    nothing is copied).

    Same constructor, parameters, init (``kaiming_uniform_(a=sqrt(5))``, the bias uniform in
    ``1/sqrt(in_features)``) and ``state_dict`` as ``torch.nn.Linear`` (it is one), plus
    ``target``, the op's. Any number of leading axes is flattened into the GEMM's rows; the
    bias is added by torch for now (see :func:`~tileops.nn.functional.linear_with`)."""

    op_class = GemmFwdOp
    op_fixed = {"trans_b": True}

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: Any = None, dtype: Any = None, *, target: str | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.target = target
        self._build_op()

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear_with(self.op, input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return super().extra_repr() + self._target_repr()
