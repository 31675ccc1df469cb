"""Prefill attention forward in TileLang: FlashAttention's online softmax over key tiles.

One CTA computes one tile of ``block_m`` query rows of one query head of one batch entry: it
holds the rows' queries in shared memory and walks the key tiles the mask lets the tile see
(``T.Pipelined`` over ``block_n`` keys a step, the next tile's keys and values copied while the
current one computes), keeping in registers the rows' running maximum, their sum of
exponentials and the unnormalized output. The pattern is TileLang's
``examples/flash_attention/example_gqa_fwd_bshd.py`` (128 x 128 tiles, two stages, 256 threads
for head dims up to 128), with what the ops need beyond it:

- the mask is bottom-right aligned (row ``i`` at key position ``i + S_kv - S_q``) and bounded
  on either side by the window (``is_causal`` is a right bound of 0): the key-tile loop starts
  and stops at the first and last tile any row of the CTA sees, and the scores outside a row's
  window or past ``S_kv`` are set to -inf after the product (not added before it: a
  selection, so no key tile's contents, in bounds or not, can reach a masked score);
- the running maximum used in the exponent is 0 while a row has seen no key (FlashAttention's
  ``Check_inf``), so a row that sees no key accumulates nothing, is written 0 and its
  log-sum-exp -inf, instead of 0 / 0;
- only the key tiles some row sees in part (a causal diagonal, a window's edges, the tail
  past ``S_kv``) are masked: the tiles every row of the CTA sees whole
  (:func:`full_key_tiles`) skip the select, a branch the CTA takes alike;
- the scores' scale is folded into the base-2 exponent (one FFMA an element); with a softcap
  the scores are replaced by ``softcap * log2(e) * tanh(scale * s / softcap)`` first, and the
  exponent's factor is 1;
- the log-sum-exp (natural log) of each row is written to a ``[B, H, S_q]`` float32 tensor;
- grouped-query heads: query head ``h`` reads key/value head ``h // (H / H_kv)``;
- either layout, ``[B, S, H, D]`` or ``[B, H, S, D]``, read and written in place;
- causal CTAs are launched longest first (the query tiles in reverse), so the short diagonal
  tiles fill the tail of the grid;
- with :data:`OVERLAP` (on; its first form, whose products ptxas serialized, ran 9-16%
  slower than the plain program on an H100, the form below 0-5% faster) each step issues key
  tile ``j``'s scores product and then tile ``j - 1``'s output product and leaves both in
  flight: the output
  product runs under tile ``j``'s softmax, and the accumulator's rescale and the
  probabilities' cast wait for it (FlashAttention-3's intra-warpgroup overlap). TileLang's
  pipeline releases a key or value stage after the stage's last use in the step, so each
  stage is read once more after its product's wait: released when its product issues, the
  load two steps on could overwrite it under the product;
- with :data:`TURNS` as well (on: the served schedule, 5% above the plain program on an
  H100 at D128, causal or not, level at D256) the two math warpgroups take turns
  issuing: each waits on a named barrier of its own, issues both products and arrives on the
  other's before waiting for them, so one warpgroup's products run under the other's softmax
  (FlashAttention-3's ping-pong). (Turns with each product waited for inside the turn, the
  plain program's ``T.gemm``, ran 5-22% slower on an H100 and are not offered.)
- with :data:`PERSISTENT` (a candidate, off: one CTA a tile is served) a grid of that many
  CTAs walks the work tiles, its load warp and math warpgroups written out as roles that
  loop over the tiles on their own, so a tile's queries and first keys and values load under
  the previous tile's last steps and epilogue (``_persistent_fwd``): for short rows (B16
  S1024 D64 causal sees 4.5 key tiles a CTA on average), where one CTA a tile pays its
  queries' load, its pipeline's fill and its epilogue unhidden at every tile.

``B``, ``S_q`` and ``S_kv`` are launch-time sizes: one program serves every batch and
sequence length of a head configuration and the op's options (it is compiled with or without
the mask, which a key length off the tile needs even without a window). Query rows past
``S_q`` and key rows past ``S_kv`` in the last tiles are TileLang's bounds-checked copies:
loads outside the tensor read zeros and stores outside it are dropped.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
import math
import struct
from typing import Any, Literal, NamedTuple, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface

from ._store import stored
from ._tilelang import compile_program, tl

__all__ = [
    "AttentionDType",
    "AttentionFwdInterface",
    "AttentionFwdKernel",
    "AttentionFwdSpec",
    "AttentionLayout",
    "AttentionPlan",
    "AttentionVarlenFwdInterface",
    "AttentionVarlenFwdKernel",
    "AttentionVarlenFwdSpec",
    "HEAD_DIMS",
    "attention_plan",
    "build_attention_fwd",
    "attention_fwd_program",
    "attention_varlen_program",
    "build_attention_varlen_fwd",
    "first_key_tile",
    "key_tiles_end",
    "needs_mask",
    "program_key",
    "tile_batches",
    "varlen_program_key",
]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453

#: the storage dtypes the attention kernels are written for
AttentionDType = Literal["float16", "bfloat16"]
_DTYPES = frozenset(get_args(AttentionDType))
#: the (D, D_v) pairs the kernels serve (each one's program is compiled by the tests)
HEAD_DIMS = frozenset({(64, 64), (128, 128), (256, 256), (192, 128)})


class AttentionLayout(enum.Enum):
    """The axis order of q, k, v and o."""

    BSHD = "bshd"  # [B, S, H, D], FlashAttention's
    BHSD = "bhsd"  # [B, H, S, D], scaled_dot_product_attention's


class AttentionFwdSpec(CallSpec, frozen=True, kw_only=True):
    """The facts of one attention call: exact sizes, the dtype, the layout and the op's mask,
    scale and softcap (``window_left`` / ``window_right``: keys seen before / after a row's
    diagonal position, -1 unbounded, ``is_causal`` already folded in as a right bound of 0)."""

    batch: int
    seq_q: int
    seq_kv: int
    heads: int
    heads_kv: int
    dim: int
    dim_v: int
    dtype: AttentionDType
    layout: AttentionLayout
    scale: float
    window_left: int
    window_right: int
    softcap: float | None

    def __post_init__(self) -> None:
        if not isinstance(self.layout, AttentionLayout):
            raise TypeError(f"AttentionFwdSpec.layout must be an AttentionLayout, got "
                            f"{self.layout!r}")
        self.check_fields(choices={"dtype": _DTYPES},
                          sizes=("batch", "seq_q", "seq_kv", "heads", "heads_kv", "dim",
                                 "dim_v"))
        _check_options(type(self).__name__, self)


def _check_options(name: str, spec: Any) -> None:
    """What both call specs refuse of the heads and the op's options, naming the spec."""
    if spec.heads_kv == 0 or spec.heads % spec.heads_kv:
        raise ValueError(f"{name}: {spec.heads} query heads do not form groups of "
                         f"{spec.heads_kv} key heads")
    if not spec.scale > 0.0:
        raise ValueError(f"{name}.scale must be > 0, got {spec.scale!r}")
    if spec.window_left < -1 or spec.window_right < -1:
        raise ValueError(f"{name}: window bounds are >= -1, got "
                         f"({spec.window_left}, {spec.window_right})")
    if spec.softcap is not None and not spec.softcap > 0.0:
        raise ValueError(f"{name}.softcap must be > 0, got {spec.softcap!r}")


class AttentionFwdInterface(KernelInterface):
    """One slot: ``forward(q, k, v, o, lse)``, q/k/v/o contiguous in the spec's layout, ``lse``
    a ``[B, H, S_q]`` float32 tensor."""

    slot = "attention_fwd"
    call_spec = AttentionFwdSpec


class AttentionVarlenFwdSpec(CallSpec, frozen=True, kw_only=True):
    """The facts of one varlen call: the packed lengths, the batch, the heads, the dtype and
    the op's mask, scale and softcap (as :class:`AttentionFwdSpec`'s)."""

    total_q: int
    total_kv: int
    batch: int
    heads: int
    heads_kv: int
    dim: int
    dim_v: int
    dtype: AttentionDType
    scale: float
    window_left: int
    window_right: int
    softcap: float | None

    def __post_init__(self) -> None:
        self.check_fields(choices={"dtype": _DTYPES},
                          sizes=("total_q", "total_kv", "batch", "heads", "heads_kv", "dim",
                                 "dim_v"))
        _check_options(type(self).__name__, self)


class AttentionVarlenFwdInterface(KernelInterface):
    """One slot: ``forward(q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse)``, q/k/v/o contiguous
    ``[Z, H, D]``, the offsets int32 ``[B + 1]``, ``lse`` a ``[H, Z_q]`` float32 tensor."""

    slot = "attention_varlen_fwd"
    call_spec = AttentionVarlenFwdSpec


class AttentionPlan(NamedTuple):
    """How a program is launched: ``block_m`` query rows and ``block_n`` keys a step,
    ``stages`` of key/value copies in flight, ``threads`` a CTA, and whether the output goes
    through shared memory (a 16-byte-vector store; left out where it would not fit)."""

    block_m: int
    block_n: int
    stages: int
    threads: int
    staged_output: bool
    #: compiled with TileLang's fast math (``tl.enable_fast_math``: the exponentials, the
    #: division by the sum and the log-sum-exp's log2 as the approximate instructions), as
    #: TileLang's flash-attention example is; within the outputs' storage precision
    fast_math: bool = True
    #: the output product of key tile ``j - 1`` issued after the scores product of tile
    #: ``j``, both left in flight, and run under tile ``j``'s softmax (the accumulator's
    #: rescale and the probabilities' cast after it): FlashAttention-3's intra-warpgroup
    #: overlap (:data:`OVERLAP`)
    overlap: bool = False
    #: with :attr:`overlap`, the two math warpgroups take turns issuing their products (a
    #: named barrier each: a warpgroup waits for its turn, issues both products and hands
    #: the turn over before waiting for them), so one warpgroup's products run under the
    #: other's softmax: FlashAttention-3's warpgroup ping-pong (:data:`TURNS`)
    turns: bool = False
    #: CTAs of a persistent grid walking the work tiles (``_persistent_fwd``; 0: one CTA a
    #: query tile of a head of a batch entry): :data:`PERSISTENT`
    persistent: int = 0


#: whether the dense forward overlaps each tile's output product with the next tile's softmax
#: (:attr:`AttentionPlan.overlap`)
OVERLAP = True
#: whether the overlapped forward's math warpgroups take turns issuing their products
#: (:attr:`AttentionPlan.turns`; on an H100 the served schedule: 560 against the plain
#: program's 533 TFLOP/s at B4 S4096 H32 D128, 547 against 524 at GQA B2 S8192 32:8 causal)
TURNS = True
#: CTAs of the dense forward's persistent grid (:attr:`AttentionPlan.persistent`), 0 for one
#: CTA a tile (served); a candidate for short rows, where a CTA's fixed cost (its queries'
#: load, the pipeline's fill, the epilogue) is paid for a few key tiles
PERSISTENT = 0
#: SMs of an H100 / H200: a persistent grid's CTAs (one CTA an SM)
SMS = 132
#: calls of at most this many keys are served the plain schedule (no overlap, no turns, so
#: not the overlapped schedule's spare step: one more scores and output product a CTA, 22% of
#: the work where a CTA sees 4.5 key tiles, 3% at 32; 0: every call the plan's). On an H100
#: the plain program took 275.5 us against the turns' 286.9 at B16 S1024 H32 D64 causal, and
#: the turns 1.96 ms against 2.06 at B4 S4096 H32 D128
PLAIN_UP_TO = 1024
#: the named barriers of the warpgroups' turns (TileLang's own synchronisation uses the low ids)
_TURN_BARRIERS = (8, 9)


def attention_plan(dim: int, dim_v: int) -> AttentionPlan:
    """The launch plan of a head-dim pair. Up to 128: the example's 128 x 128 tiles, two
    stages, 256 threads (Q 32 KiB, K and V 64 KiB each staged twice, O 32 KiB of shared
    memory). Wider heads take 64 keys a step: D = 256 holds Q (64 KiB) and two stages of K and
    V (128 KiB) and writes O from registers (another 64 KiB would pass the 227 KiB an H200 CTA
    may use); 192 / 128 fits in 160 KiB with O staged."""
    if max(dim, dim_v) <= 128:
        return AttentionPlan(block_m=128, block_n=128, stages=2, threads=256,
                             staged_output=True, overlap=OVERLAP, turns=OVERLAP and TURNS,
                             persistent=PERSISTENT)
    return AttentionPlan(block_m=128, block_n=64, stages=2, threads=256,
                         staged_output=dim_v <= 128, overlap=OVERLAP,
                         turns=OVERLAP and TURNS, persistent=PERSISTENT)


def _f32(x: float) -> float:
    """``x`` rounded to float32: the program's constants are float32 literals, and one that
    is not exactly representable would be rounded by nvcc with a warning per use."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _bounds(seq_q: int, seq_kv: int, left: int, right: int) -> tuple[int, int]:
    """The window's sides, an unbounded one (-1) as a bound no key reaches: one comparison
    form for every mask."""
    reach = seq_q + seq_kv + 1
    return (left if left >= 0 else reach), (right if right >= 0 else reach)


def first_key_tile(r0: Any, seq_q: int, seq_kv: int, left: int, bn: int, mx: Any = max) -> Any:
    """The first key tile a query tile starting at row ``r0`` sees: its first row's leftmost
    key. ``mx`` is ``max`` for ints, ``T.max`` in the program (the same formula for both)."""
    lb, _ = _bounds(seq_q, seq_kv, left, -1)
    return mx(0, r0 + (seq_kv - seq_q) - lb) // bn


def key_tiles_end(r0: Any, seq_q: int, seq_kv: int, left: int, right: int, bm: int, bn: int,
                  mx: Any = max, mn: Any = min) -> Any:
    """One past the last key tile a query tile of ``bm`` rows from ``r0`` sees (its last
    row's rightmost key, within ``S_kv``); never before :func:`first_key_tile`, so a tile
    that sees no key runs no step."""
    _, rb = _bounds(seq_q, seq_kv, left, right)
    hi = mx(0, mn(seq_kv, r0 + bm + (seq_kv - seq_q) + rb))
    return mx(first_key_tile(r0, seq_q, seq_kv, left, bn, mx), (hi + bn - 1) // bn)


def full_key_tiles(r0: Any, seq_q: int, seq_kv: int, left: int, right: int, bm: int, bn: int,
                   mx: Any = max, mn: Any = min) -> tuple[Any, Any]:
    """``(start, end)``: the key tiles from ``start`` to before ``end`` are seen whole by every
    row of the query tile of ``bm`` rows from ``r0`` (in ``S_kv``, inside every row's window),
    so their scores need no mask; the others of the loop are masked. Conservative over the
    tile's rows past ``S_q``, which are not stored. ``mx`` / ``mn`` as in
    :func:`first_key_tile`."""
    lb, rb = _bounds(seq_q, seq_kv, left, right)
    offset = seq_kv - seq_q
    # the last row's leftmost key starts the first whole tile; the first row's rightmost key
    # (and S_kv) ends the last
    # (no left side: every key left of a row's diagonal is seen, so every tile starts whole; the
    # bound _bounds gives for it is passed by the tile's rows past a short S_q)
    start = 0 if left < 0 else mx(0, r0 + bm - 1 + offset - lb + bn - 1) // bn
    end = mx(0, mn(seq_kv, r0 + offset + rb + 1)) // bn
    return start, end


def _cap_constants(scale: float, softcap: float | None) -> tuple[float, float]:
    """``(softcap * log2(e), scale / softcap)``: a capped score in the base-2 exponent's units
    is ``cap_l2 * tanh(s * cap_in)``."""
    return _f32((softcap or 1.0) * _LOG2E), _f32(scale / (softcap or 1.0))


def _softmax_macros(T, bm: int, bn: int, dim_v: int, dtype: str, scale: float,
                    softcap: float | None):
    """What the dense and the varlen programs share of the online softmax: ``step`` (one key
    tile's scores, masked to -inf where unseen, into the running maximum, the sum of
    exponentials, the probabilities in the storage dtype and the rescaled output) as its two
    halves ``scores`` (up to the probabilities in fp32 and the output's scale) and ``finish``
    (their cast and the output's rescale), ``normalize`` (the output divided by the sum; 0 for
    a row that saw no key) and ``lse_of`` (a row's natural log-sum-exp; -inf for a row that
    saw no key)."""
    # the factor of the raw scores in the base-2 exponent (1 once the softcap replaced them)
    sm = _f32(1.0 if softcap is not None else scale * _LOG2E)
    ln2 = _f32(_LN2)
    neg_inf = -math.inf

    @T.macro
    def scores(acc_s, scores_max, scores_max_prev, m_safe, scores_scale, scores_sum, logsum):
        T.copy(scores_max, scores_max_prev)
        T.reduce_max(acc_s, scores_max, dim=1, clear=False)
        for i in T.Parallel(bm):
            scores_max[i] = T.max(scores_max[i], scores_max_prev[i])
        for i in T.Parallel(bm):
            # 0 while the row has seen no key: exp2(-inf - 0) = 0, never -inf + inf
            m_safe[i] = T.if_then_else(scores_max[i] == neg_inf, 0.0, scores_max[i] * sm)
            scores_scale[i] = T.exp2(scores_max_prev[i] * sm - m_safe[i])
        for i, j in T.Parallel(bm, bn):
            acc_s[i, j] = T.exp2(acc_s[i, j] * sm - m_safe[i])
        T.reduce_sum(acc_s, scores_sum, dim=1)
        for i in T.Parallel(bm):
            logsum[i] = logsum[i] * scores_scale[i] + scores_sum[i]

    @T.macro
    def finish(acc_s, acc_s_cast, acc_o, scores_scale):
        T.copy(acc_s, acc_s_cast)
        for i, j in T.Parallel(bm, dim_v):
            acc_o[i, j] *= scores_scale[i]

    @T.macro
    def step(acc_s, acc_s_cast, acc_o, scores_max, scores_max_prev, m_safe, scores_scale,
             scores_sum, logsum):
        scores(acc_s, scores_max, scores_max_prev, m_safe, scores_scale, scores_sum, logsum)
        finish(acc_s, acc_s_cast, acc_o, scores_scale)

    @T.macro
    def normalize(acc_o, logsum):
        for i, j in T.Parallel(bm, dim_v):
            acc_o[i, j] = T.if_then_else(logsum[i] > 0, acc_o[i, j] / logsum[i], 0.0)

    def lse_of(total, m):
        return T.if_then_else(total > 0, (T.log2(total) + m) * ln2, neg_inf)

    return step, normalize, lse_of, scores, finish


def _with_fast_math(main, plan: AttentionPlan):
    """``main`` compiled with TileLang's fast math where the plan asks for it."""
    if plan.fast_math:
        return main.with_attr("tilelang_pass_configs", {"tl.enable_fast_math": True})
    return main


def _persistent_fwd(T, plan: AttentionPlan, bshd: bool, heads: int, groups: int, dtype: str,
                    q_shape, k_shape, v_shape, o_shape, batch, seq_q, seq_kv, left: int,
                    right: int, causal_like: bool, cap_and_mask, softmax_scores,
                    softmax_finish, softmax_step, normalize, lse_of):
    """The dense forward on a persistent grid (:attr:`AttentionPlan.persistent`): at most
    ``plan.persistent`` CTAs, CTA ``c`` computing the work tiles ``c, c + grid, ...`` of a
    static order (query tile, then batch entry and head: the longest causal tiles first, the
    heads of a key head side by side), with the warp roles written out. One warp of the
    last warpgroup issues the TMA loads, of each tile its queries (a one-deep ring, released
    once the tile's last scores product completes) and then its key and value tiles (a
    ``plan.stages``-deep ring each, numbered across the CTA's tiles); the two math
    warpgroups run each tile's steps (the schedule of :func:`attention_fwd_program`'s plan:
    plain, overlapped, or overlapped with turns) and its epilogue. The roles loop over the
    tiles independently, so the next tile's queries and first keys and values load while
    this tile's last steps and its epilogue (normalize, log-sum-exp, the output's store)
    run, where one CTA a tile reloads and refills its pipeline after the previous CTA left.
    The turns run on across tiles: the first warpgroup's first turn is given once a CTA."""
    bm, bn, dim, dim_v = plan.block_m, plan.block_n, q_shape[-1], v_shape[-1]
    threads, stages = plan.threads, plan.stages
    accum = "float32"
    neg_inf = -math.inf
    m_tiles = T.ceildiv(seq_q, bm)
    bh = batch * heads
    n_work = m_tiles * bh
    grid = T.min(n_work, plan.persistent)
    load_warp = threads  # the first thread of the load warp (the math threads come first)

    def rows(src, b, h, r0, n):  # n rows from r0 of one head of one batch entry
        return src[b, r0:r0 + n, h, :] if bshd else src[b, h, r0:r0 + n, :]

    # work tile t: its query tile (the longest first where later tiles see more keys), batch
    # entry and head, and the key tiles its rows see; both roles decode a tile alike
    def tile_row(t):
        return ((m_tiles - 1 - t // bh) if causal_like else t // bh) * bm

    def key_range(r0):
        return (first_key_tile(r0, seq_q, seq_kv, left, bn, T.max),
                key_tiles_end(r0, seq_q, seq_kv, left, right, bm, bn, T.max, T.min))

    def steps_end_of(start, end):  # the overlapped schedule's spare step included
        return T.if_then_else(end > start, end + 1, start) if plan.overlap else end

    @T.prim_func
    def main(Q: T.Tensor(q_shape, dtype), K: T.Tensor(k_shape, dtype),
             V: T.Tensor(v_shape, dtype), Out: T.Tensor(o_shape, dtype),
             LSE: T.Tensor([batch, heads, seq_q], accum)):
        with T.Kernel(grid, threads=threads + 128) as cta:
            Q_shared = T.alloc_shared([bm, dim], dtype)
            K_shared = T.alloc_shared([stages, bn, dim], dtype)
            V_shared = T.alloc_shared([stages, bn, dim_v], dtype)
            O_shared = T.alloc_shared([bm, dim_v], dtype) if plan.staged_output else None
            acc_s = T.alloc_fragment([bm, bn], accum)
            acc_s_cast = T.alloc_fragment([bm, bn], dtype)
            acc_o = T.alloc_fragment([bm, dim_v], accum)
            scores_max = T.alloc_fragment([bm], accum)
            scores_max_prev = T.alloc_fragment([bm], accum)
            m_safe = T.alloc_fragment([bm], accum)
            scores_scale = T.alloc_fragment([bm], accum)
            scores_sum = T.alloc_fragment([bm], accum)
            logsum = T.alloc_fragment([bm], accum)
            q_full = T.alloc_barrier([32])
            q_empty = T.alloc_barrier([threads])
            k_full = T.alloc_barrier([32] * stages)
            k_empty = T.alloc_barrier([threads] * stages)
            v_full = T.alloc_barrier([32] * stages)
            v_empty = T.alloc_barrier([threads] * stages)
            step = T.alloc_var("int32", init=0)  # key steps this role has run, all tiles
            # the work tile's first query row, batch entry and head, held in variables (its
            # expressions, repeated in every index, made TVM's codegen bind one of its
            # divisions' terms twice)
            r0 = T.alloc_var("int32")
            bz = T.alloc_var("int32")
            by = T.alloc_var("int32")
            tid = T.get_thread_binding()

            if tid >= load_warp:  # the load warpgroup: one warp issues, the rest idle
                T.set_max_nreg(24, 0)
                if tid < load_warp + 32:
                    for w in T.serial(T.ceildiv(n_work - cta, grid)):
                        t = w * grid + cta
                        r0 = tile_row(t)
                        bz = (t % bh) // heads
                        by = t % heads
                        hk = by // groups
                        start, end = key_range(r0)
                        steps_end = steps_end_of(start, end)
                        T.mbarrier_wait_parity(q_empty[0], (w & 1) ^ 1)
                        T.tma_copy(rows(Q, bz, by, r0, bm), Q_shared, barrier=q_full[0])
                        T.mbarrier_arrive(q_full[0])
                        for jt in T.serial(start, steps_end):
                            s = step % stages
                            phase = (step // stages) & 1
                            kt = T.min(jt, end - 1) if plan.overlap else jt
                            vt = T.max(jt - 1, start) if plan.overlap else jt
                            T.mbarrier_wait_parity(k_empty[s], phase ^ 1)
                            T.tma_copy(rows(K, bz, hk, kt * bn, bn), K_shared[s, :, :],
                                       barrier=k_full[s])
                            T.mbarrier_arrive(k_full[s])
                            T.mbarrier_wait_parity(v_empty[s], phase ^ 1)
                            T.tma_copy(rows(V, bz, hk, vt * bn, bn), V_shared[s, :, :],
                                       barrier=v_full[s])
                            T.mbarrier_arrive(v_full[s])
                            step = step + 1
            else:  # the math warpgroups
                T.set_max_nreg(240, 1)
                if plan.overlap and plan.turns and tid < 128:
                    T.named_barrier_arrive(_TURN_BARRIERS[0], 256)  # the first turn, once
                for w in T.serial(T.ceildiv(n_work - cta, grid)):
                    t = w * grid + cta
                    r0 = tile_row(t)
                    bz = (t % bh) // heads
                    by = t % heads
                    hk = by // groups
                    start, end = key_range(r0)
                    steps_end = steps_end_of(start, end)
                    whole_start, whole_end = full_key_tiles(r0, seq_q, seq_kv, left, right,
                                                            bm, bn, T.max, T.min)
                    T.fill(acc_o, 0)
                    T.fill(logsum, 0)
                    T.fill(m_safe, 0)
                    T.fill(scores_max, neg_inf)
                    T.mbarrier_wait_parity(q_full[0], w & 1)
                    if plan.overlap:
                        regs_s, regs_o = bm * bn // threads, bm * dim_v // threads
                        T.clear(acc_s_cast)  # the first step's output product adds nothing
                        for jt in T.serial(start, steps_end):
                            s = step % stages
                            phase = (step // stages) & 1
                            T.clear(acc_s)
                            if plan.turns:
                                wg = tid // 128
                                T.sync_threads(_TURN_BARRIERS[0] + wg, 256)
                            T.mbarrier_wait_parity(k_full[s], phase)
                            T.wgmma_gemm(Q_shared, K_shared[s, :, :], acc_s, transpose_B=True,
                                         policy=T.GemmWarpPolicy.FullRow)
                            T.mbarrier_wait_parity(v_full[s], phase)
                            T.wgmma_gemm(acc_s_cast, V_shared[s, :, :], acc_o,
                                         policy=T.GemmWarpPolicy.FullRow)
                            if plan.turns:
                                T.named_barrier_arrive(_TURN_BARRIERS[1] - wg, 256)
                            T.wait_wgmma(1)
                            T.mbarrier_arrive(k_empty[s])
                            if jt < end:
                                T.warpgroup_fence_operand(acc_s, num_regs=regs_s)
                                cap_and_mask(acc_s, jt, r0, whole_start, whole_end)
                                softmax_scores(acc_s, scores_max, scores_max_prev, m_safe,
                                               scores_scale, scores_sum, logsum)
                            T.wait_wgmma(0)
                            T.warpgroup_fence_operand(acc_o, num_regs=regs_o)
                            T.warpgroup_fence_operand(acc_s_cast, num_regs=regs_s // 2)
                            T.mbarrier_arrive(v_empty[s])
                            if jt < end:
                                softmax_finish(acc_s, acc_s_cast, acc_o, scores_scale)
                            step = step + 1
                    else:
                        for kt in T.serial(start, end):
                            s = step % stages
                            phase = (step // stages) & 1
                            T.clear(acc_s)
                            T.mbarrier_wait_parity(k_full[s], phase)
                            T.gemm(Q_shared, K_shared[s, :, :], acc_s, transpose_B=True,
                                   policy=T.GemmWarpPolicy.FullRow)
                            T.mbarrier_arrive(k_empty[s])
                            cap_and_mask(acc_s, kt, r0, whole_start, whole_end)
                            softmax_step(acc_s, acc_s_cast, acc_o, scores_max, scores_max_prev,
                                         m_safe, scores_scale, scores_sum, logsum)
                            T.mbarrier_wait_parity(v_full[s], phase)
                            T.gemm(acc_s_cast, V_shared[s, :, :], acc_o,
                                   policy=T.GemmWarpPolicy.FullRow)
                            T.mbarrier_arrive(v_empty[s])
                            step = step + 1
                    T.mbarrier_arrive(q_empty[0])  # the tile's last scores product is done
                    normalize(acc_o, logsum)
                    for i in T.Parallel(bm):
                        if r0 + i < seq_q:
                            LSE[bz, by, r0 + i] = lse_of(logsum[i], m_safe[i])
                    if plan.staged_output:
                        T.copy(acc_o, O_shared)
                        T.copy(O_shared, rows(Out, bz, by, r0, bm))
                    else:
                        T.copy(acc_o, rows(Out, bz, by, r0, bm))

    return main


def attention_fwd_program(layout: str, heads: int, heads_kv: int, dim: int, dim_v: int,
                          dtype: str, scale: float, left: int, right: int,
                          softcap: float | None, masked: bool, plan: AttentionPlan):
    """The prim_func of a head configuration and the op's options (see the module
    docstring); ``B``, ``S_q`` and ``S_kv`` are launch-time sizes. ``masked``: whether any
    score can be masked (a window, or a key length off the tile), which
    :func:`needs_mask` decides from a call."""
    tilelang, T = tl()
    bm, bn, threads = plan.block_m, plan.block_n, plan.threads
    accum = "float32"
    groups = heads // heads_kv
    batch, seq_q, seq_kv = T.dynamic("B"), T.dynamic("S_q"), T.dynamic("S_kv")
    offset = seq_kv - seq_q  # a row's diagonal key position is its index + offset
    bshd = layout == "bshd"
    q_shape = [batch, seq_q, heads, dim] if bshd else [batch, heads, seq_q, dim]
    k_shape = [batch, seq_kv, heads_kv, dim] if bshd else [batch, heads_kv, seq_kv, dim]
    v_shape = [batch, seq_kv, heads_kv, dim_v] if bshd else [batch, heads_kv, seq_kv, dim_v]
    o_shape = [batch, seq_q, heads, dim_v] if bshd else [batch, heads, seq_q, dim_v]
    m_tiles = T.ceildiv(seq_q, bm)
    causal_like = right >= 0  # later query tiles see more keys: launch them first
    lb, rb = _bounds(seq_q, seq_kv, left, right)
    capped = softcap is not None
    cap_l2, cap_in = _cap_constants(scale, softcap)
    softmax_step, normalize, lse_of, softmax_scores, softmax_finish = _softmax_macros(
        T, bm, bn, dim_v, dtype, scale, softcap)
    neg_inf = -math.inf

    @T.macro
    def load_tile(src, dst, kt, bz, hk):  # key tile kt of K or V, in either layout
        if bshd:
            T.copy(src[bz, kt * bn:(kt + 1) * bn, hk, :], dst)
        else:
            T.copy(src[bz, hk, kt * bn:(kt + 1) * bn, :], dst)

    @T.macro
    def cap_and_mask(acc_s, kt, r0, whole_start, whole_end):
        if capped:
            for i, j in T.Parallel(bm, bn):
                acc_s[i, j] = cap_l2 * T.tanh(acc_s[i, j] * cap_in)
        if masked:  # noqa: SIM102 - the program's choice, then the tile's branch
            # only the tiles a row sees in part (a causal diagonal, a window's edges, the tail
            # past S_kv): a branch the whole CTA takes alike
            if kt < whole_start or kt >= whole_end:
                for i, j in T.Parallel(bm, bn):
                    key = kt * bn + j
                    diag = r0 + i + offset
                    acc_s[i, j] = T.if_then_else(
                        key < seq_kv and key >= diag - lb and key <= diag + rb,
                        acc_s[i, j], neg_inf)

    @T.macro
    def store_staged(acc_o, Out, r0, by, bz):
        O_shared = T.alloc_shared([bm, dim_v], dtype)
        T.copy(acc_o, O_shared)
        if bshd:
            T.copy(O_shared, Out[bz, r0:r0 + bm, by, :])
        else:
            T.copy(O_shared, Out[bz, by, r0:r0 + bm, :])

    @T.macro
    def store_direct(acc_o, Out, r0, by, bz):
        if bshd:
            T.copy(acc_o, Out[bz, r0:r0 + bm, by, :])
        else:
            T.copy(acc_o, Out[bz, by, r0:r0 + bm, :])

    if plan.persistent:
        return _with_fast_math(_persistent_fwd(
            T, plan, bshd, heads, groups, dtype, q_shape, k_shape, v_shape, o_shape, batch,
            seq_q, seq_kv, left, right, causal_like, cap_and_mask, softmax_scores,
            softmax_finish, softmax_step, normalize, lse_of), plan)

    @T.prim_func
    def main(Q: T.Tensor(q_shape, dtype), K: T.Tensor(k_shape, dtype),
             V: T.Tensor(v_shape, dtype), Out: T.Tensor(o_shape, dtype),
             LSE: T.Tensor([batch, heads, seq_q], accum)):
        with T.Kernel(m_tiles, heads, batch, threads=threads) as (bx, by, bz):
            Q_shared = T.alloc_shared([bm, dim], dtype)
            K_shared = T.alloc_shared([bn, dim], dtype)
            V_shared = T.alloc_shared([bn, dim_v], dtype)
            acc_s = T.alloc_fragment([bm, bn], accum)
            acc_s_cast = T.alloc_fragment([bm, bn], dtype)
            acc_o = T.alloc_fragment([bm, dim_v], accum)
            scores_max = T.alloc_fragment([bm], accum)
            scores_max_prev = T.alloc_fragment([bm], accum)
            m_safe = T.alloc_fragment([bm], accum)
            scores_scale = T.alloc_fragment([bm], accum)
            scores_sum = T.alloc_fragment([bm], accum)
            logsum = T.alloc_fragment([bm], accum)

            tile = (m_tiles - 1 - bx) if causal_like else bx
            r0 = tile * bm
            hk = by // groups
            if bshd:
                T.copy(Q[bz, r0:r0 + bm, by, :], Q_shared)
            else:
                T.copy(Q[bz, by, r0:r0 + bm, :], Q_shared)
            T.fill(acc_o, 0)
            T.fill(logsum, 0)
            T.fill(m_safe, 0)
            T.fill(scores_max, neg_inf)

            # the key tiles some row of this CTA sees, and those every row sees whole
            start = first_key_tile(r0, seq_q, seq_kv, left, bn, T.max)
            end = key_tiles_end(r0, seq_q, seq_kv, left, right, bm, bn, T.max, T.min)
            whole_start, whole_end = full_key_tiles(r0, seq_q, seq_kv, left, right, bm, bn,
                                                    T.max, T.min)

            if plan.overlap:
                # step jt: tile jt's scores product and softmax, tile jt - 1's output product
                # (issued after the scores product, completing under the softmax); one step
                # more than tiles, none for a CTA that sees no key. Every step issues both
                # products and the scores product's wait: a product or a wait under a
                # condition makes ptxas serialize every product of the program (C7514). So
                # the last step computes tile end - 1's scores again, unused, and the first
                # step's output product adds zero probabilities times tile start's values.
                # a thread's 32-bit registers of the scores (and of their 16-bit cast: half as
                # many) and of the output accumulator
                regs_s, regs_o = bm * bn // threads, bm * dim_v // threads
                steps_end = T.if_then_else(end > start, end + 1, start)
                touch = T.alloc_local([1], dtype)
                T.clear(acc_s_cast)  # the first step's output product adds nothing
                for jt in T.Pipelined(start, steps_end, num_stages=plan.stages):
                    load_tile(K, K_shared, T.min(jt, end - 1), bz, hk)
                    load_tile(V, V_shared, T.max(jt - 1, start), bz, hk)
                    T.clear(acc_s)
                    if plan.turns:
                        # a warpgroup's turn: its barrier completes with the other's hand-over
                        # (the first warpgroup's first turn, with its own)
                        wg = T.get_thread_binding() // 128
                        if jt == start and wg == 0:
                            T.named_barrier_arrive(_TURN_BARRIERS[0], 256)
                        T.sync_threads(_TURN_BARRIERS[0] + wg, 256)
                    T.wgmma_gemm(Q_shared, K_shared, acc_s, transpose_B=True,
                                 policy=T.GemmWarpPolicy.FullRow)
                    T.wgmma_gemm(acc_s_cast, V_shared, acc_o,
                                 policy=T.GemmWarpPolicy.FullRow)
                    if plan.turns:  # issued: the other warpgroup's turn
                        T.named_barrier_arrive(_TURN_BARRIERS[1] - wg, 256)
                    T.wait_wgmma(1)  # the scores product (issued first) is done
                    if jt < end:
                        # the scores' registers are read after the wait, not moved above it
                        T.warpgroup_fence_operand(acc_s, num_regs=regs_s)
                        # the keys' last use: the pipeline releases their stage after it, not
                        # when the asynchronous product was issued
                        touch[0] = K_shared[0, 0]
                        cap_and_mask(acc_s, jt, r0, whole_start, whole_end)
                        softmax_scores(acc_s, scores_max, scores_max_prev, m_safe,
                                       scores_scale, scores_sum, logsum)
                    T.wait_wgmma(0)
                    # the output product's registers (its accumulator, the probabilities it
                    # reads) are touched after the wait, not moved above it
                    T.warpgroup_fence_operand(acc_o, num_regs=regs_o)
                    T.warpgroup_fence_operand(acc_s_cast, num_regs=regs_s // 2)
                    touch[0] = V_shared[0, 0]  # the values' last use, as the keys'
                    if jt < end:
                        softmax_finish(acc_s, acc_s_cast, acc_o, scores_scale)
            else:
                for kt in T.Pipelined(start, end, num_stages=plan.stages):
                    load_tile(K, K_shared, kt, bz, hk)
                    T.clear(acc_s)
                    T.gemm(Q_shared, K_shared, acc_s, transpose_B=True,
                           policy=T.GemmWarpPolicy.FullRow)
                    cap_and_mask(acc_s, kt, r0, whole_start, whole_end)
                    load_tile(V, V_shared, kt, bz, hk)
                    softmax_step(acc_s, acc_s_cast, acc_o, scores_max, scores_max_prev, m_safe,
                                 scores_scale, scores_sum, logsum)
                    T.gemm(acc_s_cast, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)

            normalize(acc_o, logsum)
            for i in T.Parallel(bm):
                if r0 + i < seq_q:
                    LSE[bz, by, r0 + i] = lse_of(logsum[i], m_safe[i])
            if plan.staged_output:
                store_staged(acc_o, Out, r0, by, bz)
            else:
                store_direct(acc_o, Out, r0, by, bz)

    return _with_fast_math(main, plan)


def attention_varlen_program(heads: int, heads_kv: int, dim: int, dim_v: int, dtype: str,
                             scale: float, left: int, right: int, softcap: float | None,
                             plan: AttentionPlan):
    """The varlen prim_func: packed ``[Z, H, D]`` tensors, sequence ``b``'s rows from
    ``CuQ[b]`` / ``CuK[b]``; ``Z_q``, ``Z_kv``, ``B`` and the tile count are launch-time.

    The grid is one CTA a (query tile, head): sequence ``b``'s tiles are numbered from
    ``CuQ[b] // block_m + b`` on (a sequence of ``n`` rows starting mid-tile has at most
    ``n // block_m + 1`` of them, so the numbers of two sequences never meet, and
    ``Z_q // block_m + B`` CTAs cover every batch); ``TileBatch[t]`` names tile ``t``'s
    sequence (a search the entry runs on the device). A CTA past its sequence's rows runs no
    key step and writes nothing. Each sequence is masked as a dense call of its lengths (the
    tail keys past its own length included), on the key tiles its rows see in part only, as
    the dense program. A tile within its sequence stores its output through shared memory in
    one bulk copy (where the plan stages the output); the sequence's last tile stores its
    rows one by one (the rows past it are the next sequence's), and the log-sum-exp rows are
    stored one by one."""
    tilelang, T = tl()
    bm, bn, threads = plan.block_m, plan.block_n, plan.threads
    accum = "float32"
    groups = heads // heads_kv
    z_q, z_kv = T.dynamic("Z_q"), T.dynamic("Z_kv")
    b1, n_tiles = T.dynamic("B1"), T.dynamic("NT")
    capped = softcap is not None
    cap_l2, cap_in = _cap_constants(scale, softcap)
    softmax_step, normalize, lse_of, _, _ = _softmax_macros(T, bm, bn, dim_v, dtype, scale,
                                                           softcap)
    neg_inf = -math.inf

    @T.prim_func
    def main(Q: T.Tensor([z_q, heads, dim], dtype), K: T.Tensor([z_kv, heads_kv, dim], dtype),
             V: T.Tensor([z_kv, heads_kv, dim_v], dtype), CuQ: T.Tensor([b1], "int32"),
             CuK: T.Tensor([b1], "int32"), TileBatch: T.Tensor([n_tiles], "int32"),
             Out: T.Tensor([z_q, heads, dim_v], dtype), LSE: T.Tensor([heads, z_q], accum)):
        with T.Kernel(n_tiles, heads, threads=threads) as (bx, by):
            Q_shared = T.alloc_shared([bm, dim], dtype)
            K_shared = T.alloc_shared([bn, dim], dtype)
            V_shared = T.alloc_shared([bn, dim_v], dtype)
            acc_s = T.alloc_fragment([bm, bn], accum)
            acc_s_cast = T.alloc_fragment([bm, bn], dtype)
            acc_o = T.alloc_fragment([bm, dim_v], accum)
            scores_max = T.alloc_fragment([bm], accum)
            scores_max_prev = T.alloc_fragment([bm], accum)
            m_safe = T.alloc_fragment([bm], accum)
            scores_scale = T.alloc_fragment([bm], accum)
            scores_sum = T.alloc_fragment([bm], accum)
            logsum = T.alloc_fragment([bm], accum)

            b = TileBatch[bx]
            q0 = CuQ[b]
            len_q = CuQ[b + 1] - q0
            k0 = CuK[b]
            len_k = CuK[b + 1] - k0
            r0 = (bx - (q0 // bm + b)) * bm  # the tile's first row within its sequence
            hk = by // groups
            T.copy(Q[q0 + r0:q0 + r0 + bm, by, :], Q_shared)
            T.fill(acc_o, 0)
            T.fill(logsum, 0)
            T.fill(m_safe, 0)
            T.fill(scores_max, neg_inf)
            lb, rb = _bounds(len_q, len_k, left, right)

            start = first_key_tile(r0, len_q, len_k, left, bn, T.max)
            end = T.if_then_else(
                r0 < len_q, key_tiles_end(r0, len_q, len_k, left, right, bm, bn, T.max, T.min),
                start)
            # the key tiles every row of the tile sees whole within its sequence (no mask); a
            # tile holding the sequence's last keys and the next sequence's first is masked
            whole_start, whole_end = full_key_tiles(r0, len_q, len_k, left, right, bm, bn,
                                                    T.max, T.min)
            for kt in T.Pipelined(start, end, num_stages=plan.stages):
                T.copy(K[k0 + kt * bn:k0 + kt * bn + bn, hk, :], K_shared)
                T.clear(acc_s)
                T.gemm(Q_shared, K_shared, acc_s, transpose_B=True,
                       policy=T.GemmWarpPolicy.FullRow)
                if capped:
                    for i, j in T.Parallel(bm, bn):
                        acc_s[i, j] = cap_l2 * T.tanh(acc_s[i, j] * cap_in)
                if kt < whole_start or kt >= whole_end:  # a branch the CTA takes alike
                    for i, j in T.Parallel(bm, bn):
                        key = kt * bn + j
                        diag = r0 + i + len_k - len_q
                        acc_s[i, j] = T.if_then_else(
                            key < len_k and key >= diag - lb and key <= diag + rb, acc_s[i, j],
                            neg_inf)
                T.copy(V[k0 + kt * bn:k0 + kt * bn + bn, hk, :], V_shared)
                softmax_step(acc_s, acc_s_cast, acc_o, scores_max, scores_max_prev, m_safe,
                             scores_scale, scores_sum, logsum)
                T.gemm(acc_s_cast, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)

            normalize(acc_o, logsum)
            for i in T.Parallel(bm):
                if r0 + i < len_q:
                    LSE[by, q0 + r0 + i] = lse_of(logsum[i], m_safe[i])
            if plan.staged_output and r0 + bm <= len_q:
                # a tile within its sequence: through shared memory, one bulk store
                O_shared = T.alloc_shared([bm, dim_v], dtype)
                T.copy(acc_o, O_shared)
                T.copy(O_shared, Out[q0 + r0:q0 + r0 + bm, by, :])
            else:  # the sequence's last rows: row by row (the next rows are another CTA's)
                for i, j in T.Parallel(bm, dim_v):
                    if r0 + i < len_q:
                        Out[q0 + r0 + i, by, j] = acc_o[i, j]

    return _with_fast_math(main, plan)


def needs_mask(spec: AttentionFwdSpec, plan: AttentionPlan) -> bool:
    """Whether a call's scores can be masked: a window (``is_causal`` is one), or a key
    length that is not a multiple of the key tile (the last tile's keys past ``S_kv``)."""
    return spec.window_left >= 0 or spec.window_right >= 0 or spec.seq_kv % plan.block_n != 0


def program_key(spec: AttentionFwdSpec) -> tuple:
    """What the compiled program of ``spec`` depends on (the sizes are launch-time, but for
    the schedule of a call of at most :data:`PLAIN_UP_TO` keys: plain)."""
    plan = attention_plan(spec.dim, spec.dim_v)
    if spec.seq_kv <= PLAIN_UP_TO:
        plan = plan._replace(overlap=False, turns=False)
    return (spec.layout.value, spec.heads, spec.heads_kv, spec.dim, spec.dim_v, spec.dtype,
            spec.scale, spec.window_left, spec.window_right, spec.softcap,
            needs_mask(spec, plan), plan.persistent, plan.overlap, plan.turns)


@stored(maxsize=128)
def build_attention_fwd(key: tuple, target: str | None = None,
                        plan: AttentionPlan | None = None):
    """Compile the program of a :func:`program_key` (cached per key). ``plan`` overrides
    :func:`attention_plan`, for tuning."""
    layout, heads, heads_kv, dim, dim_v, dtype, scale, left, right, softcap, masked, \
        persistent, overlap, turns = key
    plan = plan or attention_plan(dim, dim_v)._replace(overlap=overlap, turns=turns,
                                                       persistent=persistent)
    prog = attention_fwd_program(layout, heads, heads_kv, dim, dim_v, dtype, scale, left,
                                 right, softcap, masked, plan)
    return compile_program(prog, target)


class AttentionFwdKernel(Kernel, AttentionFwdInterface):
    """The one forward implementation: the head-dim pairs of :data:`HEAD_DIMS`."""

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})

    @classmethod
    def region_refusal(cls, spec: AttentionFwdSpec) -> str | None:
        if (spec.dim, spec.dim_v) not in HEAD_DIMS:
            pairs = ", ".join(f"{d}/{dv}" for d, dv in sorted(HEAD_DIMS))
            return (f"head dims D = {spec.dim}, D_v = {spec.dim_v} are none of the served "
                    f"D/D_v pairs {pairs}")
        return None

    @classmethod
    def identity(cls, spec: AttentionFwdSpec):
        return (spec.device, program_key(spec))

    def __init__(self, spec: AttentionFwdSpec) -> None:
        super().__init__(spec)
        self.program = build_attention_fwd(program_key(spec))
        self._seq_axis = 1 if spec.layout is AttentionLayout.BSHD else 2

    def __call__(self, q, k, v, o, lse) -> None:
        if not q.numel():
            return  # no query row
        if not k.numel():  # no key: every row sees none
            o.zero_()
            lse.fill_(-math.inf)
            return
        self.program(q, k, v, o, lse)


def varlen_program_key(spec: AttentionVarlenFwdSpec) -> tuple:
    """What the compiled varlen program of ``spec`` depends on (the sizes are launch-time)."""
    return (spec.heads, spec.heads_kv, spec.dim, spec.dim_v, spec.dtype, spec.scale,
            spec.window_left, spec.window_right, spec.softcap)


@stored(maxsize=128)
def build_attention_varlen_fwd(key: tuple, target: str | None = None,
                               plan: AttentionPlan | None = None):
    """Compile the varlen program of a :func:`varlen_program_key` (cached per key)."""
    heads, heads_kv, dim, dim_v, dtype, scale, left, right, softcap = key
    plan = plan or attention_plan(dim, dim_v)
    prog = attention_varlen_program(heads, heads_kv, dim, dim_v, dtype, scale, left, right,
                                    softcap, plan)
    return compile_program(prog, target)


def tile_batches(cu_seqlens_q, total_q: int, block_m: int):
    """``TileBatch`` of the varlen program: for each of the ``Z_q // block_m + B`` CTAs the
    sequence its tile belongs to (the last sequence whose first tile number,
    ``cu_seqlens_q[b] // block_m + b``, is at most the CTA's), found by a search on the
    device: no offset is read on the host, so a call stays asynchronous and capturable in a
    CUDA graph."""
    import torch

    batch = cu_seqlens_q.shape[0] - 1
    first = torch.div(cu_seqlens_q[:-1], block_m, rounding_mode="floor")
    first += torch.arange(batch, dtype=first.dtype, device=first.device)
    tiles = torch.arange(total_q // block_m + batch, dtype=first.dtype, device=first.device)
    return (torch.searchsorted(first, tiles, right=True) - 1).to(torch.int32)


class AttentionVarlenFwdKernel(Kernel, AttentionVarlenFwdInterface):
    """The varlen forward: the head-dim pairs of :data:`HEAD_DIMS`."""

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    region_refusal = AttentionFwdKernel.region_refusal

    @classmethod
    def identity(cls, spec: AttentionVarlenFwdSpec):
        return (spec.device, varlen_program_key(spec))

    def __init__(self, spec: AttentionVarlenFwdSpec) -> None:
        super().__init__(spec)
        self.program = build_attention_varlen_fwd(varlen_program_key(spec))
        self._block_m = attention_plan(spec.dim, spec.dim_v).block_m

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, o, lse) -> None:
        if not q.numel() or cu_seqlens_q.shape[0] <= 1:
            return  # no query row
        if not k.numel():  # no key: every row sees none
            o.zero_()
            lse.fill_(-math.inf)
            return
        self.program(q, k, v, cu_seqlens_q, cu_seqlens_k,
                     tile_batches(cu_seqlens_q, q.shape[0], self._block_m), o, lse)
