"""The attention layer: :class:`Attention`, FlashAttention's attention as a ``torch.nn``
module over :class:`~tileops.ops.GroupedQueryAttentionFwdOp`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tileops.ops import GroupedQueryAttentionFwdOp

from ._holder import HoldsOp

__all__ = ["Attention"]


class Attention(HoldsOp, nn.Module):
    """``o = softmax(scale * q k^T, masked) v`` over ``[B, S, H, D]`` tensors (``layout=
    'bhsd'``: ``[B, H, S, D]``, ``scaled_dot_product_attention``'s), the key and value heads
    shared by groups of query heads as ``enable_gqa`` shares them, trained through the op's
    gradients. The mask is FlashAttention's, bottom-right aligned (``is_causal`` with fewer
    queries than keys lets the last query see every key, where torch's ``is_causal`` lets the
    first see only the first), bounded by ``window=(left, right)`` (-1: unbounded) and the
    scores capped by ``softcap``; a query that sees no key is 0. It has no parameters (the
    projections around it are the model's), so its ``state_dict`` is empty; ``forward``
    returns ``o`` (the op's result without ``return_lse``)."""

    op_class = GroupedQueryAttentionFwdOp
    op_attrs = ("is_causal", "scale", "window", "softcap", "layout")

    def __init__(self, *, is_causal: bool = False, scale: float | None = None,
                 window: Any = None, softcap: float | None = None, layout: str = "bshd",
                 target: str | None = None) -> None:
        super().__init__()
        self.is_causal, self.scale, self.window = is_causal, scale, window
        self.softcap, self.layout, self.target = softcap, layout, target
        self._build_op()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.op(q, k, v)

    def extra_repr(self) -> str:
        text = f"is_causal={self.is_causal}, layout={self.layout!r}"
        for name in ("scale", "window", "softcap"):
            if getattr(self, name) is not None:
                text += f", {name}={getattr(self, name)!r}"
        return text + self._target_repr()
