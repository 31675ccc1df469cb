""":class:`MoE`, a mixture-of-experts layer (its routed experts): inference on
:class:`~tileops.ops.FusedMoeFwdOp`, training on its stages as ops with gradients
(:class:`MoeStages`, which :class:`~tileops.nn.expert_parallel.ExpertParallelMoE` runs too)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tileops.ops import (
    FusedMoeFwdOp,
    GroupedGemmFwdOp,
    MoePermuteAlignFwdOp,
    MoeTopkGatingFwdOp,
    MoeUnpermuteFwdOp,
    SiluAndMulFwdOp,
)
from tileops.ops.moe import ContiguousLayoutSpec, MaskedLayoutSpec

from ._holder import HoldsOp
from .functional import autocast_operands

__all__ = ["MoE", "MoeStages", "stages_of"]

Layout = ContiguousLayoutSpec | MaskedLayoutSpec

#: the routing options a layer passes to MoeTopkGatingFwdOp under the same names
ROUTE_ATTRS = ("top_k", "scoring", "renormalize", "num_groups", "topk_groups",
               "routed_scaling_factor")


class MoeStages:
    """The layer's stages as separate ops, each call an autograd node whose backward is its
    entry's gradient op: the routing (``route``: MoeTopkGatingFwdOp, weights differentiable
    in the logits), the grouping of ``experts`` experts' rows in ``layout`` (``permute``:
    MoePermuteAlignFwdOp, its gradient the unpermutation with unit weights), one grouped GEMM
    op for both products (``gemm``: GroupedGemmFwdOp, ``w[e]`` stored ``[out, in]`` as
    torch.nn.Linear stores it, so ``trans_b``), SiluAndMulFwdOp between them (``act``) and
    the weighted unpermutation (``unpermute``: MoeUnpermuteFwdOp)."""

    def __init__(self, route: dict[str, Any], experts: int, layout: Layout,
                 target: str | None) -> None:
        self.route = MoeTopkGatingFwdOp(**route, target=target)
        self.permute = MoePermuteAlignFwdOp(num_experts=experts, layout=layout, target=target)
        self.gemm = GroupedGemmFwdOp(layout=layout, trans_b=True, target=target)
        self.act = SiluAndMulFwdOp(target=target)
        self.unpermute = MoeUnpermuteFwdOp(target=target)

    def experts(self, y: torch.Tensor, metadata: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor) -> torch.Tensor:
        """Each grouped row through its expert's SwiGLU: ``silu(y @ gate.T) * (y @ up.T)
        @ w2[e].T``, rows flattened to ``[R, H]``."""
        h = self.gemm(y, w13, metadata)
        o = self.gemm(self.act(h), w2, metadata)
        return o.view(math.prod(o.shape[:-1]), o.shape[-1])


def stages_of(layer: nn.Module, device: torch.device, experts: int, layout: Layout,
              slot: str = "_stages") -> MoeStages:
    """``layer``'s :class:`MoeStages` for calls on ``device``, built from its routing
    attributes, ``target``, ``experts`` and ``layout`` (the key of the one set held: a config
    attribute assigned, or a call on another device, builds a fresh set, as an op binds its
    target at its first call and keeps it). Held in the instance dict under ``slot``, which
    the layers leave out of their pickled state."""
    route = {a: getattr(layer, a) for a in ROUTE_ATTRS}
    key = (device, layer.target, tuple(route.values()), experts, layout)
    held = layer.__dict__.get(slot)
    if held is None or held[0] != key:
        held = (key, MoeStages(route, experts, layout, layer.target))
        layer.__dict__[slot] = held
    return held[1]


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
    leading axes is flattened into tokens.

    The fused op has no gradient, so where one is needed (grad mode on and ``x`` or a
    parameter requiring grad) the layer runs the same computation as :class:`MoeStages`'s
    ops instead: route, permute, grouped GEMM with ``w13``, SiluAndMul, grouped GEMM with
    ``w2``, unpermute, each recording its gradient, so ``x``, ``gate.weight``, ``w13`` and
    ``w2`` all get theirs (the correction bias is a buffer: it chooses experts, it has no
    gradient). Under ``torch.no_grad`` (or with nothing requiring grad) it runs the fused
    composite."""

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

    def __setattr__(self, name: str, value: Any) -> None:
        # the experts' count is their weights' leading dim: a new count would route to experts
        # with no weights (refused here, by name, before the layer changes)
        if name == "num_experts" and "w13" in self._parameters and \
                value != self.w13.shape[0]:
            raise ValueError(
                f"{type(self).__name__}.num_experts is the experts' weights' count, "
                f"{self.w13.shape[0]} (w13 is {list(self.w13.shape)}), not {value!r}: build a "
                f"layer of {value!r} experts instead")
        super().__setattr__(name, value)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A move or a cast as ``torch.nn.Module``'s, but the correction bias stays float32
        (its values unrounded: the routing ops take it in float32 whatever the experts' dtype),
        moved where the cast sent it."""
        bias = self.e_score_correction_bias
        module = super()._apply(fn, *args, **kwargs)
        moved = self.e_score_correction_bias
        if bias is not None and moved is not None and moved.dtype != torch.float32:
            self.e_score_correction_bias = bias.to(device=moved.device, dtype=torch.float32)
        return module

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
        rows = self._rows(x, "x")
        logits = self.gate(rows)
        # under autocast the experts' products run in its dtype, as their Linears would; the
        # result comes back in x's dtype, as Hugging Face's blocks sum it
        rows, w13, w2 = autocast_operands(rows, self.w13, self.w2)
        if torch.is_grad_enabled() and (x.requires_grad or any(
                p.requires_grad for p in self.parameters())):
            out = self._staged(rows, logits, w13, w2)
        else:
            out = self.op(rows, logits, w13, w2, self.e_score_correction_bias)
        return out.view(x.shape).to(x.dtype)

    def _build_op(self) -> Any:
        """The fused op, and the training path's stage ops for the parameters' device (built
        here, where the op is: a compiled training step cannot construct them)."""
        op = super()._build_op()
        w13 = self._parameters.get("w13") if "_parameters" in self.__dict__ else None
        if w13 is not None:
            stages_of(self, w13.device, self.num_experts, self.layout)
        return op

    def _rows(self, x: Any, name: str) -> torch.Tensor:
        """``x``'s tokens as rows of ``hidden_size``, refused by name where its last axis is
        another length (a reshape by this layer's size would silently regroup them)."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.hidden_size:
            seen = (f"{str(x.dtype).removeprefix('torch.')}[{', '.join(map(str, x.shape))}]"
                    if isinstance(x, torch.Tensor) else type(x).__name__)
            raise ValueError(f"{type(self).__name__}: argument {name} expected a tensor "
                             f"[..., {self.hidden_size}] (its last axis is hidden_size), seen "
                             f"{seen}")
        return x.reshape(math.prod(x.shape[:-1]), self.hidden_size)

    def _staged(self, rows: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor) -> torch.Tensor:
        """The training path (see the class docstring)."""
        st = stages_of(self, rows.device, self.num_experts, self.layout)
        weights, ids = st.route(logits, self.e_score_correction_bias)
        y, metadata, slots = st.permute(rows, ids)
        return st.unpermute(st.experts(y, metadata, w13, w2), slots, weights)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_stages", None)
        return state

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, scoring="
                f"{self.scoring!r}" + self._target_repr())
