""":class:`MoE`, a mixture-of-experts layer (its routed experts) running
:class:`~tileops.ops.FusedMoeFwdOp`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tileops.ops import FusedMoeFwdOp
from tileops.ops.moe import ContiguousLayoutSpec, MaskedLayoutSpec

from ._holder import HoldsOp

__all__ = ["MoE"]


class MoE(HoldsOp, nn.Module):
    """The routed experts of a mixture-of-experts block: router logits ``x @ gate.weight.T``
    (``gate`` a bias-free ``torch.nn.Linear``, Mixtral's and DeepSeek-V3's router), then
    ``FusedMoeFwdOp``: the routing, each token through its ``top_k`` experts' SwiGLU
    (``w13[e]``: the gate rows, then the up rows, ``[2 * intermediate_size, hidden_size]``;
    ``w2[e]``: ``[hidden_size, intermediate_size]``), the results weighted by the gates.

    The routing options are the op's (``scoring``, ``renormalize``, ``num_groups``,
    ``topk_groups``, ``routed_scaling_factor``); ``correction_bias`` adds DeepSeek-V3's
    ``e_score_correction_bias`` buffer (float32, zeros), which shifts the choice of experts but
    not their weights. :meth:`mixtral` and :meth:`deepseek_v3` build the two models' configs;
    shared experts, where a model has them, are a dense MLP beside this layer. Any number of
    leading axes is flattened into tokens. The op has no gradient: the layer serves inference
    (``torch.no_grad``)."""

    op_class = FusedMoeFwdOp
    op_attrs = ("num_experts", "top_k", "scoring", "renormalize", "num_groups", "topk_groups",
                "routed_scaling_factor", "layout")

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 *, scoring: str = "softmax", renormalize: bool = True, num_groups: int = 1,
                 topk_groups: int = 1, routed_scaling_factor: float = 1.0,
                 correction_bias: bool = False,
                 layout: ContiguousLayoutSpec | MaskedLayoutSpec | None = None,
                 device: Any = None, dtype: Any = None, target: str | None = None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.scoring, self.renormalize = scoring, renormalize
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.routed_scaling_factor = routed_scaling_factor
        self.layout = layout if layout is not None else ContiguousLayoutSpec()
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, **kw)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size,
                                            **kw))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))
        if correction_bias:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        self.reset_parameters()
        self.target = target
        self._build_op()

    def reset_parameters(self) -> None:
        """Each expert's matrices as ``torch.nn.Linear`` initialises a weight (uniform in
        ``1/sqrt(fan_in)``, kaiming_uniform_ with ``a = sqrt(5)``); the router is the gate
        Linear's own."""
        for w in (self.w13, self.w2):
            bound = 1 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    @classmethod
    def mixtral(cls, hidden_size: int = 4096, intermediate_size: int = 14336,
                num_experts: int = 8, top_k: int = 2, **kw: Any) -> MoE:
        """Mixtral-8x7B's experts: softmax routing, top-2, renormalised."""
        return cls(hidden_size, intermediate_size, num_experts, top_k, **kw)

    @classmethod
    def deepseek_v3(cls, hidden_size: int = 7168, intermediate_size: int = 2048,
                    num_experts: int = 256, top_k: int = 8, **kw: Any) -> MoE:
        """DeepSeek-V3's routed experts: sigmoid scores with a correction bias, 8 groups of
        which the 4 best stay eligible, top-8, renormalised and scaled by 2.5."""
        opts = dict(scoring="sigmoid", num_groups=8, topk_groups=4, routed_scaling_factor=2.5,
                    correction_bias=True)
        return cls(hidden_size, intermediate_size, num_experts, top_k, **{**opts, **kw})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.hidden_size)
        logits = self.gate(rows)
        out = self.op(rows, logits, self.w13, self.w2, self.e_score_correction_bias)
        return out.view(x.shape)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, scoring="
                f"{self.scoring!r}" + self._target_repr())
