"""Mixture-of-experts routing and row movement in TileLang: the gating (scores, grouped top-k,
gate weights) and the two row permutations around the grouped GEMM.

Five slots:

:class:`MoeGatingInterface` (``moe_gating``) -- ``forward(logits, bias, weights, ids)``: a
    thread a token (:func:`gating_program`), or from 32 experts on a warp a token
    (:func:`gating_warp_program`, the same picks with the lanes' slots reduced by shuffles). The token's scores (softmax or sigmoid, float32)
    and choice scores (plus the correction bias) are kept in the thread's local memory; with
    groups, each group's sum of its two best choice scores, and the ``topk_groups`` best groups
    by repeated arg-max; then one pass over the eligible experts keeps the ``top_k`` best in a
    list, an expert entering where its score is greater or equal with a lower id (a stable
    sort's order, as torch.topk gives; a NaN above every number, as torch's sort puts it).
    Softmax and sigmoid are increasing, so without a bias or groups the picks compare the
    logits themselves, exactly, as the reference's sort of the scores does; with either they
    compare the float32 choice scores (a group's sum of two logits does not rank as the sum
    of their scores).
:class:`MoeGatingBwdInterface` (``moe_gating_bwd``) -- ``forward(dweights, logits, ids,
    dlogits)``: the weights' gradient through the renormalisation and the scoring function,
    the picks fixed: a thread a token, or from 32 experts on a warp a token, a row's columns
    across the lanes (:func:`gating_bwd_program`).
:class:`MoePermuteInterface` (``moe_permute_rows``) -- ``forward(x, rows, src, y)``:
    ``y[rows[t, j]] = x[t]``, and zeros in each row ``r`` with ``src[r] < 0``: a CTA a token
    (its row read once, written to each of its slots' rows) and CTAs past the tokens, 16 rows
    each, for the zeros, 16-byte vectors along the rows (:func:`permute_program`); the op
    computes ``rows`` and ``src`` with the grouping.
:class:`MoeUnpermuteInterface` (``moe_unpermute``) -- ``forward(y, rows, weights, out)``:
    ``out[t] = sum_j weights[t, j] * y[rows[t, j]]``, a slot with ``rows < 0`` skipped, in
    float32: a CTA a token, 16-byte vectors along the row (:func:`unpermute_program`).
:class:`MoeGateGradInterface` (``moe_gate_grad``) -- ``forward(dout, y, rows, dweights)``:
    the unpermutation's gradient for its gates, ``dweights[t, j] = dout[t] . y[rows[t, j]]``
    (0 for a dropped pick): a warp a token, 16-byte vectors, the float32 sums reduced across
    the warp (:func:`gate_grad_program`).

Row lengths off the 16-byte vector (``H`` not a multiple of 8 two-byte elements) take
element-wide accesses; the row counts are launch-time sizes, so one program serves every
token count.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

from typing import Literal, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

from ._store import stored
from ._tilelang import compile_program, isnan, tl

__all__ = [
    "MoeDType",
    "MoeGatingBwdInterface",
    "MoeGatingBwdKernel",
    "MoeGatingBwdSpec",
    "MoeGatingInterface",
    "MoeGatingKernel",
    "MoeGatingSpec",
    "MoePermuteInterface",
    "MoePermuteKernel",
    "MoeRowsSpec",
    "MoeUnpermuteInterface",
    "MoeUnpermuteKernel",
    "MoeUnpermuteSpec",
    "MoeGateGradInterface",
    "MoeGateGradKernel",
    "build_gate_grad",
    "gate_grad_program",
    "build_gating",
    "build_gating_bwd",
    "build_permute",
    "build_unpermute",
    "gating_bwd_program",
    "gating_lanes",
    "gating_program",
    "gating_warp_program",
    "permute_program",
    "unpermute_program",
    "unpermute_threads",
    "row_vector",
]

MoeDType = Literal["float16", "bfloat16"]
GatingDType = Literal["float16", "bfloat16", "float32"]
_ROW_DTYPES = frozenset(get_args(MoeDType))
_GATING_DTYPES = frozenset(get_args(GatingDType))
_SCORINGS = frozenset({"softmax", "sigmoid"})

#: threads of a row CTA (permutations) and tokens of a gating CTA
_ROW_THREADS = 128
_GATING_THREADS = 128
#: the rows a CTA of the permutation's zero fill checks: most rows are filled by a token's CTA,
#: so a CTA a row would mostly launch to read one index and exit
_ZERO_ROWS = 16


def row_vector(h: int, dtype: str) -> int:
    """Elements a thread moves at once along a row of ``h``: a 16-byte vector where the row is
    a multiple of one, else 1."""
    per = 16 // _ITEMSIZE[dtype]
    return per if h % per == 0 else 1


# --- gating ------------------------------------------------------------------------------------


class MoeGatingSpec(CallSpec, frozen=True, kw_only=True):
    """A routing call: ``e`` experts (the token count is a launch-time size), ``top_k``, the
    logits' dtype, the scoring function, whether the weights are renormalized, the groups,
    the scale of the weights and whether a correction bias is given."""

    e: int
    top_k: int
    dtype: GatingDType
    scoring: str
    renormalize: bool
    num_groups: int
    topk_groups: int
    scale: float
    bias: bool

    def __post_init__(self) -> None:
        self.check_fields(choices={"dtype": _GATING_DTYPES, "scoring": _SCORINGS},
                          sizes=("e", "top_k", "num_groups", "topk_groups"),
                          flags=("renormalize", "bias"))
        if self.num_groups < 1 or self.e % self.num_groups:
            raise ValueError(f"MoeGatingSpec.num_groups must divide e = {self.e}, got "
                             f"{self.num_groups}")


class MoeGatingInterface(KernelInterface):
    """``forward(logits, bias, weights, ids)``: ``logits (M, E)``, ``bias (E,)`` float32 or
    None, ``weights (M, top_k)`` float32 and ``ids (M, top_k)`` int32 written."""

    slot = "moe_gating"
    call_spec = MoeGatingSpec


def _above(T, a, b):
    """``a > b`` in torch's descending sort: a NaN above every number."""
    return T.Or(a > b, T.And(isnan(T, a), T.Not(isnan(T, b))))


def _before(T, a, ia, b, ib):
    """Whether choice ``a`` of expert ``ia`` goes before ``b`` of ``ib`` in the picks: the
    order of torch's stable descending sort (:func:`_above`; NaNs, and equal values, by
    id)."""
    same = T.Or(a == b, T.And(isnan(T, a), isnan(T, b)))
    return T.Or(_above(T, a, b), T.And(same, ia < ib))


def _pick_key(T, v, i):
    """Choice ``v`` of expert ``i`` as one unsigned 64-bit key whose larger values go first in
    the picks, :func:`_before`'s order: the float32's bits made monotone (the sign bit set on
    a number at least 0, every bit flipped on a negative one; -0 as +0, every NaN as the
    largest key) above ``2^32 - 1 - i`` (equal values by the lower id). 0 is no candidate:
    -inf's key is ``0x007fffff`` above the id's half."""
    u32, u64 = "uint32", "uint64"
    bits = T.reinterpret(v, u32)
    mono = T.if_then_else(T.shift_right(bits, T.uint32(31)) == T.uint32(1),
                          T.bitwise_xor(bits, T.uint32(0xFFFFFFFF)),
                          T.bitwise_or(bits, T.uint32(0x80000000)))
    mono = T.if_then_else(isnan(T, v), T.uint32(0xFFFFFFFF),
                          T.if_then_else(v == 0.0, T.uint32(0x80000000), mono))
    return T.bitwise_or(T.shift_left(T.cast(mono, u64), T.uint64(32)),
                        T.cast(T.uint32(0xFFFFFFFF) - T.cast(i, u32), u64))


def gating_program(e: int, top_k: int, dtype: str, scoring: str, renormalize: bool,
                   num_groups: int, topk_groups: int, scale: float, bias: bool):
    """The routing prim_func (see the module docstring); ``M`` dynamic."""
    _, T = tl()
    f32 = "float32"
    M = T.dynamic("M")
    threads = _GATING_THREADS
    per_group = e // num_groups
    grouped = num_groups > 1
    # picks compare the logits themselves where the order is the scores' (monotone): not with
    # a bias, nor with groups (a group's sum of its two best logits can rank the groups
    # otherwise than the sum of their scores: (10, 0) against (4, 4) under sigmoid)
    exact = not bias and not grouped
    # the list of picks in registers where it is short; a long one (top_k up to E) loops
    klist = T.unroll if top_k <= 16 else T.serial

    @T.prim_func
    def main(
        X: T.Tensor((M, e), dtype),
        Bias: T.Tensor((e,), f32),
        W: T.Tensor((M, top_k), f32),
        Ids: T.Tensor((M, top_k), "int32"),
    ):
        with T.Kernel(T.ceildiv(M, threads), threads=threads) as bx:
            tx = T.get_thread_binding(0)
            t = bx * threads + tx
            score = T.alloc_local((e,), f32)  # the scores (the weights' source)
            choice = T.alloc_local((e,), f32)  # what the picks compare
            top = T.alloc_local((top_k,), f32)  # the picks so far, best first
            tid = T.alloc_local((top_k,), "int32")  # their ids (-1: none yet)
            cv = T.alloc_local((2,), f32)  # the candidate carried down the list, a swap
            ci = T.alloc_local((2,), "int32")
            gsum = T.alloc_local((num_groups,), f32)
            kept = T.alloc_local((num_groups,), "int32")
            acc = T.alloc_local((4,), f32)  # max, sum, best value, second value / weight sum
            pick = T.alloc_local((1,), "int32")
            if t < M:
                acc[0] = T.cast(X[t, 0], f32)
                for i in T.serial(e):
                    acc[0] = T.max(acc[0], T.cast(X[t, i], f32))
                acc[1] = 0.0
                for i in T.serial(e):
                    v = T.cast(X[t, i], f32)
                    if scoring == "softmax":
                        score[i] = T.exp(v - acc[0])
                        acc[1] = acc[1] + score[i]
                    else:
                        score[i] = 1.0 / (1.0 + T.exp(-v))
                    choice[i] = v if exact else score[i]
                if scoring == "softmax":
                    for i in T.serial(e):
                        score[i] = score[i] / acc[1]
                if bias:
                    for i in T.serial(e):
                        choice[i] = score[i] + Bias[i]
                if grouped:
                    for g in T.serial(num_groups):  # the sum of the group's two best (its
                        # one, in groups of one), a NaN above every number as in the sort
                        kept[g] = 0
                        if per_group == 1:
                            gsum[g] = choice[g]
                        else:
                            acc[2] = choice[g * per_group]
                            acc[3] = choice[g * per_group + 1]
                            if _above(T, acc[3], acc[2]):
                                acc[2] = choice[g * per_group + 1]
                                acc[3] = choice[g * per_group]
                            for i in T.serial(2, per_group):
                                cv[0] = choice[g * per_group + i]
                                if _above(T, cv[0], acc[2]):
                                    acc[3] = acc[2]
                                    acc[2] = cv[0]
                                elif _above(T, cv[0], acc[3]):
                                    acc[3] = cv[0]
                            gsum[g] = acc[2] + acc[3]
                    for _ in T.serial(topk_groups):  # the best groups, the lowest on ties
                        pick[0] = -1
                        for g in T.serial(num_groups):
                            if kept[g] == 0 and (pick[0] < 0 or _above(T, gsum[g], acc[2])):
                                pick[0] = g
                                acc[2] = gsum[g]
                        kept[pick[0]] = 1
                # the top_k picks in one pass over the eligible experts (those of the kept
                # groups): a list best first, an expert entering it where it beats an entry
                # (a greater choice score, or an equal one and a lower id: a stable sort's
                # order) and the entries from there on carried down one place. (The picks
                # were top_k arg-max passes over all E, each a chain of E dependent compares:
                # DeepSeek-V3's routing of one token took 66 us on the H200.)
                for j in klist(top_k):
                    top[j] = 0.0
                    tid[j] = -1
                for i in T.serial(e):
                    cv[0] = choice[i]
                    ci[0] = i
                    if (not grouped or kept[i // per_group] == 1) and (
                            tid[top_k - 1] < 0 or _before(T, cv[0], ci[0], top[top_k - 1],
                                                          tid[top_k - 1])):
                        for j in klist(top_k):
                            if tid[j] < 0 or _before(T, cv[0], ci[0], top[j], tid[j]):
                                cv[1] = top[j]
                                ci[1] = tid[j]
                                top[j] = cv[0]
                                tid[j] = ci[0]
                                cv[0] = cv[1]
                                ci[0] = ci[1]
                acc[3] = 0.0
                for j in klist(top_k):
                    Ids[t, j] = tid[j]
                    W[t, j] = score[tid[j]]
                    acc[3] = acc[3] + score[tid[j]]
                for j in T.serial(top_k):
                    if renormalize:
                        W[t, j] = W[t, j] / acc[3] * scale
                    else:
                        W[t, j] = W[t, j] * scale

    return main


def gating_lanes(e: int, num_groups: int) -> int:
    """Lanes a token of the routing: 32 (:func:`gating_warp_program`) from 32 experts on,
    where each group's experts are whole lanes' slots, a power of two of lanes (DeepSeek-V3's
    256 in 8 groups: 8 slots a lane, 4 lanes a group); else 1 (:func:`gating_program`)."""
    if e < 32:
        return 1
    slots = -(-e // 32)
    if num_groups > 1:
        per_group = e // num_groups
        lanes = per_group // slots
        if per_group % slots or lanes & (lanes - 1):
            return 1
    return 32


def gating_warp_program(e: int, top_k: int, dtype: str, scoring: str, renormalize: bool,
                        num_groups: int, topk_groups: int, scale: float, bias: bool):
    """The routing with a warp a token, for many experts (:func:`gating_lanes`): the same
    picks and weights as :func:`gating_program` (the same order, NaNs and ties included; the
    softmax's sum is added in another order), with the serial chains cut to a lane's slots
    and five shuffles. Lane ``l`` holds experts ``l * S`` to ``l * S + S - 1`` (``S = ceil(E /
    32)``); the softmax's max and sum are warp reductions; a group's two best merge across its
    lanes; a group is kept where fewer than ``topk_groups`` groups go before it (every group's
    sum read from its first lane); each of the ``top_k`` picks is the largest of the lanes'
    free slots' 64-bit keys (:func:`_pick_key`: the order of :func:`_before` in one unsigned
    max), a butterfly of five shuffles leaving it in every lane, the owner lane giving its
    score and retiring the slot. (A thread a token ran DeepSeek-V3's routing of one token in
    62 us on the H200: chains of E dependent steps through local memory; this, 6.0 us.)"""
    _, T = tl()
    f32, i32 = "float32", "int32"
    M = T.dynamic("M")
    threads = _GATING_THREADS
    tokens = threads // 32
    n_s = -(-e // 32)  # slots a lane
    padded = e < 32 * n_s  # the last lanes hold fewer (or no) experts
    grouped = num_groups > 1
    per_group = e // num_groups
    glanes = per_group // n_s if grouped else 1  # lanes a group
    exact = not bias and not grouped
    slots = T.unroll if n_s <= 16 else T.serial
    klist = T.unroll if top_k <= 16 else T.serial

    @T.prim_func
    def main(
        X: T.Tensor((M, e), dtype),
        Bias: T.Tensor((e,), f32),
        W: T.Tensor((M, top_k), f32),
        Ids: T.Tensor((M, top_k), i32),
    ):
        with T.Kernel(T.ceildiv(M, tokens), threads=threads) as bx:
            tx = T.get_thread_binding(0)
            lane = tx % 32
            t = bx * tokens + tx // 32
            score = T.alloc_local((n_s,), f32)  # the lane's experts' scores
            choice = T.alloc_local((n_s,), f32)  # what the picks compare
            key = T.alloc_local((n_s,), "uint64")  # _pick_key, 0 once picked or ineligible
            pw = T.alloc_local((top_k,), f32)  # the picks' scores and ids, best first
            pid = T.alloc_local((top_k,), i32)
            acc = T.alloc_local((4,), f32)  # max, sum / the group's two best, its sum
            cand = T.alloc_local((4,), f32)  # a group's two best from a peer lane, a score
            best = T.alloc_local((1,), "uint64")  # the pick's key, the lane's then the warp's
            cid = T.alloc_local((1,), i32)
            rank = T.alloc_local((1,), i32)
            if t < M:  # the warp's token: every lane takes the branch alike
                acc[0] = -T.infinity(f32)
                for s in slots(n_s):
                    i = lane * n_s + s
                    if padded:
                        score[s] = T.if_then_else(i < e, T.cast(X[t, T.min(i, e - 1)], f32),
                                                  -T.infinity(f32))
                    else:
                        score[s] = T.cast(X[t, i], f32)
                    if scoring == "softmax":
                        acc[0] = T.max(acc[0], score[s])
                if scoring == "softmax":
                    for k in T.unroll(5):
                        acc[0] = T.max(acc[0], T.shfl_xor(acc[0], 16 >> k))
                acc[1] = 0.0
                for s in slots(n_s):
                    v = score[s]
                    if scoring == "softmax":
                        score[s] = T.exp(v - acc[0])
                        if padded:
                            score[s] = T.if_then_else(lane * n_s + s < e, score[s], 0.0)
                        acc[1] = acc[1] + score[s]
                    else:
                        score[s] = 1.0 / (1.0 + T.exp(-v))
                    choice[s] = v if exact else score[s]
                if scoring == "softmax":
                    for k in T.unroll(5):
                        acc[1] = acc[1] + T.shfl_xor(acc[1], 16 >> k)
                    for s in slots(n_s):
                        score[s] = score[s] / acc[1]
                        if not exact:
                            choice[s] = score[s]
                if bias:
                    for s in slots(n_s):
                        choice[s] = score[s] + Bias[T.min(lane * n_s + s, e - 1)]
                for s in slots(n_s):
                    key[s] = _pick_key(T, choice[s], lane * n_s + s)
                    if padded:
                        key[s] = T.if_then_else(lane * n_s + s < e, key[s], T.uint64(0))
                if grouped:
                    # the lane's two best (a NaN above every number), merged across the
                    # group's lanes: the group's sum of its two best (its one, in groups of one)
                    acc[2] = -T.infinity(f32)
                    acc[3] = -T.infinity(f32)
                    for s in slots(n_s):
                        cand[0] = choice[s]
                        if _above(T, cand[0], acc[2]):
                            acc[3] = acc[2]
                            acc[2] = cand[0]
                        elif _above(T, cand[0], acc[3]):
                            acc[3] = cand[0]
                    for k in T.unroll(max(glanes.bit_length() - 1, 0)):
                        cand[2] = T.shfl_xor(acc[2], 1 << k)
                        cand[3] = T.shfl_xor(acc[3], 1 << k)
                        if _above(T, cand[2], acc[2]):
                            acc[3] = T.if_then_else(_above(T, acc[2], cand[3]), acc[2], cand[3])
                            acc[2] = cand[2]
                        elif _above(T, cand[2], acc[3]):
                            acc[3] = cand[2]
                    if per_group == 1:
                        acc[1] = acc[2]
                    else:
                        acc[1] = acc[2] + acc[3]
                    # the groups going before the lane's (the best first, the lowest on ties)
                    rank[0] = 0
                    for h in T.unroll(num_groups):
                        cand[2] = T.shfl_sync(acc[1], h * glanes)
                        if _before(T, cand[2], h, acc[1], lane // glanes):
                            rank[0] = rank[0] + 1
                    if rank[0] >= topk_groups or lane // glanes >= num_groups:
                        for s in slots(n_s):
                            key[s] = T.uint64(0)
                for j in klist(top_k):
                    # the largest key: the lane's, then the warp's by a butterfly (every lane
                    # ends with it); the owner's score read from its lane, which retires it
                    best[0] = key[0]
                    for s in slots(1, n_s):
                        best[0] = T.max(best[0], key[s])
                    for k in T.unroll(5):
                        best[0] = T.max(best[0], T.shfl_xor(best[0], 16 >> k))
                    cid[0] = T.cast(T.uint32(0xFFFFFFFF) - T.cast(best[0], "uint32"), i32)
                    cand[1] = 0.0
                    for s in slots(n_s):
                        if lane * n_s + s == cid[0]:
                            cand[1] = score[s]
                            key[s] = T.uint64(0)
                    pw[j] = T.shfl_sync(cand[1], cid[0] // n_s)
                    pid[j] = T.if_then_else(best[0] == T.uint64(0), -1, cid[0])
                acc[3] = 0.0
                for j in klist(top_k):
                    acc[3] = acc[3] + pw[j]
                for j in klist(top_k):
                    if j % 32 == lane:
                        Ids[t, j] = pid[j]
                        if renormalize:
                            W[t, j] = pw[j] / acc[3] * scale
                        else:
                            W[t, j] = pw[j] * scale

    return main


@stored(maxsize=64)
def build_gating(e: int, top_k: int, dtype: str, scoring: str, renormalize: bool,
                 num_groups: int, topk_groups: int, scale: float, bias: bool,
                 target: str | None = None, lanes: int | None = None):
    """Compile the routing (cached per process and on disk): :func:`gating_warp_program` with
    ``lanes`` 32, :func:`gating_program` with 1 (the default: :func:`gating_lanes`)."""
    lanes = gating_lanes(e, num_groups) if lanes is None else lanes
    if lanes not in (1, gating_lanes(e, num_groups)):
        raise ValueError(f"build_gating: {e} experts in {num_groups} groups take a thread a "
                         f"token (lanes 1), not {lanes}")
    program = {1: gating_program, 32: gating_warp_program}[lanes]
    return compile_program(program(e, top_k, dtype, scoring, renormalize, num_groups,
                                   topk_groups, scale, bias), target)


class _MoeKernel(Kernel):
    """The MoE kernels: each is its slot's one implementation, for sm_80 to sm_90."""

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    general = True


class MoeGatingKernel(_MoeKernel, MoeGatingInterface):
    """Any expert count and top-k, sm_80 to sm_90: a thread a token, or a warp a token from 32
    experts on (:func:`gating_lanes`)."""

    def __init__(self, spec: MoeGatingSpec) -> None:
        super().__init__(spec)
        self.program = build_gating(spec.e, spec.top_k, spec.dtype, spec.scoring,
                                    spec.renormalize, spec.num_groups, spec.topk_groups,
                                    spec.scale, spec.bias)

    def __call__(self, logits, bias, weights, ids) -> None:
        if logits.shape[0] == 0:
            return
        if bias is None:  # the program reads no bias then; any float32 vector of E stands in
            bias = weights.new_empty((self.spec.e,))
        self.program(logits, bias, weights, ids)


class MoeGatingBwdSpec(CallSpec, frozen=True, kw_only=True):
    """The routing weights' gradient: ``e`` experts, ``top_k``, the logits' dtype, the
    scoring function, whether the weights were renormalized and their scale (the token count
    is a launch-time size; the groups and the correction bias only chose the picks, which are
    an input here)."""

    e: int
    top_k: int
    dtype: GatingDType
    scoring: str
    renormalize: bool
    scale: float

    def __post_init__(self) -> None:
        self.check_fields(choices={"dtype": _GATING_DTYPES, "scoring": _SCORINGS},
                          sizes=("e", "top_k"), flags=("renormalize",))


class MoeGatingBwdInterface(KernelInterface):
    """``forward(dweights, logits, ids, dlogits)``: ``dweights (M, top_k)`` float32, ``logits
    (M, E)``, ``ids (M, top_k)`` int32, ``dlogits (M, E)`` (the logits' dtype) written whole."""

    slot = "moe_gating_bwd"
    call_spec = MoeGatingBwdSpec


def gating_bwd_program(e: int, top_k: int, dtype: str, scoring: str, renormalize: bool,
                       scale: float, lanes: int = 1):
    """``dlogits`` of the routing's weights: ``lanes`` threads a token, 1 (as the forward's
    thread program) or 32 (a warp, from 32 experts on: lane ``l`` reads and writes columns
    ``l, l + 32, ...``, a warp's accesses to a row contiguous where a thread alone read its row
    a sector a load; the softmax's max and sum then reduced by shuffles). The token's row is
    read twice for softmax (its max, then its sum of exponentials) and once more as the
    gradient is written; only the picks' scores and score gradients are held (``top_k``
    floats each, every lane's: the picks' loads one address across a warp), since a column's
    score gradient is the sum of its picks' (a column no pick names gets ``-s * dot`` under
    softmax, 0 under sigmoid). Each column looks through the ``top_k`` picks for its own, so
    ids a caller repeats sum, as the reference's scatter_add does; an id outside ``[0, E)``
    reads nothing and names no column."""
    if lanes not in (1, 32):
        raise ValueError(f"gating_bwd_program: lanes is 1 or 32 (a warp), not {lanes}")
    _, T = tl()
    f32 = "float32"
    M = T.dynamic("M")
    threads = _GATING_THREADS
    tokens = threads // lanes
    n_c = -(-e // lanes)  # columns a thread
    softmax = scoring == "softmax"
    cols = T.unroll if n_c <= 16 else T.serial
    klist = T.unroll if top_k <= 16 else T.serial

    @T.prim_func
    def main(
        DW: T.Tensor((M, top_k), f32),
        X: T.Tensor((M, e), dtype),
        Ids: T.Tensor((M, top_k), "int32"),
        DX: T.Tensor((M, e), dtype),
    ):
        with T.Kernel(T.ceildiv(M, tokens), threads=threads) as bx:
            tx = T.get_thread_binding(0)
            lane = tx % lanes
            t = bx * tokens + tx // lanes
            picked = T.alloc_local((top_k,), f32)  # the picks' scores
            g = T.alloc_local((top_k,), f32)  # the picks' score gradients
            idx = T.alloc_local((top_k,), "int32")
            acc = T.alloc_local((4,), f32)  # max, exp sum (softmax), picks' score sum, dot
            col = T.alloc_local((1,), f32)  # a column's score gradient
            if t < M:  # the token's: a warp's lanes take the branch alike
                acc[0] = 0.0
                acc[1] = 1.0
                if softmax:
                    acc[0] = -T.infinity(f32)
                    for c in cols(n_c):
                        i = lane + lanes * c
                        if i < e:
                            acc[0] = T.max(acc[0], T.cast(X[t, i], f32))
                    if lanes > 1:  # over the token's lanes
                        for k in T.unroll(5):
                            acc[0] = T.max(acc[0], T.shfl_xor(acc[0], 16 >> k))
                    acc[1] = 0.0
                    for c in cols(n_c):
                        i = lane + lanes * c
                        if i < e:
                            acc[1] = acc[1] + T.exp(T.cast(X[t, i], f32) - acc[0])
                    if lanes > 1:
                        for k in T.unroll(5):
                            acc[1] = acc[1] + T.shfl_xor(acc[1], 16 >> k)
                acc[2] = 0.0
                for j in klist(top_k):
                    idx[j] = Ids[t, j]
                    picked[j] = 0.0
                    if idx[j] >= 0 and idx[j] < e:
                        v = T.cast(X[t, idx[j]], f32)
                        if softmax:
                            picked[j] = T.exp(v - acc[0]) / acc[1]
                        else:
                            picked[j] = 1.0 / (1.0 + T.exp(-v))
                    acc[2] = acc[2] + picked[j]
                    g[j] = DW[t, j] * scale
                if renormalize:  # w = s / S: ds = (g - sum(g * w)) / S
                    acc[3] = 0.0
                    for j in klist(top_k):
                        acc[3] = acc[3] + g[j] * picked[j]
                    for j in klist(top_k):
                        g[j] = (g[j] - acc[3] / acc[2]) / acc[2]
                acc[3] = 0.0  # sum(ds * s): only the picks' columns have ds
                for j in klist(top_k):
                    acc[3] = acc[3] + g[j] * picked[j]
                for c in cols(n_c):
                    i = lane + lanes * c
                    if i < e:
                        col[0] = 0.0
                        for j in klist(top_k):
                            if idx[j] == i:
                                col[0] = col[0] + g[j]
                        v = T.cast(X[t, i], f32)
                        if softmax:
                            DX[t, i] = T.cast(T.exp(v - acc[0]) / acc[1] * (col[0] - acc[3]),
                                              dtype)
                        else:
                            sg = 1.0 / (1.0 + T.exp(-v))
                            DX[t, i] = T.cast(col[0] * sg * (1.0 - sg), dtype)

    return main


@stored(maxsize=64)
def build_gating_bwd(e: int, top_k: int, dtype: str, scoring: str, renormalize: bool,
                     scale: float, target: str | None = None, lanes: int | None = None):
    """Compile :func:`gating_bwd_program` with ``lanes`` threads a token (the default: a warp
    from 32 experts on, :func:`gating_lanes` without groups)."""
    lanes = gating_lanes(e, 1) if lanes is None else lanes
    if lanes not in (1, gating_lanes(e, 1)):
        raise ValueError(f"build_gating_bwd: {e} experts take a thread a token (lanes 1), "
                         f"not {lanes}")
    return compile_program(gating_bwd_program(e, top_k, dtype, scoring, renormalize, scale,
                                              lanes), target)


class MoeGatingBwdKernel(_MoeKernel, MoeGatingBwdInterface):
    """Any expert count and top-k, sm_80 to sm_90: a thread a token, or a warp a token from 32
    experts on."""

    def __init__(self, spec: MoeGatingBwdSpec) -> None:
        super().__init__(spec)
        self.program = build_gating_bwd(spec.e, spec.top_k, spec.dtype, spec.scoring,
                                        spec.renormalize, spec.scale)

    def __call__(self, dweights, logits, ids, dlogits) -> None:
        if logits.shape[0] == 0:
            return
        self.program(dweights, logits, ids, dlogits)


# --- permutations ------------------------------------------------------------------------------


class MoeRowsSpec(CallSpec, frozen=True, kw_only=True):
    """A row permutation: the row length ``h`` and the dtype (row counts are launch-time)."""

    h: int
    dtype: MoeDType

    def __post_init__(self) -> None:
        self.check_fields(choices={"dtype": _ROW_DTYPES}, sizes=("h",))


class MoePermuteInterface(KernelInterface):
    """``forward(x, rows, src, y)``: ``x (M, H)``, ``rows (M, K)`` int32 (each slot's row of
    ``y``, -1 when dropped), ``src (R,)`` int32 (each row's token, -1 for a row no slot fills),
    ``y (R, H)`` written whole."""

    slot = "moe_permute_rows"
    call_spec = MoeRowsSpec


def permute_program(h: int, dtype: str):
    """``y[rows[t, j]] = x[t]`` for every slot, zeros in every row no slot fills: a CTA a
    token reads its row once and writes it to each of its slots' rows (token-major: the
    input is read once, where a CTA a row read each token's row once for each of its picks,
    in the experts' order), and the CTAs past the tokens, :data:`_ZERO_ROWS` rows each, write
    zeros where ``src[r] < 0`` (see the module docstring)."""
    _, T = tl()
    M, R, K = T.dynamic("M"), T.dynamic("R"), T.dynamic("K")
    threads = _ROW_THREADS
    vec = row_vector(h, dtype)
    chunks = -(-h // (threads * vec))

    @T.prim_func
    def main(
        X: T.Tensor((M, h), dtype),
        Rows: T.Tensor((M, K), "int32"),
        Src: T.Tensor((R,), "int32"),
        Y: T.Tensor((R, h), dtype),
    ):
        with T.Kernel(M + T.ceildiv(R, _ZERO_ROWS), threads=threads) as b:
            tx = T.get_thread_binding(0)
            buf = T.alloc_local((chunks, vec), dtype)
            if b < M:  # token b: its row once, then to each of its slots' rows
                for c in T.unroll(chunks):
                    col = (c * threads + tx) * vec
                    if col < h:
                        for v in T.vectorized(vec):
                            buf[c, v] = X[b, col + v]
                for j in T.serial(K):
                    r = Rows[b, j]
                    if r >= 0:
                        for c in T.unroll(chunks):
                            col = (c * threads + tx) * vec
                            if col < h:
                                for v in T.vectorized(vec):
                                    Y[r, col + v] = buf[c, v]
            else:  # rows (b - M) * _ZERO_ROWS on: zeros in those no slot fills
                for c in T.unroll(chunks):
                    for v in T.unroll(vec):
                        buf[c, v] = T.cast(0, dtype)
                for i in T.serial(_ZERO_ROWS):
                    r = (b - M) * _ZERO_ROWS + i
                    if r < R:  # noqa: SIM102 - the index read only inside the rows
                        if Src[r] < 0:
                            for c in T.unroll(chunks):
                                col = (c * threads + tx) * vec
                                if col < h:
                                    for v in T.vectorized(vec):
                                        Y[r, col + v] = buf[c, v]

    return main


@stored(maxsize=64)
def build_permute(h: int, dtype: str, target: str | None = None):
    """Compile :func:`permute_program`."""
    return compile_program(permute_program(h, dtype), target)


class MoePermuteKernel(_MoeKernel, MoePermuteInterface):
    """Any row length, sm_80 to sm_90."""

    def __init__(self, spec: MoeRowsSpec) -> None:
        super().__init__(spec)
        self.program = build_permute(spec.h, spec.dtype) if spec.h else None

    def __call__(self, x, rows, src, y) -> None:
        if self.program is None or y.shape[0] == 0:
            return
        self.program(x, rows, src, y)


class MoeUnpermuteSpec(CallSpec, frozen=True, kw_only=True):
    """An unpermutation: the row length ``h``, the picks a token ``k`` and the dtype."""

    h: int
    k: int
    dtype: MoeDType

    def __post_init__(self) -> None:
        self.check_fields(choices={"dtype": _ROW_DTYPES}, sizes=("h", "k"))


class MoeUnpermuteInterface(KernelInterface):
    """``forward(y, rows, weights, out)``: ``y (R, H)``, ``rows (M, K)`` int32, ``weights (M,
    K)`` float32, ``out (M, H)`` written whole."""

    slot = "moe_unpermute"
    call_spec = MoeUnpermuteSpec


def unpermute_threads(h: int, dtype: str) -> int:
    """Threads of the unpermutation's CTA (a token): a vector of the row each where the row
    has at most 1024 of them (Mixtral's 4096 bfloat16: 512 threads; DeepSeek-V3's 7168:
    896), a multiple of 32 from 128 on. With 128 threads a row of 4096 was four steps a
    thread, each a load of the picks' rows after the last step's store: a token alone took
    2.1 us against torch.compile's 1.5."""
    vectors = -(-h // row_vector(h, dtype))
    return min(1024, max(_ROW_THREADS, -(-vectors // 32) * 32))


def unpermute_program(h: int, k: int, dtype: str):
    """``out[t] = sum_j weights[t, j] * y[rows[t, j]]``: a CTA a token (see the module
    docstring) of :func:`unpermute_threads`."""
    _, T = tl()
    M, R = T.dynamic("M"), T.dynamic("R")
    threads = unpermute_threads(h, dtype)
    vec = row_vector(h, dtype)
    chunks = -(-h // (threads * vec))
    f32 = "float32"

    @T.prim_func
    def main(
        Y: T.Tensor((R, h), dtype),
        Rows: T.Tensor((M, k), "int32"),
        W: T.Tensor((M, k), f32),
        Out: T.Tensor((M, h), dtype),
    ):
        with T.Kernel(M, threads=threads) as t:
            tx = T.get_thread_binding(0)
            acc = T.alloc_local((vec,), f32)
            buf = T.alloc_local((k, vec), dtype)
            for c in T.serial(chunks):
                col = (c * threads + tx) * vec
                if col < h:
                    for j in T.unroll(k):  # the picks' loads in flight together
                        src = Rows[t, j]
                        if src >= 0:
                            for v in T.vectorized(vec):
                                buf[j, v] = Y[src, col + v]
                        else:
                            for v in T.vectorized(vec):
                                buf[j, v] = T.cast(0, dtype)
                    for v in T.vectorized(vec):
                        acc[v] = 0.0
                    for j in T.unroll(k):
                        for v in T.unroll(vec):
                            acc[v] = acc[v] + W[t, j] * T.cast(buf[j, v], f32)
                    for v in T.vectorized(vec):
                        Out[t, col + v] = T.cast(acc[v], dtype)

    return main


@stored(maxsize=64)
def build_unpermute(h: int, k: int, dtype: str, target: str | None = None):
    """Compile :func:`unpermute_program`."""
    return compile_program(unpermute_program(h, k, dtype), target)


class MoeUnpermuteKernel(_MoeKernel, MoeUnpermuteInterface):
    """Any row length and picks a token, sm_80 to sm_90."""

    def __init__(self, spec: MoeUnpermuteSpec) -> None:
        super().__init__(spec)
        self.program = None
        if spec.h:
            self.program = build_unpermute(spec.h, spec.k, spec.dtype)

    def __call__(self, y, rows, weights, out) -> None:
        if self.program is None or out.shape[0] == 0:
            return
        if self.spec.k == 0:
            out.zero_()
            return
        self.program(y, rows, weights, out)


class MoeGateGradInterface(KernelInterface):
    """``forward(dout, y, rows, dweights)``: ``dout (M, H)``, ``y (R, H)``, ``rows (M, K)``
    int32, ``dweights (M, K)`` float32 written whole."""

    slot = "moe_gate_grad"
    call_spec = MoeUnpermuteSpec


def gate_grad_program(h: int, k: int, dtype: str):
    """``dweights[t, j] = dout[t] . y[rows[t, j]]``: a warp a token (see the module
    docstring); the lanes' sums are reduced by TVM's thread all-reduce over the warp."""
    _, T = tl()
    M, R = T.dynamic("M"), T.dynamic("R")
    lanes = 32
    vec = row_vector(h, dtype)
    chunks = -(-h // (lanes * vec))
    f32 = "float32"

    @T.prim_func
    def main(
        Dout: T.Tensor((M, h), dtype),
        Y: T.Tensor((R, h), dtype),
        Rows: T.Tensor((M, k), "int32"),
        DW: T.Tensor((M, k), f32),
    ):
        with T.Kernel(M, threads=lanes) as t:
            lane = T.get_thread_binding(0)
            a_l = T.alloc_local((vec,), dtype)
            b_l = T.alloc_local((vec,), dtype)
            acc = T.alloc_local((1,), f32)
            red = T.alloc_local((1,), f32)
            for j in T.serial(k):
                src = Rows[t, j]
                acc[0] = 0.0
                if src >= 0:
                    for c in T.serial(chunks):
                        col = (c * lanes + lane) * vec
                        if col < h:
                            for v in T.vectorized(vec):
                                a_l[v] = Dout[t, col + v]
                            for v in T.vectorized(vec):
                                b_l[v] = Y[src, col + v]
                            for v in T.unroll(vec):
                                acc[0] += T.cast(a_l[v], f32) * T.cast(b_l[v], f32)
                with T.attr(T.comm_reducer(lambda x, y: x + y, [T.Cast(f32, 0)]),
                            "reduce_scope", T.reinterpret(T.uint64(0), dtype="handle")):
                    T.evaluate(T.tvm_thread_allreduce(T.uint32(1), acc[0], True, red[0], lane,
                                                      dtype="handle"))
                if lane == 0:
                    DW[t, j] = red[0]

    return main


@stored(maxsize=64)
def build_gate_grad(h: int, k: int, dtype: str, target: str | None = None):
    """Compile :func:`gate_grad_program`."""
    return compile_program(gate_grad_program(h, k, dtype), target)


class MoeGateGradKernel(_MoeKernel, MoeGateGradInterface):
    """Any row length and picks a token, sm_80 to sm_90."""

    def __init__(self, spec: MoeUnpermuteSpec) -> None:
        super().__init__(spec)
        self.program = build_gate_grad(spec.h, spec.k, spec.dtype) if spec.k else None

    def __call__(self, dout, y, rows, dweights) -> None:
        if self.program is None or dweights.shape[0] == 0:
            return
        if self.spec.h == 0:
            dweights.zero_()
            return
        self.program(dout, y, rows, dweights)
