"""Mixture of experts, staged: routing, the grouping of routed rows by expert, a GEMM per
expert, the rows back in token order, and the whole layer as one composite.

The layout of the grouped rows is the ``MGroupedLayout`` ADT (``specs/types.yaml``), one
Python class a constructor: :class:`ContiguousLayoutSpec` (``packing``, ``metadata_kind``,
``alignment``) and :class:`MaskedLayoutSpec` (``max_m``). An op's ``layout`` param takes
either (or the spec's ``{constructor: fields}`` value); the construction check validates the
fields and the constructor's invariant, and the family reads the value as a
:class:`~tileops.ops._moe_layout.LayoutValue`.

:class:`MoeOp` is the family base: it reads the layout once (``derive``) and brings tensors to
the kernels' layout (contiguous, 16-byte aligned). Its ops:

- :class:`MoeTopkGatingFwdOp`: the slot ``moe_gating`` (a thread a token); its weights'
  gradient :class:`MoeTopkGatingBwdOp` the slot ``moe_gating_bwd`` (a thread a token);
- :class:`MoePermuteAlignFwdOp`: the grouping by the slot ``moe_group`` (four launches: the
  slots' ranks within their experts by chunked counts, the segment offsets, the layout's
  metadata, the token of each row; :func:`~tileops.ops._moe_layout.group_slots`, a stable sort
  in torch ops, is its reference), then the rows moved by the slot ``moe_permute_rows``
  (a CTA a token writes its row to its slots' rows, 16-byte vectors), which writes every row,
  zeros where no slot goes;
  its gradient :class:`MoePermuteAlignBwdOp` the unpermutation's slot with unit weights;
- :class:`MoeUnpermuteFwdOp`: the slot ``moe_unpermute`` (a CTA a token, float32 sums);
- :class:`GroupedGemmFwdOp`: the slot ``grouped_gemm_fwd`` (a tile scheduler over the
  experts' rows read from the metadata on the device, clamped into bounds there: no host
  read); its reference, and :class:`GroupedGemmBwdOp`'s, refuse metadata out of range by
  name (:func:`~tileops.ops._moe_layout.refuse_bad_metadata`);
- :class:`FusedMoeFwdOp`: a composite of the four and SiluAndMulFwdOp, each call recorded in
  its stage (``last_call.stages``).

Each op's reference is declared here and computed in ``_moe_layout.py``; the contenders are
torch's: torch._grouped_mm (a peer where torch has it) and per-expert loops of torch.mm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, get_args

import torch
import torch.nn.functional as F

from tileops.kernels.grouped_gemm import (
    GroupedGemmDType,
    GroupedGemmInterface,
    GroupedGemmKernel,
    GroupedGemmSpec,
    GroupedLayoutKind,
)
from tileops.kernels.moe import (
    GatingDType,
    MoeDType,
    MoeGateGradInterface,
    MoeGateGradKernel,
    MoeGatingBwdInterface,
    MoeGatingBwdKernel,
    MoeGatingBwdSpec,
    MoeGatingInterface,
    MoeGatingKernel,
    MoeGatingSpec,
    MoePermuteInterface,
    MoePermuteKernel,
    MoeRowsSpec,
    MoeUnpermuteInterface,
    MoeUnpermuteKernel,
    MoeUnpermuteSpec,
)
from tileops.kernels.moe_group import (
    MoeGroupInterface,
    MoeGroupKernel,
    MoeGroupSpec,
)
from tileops.runtime import Op
from tileops.spec import AdtValue

from ._dtypes import NAMES, refuse_unserved
from ._moe_layout import (
    LayoutValue,
    expert_of_row,
    fused_reference,
    gating_bwd_reference,
    gating_reference,
    grouped_gemm_bwd_reference,
    grouped_gemm_reference,
    permute_bwd_reference,
    permute_reference,
    refuse_bad_metadata,
    refuse_bad_rows,
    unpermute_bwd_reference,
    unpermute_reference,
)
from .elementwise import SiluAndMulFwdOp

__all__ = [
    "ContiguousLayoutSpec",
    "FusedMoeFwdOp",
    "GroupedGemmBwdOp",
    "GroupedGemmFwdOp",
    "MaskedLayoutSpec",
    "MoeOp",
    "MoePermuteAlignBwdOp",
    "MoePermuteAlignFwdOp",
    "MoeTopkGatingBwdOp",
    "MoeTopkGatingFwdOp",
    "MoeUnpermuteBwdOp",
    "MoeUnpermuteFwdOp",
    "layout_spec",
]

_ROW_DTYPES = frozenset(get_args(MoeDType))
_GATING_DTYPES = frozenset(get_args(GatingDType))
_GEMM_DTYPES = frozenset(get_args(GroupedGemmDType))


@dataclass(frozen=True, kw_only=True)
class ContiguousLayoutSpec:
    """``MGroupedLayout.contiguous``: each expert's rows one segment, padded to a multiple of
    ``alignment`` rows when ``packing`` is ``'aligned'`` (``'tight'``: alignment 1); the
    metadata is the E + 1 segment offsets (``'offsets'``) or the expert of every row, -1 for
    padding (``'per_row'``). The op's construction check validates the fields and the
    invariant ``(packing == 'tight') == (alignment == 1) and alignment >= 1``."""

    packing: str = "tight"
    metadata_kind: str = "offsets"
    alignment: int = 1


@dataclass(frozen=True)
class MaskedLayoutSpec:
    """``MGroupedLayout.masked``: each expert a block of ``max_m`` rows, its first
    ``metadata[e]`` rows valid (a routing with more rows for one expert drops the rest)."""

    max_m: int


def _layout_value(v: AdtValue) -> LayoutValue:
    """The family's reading of a validated MGroupedLayout value."""
    if v.constructor == "masked":
        return LayoutValue(masked=True, max_m=v.fields["max_m"])
    return LayoutValue(masked=False, alignment=v.fields["alignment"],
                       per_row=v.fields["metadata_kind"] == "per_row")


def layout_spec(v: AdtValue) -> ContiguousLayoutSpec | MaskedLayoutSpec:
    """The constructor class's instance of a validated MGroupedLayout value (hashable: the
    composite keys its delegates by their params)."""
    if v.constructor == "masked":
        return MaskedLayoutSpec(v.fields["max_m"])
    return ContiguousLayoutSpec(**v.fields)


def _laid(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous at a 16-byte aligned address (the kernels read 16-byte vectors)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


class MoeOp(Op):
    """Family base of the mixture-of-experts ops (see the module docstring)."""

    @classmethod
    def normalize_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """A ``layout`` spelled as the spec spells an ADT value, ``{constructor: {field:
        value}}`` (its default, a workload row's), is that value; the construction check then
        validates it like a constructor class's instance."""
        layout = params.get("layout")
        if isinstance(layout, dict) and len(layout) == 1:
            (ctor, fields), = layout.items()
            if isinstance(ctor, str) and isinstance(fields, dict):
                params = {**params, "layout": AdtValue(ctor, dict(fields))}
        return params

    def derive(self) -> None:
        layout = self._point.params.get("layout")
        #: the layout as the family reads it (None for an op without one)
        self.layout_value = None if layout is None else _layout_value(layout)

    def _entry(self, key: tuple, interface: type, make: Any, dtype: Any, served, kernels: str):
        """The slot's entry for ``key`` (one lookup when cached), refusing a dtype the
        in-tree kernels do not serve by this op's name."""
        entry = self._entries_by_call.get(key)
        if entry is None:
            refuse_unserved(self, dtype, served, kernels)
            entry = self.kernel_for(key, interface, make)
        return entry


class MoeTopkGatingFwdOp(MoeOp):
    kernel_types = {MoeGatingInterface: (MoeGatingKernel,)}

    def _route(self) -> dict[str, Any]:
        return dict(top_k=self.top_k, scoring=self.scoring, renormalize=self.renormalize,
                    num_groups=self.num_groups, topk_groups=self.topk_groups,
                    scale=self.routed_scaling_factor)

    def forward(self, call, logits, correction_bias, weights, ids) -> None:
        has_bias = correction_bias is not None
        key = (call.device, logits.dtype, has_bias and correction_bias.dtype)
        entry = self._entries_by_call.get(key)
        if entry is None:
            refuse_unserved(self, logits.dtype, _GATING_DTYPES, "gating")
            if has_bias:
                refuse_unserved(self, correction_bias.dtype, frozenset({"float32"}), "gating")
            entry = self.kernel_for(key, MoeGatingInterface, lambda: MoeGatingSpec(
                device=call.device, e=logits.shape[1], top_k=self.top_k,
                dtype=NAMES[logits.dtype], scoring=self.scoring, renormalize=self.renormalize,
                num_groups=self.num_groups, topk_groups=self.topk_groups,
                scale=float(self.routed_scaling_factor), bias=has_bias))
        entry(_laid(logits), None if correction_bias is None else _laid(correction_bias),
              weights, ids)

    def reference(self, call, logits, correction_bias):
        return gating_reference(logits, correction_bias, **self._route())

    def eager(self):
        route = self._route()

        def torch_gating(logits, correction_bias=None):  # the reference's torch ops
            return gating_reference(logits, correction_bias, **route)

        return torch_gating


class MoePermuteAlignFwdOp(MoeOp):
    kernel_types = {MoePermuteInterface: (MoePermuteKernel,), MoeGroupInterface: (MoeGroupKernel,)}

    def forward(self, call, x, ids, y, metadata, rows) -> None:
        lay, experts = self.layout_value, self.num_experts
        kind = "masked" if lay.masked else "per_row" if lay.per_row else "offsets"
        group = self.kernel_for(
            (call.device, "group", ids.shape[1]), MoeGroupInterface,
            lambda: MoeGroupSpec(device=call.device, e=experts, k=ids.shape[1], metadata=kind,
                                 max_m=lay.max_m, alignment=lay.alignment))
        src = torch.empty((lay.rows(ids.numel(), experts),), dtype=torch.int32,
                          device=ids.device)
        meta_out = metadata if metadata.is_contiguous() else torch.empty_like(
            metadata, memory_format=torch.contiguous_format)
        rows_out = rows if rows.is_contiguous() else torch.empty_like(
            rows, memory_format=torch.contiguous_format)
        group(_laid(ids), meta_out, rows_out, src)
        if meta_out is not metadata:
            metadata.copy_(meta_out)
        if rows_out is not rows:
            rows.copy_(rows_out)
        h = x.shape[1]
        key = (call.device, x.dtype, h)
        entry = self._entry(key, MoePermuteInterface, lambda: MoeRowsSpec(
            device=call.device, h=h, dtype=NAMES[x.dtype]), x.dtype, _ROW_DTYPES,
            "permutation")
        entry(_laid(x), rows_out, src, y.view(-1, h))

    def reference(self, call, x, ids):
        return permute_reference(x, ids, self.num_experts, self.layout_value)

    def eager(self):
        experts, layout = self.num_experts, self.layout_value

        def torch_permute(x, ids):  # a stable sort by expert and an index of x's rows
            return permute_reference(x, ids, experts, layout)

        return torch_permute


class MoeUnpermuteFwdOp(MoeOp):
    kernel_types = {MoeUnpermuteInterface: (MoeUnpermuteKernel,)}

    def forward(self, call, y, rows, weights, out) -> None:
        h, k = y.shape[1], rows.shape[1]
        key = (call.device, y.dtype, weights.dtype, h, k)
        entry = self._entries_by_call.get(key)
        if entry is None:
            refuse_unserved(self, y.dtype, _ROW_DTYPES, "unpermutation")
            refuse_unserved(self, weights.dtype, frozenset({"float32"}), "unpermutation")
            entry = self.kernel_for(key, MoeUnpermuteInterface, lambda: MoeUnpermuteSpec(
                device=call.device, h=h, k=k, dtype=NAMES[y.dtype]))
        entry(_laid(y), _laid(rows), _laid(weights), out)

    def reference(self, call, y, rows, weights):
        refuse_bad_rows(self, rows, y.shape[0], "y")
        return (unpermute_reference(y, rows, weights),)

    def eager(self):
        def torch_unpermute(y, rows, weights):  # index_select, scale, sum over the picks
            r = rows.long()
            picked = torch.where((r >= 0)[..., None], y[r.clamp(min=0)], 0)
            wide = torch.promote_types(weights.dtype, torch.float32)
            return (picked.to(wide) * weights.to(wide)[..., None]).sum(1).to(y.dtype)

        return torch_unpermute


class GroupedGemmFwdOp(MoeOp):
    kernel_types = {GroupedGemmInterface: (GroupedGemmKernel,)}
    reference_widens = frozenset({"b"})  # an expert's weights at a time

    def derive(self) -> None:
        super().derive()
        self._read = self.index_reader("M", "E", "N", "K")

    def forward(self, call, a, b, metadata, c) -> None:
        m, e, n, k = self._read(call)
        lay = self.layout_value
        key = (call.device, a.dtype, m, e, n, k)
        entry = self._entry(key, GroupedGemmInterface, lambda: GroupedGemmSpec(
            device=call.device, m=m, e=e, n=n, k=k, dtype=NAMES[a.dtype],
            trans_b=self.trans_b,
            layout=GroupedLayoutKind.MASKED if lay.masked else GroupedLayoutKind.CONTIGUOUS,
            max_m=lay.max_m, per_row=lay.per_row), a.dtype, _GEMM_DTYPES, "grouped GEMM")
        entry(_laid(a), _laid(b), _laid(metadata), c)

    def reference(self, call, a, b, metadata):
        _refuse_bad_metadata(self, a, b, metadata)
        return (grouped_gemm_reference(a, b, metadata, layout=self.layout_value,
                                       trans_b=self.trans_b),)

    def eager(self):
        layout, trans_b = self.layout_value, self.trans_b

        def per_expert_mm(a, b, metadata):  # torch.mm (cuBLAS) an expert, bounds read back
            bt = b.transpose(-2, -1) if trans_b else b
            c = a.new_zeros((*a.shape[:-1], bt.shape[-1]))
            if layout.masked:
                for e, n in enumerate(metadata.clamp(0, layout.max_m).tolist()):
                    c[e, :n] = a[e, :n] @ bt[e]
                return c
            owner = expert_of_row(metadata, layout, a.shape[0], b.shape[0])
            if layout.per_row:
                for e in range(b.shape[0]):
                    rows = (owner == e).nonzero().squeeze(1)
                    c[rows] = a[rows] @ bt[e]
                return c
            hi = torch.cummax(metadata[1:].long(), 0).values.clamp(0, a.shape[0]).tolist()
            for e, (lo, end) in enumerate(zip([0, *hi[:-1]], hi, strict=True)):
                c[lo:end] = a[lo:end] @ bt[e]
            return c

        return per_expert_mm

    peers = {"grouped_mm": lambda op: _grouped_mm_peer(op)}


class MoeTopkGatingBwdOp(MoeOp):
    """The routing weights' gradient through the slot ``moe_gating_bwd`` (a thread a token,
    as the forward): the picks are the forward's ids, so the groups and the correction bias,
    which only chose them, are not this op's params."""

    kernel_types = {MoeGatingBwdInterface: (MoeGatingBwdKernel,)}

    def forward(self, call, dweights, logits, ids, dlogits) -> None:
        key = (call.device, logits.dtype, dweights.dtype)
        entry = self._entries_by_call.get(key)
        if entry is None:
            refuse_unserved(self, logits.dtype, _GATING_DTYPES, "gating")
            refuse_unserved(self, dweights.dtype, frozenset({"float32"}), "gating")
            entry = self.kernel_for(key, MoeGatingBwdInterface, lambda: MoeGatingBwdSpec(
                device=call.device, e=logits.shape[1], top_k=self.top_k,
                dtype=NAMES[logits.dtype], scoring=self.scoring,
                renormalize=self.renormalize, scale=float(self.routed_scaling_factor)))
        entry(_laid(dweights), _laid(logits), _laid(ids), dlogits)

    def _grad(self) -> dict[str, Any]:
        return dict(top_k=self.top_k, scoring=self.scoring, renormalize=self.renormalize,
                    scale=self.routed_scaling_factor)

    def reference(self, call, dweights, logits, ids):
        return (gating_bwd_reference(dweights, logits, ids, **self._grad()),)

    def eager(self):
        grad = self._grad()

        def torch_gating_bwd(dweights, logits, ids):  # the closed form in torch ops
            return gating_bwd_reference(dweights, logits, ids, **grad).to(logits.dtype)

        return torch_gating_bwd


class MoePermuteAlignBwdOp(MoeOp):
    """The permutation's gradient: the unpermutation with unit weights, through the
    unpermutation's own slot (``moe_unpermute``: the same kernel, a CTA a token, float32
    sums); the weights are a ones tensor of the picks, a float a routed slot beside the rows
    it sums."""

    kernel_types = {MoeUnpermuteInterface: (MoeUnpermuteKernel,)}

    def forward(self, call, dy, rows, dx) -> None:
        if self.checks_indices(rows):  # a call made directly: the kernel reads dy's rows
            refuse_bad_rows(self, rows, math.prod(dy.shape[:-1]), "dy")
        h, k = dy.shape[-1], rows.shape[1]
        key = (call.device, dy.dtype, h, k)
        entry = self._entry(key, MoeUnpermuteInterface, lambda: MoeUnpermuteSpec(
            device=call.device, h=h, k=k, dtype=NAMES[dy.dtype]), dy.dtype, _ROW_DTYPES,
            "unpermutation")
        unit = torch.ones(rows.shape, dtype=torch.float32, device=rows.device)
        entry(_laid(dy).view(-1, h), _laid(rows), unit, dx)

    def reference(self, call, dy, rows):
        refuse_bad_rows(self, rows, math.prod(dy.shape[:-1]), "dy")
        return (permute_bwd_reference(dy, rows),)

    def eager(self):
        def torch_permute_bwd(dy, rows):  # index_select of the picks' rows, summed
            return permute_bwd_reference(dy, rows).to(dy.dtype)

        return torch_permute_bwd


class MoeUnpermuteBwdOp(MoeOp):
    """The unpermutation's gradient: the gates' through the slot ``moe_gate_grad`` (a dot
    product a pick, a warp a token); the rows' in torch ops on the device, each kept pick's
    weighted upstream row summed into its row (index_add_ over one spare row for the dropped
    picks: rows a routing names twice are summed, as the gradient of a gather is)."""

    kernel_types = {MoeGateGradInterface: (MoeGateGradKernel,)}

    def forward(self, call, dout, y, rows, weights, dy, dweights) -> None:
        if self.checks_indices(rows):  # a call made directly: y's rows are read and written
            refuse_bad_rows(self, rows, y.shape[0], "y")
        if dweights is not None:
            h, k = y.shape[1], rows.shape[1]
            key = (call.device, y.dtype, dweights.dtype, h, k)
            entry = self._entries_by_call.get(key)
            if entry is None:
                refuse_unserved(self, y.dtype, _ROW_DTYPES, "unpermutation")
                refuse_unserved(self, dweights.dtype, frozenset({"float32"}), "unpermutation")
                entry = self.kernel_for(key, MoeGateGradInterface, lambda: MoeUnpermuteSpec(
                    device=call.device, h=h, k=k, dtype=NAMES[y.dtype]))
            entry(_laid(dout), _laid(y), _laid(rows), dweights)
        if dy is not None:
            dy.copy_(unpermute_bwd_reference(dout, y, rows, weights, grad_y=True,
                                             grad_weights=False)[0])

    def reference(self, call, dout, y, rows, weights):
        refuse_bad_rows(self, rows, y.shape[0], "y")
        return unpermute_bwd_reference(dout, y, rows, weights, grad_y=self.grad_y,
                                       grad_weights=self.grad_weights)


class GroupedGemmBwdOp(MoeOp):
    """The grouped GEMM's gradient: ``da`` through the forward's slot with the other weight
    layout (``dc @ op(b)^T`` is a grouped GEMM of ``dc`` and ``b`` as stored, ``trans_b``
    flipped, reduction over N); ``db`` an expert at a time in torch: a batched product of the
    masked blocks, or over contiguous segments torch._grouped_mm of ``a.T`` and ``dc`` (its
    offsets the segments' ends, on the device) where torch has it for the call (bfloat16 on
    CUDA), else torch.mm a segment with the bounds read back (no CUDA graph captures that)."""

    kernel_types = {GroupedGemmInterface: (GroupedGemmKernel,)}
    reference_widens = frozenset({"b"})  # an expert's weights at a time

    def derive(self) -> None:
        super().derive()
        self._read = self.index_reader("M", "E", "N", "K")

    def forward(self, call, a, b, metadata, dc, da, db) -> None:
        m, e, n, k = self._read(call)
        lay = self.layout_value
        if da is not None:
            key = (call.device, dc.dtype, m, e, k, n)
            entry = self._entry(key, GroupedGemmInterface, lambda: GroupedGemmSpec(
                device=call.device, m=m, e=e, n=k, k=n, dtype=NAMES[dc.dtype],
                trans_b=not self.trans_b,
                layout=GroupedLayoutKind.MASKED if lay.masked else GroupedLayoutKind.CONTIGUOUS,
                max_m=lay.max_m, per_row=lay.per_row), dc.dtype, _GEMM_DTYPES, "grouped GEMM")
            entry(_laid(dc), _laid(b), _laid(metadata), da)
        if db is not None:
            db.copy_(self._weight_grad(dc, a, b, metadata, e))

    def _weight_grad(self, dc, a, b, metadata, e):
        lay = self.layout_value
        if lay.masked or lay.per_row:  # data-independent: the reference's closed form
            return grouped_gemm_bwd_reference(dc, a, b, metadata, layout=lay,
                                              trans_b=self.trans_b, grad_a=False,
                                              grad_b=True)[1]
        ends = torch.cummax(metadata[1:].long(), 0).values.clamp(0, a.shape[0])
        grouped_mm = getattr(torch, "_grouped_mm", None)
        if a.shape[0] == 0:  # no rows: every expert's gradient is 0, no product asked for
            g = a.new_zeros((e, a.shape[1], dc.shape[1]))
        elif grouped_mm is not None and a.is_cuda and _grouped_mm_takes(a.t(), dc):
            # the segments' products over their rows, the bounds read on the device (a CUDA
            # graph captures it); torch's kernel needs rows of whole 16 bytes
            g = grouped_mm(a.t(), dc, offs=ends.to(torch.int32))
        else:  # the bounds read back: a product a segment
            g = a.new_zeros((e, a.shape[1], dc.shape[1]))
            hi = ends.tolist()
            for i, (lo, end) in enumerate(zip([0, *hi[:-1]], hi, strict=True)):
                if end > lo:
                    torch.mm(a[lo:end].T, dc[lo:end], out=g[i])
        return g.transpose(1, 2) if self.trans_b else g

    def reference(self, call, a, b, metadata, dc):
        _refuse_bad_metadata(self, a, b, metadata)
        return grouped_gemm_bwd_reference(dc, a, b, metadata, layout=self.layout_value,
                                          trans_b=self.trans_b, grad_a=self.grad_a,
                                          grad_b=self.grad_b)


class FusedMoeFwdOp(MoeOp):
    """The layer as its stages (see the spec entry): route, permute, gate_up, act, down,
    unpermute, each a delegate op whose call is recorded in its stage."""

    delegate_types = {"route": MoeTopkGatingFwdOp, "permute": MoePermuteAlignFwdOp,
                      "gate_up": GroupedGemmFwdOp, "act": SiluAndMulFwdOp,
                      "down": GroupedGemmFwdOp, "unpermute": MoeUnpermuteFwdOp}
    reference_widens = frozenset({"w13", "w2"})  # an expert's weights at a time

    def _route(self) -> dict[str, Any]:
        return dict(top_k=self.top_k, scoring=self.scoring, renormalize=self.renormalize,
                    num_groups=self.num_groups, topk_groups=self.topk_groups,
                    routed_scaling_factor=self.routed_scaling_factor)

    def forward(self, call, x, router_logits, w13, w2, correction_bias, out) -> None:
        if x.is_cuda and self.target is None:  # the GEMM delegates' dtypes, by this op's name
            refuse_unserved(self, x.dtype, _GEMM_DTYPES, "grouped GEMM")
        layout = layout_spec(self._point.params["layout"])
        route = self.delegate_for("route", **self._route())
        permute = self.delegate_for("permute", num_experts=self.num_experts, layout=layout)
        gate_up = self.delegate_for("gate_up", layout=layout, trans_b=True)
        act = self.delegate_for("act")
        down = self.delegate_for("down", layout=layout, trans_b=True)
        unpermute = self.delegate_for("unpermute")
        with self.stage("route"):
            weights, ids = route(router_logits, correction_bias)
        with self.stage("permute"):
            y, metadata, rows = permute(x, ids)
        with self.stage("gate_up"):
            h = gate_up(y, w13, metadata)
        with self.stage("act"):
            a = act(h)
        with self.stage("down"):
            o = down(a, w2, metadata)
        with self.stage("unpermute"):
            out.copy_(unpermute(o.view(math.prod(o.shape[:-1]), o.shape[-1]), rows, weights))

    def reference(self, call, x, router_logits, w13, w2, correction_bias):
        route = self._route()
        route["scale"] = route.pop("routed_scaling_factor")
        return (fused_reference(x, router_logits, w13, w2, correction_bias,
                                layout=self.layout_value, **route),)

    def eager(self):
        return _torch_moe(self)


def _refuse_bad_metadata(op: MoeOp, a: torch.Tensor, b: torch.Tensor,
                         metadata: torch.Tensor) -> None:
    """The grouped GEMM references' check of the metadata (:func:`refuse_bad_metadata`): the
    rows of a contiguous ``a``, the experts of ``b``."""
    refuse_bad_metadata(op, metadata, op.layout_value, a.shape[0], b.shape[0])


def _mm_aligned(*tensors: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes these operands (and its output, whose rows are the
    second's columns): each base 16-byte aligned and each row stride a whole number of 16
    bytes; rows of 257 bfloat16 values are not."""
    return all(t.data_ptr() % 16 == 0 and all(
        (st * t.element_size()) % 16 == 0 for st, sz in zip(t.stride(), t.shape, strict=True)
        if st != 1 and sz > 1) for t in tensors)


def _grouped_mm_takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch._grouped_mm serves ``a @ b``: operands whose rows (and the output's,
    ``b``'s columns) are whole 16 bytes, on CUDA in bfloat16 only."""
    if a.is_cuda and a.dtype != torch.bfloat16:
        return False
    return _mm_aligned(a, b) and (b.shape[-1] * b.element_size()) % 16 == 0


def _segment_products(a: torch.Tensor, bt: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``a[rows of expert e] @ bt[e]`` a segment at a time (the bounds read back), rows past
    the last end zero: torch._grouped_mm's result where it does not take the operands."""
    out = a.new_zeros((a.shape[0], bt.shape[-1]))
    lo = 0
    for e, hi in enumerate(ends.tolist()):
        if hi > lo:
            torch.mm(a[lo:hi], bt[e], out=out[lo:hi])
        lo = max(lo, hi)
    return out


# --- torch contenders ---------------------------------------------------------------------------


def _grouped_mm_peer(op: GroupedGemmFwdOp) -> Any:
    """torch._grouped_mm over the contiguous offsets (its ``offs`` are the segments' ends) or
    the masked blocks (a batched product of every block, the rows past each count then zeroed);
    None where torch lacks it or the metadata is an expert per row."""
    grouped_mm = getattr(torch, "_grouped_mm", None)
    layout, trans_b = op.layout_value, op.trans_b
    if grouped_mm is None or layout.per_row:
        return None

    def torch_grouped_mm(a, b, metadata):
        bt = b.transpose(-2, -1) if trans_b else b
        takes = _grouped_mm_takes(a, bt)
        if layout.masked:
            c = grouped_mm(a, bt) if takes else torch.bmm(a, bt)
            valid = torch.arange(a.shape[1], device=a.device) < metadata[:, None]
            return torch.where(valid[..., None], c, 0)
        if takes:
            return grouped_mm(a, bt, offs=metadata[1:])
        return _segment_products(a, bt, metadata[1:])

    return torch_grouped_mm


def _torch_moe(op: FusedMoeFwdOp) -> Any:
    """The layer in torch ops: the routing, a stable sort of the slots by expert, the rows
    gathered, torch._grouped_mm (a per-expert loop of torch.mm where torch lacks it) for both
    products with silu(gate) * up between, and index_add_ back weighted by the gates; the
    contiguous tight layout's pipeline (torch has no masked one), which is what the layer
    computes whenever no masked block overflows."""
    route = op._route()
    route["scale"] = route.pop("routed_scaling_factor")
    experts = op.num_experts
    grouped_mm = getattr(torch, "_grouped_mm", None)

    def products(xs, w, ends):
        if grouped_mm is not None and _grouped_mm_takes(xs, w.transpose(-2, -1)):
            return grouped_mm(xs, w.transpose(-2, -1), offs=ends)
        return _segment_products(xs, w.transpose(-2, -1), ends)

    def torch_moe(x, router_logits, w13, w2, correction_bias=None):
        weights, ids = gating_reference(router_logits, correction_bias, **route)
        flat = ids.reshape(-1).long()
        order = torch.sort(flat, stable=True).indices
        counts = torch.zeros(experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        ends = torch.cumsum(counts, 0).to(torch.int32)
        token = order // ids.shape[1]
        h = products(x[token], w13, ends)
        inter = h.shape[1] // 2
        a = F.silu(h[:, :inter]) * h[:, inter:]
        o = products(a, w2, ends)
        scaled = o.float() * weights.reshape(-1)[order, None].float()
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(
            0, token, scaled).to(x.dtype)

    return torch_moe
