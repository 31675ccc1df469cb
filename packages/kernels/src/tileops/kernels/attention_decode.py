"""Decode attention over a KV cache (one query token a sequence), contiguous or paged, in
TileLang: split-KV flash decoding with a combine step.

A call is ``q`` ``(B, H, D)``, the cache ``k``/``v`` (contiguous ``(B, S, H_kv, D)``, or paged
``(P, page_size, H_kv, D)`` with an int32 block table ``(B, max_pages)``), int32 lengths ``(B,)``
and the output ``o`` ``(B, H, D)``. Everything but the values is compiled in (a batch size is
its own program, as a serving engine's CUDA graphs are per batch size).

The program, per CTA: one sequence ``b``, one block of ``vh`` query heads sharing a key head
(all ``H / H_kv`` of a group, up to 64), one of ``num_split`` parts of the sequence's keys:

1. ``q`` rows in shared memory, padded with zero rows to ``block_h`` >= 16, the MMA's M (the
   padded rows' scores are computed and never stored: decode reads each key once whatever the
   M, and an M of 16 wastes least of the tensor cores).
2. The sequence's ``ceil(L / block_n)`` key tiles are shared by the splits, ``ceil(tiles /
   num_split)`` each. A split's whole tiles run through a software pipeline: TileLang
   specializes a producer warpgroup issuing TMA loads of K and V (``stages`` tiles in
   flight; a paged tile page by page, at the page the block table names) while the 128
   math threads run an online-softmax step a tile: ``s = q K^T`` (``T.gemm``, fp32), scaled
   into the log2 domain (capped first where softcap is given), the running max and sum
   rescaled, ``p`` stored to shared memory in the storage dtype and ``o += p V``.
3. The tail tile (``L % block_n`` keys, in the split holding it) is loaded element by element
   into buffers of its own (the pipeline's are staged; TileLang places the two in the same
   shared memory, used one after the other), the keys past ``L`` zero-filled, K and V alike,
   and masked to ``-inf``: a cache holds anything past a sequence's length (freed pages,
   uninitialised memory, NaN), and ``0 * NaN`` in ``p V`` would poison the row.
4. One split writes ``o = acc / l`` (0 where the sequence is empty); several write fp32 partial
   outputs and their log2-sum-exp (-inf for a split with no keys), and a combine kernel (one CTA
   a query head) weighs the parts by ``exp2(lse_s - max lse)``: 0 for a sequence with no keys.

What the kernels require of the data (the ``reference`` target checks it and refuses by name):
``0 <= L <= S`` (contiguous) or ``max_pages * page_size`` (paged), and the block table's first
``ceil(L / page_size)`` entries of row ``b`` are pages of the pool; later entries are never
read. Checking data on the host would synchronise every call (and cannot run inside a CUDA
graph), so the kernels check it where they read it: a length is clamped to the capacity and a
page number into the pool (no read outside the cache), and the sequence's output is NaN, every
head of it, so that bad data never passes for an answer. A CTA checks its own length and the
pages its split reads; a split that found bad data writes a NaN part with a log2-sum-exp of
``+inf``, which the combine's weights turn into NaN (``exp2(inf - inf)``).

How many splits (:func:`decode_plan`, a pure function): the CTAs of one split, ``B * H /
vh``, against the slots of the GPU (its SMs times the CTAs an SM holds by shared memory), the
split count the smallest that brings the last wave to within 10% of the best of 1 to
``_MAX_SPLIT`` splits (FlashAttention's heuristic over slots rather than SMs: decode CTAs are
memory-bound and several share an SM).
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from tileops.runtime import CallSpec, Kernel, KernelInterface

from ._store import stored
from ._tilelang import compile_program, tl

__all__ = [
    "AttentionDecodeDType",
    "AttentionDecodeInterface",
    "AttentionDecodeSpec",
    "AttentionDecodeSplitKernel",
    "CacheLayout",
    "DecodePlan",
    "build_decode",
    "decode_plan",
    "decode_program",
]

#: the storage dtypes the decode kernels are written for
AttentionDecodeDType = Literal["float16", "bfloat16"]
_DTYPES = frozenset(get_args(AttentionDecodeDType))
_LOG2E = 1.4426950408889634
#: the MMA's smallest M, and the most query heads one CTA holds
_MIN_BLOCK_H, _MAX_BLOCK_H = 16, 64
_THREADS = 128
#: shared memory an SM of an H100/H200 gives its CTAs, and the CTAs counted an SM at most
_SMEM_PER_SM, _MAX_RESIDENT = 227 * 1024, 4
_MAX_SPLIT = 32
#: 32-bit registers of an SM
_REGISTERS = 65536
#: a split count is taken once its last wave is within this fraction of the best
_WAVE_SLACK = 0.9
_SMS_H200 = 132
#: the columns of a tile one copy of part of a page fills (128 bytes of 16-bit values)
_PIECE = 64


class CacheLayout(enum.Enum):
    """How the KV cache is laid out."""

    CONTIGUOUS = "contiguous"  #: (B, S, H_kv, D): sequence b's keys at [b, :L]
    PAGED = "paged"  #: (P, page_size, H_kv, D) pages, a block table (B, max_pages)


class AttentionDecodeSpec(CallSpec, frozen=True, kw_only=True):
    """What a decode implementation is told about a call. ``capacity`` is ``S`` (contiguous)
    or the pool's page count ``P`` (paged); ``page_size`` and ``max_pages`` are 0 for a
    contiguous cache (a block table of no columns has ``max_pages`` 0 too). ``scale`` is resolved (1 / sqrt(D) where the op's is None)."""

    layout: CacheLayout
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    capacity: int
    page_size: int
    max_pages: int
    dtype: AttentionDecodeDType
    scale: float
    softcap: float | None

    def __post_init__(self) -> None:
        self.check_fields(choices={"dtype": _DTYPES},
                          sizes=("batch", "heads", "kv_heads", "head_dim", "capacity",
                                 "page_size", "max_pages"))
        name = type(self).__name__
        if not isinstance(self.layout, CacheLayout):
            raise TypeError(f"{name}.layout must be a CacheLayout, got {self.layout!r}")
        if self.kv_heads == 0 or self.heads % self.kv_heads:
            raise ValueError(f"{name}: heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads}) > 0")
        paged = self.layout is CacheLayout.PAGED
        if paged != (self.page_size > 0) or (not paged and self.max_pages):
            raise ValueError(f"{name}: page_size is > 0 exactly for a paged cache and "
                             f"max_pages 0 for a contiguous one, got {self.page_size} and "
                             f"{self.max_pages} for {self.layout.value}")
        if not self.scale > 0 or (self.softcap is not None and not self.softcap > 0):
            raise ValueError(f"{name}: scale and softcap must be > 0, got {self.scale} and "
                             f"{self.softcap}")

    @property
    def max_keys(self) -> int:
        """The most keys a sequence may have: ``S``, or ``max_pages * page_size``."""
        if self.layout is CacheLayout.PAGED:
            return self.max_pages * self.page_size
        return self.capacity


class AttentionDecodeInterface(KernelInterface):
    """One slot: ``forward(q, k, v, cache_seqlens, block_table, o)``, every tensor contiguous,
    ``block_table`` None for a contiguous cache."""

    slot = "attention_decode_fwd"
    call_spec = AttentionDecodeSpec


# --- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodePlan:
    """A program's launch facts: ``vh`` query heads a CTA (padded to ``block_h`` MMA rows),
    ``block_n`` keys a tile, ``stages`` tiles in flight, ``num_split`` parts of each
    sequence's keys, and the CTAs an SM is to hold (``resident``: registers are capped for
    them)."""

    vh: int
    block_h: int
    block_n: int
    stages: int
    num_split: int
    resident: int = 1

    def smem_bytes(self, head_dim: int, itemsize: int = 2) -> int:
        """Shared memory of a CTA: the K and V stages, q and p."""
        return itemsize * (2 * self.stages * self.block_n * head_dim
                           + self.block_h * head_dim + self.block_h * self.block_n)


def _head_block(groups: int) -> int:
    """The query heads of one CTA: the whole group up to 64, else the largest divisor of the
    group that is at most 64 (every CTA's heads share one key head)."""
    return max(d for d in range(1, min(groups, _MAX_BLOCK_H) + 1) if groups % d == 0)


def split_count(ctas: int, tiles: int, slots: int) -> int:
    """The parts each sequence's ``tiles`` key tiles are split into, given ``ctas`` CTAs a
    part and ``slots`` CTAs the GPU holds at once: for each count ``s`` from 1 to
    ``min(_MAX_SPLIT, tiles)`` that changes the tiles a part has, the last wave's fill
    ``w / ceil(w)`` with ``w = ctas * s / slots``; the smallest count within
    :data:`_WAVE_SLACK` of the best fill."""
    if ctas <= 0 or tiles <= 1 or slots <= 0:
        return 1
    fills: dict[int, float] = {}
    for s in range(1, min(_MAX_SPLIT, tiles) + 1):
        if s > 1 and -(-tiles // s) == -(-tiles // (s - 1)):
            continue  # as many tiles a part as one split fewer: a part left empty
        w = ctas * s / slots
        fills[s] = w / math.ceil(w)
    best = max(fills.values())
    return min(s for s, f in fills.items() if f >= _WAVE_SLACK * best)


def _block_n(head_dim: int) -> int:
    """Keys a tile: 64 for heads up to 128 wide, 32 for wider (the K and V stages' shared
    memory)."""
    return 64 if head_dim <= 128 else 32


def decode_plan(*, batch: int, heads: int, kv_heads: int, head_dim: int, max_keys: int,
                page_size: int = 0, sms: int = _SMS_H200) -> DecodePlan:
    """The launch plan of a call (see the module docstring): a pure function of the sizes and
    the SM count. ``block_n`` is 64 keys for heads up to 128 wide (32 for wider), whatever the
    page: page sizes are powers of two from 16, so a tile lies inside one page or is 2 or 4
    whole pages (``page_size`` only checks that). The CTAs an SM holds are bounded by shared
    memory, registers (each of the two warpgroups at its math threads' estimate) and
    :data:`_MAX_RESIDENT`."""
    vh = _head_block(heads // kv_heads)
    block_h = max(_MIN_BLOCK_H, 1 << (vh - 1).bit_length())
    block_n = _block_n(head_dim)
    stages = 2
    if page_size and block_n % page_size and page_size % block_n:
        raise ValueError(f"decode_plan: pages of {page_size} tokens do not tile by {block_n}")
    plan = DecodePlan(vh, block_h, block_n, stages, 1)
    # a math thread holds its share of the scores and the output, and about 56 registers
    # more; the producer warpgroup gets as many (the registers are split evenly)
    regs = (block_h * head_dim + block_h * block_n) // _THREADS + 56
    by_regs = _REGISTERS // (2 * _THREADS * regs)
    resident = max(1, min(_MAX_RESIDENT, _SMEM_PER_SM // plan.smem_bytes(head_dim), by_regs))
    ctas = batch * (heads // vh)
    tiles = -(-max_keys // block_n)
    return DecodePlan(vh, block_h, block_n, stages, split_count(ctas, tiles, sms * resident),
                      resident)


# --- the TileLang program ----------------------------------------------------------------------


def decode_program(spec: AttentionDecodeSpec, plan: DecodePlan):
    """The TileLang prim_func (not compiled) of ``spec`` under ``plan``. Its arguments: ``Q, K,
    V, Lens`` (the lengths), ``BT`` (paged only), ``Out``, and with ``plan.num_split > 1`` the fp32
    partial outputs ``(B, H, num_split, D)`` and log2-sum-exps ``(B, H, num_split)``."""
    _, T = tl()
    paged = spec.layout is CacheLayout.PAGED
    B, H, HK, D = spec.batch, spec.heads, spec.kv_heads, spec.head_dim
    dtype, accum = spec.dtype, "float32"
    vh, bh, bn, stages, nsplit = (plan.vh, plan.block_h, plan.block_n, plan.stages,
                                  plan.num_split)
    resident = plan.resident
    per_kv = (H // HK) // vh  # head blocks a key head
    cap = spec.max_keys
    ps, mp, pool = spec.page_size, spec.max_pages, spec.capacity
    # a full tile's keys come in `chunks` copies of `chunk` rows, each inside one page
    chunk = min(ps, bn) if paged else bn
    chunks = bn // chunk
    if bn % chunk or chunks not in (1, 2, 4):
        raise ValueError(f"decode_program: a tile of {bn} keys is not 1, 2 or 4 pages of "
                         f"{ps}")
    # a tile of several pages is copied page by page and, in the swizzled layout, 64 columns
    # (128 bytes) at a time: a block of rows across the whole width is not contiguous there
    piece = D if chunks == 1 else _PIECE
    pieces = D // piece
    if D % piece or pieces not in (1, 2, 4):
        raise ValueError(f"decode_program: a head of {D} is not 1, 2 or 4 pieces of {piece} "
                         f"columns")
    kv_shape = (pool, ps, HK, D) if paged else (B, spec.capacity, HK, D)
    softcap = spec.softcap
    # scores into the log2 domain: s * scale * log2(e), or softcap * tanh(s * scale / softcap)
    # * log2(e)
    qk_scale = spec.scale * _LOG2E if softcap is None else spec.scale / softcap
    cap_scale = 0.0 if softcap is None else softcap * _LOG2E
    neg_inf = -T.infinity(accum)
    nan = T.cast(float("nan"), accum)

    def page_at(BT, b, key):
        """The pool page holding key ``key`` of sequence ``b``: the block table's entry,
        column and page clamped into the table and the pool."""
        return T.max(T.min(BT[b, T.min(key // ps, mp - 1)], pool - 1), 0)

    @T.macro
    def load_piece(K, V, BT, K_s, V_s, b, g, key0, c, col):
        # rows [c * chunk, (c + 1) * chunk) of a paged tile (one page's), columns [col, col +
        # piece): a piece of the swizzled tile that is contiguous in shared memory, as a TMA
        # copy's destination must be
        T.copy(K[page_at(BT, b, key0 + c * chunk), (key0 + c * chunk) % ps:
                 (key0 + c * chunk) % ps + chunk, g, col:col + piece],
               K_s[c * chunk:(c + 1) * chunk, col:col + piece])
        T.copy(V[page_at(BT, b, key0 + c * chunk), (key0 + c * chunk) % ps:
                 (key0 + c * chunk) % ps + chunk, g, col:col + piece],
               V_s[c * chunk:(c + 1) * chunk, col:col + piece])

    @T.macro
    def load_chunk(K, V, BT, K_s, V_s, b, g, key0, c):
        # the copies are written out (a loop over them would not be pipelined)
        load_piece(K, V, BT, K_s, V_s, b, g, key0, c, 0)
        if pieces > 1:
            load_piece(K, V, BT, K_s, V_s, b, g, key0, c, piece)
        if pieces > 2:
            load_piece(K, V, BT, K_s, V_s, b, g, key0, c, 2 * piece)
            load_piece(K, V, BT, K_s, V_s, b, g, key0, c, 3 * piece)

    @T.macro
    def load_tile(K, V, BT, K_s, V_s, b, g, key0):
        # a whole tile, by asynchronous copies (pipelined); a paged tile page by page
        if paged:
            load_chunk(K, V, BT, K_s, V_s, b, g, key0, 0)
            if chunks > 1:
                load_chunk(K, V, BT, K_s, V_s, b, g, key0, 1)
            if chunks > 2:
                load_chunk(K, V, BT, K_s, V_s, b, g, key0, 2)
                load_chunk(K, V, BT, K_s, V_s, b, g, key0, 3)
        else:
            T.copy(K[b, key0:key0 + bn, g, :], K_s)
            T.copy(V[b, key0:key0 + bn, g, :], V_s)

    @T.macro
    def load_tail(K, V, BT, K_t, V_t, b, g, key0, length):
        # the tail tile element by element, keys past the length zero-filled, K and V alike
        for j, d in T.Parallel(bn, D):
            if paged:
                K_t[j, d] = T.if_then_else(
                    key0 + j < length, K[page_at(BT, b, key0 + j), (key0 + j) % ps, g, d],
                    T.cast(0, dtype))
                V_t[j, d] = T.if_then_else(
                    key0 + j < length, V[page_at(BT, b, key0 + j), (key0 + j) % ps, g, d],
                    T.cast(0, dtype))
            else:
                K_t[j, d] = T.if_then_else(key0 + j < length, K[b, key0 + j, g, d],
                                           T.cast(0, dtype))
                V_t[j, d] = T.if_then_else(key0 + j < length, V[b, key0 + j, g, d],
                                           T.cast(0, dtype))

    @T.macro
    def softmax_step(Q_s, K_s, V_s, P_s, acc_s, acc_o, m, m_prev, alpha, rowsum, l_sum, key0,
                     length, masked):
        # one tile of keys: scores into the log2 domain (keys past the length at -inf where
        # `masked`), the running max and sum rescaled, o += p V
        T.clear(acc_s)
        T.gemm(Q_s, K_s, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullCol)
        for i, j in T.Parallel(bh, bn):
            if softcap is None:
                acc_s[i, j] = acc_s[i, j] * qk_scale
            else:
                acc_s[i, j] = T.tanh(acc_s[i, j] * qk_scale) * cap_scale
            if masked:
                acc_s[i, j] = T.if_then_else(key0 + j < length, acc_s[i, j], neg_inf)
        T.copy(m, m_prev)
        T.reduce_max(acc_s, m, dim=1, clear=False)
        for i in T.Parallel(bh):
            alpha[i] = T.exp2(m_prev[i] - m[i])
        for i, j in T.Parallel(bh, bn):
            acc_s[i, j] = T.exp2(acc_s[i, j] - m[i])
        T.reduce_sum(acc_s, rowsum, dim=1)
        for i in T.Parallel(bh):
            l_sum[i] = l_sum[i] * alpha[i] + rowsum[i]
        for i, d in T.Parallel(bh, D):
            acc_o[i, d] *= alpha[i]
        T.copy(acc_s, P_s)
        T.gemm(P_s, V_s, acc_o, policy=T.GemmWarpPolicy.FullCol)

    @T.macro
    def attend(Q, K, V, Lens, BT, Out, O_part, LSE):
        with T.Kernel(H // vh, B, nsplit, threads=_THREADS) as (hx, bx, sx):
            # several CTAs an SM: the registers split evenly between the producer and the
            # math warpgroups, capped for `resident` CTAs (TileLang's default gives the math
            # warpgroup 240 a thread, one CTA an SM)
            T.disable_warp_group_reg_alloc()
            if resident > 1:
                T.annotate_min_blocks_per_sm(resident)
            Q_s = T.alloc_shared((bh, D), dtype)
            K_s = T.alloc_shared((bn, D), dtype)
            V_s = T.alloc_shared((bn, D), dtype)
            K_t = T.alloc_shared((bn, D), dtype)
            V_t = T.alloc_shared((bn, D), dtype)
            P_s = T.alloc_shared((bh, bn), dtype)
            acc_s = T.alloc_fragment((bh, bn), accum)
            acc_o = T.alloc_fragment((bh, D), accum)
            m = T.alloc_fragment((bh,), accum)
            m_prev = T.alloc_fragment((bh,), accum)
            alpha = T.alloc_fragment((bh,), accum)
            rowsum = T.alloc_fragment((bh,), accum)
            l_sum = T.alloc_fragment((bh,), accum)
            len_ = T.alloc_local((1,), "int32")
            bad = T.alloc_local((1,), "int32")  # 1: this sequence's data breaks the contract
            # (read from Lens, not len_: TileLang may hoist len_'s clamp above the check)
            bad[0] = T.if_then_else((Lens[bx] < 0) | (Lens[bx] > cap), 1, 0)
            len_[0] = T.max(T.min(Lens[bx], cap), 0)
            length = len_[0]
            g = hx // per_kv
            h0 = hx * vh
            for i, d in T.Parallel(bh, D):
                Q_s[i, d] = T.if_then_else(i < vh, Q[bx, T.min(h0 + i, H - 1), d],
                                           T.cast(0, dtype))
            T.fill(acc_o, 0)
            T.fill(l_sum, 0)
            T.fill(m, neg_inf)
            tiles = T.ceildiv(length, bn)
            per_split = T.ceildiv(tiles, nsplit)
            t0 = T.min(sx * per_split, tiles)
            t1 = T.min(t0 + per_split, tiles)
            full_end = T.max(T.min(t1, length // bn), t0)
            if paged:  # the pages this split reads, each a page of the pool
                p0 = (t0 * bn) // ps
                for j in T.serial(T.max(T.ceildiv(T.min(t1 * bn, length), ps) - p0, 0)):
                    page = BT[bx, T.min(p0 + j, mp - 1)]
                    if (page < 0) | (page >= pool):
                        bad[0] = 1
            for k in T.Pipelined(full_end - t0, num_stages=stages):
                load_tile(K, V, BT, K_s, V_s, bx, g, (t0 + k) * bn)
                softmax_step(Q_s, K_s, V_s, P_s, acc_s, acc_o, m, m_prev, alpha, rowsum, l_sum,
                             (t0 + k) * bn, length, False)
            if full_end < t1:  # the tail tile, in buffers of its own (the pipeline's are staged)
                load_tail(K, V, BT, K_t, V_t, bx, g, full_end * bn, length)
                softmax_step(Q_s, K_t, V_t, P_s, acc_s, acc_o, m, m_prev, alpha, rowsum, l_sum,
                             full_end * bn, length, True)
            if nsplit == 1:
                for i, d in T.Parallel(bh, D):
                    if i < vh:
                        Out[bx, h0 + i, d] = T.if_then_else(bad[0] > 0, nan, T.if_then_else(
                            l_sum[i] > 0, acc_o[i, d] / l_sum[i], T.cast(0, accum))).astype(dtype)
            else:
                for i, d in T.Parallel(bh, D):
                    if i < vh:
                        O_part[bx, h0 + i, sx, d] = T.if_then_else(bad[0] > 0, nan, T.if_then_else(
                            l_sum[i] > 0, acc_o[i, d] / l_sum[i], T.cast(0, accum)))
                for i in T.Parallel(bh):
                    if i < vh:
                        LSE[bx, h0 + i, sx] = T.if_then_else(bad[0] > 0, -neg_inf, T.if_then_else(
                            l_sum[i] > 0, T.log2(l_sum[i]) + m[i], neg_inf))

    @T.macro
    def combine(O_part, LSE, Out):
        with T.Kernel(H, B, threads=_THREADS) as (hx, bx):
            top = T.alloc_local((1,), accum)
            total = T.alloc_local((1,), accum)
            w = T.alloc_local((1,), accum)
            acc = T.alloc_fragment((D,), accum)
            top[0] = neg_inf
            for s in T.serial(nsplit):
                top[0] = T.max(top[0], LSE[bx, hx, s])
            total[0] = 0
            T.fill(acc, 0)
            if top[0] > neg_inf:
                for s in T.serial(nsplit):
                    w[0] = T.exp2(LSE[bx, hx, s] - top[0])
                    total[0] += w[0]
                    for d in T.Parallel(D):
                        acc[d] += O_part[bx, hx, s, d] * w[0]
                for d in T.Parallel(D):
                    Out[bx, hx, d] = (acc[d] / total[0]).astype(dtype)
            else:  # a sequence with no keys
                for d in T.Parallel(D):
                    Out[bx, hx, d] = T.cast(0, dtype)

    q_shape, o_shape = (B, H, D), (B, H, D)
    part_shape, lse_shape = (B, H, nsplit, D), (B, H, nsplit)
    if paged and nsplit > 1:
        @T.prim_func
        def main(Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype),
                 V: T.Tensor(kv_shape, dtype), Lens: T.Tensor((B,), "int32"),
                 BT: T.Tensor((B, mp), "int32"), Out: T.Tensor(o_shape, dtype),
                 O_part: T.Tensor(part_shape, accum), LSE: T.Tensor(lse_shape, accum)):
            attend(Q, K, V, Lens, BT, Out, O_part, LSE)
            combine(O_part, LSE, Out)
    elif paged:
        @T.prim_func
        def main(Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype),
                 V: T.Tensor(kv_shape, dtype), Lens: T.Tensor((B,), "int32"),
                 BT: T.Tensor((B, mp), "int32"), Out: T.Tensor(o_shape, dtype)):
            attend(Q, K, V, Lens, BT, Out, None, None)
    elif nsplit > 1:
        @T.prim_func
        def main(Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype),
                 V: T.Tensor(kv_shape, dtype), Lens: T.Tensor((B,), "int32"),
                 Out: T.Tensor(o_shape, dtype), O_part: T.Tensor(part_shape, accum),
                 LSE: T.Tensor(lse_shape, accum)):
            attend(Q, K, V, Lens, None, Out, O_part, LSE)
            combine(O_part, LSE, Out)
    else:
        @T.prim_func
        def main(Q: T.Tensor(q_shape, dtype), K: T.Tensor(kv_shape, dtype),
                 V: T.Tensor(kv_shape, dtype), Lens: T.Tensor((B,), "int32"),
                 Out: T.Tensor(o_shape, dtype)):
            attend(Q, K, V, Lens, None, Out, None, None)

    return main


@stored(maxsize=128)
def build_decode(spec: AttentionDecodeSpec, plan: DecodePlan, target: str | None = None):
    """Compile the program of ``spec`` under ``plan`` (cached per configuration); ``target``
    an arch such as ``"sm_90a"``, None for the current device."""
    return compile_program(decode_program(spec, plan), target)


# --- the implementation ------------------------------------------------------------------------

#: head widths the program serves: multiples of 32 (``o += p V`` spreads the width over the four
#: math warps, 8 columns of the MMA at a time), K and V tiles in shared memory up to 256
_MAX_HEAD_DIM = 256


class AttentionDecodeSplitKernel(Kernel, AttentionDecodeInterface):
    """Any decode call in float16 or bfloat16 with a head width a multiple of 32 up to 256:
    the split-KV program of :func:`decode_program` under :func:`decode_plan` (the split from
    the device's SM count)."""

    devices = ("cuda",)
    #: Hopper: the whole tiles load by TMA (TileLang's cp.async pipeline for earlier GPUs does not
    #: lower a loop whose trip count is a sequence's length)
    supported_archs = frozenset({(9, 0)})
    general = True

    @classmethod
    def region_refusal(cls, spec: AttentionDecodeSpec) -> str | None:
        if spec.head_dim % 32 or spec.head_dim > _MAX_HEAD_DIM:
            return (f"serves head widths that are multiples of 32 up to {_MAX_HEAD_DIM}, not "
                    f"{spec.head_dim}")
        if spec.page_size and spec.page_size < _block_n(spec.head_dim) and \
                spec.head_dim % _PIECE:
            return (f"serves pages shorter than a tile ({spec.page_size} < "
                    f"{_block_n(spec.head_dim)} keys) for head widths that are multiples of "
                    f"{_PIECE}, not {spec.head_dim}")
        return None

    @classmethod
    def identity(cls, spec: AttentionDecodeSpec):
        return (spec, _sms(spec.device))

    def __init__(self, spec: AttentionDecodeSpec, plan: DecodePlan | None = None) -> None:
        """``plan`` overrides :func:`decode_plan` (the GPU tests run several splits)."""
        super().__init__(spec)
        self.plan = plan or decode_plan(
            batch=spec.batch, heads=spec.heads, kv_heads=spec.kv_heads,
            head_dim=spec.head_dim, max_keys=spec.max_keys, page_size=spec.page_size,
            sms=_sms(spec.device))
        empty = spec.batch == 0 or spec.heads == 0 or spec.head_dim == 0 or spec.max_keys == 0
        self.program = None if empty else build_decode(spec, self.plan)
        self._paged = spec.layout is CacheLayout.PAGED

    def __call__(self, q, k, v, cache_seqlens, block_table, o) -> None:
        if self.program is None:  # nothing to read: every sequence is empty
            o.zero_()
            return
        args = [q, k, v, cache_seqlens]
        if self._paged:
            args.append(block_table)
        args.append(o)
        n = self.plan.num_split
        if n > 1:
            b, h, d = q.shape
            args.append(torch.empty((b, h, n, d), dtype=torch.float32, device=q.device))
            args.append(torch.empty((b, h, n), dtype=torch.float32, device=q.device))
        self.program(*args)


def _sms(device) -> int:
    """The SM count of a CUDA device (the plan's), the H200's elsewhere."""
    if getattr(device, "type", None) != "cuda":
        return _SMS_H200
    return torch.cuda.get_device_properties(device).multi_processor_count
