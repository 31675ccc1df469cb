"""Loss layers: :class:`CrossEntropyLoss`, a subclass of ``torch.nn.CrossEntropyLoss`` running
:class:`~tileops.ops.CrossEntropyFwdOp` (its gradient through
:class:`~tileops.ops.CrossEntropyBwdOp`), and :class:`FusedLinearCrossEntropyLoss`, the loss of
a language model's head (``F.cross_entropy(hidden @ weight.T, target)``) running
:class:`~tileops.ops.FusedLinearCrossEntropyFwdOp`, which never holds every row's logits."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tileops.ops import CrossEntropyFwdOp, FusedLinearCrossEntropyFwdOp

from ._holder import HoldsOp
from .functional import autocast_operands

__all__ = ["CrossEntropyLoss", "FusedLinearCrossEntropyLoss"]


class CrossEntropyLoss(HoldsOp, nn.CrossEntropyLoss):
    """``torch.nn.CrossEntropyLoss`` over ``(N, C)`` logits and ``(N,)`` int64 class indices,
    with torch's ``ignore_index``, ``reduction`` and ``label_smoothing``, plus three keywords of
    the op: ``lse_square_scale`` (the z-loss, ``scale * lse^2`` a row), ``softcap``
    (``softcap * tanh(logits / softcap)`` first) and ``inplace_grad`` (the backward writes the
    gradient over the logits, whose values are lost: no second ``N x C`` tensor; not over a
    leaf, nor over logits the node that made them saved, such as a tanh's output: those get a
    gradient of their own, see :class:`~tileops.ops.CrossEntropyFwdOp`). The loss is float32
    (float64 for float64 logits), whatever the logits' dtype.

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
        _tensors(type(self).__name__, input=input, target=target)
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


class FusedLinearCrossEntropyLoss(HoldsOp, nn.Module):
    """``F.cross_entropy(hidden @ weight.T, target)`` without the logits of every row at once:
    called as ``loss(hidden, weight, target)`` (the op's order; Liger-Kernel's layer takes the
    weight first) with ``hidden`` of shape ``(..., H)``, the head's ``weight`` ``(V, H)`` and
    int64 class indices of ``hidden``'s leading shape, whose positions are flattened into rows
    (reduction ``none`` returns the losses in the target's shape). The keywords are
    :class:`CrossEntropyLoss`'s: torch's ``ignore_index``, ``reduction`` and
    ``label_smoothing``, and the op's ``lse_square_scale`` and ``softcap``. The loss is float32
    (float64 for float64 inputs). The layer holds no weight: the head's stays where the model
    keeps it (tied embeddings, an ``nn.Linear``), and its gradient arrives there."""

    op_class = FusedLinearCrossEntropyFwdOp
    op_attrs = ("ignore_index", "reduction", "label_smoothing", "lse_square_scale", "softcap")

    def __init__(self, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, *, lse_square_scale: float = 0.0,
                 softcap: float | None = None, target: str | None = None) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.lse_square_scale = lse_square_scale
        self.softcap = softcap
        self.target = target
        self._build_op()

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                target: torch.Tensor) -> torch.Tensor:
        _tensors(type(self).__name__, hidden=hidden, weight=weight, target=target)
        # the logits' product as autocast runs lm_head's (the loss is float32 either way)
        hidden, weight = autocast_operands(hidden, weight)
        if hidden.dim() < 1 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
            raise ValueError(f"FusedLinearCrossEntropyLoss: hidden must be (..., H) and weight "
                             f"(V, H), got shapes {tuple(hidden.shape)} and "
                             f"{tuple(weight.shape)}")
        if tuple(target.shape) != tuple(hidden.shape[:-1]):
            raise ValueError(f"FusedLinearCrossEntropyLoss: target must have hidden's leading "
                             f"shape {tuple(hidden.shape[:-1])}, got {tuple(target.shape)}")
        rows = hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])  # an H of 0 too
        loss = self.op(rows, weight, target.reshape(-1))
        return loss.reshape(target.shape) if self.reduction == "none" else loss

    def extra_repr(self) -> str:
        defaults = {"ignore_index": -100, "reduction": "mean", "label_smoothing": 0.0,
                    "lse_square_scale": 0.0, "softcap": None, "target": None}
        return ", ".join(f"{k}={getattr(self, k)!r}" for k, v in defaults.items()
                         if getattr(self, k) != v)


def _tensors(layer: str, **arguments: Any) -> None:
    """Each argument a tensor, else refused naming the layer, the argument and its type."""
    for name, value in arguments.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{layer}: argument {name} expected a tensor, seen "
                            f"{type(value).__name__}")
