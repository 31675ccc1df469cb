"""Expert parallelism over ``torch.distributed``: :class:`ExpertParallelMoE`, the routed
experts of :class:`~tileops.nn.MoE` sharded over a process group, the router replicated.

Each rank holds ``num_experts / world`` consecutive experts (rank ``r`` the experts
``[r * E_l, (r + 1) * E_l)``) and a batch of its own tokens. A forward:

1. routes its tokens locally (the replicated router, MoeTopkGatingFwdOp) and groups their
   routed slots by global expert (MoePermuteAlignFwdOp over all ``E`` experts, tight), so the
   rows bound for each rank are one consecutive run of the grouped rows, in rank order;
2. exchanges the per-expert counts, then the rows, with ``all_to_all_single`` (each rank
   receives, source rank by source rank, its experts' rows in expert order);
3. groups the received rows by local expert (MoePermuteAlignFwdOp over ``E_l`` experts in the
   layer's layout), runs them through the local experts (the grouped GEMM, SiluAndMul, the
   grouped GEMM: :meth:`~tileops.nn.moe.MoeStages.experts`) and puts them back in received
   order (MoeUnpermuteFwdOp with unit weights);
4. sends the results back with the reverse ``all_to_all_single`` and unpermutes them with the
   gates (MoeUnpermuteFwdOp), as the one-device layer does.

Every stage is an op with its gradient, so the backward is those ops' gradients in reverse
with the row exchanges reversed: ``_AllToAll`` is the one autograd function here, whose
backward is the all-to-all with the split sizes swapped (the adjoint of a permutation of rows
between ranks). The counts are integers, exchanged once forward and reused backward. gloo
implements ``all_to_all_single`` with uneven split sizes on the CPU (the two-rank tests run it
on torch 2.13), as NCCL does on GPUs, so one code path serves both.

Gradients: ``x``'s is this rank's tokens', exact; each expert's is over every rank's tokens
routed to it (they came through the exchange), so an expert shard's gradient is the one-device
layer's slice of it; the router's (``gate.weight``) is this rank's tokens' share only: sum it
over the ranks (``torch.distributed.all_reduce``, or DistributedDataParallel over the group,
as for any replicated parameter) to get the one-device layer's. The layer runs eagerly; it is
not claimed under ``torch.compile``. A rank whose tokens route nowhere on another rank, or
that receives no rows, still joins every exchange (with empty splits) and gets zero gradients
for its experts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tileops.ops import FusedMoeFwdOp
from tileops.ops.moe import ContiguousLayoutSpec, MaskedLayoutSpec

from .moe import ROUTE_ATTRS, MoE, stages_of

__all__ = ["ExpertParallelMoE"]

_NAME = "ExpertParallelMoE"
#: the grouping of a rank's slots by global expert: a send buffer, every slot kept in order
_DISPATCH = ContiguousLayoutSpec()


def _world(group: Any) -> tuple[int, int]:
    """``(world size, rank)`` in ``group`` (None: the default group); refuses where
    torch.distributed is not set up."""
    if not dist.is_available():
        raise RuntimeError(f"{_NAME}: torch.distributed is not available in this build of "
                           f"torch; expert parallelism needs it")
    if not dist.is_initialized():
        raise RuntimeError(f"{_NAME}: torch.distributed is not initialised; expected "
                           f"torch.distributed.init_process_group() to have been called "
                           f"(torchrun sets up its environment) before the layer is built")
    resolved = dist.group.WORLD if group is None else group
    return dist.get_world_size(resolved), dist.get_rank(resolved)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows: ``x``'s first ``send[i]`` rows (then the next ...) go to
    rank ``i``, ``recv[i]`` rows come from rank ``i``; backward sends the gradient back with
    the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], recv: list[int],
                group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out


class ExpertParallelMoE(nn.Module):
    """The routed experts of a mixture-of-experts block with the experts sharded over
    ``group`` (see the module docstring): :class:`~tileops.nn.MoE`'s arguments, routing,
    parameter layout and results, this rank holding ``w13`` and ``w2`` of its
    ``num_experts / world`` experts (``num_local_experts``, from ``expert_offset``) and the
    whole router. ``num_experts`` must be a multiple of the group's size. :meth:`from_moe`
    takes this rank's shard of a full layer, so a sharded model starts from a one-device
    model's exact state; a freshly built shard draws its experts from MoE's init on its own
    (ranks seeded alike draw the same router)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 *, group: Any = None, scoring: str = "softmax", renormalize: bool = True,
                 num_groups: int = 1, topk_groups: int = 1,
                 routed_scaling_factor: float = 1.0, correction_bias: bool = False,
                 layout: ContiguousLayoutSpec | MaskedLayoutSpec | None = None,
                 device: Any = None, dtype: Any = None, target: str | None = None) -> None:
        super().__init__()
        world, rank = _world(group)
        if num_experts % world:
            raise ValueError(f"{_NAME}: argument num_experts is {num_experts}, not divisible "
                             f"by the expert-parallel world size {world}; expected a multiple "
                             f"of {world}")
        kw = {"device": device, "dtype": dtype}
        self.group, self.world, self.rank = group, world, rank
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.num_local_experts = num_experts // world
        self.expert_offset = rank * self.num_local_experts
        self.scoring, self.renormalize = scoring, renormalize
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.routed_scaling_factor = routed_scaling_factor
        self.layout = layout if layout is not None else ContiguousLayoutSpec()
        self.target = target
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, **kw)
        local = self.num_local_experts
        self.w13 = nn.Parameter(torch.empty(local, 2 * intermediate_size, hidden_size, **kw))
        self.w2 = nn.Parameter(torch.empty(local, hidden_size, intermediate_size, **kw))
        if correction_bias:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None
        # the routing and the layout are checked where the layer is made, by the construction
        # check of the composite a one-device MoE of this config holds (the stage ops meet
        # the expert count only at a call)
        FusedMoeFwdOp(num_experts=num_experts, layout=self.layout, target=target,
                      **{a: getattr(self, a) for a in ROUTE_ATTRS})
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As :meth:`tileops.nn.MoE.reset_parameters`: each expert matrix uniform in
        ``1/sqrt(fan_in)``."""
        for w in (self.w13, self.w2):
            bound = 1 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    @classmethod
    def from_moe(cls, moe: MoE, group: Any = None) -> ExpertParallelMoE:
        """This rank's shard of ``moe`` (a full :class:`~tileops.nn.MoE`): its config, its
        router and correction bias, and the rows of ``w13`` and ``w2`` of this rank's
        experts, copied (the shard owns its parameters)."""
        if not isinstance(moe, MoE):
            raise TypeError(f"{_NAME}.from_moe: argument moe must be a tileops.nn.MoE (the "
                            f"full, unsharded layer), seen {type(moe).__name__}")
        route = {a: getattr(moe, a) for a in ROUTE_ATTRS if a != "top_k"}
        layer = cls(moe.hidden_size, moe.intermediate_size, moe.num_experts, moe.top_k,
                    group=group, correction_bias=moe.e_score_correction_bias is not None,
                    layout=moe.layout, device=moe.w13.device, dtype=moe.w13.dtype,
                    target=moe.target, **route)
        part = slice(layer.expert_offset, layer.expert_offset + layer.num_local_experts)
        with torch.no_grad():
            layer.gate.weight.copy_(moe.gate.weight)
            layer.w13.copy_(moe.w13[part])
            layer.w2.copy_(moe.w2[part])
            if moe.e_score_correction_bias is not None:
                layer.e_score_correction_bias.copy_(moe.e_score_correction_bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.hidden_size)
        dev, local, world = rows.device, self.num_local_experts, self.world
        dispatch = stages_of(self, dev, self.num_experts, _DISPATCH, "_dispatch")
        st = stages_of(self, dev, local, self.layout)
        weights, ids = dispatch.route(self.gate(rows), self.e_score_correction_bias)
        grouped, offsets, slots = dispatch.permute(rows, ids)
        # the counts of each (destination rank, its expert), then the rows: the source's
        # slots of one rank's experts are consecutive in the grouping
        counts = (offsets[1:] - offsets[:-1]).to(torch.int64)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.group)
        send = counts.view(world, local).sum(1).tolist()
        recv = got.view(world, local).sum(1).tolist()
        arrived = _AllToAll.apply(grouped, send, recv, self.group)
        # the rows arrive source by source, each source's in expert order
        expert = torch.arange(local, device=dev).repeat(world)
        local_ids = torch.repeat_interleave(expert, got).to(torch.int32)[:, None]
        y, metadata, local_slots = st.permute(arrived, local_ids)
        out = st.experts(y, metadata, self.w13, self.w2)
        unit = torch.ones(local_slots.shape, device=dev,
                          dtype=torch.float64 if out.dtype == torch.float64 else torch.float32)
        back = _AllToAll.apply(st.unpermute(out, local_slots, unit), recv, send, self.group)
        return st.unpermute(back, slots, weights).view(x.shape)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_stages", None)
        state.pop("_dispatch", None)
        return state

    def extra_repr(self) -> str:
        target = "" if self.target is None else f", target={self.target!r}"
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, top_k={self.top_k}, experts "
                f"[{self.expert_offset}, {self.expert_offset + self.num_local_experts}) of "
                f"{self.world} ranks, scoring={self.scoring!r}" + target)
