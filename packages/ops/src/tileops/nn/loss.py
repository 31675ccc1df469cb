"""Loss layers: :class:`CrossEntropyLoss`, a subclass of ``torch.nn.CrossEntropyLoss`` running
:class:`~tileops.ops.CrossEntropyFwdOp` (its gradient through
:class:`~tileops.ops.CrossEntropyBwdOp`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tileops.ops import CrossEntropyFwdOp

from ._holder import HoldsOp

__all__ = ["CrossEntropyLoss"]


class CrossEntropyLoss(HoldsOp, nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` over ``(N, C)`` logits and ``(N,)`` int64 class indices,
    with torch's ``ignore_index``, ``reduction`` and ``label_smoothing``, plus three keywords of
    the op: ``lse_square_scale`` (the z-loss, ``scale * lse^2`` a row), ``softcap``
    (``softcap * tanh(logits / softcap)`` first) and ``inplace_grad`` (the backward writes the
    gradient over the logits, whose values are lost: no second ``N x C`` tensor). The loss is float32 (float64 for float64
    logits), whatever the logits' dtype.

    What torch's layer takes and the op does not compute is refused where the layer is made
    (a class ``weight``; the deprecated ``size_average`` and ``reduce``, which spell a
    reduction) or called (class probabilities as the target, inputs other than ``(N, C)``:
    flatten the positions of a ``(B, S, C)`` input into rows first)."""

    op_class = CrossEntropyFwdOp
    op_attrs = ("ignore_index", "reduction", "label_smoothing", "lse_square_scale", "softcap",
                "inplace_grad")

    def __init__(self, weight: torch.Tensor | None = None, size_average: Any = None,
                 ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0,
                 softcap: float | None = None, inplace_grad: bool = False,
                 target: str | None = None) -> None:
        if weight is not None:
            raise ValueError("CrossEntropyLoss: weight= (a weight per class) is not supported; "
                             f"expected None, got a tensor of shape {tuple(weight.shape)}")
        for name, value in (("size_average", size_average), ("reduce", reduce)):
            if value is not None:
                raise ValueError(f"CrossEntropyLoss: {name}= is deprecated in torch and not "
                                 f"supported; expected None, got {value!r} (use reduction=)")
        super().__init__(None, None, ignore_index, None, reduction, label_smoothing)
        self.lse_square_scale = lse_square_scale
        self.softcap = softcap
        self.inplace_grad = inplace_grad
        self.target = target
        self._build_op()

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if input.dim() != 2:
            raise ValueError(f"CrossEntropyLoss: input must be (N, C) logits, got shape "
                             f"{tuple(input.shape)}; flatten the positions into N rows")
        if target.is_floating_point():
            raise ValueError("CrossEntropyLoss: target must be int64 class indices; class "
                             f"probabilities ({target.dtype}) are not supported")
        return self.op(input, target)

    def extra_repr(self) -> str:
        # torch's layer prints nothing; only what it does not have is shown
        extra = []
        if self.lse_square_scale:
            extra.append(f"lse_square_scale={self.lse_square_scale}")
        if self.softcap is not None:
            extra.append(f"softcap={self.softcap}")
        if self.inplace_grad:
            extra.append("inplace_grad=True")
        if self.target is not None:
            extra.append(f"target={self.target!r}")
        return ", ".join(extra)
