"""Row normalizations (RMSNorm, fused add + RMSNorm, LayerNorm) in TileLang.

Every kernel here normalizes each row of an ``(M, N)`` view of its input; ``M`` is a launch-
time size (one compiled program serves every batch size), ``N``, the dtype, ``eps`` and which
affine tensors are present are compiled in. Arithmetic is fp32 whatever the storage dtype.

Two implementations serve the one slot :class:`RowNormFwdInterface`:

:class:`RowNormRegisterKernel` -- a row (or, for narrow rows, several rows per CTA, one warp
    a row) is read once into registers with 16-byte vector loads, reduced with warp shuffles
    (and shared memory across the warps of a row), normalized and written from registers.
    Memory traffic is the floor: each input read once, each output written once. It serves
    rows whose share per thread fits the register budget (128 bytes a thread, up to 512
    threads: rows up to 64 KiB).
:class:`RowNormClusterKernel` -- few rows of a wide row (sm_90): a row split over the CTAs
    of a thread-block cluster, each holding its share in registers, the sums exchanged over
    distributed shared memory; one read and one write. It serves 32 rows or fewer of rows of
    at least 128 KiB (where the H200 measured it ahead).
:class:`RowNormLoopedKernel` -- the general one: any ``N``. One CTA a row, 1024 threads,
    walking the row in chunks twice (sums, then normalize and write); the second read comes
    from L2 for all but the widest rows.

Rows whose length is not a multiple of the 16-byte vector (``N = 4097``) are read with the
widest access the alignment allows (down to one element): rows start at ``N * itemsize``
byte offsets, so a wider access would be misaligned.

The fused add computes ``s = x + residual`` in fp32, stores ``residual_out = s`` rounded to the
storage dtype and normalizes that rounded value (so ``y == rmsnorm(residual_out)`` exactly, as
the unfused reference computes it).
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
from typing import Any, ClassVar, Literal, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

from ._store import stored
from ._tilelang import compile_program, tl
from ._tilelang import pow2_at_least as _pow2_at_least
from ._tilelang import widest_vec as _vec

__all__ = [
    "FEW_ROWS",
    "RowNormClusterKernel",
    "RowNormDType",
    "RowNormFwdInterface",
    "RowNormKind",
    "RowNormLoopedKernel",
    "RowNormRegisterKernel",
    "RowNormSpec",
    "RowNormSplitKernel",
    "SPLITS",
    "build_cluster_kernel",
    "build_register_kernel",
    "build_looped_kernel",
    "build_split_kernel",
    "cluster_plan",
    "register_plan",
    "looped_plan",
    "split_plan",
    "split_programs",
]

_VECTOR_BYTES = 16
_WARP = 32
#: bytes of a row one thread may hold in registers (beyond this the looped kernel runs)
_HELD_BYTES_PER_THREAD = 128
_MAX_THREADS = 1024
_MAX_REGISTER_THREADS = 512
#: fewer rows than this are latency-bound (about one row per SM of an H100/H200)
FEW_ROWS = 132


class RowNormKind(enum.Enum):
    """Which normalization a row-norm call computes."""

    RMS = "rms"  # x * rsqrt(mean(x^2) + eps) * weight
    LAYER = "layer"  # (x - mean) * rsqrt(var + eps) * weight + bias
    ADD_RMS = "add_rms"  # residual_out = x + residual; y = rms(residual_out) * weight


#: the storage dtypes the row-norm kernels are written for
RowNormDType = Literal["float16", "bfloat16", "float32"]
_ROW_NORM_DTYPES = frozenset(get_args(RowNormDType))


class RowNormSpec(CallSpec, frozen=True, kw_only=True):
    """What a row-norm implementation is told about a call: the facts of the call, not how to
    launch it (the row count is exact; which launch plan a row count gets, e.g. the few-rows
    plan below :data:`FEW_ROWS`, is the implementation's choice)."""

    kind: RowNormKind
    rows: int  # rows of the (rows, n) view
    n: int  # row length
    dtype: RowNormDType  # storage dtype name
    eps: float
    has_weight: bool
    has_bias: bool

    def __post_init__(self) -> None:
        if not isinstance(self.kind, RowNormKind):
            raise TypeError(f"RowNormSpec.kind must be a RowNormKind, got {self.kind!r}")
        self.check_fields(choices={"dtype": _ROW_NORM_DTYPES}, sizes=("rows", "n"))
        if self.has_bias and self.kind is not RowNormKind.LAYER:
            raise ValueError(f"RowNormSpec: only LAYER normalizes with a bias, not {self.kind}")

    @property
    def few_rows(self) -> bool:
        """Fewer rows than :data:`FEW_ROWS`: the latency-bound launch plan."""
        return self.rows < FEW_ROWS


class RowNormFwdInterface(KernelInterface):
    """One slot: normalize the rows of ``x`` (plus ``residual`` for the fused add).

    ``forward(x, residual, weight, bias, y, residual_out)`` with 2-D contiguous ``x``,
    ``residual``, ``y``, ``residual_out`` of shape ``(M, N)`` and 1-D ``weight``/``bias`` of
    ``N``; absent ones are None. ``y`` may be ``x`` and ``residual_out`` may be ``residual``
    (the in-place fused form).
    """

    slot = "row_norm_fwd"
    call_spec = RowNormSpec


# --- plans: the launch shape of each kernel, chosen from (N, dtype) ---------------------------


def register_plan(n: int, dtype: str, few_rows: bool = False
                  ) -> tuple[int, int, int, int] | None:
    """``(threads_per_row, rows_per_cta, vec, per)`` for the register kernel, or None when a
    row does not fit: each thread holds ``per`` accesses of ``vec`` elements.

    Chosen from sweeps on the H200 (benchmarks/results/norm_sweep.txt and norm.md):

    - many rows (bandwidth-bound): 16-byte accesses do best with 8 in flight per thread
      (128 B) on 128 to 256 threads a row (16384 x bf16: 256 threads x 8 reached 4180 GB/s,
      512 x 4 only 3024); narrower accesses with about 16 (4097 x bf16, one element each:
      256 x 17 gave 3348 GB/s, 1024 x 5 gave 1262). Rows of at most a warp's share pack 8
      rows (one warp each) into a CTA (128 x bf16: 1815 GB/s against 1379 with 4); wider
      rows take a CTA each (two 128-thread rows a CTA cost LayerNorm a third of its rate).
    - few rows (fewer than the SMs: latency-bound): spread a row over as many threads as
      give each at most two accesses.

    A thread holds at most _HELD_BYTES_PER_THREAD of its row; wider rows spread over up to
    _MAX_REGISTER_THREADS threads, and beyond that go to the looped kernel (64 x 65536 x
    bf16: looped 2380 GB/s, 1024 threads x 8 held 1779).
    """
    item = _ITEMSIZE[dtype]
    vec = _vec(n, dtype)
    width = vec * item
    nv = -(-n // vec)  # accesses in a row
    if few_rows:
        tpr = min(_MAX_REGISTER_THREADS, max(_WARP, _pow2_at_least(-(-nv // 2))))
    else:
        want = 8 if width >= _VECTOR_BYTES else 16
        tpr = _pow2_at_least(-(-nv // want))
        tpr = _WARP if tpr <= _WARP else min(256, max(128, tpr))
    per = -(-nv // tpr)
    if per * width > _HELD_BYTES_PER_THREAD:
        tpr = min(_MAX_REGISTER_THREADS,
                  _pow2_at_least(-(-nv * width // _HELD_BYTES_PER_THREAD)))
        per = -(-nv // tpr)
        if per * width > _HELD_BYTES_PER_THREAD:
            return None
    rpc = 256 // _WARP if tpr == _WARP and not few_rows else 1
    return tpr, rpc, vec, per


def _direct_row_load_fails(n: int) -> bool:
    """Whether TileLang cannot lower a load of one fixed column of a row, ``X[row, 0]``, for
    rows of ``n`` elements.

    TileLang 0.1.15's StorageRewrite pass records, for every scalar load from a tensor, the
    stride pattern of its index (the modular coefficient: ``n`` for ``row * n + 0``) as the lane
    count of a vector type. A TVM ``DataType`` keeps its lanes in 16 bits and reads them back signed,
    negative meaning a scalable vector, so an ``n`` of ``2**15`` or more modulo ``2**16``
    (100000, 131071, 2**20 - 1) stops lowering with "Can't fetch the lanes of a scalable
    vector at a compile time". A load whose column varies with the thread has a stride
    pattern of at most the vector width and is not affected; only the looped LayerNorm's shift
    reads a fixed column. For these ``n`` the warp's lanes read columns 0 to 31 and lane 0's
    value is broadcast (every ``n`` affected is far wider than a warp); the other ``n`` keep
    the one direct load, and their programs are unchanged.
    """
    return n % (1 << 16) >= 1 << 15


def looped_plan(n: int, dtype: str) -> tuple[int, int, int]:
    """``(threads, vec, per)``: each pass walks the row in chunks of threads * vec * per."""
    vec = _vec(n, dtype)
    return _MAX_THREADS, vec, 2


# --- TileLang programs -----------------------------------------------------------------------


def _tensor_shapes(kind: str, n: int, has_weight: bool, has_bias: bool, M: Any):
    add = kind == "add_rms"
    return {
        "x": (M, n),
        "r": (M, n) if add else (1,),
        "w": (n,) if has_weight else (1,),
        "b": (n,) if has_bias else (1,),
        "y": (M, n),
        "ro": (M, n) if add else (1,),
    }


def _with_params(body, shapes: dict, dtype: str, add: bool, has_weight: bool, has_bias: bool):
    """The prim_func taking exactly the tensors present, in the order
    ``x, [residual], [weight], [bias], y, [residual_out]``.

    Every tensor argument costs the launch (DLPack conversion and checks in the FFI) about
    1.5-2 us of host time, so absent tensors are not passed as placeholders: each set of
    present tensors gets its own signature around the one body (a macro; absent tensors are
    None there and never read).
    """
    _, T = tl()
    sx, sr, sw, sb, sy, sro = (shapes[k] for k in ("x", "r", "w", "b", "y", "ro"))
    if add and has_weight:
        @T.prim_func
        def main(X: T.Tensor(sx, dtype), R: T.Tensor(sr, dtype), W: T.Tensor(sw, dtype),
                 Y: T.Tensor(sy, dtype), RO: T.Tensor(sro, dtype)):
            body(X, R, W, None, Y, RO)
    elif add:
        @T.prim_func
        def main(X: T.Tensor(sx, dtype), R: T.Tensor(sr, dtype), Y: T.Tensor(sy, dtype),
                 RO: T.Tensor(sro, dtype)):
            body(X, R, None, None, Y, RO)
    elif has_weight and has_bias:
        @T.prim_func
        def main(X: T.Tensor(sx, dtype), W: T.Tensor(sw, dtype), B: T.Tensor(sb, dtype),
                 Y: T.Tensor(sy, dtype)):
            body(X, None, W, B, Y, None)
    elif has_weight:
        @T.prim_func
        def main(X: T.Tensor(sx, dtype), W: T.Tensor(sw, dtype), Y: T.Tensor(sy, dtype)):
            body(X, None, W, None, Y, None)
    elif has_bias:
        @T.prim_func
        def main(X: T.Tensor(sx, dtype), B: T.Tensor(sb, dtype), Y: T.Tensor(sy, dtype)):
            body(X, None, None, B, Y, None)
    else:
        @T.prim_func
        def main(X: T.Tensor(sx, dtype), Y: T.Tensor(sy, dtype)):
            body(X, None, None, None, Y, None)
    return main


def _held_macros(T, kind: str, n: int, dtype: str, has_weight: bool, has_bias: bool,
                 width: int, vec: int, per: int, exact: bool):
    """What the register and the cluster programs do with a thread's ``per`` accesses of
    ``vec`` elements of its row (columns ``base + (v * width + lane) * vec``; a row below
    ``M`` only): ``load`` them (and the residual's), ``add_and_sum`` (the fused add, written
    to ``RO``, then the sum, or sum of squares, into ``acc[0]``), ``centred`` (LayerNorm's sum
    of squares about ``mean`` into ``acc[1]``) and ``normalize`` (``(x - acc[0]) * acc[1]``,
    the weight and bias, stored to ``Y``). ``exact``: no column predicate."""
    add, layer = kind == "add_rms", kind == "layer"
    f32 = "float32"

    @T.macro
    def load(X, R, held, held_r, row, base, lane, M):
        for v in T.unroll(per):
            col = base + (v * width + lane) * vec
            if row < M and (exact or col < n):
                for i in T.vectorized(vec):
                    held[v * vec + i] = X[row, col + i]
                if add:
                    for i in T.vectorized(vec):
                        held_r[v * vec + i] = R[row, col + i]
            else:
                for i in T.unroll(vec):
                    held[v * vec + i] = T.cast(0, dtype)
                    if add:
                        held_r[v * vec + i] = T.cast(0, dtype)

    @T.macro
    def add_and_sum(RO, held, held_r, acc, row, base, lane, M):
        for v in T.unroll(per):
            col = base + (v * width + lane) * vec
            if add:
                for i in T.unroll(vec):
                    held[v * vec + i] = T.cast(T.cast(held[v * vec + i], f32)
                                               + T.cast(held_r[v * vec + i], f32), dtype)
                if row < M and (exact or col < n):
                    for i in T.vectorized(vec):
                        RO[row, col + i] = held[v * vec + i]
            for i in T.unroll(vec):
                acc[0] += T.cast(held[v * vec + i], f32) * (
                    1.0 if layer else T.cast(held[v * vec + i], f32))

    @T.macro
    def centred(held, acc, mean, row, base, lane, M):
        for v in T.unroll(per):
            col = base + (v * width + lane) * vec
            if row < M and (exact or col < n):
                for i in T.unroll(vec):
                    d = T.cast(held[v * vec + i], f32) - mean
                    acc[1] += d * d

    @T.macro
    def normalize(W, B, Y, held, piece, other, acc, row, base, lane, M):
        for v in T.unroll(per):
            col = base + (v * width + lane) * vec
            if row < M and (exact or col < n):
                if has_weight:
                    for i in T.vectorized(vec):
                        other[i] = W[col + i]
                if has_bias:
                    for i in T.vectorized(vec):
                        piece[i] = B[col + i]
                for i in T.unroll(vec):
                    val = (T.cast(held[v * vec + i], f32) - acc[0]) * acc[1]
                    if has_weight:
                        val = val * T.cast(other[i], f32)
                    if has_bias:
                        val = val + T.cast(piece[i], f32)
                    held[v * vec + i] = T.cast(val, dtype)
                for i in T.vectorized(vec):
                    Y[row, col + i] = held[v * vec + i]

    return load, add_and_sum, centred, normalize


def register_program(kind: str, n: int, dtype: str, eps: float, has_weight: bool,
                     has_bias: bool, tpr: int, rpc: int, vec: int, per: int):
    """The TileLang prim_func of the register kernel (not compiled)."""
    _, T = tl()
    M = T.dynamic("M")
    shapes = _tensor_shapes(kind, n, has_weight, has_bias, M)
    add, layer = kind == "add_rms", kind == "layer"
    threads = tpr * rpc
    wpr = tpr // _WARP  # warps a row
    exact = n == tpr * per * vec  # no column predicate needed
    f32 = "float32"
    inv_n = 1.0 / n
    load, add_and_sum, centred, normalize = _held_macros(
        T, kind, n, dtype, has_weight, has_bias, tpr, vec, per, exact)

    @T.macro
    def body(X, R, W, B, Y, RO):
        with T.Kernel(T.ceildiv(M, rpc), threads=threads) as bx:
            tx = T.get_thread_binding()
            lane = tx % tpr
            row = bx * rpc + tx // tpr
            held = T.alloc_local((per * vec,), dtype)
            held_r = T.alloc_local((per * vec if add else 1,), dtype)
            piece = T.alloc_local((vec,), dtype)
            other = T.alloc_local((vec,), dtype)
            acc = T.alloc_local((2,), f32)
            red = T.alloc_shared((rpc * wpr * 2 if wpr > 1 else 1,), f32)
            acc[0] = T.cast(0, f32)
            acc[1] = T.cast(0, f32)
            # Issue every load of the row before any store: the fused form may write RO over
            # R (in place), so a store between loads would keep the compiler from hoisting
            # the later loads and leave one vector in flight instead of `per`.
            load(X, R, held, held_r, row, 0, lane, M)
            add_and_sum(RO, held, held_r, acc, row, 0, lane, M)
            # row sum (layer) or sum of squares (rms) across the row's threads
            for s in T.unroll(5):
                acc[0] += T.shfl_xor(acc[0], 16 >> s)
            if wpr > 1:
                if lane % _WARP == 0:
                    red[(tx // tpr) * wpr + lane // _WARP] = acc[0]
                T.sync_threads()
                acc[0] = T.cast(0, f32)
                for w in T.unroll(wpr):
                    acc[0] += red[(tx // tpr) * wpr + w]
            if layer:
                # centred second moment from the held values: exact two-pass variance
                mean = acc[0] * inv_n
                centred(held, acc, mean, row, 0, lane, M)
                for s in T.unroll(5):
                    acc[1] += T.shfl_xor(acc[1], 16 >> s)
                if wpr > 1:
                    if lane % _WARP == 0:
                        red[rpc * wpr + (tx // tpr) * wpr + lane // _WARP] = acc[1]
                    T.sync_threads()
                    acc[1] = T.cast(0, f32)
                    for w in T.unroll(wpr):
                        acc[1] += red[rpc * wpr + (tx // tpr) * wpr + w]
                acc[1] = T.rsqrt(acc[1] * inv_n + eps)
                acc[0] = mean
            else:
                acc[1] = T.rsqrt(acc[0] * inv_n + eps)
                acc[0] = T.cast(0, f32)
            normalize(W, B, Y, held, piece, other, acc, row, 0, lane, M)

    return _with_params(body, shapes, dtype, add, has_weight, has_bias)


#: the most CTAs a row is split over (a portable cluster: up to 8 CTAs on sm_90)
_MAX_CLUSTER = 8
#: the fewest elements a CTA of a split row takes (below that, one CTA a row is as fast)
_MIN_CLUSTER_SHARE = 2048


def cluster_plan(rows: int, n: int, dtype: str, cluster: int | None = None
                 ) -> tuple[int, int, int, int] | None:
    """``(cluster, threads, vec, per)`` for the cluster kernel, or None where it does not
    apply: a row split over ``cluster`` CTAs of one cluster (a power of two, 2 to 8, as many
    as keep ``rows * cluster`` within :data:`FEW_ROWS` and each CTA's share at least
    ``_MIN_CLUSTER_SHARE`` elements), each holding its share in registers (``threads``
    threads with ``per`` accesses of ``vec`` elements, at most
    ``_HELD_BYTES_PER_THREAD`` bytes a thread, up to 1024 threads). ``cluster`` given (the
    sweep's): that split, whatever the row count; where its CTAs outnumber the SMs, at most
    512 threads a CTA, so two are resident on an SM."""
    if rows < 1:
        return None
    if cluster is None:
        cluster = 1
        while (cluster * 2 <= _MAX_CLUSTER and rows * cluster * 2 <= FEW_ROWS
               and n // (cluster * 2) >= _MIN_CLUSTER_SHARE):
            cluster *= 2
    elif cluster not in (2, 4, 8) or n // cluster < _MIN_CLUSTER_SHARE:
        return None
    if cluster == 1:
        return None
    item = _ITEMSIZE[dtype]
    vec = _vec(n, dtype)
    accesses = -(-n // vec)  # in a row
    share = -(-accesses // cluster)  # a CTA's
    cap = _MAX_THREADS if rows * cluster <= FEW_ROWS else _MAX_THREADS // 2
    threads = min(cap, max(_WARP, _pow2_at_least(-(-share // 4))))
    per = -(-share // threads)
    if per * vec * item > _HELD_BYTES_PER_THREAD:
        return None
    return cluster, threads, vec, per


def cluster_program(kind: str, n: int, dtype: str, eps: float, has_weight: bool,
                    has_bias: bool, cluster: int, threads: int, vec: int, per: int):
    """The TileLang prim_func of the cluster kernel (not compiled): the register kernel's
    arithmetic with each row split over the ``cluster`` CTAs of a thread-block cluster
    (sm_90). CTA ``r`` of a row's cluster holds columns ``r * share`` on; each reduction (the
    sum of squares, or LayerNorm's sum then centred sum of squares) is summed in the CTA, then
    each CTA pushes its partial into slot ``r`` of every CTA's shared array over distributed
    shared memory (``T.copy_cluster``), a cluster barrier orders the pushes before the reads,
    and every CTA adds the ``cluster`` partials in the same order, so all of a row's CTAs
    normalize with the same value. One read and one write of the row, as the register
    kernel; the grid is ``M * cluster`` CTAs."""
    _, T = tl()
    M = T.dynamic("M")
    shapes = _tensor_shapes(kind, n, has_weight, has_bias, M)
    add, layer = kind == "add_rms", kind == "layer"
    wpr = threads // _WARP
    share = threads * per * vec  # columns a CTA covers
    exact = n == cluster * share
    f32 = "float32"
    inv_n = 1.0 / n
    load, add_and_sum, centred, normalize = _held_macros(
        T, kind, n, dtype, has_weight, has_bias, threads, vec, per, exact)

    # one shared array, its parts disjoint: the warps' sums (2 * wpr), this CTA's partials (2),
    # the cluster's partials (2 * cluster). Separate arrays would let the storage planner
    # overlap them, unaware that other CTAs write the partials while this one still sums
    # its warps.
    mine, parts = 2 * wpr, 2 * wpr + 2

    @T.macro
    def cta_sum(acc, k, scratch, tx):
        # acc[k] summed over the CTA's threads; every thread ends with the total
        for s in T.unroll(5):
            acc[k] += T.shfl_xor(acc[k], 16 >> s)
        if wpr > 1:
            if tx % _WARP == 0:
                scratch[k * wpr + tx // _WARP] = acc[k]
            T.sync_threads()
            acc[k] = T.cast(0, f32)
            for w in T.unroll(wpr):
                acc[k] += scratch[k * wpr + w]

    @T.macro
    def cluster_sum(acc, k, scratch, rank, tx):
        # acc[k] summed over the cluster's CTAs, in rank order on every CTA
        if tx == 0:
            scratch[mine + k] = acc[k]
        T.sync_threads()
        slot = parts + k * cluster + rank
        for d in T.unroll(cluster):
            T.copy_cluster(scratch[mine + k:mine + k + 1], scratch[slot:slot + 1], dst_block=d)
        T.cluster_sync()
        acc[k] = T.cast(0, f32)
        for c in T.unroll(cluster):
            acc[k] += scratch[parts + k * cluster + c]

    @T.macro
    def body(X, R, W, B, Y, RO):
        with T.Kernel(M * cluster, threads=threads, cluster_dims=(cluster, 1, 1)) as bx:
            tx = T.get_thread_binding()
            rank = bx % cluster
            row = bx // cluster
            base = rank * share
            held = T.alloc_local((per * vec,), dtype)
            held_r = T.alloc_local((per * vec if add else 1,), dtype)
            piece = T.alloc_local((vec,), dtype)
            other = T.alloc_local((vec,), dtype)
            acc = T.alloc_local((2,), f32)
            scratch = T.alloc_shared((2 * wpr + 2 + 2 * cluster,), f32)
            acc[0] = T.cast(0, f32)
            acc[1] = T.cast(0, f32)
            load(X, R, held, held_r, row, base, tx, M)
            # every CTA of the cluster is running before any writes into another's memory
            T.cluster_sync()
            add_and_sum(RO, held, held_r, acc, row, base, tx, M)
            cta_sum(acc, 0, scratch, tx)
            cluster_sum(acc, 0, scratch, rank, tx)
            if layer:
                mean = acc[0] * inv_n
                centred(held, acc, mean, row, base, tx, M)
                cta_sum(acc, 1, scratch, tx)
                cluster_sum(acc, 1, scratch, rank, tx)
                acc[1] = T.rsqrt(acc[1] * inv_n + eps)
                acc[0] = mean
            else:
                acc[1] = T.rsqrt(acc[0] * inv_n + eps)
                acc[0] = T.cast(0, f32)
            normalize(W, B, Y, held, piece, other, acc, row, base, tx, M)

    return _with_params(body, shapes, dtype, add, has_weight, has_bias)


#: the row splits the split kernel takes (CTAs a row)
SPLITS = (4, 8, 16, 32, 64, 128)


def _default_split(rows: int, row_bytes: int, fits: tuple[int, ...]) -> int | None:
    """The split the op takes among those that ``fits``, from the H200's few-rows sweep
    (RMSNorm bf16, 1-64 rows of 256k-1M, benchmarks/results/norm_few_rows_wide-cuda0.txt): 32
    CTAs a row was the best or within 5% of it from 1 to 16 rows, 16 (four CTAs an SM) from 33 rows,
    and 64 for one or two rows of 1 MiB and more (1 x 1M: 0.90 TB/s against 32's 0.75); more
    CTAs a row than that ran slower everywhere (the second program's serial sum of partials
    and the smaller shares)."""
    if rows <= 2 and row_bytes >= 1 << 20 and 64 in fits:
        return 64
    small = [s for s in fits if s <= 32]
    if small:
        return next((s for s in small if rows * s >= 4 * FEW_ROWS), small[-1])
    return fits[0] if fits else None


def split_plan(rows: int, n: int, dtype: str, splits: int | None = None
               ) -> tuple[int, int, int, int] | None:
    """``(splits, threads, vec, per)`` for the split kernel (:func:`split_programs`), or None
    where it does not apply: fewer rows than :data:`FEW_ROWS`, each split over ``splits``
    CTAs, each CTA's share at least ``_MIN_CLUSTER_SHARE`` elements, read by ``threads``
    threads with ``per`` accesses of ``vec`` elements (at most ``_HELD_BYTES_PER_THREAD``
    bytes a thread). By default (:func:`_default_split`) ``splits`` is 64 for one or two rows
    of at least 1 MiB, else the fewest of :data:`SPLITS` up to 32 that fit and give four CTAs
    an SM, else the most up to 32 that fit, else the fewest above 32 that fit."""
    if rows < 1 or rows >= FEW_ROWS:
        return None
    if splits is None:
        fits = {s: p for s in SPLITS if (p := split_plan(rows, n, dtype, s)) is not None}
        return fits.get(_default_split(rows, n * _ITEMSIZE[dtype], tuple(fits)))
    if splits not in SPLITS:
        return None
    vec = _vec(n, dtype)
    accesses = n // vec
    share = -(-accesses // splits)
    if share * vec < _MIN_CLUSTER_SHARE:
        return None
    per_max = max(1, _HELD_BYTES_PER_THREAD // (vec * _ITEMSIZE[dtype]))
    threads = min(_MAX_THREADS // 2, max(2 * _WARP, _pow2_at_least(-(-share // per_max))))
    per = -(-share // threads)
    if per * vec * _ITEMSIZE[dtype] > _HELD_BYTES_PER_THREAD:
        return None
    return splits, threads, vec, per


def split_programs(n: int, dtype: str, eps: float, has_weight: bool, splits: int,
                   threads: int, vec: int, per: int):
    """The two TileLang prim_funcs of the split kernel (RMS, not compiled): each of a row's
    ``splits`` CTAs covers ``share`` accesses of ``vec`` columns (the last CTA fewer).
    ``partial(X, P)`` writes the CTA's sum of squares in float32 to ``P[row, s]``;
    ``scale(X, P, [W,] Y)`` adds the row's ``splits`` partials in one order (every CTA of a
    row gets the same scale), then reads its share again (an L2 hit where the rows fit it)
    and writes ``Y``. Two launches where the cluster kernel takes one, for ``splits`` CTAs
    a row beyond a cluster's 8 and no cluster barrier."""
    _, T = tl()
    M = T.dynamic("M")
    f32 = "float32"
    accesses = n // vec
    share = -(-accesses // splits)
    exact = share * splits == accesses and share == threads * per
    warps = threads // _WARP
    inv_n = 1.0 / n

    @T.macro
    def partial_body(X, P):
        with T.Kernel(splits, M, threads=threads) as (sx, row):
            tx = T.get_thread_binding()
            held = T.alloc_local((per * vec,), dtype)
            acc = T.alloc_local((1,), f32)
            red = T.alloc_shared((warps,), f32)
            acc[0] = T.cast(0, f32)
            # every load issued before any arithmetic: `per` vectors in flight a thread
            for v in T.unroll(per):
                a = v * threads + tx
                if exact or (a < share and sx * share + a < accesses):
                    for i in T.vectorized(vec):
                        held[v * vec + i] = X[row, (sx * share + a) * vec + i]
                else:
                    for i in T.unroll(vec):
                        held[v * vec + i] = T.cast(0, dtype)
            for j in T.unroll(per * vec):
                acc[0] += T.cast(held[j], f32) * T.cast(held[j], f32)
            for k in T.unroll(5):
                acc[0] += T.shfl_xor(acc[0], 16 >> k)
            if tx % _WARP == 0:
                red[tx // _WARP] = acc[0]
            T.sync_threads()
            if tx == 0:
                acc[0] = T.cast(0, f32)
                for w in T.unroll(warps):
                    acc[0] += red[w]
                P[row, sx] = acc[0]

    @T.macro
    def scale_body(X, P, W, Y):
        with T.Kernel(splits, M, threads=threads) as (sx, row):
            tx = T.get_thread_binding()
            held = T.alloc_local((per * vec,), dtype)
            wpiece = T.alloc_local((vec,), dtype)
            part = T.alloc_local((splits,), f32)
            acc = T.alloc_local((1,), f32)
            for v in T.unroll(per):
                a = v * threads + tx
                if exact or (a < share and sx * share + a < accesses):
                    for i in T.vectorized(vec):
                        held[v * vec + i] = X[row, (sx * share + a) * vec + i]
            # the row's partials in 16-byte loads (4 a load, where 32-bit loads issued one
            # each), added in one order for every CTA of the row
            for j in T.vectorized(splits):
                part[j] = P[row, j]
            acc[0] = T.cast(0, f32)
            for j in T.serial(splits):
                acc[0] += part[j]
            acc[0] = T.rsqrt(acc[0] * inv_n + eps)
            for v in T.unroll(per):
                a = v * threads + tx
                if exact or (a < share and sx * share + a < accesses):
                    col = (sx * share + a) * vec
                    if has_weight:
                        for i in T.vectorized(vec):
                            wpiece[i] = W[col + i]
                    for i in T.unroll(vec):
                        val = T.cast(held[v * vec + i], f32) * acc[0]
                        if has_weight:
                            val = val * T.cast(wpiece[i], f32)
                        held[v * vec + i] = T.cast(val, dtype)
                    for i in T.vectorized(vec):
                        Y[row, col + i] = held[v * vec + i]

    @T.prim_func
    def partial(X: T.Tensor((M, n), dtype), P: T.Tensor((M, splits), f32)):
        partial_body(X, P)

    if has_weight:
        @T.prim_func
        def scale(X: T.Tensor((M, n), dtype), P: T.Tensor((M, splits), f32),
                  W: T.Tensor((n,), dtype), Y: T.Tensor((M, n), dtype)):
            scale_body(X, P, W, Y)
    else:
        @T.prim_func
        def scale(X: T.Tensor((M, n), dtype), P: T.Tensor((M, splits), f32),
                  Y: T.Tensor((M, n), dtype)):
            scale_body(X, P, None, Y)

    return partial, scale


def looped_program(kind: str, n: int, dtype: str, eps: float, has_weight: bool,
                   has_bias: bool, threads: int, vec: int, per: int):
    """The general kernel: one CTA a row, two passes over the row in chunks."""
    _, T = tl()
    M = T.dynamic("M")
    shapes = _tensor_shapes(kind, n, has_weight, has_bias, M)
    add, layer = kind == "add_rms", kind == "layer"
    chunk = threads * vec * per
    steps = -(-n // chunk)
    warps = threads // _WARP
    f32 = "float32"
    inv_n = 1.0 / n
    spread = layer and _direct_row_load_fails(n)

    def first(X, row, col):
        """Element ``col`` of the row, in fp32 (only LayerNorm shifts by it; it has no
        residual)."""
        return T.cast(X[row, col], f32)

    @T.macro
    def body(X, R, W, B, Y, RO):
        with T.Kernel(M, threads=threads) as row:
            tx = T.get_thread_binding()
            piece = T.alloc_local((vec,), dtype)
            other = T.alloc_local((vec,), dtype)
            third = T.alloc_local((vec,), dtype)
            acc = T.alloc_local((3,), f32)  # sum, sum of squares (shifted), shift
            red = T.alloc_shared((warps * 2,), f32)
            acc[0] = T.cast(0, f32)
            acc[1] = T.cast(0, f32)
            # layer norm: shift by the row's first element (shifted-data variance, stable)
            if not layer:
                acc[2] = T.cast(0, f32)
            elif spread:  # see _direct_row_load_fails: lane 0's column-0 read is the shift
                acc[2] = T.shfl_sync(first(X, row, tx % _WARP), 0)
            else:
                acc[2] = first(X, row, 0)
            for step in T.serial(steps):
                for v in T.unroll(per):
                    col = step * chunk + (v * threads + tx) * vec
                    if col < n:
                        for i in T.vectorized(vec):
                            piece[i] = X[row, col + i]
                        if add:
                            for i in T.vectorized(vec):
                                other[i] = R[row, col + i]
                            for i in T.unroll(vec):
                                piece[i] = T.cast(T.cast(piece[i], f32)
                                                  + T.cast(other[i], f32), dtype)
                            for i in T.vectorized(vec):
                                RO[row, col + i] = piece[i]
                        for i in T.unroll(vec):
                            d = T.cast(piece[i], f32) - acc[2]
                            acc[0] += d
                            acc[1] += d * d
            for s in T.unroll(5):
                acc[0] += T.shfl_xor(acc[0], 16 >> s)
                acc[1] += T.shfl_xor(acc[1], 16 >> s)
            if tx % _WARP == 0:
                red[tx // _WARP] = acc[0]
                red[warps + tx // _WARP] = acc[1]
            T.sync_threads()
            acc[0] = T.cast(0, f32)
            acc[1] = T.cast(0, f32)
            for w in T.unroll(warps):
                acc[0] += red[w]
                acc[1] += red[warps + w]
            if layer:
                dm = acc[0] * inv_n
                acc[1] = T.rsqrt(T.max(acc[1] * inv_n - dm * dm, T.cast(0, f32)) + eps)
                acc[0] = acc[2] + dm
            else:
                acc[1] = T.rsqrt(acc[1] * inv_n + eps)
                acc[0] = T.cast(0, f32)
            for step in T.serial(steps):
                for v in T.unroll(per):
                    col = step * chunk + (v * threads + tx) * vec
                    if col < n:
                        if add:
                            for i in T.vectorized(vec):
                                piece[i] = RO[row, col + i]
                        else:
                            for i in T.vectorized(vec):
                                piece[i] = X[row, col + i]
                        if has_weight:
                            for i in T.vectorized(vec):
                                other[i] = W[col + i]
                        if has_bias:
                            for i in T.vectorized(vec):
                                third[i] = B[col + i]
                        for i in T.unroll(vec):
                            val = (T.cast(piece[i], f32) - acc[0]) * acc[1]
                            if has_weight:
                                val = val * T.cast(other[i], f32)
                            if has_bias:
                                val = val + T.cast(third[i], f32)
                            piece[i] = T.cast(val, dtype)
                        for i in T.vectorized(vec):
                            Y[row, col + i] = piece[i]

    return _with_params(body, shapes, dtype, add, has_weight, has_bias)


@stored(maxsize=256)
def build_register_kernel(kind: str, n: int, dtype: str, eps: float, has_weight: bool,
                          has_bias: bool, target: str | None = None,
                          plan: tuple[int, int, int, int] | None = None,
                          few_rows: bool = False):
    """Compile the register kernel (cached per configuration). ``plan`` overrides
    :func:`register_plan` (``(threads_per_row, rows_per_cta, vec, per)``), for tuning."""
    plan = plan or register_plan(n, dtype, few_rows)
    if plan is None:
        raise ValueError(f"a row of {n} {dtype} does not fit the register kernel")
    tpr, rpc, vec, per = plan
    prog = register_program(kind, n, dtype, eps, has_weight, has_bias, tpr, rpc, vec, per)
    return compile_program(prog, target)


@stored(maxsize=256)
def build_cluster_kernel(kind: str, n: int, dtype: str, eps: float, has_weight: bool,
                         has_bias: bool, target: str | None = None,
                         plan: tuple[int, int, int, int] | None = None):
    """Compile the cluster kernel for a :func:`cluster_plan` (cached per configuration)."""
    if plan is None:
        raise ValueError("the cluster kernel needs its plan (cluster_plan of the row count)")
    prog = cluster_program(kind, n, dtype, eps, has_weight, has_bias, *plan)
    return compile_program(prog, target)


@stored(maxsize=256)
def build_looped_kernel(kind: str, n: int, dtype: str, eps: float, has_weight: bool,
                        has_bias: bool, target: str | None = None, plan: Any = None,
                        few_rows: bool = False):
    threads, vec, per = looped_plan(n, dtype)
    prog = looped_program(kind, n, dtype, eps, has_weight, has_bias, threads, vec, per)
    return compile_program(prog, target)


@stored(maxsize=256)
def build_split_kernel(n: int, dtype: str, eps: float, has_weight: bool, part: str,
                       target: str | None = None,
                       plan: tuple[int, int, int, int] | None = None):
    """Compile one of :func:`split_programs` (``part``: ``"partial"`` or ``"scale"``) for a
    :func:`split_plan` (cached per configuration)."""
    if plan is None:
        raise ValueError("the split kernel needs its plan (split_plan of the row count)")
    if part not in ("partial", "scale"):
        raise ValueError(f"build_split_kernel: part is 'partial' or 'scale', not {part!r}")
    partial, scale = split_programs(n, dtype, eps, has_weight, *plan)
    return compile_program(partial if part == "partial" else scale, target)


# --- the implementations ---------------------------------------------------------------------


class _RowNormKernel(Kernel, RowNormFwdInterface):
    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    _build: ClassVar[Any] = None

    @classmethod
    def identity(cls, spec: RowNormSpec):
        # the program depends on the row count only through the launch plan it picks
        return (spec.kind, spec.n, spec.dtype, spec.eps, spec.has_weight, spec.has_bias,
                spec.device, spec.few_rows)

    def __init__(self, spec: RowNormSpec) -> None:
        super().__init__(spec)
        self.program = type(self)._build(spec.kind.value, spec.n, spec.dtype, spec.eps,
                                         spec.has_weight, spec.has_bias, None, None,
                                         spec.few_rows)
        # the program takes exactly the tensors present (see _with_params)
        self._present = (spec.kind is RowNormKind.ADD_RMS, spec.has_weight, spec.has_bias)

    def __call__(self, x, residual, weight, bias, y, residual_out) -> None:
        if x.shape[0] == 0:
            return
        add, has_w, has_b = self._present
        if add:
            if has_w:
                self.program(x, residual, weight, y, residual_out)
            else:
                self.program(x, residual, y, residual_out)
        elif has_w:
            if has_b:
                self.program(x, weight, bias, y)
            else:
                self.program(x, weight, y)
        elif has_b:
            self.program(x, bias, y)
        else:
            self.program(x, y)


class RowNormRegisterKernel(_RowNormKernel):
    """Rows held in registers: read once, 16-byte accesses where the row length allows."""

    _build = staticmethod(build_register_kernel)

    @classmethod
    def region_refusal(cls, spec: RowNormSpec) -> str | None:
        if register_plan(spec.n, spec.dtype, spec.few_rows) is None:
            return (f"a row of {spec.n} x {spec.dtype} exceeds the {_HELD_BYTES_PER_THREAD} "
                    f"bytes a thread holds at {_MAX_REGISTER_THREADS} threads")
        return None


#: the region the cluster kernel serves, from the H200's few_rows sweep (RMSNorm bf16,
#: benchmarks/results/gpu_session_2026-12-01b.md): at least 4 CTAs a row (32 rows or fewer)
#: and rows of at least 128 KiB, where it ran 1.2-3.2x the one-CTA-a-row kernels and ahead of
#: torch.compile; with 2 CTAs a row (64 rows) it was 0.92-1.13x of them
_CLUSTER_MIN_CTAS = 4
_CLUSTER_MIN_ROW_BYTES = 128 << 10


class RowNormClusterKernel(_RowNormKernel):
    """Few rows of a wide row: each row split over the CTAs of a thread-block cluster
    (sm_90), its reductions exchanged over distributed shared memory (:func:`cluster_program`),
    so ``rows * cluster`` CTAs share the read instead of ``rows``. Preferred over the register
    kernel where both apply, in the region the H200's sweep measured it ahead
    (``_CLUSTER_MIN_CTAS``, ``_CLUSTER_MIN_ROW_BYTES``)."""

    supported_archs = frozenset({(9, 0)})
    preferred_over = (RowNormRegisterKernel,)

    @classmethod
    def region_refusal(cls, spec: RowNormSpec) -> str | None:
        plan = cluster_plan(spec.rows, spec.n, spec.dtype)
        if plan is None:
            return (f"{spec.rows} rows of {spec.n} x {spec.dtype} do not split over a "
                    f"cluster (at least {_MIN_CLUSTER_SHARE} elements a CTA, rows x 2 "
                    f"within {FEW_ROWS}, at most {_HELD_BYTES_PER_THREAD} bytes a thread)")
        if plan[0] < _CLUSTER_MIN_CTAS or spec.n * _ITEMSIZE[spec.dtype] < _CLUSTER_MIN_ROW_BYTES:
            return (f"{spec.rows} rows of {spec.n} x {spec.dtype} split over {plan[0]} CTAs: "
                    f"the split serves rows of at least {_CLUSTER_MIN_ROW_BYTES >> 10} KiB over "
                    f"at least {_CLUSTER_MIN_CTAS} CTAs")
        return None

    @classmethod
    def identity(cls, spec: RowNormSpec):
        # the row count picks the cluster size
        return (*super().identity(spec), cluster_plan(spec.rows, spec.n, spec.dtype))

    def __init__(self, spec: RowNormSpec) -> None:
        Kernel.__init__(self, spec)
        self.plan = cluster_plan(spec.rows, spec.n, spec.dtype)
        self.program = build_cluster_kernel(spec.kind.value, spec.n, spec.dtype, spec.eps,
                                            spec.has_weight, spec.has_bias, None, self.plan)
        self._present = (spec.kind is RowNormKind.ADD_RMS, spec.has_weight, spec.has_bias)


#: the region the split kernel serves, from the H200's few-rows sweeps (RMSNorm bf16, 1-128
#: rows of 64k-1M, benchmarks/results/norm_few_rows-cuda0.txt and
#: norm_few_rows_wide-cuda0.txt): at most 64 rows of at least 512 KiB, or 16-64 rows of at
#: least 256 KiB, where it ran 1.05-1.5x the cluster and one-CTA kernels and 1.5-18x the
#: looped one past a cluster's reach (33 x 524288: 2.33 TB/s against 1.49; 1 x 1M: 0.90
#: against 0.05), also past the L2, where its second read of a row misses; narrower rows or
#: more rows ran faster on those
_SPLIT_MAX_ROWS = 64
_SPLIT_MIN_ROW_BYTES = 512 << 10
_SPLIT_MIN_ROW_BYTES_16 = 256 << 10  # from 16 rows on


class RowNormSplitKernel(_RowNormKernel):
    """Few rows of a wide RMS row: each row split over up to 128 CTAs (:func:`split_plan`),
    one program writing each CTA's sum of squares, a second adding a row's partials and
    scaling its share, which it reads again from L2 (:func:`split_programs`): more CTAs a row
    than a cluster holds, for one more launch. Preferred over the cluster and register
    kernels in the region the H200's sweeps measured it ahead (``_SPLIT_MAX_ROWS``,
    ``_SPLIT_MIN_ROW_BYTES``, ``_SPLIT_MIN_ROW_BYTES_16``)."""

    preferred_over = (RowNormClusterKernel, RowNormRegisterKernel)

    @classmethod
    def region_refusal(cls, spec: RowNormSpec) -> str | None:
        if spec.kind is not RowNormKind.RMS:
            return f"splits RMS rows without a residual, not {spec.kind.value}"
        row_bytes = spec.n * _ITEMSIZE[spec.dtype]
        least = _SPLIT_MIN_ROW_BYTES_16 if spec.rows >= 16 else _SPLIT_MIN_ROW_BYTES
        if not (spec.rows <= _SPLIT_MAX_ROWS and row_bytes >= least):
            return (f"{spec.rows} rows of {spec.n} x {spec.dtype}: the split serves at most "
                    f"{_SPLIT_MAX_ROWS} rows of at least {_SPLIT_MIN_ROW_BYTES >> 10} KiB, or "
                    f"of {_SPLIT_MIN_ROW_BYTES_16 >> 10} KiB from 16 rows on")
        if split_plan(spec.rows, spec.n, spec.dtype) is None:
            return (f"{spec.rows} rows of {spec.n} x {spec.dtype} do not split within "
                    f"{_HELD_BYTES_PER_THREAD} bytes a thread")
        return None

    @classmethod
    def identity(cls, spec: RowNormSpec):
        # the row count picks the split
        return (*super().identity(spec), split_plan(spec.rows, spec.n, spec.dtype))

    def __init__(self, spec: RowNormSpec) -> None:
        Kernel.__init__(self, spec)
        self.plan = split_plan(spec.rows, spec.n, spec.dtype)
        self._partial, self._scale = (
            build_split_kernel(spec.n, spec.dtype, spec.eps, spec.has_weight, part, None,
                               self.plan) for part in ("partial", "scale"))
        self._present = (False, spec.has_weight, False)

    def __call__(self, x, residual, weight, bias, y, residual_out) -> None:
        import torch

        rows = x.shape[0]
        if rows == 0:
            return
        parts = torch.empty((rows, self.plan[0]), dtype=torch.float32, device=x.device)
        self._partial(x, parts)
        if weight is not None:
            self._scale(x, parts, weight, y)
        else:
            self._scale(x, parts, y)


class RowNormLoopedKernel(_RowNormKernel):
    """Any row length: two passes over the row in chunks."""

    general = True
    _build = staticmethod(build_looped_kernel)
