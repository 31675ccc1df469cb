"""Softmax, log-softmax and logsumexp over one axis, and the two gradients, in TileLang.

Every call is an ``(outer, R, inner)`` view of a contiguous tensor, reduced over ``R``. The
storage dtype is float16, bfloat16 or float32; the arithmetic is fp32. ``exp(v - m)`` is
computed as ``exp2((v - m) * log2(e))`` (CUDA's ``exp2f``, the MUFU ``ex2``, within 2 ulp of
fp32): the difference first, so ``v = -inf`` against a finite ``m`` is exactly 0.

The reduced axis is the last one (``inner == 1``, rows):

:class:`SoftmaxRegisterKernel` / :class:`SoftmaxBwdRegisterKernel` -- the row (for the
    gradient, the rows of ``y`` and ``dy``) is read once into registers with 16-byte vector
    loads, reduced with warp shuffles (and shared memory across the warps of a row), and the
    output written from registers: each tensor read once and written once, the floor. The
    forward reduces twice (the row max, then the sum of ``exp(x - max)``) over the held
    values (softmax keeps the sum's exponentials in fp32 registers for rows of at most 128
    threads, see :func:`keep_exp`); the gradient reduces once (``sum(dy * y)`` or
    ``sum(dy)``). A thread holds at most 128 bytes (8 accesses of 16 bytes in flight, the
    H200's best in the norm sweeps), up to 512 threads a row; short rows take less than a warp (1024 columns of bf16: 16
    threads a row, 16 rows a CTA), so many rows share a CTA.
:class:`SoftmaxLoopedKernel` / :class:`SoftmaxBwdLoopedKernel` -- rows too wide to hold
    (the forward beyond 64 KiB a row: 128256 columns of bf16 is 256 KiB) take one CTA of
    1024 threads a row and two passes. Pass 1 holds the row's head in registers (64 bytes a
    thread: 64 KiB of the row) and walks the rest keeping an online (max, sum) per thread
    (the sum rescaled by ``exp(m_old - m_new)`` when the max grows), then merges the pairs
    across the CTA (a shuffle tree in each warp, the warps' pairs through shared memory, the
    tree again); pass 2 writes the head from registers and reads the rest again. This
    two-pass walk was chosen over holding the whole row on chip (registers plus shared
    memory): at one 1024-thread CTA an SM (64 registers a thread) the rows in flight re-read
    132 x 192 KiB = 25 MB, well inside the H200's 50 MB L2, so the second read of a 128256
    row comes from L2 and HBM sees one read and one write; the same code serves every width
    (262144 columns of fp32 is 1 MiB, more than an SM holds). The H200 measured 2.53 TB/s for
    4096 x 128256 bf16, so the staged plan (:func:`looped_staged_plan`) keeps the chunks past
    the head in shared memory as well, up to 192 KiB (the whole 128256 row), optionally
    copying them before any arithmetic; it is selected by its plan, for the sweep to compare.

The reduced axis is not the last one (``inner > 1``): :class:`SoftmaxStridedKernel` /
:class:`SoftmaxBwdStridedKernel` read the ``(outer, R, inner)`` view in place, with no
transposing copy (a copy would read and write the tensor twice more). A CTA owns
``32 * vec`` contiguous inner columns of one outer index: each of its 32 column lanes owns
``vec`` adjacent columns (one vector access, coalesced across the warp) and its ``groups``
warps split ``R`` between them, each walking its share with the same online (max, sum); the
groups merge through shared memory and pass 2 writes. The vector narrows until the grid has
about two CTAs per SM, so a small ``outer * inner`` (dim 0 of 1024 x 4096) still fills the
GPU.

logsumexp's gradient ``dx = dy * exp(x - lse)`` has no reduction: :class:`LogSumExpBwdRowsKernel`
walks rows in the register plan's shape (one step where the row fits, chunks of a 1024-thread
CTA beyond), :class:`LogSumExpBwdStridedKernel` the strided kernels' CTAs, each thread reading
its columns' ``dy`` and ``lse`` once.

A row of every ``-inf`` follows torch: softmax and log-softmax give NaN, logsumexp ``-inf``;
the running max starts at the most negative finite float so that such a row never computes
``-inf - -inf``.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
import math
from typing import Any, ClassVar, Literal, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

from ._store import stored
from ._tilelang import compile_program, tl
from ._tilelang import pow2_at_least as _pow2_at_least
from ._tilelang import widest_vec as _vec

__all__ = [
    "LogSumExpBwdInterface",
    "LogSumExpBwdRowsKernel",
    "LogSumExpBwdSpec",
    "LogSumExpBwdStridedKernel",
    "SoftmaxBwdInterface",
    "SoftmaxBwdLoopedKernel",
    "SoftmaxBwdRegisterKernel",
    "SoftmaxBwdSpec",
    "SoftmaxBwdStridedKernel",
    "SoftmaxDType",
    "SoftmaxFwdInterface",
    "SoftmaxKind",
    "SoftmaxLoopedKernel",
    "SoftmaxRegisterKernel",
    "SoftmaxSpec",
    "SoftmaxStridedKernel",
    "build_bwd",
    "build_fwd",
    "build_lse_bwd",
    "keep_exp",
    "looped_plan",
    "looped_staged_plan",
    "register_plan",
    "rows_walk_plan",
    "strided_plan",
]

_VECTOR_BYTES = 16
_WARP = 32
#: bytes of its rows one thread holds in registers (8 accesses of 16 bytes in flight)
_HELD_BYTES_PER_THREAD = 128
_MAX_REGISTER_THREADS = 512
#: threads of a CTA of rows shorter than a warp's share
_ROWS_CTA_THREADS = 256
_LOOPED_THREADS = 1024
#: bytes of the row's head one thread of the looped kernels holds through both passes
_HELD_LOOPED_BYTES = 64
#: threads of a strided CTA: 32 column lanes times 16 groups splitting R
_STRIDED_THREADS = 512
#: the strided grid narrows its vector until it has this many CTAs (two per H200 SM)
_STRIDED_MIN_CTAS = 264
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


class SoftmaxKind(enum.Enum):
    """What a softmax-family call computes over its reduced axis."""

    SOFTMAX = "softmax"  # exp(x - lse)
    LOG_SOFTMAX = "log_softmax"  # x - lse
    LOGSUMEXP = "logsumexp"  # lse = max + log(sum(exp(x - max))), one value a row


#: the storage dtypes the softmax kernels are written for
SoftmaxDType = Literal["float16", "bfloat16", "float32"]
_DTYPES = frozenset(get_args(SoftmaxDType))


class _ViewSpec(CallSpec, frozen=True, kw_only=True):
    """The facts both slots' specs share: the ``(outer, r, inner)`` view and the dtype."""

    kind: SoftmaxKind
    outer: int  # product of the axes before the reduced one
    r: int  # length of the reduced axis
    inner: int  # product of the axes after it (1: the reduced axis is the last)
    dtype: SoftmaxDType

    def __post_init__(self) -> None:
        if not isinstance(self.kind, SoftmaxKind):
            raise TypeError(f"{type(self).__name__}.kind must be a SoftmaxKind, got "
                            f"{self.kind!r}")
        self.check_fields(choices={"dtype": _DTYPES}, sizes=("outer", "r", "inner"))
        if self.r == 0 or self.inner == 0:
            raise ValueError(f"{type(self).__name__}: the reduced axis ({self.r}) and the "
                             f"inner size ({self.inner}) must be at least 1")


class SoftmaxSpec(_ViewSpec, frozen=True, kw_only=True):
    """A forward call: ``y = softmax / log_softmax(x)`` of the view's shape, or ``lse`` of
    shape ``(outer, inner)``."""


class SoftmaxBwdSpec(_ViewSpec, frozen=True, kw_only=True):
    """A gradient call from the saved output ``y`` and ``dy``: softmax's
    ``dx = y * (dy - sum(dy * y))`` or log-softmax's ``dx = dy - exp(y) * sum(dy)``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind is SoftmaxKind.LOGSUMEXP:
            raise ValueError("SoftmaxBwdSpec: the gradient kernels serve SOFTMAX and "
                             "LOG_SOFTMAX, not LOGSUMEXP")


class LogSumExpBwdSpec(_ViewSpec, frozen=True, kw_only=True):
    """logsumexp's gradient: ``dx = dy * exp(x - lse)``, ``dy`` and ``lse`` of ``(outer,
    inner)`` broadcast along the reduced axis. ``kind`` is LOGSUMEXP."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kind is not SoftmaxKind.LOGSUMEXP:
            raise ValueError(f"LogSumExpBwdSpec: the kind is LOGSUMEXP, not {self.kind}")


class SoftmaxFwdInterface(KernelInterface):
    """``forward(x, out)``: ``x`` contiguous with ``outer * r * inner`` elements; ``out`` is
    ``y`` (like ``x``) or, for LOGSUMEXP, ``lse`` with ``outer * inner`` elements, contiguous."""

    slot = "softmax_fwd"
    call_spec = SoftmaxSpec


class SoftmaxBwdInterface(KernelInterface):
    """``forward(y, dy, dx)``: three contiguous tensors of ``outer * r * inner`` elements."""

    slot = "softmax_bwd"
    call_spec = SoftmaxBwdSpec


class LogSumExpBwdInterface(KernelInterface):
    """``forward(dy, x, lse, dx)``: ``x`` and ``dx`` of ``outer * r * inner`` elements, ``dy``
    and ``lse`` of ``outer * inner``, all contiguous."""

    slot = "logsumexp_bwd"
    call_spec = LogSumExpBwdSpec


# --- plans -------------------------------------------------------------------------------------


def register_plan(n: int, dtype: str, held: int = 1) -> tuple[int, int, int, int] | None:
    """``(threads_per_row, rows_per_cta, vec, per)`` of the register kernel for rows of ``n``
    holding ``held`` tensors (1 forward, 2 for the gradient's ``y`` and ``dy``), or None when
    a row does not fit: each thread holds ``per`` accesses of ``vec`` elements of each.

    A thread aims at 8 accesses in flight when they are 16 bytes and 16 when the row length
    forces narrower ones (the norm sweeps on the H200), within 128 bytes held; the threads of
    a row are a power of two from 1 to 512. Rows of at most a warp's share pack into CTAs of
    256 threads, so a short row is reduced by shuffles within part of a warp.
    """
    item = _ITEMSIZE[dtype]
    vec = _vec(n, dtype)
    width = vec * item * held
    nv = -(-n // vec)  # accesses in a row
    want = max(1, (8 if vec * item >= _VECTOR_BYTES else 16) // held)
    tpr = _pow2_at_least(-(-nv // want))
    if tpr > _WARP:  # a row over several warps: at least 4 of them, at most 512 threads
        tpr = min(_MAX_REGISTER_THREADS, max(128, tpr))
    per = -(-nv // tpr)
    while per * width > _HELD_BYTES_PER_THREAD and tpr < _MAX_REGISTER_THREADS:
        tpr *= 2
        per = -(-nv // tpr)
    if per * width > _HELD_BYTES_PER_THREAD or tpr > _MAX_REGISTER_THREADS:
        return None
    rpc = _ROWS_CTA_THREADS // tpr if tpr <= _WARP else 1
    return tpr, rpc, vec, per


def keep_exp(kind: "SoftmaxKind", plan: tuple[int, int, int, int]) -> bool:
    """Whether the register softmax keeps its ``exp(x - max)`` in fp32 registers (one
    exponential an element instead of two): for rows of at most 128 threads, where the extra
    registers (one a held element) still leave two CTAs of a row or more an SM. Wider rows
    recompute them: at 512 threads a row the registers would leave one CTA an SM, whose
    barriers nothing overlaps. A first choice, before any H200 sweep of it (gpu_softmax.sh's
    sweep stage times both)."""
    return kind is SoftmaxKind.SOFTMAX and plan[0] <= 128


def looped_plan(n: int, dtype: str, held: int = 1) -> tuple[int, int, int, int]:
    """``(threads, vec, per, hold)``: each thread holds ``hold`` accesses of the row's head (of
    each of the ``held`` tensors) in registers, and the passes walk the rest in chunks of
    ``threads * vec * per`` (4 accesses in flight a thread). 64 bytes held a thread keep a
    1024-thread CTA within 64 registers a thread (the register file at one CTA an SM)."""
    vec = _vec(n, dtype)
    hold = max(1, _HELD_LOOPED_BYTES // (vec * _ITEMSIZE[dtype] * held))
    hold = min(hold, -(-n // (_LOOPED_THREADS * vec)))  # no access wholly past the row
    return _LOOPED_THREADS, vec, 4, hold


#: shared memory the staged looped forward may keep its chunks in (an H200 CTA may have
#: 227 KiB; the rest is the reduction's and the runtime's)
_STAGED_BYTES = 192 * 1024


def looped_staged_plan(kind: "SoftmaxKind", n: int, dtype: str) -> tuple[int, int, int, int, int]:
    """``(threads, vec, per, hold, stage)``: :func:`looped_plan`'s threads and head, walking
    chunks of 2 accesses a thread, with as many of the chunks past the head kept in shared
    memory (``stage``) as fit :data:`_STAGED_BYTES`, so the second pass reads them on chip:
    128256 columns of bf16 are a 64 KiB head in registers and six 32 KiB chunks in shared
    memory, the whole row read from HBM once. Two accesses, not the walk's four: with the
    staging's addresses four take 64 registers and spill 40 bytes a thread (sm_90 ptxas), two
    take 61 and spill none. The cost is one CTA an SM whatever its registers (the shared
    memory), against the two-pass plan's reliance on L2 for the second read. The forward's
    default (with its staged loads issued together) since the H200 sweep: 3.36 TB/s on 4096 x
    128256 bf16 against the two-pass walk's 2.53; logsumexp, with no second pass, stages
    nothing and keeps :func:`looped_plan`."""
    threads, vec, _, hold = looped_plan(n, dtype)
    per = 2
    chunk = threads * vec * per
    steps = max(0, -(-(n - threads * vec * hold) // chunk))
    stage = min(steps, _STAGED_BYTES // (chunk * _ITEMSIZE[dtype]))
    return threads, vec, per, hold, 0 if kind is SoftmaxKind.LOGSUMEXP else stage


def shared_sm_plan(kind: "SoftmaxKind", n: int, dtype: str) -> tuple | None:
    """``(threads, vec, per, hold, stage, early, ctas)`` of the looped forward for the rows the
    register kernel would spread over 512 threads (16 to 64 KiB of 16-byte accesses): 256
    threads hold a 16 KiB head in registers and stage the rest (at most three 16 KiB chunks)
    in shared memory, registers capped for three CTAs an SM, so the next rows' reads overlap a
    row's reductions and writes. On the H200 4096 x 32000 bf16 ran at 3.91 TB/s so, against
    3.43 for the register kernel at two CTAs an SM and 3.11 at one
    (benchmarks/results/softmax_sweep-cuda0.txt). None for other rows, for rows of narrower
    accesses (their head would cover less than the staging can hold) and for logsumexp (no
    second pass to stage for)."""
    if kind is SoftmaxKind.LOGSUMEXP:
        return None
    plan = register_plan(n, dtype)
    vec = _vec(n, dtype)
    if plan is None or plan[0] != _MAX_REGISTER_THREADS or vec * _ITEMSIZE[dtype] != _VECTOR_BYTES:
        return None
    threads, per, hold, ctas = 256, 4, 4, 3
    stage = max(0, -(-(n - threads * vec * hold) // (threads * vec * per)))
    return (threads, vec, per, hold, stage, True, ctas) if stage <= 3 else None


def rows_walk_plan(n: int, dtype: str) -> tuple[int, int, int, int, int]:
    """``(threads_per_row, rows_per_cta, vec, per, steps)`` of logsumexp's gradient over rows:
    no reduction, so a row is walked in ``steps`` chunks of ``threads_per_row * vec * per``;
    rows that fit the register plan take its shape in one step, wider ones a CTA of 1024
    threads each with 4 accesses in flight a step."""
    plan = register_plan(n, dtype)
    if plan is not None:
        return (*plan, 1)
    vec = _vec(n, dtype)
    return _LOOPED_THREADS, 1, vec, 4, -(-n // (_LOOPED_THREADS * vec * 4))


def strided_plan(outer: int, r: int, inner: int, dtype: str) -> tuple[int, int, int]:
    """``(lanes, groups, vec)`` of the strided kernel: ``lanes`` column lanes of ``vec``
    columns each (a warp, or fewer for a narrow ``inner``) and ``groups`` splitting ``R``.
    The vector narrows (down to one element) while the grid has fewer than
    :data:`_STRIDED_MIN_CTAS` CTAs."""
    vec = _vec(inner, dtype)
    lanes = min(_WARP, _pow2_at_least(-(-inner // vec)))
    while vec > 1 and outer * -(-inner // (lanes * vec)) < _STRIDED_MIN_CTAS:
        vec //= 2
        lanes = min(_WARP, _pow2_at_least(-(-inner // vec)))
    groups = min(_STRIDED_THREADS // lanes, _pow2_at_least(r))
    return lanes, groups, vec


# --- shared pieces of the programs -------------------------------------------------------------


def _rescaled(T, s, m, nm):
    """``s * exp(m - nm)``: a sum of ``exp(v - m)`` moved to the larger max ``nm``."""
    return s * T.exp2((m - nm) * _LOG2E)


def _lse(T, m, s):
    return m + T.log2(s) * _LN2


# --- forward programs --------------------------------------------------------------------------


def _fwd_signature(body, kind: str, xs, os_, dtype: str):
    _, T = tl()

    @T.prim_func
    def main(X: T.Tensor(xs, dtype), Y: T.Tensor(os_, dtype)):
        body(X, Y)

    return main


def register_fwd_program(kind: str, n: int, dtype: str, tpr: int, rpc: int, vec: int,
                         per: int, keep_exp: bool = False, resident: int = 1):
    """The register kernel's prim_func (not compiled) over an ``(M, n)`` view. With
    ``keep_exp`` (softmax only) the sum's ``exp(x - max)`` are kept in fp32 registers and the
    output is each times ``1 / sum``: one exponential an element instead of two, for as many
    more registers as the thread holds elements. ``resident`` above 1 caps the registers
    (``__launch_bounds__``' second argument) so that many CTAs fit an SM together: 32000
    columns of bf16 at 512 threads take 89 registers a thread unbounded (sm_90 ptxas), one
    CTA an SM, and 64 at ``resident=2``, where one CTA's loads overlap the other's reduction
    and stores."""
    _, T = tl()
    M = T.dynamic("M")
    lse_out = kind == "logsumexp"
    threads = tpr * rpc
    wpr = max(1, tpr // _WARP)  # warps a row
    span = min(tpr, _WARP)  # lanes of a row within its warp
    exact = n == tpr * per * vec
    f32 = "float32"
    held_n = per * vec

    @T.macro
    def body(X, Y):
        with T.Kernel(T.ceildiv(M, rpc), threads=threads) as bx:
            if resident > 1:
                T.annotate_min_blocks_per_sm(resident)
            tx = T.get_thread_binding()
            lane = tx % tpr
            grp = tx // tpr
            row = bx * rpc + grp
            held = T.alloc_local((held_n,), dtype)
            acc = T.alloc_local((3,), f32)  # max, sum, lse (1 / sum when keep_exp)
            ex = T.alloc_local((held_n if keep_exp else 1,), f32)
            red = T.alloc_shared((rpc * wpr * 2,), f32)
            for v in T.unroll(per):
                col = (v * tpr + lane) * vec
                if row < M and (exact or col < n):
                    for i in T.vectorized(vec):
                        held[v * vec + i] = X[row, col + i]
                else:
                    for i in T.unroll(vec):
                        held[v * vec + i] = T.cast(-T.infinity(f32), dtype)
            acc[0] = T.min_value(f32)
            for j in T.unroll(held_n):
                acc[0] = T.max(acc[0], T.cast(held[j], f32))
            if span > 1:
                for s in T.unroll(span.bit_length() - 1):
                    acc[0] = T.max(acc[0], T.shfl_xor(acc[0], (span // 2) >> s))
            if wpr > 1:
                if lane % _WARP == 0:
                    red[grp * wpr + lane // _WARP] = acc[0]
                T.sync_threads()
                for w in T.unroll(wpr):
                    acc[0] = T.max(acc[0], red[grp * wpr + w])
            acc[1] = T.cast(0, f32)
            if keep_exp:
                for j in T.unroll(held_n):
                    ex[j] = T.exp2((T.cast(held[j], f32) - acc[0]) * _LOG2E)
                    acc[1] += ex[j]
            else:
                for j in T.unroll(held_n):
                    acc[1] += T.exp2((T.cast(held[j], f32) - acc[0]) * _LOG2E)
            if span > 1:
                for s in T.unroll(span.bit_length() - 1):
                    acc[1] += T.shfl_xor(acc[1], (span // 2) >> s)
            if wpr > 1:
                if lane % _WARP == 0:
                    red[rpc * wpr + grp * wpr + lane // _WARP] = acc[1]
                T.sync_threads()
                acc[1] = T.cast(0, f32)
                for w in T.unroll(wpr):
                    acc[1] += red[rpc * wpr + grp * wpr + w]
            if keep_exp:
                acc[2] = T.cast(1, f32) / acc[1]
            else:
                acc[2] = _lse(T, acc[0], acc[1])
            if lse_out:
                if row < M and lane == 0:
                    Y[row] = T.cast(acc[2], dtype)
            else:
                for v in T.unroll(per):
                    col = (v * tpr + lane) * vec
                    if row < M and (exact or col < n):
                        for i in T.unroll(vec):
                            if keep_exp:
                                held[v * vec + i] = T.cast(ex[v * vec + i] * acc[2], dtype)
                            elif kind == "softmax":
                                held[v * vec + i] = T.cast(T.exp2(
                                    (T.cast(held[v * vec + i], f32) - acc[2]) * _LOG2E), dtype)
                            else:
                                held[v * vec + i] = T.cast(
                                    T.cast(held[v * vec + i], f32) - acc[2], dtype)
                        for i in T.vectorized(vec):
                            Y[row, col + i] = held[v * vec + i]

    return _fwd_signature(body, kind, (M, n), (M,) if lse_out else (M, n), dtype)


def looped_fwd_program(kind: str, n: int, dtype: str, threads: int, vec: int, per: int,
                       hold: int, stage: int = 0, early: bool = False, resident: int = 1):
    """The looped kernel's prim_func: one CTA a row. Pass 1 holds the row's first
    ``threads * vec * hold`` elements in registers and walks the rest in chunks of
    ``threads * vec * per`` with an online (max, sum); pass 2 (unless the output is the lse)
    writes the held head from registers and reads the rest again.

    With ``stage`` (see :func:`looped_staged_plan`) pass 1 also keeps its first ``stage``
    chunks in shared memory, and pass 2 reads them from there instead of global memory. Each
    thread reads back only the 16-byte slots it wrote (a chunk's access ``v`` of thread ``tx``
    at row ``step * per + v``, column ``tx * vec``: a warp's accesses are contiguous, free of
    bank conflicts), so the staging needs no barrier. With ``early`` the staged chunks are
    copied in an unrolled loop issued right after the head's loads, before any arithmetic, so
    the loads of the whole staged row are in flight together (the walk's loop waits on each
    chunk's two accesses in turn), and pass 1 then folds them from shared memory. ``resident`` caps the
    registers for that many CTAs an SM, as in :func:`register_fwd_program`: a row the staged
    chunks hold whole at fewer threads (32000 columns of bf16 at 512 threads: a 32 KiB head
    in registers, two 16 KiB chunks staged, 64 registers and no spill at two CTAs an SM) can
    then share its SM with another row's CTA."""
    _, T = tl()
    M = T.dynamic("M")
    lse_out = kind == "logsumexp"
    head = threads * vec * hold
    chunk = threads * vec * per
    steps = max(0, -(-(n - head) // chunk))
    warps = threads // _WARP
    f32 = "float32"
    if stage and (lse_out or stage > steps):
        raise ValueError(f"looped_fwd_program: {stage} staged chunks for a {kind} row of {n} "
                         f"with {steps} chunks past the head (the lse has no second pass)")
    if early and not stage:
        raise ValueError("looped_fwd_program: early copies staged chunks; the plan stages none")

    @T.macro
    def tree(acc):
        """Merge the (max, sum) pairs ``acc[0:2]`` of a warp's lanes into every lane."""
        for s in T.unroll(5):
            acc[2] = T.shfl_xor(acc[0], 16 >> s)
            acc[3] = T.shfl_xor(acc[1], 16 >> s)
            acc[4] = T.max(acc[0], acc[2])
            acc[1] = _rescaled(T, acc[1], acc[0], acc[4]) + _rescaled(T, acc[3], acc[2], acc[4])
            acc[0] = acc[4]

    def out_value(v, lse):
        if kind == "softmax":
            return T.cast(T.exp2((T.cast(v, f32) - lse) * _LOG2E), dtype)
        return T.cast(T.cast(v, f32) - lse, dtype)

    @T.macro
    def load(X, row, tx, piece, step):
        """Chunk ``step`` past the head into ``piece`` (``-inf`` past the row's end)."""
        for v in T.unroll(per):
            col = head + step * chunk + (v * threads + tx) * vec
            if col < n:
                for i in T.vectorized(vec):
                    piece[v * vec + i] = X[row, col + i]
            else:
                for i in T.unroll(vec):
                    piece[v * vec + i] = T.cast(-T.infinity(f32), dtype)

    @T.macro
    def online(acc, piece):
        """Fold ``piece`` into the running (max, sum) ``acc[0:2]``."""
        acc[4] = acc[0]
        for j in T.unroll(per * vec):
            acc[4] = T.max(acc[4], T.cast(piece[j], f32))
        acc[1] = _rescaled(T, acc[1], acc[0], acc[4])
        for j in T.unroll(per * vec):
            acc[1] += T.exp2((T.cast(piece[j], f32) - acc[4]) * _LOG2E)
        acc[0] = acc[4]

    @T.macro
    def store(Y, row, tx, piece, step, lse):
        """``piece`` (chunk ``step``'s inputs) turned into outputs and written."""
        for v in T.unroll(per):
            col = head + step * chunk + (v * threads + tx) * vec
            if col < n:
                for i in T.unroll(vec):
                    piece[v * vec + i] = out_value(piece[v * vec + i], lse)
                for i in T.vectorized(vec):
                    Y[row, col + i] = piece[v * vec + i]

    @T.macro
    def body(X, Y):
        with T.Kernel(M, threads=threads) as row:
            if resident > 1:
                T.annotate_min_blocks_per_sm(resident)
            tx = T.get_thread_binding()
            held = T.alloc_local((hold * vec,), dtype)
            piece = T.alloc_local((per * vec,), dtype)
            acc = T.alloc_local((5,), f32)  # max, sum, other max / lse, other sum, new max
            red = T.alloc_shared((warps * 2,), f32)
            if stage:
                staged = T.alloc_shared((stage * per, threads * vec), dtype)
            for v in T.unroll(hold):
                col = (v * threads + tx) * vec
                if col < n:
                    for i in T.vectorized(vec):
                        held[v * vec + i] = X[row, col + i]
                else:
                    for i in T.unroll(vec):
                        held[v * vec + i] = T.cast(-T.infinity(f32), dtype)
            if stage and early:
                for step in T.unroll(stage):
                    load(X, row, tx, piece, step)
                    for v in T.unroll(per):
                        for i in T.vectorized(vec):
                            staged[step * per + v, tx * vec + i] = piece[v * vec + i]
            acc[0] = T.min_value(f32)
            for j in T.unroll(hold * vec):
                acc[0] = T.max(acc[0], T.cast(held[j], f32))
            acc[1] = T.cast(0, f32)
            for j in T.unroll(hold * vec):
                acc[1] += T.exp2((T.cast(held[j], f32) - acc[0]) * _LOG2E)
            if stage and early:
                for step in T.serial(stage):
                    for v in T.unroll(per):
                        for i in T.vectorized(vec):
                            piece[v * vec + i] = staged[step * per + v, tx * vec + i]
                    online(acc, piece)
            if stage and not early:
                for step in T.serial(stage):
                    load(X, row, tx, piece, step)
                    for v in T.unroll(per):
                        for i in T.vectorized(vec):
                            staged[step * per + v, tx * vec + i] = piece[v * vec + i]
                    online(acc, piece)
            for rest in T.serial(steps - stage):
                load(X, row, tx, piece, stage + rest)
                online(acc, piece)
            # the CTA's pairs: a shuffle tree within each warp, the warps' pairs through shared
            # memory, then the same tree over them in every warp (no second barrier)
            tree(acc)
            if tx % _WARP == 0:
                red[tx // _WARP] = acc[0]
                red[warps + tx // _WARP] = acc[1]
            T.sync_threads()
            if tx % _WARP < warps:
                acc[0] = red[tx % _WARP]
                acc[1] = red[warps + tx % _WARP]
            else:
                acc[0] = T.min_value(f32)
                acc[1] = T.cast(0, f32)
            tree(acc)
            acc[2] = _lse(T, acc[0], acc[1])
            if lse_out:
                if tx == 0:
                    Y[row] = T.cast(acc[2], dtype)
            else:
                for v in T.unroll(hold):
                    col = (v * threads + tx) * vec
                    if col < n:
                        for i in T.unroll(vec):
                            held[v * vec + i] = out_value(held[v * vec + i], acc[2])
                        for i in T.vectorized(vec):
                            Y[row, col + i] = held[v * vec + i]
                if stage:
                    for step in T.serial(stage):
                        for v in T.unroll(per):
                            for i in T.vectorized(vec):
                                piece[v * vec + i] = staged[step * per + v, tx * vec + i]
                        store(Y, row, tx, piece, step, acc[2])
                for rest in T.serial(steps - stage):
                    for v in T.unroll(per):
                        col = head + (stage + rest) * chunk + (v * threads + tx) * vec
                        if col < n:
                            for i in T.vectorized(vec):
                                piece[v * vec + i] = X[row, col + i]
                    store(Y, row, tx, piece, stage + rest, acc[2])

    return _fwd_signature(body, kind, (M, n), (M,) if lse_out else (M, n), dtype)


def strided_fwd_program(kind: str, r: int, inner: int, dtype: str, lanes: int, groups: int,
                        vec: int):
    """The strided kernel's prim_func over an ``(outer, r, inner)`` view (see the module
    docstring): CTA ``o * blocks + b`` owns columns ``b * lanes * vec`` onward of outer index
    ``o``."""
    _, T = tl()
    outer = T.dynamic("outer")
    lse_out = kind == "logsumexp"
    cols = lanes * vec
    blocks = -(-inner // cols)  # column blocks of an outer index
    steps = -(-r // groups)
    f32 = "float32"

    @T.macro
    def body(X, Y):
        # a 1-D grid, column blocks fastest: gridDim.y would cap outer at 65535
        with T.Kernel(outer * blocks, threads=lanes * groups) as bid:
            o = bid // blocks
            tx = T.get_thread_binding()
            lane = tx % lanes
            g = tx // lanes
            c = (bid % blocks) * cols + lane * vec
            piece = T.alloc_local((vec,), dtype)
            m = T.alloc_local((vec,), f32)
            s = T.alloc_local((vec,), f32)
            t = T.alloc_local((2,), f32)
            red_m = T.alloc_shared((groups, cols), f32)
            red_s = T.alloc_shared((groups, cols), f32)
            for i in T.unroll(vec):
                m[i] = T.min_value(f32)
                s[i] = T.cast(0, f32)
            for step in T.serial(steps):
                k = step * groups + g
                if k < r and c < inner:
                    for i in T.vectorized(vec):
                        piece[i] = X[o, k, c + i]
                    for i in T.unroll(vec):
                        t[0] = T.max(m[i], T.cast(piece[i], f32))
                        s[i] = _rescaled(T, s[i], m[i], t[0]) + T.exp2(
                            (T.cast(piece[i], f32) - t[0]) * _LOG2E)
                        m[i] = t[0]
            for i in T.unroll(vec):
                red_m[g, lane * vec + i] = m[i]
                red_s[g, lane * vec + i] = s[i]
            T.sync_threads()
            for i in T.unroll(vec):
                m[i] = T.min_value(f32)
                s[i] = T.cast(0, f32)
                for w in T.serial(groups):
                    t[0] = T.max(m[i], red_m[w, lane * vec + i])
                    s[i] = _rescaled(T, s[i], m[i], t[0]) + _rescaled(
                        T, red_s[w, lane * vec + i], red_m[w, lane * vec + i], t[0])
                    m[i] = t[0]
                m[i] = _lse(T, m[i], s[i])  # m holds the lse from here on
            if lse_out:
                if g == 0 and c < inner:
                    for i in T.unroll(vec):
                        piece[i] = T.cast(m[i], dtype)
                    for i in T.vectorized(vec):
                        Y[o, c + i] = piece[i]
            else:
                for step in T.serial(steps):
                    k = step * groups + g
                    if k < r and c < inner:
                        for i in T.vectorized(vec):
                            piece[i] = X[o, k, c + i]
                        for i in T.unroll(vec):
                            if kind == "softmax":
                                piece[i] = T.cast(T.exp2(
                                    (T.cast(piece[i], f32) - m[i]) * _LOG2E), dtype)
                            else:
                                piece[i] = T.cast(T.cast(piece[i], f32) - m[i], dtype)
                        for i in T.vectorized(vec):
                            Y[o, k, c + i] = piece[i]

    return _fwd_signature(body, kind, (outer, r, inner), (outer, inner) if lse_out else (outer, r, inner),
                          dtype)


# --- gradient programs -------------------------------------------------------------------------


def _bwd_signature(body, shape, dtype: str):
    _, T = tl()

    @T.prim_func
    def main(Yv: T.Tensor(shape, dtype), DY: T.Tensor(shape, dtype),
             DX: T.Tensor(shape, dtype)):
        body(Yv, DY, DX)

    return main


def _bwd_term(T, kind: str, y, dy):
    """The row sum's term: ``dy * y`` (softmax) or ``dy`` (log-softmax), in fp32."""
    f32 = "float32"
    if kind == "softmax":
        return T.cast(dy, f32) * T.cast(y, f32)
    return T.cast(dy, f32)


def _bwd_value(T, kind: str, y, dy, total):
    """``dx`` of one element in fp32 from the row sum ``total``."""
    f32 = "float32"
    if kind == "softmax":
        return T.cast(y, f32) * (T.cast(dy, f32) - total)
    return T.cast(dy, f32) - T.exp2(T.cast(y, f32) * _LOG2E) * total


def register_bwd_program(kind: str, n: int, dtype: str, tpr: int, rpc: int, vec: int,
                         per: int):
    """The gradient's register kernel over ``(M, n)`` views of ``y``, ``dy`` and ``dx``."""
    _, T = tl()
    M = T.dynamic("M")
    threads = tpr * rpc
    wpr = max(1, tpr // _WARP)
    span = min(tpr, _WARP)
    exact = n == tpr * per * vec
    f32 = "float32"
    held_n = per * vec

    @T.macro
    def body(Yv, DY, DX):
        with T.Kernel(T.ceildiv(M, rpc), threads=threads) as bx:
            tx = T.get_thread_binding()
            lane = tx % tpr
            grp = tx // tpr
            row = bx * rpc + grp
            hy = T.alloc_local((held_n,), dtype)
            hd = T.alloc_local((held_n,), dtype)
            acc = T.alloc_local((1,), f32)
            red = T.alloc_shared((rpc * wpr,), f32)
            for v in T.unroll(per):
                col = (v * tpr + lane) * vec
                if row < M and (exact or col < n):
                    for i in T.vectorized(vec):
                        hy[v * vec + i] = Yv[row, col + i]
                    for i in T.vectorized(vec):
                        hd[v * vec + i] = DY[row, col + i]
                else:
                    for i in T.unroll(vec):
                        hy[v * vec + i] = T.cast(0, dtype)
                        hd[v * vec + i] = T.cast(0, dtype)
            acc[0] = T.cast(0, f32)
            for j in T.unroll(held_n):
                acc[0] += _bwd_term(T, kind, hy[j], hd[j])
            if span > 1:
                for s in T.unroll(span.bit_length() - 1):
                    acc[0] += T.shfl_xor(acc[0], (span // 2) >> s)
            if wpr > 1:
                if lane % _WARP == 0:
                    red[grp * wpr + lane // _WARP] = acc[0]
                T.sync_threads()
                acc[0] = T.cast(0, f32)
                for w in T.unroll(wpr):
                    acc[0] += red[grp * wpr + w]
            for v in T.unroll(per):
                col = (v * tpr + lane) * vec
                if row < M and (exact or col < n):
                    for i in T.unroll(vec):
                        hd[v * vec + i] = T.cast(_bwd_value(
                            T, kind, hy[v * vec + i], hd[v * vec + i], acc[0]), dtype)
                    for i in T.vectorized(vec):
                        DX[row, col + i] = hd[v * vec + i]

    return _bwd_signature(body, (M, n), dtype)


def looped_bwd_program(kind: str, n: int, dtype: str, threads: int, vec: int, per: int,
                       hold: int):
    """The gradient's looped kernel: one CTA a row; the row's first ``threads * vec * hold``
    elements of ``y`` and ``dy`` are held in registers, the rest read once to sum and once
    more to write."""
    _, T = tl()
    M = T.dynamic("M")
    head = threads * vec * hold
    chunk = threads * vec * per
    steps = max(0, -(-(n - head) // chunk))
    warps = threads // _WARP
    f32 = "float32"

    @T.macro
    def body(Yv, DY, DX):
        with T.Kernel(M, threads=threads) as row:
            tx = T.get_thread_binding()
            hy = T.alloc_local((hold * vec,), dtype)
            hd = T.alloc_local((hold * vec,), dtype)
            py = T.alloc_local((per * vec,), dtype)
            pd = T.alloc_local((per * vec,), dtype)
            acc = T.alloc_local((1,), f32)
            red = T.alloc_shared((warps,), f32)
            for v in T.unroll(hold):
                col = (v * threads + tx) * vec
                if col < n:
                    for i in T.vectorized(vec):
                        hy[v * vec + i] = Yv[row, col + i]
                    for i in T.vectorized(vec):
                        hd[v * vec + i] = DY[row, col + i]
                else:
                    for i in T.unroll(vec):
                        hy[v * vec + i] = T.cast(0, dtype)
                        hd[v * vec + i] = T.cast(0, dtype)
            acc[0] = T.cast(0, f32)
            for j in T.unroll(hold * vec):
                acc[0] += _bwd_term(T, kind, hy[j], hd[j])
            for step in T.serial(steps):
                for v in T.unroll(per):
                    col = head + step * chunk + (v * threads + tx) * vec
                    if col < n:
                        for i in T.vectorized(vec):
                            py[v * vec + i] = Yv[row, col + i]
                        for i in T.vectorized(vec):
                            pd[v * vec + i] = DY[row, col + i]
                    else:
                        for i in T.unroll(vec):
                            py[v * vec + i] = T.cast(0, dtype)
                            pd[v * vec + i] = T.cast(0, dtype)
                for j in T.unroll(per * vec):
                    acc[0] += _bwd_term(T, kind, py[j], pd[j])
            for s in T.unroll(5):
                acc[0] += T.shfl_xor(acc[0], 16 >> s)
            if tx % _WARP == 0:
                red[tx // _WARP] = acc[0]
            T.sync_threads()
            acc[0] = T.cast(0, f32)
            if tx % _WARP < warps:
                acc[0] = red[tx % _WARP]
            for s in T.unroll(5):
                acc[0] += T.shfl_xor(acc[0], 16 >> s)
            for v in T.unroll(hold):
                col = (v * threads + tx) * vec
                if col < n:
                    for i in T.unroll(vec):
                        hd[v * vec + i] = T.cast(_bwd_value(
                            T, kind, hy[v * vec + i], hd[v * vec + i], acc[0]), dtype)
                    for i in T.vectorized(vec):
                        DX[row, col + i] = hd[v * vec + i]
            for step in T.serial(steps):
                for v in T.unroll(per):
                    col = head + step * chunk + (v * threads + tx) * vec
                    if col < n:
                        for i in T.vectorized(vec):
                            py[v * vec + i] = Yv[row, col + i]
                        for i in T.vectorized(vec):
                            pd[v * vec + i] = DY[row, col + i]
                for v in T.unroll(per):
                    col = head + step * chunk + (v * threads + tx) * vec
                    if col < n:
                        for i in T.unroll(vec):
                            pd[v * vec + i] = T.cast(_bwd_value(
                                T, kind, py[v * vec + i], pd[v * vec + i], acc[0]), dtype)
                        for i in T.vectorized(vec):
                            DX[row, col + i] = pd[v * vec + i]

    return _bwd_signature(body, (M, n), dtype)


def strided_bwd_program(kind: str, r: int, inner: int, dtype: str, lanes: int, groups: int,
                        vec: int):
    """The gradient's strided kernel over ``(outer, r, inner)`` views."""
    _, T = tl()
    outer = T.dynamic("outer")
    cols = lanes * vec
    blocks = -(-inner // cols)  # column blocks of an outer index
    steps = -(-r // groups)
    f32 = "float32"

    @T.macro
    def body(Yv, DY, DX):
        # a 1-D grid, column blocks fastest: gridDim.y would cap outer at 65535
        with T.Kernel(outer * blocks, threads=lanes * groups) as bid:
            o = bid // blocks
            tx = T.get_thread_binding()
            lane = tx % lanes
            g = tx // lanes
            c = (bid % blocks) * cols + lane * vec
            py = T.alloc_local((vec,), dtype)
            pd = T.alloc_local((vec,), dtype)
            tot = T.alloc_local((vec,), f32)
            red = T.alloc_shared((groups, cols), f32)
            for i in T.unroll(vec):
                tot[i] = T.cast(0, f32)
            for step in T.serial(steps):
                k = step * groups + g
                if k < r and c < inner:
                    for i in T.vectorized(vec):
                        py[i] = Yv[o, k, c + i]
                    for i in T.vectorized(vec):
                        pd[i] = DY[o, k, c + i]
                    for i in T.unroll(vec):
                        tot[i] += _bwd_term(T, kind, py[i], pd[i])
            for i in T.unroll(vec):
                red[g, lane * vec + i] = tot[i]
            T.sync_threads()
            for i in T.unroll(vec):
                tot[i] = T.cast(0, f32)
                for w in T.serial(groups):
                    tot[i] += red[w, lane * vec + i]
            for step in T.serial(steps):
                k = step * groups + g
                if k < r and c < inner:
                    for i in T.vectorized(vec):
                        py[i] = Yv[o, k, c + i]
                    for i in T.vectorized(vec):
                        pd[i] = DY[o, k, c + i]
                    for i in T.unroll(vec):
                        pd[i] = T.cast(_bwd_value(T, kind, py[i], pd[i], tot[i]), dtype)
                    for i in T.vectorized(vec):
                        DX[o, k, c + i] = pd[i]

    return _bwd_signature(body, (outer, r, inner), dtype)


# --- logsumexp's gradient --------------------------------------------------------------------


def _lse_bwd_signature(body, xs, rs, dtype: str):
    _, T = tl()

    @T.prim_func
    def main(DY: T.Tensor(rs, dtype), X: T.Tensor(xs, dtype), LSE: T.Tensor(rs, dtype),
             DX: T.Tensor(xs, dtype)):
        body(DY, X, LSE, DX)

    return main


def rows_lse_bwd_program(kind: str, n: int, dtype: str, tpr: int, rpc: int, vec: int,
                         per: int, steps: int):
    """``dx = dy * exp(x - lse)`` over ``(M, n)`` rows with ``(M,)`` ``dy`` and ``lse``."""
    _, T = tl()
    M = T.dynamic("M")
    chunk = tpr * per * vec
    f32 = "float32"

    @T.macro
    def body(DY, X, LSE, DX):
        with T.Kernel(T.ceildiv(M, rpc), threads=tpr * rpc) as bx:
            tx = T.get_thread_binding()
            lane = tx % tpr
            row = bx * rpc + tx // tpr
            piece = T.alloc_local((per * vec,), dtype)
            g = T.alloc_local((2,), f32)  # dy, lse
            if row < M:
                g[0] = T.cast(DY[row], f32)
                g[1] = T.cast(LSE[row], f32)
            for step in T.serial(steps):
                for v in T.unroll(per):
                    col = step * chunk + (v * tpr + lane) * vec
                    if row < M and col < n:
                        for i in T.vectorized(vec):
                            piece[v * vec + i] = X[row, col + i]
                for v in T.unroll(per):
                    col = step * chunk + (v * tpr + lane) * vec
                    if row < M and col < n:
                        for i in T.unroll(vec):
                            piece[v * vec + i] = T.cast(g[0] * T.exp2(
                                (T.cast(piece[v * vec + i], f32) - g[1]) * _LOG2E), dtype)
                        for i in T.vectorized(vec):
                            DX[row, col + i] = piece[v * vec + i]

    return _lse_bwd_signature(body, (M, n), (M,), dtype)


def strided_lse_bwd_program(kind: str, r: int, inner: int, dtype: str, lanes: int,
                            groups: int, vec: int):
    """``dx = dy * exp(x - lse)`` over an ``(outer, r, inner)`` view with ``(outer, inner)``
    ``dy`` and ``lse``: the strided kernels' CTAs, each thread reading its columns' ``dy`` and
    ``lse`` once and walking its share of ``r``."""
    _, T = tl()
    outer = T.dynamic("outer")
    cols = lanes * vec
    blocks = -(-inner // cols)
    steps = -(-r // groups)
    f32 = "float32"

    @T.macro
    def body(DY, X, LSE, DX):
        with T.Kernel(outer * blocks, threads=lanes * groups) as bid:
            o = bid // blocks
            tx = T.get_thread_binding()
            g = tx // lanes
            c = (bid % blocks) * cols + (tx % lanes) * vec
            piece = T.alloc_local((vec,), dtype)
            d = T.alloc_local((vec,), dtype)
            e = T.alloc_local((vec,), dtype)
            if c < inner:
                for i in T.vectorized(vec):
                    d[i] = DY[o, c + i]
                for i in T.vectorized(vec):
                    e[i] = LSE[o, c + i]
            for step in T.serial(steps):
                k = step * groups + g
                if k < r and c < inner:
                    for i in T.vectorized(vec):
                        piece[i] = X[o, k, c + i]
                    for i in T.unroll(vec):
                        piece[i] = T.cast(T.cast(d[i], f32) * T.exp2(
                            (T.cast(piece[i], f32) - T.cast(e[i], f32)) * _LOG2E), dtype)
                    for i in T.vectorized(vec):
                        DX[o, k, c + i] = piece[i]

    return _lse_bwd_signature(body, (outer, r, inner), (outer, inner), dtype)


# --- building ----------------------------------------------------------------------------------


class Layout(enum.Enum):
    """Which program a call gets (the implementation's choice, from the view)."""

    REGISTER = "register"
    LOOPED = "looped"
    STRIDED = "strided"
    ROWS = "rows"  # logsumexp's gradient over rows: a walk without a reduction


def plan_of(layout: Layout, spec: _ViewSpec) -> tuple[int, ...]:
    """The launch plan of ``layout`` for ``spec`` (the plan is part of the build key)."""
    held = 2 if isinstance(spec, SoftmaxBwdSpec) else 1
    if layout is Layout.ROWS:
        return rows_walk_plan(spec.r, spec.dtype)
    if layout is Layout.REGISTER:
        plan = register_plan(spec.r, spec.dtype, held)
        assert plan is not None, "the register kernel refuses rows it cannot hold"
        if held == 1:  # the forward: whether softmax keeps its exponentials
            keep = keep_exp(spec.kind, plan)
            if plan[0] == _MAX_REGISTER_THREADS and not keep:
                # registers capped for two CTAs an SM: on the H200 4096 x 32000 bf16 ran at
                # 3.43 TB/s so against 3.11 at one (benchmarks/results/softmax_sweep-cuda0.txt)
                return (*plan, keep, 2)
            return (*plan, keep)
        return plan
    if layout is Layout.LOOPED:
        shared = shared_sm_plan(spec.kind, spec.r, spec.dtype) if held == 1 else None
        if shared is not None:
            return shared
        if held == 1 and spec.kind is not SoftmaxKind.LOGSUMEXP:
            # the row kept on chip (chunks past the head staged in shared memory, their loads
            # issued together): 4096 x 128256 bf16 ran at 3.36 TB/s on the H200 against the
            # two-pass walk's 2.53 (benchmarks/results/softmax_sweep-cuda0.txt)
            return (*looped_staged_plan(spec.kind, spec.r, spec.dtype), True)
        return looped_plan(spec.r, spec.dtype, held)
    return strided_plan(spec.outer, spec.r, spec.inner, spec.dtype)


_FWD = {Layout.REGISTER: register_fwd_program, Layout.LOOPED: looped_fwd_program,
        Layout.STRIDED: strided_fwd_program}
_BWD = {Layout.REGISTER: register_bwd_program, Layout.LOOPED: looped_bwd_program,
        Layout.STRIDED: strided_bwd_program}
_LSE_BWD = {Layout.ROWS: rows_lse_bwd_program, Layout.STRIDED: strided_lse_bwd_program}


def _program(table, layout: Layout, kind: str, r: int, inner: int, dtype: str, plan):
    if layout is Layout.STRIDED:
        return table[layout](kind, r, inner, dtype, *plan)
    return table[layout](kind, r, dtype, *plan)


@stored(maxsize=256)
def build_fwd(layout: Layout, kind: str, r: int, inner: int, dtype: str, plan: tuple,
              target: str | None = None):
    """Compile a forward program (cached per configuration); ``inner`` is 1 but for
    STRIDED."""
    return compile_program(_program(_FWD, layout, kind, r, inner, dtype, plan), target)


@stored(maxsize=256)
def build_bwd(layout: Layout, kind: str, r: int, inner: int, dtype: str, plan: tuple,
              target: str | None = None):
    """Compile a gradient program (cached per configuration)."""
    return compile_program(_program(_BWD, layout, kind, r, inner, dtype, plan), target)


@stored(maxsize=256)
def build_lse_bwd(layout: Layout, kind: str, r: int, inner: int, dtype: str, plan: tuple,
                  target: str | None = None):
    """Compile a program of logsumexp's gradient (cached per configuration)."""
    return compile_program(_program(_LSE_BWD, layout, kind, r, inner, dtype, plan), target)


# --- the implementations -----------------------------------------------------------------------


class _SoftmaxKernel(Kernel):
    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    layout: ClassVar[Layout]
    _build: ClassVar[Any] = None
    #: what serves a call whose reduced axis is the last, as the strided kernel's refusal says
    _rows_served_by: ClassVar[str] = "the row kernels serve it"
    #: a looped layout's register sibling, which it leaves the rows it holds
    _register: ClassVar[Any] = None
    #: how a looped kernel's refusal names rows the register kernel holds
    _rows_fit: ClassVar[str] = ""

    @classmethod
    def identity(cls, spec: _ViewSpec):
        # the program is compiled for the reduced length (and inner size, when strided); the
        # rows / outer count is a launch-time size, except where the strided plan reads it
        plan = plan_of(cls.layout, spec)
        inner = spec.inner if cls.layout is Layout.STRIDED else 1
        return spec.kind, spec.r, inner, spec.dtype, plan, spec.device

    @classmethod
    def region_refusal(cls, spec: _ViewSpec) -> str | None:
        # the strided layout serves a reduced axis that is not the last; the others, rows
        # (inner 1) within the limits of :meth:`_row_refusal`
        if cls.layout is Layout.STRIDED:
            if spec.inner == 1:
                return f"the reduced axis is the last one (inner 1): {cls._rows_served_by}"
            return None
        if spec.inner != 1:
            return f"reduces the last axis (inner 1), not an inner size of {spec.inner}"
        return cls._row_refusal(spec)

    @classmethod
    def _row_refusal(cls, spec: _ViewSpec) -> str | None:
        """Why rows of ``spec`` are outside this row layout's lengths, or None (a looped
        layout: the rows its register sibling serves)."""
        if cls._register is not None and cls._register._row_refusal(spec) is None:
            return cls._rows_fit.format(r=spec.r, dtype=spec.dtype) + " the register kernel"
        return None

    def __init__(self, spec: _ViewSpec) -> None:
        super().__init__(spec)
        inner = spec.inner if self.layout is Layout.STRIDED else 1
        self.program = type(self)._build(self.layout, spec.kind.value, spec.r, inner,
                                         spec.dtype, plan_of(self.layout, spec))
        self._rows = (-1, spec.r) if self.layout is not Layout.STRIDED else (-1, spec.r,
                                                                            spec.inner)
        self._lse = (-1,) if self.layout is not Layout.STRIDED else (-1, spec.inner)
        self._empty = spec.outer == 0


class _FwdKernel(_SoftmaxKernel, SoftmaxFwdInterface):
    _build = staticmethod(build_fwd)
    _rows_fit = "a row of {r} x {dtype} fits"

    def __call__(self, x, out) -> None:
        if self._empty:
            return
        lse = self.spec.kind is SoftmaxKind.LOGSUMEXP
        self.program(x.view(self._rows), out.view(self._lse if lse else self._rows))


class _BwdKernel(_SoftmaxKernel, SoftmaxBwdInterface):
    _build = staticmethod(build_bwd)
    _rows_fit = "rows of {r} x {dtype} (y and dy) fit"

    def __call__(self, y, dy, dx) -> None:
        if self._empty:
            return
        v = self._rows
        self.program(y.view(v), dy.view(v), dx.view(v))


class _LseBwdKernel(_SoftmaxKernel, LogSumExpBwdInterface):
    _build = staticmethod(build_lse_bwd)
    _rows_served_by = "the rows kernel serves it"

    def __call__(self, dy, x, lse, dx) -> None:
        if self._empty:
            return
        v, w = self._rows, self._lse
        self.program(dy.view(w), x.view(v), lse.view(w), dx.view(v))


class LogSumExpBwdRowsKernel(_LseBwdKernel):
    """logsumexp's gradient over rows: each element read once and written once."""

    layout = Layout.ROWS


class LogSumExpBwdStridedKernel(_LseBwdKernel):
    """logsumexp's gradient over a reduced axis that is not the last, read in place."""

    layout = Layout.STRIDED


class SoftmaxRegisterKernel(_FwdKernel):
    """Rows held in registers: each element read once and written once."""

    layout = Layout.REGISTER

    @classmethod
    def _row_refusal(cls, spec: SoftmaxSpec) -> str | None:
        if register_plan(spec.r, spec.dtype) is None:
            return (f"a row of {spec.r} x {spec.dtype} exceeds the {_HELD_BYTES_PER_THREAD} "
                    f"bytes a thread holds at {_MAX_REGISTER_THREADS} threads")
        if shared_sm_plan(spec.kind, spec.r, spec.dtype) is not None:
            return (f"a row of {spec.r} x {spec.dtype} would take {_MAX_REGISTER_THREADS} "
                    f"threads: the looped kernel holds it on chip at three CTAs an SM")
        return None


class SoftmaxLoopedKernel(_FwdKernel):
    """Rows of any length: an online (max, sum) pass and a writing pass."""

    layout = Layout.LOOPED
    _register = SoftmaxRegisterKernel


class SoftmaxStridedKernel(_FwdKernel):
    """A reduced axis that is not the last: the ``(outer, R, inner)`` view read in place."""

    layout = Layout.STRIDED


class SoftmaxBwdRegisterKernel(_BwdKernel):
    """The gradient with the rows of ``y`` and ``dy`` held in registers."""

    layout = Layout.REGISTER

    @classmethod
    def _row_refusal(cls, spec: SoftmaxBwdSpec) -> str | None:
        if register_plan(spec.r, spec.dtype, 2) is None:
            return (f"rows of {spec.r} x {spec.dtype} (y and dy) exceed the "
                    f"{_HELD_BYTES_PER_THREAD} bytes a thread holds at "
                    f"{_MAX_REGISTER_THREADS} threads")
        return None


class SoftmaxBwdLoopedKernel(_BwdKernel):
    """The gradient of rows of any length: a summing pass and a writing pass."""

    layout = Layout.LOOPED
    _register = SoftmaxBwdRegisterKernel


class SoftmaxBwdStridedKernel(_BwdKernel):
    """The gradient over a reduced axis that is not the last, read in place."""

    layout = Layout.STRIDED
