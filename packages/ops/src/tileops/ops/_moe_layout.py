"""The mixture-of-experts family's computations in plain PyTorch: the routing, the grouping of
routed slots by expert in either layout, and the references of the staged ops.

:func:`group_slots` is half of the permutation's reference (a stable sort in torch ops on the
device, none of which waits for the host: no boolean indexing, no ``bincount`` of unknown
length); the CUDA forward groups with its own kernel (``tileops.kernels.moe_group``: chunked
counts, no sort), which the tests hold to it. The other functions are the references: each computes in float32 for narrower inputs and in float64 for float64 ones,
and never writes its inputs. The fused layer's reference, :func:`fused_reference`, is a loop
over the experts that does not go through :func:`group_slots`, so it checks the composite's
grouping too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tileops.runtime.memory import first_outside, has_data

__all__ = [
    "Grouping",
    "LayoutValue",
    "expert_of_row",
    "fused_reference",
    "gating_bwd_reference",
    "gating_reference",
    "permute_bwd_reference",
    "grouped_gemm_bwd_reference",
    "unpermute_bwd_reference",
    "grouped_gemm_reference",
    "group_slots",
    "permute_reference",
    "refuse_bad_metadata",
    "refuse_bad_rows",
    "unpermute_reference",
    "wide_dtype",
]


@dataclass(frozen=True)
class LayoutValue:
    """An MGroupedLayout value as the family reads it: ``masked`` with ``max_m``, or
    contiguous with ``alignment`` and ``per_row`` (an expert per row, else the E + 1
    offsets)."""

    masked: bool
    max_m: int = 0
    alignment: int = 1
    per_row: bool = False

    def rows(self, slots: int, experts: int) -> int:
        """The rows of a grouping of ``slots`` routed slots: the layout's bound."""
        if self.masked:
            return experts * self.max_m
        return slots + experts * (self.alignment - 1)


def wide_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 for a float64 tensor, else float32: what a reference computes in."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# --- routing ----------------------------------------------------------------------------------


def gating_reference(logits: torch.Tensor, bias: torch.Tensor | None, *, top_k: int,
                     scoring: str, renormalize: bool, num_groups: int, topk_groups: int,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)`` of MoeTopkGatingFwdOp. The picks are a stable descending sort of
    the choice scores (ties keep the lowest id); without a bias or groups the choice scores
    are the logits themselves (softmax and sigmoid are increasing, so the order is the
    scores', exactly, with no rounding of the scores to tie two logits that differ)."""
    wide = wide_dtype(logits)
    z = logits.to(wide)
    scores = torch.softmax(z, dim=-1) if scoring == "softmax" else torch.sigmoid(z)
    if bias is None and num_groups == 1:
        choice = z
    else:
        choice = scores if bias is None else scores + bias.to(wide)
    m, e = z.shape
    if num_groups > 1:
        per = e // num_groups
        top2 = torch.sort(choice.view(m, num_groups, per), dim=-1, descending=True).values
        group_score = top2[..., :2].sum(-1)
        keep = torch.sort(group_score, dim=-1, descending=True, stable=True).indices
        kept = torch.zeros(m, num_groups, dtype=torch.bool, device=z.device)
        kept.scatter_(1, keep[:, :topk_groups], True)
        eligible = kept.repeat_interleave(per, dim=1)
        choice = choice.masked_fill(~eligible, float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * scale, ids.to(torch.int32)


def gating_bwd_reference(dweights: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, *,
                         top_k: int, scoring: str, renormalize: bool,
                         scale: float) -> torch.Tensor:
    """``dlogits`` of MoeTopkGatingBwdOp: the weights' chain rule with the picks fixed. Each
    pick's score gradient (``g = scale * dweights``, through the renormalisation ``w = s / S``:
    ``(g - sum(g * w)) / S``) is summed into its expert's column (``scatter_add``: a column two
    picks name gets both), then taken through the softmax's or the sigmoid's Jacobian. A pick
    whose id is outside ``[0, E)`` has score 0 and no column."""
    wide = wide_dtype(logits)
    z = logits.to(wide)
    s = torch.softmax(z, dim=-1) if scoring == "softmax" else torch.sigmoid(z)
    e = z.shape[1]
    idx = ids.to(torch.int64)
    valid = (idx >= 0) & (idx < e)
    idx = idx.clamp(0, e - 1)
    picked = torch.where(valid, s.gather(1, idx), torch.zeros((), dtype=wide))
    g = dweights.to(wide) * scale
    if renormalize:
        total = picked.sum(-1, keepdim=True)
        g = (g - (g * picked).sum(-1, keepdim=True) / total) / total
    g = torch.where(valid, g, torch.zeros((), dtype=wide))
    ds = torch.zeros_like(s).scatter_add(1, idx, g)
    if scoring == "softmax":
        return s * (ds - (ds * s).sum(-1, keepdim=True))
    return ds * s * (1 - s)


# --- the grouping ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grouping:
    """Where the routed slots go: ``rows`` (the slot's row, -1 when dropped; the shape of
    ``ids``), ``metadata`` (the layout's) and ``src`` (the token of each of the ``R`` rows, -1
    for a row no slot fills)."""

    rows: torch.Tensor
    metadata: torch.Tensor
    src: torch.Tensor


def group_slots(ids: torch.Tensor, experts: int, layout: LayoutValue) -> Grouping:
    """Group the slots of ``ids`` (``[M, K]``) by expert, in token order within an expert, as
    MoePermuteAlignFwdOp states (see its spec entry). Device-side torch ops only."""
    dev = ids.device
    m, k = ids.shape
    n = m * k
    r = layout.rows(n, experts)
    flat = ids.reshape(-1).to(torch.int64)
    valid = (flat >= 0) & (flat < experts)
    key = torch.where(valid, flat, experts)  # dropped slots sort last
    order = torch.sort(key, stable=True).indices
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts  # each expert's first slot in sorted order
    sorted_key = key[order]
    pos = torch.arange(n, device=dev) - starts[sorted_key]  # the slot's rank in its expert
    counts = counts[:experts]
    if layout.masked:
        kept = (sorted_key < experts) & (pos < layout.max_m)
        row = torch.where(kept, sorted_key * layout.max_m + pos, -1)
        metadata = counts.clamp(max=layout.max_m)
    else:
        a = layout.alignment
        seg = (counts + (a - 1)) // a * a
        offsets = torch.zeros(experts + 1, dtype=torch.int64, device=dev)
        torch.cumsum(seg, 0, out=offsets[1:])
        kept = sorted_key < experts
        row = torch.where(kept, offsets[sorted_key.clamp(max=experts - 1)] + pos, -1)
        metadata = offsets
    rows = torch.empty(n, dtype=torch.int64, device=dev)
    rows[order] = row
    # every row's token (-1 where none): a scatter into one spare row for the dropped slots
    spare = torch.where(row >= 0, row, r)
    src = torch.full((r + 1,), -1, dtype=torch.int64, device=dev)
    src.scatter_(0, spare, order // k)
    if layout.per_row:
        per_row = torch.full((r + 1,), -1, dtype=torch.int64, device=dev)
        per_row.scatter_(0, spare, sorted_key)
        metadata = per_row[:r]
    return Grouping(rows.view(m, k).to(torch.int32), metadata.to(torch.int32),
                    src[:r].to(torch.int32))


def permute_reference(x: torch.Tensor, ids: torch.Tensor, experts: int,
                      layout: LayoutValue) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, metadata, rows)`` of MoePermuteAlignFwdOp (``y`` ``(E, max_m, H)`` for masked)."""
    g = group_slots(ids, experts, layout)
    src = g.src.to(torch.int64)
    m = x.shape[0]
    padded = torch.cat([x, x.new_zeros((1, x.shape[1]))])  # row m: the zeros of unfilled rows
    y = padded[torch.where(src >= 0, src, m)]
    if layout.masked:
        y = y.view(experts, layout.max_m, x.shape[1])
    return y, g.metadata, g.rows


def refuse_bad_rows(op: object, rows: torch.Tensor, count: int, of: str) -> None:
    """A slot of ``rows`` that is neither a row of ``of`` (``count`` rows) nor -1 (dropped) is
    refused by name where the tensor holds data (the references; a backward op's in-tree call
    where it is called directly, not by its forward's gradient:
    :meth:`~tileops.runtime.Op.checks_indices`; the forward kernels check nothing on the
    host)."""
    bad = first_outside(rows, -1, count)
    if bad is not None:
        at, value = bad
        raise IndexError(
            f"{type(op).__name__}: rows[{', '.join(map(str, at))}] is {value}: not a row of "
            f"{of} in [0, {count}) and not -1 (a dropped slot)")


def unpermute_reference(y: torch.Tensor, rows: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * y[rows[t, j]]``, dropped slots (-1) skipped."""
    wide = torch.float64 if torch.float64 in (y.dtype, weights.dtype) else torch.float32
    r = rows.to(torch.int64)
    # a dropped slot reads a row of zeros appended to y (a y of no rows, every slot dropped,
    # gives zeros) and its weight is not read (0 in its place)
    padded = torch.cat((y.to(wide), y.new_zeros((1, *y.shape[1:]), dtype=wide)))
    kept = r >= 0
    picked = padded[torch.where(kept, r, y.shape[0])]  # [M, K, H]
    w = torch.where(kept, weights.to(wide), torch.zeros((), dtype=wide, device=weights.device))
    return (picked * w[..., None]).sum(1)


def permute_bwd_reference(dy: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``dx`` of MoePermuteAlignBwdOp: the unpermutation of ``dy``'s rows (flattened over a
    masked layout's blocks) with unit weights."""
    unit = torch.ones(rows.shape, dtype=wide_dtype(dy), device=rows.device)
    return unpermute_reference(dy.reshape(math.prod(dy.shape[:-1]), dy.shape[-1]), rows, unit)


def expert_of_row(metadata: torch.Tensor, layout: LayoutValue, m: int,
                   experts: int) -> torch.Tensor:
    """The expert of each of the ``m`` rows of a contiguous operand (``experts`` for a row of
    none), as the kernels read the metadata: expert ``e`` owns rows ``[hi[e - 1], hi[e])``
    with ``hi`` the offsets past the first made non-decreasing and clamped into ``[0, m]``
    (``hi[-1] = 0``), or the rows whose per-row expert is ``e``. Data-independent tensor ops,
    so it runs on fake and meta tensors too."""
    if layout.per_row:
        e = metadata.to(torch.int64)
        return torch.where((e >= 0) & (e < experts), e, experts)
    hi = torch.cummax(metadata[1:].to(torch.int64), 0).values.clamp(0, m)
    return torch.searchsorted(hi, torch.arange(m, device=metadata.device), right=True)


def refuse_bad_metadata(op: object, metadata: torch.Tensor, layout: LayoutValue, rows: int,
                        experts: int) -> None:
    """Refuse by name, naming the op, ``metadata``'s first bad entry, its value and what was
    expected, grouped GEMM metadata that the kernels would clamp into bounds rather than read
    (the references, where the tensor holds data and no CUDA graph is being captured; the
    kernels read the metadata on the device only and clamp it, :func:`expert_of_row`):
    masked, a block's count outside ``[0, max_m]``; per row, an expert outside ``[0, E)``
    other than -1 (a row of no expert); offsets, one outside ``[0, rows]`` (``rows`` the rows
    of ``a``), a first one other than 0, or one below the one before it (a segment of fewer
    than no rows)."""
    if not metadata.numel() or not has_data(metadata) or (
            metadata.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    head = f"{type(op).__name__}: metadata"
    if layout.masked:
        bad = first_outside(metadata, 0, layout.max_m + 1)
        if bad is not None:
            (i,), v = bad
            raise ValueError(f"{head}[{i}] is {v}: a masked block's count of rows, in "
                             f"[0, {layout.max_m}] (max_m = {layout.max_m})")
        return
    if layout.per_row:
        bad = first_outside(metadata, -1, experts)
        if bad is not None:
            (i,), v = bad
            raise IndexError(f"{head}[{i}] is {v}: not an expert in [0, {experts}) (b has "
                             f"{experts}) and not -1 (a row of no expert)")
        return
    bad = first_outside(metadata, 0, rows + 1)
    if bad is not None:
        (i,), v = bad
        raise ValueError(f"{head}[{i}] is {v}: an offset is a row boundary of a, in [0, {rows}] "
                         f"(a has {rows} rows)")
    first = int(metadata[0])
    if first != 0:
        raise ValueError(f"{head}[0] is {first}: the offsets start at 0 (expert 0's rows begin "
                         f"at row 0)")
    falls = (metadata[1:] < metadata[:-1]).nonzero()
    if falls.numel():
        i = int(falls[0, 0]) + 1
        lo, hi = int(metadata[i - 1]), int(metadata[i])
        raise ValueError(f"{head}[{i}] is {hi}, below metadata[{i - 1}] = {lo}: the offsets "
                         f"never fall (expert {i - 1} would have {hi - lo} rows)")


def grouped_gemm_reference(a: torch.Tensor, b: torch.Tensor, metadata: torch.Tensor, *,
                           layout: LayoutValue, trans_b: bool) -> torch.Tensor:
    """GroupedGemmFwdOp's ``c``: a float64 (float32 for narrower) product per expert. A
    masked block's product is kept for its first ``metadata[e]`` rows; a contiguous operand's
    product with each expert's weights is kept on that expert's rows (every row is multiplied
    by every expert: no loop bound reads the metadata, so fake tensors and CUDA graphs take
    it). Metadata out of range is read as the kernels read it, clamped into bounds; the ops'
    references refuse it first (:func:`refuse_bad_metadata`)."""
    wide = wide_dtype(a)
    aw = a.to(wide)

    def weights(e: int) -> torch.Tensor:  # expert e's [K, N], widened alone
        w = b[e].to(wide)
        return w.T if trans_b else w

    experts, n = b.shape[0], b.shape[-2] if trans_b else b.shape[-1]
    if layout.masked:
        valid = torch.arange(a.shape[1], device=a.device) < metadata.clamp(0, layout.max_m)[:, None]
        c = torch.stack([aw[e] @ weights(e) for e in range(experts)]) if experts else \
            aw.new_zeros((0, a.shape[1], n))
        return torch.where(valid[..., None], c, torch.zeros((), dtype=wide))
    owner = expert_of_row(metadata, layout, a.shape[0], experts)
    c = torch.zeros((a.shape[0], n), dtype=wide, device=a.device)
    for e in range(experts):
        c = torch.where((owner == e)[:, None], aw @ weights(e), c)
    return c


def unpermute_bwd_reference(dout: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                            weights: torch.Tensor, *, grad_y: bool, grad_weights: bool):
    """``(dy, dweights)`` of MoeUnpermuteBwdOp: each kept pick's ``weights * dout`` summed
    into its row (one spare row takes the dropped picks), and ``dout . y[row]``."""
    wide = torch.float64 if torch.float64 in (y.dtype, weights.dtype) else torch.float32
    r = rows.to(torch.int64)
    kept = r >= 0
    dy = dw = None
    if grad_y:
        spare = torch.where(kept, r, y.shape[0]).reshape(-1)
        # every size named: a -1 is ambiguous where the rows are empty (H = 0)
        part = (dout.to(wide)[:, None, :] * weights.to(wide)[..., None]).reshape(
            spare.numel(), y.shape[1])
        dy = torch.zeros((y.shape[0] + 1, y.shape[1]), dtype=wide, device=y.device)
        dy = dy.index_add(0, spare, part)[:y.shape[0]]
    if grad_weights:
        picked = y.to(wide)[r.clamp(min=0)]  # [M, K, H]
        dots = (picked * dout.to(wide)[:, None, :]).sum(-1)
        dw = torch.where(kept, dots, torch.zeros((), dtype=wide))
    return dy, dw


def grouped_gemm_bwd_reference(dc: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                               metadata: torch.Tensor, *, layout: LayoutValue, trans_b: bool,
                               grad_a: bool, grad_b: bool):
    """``(da, db)`` of GroupedGemmBwdOp: ``da`` the grouped GEMM of ``dc`` with the other
    weight layout; ``op(db[e]) = a[rows of e].T @ dc[rows of e]`` over every row masked to the
    expert's (no loop bound reads the metadata)."""
    wide = wide_dtype(a)
    da = db = None
    if grad_a:
        da = grouped_gemm_reference(dc, b, metadata, layout=layout, trans_b=not trans_b)
    if grad_b:
        aw, dcw = a.to(wide), dc.to(wide)
        if layout.masked:
            valid = torch.arange(a.shape[1], device=a.device) < \
                metadata.clamp(0, layout.max_m)[:, None]
            # rows past a count selected out, not multiplied by 0: what a block holds there
            # (a NaN of torch.empty, say) is no expert's and is not read, as in the kernels
            aw, dcw = (torch.where(valid[..., None], t, 0.0) for t in (aw, dcw))
            g = torch.bmm(aw.transpose(1, 2), dcw)  # [E, K, N]
        else:
            owner = expert_of_row(metadata, layout, a.shape[0], b.shape[0])

            def own(t: torch.Tensor, e: int) -> torch.Tensor:  # expert e's rows, others 0
                return torch.where((owner == e)[:, None], t, 0.0)

            g = torch.stack([own(aw, e).T @ own(dcw, e) for e in range(b.shape[0])])
        db = g.transpose(1, 2) if trans_b else g
    return da, db


def fused_reference(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, bias: torch.Tensor | None, *, layout: LayoutValue,
                    **route) -> torch.Tensor:
    """FusedMoeFwdOp's ``out`` by a loop over the experts, each applied to every token:
    ``silu(x @ gate.T) * (x @ up.T) @ w2[e].T`` scaled by the token's gate weight for ``e``
    (zero where it was not routed to ``e``, or, masked, where ``max_m`` earlier routed slots
    fill the expert's block), summed. Nothing reads the routing's values on the host."""
    wide = wide_dtype(x)
    weights, ids = gating_reference(logits, bias, **route)
    m, k = ids.shape
    zero = torch.zeros((), dtype=wide, device=x.device)
    experts, two_i = w13.shape[0], w13.shape[1]
    inter = two_i // 2
    flat = ids.reshape(-1).to(torch.int64)
    wflat = weights.reshape(-1).to(wide)
    xw = x.to(wide)
    out = torch.zeros(x.shape, dtype=wide, device=x.device)
    for e in range(experts):  # each expert's weights widened alone
        routed = flat == e
        if layout.masked:  # the slot's rank among the expert's slots, in token order
            routed = routed & (torch.cumsum(routed, 0) <= layout.max_m)
        gate = torch.where(routed, wflat, zero).view(m, k).sum(1)
        h = xw @ w13[e].to(wide).T
        act = F.silu(h[:, :inter]) * h[:, inter:]
        # a token not routed to e takes none of its product (selected out, not multiplied by
        # 0: a NaN or inf in weights no token chose stays out, as in the kernels)
        chosen = routed.view(m, k).any(1)[:, None]
        out = out + torch.where(chosen, (act @ w2[e].to(wide).T) * gate[:, None], zero)
    return out
