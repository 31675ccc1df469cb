"""Quantising a ``[M, K]`` bfloat16 / float16 / float32 tensor to float8 with float32 scales.

Every scale block (the whole tensor, a row, a 1 x 128 group along a row, a 128 x 128 block)
gets ``scale = max(amax(|x|), AMAX_FLOOR) / fp8_max`` and its elements ``q = clamp(x / scale,
-fp8_max, fp8_max)`` cast to the fp8 dtype (round to nearest even): the convention of
torch._scaled_mm and DeepGEMM, dequantised = ``q * scale``. The scales are written in
row-major block order: ``[1]`` (the op's ``[]`` viewed flat), ``[M, 1]``, ``[M, ceil(K / 128)]``,
``[ceil(M / 128), ceil(K / 128)]``. ``M`` is a launch-time size (one entry serves every row
count); ``K``, the dtypes and the granularity are compiled in. An element outside ``[M, K]``
reads as 0, which changes no absolute maximum, and is not written.

Groups and blocks (:func:`quant_program`) walk tiles of ``rows`` rows by 128 columns held in
registers as float32, one pass: the tile is the scale block (a block) or ``rows`` of them (a
group, four tiles a CTA).

Rows and the tensor share one layout (:func:`row_plan`, as the softmax and norm row kernels
have it): ``tpr`` threads a row, each holding ``per`` accesses of up to 16 bytes (the widest
that divides ``K``) in the input's dtype, ``rpc`` rows a CTA (rows of at most a warp's share
pack into CTAs of 256 threads). A row of up to :data:`ROW_THREADS` x :data:`HELD_BYTES` (32768
columns of bfloat16, 16384 of float32) is held whole, so each element is read from memory
once: :func:`row_program` loads the row, folds ``|x|`` into one running maximum a thread,
reduces it across the row's threads (shuffles, and shared memory across its warps), writes the
scale and quantises from the same registers. M = 8192, K = 4096 bfloat16 is one row of 128
threads (four 16-byte loads each) a CTA, 8192 CTAs; M = 16 is 16 CTAs reading their rows at
once (the plan it replaces walked 16 rows a CTA in 16 x 128 tiles twice: one CTA for 16 rows).
A longer row takes :data:`ROW_THREADS` threads and steps of :data:`STEP_BYTES` a thread,
keeps its first step in registers and reads the others twice (the maximum, then the
quotients; the second read mostly from L2).

The tensor: up to :data:`TENSOR_ONE_CTA_BYTES` of ``x`` (:func:`one_cta_serves`, chosen by
``M`` at the call) is one program of one CTA (:func:`tensor_one_program`: the maximum over its
row groups, reduced across the CTA, then the quotients, the first group from registers), one
launch where there were two. A larger tensor takes two programs: :func:`amax_program` folds
the row groups into :func:`tensor_partials` partial maxima (:data:`AMAX_CTAS_PER_SM` CTAs an
SM, each striding over the groups), and :func:`tensor_quant_program` reduces them in every CTA
and quantises :data:`TENSOR_CTA_BYTES` of ``x`` a CTA, walking the tensor from its end: the
first CTAs to run read the rows the maximum's program read last, while L2 may still hold them
(a tensor larger than L2 is read twice from memory otherwise).

The row and tensor programs are a first design, compiled and run on the host against torch
(tests/kernels/test_fp8_host.py), checked on an H100 (53 of the GPU tests' 60 quantiser cases
passed, none failed, the rest not reached in the time given) but not yet timed; the plan's
figures (8 accesses a
thread, 4 warps a row at least, 8 partial-maximum CTAs an SM, the 64 KiB limits) are the
softmax and norm kernels' measured choices or estimates, for a sweep to settle.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
from typing import Any, Literal, NamedTuple, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

from ._store import stored
from ._tilelang import VECTOR_BYTES, compile_program, pow2_at_least, tl, widest_vec
from .gemm import sm_count

__all__ = [
    "AMAX_CTAS_PER_SM",
    "AMAX_FLOOR",
    "BUILDERS",
    "FP8_MAX",
    "GROUP",
    "HELD_BYTES",
    "ROW_THREADS",
    "STEP_BYTES",
    "TENSOR_CTA_BYTES",
    "TENSOR_ONE_CTA_BYTES",
    "TENSOR_PARTIALS",
    "Fp8QuantDType",
    "Fp8QuantInterface",
    "Fp8QuantKernel",
    "Fp8QuantSpec",
    "Granularity",
    "QuantPlan",
    "RowPlan",
    "amax_program",
    "build_amax_kernel",
    "build_quant_kernel",
    "build_tensor_one_kernel",
    "one_cta_serves",
    "program_keys",
    "quant_plan",
    "quant_program",
    "row_plan",
    "row_program",
    "tensor_one_program",
    "tensor_partials",
    "tensor_quant_program",
    "tensor_span",
    "tile_plan",
]

#: the absolute maximum of a scale block is clamped below by this (an all-zero block gets a
#: finite scale and quantises to zeros)
AMAX_FLOOR = 1e-12
#: the largest finite value of each fp8 dtype (torch.finfo(...).max)
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
#: the width of a group and of a block, and of every tile the programs load
GROUP = 128
#: the most partial maxima the tensor granularity's first program writes
TENSOR_PARTIALS = 1024
#: CTAs an SM of the tensor granularity's first program (its partial maxima)
AMAX_CTAS_PER_SM = 8
#: the largest ``x`` (bytes) the tensor granularity quantises in one program of one CTA
TENSOR_ONE_CTA_BYTES = 64 * 1024
#: bytes of ``x`` a CTA of the tensor granularity's quantising program covers
TENSOR_CTA_BYTES = 64 * 1024
#: bytes of its row a thread of a row program holds (8 accesses of 16 bytes)
HELD_BYTES = 128
#: the most threads a row (a longer row takes this many and steps)
ROW_THREADS = 512
#: bytes a thread of a row too long to hold loads a step
STEP_BYTES = 64
_WARP = 32
#: threads of a CTA of rows of at most a warp's share
_CTA_THREADS = 256

Fp8QuantDType = Literal["bfloat16", "float16", "float32"]
Fp8DType = Literal["float8_e4m3fn", "float8_e5m2"]


class Granularity(enum.Enum):
    """The scale block: the tensor, a row, a 1 x 128 group, a 128 x 128 block."""

    TENSOR = "tensor"
    ROW = "row"
    GROUP = "group"
    BLOCK = "block"


class Fp8QuantSpec(CallSpec, frozen=True, kw_only=True):
    """A quantising call: ``x`` ``[m, k]`` in ``dtype`` to ``fp8_dtype`` at ``granularity``."""

    m: int
    k: int
    dtype: Fp8QuantDType
    fp8_dtype: Fp8DType
    granularity: Granularity

    def __post_init__(self) -> None:
        self.check_fields(choices={"dtype": frozenset(get_args(Fp8QuantDType)),
                                   "fp8_dtype": frozenset(get_args(Fp8DType)),
                                   "granularity": frozenset(Granularity)},
                          sizes=("m", "k"))


class Fp8QuantInterface(KernelInterface):
    """One slot: ``forward(x, q, scale)`` writes ``q`` and ``scale`` of ``x`` (contiguous)."""

    slot = "fp8_quant"
    call_spec = Fp8QuantSpec


class QuantPlan(NamedTuple):
    """A tile plan (a group, a block): ``rows`` rows a tile, ``tiles`` 128-column tiles a CTA
    walks along K, ``threads`` a CTA."""

    rows: int
    tiles: int
    threads: int


class RowPlan(NamedTuple):
    """A row plan (a row, the tensor): ``tpr`` threads a row, ``rpc`` rows a CTA, each thread
    ``per`` accesses of ``vec`` elements a step, ``steps`` steps a row (1: the row is held in
    registers whole). Thread ``lane`` of a row reads columns ``((step * per + v) * tpr + lane)
    * vec ...`` for access ``v``: a warp's accesses of one ``v`` are contiguous."""

    tpr: int
    rpc: int
    vec: int
    per: int
    steps: int

    @property
    def threads(self) -> int:
        return self.tpr * self.rpc


def tile_plan(spec: Fp8QuantSpec) -> QuantPlan:
    """The tile plan of a group or block call. A block is one 128 x 128 tile (64 float32
    registers a thread at 256 threads); a group walks four tiles of 32 rows (8 KiB of bfloat16
    a load)."""
    chunks = -(-spec.k // GROUP)
    if spec.granularity is Granularity.BLOCK:
        return QuantPlan(GROUP, 1, 256)
    if spec.granularity is Granularity.GROUP:
        return QuantPlan(32, min(4, max(chunks, 1)), 128)
    raise ValueError(f"tile_plan: a row or the tensor takes row_plan, got {spec.granularity}")


def row_plan(k: int, dtype: str) -> RowPlan:
    """The row plan of rows of ``k`` elements of ``dtype``: the widest access that divides the
    row (16 bytes where ``k`` allows), 8 of them a thread (16 of narrower ones) in a power of
    two of threads a row, at least 4 warps where a row takes more than one; rows of at most a
    warp's share pack into CTAs of 256 threads. A thread holds at most :data:`HELD_BYTES` of
    its row, up to :data:`ROW_THREADS` threads a row (32768 columns of bfloat16, 16384 of
    float32, all in one read); a longer row takes a CTA of :data:`ROW_THREADS` threads and
    steps of :data:`STEP_BYTES` a thread, read twice (the second read from L2, but for the
    first step, which stays in registers)."""
    item = _ITEMSIZE[dtype]
    k = max(k, 1)
    vec = widest_vec(k, dtype)
    width = vec * item
    nv = -(-k // vec)  # accesses in a row
    tpr = pow2_at_least(-(-nv // (8 if width >= VECTOR_BYTES else 16)))
    if tpr > _WARP:  # a row over several warps: at least 4, at most ROW_THREADS threads
        tpr = min(ROW_THREADS, max(128, tpr))
    per = -(-nv // tpr)
    while per * width > HELD_BYTES and tpr < ROW_THREADS:
        tpr *= 2
        per = -(-nv // tpr)
    if per * width <= HELD_BYTES:
        return RowPlan(tpr, _CTA_THREADS // tpr if tpr <= _WARP else 1, vec, per, 1)
    per = max(1, STEP_BYTES // width)
    return RowPlan(ROW_THREADS, 1, vec, per, -(-nv // (ROW_THREADS * per)))


def quant_plan(spec: Fp8QuantSpec) -> QuantPlan | RowPlan:
    """The plan of a call: :func:`tile_plan` for a group or a block, :func:`row_plan` for a
    row and the tensor."""
    if spec.granularity in (Granularity.GROUP, Granularity.BLOCK):
        return tile_plan(spec)
    return row_plan(spec.k, spec.dtype)


def tensor_partials(m: int, plan: RowPlan, sms: int) -> int:
    """The partial maxima (the CTAs of :func:`amax_program`) of the tensor granularity for
    ``m`` rows on ``sms`` SMs: :data:`AMAX_CTAS_PER_SM` an SM, at most one a CTA's rows and at
    most :data:`TENSOR_PARTIALS` (at least 1)."""
    groups = -(-m // plan.rpc)
    return max(1, min(groups, TENSOR_PARTIALS, AMAX_CTAS_PER_SM * sms))


def tensor_span(k: int, dtype: str, plan: RowPlan) -> int:
    """The row groups (``plan.rpc`` rows each) a CTA of the tensor's quantising program
    covers: :data:`TENSOR_CTA_BYTES` of ``x``, at least one."""
    return max(1, TENSOR_CTA_BYTES // (plan.rpc * max(k, 1) * _ITEMSIZE[dtype]))


def one_cta_serves(m: int, k: int, dtype: str) -> bool:
    """Whether the tensor granularity quantises ``[m, k]`` in one program of one CTA
    (:func:`tensor_one_program`): ``x`` of at most :data:`TENSOR_ONE_CTA_BYTES`."""
    return m * k * _ITEMSIZE[dtype] <= TENSOR_ONE_CTA_BYTES


def _inside(T, M, k: int, r, col):
    """Whether element ``(r, col)`` is inside ``[M, k]`` (the column test only where ``k``
    is not a multiple of the tile width)."""
    if k % GROUP:
        return T.And(r < M, col < k)
    return r < M


def _loader(T, M, k: int, rows: int):
    """The tile load the tile programs share: ``load(X, xf, r0, c)`` fills the float32 fragment
    with rows ``r0 ...`` of tile ``c`` of ``X`` (0 outside ``[M, k]``)."""

    @T.macro
    def load(X, xf, r0, c):
        for i, j in T.Parallel(rows, GROUP):
            xf[i, j] = T.if_then_else(_inside(T, M, k, r0 + i, c * GROUP + j),
                                      T.Cast("float32", X[r0 + i, c * GROUP + j]),
                                      T.float32(0))

    return load


def quant_program(k: int, dtype: str, fp8_dtype: str, granularity: Granularity,
                  plan: QuantPlan):
    """The tile programs' prim_func (``M`` dynamic), a group or a block: arguments ``(X, Q,
    S)``."""
    if granularity not in (Granularity.GROUP, Granularity.BLOCK):
        raise ValueError(f"quant_program: the tile programs serve groups and blocks, got "
                         f"{granularity}")
    _, T = tl()
    M = T.dynamic("M")
    rows, tiles, threads = plan
    chunks = -(-k // GROUP)
    fmax = FP8_MAX[fp8_dtype]
    g = granularity
    grid_x = -(-chunks // tiles)
    s_shape = (M, chunks) if g is Granularity.GROUP else (T.ceildiv(M, GROUP), chunks)
    load = _loader(T, M, k, rows)

    @T.macro
    def store(Q, xf, s, r0, c):
        for i, j in T.Parallel(rows, GROUP):
            if _inside(T, M, k, r0 + i, c * GROUP + j):
                Q[r0 + i, c * GROUP + j] = T.Cast(fp8_dtype,
                                                  T.clamp(xf[i, j] / s[i], -fmax, fmax))

    # One scale for the whole tile (a block) is a register of every thread: as a fragment
    # broadcast over the tile's rows, layout inference replicates the tile itself into every
    # thread.
    @T.macro
    def store_uniform(Q, xf, sc, r0, c):
        for i, j in T.Parallel(rows, GROUP):
            if _inside(T, M, k, r0 + i, c * GROUP + j):
                Q[r0 + i, c * GROUP + j] = T.Cast(fp8_dtype,
                                                  T.clamp(xf[i, j] / sc[0], -fmax, fmax))

    @T.prim_func
    def quant(X: T.Tensor((M, k), dtype), Q: T.Tensor((M, k), fp8_dtype),
              S: T.Tensor(s_shape, "float32")):
        with T.Kernel(grid_x, T.ceildiv(M, rows), threads=threads) as (bx, by):
            xf = T.alloc_fragment((rows, GROUP), "float32")
            amax = T.alloc_fragment((rows,), "float32")
            s = T.alloc_fragment((rows,), "float32")
            whole = T.alloc_fragment((1,), "float32")
            sc = T.alloc_local((1,), "float32")
            r0 = by * rows
            if g is Granularity.BLOCK:
                load(X, xf, r0, bx)
                T.reduce_absmax(xf, amax, dim=1)
                T.reduce_max(amax, whole, dim=0)
                sc[0] = T.max(whole[0], AMAX_FLOOR) / fmax
                S[by, bx] = sc[0]
                store_uniform(Q, xf, sc, r0, bx)
            else:
                for t in T.serial(tiles):
                    if bx * tiles + t < chunks:
                        load(X, xf, r0, bx * tiles + t)
                        T.reduce_absmax(xf, amax, dim=1)
                        for i in T.Parallel(rows):
                            s[i] = T.max(amax[i], AMAX_FLOOR) / fmax
                        for i in T.Parallel(rows):
                            if r0 + i < M:
                                S[r0 + i, bx * tiles + t] = s[i]
                        store(Q, xf, s, r0, bx * tiles + t)

    return quant


class _RowPieces(NamedTuple):
    load: Any
    fold: Any
    store: Any
    reduce_row: Any
    reduce_cta: Any


def _row_pieces(T, M, k: int, dtype: str, fp8_dtype: str | None, plan: RowPlan) -> _RowPieces:
    """The macros the row programs share, over ``X`` / ``Q`` of ``[M, k]``:

    - ``load(X, buf, row, lane, step)``: the thread's ``per`` accesses of step ``step`` of
      ``row`` into ``buf`` (``dtype``; 0 outside ``[M, k]``, which changes no maximum);
    - ``fold(acc, buf)``: ``acc[0]`` = the larger of it and every ``|buf|``;
    - ``store(Q, buf, row, lane, step, sc)``: ``clamp(buf / sc)`` cast to ``fp8_dtype`` into
      the same places of ``Q`` (none outside ``[M, k]``);
    - ``reduce_row(acc, red, lane, grp)``: ``acc[0]`` the maximum over the row's threads
      (shuffles in a warp, ``red`` across the warps of a row);
    - ``reduce_cta(acc, red, tx)``: the maximum over every thread of the CTA."""
    tpr, rpc, vec, per, steps = plan
    threads = tpr * rpc
    exact = k == tpr * per * vec * steps  # every access inside the row
    f32 = "float32"
    fmax = FP8_MAX[fp8_dtype] if fp8_dtype else 0.0
    span = min(tpr, _WARP)  # lanes of a row within its warp
    wpr = max(1, tpr // _WARP)  # warps a row
    warps = threads // _WARP

    @T.macro
    def load(X, buf, row, lane, step):
        for v in T.unroll(per):
            col = ((step * per + v) * tpr + lane) * vec
            if row < M and (exact or col < k):
                for i in T.vectorized(vec):
                    buf[v * vec + i] = X[row, col + i]
            else:
                for i in T.unroll(vec):
                    buf[v * vec + i] = T.cast(0, dtype)

    @T.macro
    def fold(acc, buf):
        for j in T.unroll(per * vec):
            acc[0] = T.max(acc[0], T.abs(T.cast(buf[j], f32)))

    @T.macro
    def store(Q, buf, row, lane, step, sc):
        for v in T.unroll(per):
            col = ((step * per + v) * tpr + lane) * vec
            if row < M and (exact or col < k):
                for i in T.vectorized(vec):
                    Q[row, col + i] = T.cast(
                        T.clamp(T.cast(buf[v * vec + i], f32) / sc, -fmax, fmax), fp8_dtype)

    @T.macro
    def reduce_row(acc, red, lane, grp):
        if span > 1:
            for s in T.unroll(span.bit_length() - 1):
                acc[0] = T.max(acc[0], T.shfl_xor(acc[0], (span // 2) >> s))
        if wpr > 1:
            if lane % _WARP == 0:
                red[grp * wpr + lane // _WARP] = acc[0]
            T.sync_threads()
            for w in T.unroll(wpr):
                acc[0] = T.max(acc[0], red[grp * wpr + w])

    @T.macro
    def reduce_cta(acc, red, tx):
        for s in T.unroll(5):
            acc[0] = T.max(acc[0], T.shfl_xor(acc[0], 16 >> s))
        if warps > 1:
            if tx % _WARP == 0:
                red[tx // _WARP] = acc[0]
            T.sync_threads()
            for w in T.unroll(warps):
                acc[0] = T.max(acc[0], red[w])

    return _RowPieces(load, fold, store, reduce_row, reduce_cta)


def row_program(k: int, dtype: str, fp8_dtype: str, plan: RowPlan):
    """The row granularity's prim_func ``(X, Q, S)`` (``M`` dynamic; ``S`` ``[M, 1]``): a CTA
    of ``plan.rpc`` rows, ``plan.tpr`` threads a row. A row held whole (``plan.steps`` 1) is
    read once: its maximum is folded from registers, reduced across its threads, the scale
    written and the quotients written from the same registers. A longer row keeps its first
    step in registers and reads the rest twice (the maximum, then the quotients)."""
    _, T = tl()
    M = T.dynamic("M")
    tpr, rpc, vec, per, steps = plan
    fmax = FP8_MAX[fp8_dtype]
    wpr = max(1, tpr // _WARP)
    rp = _row_pieces(T, M, k, dtype, fp8_dtype, plan)

    @T.prim_func
    def quant_row(X: T.Tensor((M, k), dtype), Q: T.Tensor((M, k), fp8_dtype),
                  S: T.Tensor((M, 1), "float32")):
        with T.Kernel(T.ceildiv(M, rpc), threads=tpr * rpc) as bx:
            tx = T.get_thread_binding()
            lane = tx % tpr
            grp = tx // tpr
            row = bx * rpc + grp
            held = T.alloc_local((per * vec,), dtype)
            buf = T.alloc_local((per * vec,), dtype)
            acc = T.alloc_local((2,), "float32")  # the maximum, the scale
            red = T.alloc_shared((rpc * wpr,), "float32")
            rp.load(X, held, row, lane, 0)
            acc[0] = T.float32(0)
            rp.fold(acc, held)
            for step in T.serial(steps - 1):
                rp.load(X, buf, row, lane, step + 1)
                rp.fold(acc, buf)
            rp.reduce_row(acc, red, lane, grp)
            acc[1] = T.max(acc[0], AMAX_FLOOR) / fmax
            if row < M and lane == 0:
                S[row, 0] = acc[1]
            rp.store(Q, held, row, lane, 0, acc[1])
            for step in T.serial(steps - 1):
                rp.load(X, buf, row, lane, step + 1)
                rp.store(Q, buf, row, lane, step + 1, acc[1])

    return quant_row


def tensor_one_program(k: int, dtype: str, fp8_dtype: str, plan: RowPlan):
    """The tensor granularity in one program of one CTA, for a small tensor
    (:func:`one_cta_serves`): ``(X, Q, S)``, ``S`` the scale viewed ``[1]``. The CTA walks
    its row groups (``plan.rpc`` rows, every step of a long row), folding the maximum, reduces
    it across the CTA, and quantises: the first group from registers, the rest read again
    (from L1 / L2)."""
    _, T = tl()
    M = T.dynamic("M")
    tpr, rpc, vec, per, steps = plan
    fmax = FP8_MAX[fp8_dtype]
    threads = tpr * rpc
    rp = _row_pieces(T, M, k, dtype, fp8_dtype, plan)

    @T.prim_func
    def quant_tensor_one(X: T.Tensor((M, k), dtype), Q: T.Tensor((M, k), fp8_dtype),
                         S: T.Tensor((1,), "float32")):
        with T.Kernel(1, threads=threads):
            tx = T.get_thread_binding()
            lane = tx % tpr
            grp = tx // tpr
            held = T.alloc_local((per * vec,), dtype)
            buf = T.alloc_local((per * vec,), dtype)
            acc = T.alloc_local((2,), "float32")
            red = T.alloc_shared((threads // _WARP,), "float32")
            units = T.ceildiv(M, rpc) * steps  # (row group, step) pairs
            rp.load(X, held, grp, lane, 0)
            acc[0] = T.float32(0)
            rp.fold(acc, held)
            for u in T.serial(units - 1):
                rp.load(X, buf, (u + 1) // steps * rpc + grp, lane, (u + 1) % steps)
                rp.fold(acc, buf)
            rp.reduce_cta(acc, red, tx)
            acc[1] = T.max(acc[0], AMAX_FLOOR) / fmax
            if tx == 0:
                S[0] = acc[1]
            rp.store(Q, held, grp, lane, 0, acc[1])
            for u in T.serial(units - 1):
                rp.load(X, buf, (u + 1) // steps * rpc + grp, lane, (u + 1) % steps)
                rp.store(Q, buf, (u + 1) // steps * rpc + grp, lane, (u + 1) % steps, acc[1])

    return quant_tensor_one


def amax_program(k: int, dtype: str, plan: RowPlan):
    """``PART[p]`` = the absolute maximum of the row groups ``p, p + P, ...`` of ``X`` (groups
    of ``plan.rpc`` rows; ``P`` the length of ``PART``, a launch-time size, as ``M``): each
    thread folds its accesses into one running maximum, reduced across the CTA once at the
    end. The groups read last are the tensor's last (see :func:`tensor_quant_program`)."""
    _, T = tl()
    M = T.dynamic("M")
    P = T.dynamic("P")
    tpr, rpc, vec, per, steps = plan
    threads = tpr * rpc
    rp = _row_pieces(T, M, k, dtype, None, plan)

    @T.prim_func
    def amax(X: T.Tensor((M, k), dtype), PART: T.Tensor((P,), "float32")):
        with T.Kernel(P, threads=threads) as p:
            tx = T.get_thread_binding()
            lane = tx % tpr
            grp = tx // tpr
            buf = T.alloc_local((per * vec,), dtype)
            acc = T.alloc_local((1,), "float32")
            red = T.alloc_shared((threads // _WARP,), "float32")
            acc[0] = T.float32(0)
            for t in T.serial(T.ceildiv(T.ceildiv(M, rpc) - p, P)):
                for step in T.serial(steps):
                    rp.load(X, buf, (p + t * P) * rpc + grp, lane, step)
                    rp.fold(acc, buf)
            rp.reduce_cta(acc, red, tx)
            if tx == 0:
                PART[p] = acc[0]

    return amax


def tensor_quant_program(k: int, dtype: str, fp8_dtype: str, plan: RowPlan):
    """The tensor granularity's quantising prim_func ``(X, PART, Q, S)`` after
    :func:`amax_program` (``PART`` its partial maxima, at most :data:`TENSOR_PARTIALS`;
    ``S`` the scale viewed ``[1]``). CTA ``b`` covers :func:`tensor_span` row groups counted
    from the tensor's end (``G - 1 - b * span`` down), so the first CTAs to run read what the
    maximum's program read last, while it may still be in L2. Each CTA issues its first
    group's loads, reduces the partials (every one a thread's load at once) across the CTA,
    and quantises."""
    _, T = tl()
    M = T.dynamic("M")
    P = T.dynamic("P")
    tpr, rpc, vec, per, steps = plan
    fmax = FP8_MAX[fp8_dtype]
    threads = tpr * rpc
    span = tensor_span(k, dtype, plan)
    rp = _row_pieces(T, M, k, dtype, fp8_dtype, plan)

    @T.prim_func
    def quant_tensor(X: T.Tensor((M, k), dtype), PART: T.Tensor((P,), "float32"),
                     Q: T.Tensor((M, k), fp8_dtype), S: T.Tensor((1,), "float32")):
        with T.Kernel(T.ceildiv(T.ceildiv(M, rpc), span), threads=threads) as b:
            tx = T.get_thread_binding()
            lane = tx % tpr
            grp = tx // tpr
            held = T.alloc_local((per * vec,), dtype)
            buf = T.alloc_local((per * vec,), dtype)
            acc = T.alloc_local((2,), "float32")
            red = T.alloc_shared((threads // _WARP,), "float32")
            last = T.ceildiv(M, rpc) - 1  # the tensor's last row group
            rp.load(X, held, (last - b * span) * rpc + grp, lane, 0)
            acc[0] = T.float32(0)
            for i in T.unroll(-(-TENSOR_PARTIALS // threads)):
                if i * threads + tx < P:
                    acc[0] = T.max(acc[0], PART[i * threads + tx])
            rp.reduce_cta(acc, red, tx)
            acc[1] = T.max(acc[0], AMAX_FLOOR) / fmax
            if b == 0 and tx == 0:
                S[0] = acc[1]
            rp.store(Q, held, (last - b * span) * rpc + grp, lane, 0, acc[1])
            for u in T.serial(span * steps - 1):
                if (u + 1) // steps <= last - b * span:
                    rp.load(X, buf, (last - b * span - (u + 1) // steps) * rpc + grp, lane,
                            (u + 1) % steps)
                    rp.store(Q, buf, (last - b * span - (u + 1) // steps) * rpc + grp, lane,
                             (u + 1) % steps, acc[1])

    return quant_tensor


@stored(maxsize=64)
def build_quant_kernel(k: int, dtype: str, fp8_dtype: str, granularity: Granularity,
                       plan: QuantPlan | RowPlan, target: str | None = None):
    """Compile a granularity's quantising program (cached per process; TileLang also caches
    on disk): :func:`quant_program` for a group or a block, :func:`row_program` for a row,
    :func:`tensor_quant_program` for the tensor (the second of its two programs)."""
    if granularity is Granularity.ROW:
        prog = row_program(k, dtype, fp8_dtype, plan)
    elif granularity is Granularity.TENSOR:
        prog = tensor_quant_program(k, dtype, fp8_dtype, plan)
    else:
        prog = quant_program(k, dtype, fp8_dtype, granularity, plan)
    return compile_program(prog, target)


@stored(maxsize=32)
def build_amax_kernel(k: int, dtype: str, plan: RowPlan, target: str | None = None):
    """Compile :func:`amax_program`."""
    return compile_program(amax_program(k, dtype, plan), target)


@stored(maxsize=32)
def build_tensor_one_kernel(k: int, dtype: str, fp8_dtype: str, plan: RowPlan,
                            target: str | None = None):
    """Compile :func:`tensor_one_program`."""
    return compile_program(tensor_one_program(k, dtype, fp8_dtype, plan), target)


#: the builders of :func:`program_keys`, by the key's first element
BUILDERS = {"quant": build_quant_kernel, "amax": build_amax_kernel,
            "tensor_one": build_tensor_one_kernel}


def program_keys(spec: Fp8QuantSpec) -> list[tuple]:
    """The programs the entry of ``spec`` builds, each ``(builder, *arguments)`` with the
    builder named as in :data:`BUILDERS`: none for ``K = 0``; the granularity's quantising
    program; for the tensor its maximum's program and, where a tensor of one row would be
    served by it (:func:`one_cta_serves`), the one-CTA program."""
    if spec.k == 0:
        return []
    plan = quant_plan(spec)
    keys = [("quant", spec.k, spec.dtype, spec.fp8_dtype, spec.granularity, plan)]
    if spec.granularity is Granularity.TENSOR:
        keys.append(("amax", spec.k, spec.dtype, plan))
        if one_cta_serves(1, spec.k, spec.dtype):
            keys.append(("tensor_one", spec.k, spec.dtype, spec.fp8_dtype, plan))
    return keys


class Fp8QuantKernel(Kernel, Fp8QuantInterface):
    """Every quantising call on sm_80+ (the fp8 conversions need sm_89 for hardware cvt;
    TileLang emits the software conversion below it). One entry serves every ``M``: it builds
    every program of :func:`program_keys` and picks among the tensor's by ``M`` at the call."""

    general = True
    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})

    @classmethod
    def identity(cls, spec: Fp8QuantSpec) -> Any:
        return (spec.device, spec.k, spec.dtype, spec.fp8_dtype, spec.granularity)

    def __init__(self, spec: Fp8QuantSpec) -> None:
        super().__init__(spec)
        self.plan = quant_plan(spec)
        built = {key[0]: BUILDERS[key[0]](*key[1:]) for key in program_keys(spec)}
        self.program = built.get("quant")
        self.amax = built.get("amax")
        self.one = built.get("tensor_one")

    def __call__(self, x, q, scale) -> None:
        import torch

        m = x.shape[0]
        spec = self.spec
        if m == 0 or self.program is None:  # no element: each scale block is empty
            scale.fill_(AMAX_FLOOR / FP8_MAX[spec.fp8_dtype])
            return
        if spec.granularity is not Granularity.TENSOR:
            self.program(x, q, scale)
        elif self.one is not None and one_cta_serves(m, spec.k, spec.dtype):
            self.one(x, q, scale.view(1))
        else:
            part = torch.empty(tensor_partials(m, self.plan, sm_count(x.device)),
                               dtype=torch.float32, device=x.device)
            self.amax(x, part)
            self.program(x, part, q, scale.view(1))
