"""Cumulative scans (sum, product) along one axis, in TileLang.

A call is an ``(outer, length, inner)`` view of a contiguous input, scanned along ``length``.
Arithmetic runs in the accumulation dtype: float32 for a floating input (float16, bfloat16 and
float32 alike, as torch accumulates on CUDA), int64 for an integer one (whose output is int64,
as torch's; a bool input is handed over as uint8 by the op). ``length`` and ``inner`` are
compiled in; ``outer`` is a launch-time size.

Two implementations serve the one slot :class:`ScanInterface`:

:class:`ScanRowKernel` -- ``inner == 1``: each row is walked in chunks by one CTA. A thread
    reads ``per`` contiguous elements (32 bytes, in the widest accesses the row's alignment
    allows), scans them in registers, the threads' totals are scanned with warp shuffles and
    across warps through shared memory, and the chunk's total is carried to the next chunk.
:class:`ScanStridedKernel` -- any ``inner`` (the general one): threads lie along ``inner``
    (coalesced, ``vec`` contiguous elements each) and each walks ``length`` carrying its
    running values, reading ``unroll`` rows before it scans them so that several loads are in
    flight.

Every grid is one-dimensional (the row count or ``outer`` alone may pass the 65535 a grid's
second and third dimensions allow). Both split the scanned axis into segments when the call alone would not fill the GPU (one long
row, or a leading dim over few columns): a first program writes each segment's total (a sum
or a product in the accumulation dtype) and the scan program starts each segment from the
combination of the totals before it. That reads the input twice, which costs a third of the
bandwidth a single pass would reach, but spreads a 2^20-element row over hundreds of CTAs
instead of leaving it to one.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
from typing import Literal, get_args

import torch

from tileops.runtime import CallSpec, Kernel, KernelInterface
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

from ._store import stored
from ._tilelang import compile_program, tl
from ._tilelang import pow2_at_least as _pow2_at_least
from ._tilelang import widest_vec as _vec

__all__ = [
    "ScanDType",
    "ScanInterface",
    "ScanKind",
    "ScanRowKernel",
    "ScanSpec",
    "ScanStridedKernel",
    "build_row_scan",
    "build_strided_scan",
    "row_plan",
    "strided_plan",
]

_VECTOR_BYTES = 16
_WARP = 32
#: CTAs a call should launch at least before its scanned axis is split: eight per SM of an
#: H100/H200 (132 SMs)
_WANT_CTAS = 1056
_ROW_THREADS = 512
_STRIDED_THREADS = 128
#: rows a thread of the strided walk reads before it scans them (eight 16-byte loads in flight)
_UNROLL = 8
#: the fewest rows of the scanned axis a strided segment holds
_MIN_SEGMENT_ROWS = 16


class ScanKind(enum.Enum):
    """Which combination a scan computes."""

    SUM = "sum"
    PROD = "prod"


#: the input dtypes the scan kernels are written for (a bool input is viewed as uint8)
ScanDType = Literal["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
                    "float32"]
_SCAN_DTYPES = frozenset(get_args(ScanDType))
_INTEGER = frozenset({"uint8", "int8", "int16", "int32", "int64"})


def out_dtype(dtype: str) -> str:
    """The output dtype of a scan of ``dtype``: int64 for an integer, else ``dtype``."""
    return "int64" if dtype in _INTEGER else dtype


def acc_dtype(dtype: str) -> str:
    """The dtype a scan of ``dtype`` accumulates in."""
    return "int64" if dtype in _INTEGER else "float32"


class ScanSpec(CallSpec, frozen=True, kw_only=True):
    """What a scan implementation is told about a call: the ``(outer, length, inner)`` view of
    the contiguous input, scanned along ``length``, its storage dtype and the combination."""

    kind: ScanKind
    outer: int
    length: int
    inner: int
    dtype: ScanDType

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ScanKind):
            raise TypeError(f"ScanSpec.kind must be a ScanKind, got {self.kind!r}")
        self.check_fields(choices={"dtype": _SCAN_DTYPES}, sizes=("outer", "length", "inner"))


class ScanInterface(KernelInterface):
    """One slot: ``forward(x, y)`` with ``x`` a contiguous ``(outer, length, inner)`` tensor at
    a 16-byte aligned address and ``y`` one of the same shape in :func:`out_dtype`; ``y`` is
    the scan of ``x`` along its middle axis."""

    slot = "scan_fwd"
    call_spec = ScanSpec


# --- plans -----------------------------------------------------------------------------------


def row_plan(n: int, dtype: str, rows: int) -> tuple[int, int, int, int, int]:
    """``(threads, vec, per, segs, seg_len)`` of the row scan: each thread scans ``per``
    contiguous elements (32 bytes: two 16-byte loads in flight) of a chunk of
    ``threads * per``, read ``vec`` at a time; a row is cut
    into ``segs`` segments of ``seg_len`` elements (a multiple of the chunk), split only when
    the rows alone launch fewer than :data:`_WANT_CTAS` CTAs."""
    vec = _vec(n, dtype)
    per = max(vec, 2 * _VECTOR_BYTES // _ITEMSIZE[dtype])
    threads = min(_ROW_THREADS, max(_WARP, _pow2_at_least(-(-n // per))))
    chunk = threads * per
    chunks = max(1, -(-n // chunk))
    segs = 1
    if rows < _WANT_CTAS and chunks > 1:
        segs = min(chunks, -(-_WANT_CTAS // max(rows, 1)))
    seg_chunks = -(-chunks // segs)
    segs = -(-chunks // seg_chunks)
    return threads, vec, per, segs, seg_chunks * chunk


def strided_plan(length: int, inner: int, dtype: str, outer: int
                 ) -> tuple[int, int, int, int]:
    """``(threads, vec, segs, seg_len)`` of the strided walk: each thread holds ``vec``
    contiguous columns (narrowed until a warp's worth of threads has columns), ``threads``
    threads a CTA, and the scanned axis is cut into ``segs`` segments of ``seg_len`` rows (a
    multiple of :data:`_UNROLL`) when the columns alone launch fewer than
    :data:`_WANT_CTAS` CTAs."""
    vec = _vec(inner, dtype)
    while vec > 1 and -(-inner // vec) < _WARP:
        vec //= 2
    threads = min(_STRIDED_THREADS, max(_WARP, _pow2_at_least(-(-inner // vec))))
    ctas = max(1, -(-inner // (threads * vec)) * outer)
    segs = 1
    if ctas < _WANT_CTAS:
        segs = max(1, min(-(-_WANT_CTAS // ctas), length // _MIN_SEGMENT_ROWS))
    seg_len = -(-max(length, 1) // segs)
    seg_len = -(-seg_len // _UNROLL) * _UNROLL
    segs = max(1, -(-length // seg_len))
    return threads, vec, segs, seg_len


# --- TileLang programs -----------------------------------------------------------------------


def _combine(kind: str):
    return (lambda a, b: a + b) if kind == "sum" else (lambda a, b: a * b)


def _identity(kind: str, acc: str):
    _, T = tl()
    return T.cast(0 if kind == "sum" else 1, acc)


def row_program(kind: str, n: int, dtype: str, totals: bool, threads: int, vec: int,
                per: int, segs: int, seg_len: int):
    """The row scan over ``(M, n)`` (``totals``: the program writing each segment's total into
    an ``(M, segs)`` tensor instead). Not compiled."""
    _, T = tl()
    M = T.dynamic("M")
    out, acc = out_dtype(dtype), acc_dtype(dtype)
    op = _combine(kind)
    chunk = threads * per
    steps = seg_len // chunk
    warps = threads // _WARP
    pieces = per // vec
    exact = segs * seg_len == n  # no column predicate needed

    @T.macro
    def load(X, row, base, vals, piece):
        """The thread's ``per`` elements at ``base`` into ``vals`` (the identity past n)."""
        for p in T.unroll(pieces):
            col = base + p * vec
            if exact or col < n:
                for i in T.vectorized(vec):
                    piece[i] = X[row, col + i]
                for i in T.unroll(vec):
                    vals[p * vec + i] = T.cast(piece[i], acc)
            else:
                for i in T.unroll(vec):
                    vals[p * vec + i] = _identity(kind, acc)

    @T.macro
    def block_combine(c, slot, ws, tx):
        """``c[slot]`` combined over the CTA's threads, in every thread."""
        for s in T.unroll(5):
            c[slot] = op(c[slot], T.shfl_xor(c[slot], 16 >> s))
        if warps > 1:
            if tx % _WARP == 0:
                ws[tx // _WARP] = c[slot]
            T.sync_threads()
            c[slot] = ws[0]
            for w in T.unroll(1, warps):
                c[slot] = op(c[slot], ws[w])
            T.sync_threads()

    if totals:
        @T.prim_func
        def main(X: T.Tensor((M, n), dtype), Tot: T.Tensor((M, segs), acc)):
            with T.Kernel(M * segs, threads=threads) as bid:
                row = bid // segs
                sx = bid % segs
                tx = T.get_thread_binding()
                vals = T.alloc_local((per,), acc)
                piece = T.alloc_local((vec,), dtype)
                c = T.alloc_local((1,), acc)
                ws = T.alloc_shared((warps,), acc)
                c[0] = _identity(kind, acc)
                for step in T.serial(steps):
                    load(X, row, sx * seg_len + step * chunk + tx * per, vals, piece)
                    for i in T.unroll(per):
                        c[0] = op(c[0], vals[i])
                block_combine(c, 0, ws, tx)
                if tx == 0:
                    Tot[row, sx] = c[0]

        return main

    @T.macro
    def body(X, Tot, Y):
        with T.Kernel(M * segs, threads=threads) as bid:
            row = bid // segs
            sx = bid % segs
            tx = T.get_thread_binding()
            lane = tx % _WARP
            warp = tx // _WARP
            vals = T.alloc_local((per,), acc)
            piece = T.alloc_local((vec,), dtype)
            outp = T.alloc_local((per,), out)
            c = T.alloc_local((4,), acc)  # carry, thread total, exclusive prefix, shuffled
            ws = T.alloc_shared((warps,), acc)
            c[0] = _identity(kind, acc)
            if segs > 1:
                # the carry into this segment: the totals of the segments before it
                c[1] = _identity(kind, acc)
                for j in T.serial(-(-segs // threads)):
                    if j * threads + tx < sx:
                        c[1] = op(c[1], Tot[row, j * threads + tx])
                block_combine(c, 1, ws, tx)
                c[0] = c[1]
            for step in T.serial(steps):
                base = sx * seg_len + step * chunk + tx * per
                load(X, row, base, vals, piece)
                for i in T.unroll(1, per):
                    vals[i] = op(vals[i - 1], vals[i])
                # inclusive scan of the thread totals across the warp (Hillis-Steele); every
                # lane shuffles, and only the lanes above the offset combine
                c[1] = vals[per - 1]
                for s in T.unroll(5):
                    c[3] = T.shfl_up(c[1], 1 << s)
                    if lane >= (1 << s):
                        c[1] = op(c[1], c[3])
                c[3] = T.shfl_up(c[1], 1)
                c[2] = _identity(kind, acc)
                if lane > 0:
                    c[2] = c[3]
                if warps > 1:
                    if lane == _WARP - 1:
                        ws[warp] = c[1]
                    T.sync_threads()
                    for w in T.unroll(warps - 1):
                        if w < warp:
                            c[2] = op(c[2], ws[w])
                c[2] = op(c[2], c[0])
                for i in T.unroll(per):
                    outp[i] = T.cast(op(c[2], vals[i]), out)
                for p in T.unroll(pieces):
                    col = base + p * vec
                    if exact or col < n:
                        for i in T.vectorized(vec):
                            Y[row, col + i] = outp[p * vec + i]
                # the chunk's total carries into the next chunk
                if warps > 1:
                    for w in T.unroll(warps):
                        c[0] = op(c[0], ws[w])
                    T.sync_threads()
                else:
                    c[0] = op(c[0], T.shfl_sync(c[1], _WARP - 1))

    if segs > 1:
        @T.prim_func
        def main(X: T.Tensor((M, n), dtype), Tot: T.Tensor((M, segs), acc),
                 Y: T.Tensor((M, n), out)):
            body(X, Tot, Y)
    else:
        @T.prim_func
        def main(X: T.Tensor((M, n), dtype), Y: T.Tensor((M, n), out)):
            body(X, None, Y)
    return main


def strided_program(kind: str, length: int, inner: int, dtype: str, totals: bool,
                    threads: int, vec: int, segs: int, seg_len: int):
    """The strided walk over ``(B, length, inner)`` (``totals``: the program writing each
    segment's column totals into a ``(B, segs, inner)`` tensor instead). Not compiled."""
    _, T = tl()
    B = T.dynamic("B")
    out, acc = out_dtype(dtype), acc_dtype(dtype)
    op = _combine(kind)
    blocks = -(-inner // (threads * vec))
    steps = seg_len // _UNROLL
    exact = segs * seg_len == length

    @T.macro
    def walk(X, Tot, Y):
        with T.Kernel(B * segs * blocks, threads=threads) as bid:
            o = bid // (segs * blocks)
            sx = bid // blocks % segs
            bx = bid % blocks
            tx = T.get_thread_binding()
            col = (bx * threads + tx) * vec
            run = T.alloc_local((vec,), acc)
            held = T.alloc_local((_UNROLL * vec,), dtype)
            outp = T.alloc_local((vec,), out)
            for i in T.unroll(vec):
                run[i] = _identity(kind, acc)
            if col < inner:
                if not totals and segs > 1:
                    for s in T.serial(sx):
                        for i in T.unroll(vec):
                            run[i] = op(run[i], Tot[o, s, col + i])
                for step in T.serial(steps):
                    for u in T.unroll(_UNROLL):
                        r = sx * seg_len + step * _UNROLL + u
                        if exact or r < length:
                            for i in T.vectorized(vec):
                                held[u * vec + i] = X[o, r, col + i]
                    for u in T.unroll(_UNROLL):
                        r = sx * seg_len + step * _UNROLL + u
                        if exact or r < length:
                            for i in T.unroll(vec):
                                run[i] = op(run[i], T.cast(held[u * vec + i], acc))
                            if not totals:
                                for i in T.unroll(vec):
                                    outp[i] = T.cast(run[i], out)
                                for i in T.vectorized(vec):
                                    Y[o, r, col + i] = outp[i]
                if totals:
                    for i in T.unroll(vec):
                        Tot[o, sx, col + i] = run[i]

    if totals:
        @T.prim_func
        def main(X: T.Tensor((B, length, inner), dtype),
                 Tot: T.Tensor((B, segs, inner), acc)):
            walk(X, Tot, None)
    elif segs > 1:
        @T.prim_func
        def main(X: T.Tensor((B, length, inner), dtype),
                 Tot: T.Tensor((B, segs, inner), acc), Y: T.Tensor((B, length, inner), out)):
            walk(X, Tot, Y)
    else:
        @T.prim_func
        def main(X: T.Tensor((B, length, inner), dtype), Y: T.Tensor((B, length, inner), out)):
            walk(X, None, Y)
    return main


@stored(maxsize=256)
def build_row_scan(kind: str, n: int, dtype: str, totals: bool, plan: tuple,
                   target: str | None = None):
    """Compile a row-scan program for ``plan`` (:func:`row_plan`'s tuple), cached."""
    return compile_program(row_program(kind, n, dtype, totals, *plan), target)


@stored(maxsize=256)
def build_strided_scan(kind: str, length: int, inner: int, dtype: str, totals: bool,
                       plan: tuple, target: str | None = None):
    """Compile a strided-walk program for ``plan`` (:func:`strided_plan`'s tuple), cached."""
    return compile_program(strided_program(kind, length, inner, dtype, totals, *plan), target)


# --- the implementations ---------------------------------------------------------------------

_TORCH_ACC = {"int64": torch.int64, "float32": torch.float32}


class _ScanKernel(Kernel, ScanInterface):
    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})


class ScanRowKernel(_ScanKernel):
    """``inner == 1``: a CTA a row (or a row segment), chunks carried along the row."""

    @classmethod
    def region_refusal(cls, spec: ScanSpec) -> str | None:
        if spec.inner != 1:
            return f"the scanned axis is not the last (inner {spec.inner})"
        return None

    @classmethod
    def identity(cls, spec: ScanSpec):
        # the row count matters only through the plan's split, and whether there are rows
        return (spec.device, spec.kind, spec.length, spec.dtype, spec.outer == 0,
                row_plan(spec.length, spec.dtype, spec.outer))

    def __init__(self, spec: ScanSpec) -> None:
        super().__init__(spec)
        plan = row_plan(spec.length, spec.dtype, spec.outer)
        self._segs = plan[3]
        self._acc = _TORCH_ACC[acc_dtype(spec.dtype)]
        # an empty call builds nothing (a program over a zero-length axis is not one)
        empty = spec.outer * spec.length == 0
        self.program = None if empty else build_row_scan(spec.kind.value, spec.length,
                                                         spec.dtype, False, plan)
        self.totals = (build_row_scan(spec.kind.value, spec.length, spec.dtype, True, plan)
                       if self._segs > 1 and not empty else None)

    def __call__(self, x, y) -> None:
        if self.program is None:
            return
        rows = x.shape[0]
        x2, y2 = x.view(rows, x.shape[1]), y.view(rows, x.shape[1])
        if self.totals is None:
            self.program(x2, y2)
            return
        tot = torch.empty((rows, self._segs), dtype=self._acc, device=x.device)
        self.totals(x2, tot)
        self.program(x2, tot, y2)


class ScanStridedKernel(_ScanKernel):
    """Any axis: threads along ``inner``, each carrying its running values along ``length``."""

    general = True

    @classmethod
    def identity(cls, spec: ScanSpec):
        return (spec.device, spec.kind, spec.length, spec.inner, spec.dtype, spec.outer == 0,
                strided_plan(spec.length, spec.inner, spec.dtype, spec.outer))

    def __init__(self, spec: ScanSpec) -> None:
        super().__init__(spec)
        plan = strided_plan(spec.length, spec.inner, spec.dtype, spec.outer)
        self._segs = plan[2]
        self._acc = _TORCH_ACC[acc_dtype(spec.dtype)]
        args = (spec.kind.value, spec.length, spec.inner, spec.dtype)
        empty = spec.outer * spec.length * spec.inner == 0  # builds nothing
        self.program = None if empty else build_strided_scan(*args, False, plan)
        self.totals = (build_strided_scan(*args, True, plan) if self._segs > 1 and not empty
                       else None)

    def __call__(self, x, y) -> None:
        if self.program is None:
            return
        if self.totals is None:
            self.program(x, y)
            return
        tot = torch.empty((x.shape[0], self._segs, x.shape[2]), dtype=self._acc,
                          device=x.device)
        self.totals(x, tot)
        self.program(x, tot, y)
