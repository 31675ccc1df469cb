"""The mixture-of-experts family on the CPU: the layout ADT's classes and spellings, the
workload generator of grouped metadata, each staged op's reference against a float64 loop
written out here (uneven loads, empty experts, dropped slots, ties), and the composite's
forward, whose delegates run their references, against the layer's reference and with its
stages recorded.

The generic harness covers the spec workloads (numerics, bad inputs, fake tensors, compile);
this file covers what is particular: the spaces of routings and layouts, by hypothesis.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels.grouped_gemm import GroupedGemmInterface, GroupedLayoutKind
from tileops.kernels.moe import MoeGateGradInterface, MoePermuteInterface, MoeUnpermuteInterface
from tileops.kernels.moe_group import MoeGroupInterface
from tileops.ops import SiluAndMulFwdOp
from tileops.ops._moe_layout import LayoutValue, grouped_gemm_reference, unpermute_reference
from tileops.ops.moe import (
    ContiguousLayoutSpec,
    FusedMoeFwdOp,
    GroupedGemmBwdOp,
    GroupedGemmFwdOp,
    MaskedLayoutSpec,
    MoePermuteAlignBwdOp,
    MoePermuteAlignFwdOp,
    MoeTopkGatingFwdOp,
    MoeUnpermuteBwdOp,
    MoeUnpermuteFwdOp,
    layout_spec,
)
from tileops.runtime import Kernel, targets
from tileops.signature import ConstructionError
from tileops.spec import AdtValue
from tileops.spec.primitives import PrimitiveError, moe_metadata

REF = "reference"
TIGHT = ContiguousLayoutSpec()


def _layouts():
    return st.one_of(
        st.just(TIGHT),
        st.integers(2, 5).map(lambda a: ContiguousLayoutSpec(packing="aligned", alignment=a)),
        st.integers(2, 5).map(lambda a: ContiguousLayoutSpec(
            packing="aligned", metadata_kind="per_row", alignment=a)),
        st.integers(1, 6).map(MaskedLayoutSpec))


# --- the layout ADT -----------------------------------------------------------------------------


def test_every_spelling_of_a_layout_is_one_construction_point() -> None:
    spellings = [MaskedLayoutSpec(8), AdtValue("masked", {"max_m": 8}), {"masked": {"max_m": 8}}]
    points = {id(GroupedGemmFwdOp(layout=s)._point) for s in spellings}
    assert len(points) == 1
    op = GroupedGemmFwdOp()  # the spec's default: contiguous, tight, offsets
    assert op._point.params["layout"] == AdtValue(
        "contiguous", {"packing": "tight", "metadata_kind": "offsets", "alignment": 1})
    assert layout_spec(op._point.params["layout"]) == TIGHT
    assert layout_spec(AdtValue("masked", {"max_m": 3})) == MaskedLayoutSpec(3)


def test_a_layout_breaking_its_invariant_is_refused_by_name() -> None:
    with pytest.raises(ConstructionError) as info:
        GroupedGemmFwdOp(layout=ContiguousLayoutSpec(packing="aligned", alignment=1))
    lines = str(info.value).splitlines()
    assert lines[0] == "GroupedGemmFwdOp: construction param layout does not match the signature"
    assert lines[3] == ("  because:  contiguous breaks its invariant \"(packing == 'tight') == "
                        "(alignment == 1) and alignment >= 1\"")


def test_a_masked_block_must_have_max_m_rows() -> None:
    op = GroupedGemmFwdOp(layout=MaskedLayoutSpec(4), target=REF)
    with pytest.raises(ValueError) as info:
        op(torch.randn(2, 3, 5), torch.randn(2, 5, 6), torch.zeros(2, dtype=torch.int32))
    assert str(info.value).splitlines()[3] == (
        "  because:  refinement 'prod(Block[layout, M]) == M' does not hold (layout = "
        "AdtValue(constructor='masked', fields={'max_m': 4}), M = 3)")


def test_top_k_beyond_the_experts_is_refused() -> None:
    with pytest.raises(ValueError) as info:
        MoeTopkGatingFwdOp(top_k=3, target=REF)(torch.randn(4, 2))
    assert str(info.value).splitlines()[3] == (
        "  because:  refinement 'top_k <= E' does not hold (top_k = 3, E = 2)")


# --- the workload generator -----------------------------------------------------------------------


def test_moe_metadata_in_each_layout() -> None:
    aligned = AdtValue("contiguous", {"packing": "aligned", "metadata_kind": "offsets",
                                      "alignment": 4})
    # 40 - 4 * 3 = 28 rows: expert 0 eight shares of 10, expert 3 none
    assert moe_metadata(aligned, 40, 4, 1) == [0, 24, 28, 32, 32]
    assert moe_metadata(aligned, 40, 4, 0) == [0, 8, 16, 24, 32]
    per_row = AdtValue("contiguous", {"packing": "aligned", "metadata_kind": "per_row",
                                      "alignment": 4})
    rows = moe_metadata(per_row, 40, 4, 1)
    assert len(rows) == 40 and rows[:23] == [0] * 23 and rows[23] == -1
    assert rows[24:28] == [1, 1, 1, -1] and rows[28:32] == [2, 2, -1, -1]
    assert rows[32:] == [-1] * 8
    assert moe_metadata(AdtValue("masked", {"max_m": 8}), 0, 4, 1) == [8, 2, 1, 0]
    with pytest.raises(PrimitiveError, match="uneven must be 0 or 1, got 2"):
        moe_metadata(aligned, 40, 4, 2)
    with pytest.raises(PrimitiveError, match="needs experts > 0, got 0"):
        moe_metadata(aligned, 40, 0, 0)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 300), experts=st.integers(1, 9), uneven=st.integers(0, 1),
       align=st.integers(1, 6))
def test_moe_metadata_offsets_fit_the_rows(rows, experts, uneven, align) -> None:
    packing = "tight" if align == 1 else "aligned"
    lay = AdtValue("contiguous", {"packing": packing, "metadata_kind": "offsets",
                                  "alignment": align})
    off = moe_metadata(lay, rows, experts, uneven)
    assert len(off) == experts + 1 and off[0] == 0 and off[-1] <= max(rows, 0) + 0
    assert all(b >= a and (b - a) % align == 0 for a, b in zip(off, off[1:], strict=False))


# --- routing ----------------------------------------------------------------------------------


def _gating_loop(logits, bias, *, top_k, scoring, renormalize, num_groups, topk_groups, scale):
    """Token by token, expert by expert, in float64: the spec entry's doc spelled out."""
    m, e = logits.shape
    z = logits.double()
    scores = torch.softmax(z, -1) if scoring == "softmax" else torch.sigmoid(z)
    ws, ids = [], []
    for t in range(m):
        choice = [float(scores[t, i]) + (0.0 if bias is None else float(bias[i]))
                  for i in range(e)]
        if bias is None and num_groups == 1:
            choice = [float(z[t, i]) for i in range(e)]
        eligible = set(range(e))
        if num_groups > 1:
            per = e // num_groups
            sums = [sum(sorted(choice[g * per:(g + 1) * per], reverse=True)[:2])
                    for g in range(num_groups)]
            groups = sorted(range(num_groups), key=lambda g: (-sums[g], g))[:topk_groups]
            eligible = {g * per + i for g in groups for i in range(per)}
        picked = sorted(eligible, key=lambda i: (-choice[i], i))[:top_k]
        w = [float(scores[t, i]) for i in picked]
        total = sum(w)
        ws.append([x / total * scale if renormalize else x * scale for x in w])
        ids.append(picked)
    return torch.tensor(ws, dtype=torch.float64), torch.tensor(ids, dtype=torch.int32)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 6), groups=st.sampled_from([1, 2, 4]), per=st.integers(2, 4),
       data=st.data())
def test_gating_matches_the_token_loop(m, groups, per, data) -> None:
    e = groups * per
    topk_groups = data.draw(st.integers(1, groups))
    top_k = data.draw(st.integers(1, topk_groups * per))
    opts = dict(top_k=top_k, scoring=data.draw(st.sampled_from(["softmax", "sigmoid"])),
                renormalize=data.draw(st.booleans()), num_groups=groups,
                topk_groups=topk_groups, routed_scaling_factor=data.draw(
                    st.sampled_from([1.0, 2.5])))
    g = torch.Generator().manual_seed(m * 131 + e)
    # integer logits: ties everywhere, which the picks resolve to the lowest id
    logits = torch.randint(-2, 3, (m, e), generator=g).double()
    bias = torch.randint(-1, 2, (e,), generator=g).float() / 4 if data.draw(st.booleans()) \
        else None
    op = MoeTopkGatingFwdOp(target=REF, **opts)
    w, ids = op(logits, bias)
    route = {k: v for k, v in opts.items() if k != "routed_scaling_factor"}
    w_ref, ids_ref = _gating_loop(logits, bias, scale=opts["routed_scaling_factor"], **route)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-12, atol=1e-12)


def test_ties_keep_the_lowest_ids() -> None:
    """torch.topk leaves which of equal scores it keeps open (on the CPU it keeps 2, 4, 1 of
    the first row); the picks are the answer a stable sort gives, the one TopkFwdOp gives, and
    pick the same scores as torch.topk."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0]])
    _, ids = MoeTopkGatingFwdOp(top_k=3, target=REF)(logits)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert torch.equal(logits.gather(1, ids.long()), torch.topk(logits, 3).values)


def test_mixtral_gating_is_a_softmax_over_the_top_logits() -> None:
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w, ids = MoeTopkGatingFwdOp(top_k=2, target=REF)(logits)
    top = torch.topk(logits, 2)
    assert torch.equal(ids.long(), top.indices)
    torch.testing.assert_close(w, torch.softmax(top.values, -1), rtol=1e-12, atol=1e-12)


# --- the permutations -------------------------------------------------------------------------


def _permute_loop(x, ids, experts, lay):
    """Slot by slot in token order: each expert's rows in order, padded or blocked."""
    m, k = ids.shape
    by_expert = [[] for _ in range(experts)]
    for t in range(m):
        for j in range(k):
            e = int(ids[t, j])
            if 0 <= e < experts:
                by_expert[e].append((t, j))
    rows = torch.full((m, k), -1, dtype=torch.int32)
    if isinstance(lay, MaskedLayoutSpec):
        y = torch.zeros(experts, lay.max_m, x.shape[1], dtype=x.dtype)
        for e, slots in enumerate(by_expert):
            for p, (t, j) in enumerate(slots[:lay.max_m]):
                y[e, p] = x[t]
                rows[t, j] = e * lay.max_m + p
        meta = torch.tensor([min(len(s), lay.max_m) for s in by_expert], dtype=torch.int32)
        return y, meta, rows
    a = lay.alignment
    total = m * k + experts * (a - 1)
    y = torch.zeros(total, x.shape[1], dtype=x.dtype)
    owner = torch.full((total,), -1, dtype=torch.int32)
    offsets = [0]
    for e, slots in enumerate(by_expert):
        for p, (t, j) in enumerate(slots):
            y[offsets[-1] + p] = x[t]
            rows[t, j] = offsets[-1] + p
            owner[offsets[-1] + p] = e
        offsets.append(offsets[-1] + -(-len(slots) // a) * a)
    meta = owner if lay.metadata_kind == "per_row" else torch.tensor(offsets, dtype=torch.int32)
    return y, meta, rows


def _ids(m, k, experts, seed, dropped=False):
    """Uneven routing: expert 0 most, some experts empty, ids out of range when ``dropped``."""
    g = torch.Generator().manual_seed(seed)
    hot = torch.randint(0, 3, (m, k), generator=g) == 0
    ids = torch.where(hot, 0, torch.randint(0, max(1, experts - 1), (m, k), generator=g))
    if dropped:
        ids = torch.where(torch.rand(m, k, generator=g) < 0.2, experts, ids)
    return ids.to(torch.int32)


@settings(max_examples=50, deadline=None)
@given(m=st.integers(0, 9), k=st.integers(1, 3), experts=st.integers(1, 5), h=st.integers(1, 5),
       lay=_layouts(), dropped=st.booleans())
def test_permute_matches_the_slot_loop(m, k, experts, h, lay, dropped) -> None:
    x = torch.randn(m, h, generator=torch.Generator().manual_seed(m + 10 * h), dtype=torch.float64)
    ids = _ids(m, k, experts, seed=m * 7 + k, dropped=dropped)
    op = MoePermuteAlignFwdOp(num_experts=experts, layout=lay, target=REF)
    y, meta, rows = op(x, ids)
    y_ref, meta_ref, rows_ref = _permute_loop(x, ids, experts, lay)
    assert torch.equal(y, y_ref) and torch.equal(meta, meta_ref) and torch.equal(rows, rows_ref)
    # and back: weights of one restore each kept slot's token, once a kept pick
    out = MoeUnpermuteFwdOp(target=REF)(y.reshape(-1, h), rows, torch.ones(m, k))
    kept = (rows >= 0).sum(1, keepdim=True).double()
    torch.testing.assert_close(out, x * kept, rtol=0, atol=0)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 6), k=st.integers(1, 4), r=st.integers(1, 9), h=st.integers(1, 6))
def test_unpermute_matches_the_token_loop(m, k, r, h) -> None:
    g = torch.Generator().manual_seed(m * 100 + r)
    y = torch.randn(r, h, generator=g, dtype=torch.float64)
    rows = torch.randint(-1, r, (m, k), generator=g, dtype=torch.int32)
    w = torch.rand(m, k, generator=g, dtype=torch.float64)
    out = MoeUnpermuteFwdOp(target=REF)(y, rows, w)
    ref = torch.zeros(m, h, dtype=torch.float64)
    for t in range(m):
        for j in range(k):
            if rows[t, j] >= 0:
                ref[t] += w[t, j] * y[rows[t, j]]
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_unpermute_of_no_rows_with_every_slot_dropped_is_zeros() -> None:
    """y of no rows, every slot dropped: zeros (the gather indexed y at 0 and failed), with a
    dropped slot's weight not read (a NaN there is not the token's)."""
    w = torch.tensor([[0.5, float("nan")], [0.25, 1.0]], dtype=torch.float64)
    out = MoeUnpermuteFwdOp(target=REF)(torch.randn(0, 4, dtype=torch.float64),
                                        torch.full((2, 2), -1, dtype=torch.int32), w)
    assert torch.equal(out, torch.zeros(2, 4, dtype=torch.float64))
    y = torch.randn(3, 4, dtype=torch.float64)
    out = MoeUnpermuteFwdOp(target=REF)(y, torch.tensor([[2, -1], [-1, 0]], dtype=torch.int32),
                                        w)
    torch.testing.assert_close(out, torch.stack((0.5 * y[2], 1.0 * y[0])), rtol=0, atol=0)


def test_rows_of_no_width_unpermute_and_train() -> None:
    """Rows of width 0 (H = 0) through the unpermutation, its gradient and the permutation's
    gradient: empty results of torch's shapes and zero weight gradients (the references
    flattened the picks with a -1, ambiguous among 0 elements); the ops serve the next call."""
    rows = torch.tensor([[0, -1], [2, 1]], dtype=torch.int32)
    w = torch.rand(2, 2, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 0, dtype=torch.float64, requires_grad=True)
    fwd, bwd = MoeUnpermuteFwdOp(target=REF), MoeUnpermuteBwdOp(target=REF)
    out = fwd(y, rows, w)
    assert out.shape == (2, 0)
    out.sum().backward()
    assert y.grad.shape == (3, 0) and torch.equal(w.grad, torch.zeros(2, 2, dtype=torch.float64))
    dy, dw = bwd(torch.ones(2, 0, dtype=torch.float64), y.detach(), rows, w.detach())
    assert dy.shape == (3, 0) and torch.equal(dw, torch.zeros(2, 2, dtype=torch.float64))
    align = MoePermuteAlignBwdOp(target=REF)
    assert align(torch.randn(3, 0, dtype=torch.float64), rows).shape == (2, 0)
    y1 = torch.randn(3, 2, dtype=torch.float64)
    out = fwd(y1, rows, w.detach())
    torch.testing.assert_close(out, torch.stack((w[0, 0] * y1[0], w[1, 0] * y1[2] + w[1, 1] * y1[1])).detach())
    assert bwd(torch.ones(2, 2, dtype=torch.float64), y1, rows, w.detach())[0].shape == (3, 2)
    assert align(y1, rows).shape == (2, 2)


@pytest.mark.parametrize("bad", [9, 8, -2])
def test_rows_outside_the_rows_are_refused_by_name(bad) -> None:
    """A slot that is neither a row of y nor -1 (dropped), in the unpermutation, its gradient
    and the permutation's gradient: refused naming the op, the slot, its value and the range;
    the op serves the next call."""
    y, w = torch.randn(8, 3, dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64)
    rows = torch.tensor([[0, -1], [1, bad]], dtype=torch.int32)
    good = torch.tensor([[0, -1], [1, 7]], dtype=torch.int32)
    calls = [(MoeUnpermuteFwdOp(target=REF), (y, rows, w), (y, good, w)),
             (MoeUnpermuteBwdOp(target=REF), (torch.ones(2, 3, dtype=torch.float64), y, rows, w),
              (torch.ones(2, 3, dtype=torch.float64), y, good, w)),
             (MoePermuteAlignBwdOp(target=REF), (y.reshape(2, 4, 3), rows),
              (y.reshape(2, 4, 3), good))]
    for op, args, fine in calls:
        with pytest.raises(IndexError) as exc:
            op(*args)
        of = "dy" if isinstance(op, MoePermuteAlignBwdOp) else "y"
        assert str(exc.value) == (f"{type(op).__name__}: rows[1, 1] is {bad}: not a row of {of} "
                                  f"in [0, 8) and not -1 (a dropped slot)")
        op(*fine)


# --- the grouped GEMM --------------------------------------------------------------------------


def _gemm_loop(a, b, meta, lay, trans_b):
    """Expert by expert, in float64, reading the metadata as plain ints."""
    bb = b.transpose(-2, -1) if trans_b else b
    c = torch.zeros(*a.shape[:-1], bb.shape[-1], dtype=torch.float64)
    if isinstance(lay, MaskedLayoutSpec):
        for e in range(b.shape[0]):
            n = min(max(int(meta[e]), 0), lay.max_m)
            c[e, :n] = a[e, :n] @ bb[e]
        return c
    if lay.metadata_kind == "per_row":
        for r in range(a.shape[0]):
            if 0 <= int(meta[r]) < b.shape[0]:
                c[r] = a[r] @ bb[int(meta[r])]
        return c
    lo = 0
    for e in range(b.shape[0]):
        hi = min(max(int(meta[e + 1]), lo), a.shape[0])
        c[lo:hi] = a[lo:hi] @ bb[e]
        lo = hi
    return c


def _in_range(meta, lay, rows, experts):
    """Whether grouped GEMM metadata is in range (the references' check)."""
    v = meta.tolist()
    if isinstance(lay, MaskedLayoutSpec):
        return all(0 <= c <= lay.max_m for c in v)
    if lay.metadata_kind == "per_row":
        return all(-1 <= e < experts for e in v)
    return v[0] == 0 and all(0 <= o <= rows for o in v) and v == sorted(v)


@settings(max_examples=50, deadline=None)
@given(experts=st.integers(1, 5), n=st.integers(1, 5), k=st.integers(1, 5), lay=_layouts(),
       trans_b=st.booleans(), data=st.data())
def test_grouped_gemm_matches_the_expert_loop(experts, n, k, lay, trans_b, data) -> None:
    """The op over metadata in range, against the loop; metadata out of range is refused by
    the op's reference naming the entry, and the kernels' reading of it (clamped into bounds:
    grouped_gemm_reference, the kernels' contract, and the eager loop) is the loop's."""
    g = torch.Generator().manual_seed(experts * 50 + n * 7 + k)
    if isinstance(lay, MaskedLayoutSpec):
        a = torch.randn(experts, lay.max_m, k, generator=g, dtype=torch.float64)
        meta = torch.tensor(data.draw(st.lists(st.integers(-1, lay.max_m + 2), min_size=experts,
                                               max_size=experts)), dtype=torch.int32)
    else:
        m = data.draw(st.integers(0, 12))
        a = torch.randn(m, k, generator=g, dtype=torch.float64)
        if lay.metadata_kind == "per_row":
            meta = torch.tensor(data.draw(st.lists(st.integers(-2, experts), min_size=m,
                                                   max_size=m)), dtype=torch.int32)
        else:  # rising offsets in range, or any: past the rows, falling
            ends = st.lists(st.integers(0, m), min_size=experts, max_size=experts).map(sorted)
            anything = st.lists(st.integers(-1, m + 3), min_size=experts, max_size=experts)
            meta = torch.tensor([0] + data.draw(st.one_of(ends, anything)), dtype=torch.int32)
    b = torch.randn(experts, *((n, k) if trans_b else (k, n)), generator=g, dtype=torch.float64)
    op = GroupedGemmFwdOp(layout=lay, trans_b=trans_b, target=REF)
    ref = _gemm_loop(a, b, meta, lay, trans_b)
    clamped = grouped_gemm_reference(a, b, meta, layout=op.layout_value, trans_b=trans_b)
    torch.testing.assert_close(clamped, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(op.eager()(a, b, meta), ref, rtol=1e-12, atol=1e-12)
    if _in_range(meta, lay, a.shape[0], experts):
        torch.testing.assert_close(op(a, b, meta), ref, rtol=1e-12, atol=1e-12)
    else:
        with pytest.raises((ValueError, IndexError), match=r"^GroupedGemmFwdOp: metadata\["):
            op(a, b, meta)


_PER_ROW = ContiguousLayoutSpec(packing="aligned", metadata_kind="per_row", alignment=2)


@pytest.mark.parametrize(("lay", "meta", "error", "message"), [
    (TIGHT, [0, 5, 3, 8], ValueError,
     "metadata[2] is 3, below metadata[1] = 5: the offsets never fall (expert 1 would have -2 "
     "rows)"),
    (TIGHT, [0, 3, 5, 11], ValueError,
     "metadata[3] is 11: an offset is a row boundary of a, in [0, 10] (a has 10 rows)"),
    (TIGHT, [0, -1, 5, 8], ValueError,
     "metadata[1] is -1: an offset is a row boundary of a, in [0, 10] (a has 10 rows)"),
    (TIGHT, [2, 3, 5, 8], ValueError,
     "metadata[0] is 2: the offsets start at 0 (expert 0's rows begin at row 0)"),
    (MaskedLayoutSpec(4), [4, 5, 0], ValueError,
     "metadata[1] is 5: a masked block's count of rows, in [0, 4] (max_m = 4)"),
    (MaskedLayoutSpec(4), [1, 0, -1], ValueError,
     "metadata[2] is -1: a masked block's count of rows, in [0, 4] (max_m = 4)"),
    (_PER_ROW, [0, 0, 2, 2, 1, 1, 3, -1, -1, -1], IndexError,
     "metadata[6] is 3: not an expert in [0, 3) (b has 3) and not -1 (a row of no expert)"),
    (_PER_ROW, [0, 0, -2, 2, 1, 1, 2, -1, -1, -1], IndexError,
     "metadata[2] is -2: not an expert in [0, 3) (b has 3) and not -1 (a row of no expert)"),
])
def test_grouped_gemm_metadata_out_of_range_is_refused_by_name(lay, meta, error, message):
    """Offsets that fall, pass the rows, are negative or do not start at 0; masked counts
    past max_m or negative; per-row experts out of range: the kernels would clamp them into
    bounds (a result for a routing nobody made), the references refuse them naming the op,
    the entry, its value and the range, forward and backward, through autograd too; each op
    serves the next call."""
    masked = isinstance(lay, MaskedLayoutSpec)
    g = torch.Generator().manual_seed(7)
    a = torch.randn(*((3, 4) if masked else (10,)), 6, generator=g, dtype=torch.float64)
    b = torch.randn(3, 6, 5, generator=g, dtype=torch.float64)
    dc = torch.randn(*a.shape[:-1], 5, generator=g, dtype=torch.float64)
    bad = torch.tensor(meta, dtype=torch.int32)
    good = torch.tensor([4, 0, 2] if masked else [0, 0, 2, 2, 1, 1, 2, -1, -1, -1]
                        if lay is _PER_ROW else [0, 3, 3, 8], dtype=torch.int32)
    fwd = GroupedGemmFwdOp(layout=lay, target=REF)
    bwd = GroupedGemmBwdOp(layout=lay, target=REF)
    for op, args in ((fwd, (a, b)), (bwd, (a, b))):
        tail = (dc,) if op is bwd else ()
        with pytest.raises(error) as exc:
            op(*args, bad, *tail)
        assert str(exc.value) == f"{type(op).__name__}: {message}"
        want = op.fp64_reference(*args, good, *tail)
        got = op(*args, good, *tail)
        for x, y in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,), strict=True):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    a_grad = a.clone().requires_grad_()
    with pytest.raises(error, match=r"^GroupedGemmFwdOp: metadata\["):
        fwd(a_grad, b, bad)
    fwd(a_grad, b, good).sum().backward()
    assert a_grad.grad is not None


@pytest.mark.parametrize("lay", [TIGHT, MaskedLayoutSpec(4), _PER_ROW])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_rows_of_another_expert_or_of_none_stay_out_of_the_weight_gradient(lay, value):
    """A NaN or inf in rows no expert owns (past a masked count, past the last offset, an
    expert of -1) or in another expert's rows: each expert's weight gradient is its own rows'
    product, as the kernels read them (the reference multiplied every row by a 0/1 mask, so
    0 times the NaN reached every expert's gradient)."""
    masked = isinstance(lay, MaskedLayoutSpec)
    g = torch.Generator().manual_seed(3)
    a = torch.randn(*((3, 4) if masked else (10,)), 6, generator=g, dtype=torch.float64)
    b = torch.randn(3, 6, 5, generator=g, dtype=torch.float64)
    dc = torch.randn(*a.shape[:-1], 5, generator=g, dtype=torch.float64)
    meta = torch.tensor([2, 0, 3] if masked else [0, 0, 2, 2, 1, 1, 2, -1, -1, -1]
                        if lay is _PER_ROW else [0, 3, 3, 8], dtype=torch.int32)
    if masked:
        owned = torch.arange(4) < meta[:, None]
        first = owned & (torch.arange(3) == 0)[:, None]
    else:
        owner = torch.tensor([0, 0, 2, 2, 1, 1, 2, -1, -1, -1] if lay is _PER_ROW
                             else [0, 0, 0, 2, 2, 2, 2, 2, -1, -1])
        owned, first = owner >= 0, owner == 0
    bwd = GroupedGemmBwdOp(layout=lay, target=REF)
    clean = bwd(a.masked_fill(~owned[..., None], 0), b, meta, dc.masked_fill(~owned[..., None], 0))
    da, db = bwd(a.masked_fill(~owned[..., None], value), b, meta,
                 dc.masked_fill(~owned[..., None], value))
    torch.testing.assert_close(db, clean[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(da[owned], clean[0][owned], rtol=1e-12, atol=1e-12)
    # another expert's NaN: expert 0's rows of dc; every other expert's gradient is finite
    _, db = bwd(a, b, meta, dc.masked_fill(first[..., None], float("nan")))
    assert db[0].isnan().all() and db[1:].isfinite().all()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_weights_of_an_expert_no_token_chose_do_not_reach_the_output(value):
    """A NaN or inf in the weights of an expert no token routes to: the layer's output is that
    of finite weights there, as torch's pipeline and the kernels give it (the reference added
    every expert's product times a gate of 0)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    logits = torch.randn(4, 4, generator=g, dtype=torch.float64)
    logits[:, 3] = -30.0  # expert 3: no token's top 2
    w13 = torch.randn(4, 6, 8, generator=g, dtype=torch.float64)
    w2 = torch.randn(4, 8, 3, generator=g, dtype=torch.float64)
    op = FusedMoeFwdOp(num_experts=4, top_k=2, target=REF)
    want = op(x, logits, w13, w2)
    for w in (w13, w2):
        dirty = [t.clone() for t in (w13, w2)]
        dirty[0 if w is w13 else 1][3, 1] = value
        torch.testing.assert_close(op(x, logits, *dirty), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("lay", "length"), [(TIGHT, 3), (TIGHT, 5), (MaskedLayoutSpec(4), 2),
                                             (MaskedLayoutSpec(4), 4), (_PER_ROW, 9)])
def test_grouped_gemm_metadata_of_a_wrong_length_is_refused_by_the_signature(lay, length):
    """E + 1 offsets, E masked counts, an expert a row: any other length is refused by the
    signature check, naming the op and the argument (the in-tree path too: it runs first)."""
    masked = isinstance(lay, MaskedLayoutSpec)
    a = torch.randn(*((3, 4) if masked else (10,)), 6, dtype=torch.float64)
    b = torch.randn(3, 6, 5, dtype=torch.float64)
    for op in (GroupedGemmFwdOp(layout=lay, target=REF), GroupedGemmFwdOp(layout=lay)):
        with pytest.raises(ValueError) as exc:
            op(a, b, torch.zeros(length, dtype=torch.int32))
        assert str(exc.value).startswith(
            "GroupedGemmFwdOp: argument metadata does not match the signature")


def test_grouped_gemm_uneven_loads_against_torch_grouped_mm() -> None:
    """One expert with eight times the rows of the others, two empty: the op's reference and
    its torch._grouped_mm peer agree (float32 on the CPU)."""
    loads = [64, 8, 0, 8, 0, 8, 8, 8]
    offsets = torch.tensor([0, *torch.tensor(loads).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    a = torch.randn(sum(loads), 16, generator=g)
    b = torch.randn(8, 24, 16, generator=g)
    op = GroupedGemmFwdOp(trans_b=True, target=REF)
    peer = op.contenders()["grouped_mm"]
    torch.testing.assert_close(peer(a, b, offsets), op(a, b, offsets), rtol=1e-5, atol=1e-5)


# --- the composite ------------------------------------------------------------------------------

#: a target with builders for the fused layer's delegates (their references) and none for the
#: layer, so that the composite runs its own stages on the CPU
STAGES = "moe-stages"
_DELEGATES = (MoeTopkGatingFwdOp, MoePermuteAlignFwdOp, GroupedGemmFwdOp, SiluAndMulFwdOp,
              MoeUnpermuteFwdOp)


@pytest.fixture(scope="module", autouse=True)
def _stages_target():
    targets.register_target(STAGES, ("cpu",))
    for cls in _DELEGATES:
        targets.register_builder(STAGES, cls, targets.builder_for(targets.REFERENCE, cls))
    yield
    del targets._targets[STAGES], targets._builders[STAGES]


CONFIGS = {
    "mixtral": dict(num_experts=8, top_k=2),
    "deepseek": dict(num_experts=16, top_k=4, scoring="sigmoid", num_groups=4, topk_groups=2,
                     routed_scaling_factor=2.5),
}


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 12), config=st.sampled_from(sorted(CONFIGS)),
       lay=_layouts().filter(lambda v: getattr(v, "metadata_kind", "") != "per_row"))
def test_the_composite_runs_its_stages_and_matches_the_layer(m, config, lay) -> None:
    opts = CONFIGS[config]
    e, h, inter = opts["num_experts"], 12, 10
    g = torch.Generator().manual_seed(m * 17 + e)
    x = torch.randn(m, h, generator=g, dtype=torch.float64)
    logits = torch.randn(m, e, generator=g, dtype=torch.float64)
    w13 = torch.randn(e, 2 * inter, h, generator=g, dtype=torch.float64) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g, dtype=torch.float64) / inter ** 0.5
    bias = torch.randn(e, generator=g) / 10 if config == "deepseek" else None
    op = FusedMoeFwdOp(layout=lay, target=STAGES, **opts)
    out = op(x, logits, w13, w2, bias)
    assert [s.name for s in op.last_call.stages] == ["route", "permute", "gate_up", "act",
                                                      "down", "unpermute"]
    assert [len(s.calls) for s in op.last_call.stages] == [1] * 6
    torch.testing.assert_close(out, op.fp64_reference(x, logits, w13, w2, bias)[0],
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("lay", [None, {"masked": {"max_m": 3}}])
def test_the_float64_references_widen_the_expert_banks_an_expert_at_a_time(lay) -> None:
    """The ops whose weights are expert banks hand them to the reference as they are
    (``reference_widens``: DeepSeek-V3's in float64 at once would not fit a GPU beside the
    call); the reference widens an expert at a time, to exactly what whole float64 copies
    give."""
    from tileops.runtime.declared import Equivalents

    g = torch.Generator().manual_seed(11)
    e, m, h, inter = 4, 6, 16, 8
    bf = torch.bfloat16
    x, logits = torch.randn(m, h, generator=g).to(bf), torch.randn(m, e, generator=g).to(bf)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / 4).to(bf)
    w2 = (torch.randn(e, h, inter, generator=g) / 4).to(bf)
    rows = e * 3 if lay else m
    a = torch.randn(*((e, 3, h) if lay else (rows, h)), generator=g).to(bf)
    meta = torch.tensor([3, 1, 0, 2] if lay else [0, 2, 2, 5, 6], dtype=torch.int32)
    dc = torch.randn(*((e, 3, 2 * inter) if lay else (rows, 2 * inter)), generator=g).to(bf)
    layout = {"layout": lay} if lay else {}
    for op, inputs in [
            (FusedMoeFwdOp(num_experts=e, top_k=2, **layout), (x, logits, w13, w2, None)),
            (GroupedGemmFwdOp(trans_b=True, **layout), (a, w13, meta)),
            (GroupedGemmBwdOp(trans_b=True, **layout), (a, w13, meta, dc))]:
        assert type(op).reference_widens and \
            type(op).reference_widens <= set(op._signature.input_names)
        got = op.fp64_reference(*inputs)
        saved = type(op).reference_widens
        try:  # every floating input widened whole, as the base does for other ops
            type(op).reference_widens = Equivalents.reference_widens
            whole = op.fp64_reference(*inputs)
        finally:
            type(op).reference_widens = saved
        for u, v in zip(got, whole, strict=True):
            assert u.dtype == torch.float64 and torch.equal(u, v)


def test_the_layer_against_torch_ops_in_float32() -> None:
    """The torch pipeline (the eager contender: torch._grouped_mm between the routing and
    index_add_) and the op agree."""
    g = torch.Generator().manual_seed(5)
    m, h, inter, e = 9, 16, 8, 4
    x, logits = torch.randn(m, h, generator=g), torch.randn(m, e, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / 4
    w2 = torch.randn(e, h, inter, generator=g) / 4
    op = FusedMoeFwdOp(num_experts=e, top_k=2, target=STAGES)
    torch.testing.assert_close(op.eager()(x, logits, w13, w2), op(x, logits, w13, w2),
                               rtol=1e-4, atol=1e-4)
    # and by hand: each token through its two experts
    w, ids = torch.topk(torch.softmax(logits, -1), 2)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros(m, h)
    for t in range(m):
        for j in range(2):
            hh = w13[ids[t, j]] @ x[t]
            ref[t] += w[t, j] * (w2[ids[t, j]] @ (F.silu(hh[:inter]) * hh[inter:]))
    torch.testing.assert_close(op(x, logits, w13, w2), ref, rtol=1e-4, atol=1e-4)


# --- gradients ----------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 7), lay=_layouts().filter(
    lambda v: getattr(v, "metadata_kind", "") != "per_row"), trans_b=st.booleans())
def test_gradients_through_the_grouped_layer_match_torch_autograd(m, lay, trans_b) -> None:
    """grouped GEMM -> unpermute over a permutation's rows, through each op's backward op
    (their references on the CPU), against torch's autograd of the same computation written
    pick by pick in float64."""
    e, k, h, n = 4, 2, 5, 3
    g = torch.Generator().manual_seed(m * 31 + (7 if trans_b else 0))
    x = torch.randn(m, h, generator=g, dtype=torch.float64)
    ids = _ids(m, k, e, seed=m)
    y0, meta, rows = MoePermuteAlignFwdOp(num_experts=e, layout=lay, target=REF)(x, ids)
    y = y0.clone().requires_grad_()
    b = torch.randn(e, *((n, h) if trans_b else (h, n)), generator=g, dtype=torch.float64,
                    requires_grad=True)
    w = torch.rand(m, k, generator=g, dtype=torch.float64, requires_grad=True)
    c = GroupedGemmFwdOp(layout=lay, trans_b=trans_b, target=REF)(y, b, meta)
    out = MoeUnpermuteFwdOp(target=REF)(c.reshape(-1, n), rows, w)
    up = torch.randn(m, n, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (y, b, w), up)

    # the same in torch: each kept pick's row of y through its expert's weights
    bb = b.transpose(1, 2) if trans_b else b
    flat_y = y.reshape(-1, h)
    kept = rows >= 0
    picked = flat_y[rows.long().clamp(min=0)]  # [M, K, H]
    prod = torch.einsum("mkh,mkhn->mkn", picked, bb[ids.long()])
    ref = (prod * (w * kept)[..., None]).sum(1)
    want = torch.autograd.grad(ref, (y, b, w), up)
    for got, exp in zip(grads, want, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-10)


# --- the forwards' glue, through CPU stand-ins of the kernels --------------------------------
#
# The in-tree kernels run on CUDA only; a stand-in implementing a slot on the CPU (the math of
# the slot's contract in torch) runs each op's own forward here: the call spec it builds, the
# tensors it hands over, what it computes around the slot.


class _GemmStandIn(Kernel, GroupedGemmInterface):
    devices = ("cpu",)
    general = True
    specs: list = []

    def __call__(self, a, b, metadata, c) -> None:
        s = self.spec
        type(self).specs.append(s)
        lay = LayoutValue(masked=s.layout is GroupedLayoutKind.MASKED, max_m=s.max_m)
        c.copy_(grouped_gemm_reference(a, b, metadata, layout=lay, trans_b=s.trans_b))


class _PermuteStandIn(Kernel, MoePermuteInterface):
    devices = ("cpu",)
    general = True

    def __call__(self, x, rows, src, y) -> None:
        """Token-major, as the kernel: each token's row to its slots' rows (``rows``), zeros
        where ``src`` says no slot fills a row."""
        y.zero_()
        r = rows.long()
        tokens = torch.arange(x.shape[0]).unsqueeze(1).expand_as(r)
        y[r[r >= 0]] = x[tokens[r >= 0]]
        assert torch.equal((src >= 0).nonzero().flatten().sort().values,
                           r[r >= 0].sort().values)  # the rows src says are filled


class _GroupStandIn(Kernel, MoeGroupInterface):
    """The grouping kernel's algorithm in Python (counts; each slot's rank among the slots
    before it with its key; the aligned counts summed into offsets), not the torch grouping's
    sort: the op's outputs are then held to the sort by the reference. Records its calls."""

    devices = ("cpu",)
    general = True
    calls = 0

    def __call__(self, ids, metadata, rows, src) -> None:
        type(self).calls += 1
        s = self.spec
        keys = [v if 0 <= v < s.e else s.e for v in ids.reshape(-1).tolist()]
        counts = [keys.count(q) for q in range(s.e + 1)]

        def aligned(c):
            return -(-c // s.alignment) * s.alignment

        offsets = [sum(aligned(c) for c in counts[:q]) for q in range(s.e + 1)]
        src.fill_(-1)
        for i, key in enumerate(keys):
            rank = keys[:i].count(key)
            if s.metadata == "masked":
                row = key * s.max_m + rank if key < s.e and rank < s.max_m else -1
            else:
                row = offsets[key] + rank if key < s.e else -1
            rows.view(-1)[i] = row
            if row >= 0:
                src[row] = i // s.k
        if s.metadata == "masked":
            metadata.copy_(torch.tensor([min(c, s.max_m) for c in counts[:s.e]]))
        elif s.metadata == "offsets":
            metadata.copy_(torch.tensor(offsets))
        else:
            metadata.copy_(torch.tensor([next((q for q in range(s.e) if offsets[q] <= r
                                               < offsets[q] + counts[q]), -1)
                                         for r in range(metadata.numel())]))


class _GateGradStandIn(Kernel, MoeGateGradInterface):
    devices = ("cpu",)
    general = True

    def __call__(self, dout, y, rows, dweights) -> None:
        r = rows.long()
        dots = (y[r.clamp(min=0)].float() * dout.float()[:, None, :]).sum(-1)
        dweights.copy_(torch.where(r >= 0, dots, 0.0))


def _bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("masked", [False, True])
def test_the_gemm_gradient_builds_the_flipped_product_and_the_segment_products(masked):
    _GemmStandIn.specs.clear()
    lay = MaskedLayoutSpec(4) if masked else TIGHT
    op = GroupedGemmBwdOp(trans_b=True, layout=lay, target=targets.IN_TREE,
                          kernel_map={GroupedGemmInterface: _GemmStandIn})
    a = _bf16(3, 4, 6, seed=1) if masked else _bf16(10, 6, seed=1)
    dc = _bf16(3, 4, 5, seed=2) if masked else _bf16(10, 5, seed=2)
    b = _bf16(3, 5, 6, seed=3)
    meta = torch.tensor([4, 0, 2] if masked else [0, 3, 3, 8], dtype=torch.int32)
    da, db = op(a, b, meta, dc)
    (spec,) = _GemmStandIn.specs
    assert (spec.n, spec.k, spec.trans_b) == (6, 5, False)  # dc @ b[e]: N reduced, K out
    ref_da, ref_db = op.fp64_reference(a, b, meta, dc)
    torch.testing.assert_close(da.double(), ref_da, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(db.double(), ref_db, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("layout", [
    MaskedLayoutSpec(3), ContiguousLayoutSpec(),
    ContiguousLayoutSpec(packing="aligned", metadata_kind="offsets", alignment=4),
    ContiguousLayoutSpec(packing="aligned", metadata_kind="per_row", alignment=4)])
def test_the_permutation_gathers_the_grouping_s_rows(layout):
    """The op groups through the slot ``moe_group`` (here its algorithm in Python) and
    gathers the rows through ``moe_permute_rows``; the outputs are the reference's (a stable
    sort), for no tokens too."""
    op = MoePermuteAlignFwdOp(num_experts=4, layout=layout, target=targets.IN_TREE,
                              kernel_map={MoePermuteInterface: _PermuteStandIn,
                                          MoeGroupInterface: _GroupStandIn})
    for m in (6, 300, 0):
        x, ids = _bf16(m, 8, seed=4), _ids(m, 2, 4, seed=5, dropped=True)
        before = _GroupStandIn.calls
        for got, want in zip(op(x, ids), op.fp64_reference(x, ids), strict=True):
            assert torch.equal(got.double(), want.double())
        assert _GroupStandIn.calls == before + 1


def test_the_unpermutation_gradient_takes_the_gates_from_the_slot():
    op = MoeUnpermuteBwdOp(target=targets.IN_TREE,
                           kernel_map={MoeGateGradInterface: _GateGradStandIn})
    y, dout = _bf16(9, 8, seed=6), _bf16(4, 8, seed=7)
    rows = torch.tensor([[0, 3], [5, -1], [8, 1], [2, 2]], dtype=torch.int32)
    w = torch.rand(4, 2, generator=torch.Generator().manual_seed(8))
    dy, dw = op(dout, y, rows, w)
    ref_dy, ref_dw = op.fp64_reference(dout, y, rows, w)
    torch.testing.assert_close(dy.double(), ref_dy, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(dw.double(), ref_dw, rtol=1e-5, atol=1e-5)


class _UnpermuteRows(Kernel, MoeUnpermuteInterface):
    devices = ("cpu",)
    general = True

    def __call__(self, y, rows, weights, out) -> None:
        out.copy_(unpermute_reference(y, rows, weights))


@pytest.mark.parametrize("bad", [9, 8, -2])
def test_a_gradient_called_directly_in_tree_refuses_rows_outside_the_rows(bad) -> None:
    """The in-tree gradients called directly (not by their forward's gradient, whose rows
    are the forward's): a slot that is neither a row nor -1 is refused on the host by name
    before a kernel or torch's index_add would read or write out of bounds (on a GPU a
    device-side assert); the op serves the next call."""
    y, w = _bf16(8, 3, seed=1), torch.ones(2, 2)
    rows = torch.tensor([[0, -1], [1, bad]], dtype=torch.int32)
    good = torch.tensor([[0, -1], [1, 7]], dtype=torch.int32)
    dout = _bf16(2, 3, seed=2)
    unpermute = MoeUnpermuteBwdOp(target=targets.IN_TREE,
                                  kernel_map={MoeGateGradInterface: _GateGradStandIn})
    permute = MoePermuteAlignBwdOp(target=targets.IN_TREE,
                                   kernel_map={MoeUnpermuteInterface: _UnpermuteRows})
    for op, args, fine, of in ((unpermute, (dout, y, rows, w), (dout, y, good, w), "y"),
                               (permute, (y.reshape(2, 4, 3), rows),
                                (y.reshape(2, 4, 3), good), "dy")):
        with pytest.raises(IndexError) as exc:
            op(*args)
        assert str(exc.value) == (f"{type(op).__name__}: rows[1, 1] is {bad}: not a row of {of} "
                                  f"in [0, 8) and not -1 (a dropped slot)")
        out = op(*fine)
        for got, want in zip(out if isinstance(out, tuple) else (out,), op.fp64_reference(*fine),
                             strict=True):
            torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def test_weight_gradient_takes_grouped_mm_only_on_16_byte_rows() -> None:
    """torch._grouped_mm refuses rows that are not whole 16 bytes (257 bfloat16 values): the
    weight gradient takes it only where every operand's rows are."""
    from tileops.ops.moe import _mm_aligned

    a = torch.empty(64, 200, dtype=torch.bfloat16)
    assert _mm_aligned(a, torch.empty(64, 256, dtype=torch.bfloat16))
    assert _mm_aligned(a.t(), torch.empty(64, 256, dtype=torch.bfloat16))
    assert not _mm_aligned(a, torch.empty(64, 257, dtype=torch.bfloat16))
    assert not _mm_aligned(torch.empty(64, 201, dtype=torch.bfloat16).t())
    assert not _mm_aligned(torch.empty(64, 256, dtype=torch.bfloat16)[:, 1:9])
    assert _mm_aligned(torch.empty(1, 257, dtype=torch.bfloat16))  # one row: no stride read


def test_the_segment_products_are_torch_grouped_mm():
    """Where torch._grouped_mm does not take the operands (CUDA rows off 16 bytes), the torch
    contenders multiply a segment at a time: the same result, empty experts included."""
    from tileops.ops.moe import _grouped_mm_takes, _segment_products

    g = torch.Generator().manual_seed(0)
    loads = [3, 0, 5, 1, 0]
    ends = torch.tensor(loads).cumsum(0).to(torch.int32)
    for k, n in ((7, 9), (8, 16)):  # rows of 28 and 36 bytes; of 32 and 64
        a = torch.randn(sum(loads), k, generator=g)
        bt = torch.randn(len(loads), k, n, generator=g)
        want = torch.cat([a[lo:hi] @ bt[e] for e, (lo, hi) in
                          enumerate(zip([0, *ends.tolist()[:-1]], ends.tolist(), strict=True))])
        torch.testing.assert_close(_segment_products(a, bt, ends), want, rtol=1e-6, atol=1e-6)
        assert _grouped_mm_takes(a, bt) == (k == 8)
        if k == 8 and hasattr(torch, "_grouped_mm"):
            torch.testing.assert_close(torch._grouped_mm(a, bt, offs=ends), want, rtol=1e-5,
                                       atol=1e-5)


def test_top_k_below_one_is_refused_where_the_gating_op_is_made():
    """top_k < 1 fits no router: refused at construction by name (the call blamed logits)."""
    from tileops.signature import ConstructionError

    with pytest.raises(ConstructionError) as err:
        MoeTopkGatingFwdOp(top_k=0)
    assert str(err.value).startswith("MoeTopkGatingFwdOp: construction param top_k")
