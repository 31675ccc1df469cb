"""Prefill attention backward in TileLang: dq, dk, dv of the forward in ``attention.py``.

The pattern is TileLang's ``examples/flash_attention/example_gqa_bwd.py``: one CTA a (key
tile, query head, batch entry) holds ``block_n`` keys and values in shared memory and walks
the query tiles that see them (``T.Pipelined`` over ``block_m`` query rows a step), with the
probabilities recomputed from the forward's log-sum-exp in their transposed form
(``P^T = exp(K Q^T - lse)``, so the key tile's ``dK`` and ``dV`` accumulate in registers):

- ``dV += P^T dO``; ``dP^T = V dO^T``; ``dS^T = P^T (dP^T - delta)`` with ``delta`` the row
  sums of ``dO * O`` less the log-sum-exp's upstream gradient where it has one (computed
  before the kernel: ``d lse / d s = P``), times ``1 - tanh^2`` of the capped scores
  under a softcap and by the scale; ``dK += dS^T Q``; ``dQ += dS K`` added atomically into a
  float32 ``dQ`` (every key tile adds its share of a query row's gradient);
- the mask is the forward's, bottom-right aligned, with the window's bounds: the query-tile
  loop starts and stops at the first and last query rows that see the CTA's keys, and a
  probability outside a row's window, past ``S_kv`` or past ``S_q`` is selected to 0 (a row
  that sees no key has log-sum-exp -inf and contributes nothing);
- grouped-query heads: each CTA writes its query head's ``dK`` and ``dV`` to float32 buffers
  with one slot a query head, summed over each key head's group after the kernel (one
  deterministic sum instead of atomics between the heads of a group).

``B``, ``S_q`` and ``S_kv`` are launch-time sizes, as the forward's. The entry runs the
preprocess (``delta``), the kernel, the group sums and the casts of the float32 gradients.

The sm_90 program (:class:`AttentionBwdTmaKernel`) has two schedules beside the served one,
each a module flag (a program of its own; off until timed on a GPU), after FlashAttention-3's
backward (``hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp``), whose structure it otherwise shares
(128 keys a CTA over two math warpgroups, 64 query rows a step, ``S^T`` and ``dP^T`` with the
keys as rows so ``P^T`` and ``dS^T`` feed ``dV`` and ``dK`` from registers, ``dS`` through
shared memory for ``dQ``, one TMA reduce-add of the ``dQ`` tile a step):

- :data:`STATS_TMA`: the served program's math threads load each step's log-sum-exp and
  ``Delta`` from global memory and store them to shared memory before the step's first
  product, behind a barrier of both warpgroups (a load's latency a step on the critical path),
  and those loads make TileLang's pipeline keep two producer warpgroups (512 threads, 224
  registers a math thread). With the flag the delta program writes both in whole tiles of
  ``block_m`` rows (the log-sum-exp times log2(e)), the producer loads them by TMA in the
  query tile's stage, and the pipeline has one producer warpgroup (384 threads, 240
  registers a math thread, FlashAttention-3's split);
- :data:`OVERLAP`: the served program waits for each of ``dV``'s, ``dK``'s and ``dQ``'s
  products as soon as it is issued. With the flag ``dV``'s is issued as soon as ``P`` is cast
  (under ``dP``'s tail and ``dS``), ``dQ``'s after ``dS``'s store and ``dK``'s after ``dV``'s
  wait, each waited for one product behind, so ``dK``'s runs under the store of the ``dQ``
  tile and its reduce-add.

:class:`AttentionBwdFragmentKernel` (opt-in, not yet measured) stores the float32 ``dQ`` in
the order of the ``dQ`` product's register fragment, as TileLang's wgmma backward example
does: a warp's atomic adds then land on consecutive words instead of rows ``H * D`` apart,
and a second program casts the buffer out into ``dq`` (no ``copy_`` of it).
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

from typing import Any, ClassVar, NamedTuple

from tileops.runtime import Kernel, KernelInterface

from ._store import stored
from ._tilelang import compile_program, tl
from .attention import (
    AttentionFwdSpec,
    AttentionLayout,
    _bounds,
    _cap_constants,
    _f32,
)

__all__ = [
    "AttentionBwdFragmentKernel",
    "AttentionBwdInterface",
    "AttentionBwdKernel",
    "AttentionBwdPlan",
    "AttentionBwdTmaKernel",
    "BWD_HEAD_DIMS",
    "DQ_ROW_BLOCK",
    "attention_bwd_delta_program",
    "attention_bwd_dq_program",
    "attention_bwd_plan",
    "attention_bwd_program",
    "bwd_program_key",
    "build_attention_bwd",
    "build_attention_bwd_delta",
    "build_attention_bwd_dq",
    "dq_fragment_layout",
    "first_query_tile",
    "whole_tile_pair",
    "query_tiles_end",
]

_LOG2E = 1.4426950408889634


class AttentionBwdInterface(KernelInterface):
    """One slot: ``forward(dout, q, k, v, o, lse, dlse, dq, dk, dv)``, every tensor contiguous
    in the spec's layout, ``lse`` the forward's ``[B, H, S_q]`` float32 log-sum-exp, ``dlse``
    its upstream gradient or None. The call spec is the forward's
    (:class:`AttentionFwdSpec`)."""

    slot = "attention_bwd"
    call_spec = AttentionFwdSpec


class AttentionBwdPlan(NamedTuple):
    """``block_n`` keys a CTA, ``block_m`` query rows a step, ``stages`` of query-tile copies
    in flight, ``threads`` a CTA; ``dq_fragment_order``: the float32 ``dQ`` the key tiles add
    into is stored in the order of the ``dQ`` product's register fragment (8 x 8 blocks, a
    thread's pairs adjacent), so a warp's atomic adds land on consecutive words instead of
    rows ``H * D`` apart, and a second program (:func:`attention_bwd_dq_program`) writes it
    out in the layout and dtype; TileLang's wgmma backward example stores it so.
    ``dq_tma`` (sm_90): a step's ``dQ`` tile goes through shared memory and is added into the
    float32 ``dQ`` by one TMA reduce-add (``cp.reduce.async.bulk.tensor``), rows past ``S_q``
    dropped by the tensor map, instead of a float32 atomic per element; ``sdp_async`` (sm_90,
    ``block_m`` of 64 or more): the scores' and ``dP``'s products are issued together and the
    probabilities computed while ``dP``'s runs (FlashAttention-3's first overlap).
    ``kv_direct``: where every query head has its own key head (no group to reduce), ``dK``
    and ``dV`` are written in the storage dtype by the program itself, not as float32
    partials the host casts; ``delta_program``: ``Delta = rowsum(dO * O) - dlse`` comes from
    a program reading ``dO`` and ``O`` once (:func:`attention_bwd_delta_program`), not from
    float32 copies of both."""

    block_n: int
    block_m: int
    stages: int
    threads: int
    dq_fragment_order: bool = False
    dq_tma: bool = False
    sdp_async: bool = False
    kv_direct: bool = False
    delta_program: bool = False
    #: (with ``delta_program``) the delta program also writes the log-sum-exp times log2(e),
    #: and both go to ``[B, H, S_t, block_m]`` buffers of whole query tiles (rows past ``S_q``
    #: 0), so a step's 64 values of each are one TMA load of the pipeline's producer, in the
    #: stage of its query tile: the consumers no longer load them from global memory and
    #: store them to shared memory before each step's products (a load's latency and a
    #: barrier a step), and the exponent takes the scaled log-sum-exp as it is
    #: (FlashAttention-3's preprocess); :data:`STATS_TMA`
    stats_tma: bool = False
    #: (with ``sdp_async``) the step's last three products are issued back to back and waited
    #: for one behind: ``dV += P^T dO`` runs under the store of ``dS`` to shared memory and its
    #: barrier, ``dQ = dS K`` under ``dV``'s tail and ``dK += dS^T Q`` under the store of the
    #: ``dQ`` tile and its reduce-add, where each was waited for as soon as it was issued
    #: (FlashAttention-3's order); :data:`OVERLAP`
    overlap: bool = False


#: whether the sm_90 backward (:class:`AttentionBwdTmaKernel`) loads the log-sum-exp and
#: ``Delta`` of a step by TMA from whole-tile buffers (:attr:`AttentionBwdPlan.stats_tma`;
#: off until timed on a GPU)
STATS_TMA = False
#: whether the sm_90 backward issues its last three products back to back
#: (:attr:`AttentionBwdPlan.overlap`; off until timed on a GPU)
OVERLAP = False


#: the (D, D_v) pairs the backward serves. Wider heads would hold dK and dV of 64 keys over
#: one warpgroup (256 float32 registers a thread for D 256) or split 64 keys over two, which
#: TileLang 0.1.15 refuses ("layout infer conflict" between the probabilities and their cast);
#: the reference target serves them
BWD_HEAD_DIMS = frozenset({(64, 64), (128, 128)})


def attention_bwd_plan(dim: int, dim_v: int) -> AttentionBwdPlan:
    """128 keys a CTA (dK and dV of 128 x 128 in float32 are 64 registers each over 256
    threads), 32 query rows a step, two stages, 256 threads."""
    return AttentionBwdPlan(block_n=128, block_m=32, stages=2, threads=256)


#: rows of the fragment-ordered ``dQ`` are allocated in whole blocks of this many
DQ_ROW_BLOCK = 8


def dq_fragment_layout(bshd: bool):
    """The index map of the fragment-ordered ``dQ`` (logical ``[B, S, H, D]`` or
    ``[B, H, S, D]`` to its storage): 8 x 8 blocks of (row, column), each a block of 64 words
    in which a thread's two adjacent columns of a row are neighbours, as the product's
    accumulator fragment holds them."""
    if bshd:
        return lambda b, r, h, d: [b, r // 8, h, d // 8, d % 2, 4 * (r % 8) + (d % 8) // 2]
    return lambda b, h, r, d: [b, h, r // 8, d // 8, d % 2, 4 * (r % 8) + (d % 8) // 2]


def first_query_tile(j0: Any, seq_q: Any, seq_kv: Any, right: int, bm: int,
                     mx: Any = max) -> Any:
    """The first query tile that sees a key tile starting at key ``j0``: row ``i`` sees key
    ``j`` when ``j <= i + S_kv - S_q + right``. ``mx`` is ``max`` for ints, ``T.max`` in the
    program."""
    _, rb = _bounds(seq_q, seq_kv, -1, right)
    return mx(0, j0 - (seq_kv - seq_q) - rb) // bm


def query_tiles_end(j0: Any, seq_q: Any, seq_kv: Any, left: int, right: int, bn: int,
                    bm: int, mx: Any = max, mn: Any = min) -> Any:
    """One past the last query tile that sees a key tile of ``bn`` keys from ``j0`` (row ``i``
    sees key ``j`` when ``j >= i + S_kv - S_q - left``), within ``S_q``; never before
    :func:`first_query_tile`."""
    lb, _ = _bounds(seq_q, seq_kv, left, right)
    hi = mx(0, mn(seq_q, j0 + bn - (seq_kv - seq_q) + lb))
    return mx(first_query_tile(j0, seq_q, seq_kv, right, bm, mx), (hi + bm - 1) // bm)


def whole_tile_pair(j0: Any, i0: Any, seq_q: Any, seq_kv: Any, left: int, right: int,
                    bn: int, bm: int) -> Any:
    """Whether every row of the query tile of ``bm`` rows from ``i0`` sees every key of the key
    tile of ``bn`` keys from ``j0`` (both tiles within ``S_q`` and ``S_kv``, every pair inside
    the window: row ``i`` sees key ``j`` when ``i + S_kv - S_q - left <= j <= i + S_kv - S_q +
    right``), so the probabilities need no mask. An expression of the program's sizes there,
    a bool on ints."""
    lb, rb = _bounds(seq_q, seq_kv, left, right)
    offset = seq_kv - seq_q
    whole = (j0 + bn <= seq_kv) & (i0 + bm <= seq_q)
    if right >= 0:  # the first row's rightmost key reaches the tile's last key
        whole = whole & (j0 + bn - 1 <= i0 + offset + rb)
    if left >= 0:  # the last row's leftmost key is at or before the tile's first key
        whole = whole & (j0 >= i0 + bm - 1 + offset - lb)
    return whole


def attention_bwd_program(layout: str, heads: int, heads_kv: int, dim: int, dim_v: int,
                          dtype: str, scale: float, left: int, right: int,
                          softcap: float | None, plan: AttentionBwdPlan):
    """The backward prim_func (see the module docstring). ``dK``/``dV`` are float32 with one
    slot a query head (``[B, S_kv, H, D]`` in the layout; in the storage dtype with the plan's
    ``kv_direct`` where ``heads == heads_kv``), ``dQ`` float32 and zeroed: with
    the plan's ``dq_fragment_order``, of ``S_q`` rounded up to :data:`DQ_ROW_BLOCK` rows and
    stored in :func:`dq_fragment_layout`'s order."""
    tilelang, T = tl()
    bn, bm, threads = plan.block_n, plan.block_m, plan.threads
    if plan.dq_tma and plan.dq_fragment_order:
        raise ValueError("attention_bwd_program: dq_tma adds dQ tiles in its layout, which "
                         "dq_fragment_order replaces; take one")
    if plan.overlap and not plan.sdp_async:
        raise ValueError("attention_bwd_program: overlap issues the products asynchronously, "
                         "as sdp_async does; take both")
    accum = "float32"
    groups = heads // heads_kv
    kv_dtype = dtype if plan.kv_direct and groups == 1 else accum
    batch, seq_q, seq_kv = T.dynamic("B"), T.dynamic("S_q"), T.dynamic("S_kv")
    ordered = plan.dq_fragment_order
    seq_dq = T.dynamic("S_dq") if ordered else seq_q
    offset = seq_kv - seq_q
    bshd = layout == "bshd"
    # the log-sum-exp (times log2(e) with stats_tma) and Delta of each query row: whole tiles
    # of block_m rows loaded by TMA, or rows loaded by the consumers
    stats = [batch, heads, T.dynamic("S_t"), bm] if plan.stats_tma else [batch, heads, seq_q]
    # with overlap: a thread's 32-bit registers of dP's and dQ's accumulators (dQ's product
    # splits its columns over the warpgroups)
    regs_s, regs_dq = bn * bm // threads, bm * dim // threads

    def shape(s, h, d):
        return [batch, s, h, d] if bshd else [batch, h, s, d]

    lb, rb = _bounds(seq_q, seq_kv, left, right)

    def whole_pair(j0, i0):
        return whole_tile_pair(j0, i0, seq_q, seq_kv, left, right, bn, bm)

    capped = softcap is not None
    cap_l2, cap_in = _cap_constants(scale, softcap)
    sm = _f32(scale * _LOG2E)
    log2e = _f32(_LOG2E)
    # dS0 = dS * (1 - tanh^2) under a softcap; the scale of both products folded in
    ds_scale = _f32(scale)

    def lse_of(lse_shared, i):  # row i's log-sum-exp in the base-2 exponent's units
        return lse_shared[i] if plan.stats_tma else lse_shared[i] * log2e

    @T.macro
    def make_ds(pT, dpT, qkT, delta_shared, dsT_cast, cap):  # dS^T in the storage dtype
        for j, i in T.Parallel(bn, bm):
            ds = pT[j, i] * (dpT[j, i] - delta_shared[i]) * ds_scale
            if cap:  # tanh's derivative
                ds = ds * (1.0 - qkT[j, i] * qkT[j, i])
            dsT_cast[j, i] = ds

    @T.macro
    def store_dq(dQ, dq, dq_shared, i0, by, bz):  # the step's dQ tile added into the float32 dQ
        if plan.dq_tma:  # one bulk reduce-add a step; the tensor map drops rows >= S_q
            T.copy(dq, dq_shared)
            if bshd:
                T.atomic_add(dQ[bz, i0:i0 + bm, by, :], dq_shared, annotations={"use_tma": 1})
            else:
                T.atomic_add(dQ[bz, by, i0:i0 + bm, :], dq_shared, annotations={"use_tma": 1})
        else:
            for i, d in T.Parallel(bm, dim):
                if i0 + i < seq_q:
                    if bshd:
                        T.atomic_add(dQ[bz, i0 + i, by, d], dq[i, d])
                    else:
                        T.atomic_add(dQ[bz, by, i0 + i, d], dq[i, d])

    @T.prim_func
    def main(dO: T.Tensor(shape(seq_q, heads, dim_v), dtype),
             Q: T.Tensor(shape(seq_q, heads, dim), dtype),
             K: T.Tensor(shape(seq_kv, heads_kv, dim), dtype),
             V: T.Tensor(shape(seq_kv, heads_kv, dim_v), dtype),
             LSE: T.Tensor(stats, accum),
             Delta: T.Tensor(stats, accum),
             dQ: T.Tensor(shape(seq_dq, heads, dim), accum),
             dK: T.Tensor(shape(seq_kv, heads, dim), kv_dtype),
             dV: T.Tensor(shape(seq_kv, heads, dim_v), kv_dtype)):
        with T.Kernel(T.ceildiv(seq_kv, bn), heads, batch, threads=threads) as (kx, by, bz):
            K_shared = T.alloc_shared([bn, dim], dtype)
            V_shared = T.alloc_shared([bn, dim_v], dtype)
            q_shared = T.alloc_shared([bm, dim], dtype)
            do_shared = T.alloc_shared([bm, dim_v], dtype)
            lse_shared = T.alloc_shared([bm], accum)
            delta_shared = T.alloc_shared([bm], accum)
            dsT_shared = T.alloc_shared([bn, bm], dtype)
            qkT = T.alloc_fragment([bn, bm], accum)
            pT = T.alloc_fragment([bn, bm], accum)
            dpT = T.alloc_fragment([bn, bm], accum)
            pT_cast = T.alloc_fragment([bn, bm], dtype)
            dsT_cast = T.alloc_fragment([bn, bm], dtype)
            dk = T.alloc_fragment([bn, dim], accum)
            dv = T.alloc_fragment([bn, dim_v], accum)
            dq = T.alloc_fragment([bm, dim], accum)
            # the step's dQ tile on its way to the reduce-add (with dq_tma)
            dq_shared = T.alloc_shared([bm, dim], accum) if plan.dq_tma else None
            if plan.overlap:
                touch = T.alloc_local([1], dtype)

            if ordered:
                T.annotate_layout({dQ: T.Layout(dQ.shape, dq_fragment_layout(bshd))})
            j0 = kx * bn
            hk = by // groups
            if bshd:
                T.copy(K[bz, j0:j0 + bn, hk, :], K_shared)
                T.copy(V[bz, j0:j0 + bn, hk, :], V_shared)
            else:
                T.copy(K[bz, hk, j0:j0 + bn, :], K_shared)
                T.copy(V[bz, hk, j0:j0 + bn, :], V_shared)
            T.clear(dk)
            T.clear(dv)
            start = first_query_tile(j0, seq_q, seq_kv, right, bm, T.max)
            end = query_tiles_end(j0, seq_q, seq_kv, left, right, bn, bm, T.max, T.min)

            for it in T.Pipelined(start, end, num_stages=plan.stages):
                i0 = it * bm
                if bshd:
                    T.copy(Q[bz, i0:i0 + bm, by, :], q_shared)
                    T.copy(dO[bz, i0:i0 + bm, by, :], do_shared)
                else:
                    T.copy(Q[bz, by, i0:i0 + bm, :], q_shared)
                    T.copy(dO[bz, by, i0:i0 + bm, :], do_shared)
                if plan.stats_tma:  # the query tile's row of each whole-tile buffer
                    T.copy(LSE[bz, by, it, :], lse_shared)
                    T.copy(Delta[bz, by, it, :], delta_shared)
                else:
                    # plain loads: a row of S_q float32 values is a stride TMA refuses unless
                    # S_q is a multiple of 4 (16 bytes)
                    T.copy(LSE[bz, by, i0:i0 + bm], lse_shared,
                           annotations={"disable_tma": True})
                    T.copy(Delta[bz, by, i0:i0 + bm], delta_shared,
                           annotations={"disable_tma": True})
                T.clear(qkT)
                if plan.sdp_async:  # both products in flight; the probabilities under dP's
                    T.wgmma_gemm(K_shared, q_shared, qkT, transpose_B=True,
                                 policy=T.GemmWarpPolicy.FullRow)
                    # dP's first step writes its accumulator: a clear of dP between the two
                    # issues (copies of the zero the scores' accumulator started from) made
                    # ptxas wait for the scores' product before it (C7517)
                    T.wgmma_gemm(V_shared, do_shared, dpT, transpose_B=True,
                                 policy=T.GemmWarpPolicy.FullRow, clear_accum=True)
                    T.wait_wgmma(1)
                else:
                    T.gemm(K_shared, q_shared, qkT, transpose_B=True,
                           policy=T.GemmWarpPolicy.FullRow)
                if capped:
                    for j, i in T.Parallel(bn, bm):
                        qkT[j, i] = T.tanh(qkT[j, i] * cap_in)  # t; the score is cap * t
                # the mask only where some (row, key) pair of the tiles is unseen (a causal
                # diagonal, a window's edges, the tails past S_q and S_kv): a branch the whole
                # CTA takes alike
                if whole_pair(j0, i0):
                    for j, i in T.Parallel(bn, bm):
                        s_l2 = cap_l2 * qkT[j, i] if capped else qkT[j, i] * sm
                        pT[j, i] = T.exp2(s_l2 - lse_of(lse_shared, i))
                else:
                    for j, i in T.Parallel(bn, bm):
                        key = j0 + j
                        diag = i0 + i + offset
                        seen = (key < seq_kv and i0 + i < seq_q and key >= diag - lb
                                and key <= diag + rb)
                        s_l2 = cap_l2 * qkT[j, i] if capped else qkT[j, i] * sm
                        pT[j, i] = T.if_then_else(seen, T.exp2(s_l2 - lse_of(lse_shared, i)), 0.0)
                if plan.overlap:
                    # dV's product issued as soon as the probabilities are cast (under dP's
                    # tail and dS), dQ's under dV's tail, dK's under the store of the dQ tile
                    # and its reduce-add: each waited for one product behind
                    T.copy(pT, pT_cast)
                    if capped:  # tanh's derivative folded into P now: no scores kept under dV
                        for j, i in T.Parallel(bn, bm):
                            pT[j, i] = pT[j, i] * (1.0 - qkT[j, i] * qkT[j, i])
                    T.wgmma_gemm(pT_cast, do_shared, dv, policy=T.GemmWarpPolicy.FullRow)
                    T.wait_wgmma(1)  # dP's product is done
                    T.warpgroup_fence_operand(dpT, num_regs=regs_s)
                    make_ds(pT, dpT, qkT, delta_shared, dsT_cast, False)
                    T.copy(dsT_cast, dsT_shared)
                    T.wgmma_gemm(dsT_shared, K_shared, dq, transpose_A=True, clear_accum=True)
                    T.wait_wgmma(1)  # dV's product is done
                    # dO's last use: the pipeline releases its stage after it, not when the
                    # asynchronous product was issued
                    touch[0] = do_shared[0, 0]
                    T.wgmma_gemm(dsT_cast, q_shared, dk, policy=T.GemmWarpPolicy.FullRow)
                    T.wait_wgmma(1)  # dQ's product is done
                    # dQ's registers are read after the wait, not moved above it
                    T.warpgroup_fence_operand(dq, num_regs=regs_dq)
                    store_dq(dQ, dq, dq_shared, i0, by, bz)
                    T.wait_wgmma(0)
                    touch[0] = q_shared[0, 0]  # the queries' last use, as dO's
                else:
                    if plan.sdp_async:
                        T.wait_wgmma(0)
                    else:
                        T.clear(dpT)
                        T.gemm(V_shared, do_shared, dpT, transpose_B=True,
                               policy=T.GemmWarpPolicy.FullRow)
                    T.copy(pT, pT_cast)
                    T.gemm(pT_cast, do_shared, dv, policy=T.GemmWarpPolicy.FullRow)
                    make_ds(pT, dpT, qkT, delta_shared, dsT_cast, capped)
                    T.gemm(dsT_cast, q_shared, dk, policy=T.GemmWarpPolicy.FullRow)
                    T.copy(dsT_cast, dsT_shared)
                    T.clear(dq)
                    T.gemm(dsT_shared, K_shared, dq, transpose_A=True)
                    store_dq(dQ, dq, dq_shared, i0, by, bz)

            if bshd:
                T.copy(dk, dK[bz, j0:j0 + bn, by, :])
                T.copy(dv, dV[bz, j0:j0 + bn, by, :])
            else:
                T.copy(dk, dK[bz, by, j0:j0 + bn, :])
                T.copy(dv, dV[bz, by, j0:j0 + bn, :])

    return main


def attention_bwd_dq_program(layout: str, heads: int, dim: int, dtype: str,
                             rows: int = 64, threads: int = 128):
    """``dQ_out = dQ`` in the storage dtype, from the fragment-ordered float32 ``dQ`` (its
    ``S_dq >= S_q`` rows, :func:`dq_fragment_layout`) to ``dQ_out`` in the layout: ``rows``
    query rows a CTA."""
    _, T = tl()
    batch, seq_q, seq_dq = T.dynamic("B"), T.dynamic("S_q"), T.dynamic("S_dq")
    bshd = layout == "bshd"

    def shape(s):
        return [batch, s, heads, dim] if bshd else [batch, heads, s, dim]

    @T.prim_func
    def main(dQ: T.Tensor(shape(seq_dq), "float32"), dQ_out: T.Tensor(shape(seq_q), dtype)):
        with T.Kernel(T.ceildiv(seq_q, rows), heads, batch, threads=threads) as (bx, by, bz):
            T.annotate_layout({dQ: T.Layout(dQ.shape, dq_fragment_layout(bshd))})
            for i, d in T.Parallel(rows, dim):
                row = bx * rows + i
                if row < seq_q:
                    if bshd:
                        dQ_out[bz, row, by, d] = T.cast(dQ[bz, row, by, d], dtype)
                    else:
                        dQ_out[bz, by, row, d] = T.cast(dQ[bz, by, row, d], dtype)

    return main


def attention_bwd_delta_program(layout: str, heads: int, dim_v: int, dtype: str,
                                with_dlse: bool, rows: int = 32, threads: int = 128,
                                tile: int = 0):
    """``Delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d]`` (minus ``dLSE[b, h, i]`` with
    ``with_dlse``) in float32, ``[B, H, S_q]``: ``dO`` and ``O`` read once in the storage
    dtype, ``rows`` query rows of one head a CTA.

    With ``tile`` (a multiple of ``rows``; :attr:`AttentionBwdPlan.stats_tma`) ``Delta`` and
    ``LSE2 = LSE * log2(e)`` (from the forward's ``LSE``, ``[B, H, S_q]``) are written to
    ``[B, H, S_t, tile]`` buffers, row ``i`` at ``[b, h, i // tile, i % tile]``, every row of
    the ``S_t`` tiles written (0 past ``S_q``)."""
    _, T = tl()
    f32 = "float32"
    batch, seq_q = T.dynamic("B"), T.dynamic("S_q")
    bshd = layout == "bshd"
    shape = [batch, seq_q, heads, dim_v] if bshd else [batch, heads, seq_q, dim_v]
    if tile and tile % rows:
        raise ValueError(f"attention_bwd_delta_program: tiles of {tile} rows are not whole "
                         f"CTAs of {rows}")
    seq_t = T.dynamic("S_t") if tile else None
    stats = [batch, heads, seq_t, tile] if tile else [batch, heads, seq_q]
    rows_out = seq_t * tile if tile else seq_q
    log2e = _f32(_LOG2E)

    def at(bz, by, r):
        return (bz, by, r // tile, r % tile) if tile else (bz, by, r)

    @T.macro
    def body(dO, Out, DLSE, Delta, LSE, LSE2):
        with T.Kernel(T.ceildiv(rows_out, rows), heads, batch, threads=threads) as (bx, by, bz):
            o = T.alloc_fragment([rows, dim_v], dtype)
            do = T.alloc_fragment([rows, dim_v], dtype)
            acc = T.alloc_fragment([rows, dim_v], f32)
            delta = T.alloc_fragment([rows], f32)
            r0 = bx * rows
            if bshd:
                T.copy(Out[bz, r0:r0 + rows, by, :], o)
                T.copy(dO[bz, r0:r0 + rows, by, :], do)
            else:
                T.copy(Out[bz, by, r0:r0 + rows, :], o)
                T.copy(dO[bz, by, r0:r0 + rows, :], do)
            for i, d in T.Parallel(rows, dim_v):
                acc[i, d] = T.cast(o[i, d], f32) * T.cast(do[i, d], f32)
            T.reduce_sum(acc, delta, dim=1)
            for i in T.Parallel(rows):
                r = r0 + i
                if tile:  # every row of the whole tiles; those past S_q 0
                    inside = r < seq_q
                    if with_dlse:
                        Delta[at(bz, by, r)] = T.if_then_else(
                            inside, delta[i] - DLSE[bz, by, r], 0.0)
                    else:
                        Delta[at(bz, by, r)] = T.if_then_else(inside, delta[i], 0.0)
                    LSE2[at(bz, by, r)] = T.if_then_else(inside, LSE[bz, by, r] * log2e, 0.0)
                elif r < seq_q:
                    if with_dlse:
                        Delta[bz, by, r] = delta[i] - DLSE[bz, by, r]
                    else:
                        Delta[bz, by, r] = delta[i]

    if tile and with_dlse:
        @T.prim_func
        def main(dO: T.Tensor(shape, dtype), Out: T.Tensor(shape, dtype),
                 DLSE: T.Tensor([batch, heads, seq_q], f32),
                 LSE: T.Tensor([batch, heads, seq_q], f32),
                 Delta: T.Tensor(stats, f32), LSE2: T.Tensor(stats, f32)):
            body(dO, Out, DLSE, Delta, LSE, LSE2)
    elif tile:
        @T.prim_func
        def main(dO: T.Tensor(shape, dtype), Out: T.Tensor(shape, dtype),
                 LSE: T.Tensor([batch, heads, seq_q], f32),
                 Delta: T.Tensor(stats, f32), LSE2: T.Tensor(stats, f32)):
            body(dO, Out, None, Delta, LSE, LSE2)
    elif with_dlse:
        @T.prim_func
        def main(dO: T.Tensor(shape, dtype), Out: T.Tensor(shape, dtype),
                 DLSE: T.Tensor([batch, heads, seq_q], f32),
                 Delta: T.Tensor([batch, heads, seq_q], f32)):
            body(dO, Out, DLSE, Delta, None, None)
    else:
        @T.prim_func
        def main(dO: T.Tensor(shape, dtype), Out: T.Tensor(shape, dtype),
                 Delta: T.Tensor([batch, heads, seq_q], f32)):
            body(dO, Out, None, Delta, None, None)
    return main


def bwd_program_key(spec: AttentionFwdSpec) -> tuple:
    """What the compiled backward program of ``spec`` depends on (sizes are launch-time)."""
    return (spec.layout.value, spec.heads, spec.heads_kv, spec.dim, spec.dim_v, spec.dtype,
            spec.scale, spec.window_left, spec.window_right, spec.softcap)


@stored(maxsize=128)
def build_attention_bwd(key: tuple, target: str | None = None,
                        plan: AttentionBwdPlan | None = None):
    """Compile the backward program of a :func:`bwd_program_key` (cached per key)."""
    layout, heads, heads_kv, dim, dim_v, dtype, scale, left, right, softcap = key
    plan = plan or attention_bwd_plan(dim, dim_v)
    prog = attention_bwd_program(layout, heads, heads_kv, dim, dim_v, dtype, scale, left,
                                 right, softcap, plan)
    return compile_program(prog, target)


@stored(maxsize=64)
def build_attention_bwd_dq(layout: str, heads: int, dim: int, dtype: str,
                           target: str | None = None):
    """Compile :func:`attention_bwd_dq_program` (cached per layout, heads, D and dtype)."""
    return compile_program(attention_bwd_dq_program(layout, heads, dim, dtype), target)


@stored(maxsize=64)
def build_attention_bwd_delta(layout: str, heads: int, dim_v: int, dtype: str, with_dlse: bool,
                              target: str | None = None, tile: int = 0):
    """Compile :func:`attention_bwd_delta_program` (cached per configuration)."""
    return compile_program(attention_bwd_delta_program(layout, heads, dim_v, dtype, with_dlse,
                                                       tile=tile), target)


class AttentionBwdKernel(Kernel, AttentionBwdInterface):
    """The backward of the head-dim pairs of :data:`BWD_HEAD_DIMS` on sm_80-sm_90: 32 query
    rows a step, ``dQ`` added by per-element atomics (on sm_90 :class:`AttentionBwdTmaKernel`
    is preferred)."""

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})

    @classmethod
    def region_refusal(cls, spec: AttentionFwdSpec) -> str | None:
        if (spec.dim, spec.dim_v) not in BWD_HEAD_DIMS:
            pairs = ", ".join(f"{d}/{dv}" for d, dv in sorted(BWD_HEAD_DIMS))
            return (f"head dims D = {spec.dim}, D_v = {spec.dim_v} are none of the D/D_v pairs "
                    f"the backward serves, {pairs}")
        return None

    @classmethod
    def identity(cls, spec: AttentionFwdSpec):
        return (spec.device, bwd_program_key(spec))

    #: the plan's fields this implementation sets over :func:`attention_bwd_plan`'s
    plan_fields: ClassVar[dict] = {}

    @classmethod
    def schedule(cls) -> dict:
        """The plan's fields the module's flags set for this implementation (none here)."""
        return {}

    @classmethod
    def plan(cls, spec: AttentionFwdSpec) -> AttentionBwdPlan:
        """The plan this implementation compiles for ``spec``."""
        return attention_bwd_plan(spec.dim, spec.dim_v)._replace(**cls.plan_fields,
                                                                 **cls.schedule())

    def __init__(self, spec: AttentionFwdSpec) -> None:
        super().__init__(spec)
        key = bwd_program_key(spec)
        plan = self.plan(spec)
        self.dq_fragment_order = plan.dq_fragment_order
        if self.dq_fragment_order:
            self._dq_program = build_attention_bwd_dq(key[0], spec.heads, spec.dim,
                                                      spec.dtype)
        self.program = build_attention_bwd(key, plan=plan if self.plan_fields else None)
        self._bshd = spec.layout is AttentionLayout.BSHD
        self._groups = spec.heads // spec.heads_kv
        self._kv_direct = plan.kv_direct and self._groups == 1
        # with stats_tma: the log-sum-exp and Delta in whole tiles of this many rows
        self._stats_tile = plan.block_m if plan.stats_tma else 0
        self._delta = {}
        if plan.delta_program or plan.stats_tma:  # with and without the lse's gradient
            for with_dlse in (False, True):
                self._delta[with_dlse] = build_attention_bwd_delta(
                    key[0], spec.heads, spec.dim_v, spec.dtype, with_dlse,
                    tile=self._stats_tile)

    def __call__(self, dout, q, k, v, o, lse, dlse, dq, dk, dv) -> None:
        import torch

        if not q.numel() or not k.numel():  # no row or no key: no gradient flows
            dq.zero_()
            dk.zero_()
            dv.zero_()
            return
        bshd = self._bshd
        b = q.shape[0]
        h = q.shape[2] if bshd else q.shape[1]
        s_kv = k.shape[1] if bshd else k.shape[2]
        # the log-sum-exp's gradient (d lse / d s = P) joins the scores' through delta
        tile = self._stats_tile
        if tile:  # both in whole tiles of rows, the log-sum-exp times log2(e)
            stats = (b, h, -(-lse.shape[-1] // tile), tile)
            delta = torch.empty(stats, dtype=torch.float32, device=q.device)
            lse2 = torch.empty(stats, dtype=torch.float32, device=q.device)
            if dlse is not None:
                self._delta[True](dout, o, dlse.contiguous(), lse, delta, lse2)
            else:
                self._delta[False](dout, o, lse, delta, lse2)
            lse = lse2
        elif self._delta:
            delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
            if dlse is not None:
                self._delta[True](dout, o, dlse.contiguous(), delta)
            else:
                self._delta[False](dout, o, delta)
        else:
            delta = (dout.float() * o.float()).sum(-1)
            delta = delta.transpose(1, 2) if bshd else delta
            delta = (delta - dlse if dlse is not None else delta).contiguous()
        dq_shape = list(q.shape)
        if self.dq_fragment_order:  # whole blocks of rows, stored in the fragment's order
            s_axis = 1 if bshd else 2
            dq_shape[s_axis] = -(-dq_shape[s_axis] // DQ_ROW_BLOCK) * DQ_ROW_BLOCK
        dq_acc = torch.zeros(dq_shape, dtype=torch.float32, device=q.device)
        if self._kv_direct:  # written in the storage dtype by the program
            self.program(dout, q, k, v, lse, delta, dq_acc, dk, dv)
        else:
            d_kv = (b, s_kv, h) if bshd else (b, h, s_kv)
            dk_part = torch.empty(*d_kv, k.shape[-1], dtype=torch.float32, device=q.device)
            dv_part = torch.empty(*d_kv, v.shape[-1], dtype=torch.float32, device=q.device)
            self.program(dout, q, k, v, lse, delta, dq_acc, dk_part, dv_part)
        if self.dq_fragment_order:
            self._dq_program(dq_acc, dq)
        else:
            dq.copy_(dq_acc)
        if self._kv_direct:
            return
        g = self._groups
        head_axis = 2 if bshd else 1
        for part, out in ((dk_part, dk), (dv_part, dv)):
            if g > 1:  # the query heads of a group are adjacent: h = h_kv * g + j
                shape = list(part.shape)
                shape[head_axis:head_axis + 1] = [shape[head_axis] // g, g]
                part = part.view(shape).sum(head_axis + 1)
            out.copy_(part)


class AttentionBwdFragmentKernel(AttentionBwdKernel):
    """The backward with the fragment-ordered ``dQ`` (:class:`AttentionBwdPlan`'s
    ``dq_fragment_order``) and its second program writing ``dq``. Not among the ops' default
    implementations until it is measured: a ``kernel_map`` or the sweep picks it."""

    plan_fields: ClassVar[dict] = {"dq_fragment_order": True}

    @classmethod
    def identity(cls, spec: AttentionFwdSpec):
        return (spec.device, bwd_program_key(spec), "dq_fragment_order")


class AttentionBwdTmaKernel(AttentionBwdKernel):
    """The backward at 64 query rows a step, each step's ``dQ`` tile added by one TMA
    reduce-add, the scores' and ``dP``'s products in flight together, ``dK``/``dV`` written in
    the storage dtype where no group is reduced and ``Delta`` from its own program
    (:class:`AttentionBwdPlan`'s ``dq_tma``, ``sdp_async``, ``kv_direct`` and
    ``delta_program``; sm_90). The ops' backward on sm_90, where it is preferred over
    :class:`AttentionBwdKernel` (1.4-1.9x its rate on the H200 at the backward sweep's
    shapes, ``benchmarks/results``). Its schedule is the module's flags' (:data:`STATS_TMA`,
    :data:`OVERLAP`) when a program is built, part of the identity."""

    supported_archs = frozenset({(9, 0)})
    preferred_over = (AttentionBwdKernel,)
    plan_fields: ClassVar[dict] = {"block_m": 64, "dq_tma": True, "sdp_async": True,
                                   "kv_direct": True, "delta_program": True}

    @classmethod
    def schedule(cls) -> dict:
        """The module's flags: :data:`STATS_TMA` and :data:`OVERLAP`, read when a program is
        built (a program of its own each)."""
        return {"stats_tma": STATS_TMA, "overlap": OVERLAP}

    @classmethod
    def identity(cls, spec: AttentionFwdSpec):
        return (spec.device, bwd_program_key(spec), "dq_tma", *cls.schedule().values())
