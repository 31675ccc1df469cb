"""Reductions (sum, mean, prod, amax, amin, var, std, var_mean, the 2-norm, all, any, argmax,
argmin) in TileLang.

Every call is handed over as a contiguous ``(outer, R, inner)`` view of its input, reduced over
``R`` (the op merges adjacent reduced axes and adjacent kept ones; see
:mod:`tileops.ops.reduction`). Two programs serve the one slot :class:`ReductionInterface`:

:class:`ReductionRowKernel` (``inner == 1``) -- a row reduction of an ``(M, N)`` view.
    ``tpr`` threads a row walk it with the widest aligned access (16 bytes where ``N`` allows),
    ``per`` accesses issued before any is accumulated, then reduce with warp shuffles and,
    across the warps of a row, shared memory. Rows of at most a warp's share pack eight rows
    (a warp each) into a CTA. Few long rows (``dim=None`` is one row) are split across CTAs.
:class:`ReductionColumnKernel` (``inner > 1``) -- a column reduction. A CTA is ``tcols``
    threads over ``inner`` (one aligned vector each, so a warp reads 512 contiguous bytes of a
    row) by ``ty`` groups walking ``R`` interleaved; the groups' partials meet in shared
    memory. When ``outer x inner`` gives too few CTAs (``dim=0`` of 32768 x 8192 gives 32),
    ``R`` is split across CTAs.

Sizes: the row count (``M = outer`` of the row program, ``outer`` of the column program, the
outputs' count of the finish) is a launch-time size (``T.dynamic``), so a model calling a
reduction on a new batch size reuses the program of the last one. The reduced length ``r``
and ``inner`` stay compiled in: the access width, the threads and the loop's steps are
functions of them. The row count reaches a plan only through the split count, which is asked
for as a power of two, so the row counts of a row length share at most 11 programs (one, the
unsplit, from ``_TARGET_CTAS`` CTAs of whole rows up).

A split writes one partial state per (split, output) into a float32 / int64 workspace
``(parts, splits, P)`` (and an int32 ``(splits, P)`` of indices for argmax/argmin) and a second
small program, the finish, combines the splits of each output in split order and writes it.
Two passes rather than atomics: the combine is not a float add for most kinds (prod, the
moments, argmax), and the order stays fixed, so results are deterministic.

Arithmetic: float16/bfloat16/float32 accumulate in float32, integers and bool (sum, prod) in
int64, amax/amin/argmax of integers and amax/amin of bool in int64 (exact); the 8- and 16-bit
integers are read as themselves (16 or 8 to a 16-byte access). The variance is the shifted-data form:
``d = x - x_0`` with ``x_0`` the first element of the reduced run, ``M2 = sum(d^2) -
sum(d)^2 / n``, which keeps the fp32 cancellation bounded by the spread around ``x_0`` (the
unshifted form loses every digit when the mean dominates) and, unlike Welford, merges the
partials of splits and threads by plain addition.

NaN follows torch: amax/amin return NaN if any element is NaN; argmax/argmin take a NaN as the
extreme (its first occurrence); ties keep the first index. bool tensors are declared uint8
(TileLang cannot vectorize bool) and read as a nonzero test; all/any write 0 or 1 into the bool
output's uint8 view (into a uint8 output for a uint8 input, as torch's all and any keep uint8),
amax/amin of bool their 0 or 1.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
from typing import Literal, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

from ._store import stored
from ._tilelang import compile_program, tl
from ._tilelang import pow2_at_least as _pow2_at_least

__all__ = [
    "ReduceKind",
    "ReductionColumnKernel",
    "ReductionDType",
    "ReductionInterface",
    "ReductionRowKernel",
    "ReductionSpec",
    "build_column_kernel",
    "build_finish_kernel",
    "build_row_kernel",
    "column_plan",
    "column_shape",
    "row_plan",
    "row_shape",
]

_VECTOR_BYTES = 16
_WARP = 32
#: CTAs a split aims for: 16 for each of an H200's 132 SMs. Several waves of short CTAs, not
#: one wave of long ones, so that SMs finishing early take more work: dim=0 of 32768 x 8192
#: has 32 column blocks, and 17 splits (544 CTAs, 4.1 an SM) would leave a fifth of the SMs
#: one CTA behind the rest (it gets 64 splits of 512 rows: a split is whole steps of a CTA's
#: rows). The workspace stays small beside the input (64 x 8192 float32 partials: 2 MB
#: against 512 MB read).
_TARGET_CTAS = 132 * 16
#: a split's share of a row, in accesses per thread, below which splitting further costs more
#: in the finish than it gains in parallelism
_MIN_SPLIT_ACCESSES = 8
_MAX_SPLITS = 1024
_INT_MAX = 2**31 - 1


class ReduceKind(enum.Enum):
    """What a reduction computes over its reduced run."""

    SUM = "sum"
    MEAN = "mean"
    PROD = "prod"
    AMAX = "amax"
    AMIN = "amin"
    VAR = "var"
    STD = "std"
    VAR_MEAN = "var_mean"  # two outputs: var, mean
    L2NORM = "l2norm"  # sqrt(sum(x^2))
    ALL = "all"
    ANY = "any"
    ARGMAX = "argmax"
    ARGMIN = "argmin"


_MOMENTS = frozenset({ReduceKind.VAR, ReduceKind.STD, ReduceKind.VAR_MEAN})
_ARG = frozenset({ReduceKind.ARGMAX, ReduceKind.ARGMIN})
_FLOAT_ONLY = _MOMENTS | {ReduceKind.MEAN, ReduceKind.L2NORM}

#: the input dtypes the kernels are written for (float64 is the reference target's)
ReductionDType = Literal["bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                         "bfloat16", "float32"]
_DTYPES = frozenset(get_args(ReductionDType))
_FLOATS = frozenset({"float16", "bfloat16", "float32"})
_OUT_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64", "float16",
                         "bfloat16", "float32"})


def out_dtype_of(kind: ReduceKind, dtype: str) -> str:
    """The output dtype torch gives ``kind`` of a ``dtype`` input (the spec's dtype expressions
    state the same rule; the spec checks the two agree)."""
    if kind in (ReduceKind.ALL, ReduceKind.ANY):
        return "uint8" if dtype == "uint8" else "bool"  # torch.all keeps uint8
    if kind in _ARG:
        return "int64"
    if kind in (ReduceKind.SUM, ReduceKind.PROD) and dtype not in _FLOATS:
        return "int64"
    return dtype


class ReductionSpec(CallSpec, frozen=True, kw_only=True):
    """A reduction call as the kernels see it: the ``(outer, r, inner)`` view reduced over
    ``r``, the input dtype, and for the variance kinds the correction (torch's divisor is
    ``max(0, r - correction)``)."""

    kind: ReduceKind
    outer: int
    r: int
    inner: int
    dtype: ReductionDType
    correction: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ReduceKind):
            raise TypeError(f"ReductionSpec.kind must be a ReduceKind, got {self.kind!r}")
        self.check_fields(choices={"dtype": _DTYPES}, sizes=("outer", "r", "inner"))
        if self.kind in _FLOAT_ONLY and self.dtype not in _FLOATS:
            raise ValueError(f"ReductionSpec: {self.kind.value} needs a floating dtype, got "
                             f"{self.dtype}")
        if self.r == 0 and self.kind in (*_ARG, ReduceKind.AMAX, ReduceKind.AMIN):
            raise ValueError(f"ReductionSpec: {self.kind.value} of an empty run (r = 0) has "
                             f"no value")
        if self.correction and self.kind not in _MOMENTS:
            raise ValueError(f"ReductionSpec: only the variance kinds take a correction, not "
                             f"{self.kind.value}")

    @property
    def out_dtype(self) -> str:
        return out_dtype_of(self.kind, self.dtype)


class ReductionInterface(KernelInterface):
    """One slot: reduce ``x`` of shape ``(outer, r, inner)`` (contiguous, 16-byte aligned)
    over ``r`` into ``out`` (contiguous, ``outer * inner`` elements; ``out2`` too for
    var_mean, else None). ``forward(x, out, out2)``; a bool tensor is passed as it is (the
    entry takes its uint8 view)."""

    slot = "reduction"
    call_spec = ReductionSpec


# --- plans ---------------------------------------------------------------------------------------


def _storage(dtype: str) -> str:
    return "uint8" if dtype == "bool" else dtype


def _vec(n: int, dtype: str) -> int:
    """Widest power-of-two access (elements) that divides ``n`` and fits 16 bytes."""
    vec = _VECTOR_BYTES // _ITEMSIZE[_storage(dtype)]
    while vec > 1 and n % vec:
        vec //= 2
    return vec


def _ceil_to(x: int, step: int) -> int:
    return -(-x // step) * step


def _pow2_at_most(x: int) -> int:
    p = 1
    while 2 * p <= x:
        p *= 2
    return p


def row_shape(n: int, dtype: str) -> tuple[int, int, int, int]:
    """``(tpr, rpc, vec, per)`` of the row kernel for rows of ``n`` (see :func:`row_plan`):
    what the program compiles in besides its split count, a function of the row alone."""
    vec = _vec(n, dtype)
    nv = -(-n // vec)  # accesses in a row
    per = 8 if vec * _ITEMSIZE[_storage(dtype)] >= _VECTOR_BYTES else 16
    tpr = _pow2_at_least(-(-nv // per))
    tpr = _WARP if tpr <= _WARP else min(256, max(128, tpr))
    rpc = 256 // _WARP if tpr == _WARP else 1
    return tpr, rpc, vec, per


def row_plan(m: int, n: int, dtype: str) -> tuple[int, int, int, int, int]:
    """``(tpr, rpc, vec, per, splits)`` for the row kernel: ``tpr`` threads a row, ``rpc``
    rows a CTA, accesses of ``vec`` elements, ``per`` in flight a thread, each row split over
    ``splits`` CTAs.

    The row norms' H200 sweeps (benchmarks/results/norm_sweep.txt) set the shape: 16-byte
    accesses do best with 8 in flight a thread on 128 to 256 threads a row, narrower ones with
    16; rows of at most a warp's share pack 8 rows a CTA. A reduction holds nothing, so a row
    longer than one pass loops. Rows are split only when the CTAs of whole rows cannot fill
    the SMs and each split keeps at least ``_MIN_SPLIT_ACCESSES`` accesses a thread.

    The row count ``m`` is a launch-time size of the program; it reaches the plan only through
    the split count, which is asked for as a power of two (rounded down), so every ``m`` of a
    row length maps to one of at most 11 programs (``m >= _TARGET_CTAS``: always the unsplit
    one).
    """
    tpr, rpc, vec, per = row_shape(n, dtype)
    nv = -(-n // vec)
    ctas = -(-m // rpc)
    splits = 1
    if rpc == 1 and ctas < _TARGET_CTAS:
        most = max(1, nv // (tpr * _MIN_SPLIT_ACCESSES))
        splits = _pow2_at_most(min(_MAX_SPLITS, most, -(-_TARGET_CTAS // max(ctas, 1))))
        splits = -(-n // _row_segment(n, splits, tpr * per * vec, vec))
    return tpr, rpc, vec, per, splits


def _row_segment(n: int, splits: int, chunk: int, vec: int) -> int:
    """The columns of a row split: whole passes of ``chunk`` (no column predicate where they
    tile the row), or the whole row in whole vectors without a split."""
    return _ceil_to(-(-n // splits), chunk if splits > 1 else vec)


def _column_segment(r: int, splits: int, rows: int) -> int:
    """The rows of a column split: whole steps of ``rows`` (no row predicate where they tile
    ``r``)."""
    return _ceil_to(-(-r // splits), rows)


def column_shape(inner: int, dtype: str) -> tuple[int, int, int, int]:
    """``(tcols, ty, vec, per)`` of the column kernel for ``inner`` columns (see
    :func:`column_plan`), a function of ``inner`` alone."""
    vec = _vec(inner, dtype)
    tcols = min(_WARP, _pow2_at_least(-(-inner // vec)))
    ty = 256 // tcols
    per = 8 if vec * _ITEMSIZE[_storage(dtype)] >= _VECTOR_BYTES else 16  # as row_plan's
    return tcols, ty, vec, per


def column_plan(outer: int, r: int, inner: int, dtype: str
                ) -> tuple[int, int, int, int, int]:
    """``(tcols, ty, vec, per, splits)`` for the column kernel: 256 threads, ``tcols`` over
    ``inner`` (one ``vec`` access each) by ``ty`` over ``r``, ``per`` rows in flight a thread,
    ``r`` split over ``splits`` CTAs. A warp spans a row's 32 vectors where ``inner`` has
    them (coalesced 512-byte reads); narrower ``inner`` gives more of the 256 threads to ``r``.
    ``r`` is split when the CTAs over ``outer x inner`` cannot fill the SMs, keeping at least
    ``ty * per`` rows a split. ``outer`` is a launch-time size: as in :func:`row_plan`, it
    reaches the plan only through a power-of-two split count."""
    tcols, ty, vec, per = column_shape(inner, dtype)
    ctas = outer * -(-inner // (tcols * vec))
    splits = 1
    if ctas < _TARGET_CTAS:
        most = max(1, r // (ty * per))
        splits = _pow2_at_most(min(_MAX_SPLITS, most, -(-_TARGET_CTAS // max(ctas, 1))))
        splits = -(-r // _column_segment(r, splits, ty * per))
    return tcols, ty, vec, per, splits


# --- the arithmetic of one kind ----------------------------------------------------------------


def _acc_dtype(kind: ReduceKind, dtype: str) -> str:
    if kind in (ReduceKind.ALL, ReduceKind.ANY):
        return "int32"
    return "float32" if dtype in _FLOATS else "int64"


def _parts(kind: ReduceKind) -> int:
    """Accumulators a state holds (the moments: sum of d, sum of d^2)."""
    return 2 if kind in _MOMENTS else 1


class _Arith:
    """The expressions of one kind in TileLang: the identity, folding in an element, merging two
    states and the output. A state is its parts (``_parts``) plus an index for argmax/argmin;
    an element enters widened to the accumulator dtype."""

    def __init__(self, kind: ReduceKind, dtype: str, r: int, correction: float) -> None:
        _, self.T = tl()
        self.kind, self.dtype, self.r = kind, dtype, r
        self.acc = _acc_dtype(kind, dtype)
        self.out = _storage(out_dtype_of(kind, dtype))
        self.is_float = dtype in _FLOATS
        self.nparts = _parts(kind)
        self.arg = kind in _ARG
        self.divisor = max(0.0, r - correction)

    def identity(self) -> tuple:
        T, k, a = self.T, self.kind, self.acc
        if k in (ReduceKind.AMAX, ReduceKind.ARGMAX):
            return (-T.infinity(a) if self.is_float else T.min_value(a),)
        if k in (ReduceKind.AMIN, ReduceKind.ARGMIN):
            return (T.infinity(a) if self.is_float else T.max_value(a),)
        if k in (ReduceKind.PROD, ReduceKind.ALL):
            return (T.cast(1, a),)
        return (T.cast(0, a),) * self.nparts

    def widen(self, x):
        """A stored element as the accumulator reads it (bool/uint8 as a nonzero test)."""
        T = self.T
        if self.kind in (ReduceKind.ALL, ReduceKind.ANY):
            return T.cast(x != T.cast(0, x.dtype), "int32")
        return T.cast(x, self.acc)

    def _isnan(self, x):
        # CUDA's isnan as an opaque call: TVM's simplifier folds x != x to False
        return self.T.call_pure_extern("bool", "isnan", x)

    def fold(self, state: tuple, x, shift=None) -> tuple:
        """The parts after folding element ``x`` (widened) into ``state`` (not for the arg kinds:
        see :meth:`better`)."""
        k = self.kind
        if k in (ReduceKind.SUM, ReduceKind.MEAN):
            return (state[0] + x,)
        if k is ReduceKind.L2NORM:
            return (state[0] + x * x,)
        if k is ReduceKind.PROD:
            return (state[0] * x,)
        if k in _MOMENTS:
            d = x - shift
            return (state[0] + d, state[1] + d * d)
        return self.merge(state, (x,))

    def merge(self, a: tuple, b: tuple) -> tuple:
        """Two states' parts combined (the arg kinds: see :meth:`better`)."""
        T, k = self.T, self.kind
        if k in (ReduceKind.SUM, ReduceKind.MEAN, ReduceKind.L2NORM) or k in _MOMENTS:
            return tuple(x + y for x, y in zip(a, b, strict=True))
        if k is ReduceKind.PROD:
            return (a[0] * b[0],)
        if k is ReduceKind.ALL:
            return (T.min(a[0], b[0]),)
        if k is ReduceKind.ANY:
            return (T.max(a[0], b[0]),)
        pick = T.max if k is ReduceKind.AMAX else T.min
        if not self.is_float:
            return (pick(a[0], b[0]),)
        # torch.amax/amin: NaN if either is NaN
        return (T.if_then_else(self._isnan(a[0]), a[0],
                               T.if_then_else(self._isnan(b[0]), b[0], pick(a[0], b[0]))),)

    def better(self, v, i, w, j):
        """Whether ``(v, i)`` replaces ``(w, j)`` as argmax/argmin: a NaN beats a number, a
        strictly greater (smaller) value wins, and equal values (or two NaN) keep the lower
        index: torch's first occurrence."""
        T = self.T
        wins = v > w if self.kind is ReduceKind.ARGMAX else v < w
        tie = v == w
        if not self.is_float:
            return T.Or(wins, T.And(tie, i < j))
        nv, nw = self._isnan(v), self._isnan(w)
        return T.Or(T.And(nv, T.Not(nw)),
                    T.Or(T.And(T.Not(nw), wins),
                         T.And(T.Or(tie, T.And(nv, nw)), i < j)))

    def outputs(self, parts: tuple, idx, shift) -> tuple:
        """The output values of a final state, in the output's storage dtype."""
        T, k, o = self.T, self.kind, self.out
        f32 = "float32"
        if k in _ARG:
            return (T.cast(idx, o),)
        if k is ReduceKind.MEAN:
            return (T.cast(parts[0] / T.float32(self.r), o),)
        if k is ReduceKind.L2NORM:
            return (T.cast(T.sqrt(parts[0]), o),)
        if k in (ReduceKind.ALL, ReduceKind.ANY):
            return (T.cast(parts[0], o),)
        if k in _MOMENTS:
            s, s2 = parts
            m2 = T.max(s2 - s * s / T.float32(self.r), T.cast(0, f32))
            # torch's divisor max(0, r - correction); at 0, M2 / 0 as IEEE gives it (inf, or NaN
            # for M2 = 0) without a constant division by zero, which TVM's folder refuses
            var = (m2 / T.float32(self.divisor) if self.divisor
                   else m2 * T.infinity(f32))
            if k is ReduceKind.VAR:
                return (T.cast(var, o),)
            if k is ReduceKind.STD:
                return (T.cast(T.sqrt(var), o),)
            return T.cast(var, o), T.cast(shift + s / T.float32(self.r), o)
        return (T.cast(parts[0], o),)


# --- TileLang programs -------------------------------------------------------------------------


def _merging(ar: _Arith):
    """The macros a program's states share, over local buffers: ``fold_in`` (an element into
    the state of column ``i``: parts ``acc[k * stride + i]``, index ``idx[i]``),
    ``merge_into`` (the state ``oth`` / ``idx[1]`` into ``acc`` / ``idx[0]``) and ``warp_merge``
    (a butterfly of shuffles: every lane ends with its warp's state). The arg kinds' order is
    total (value, NaN, then index), so both partners of a shuffle pick the same winner."""
    _, T = tl()
    nparts, arg = ar.nparts, ar.arg

    @T.macro
    def fold_in(acc, idx, take, i, stride, x, at, shift):
        if arg:
            take[0] = ar.better(x, at, acc[i], idx[i])
            if take[0]:
                acc[i] = x
                idx[i] = at
        elif nparts == 2:
            nxt = ar.fold((acc[i], acc[stride + i]), x, shift)
            acc[stride + i] = nxt[1]
            acc[i] = nxt[0]
        else:
            acc[i] = ar.fold((acc[i],), x)[0]

    @T.macro
    def merge_into(acc, oth, idx):
        if arg:
            if ar.better(oth[0], idx[1], acc[0], idx[0]):
                acc[0] = oth[0]
                idx[0] = idx[1]
        elif nparts == 2:
            acc[0] = acc[0] + oth[0]
            acc[1] = acc[1] + oth[1]
        else:
            acc[0] = ar.merge((acc[0],), (oth[0],))[0]

    @T.macro
    def warp_merge(acc, oth, idx):
        for s in T.unroll(5):
            for k in T.unroll(nparts):
                oth[k] = T.shfl_xor(acc[k], 16 >> s)
            if arg:
                idx[1] = T.shfl_xor(idx[0], 16 >> s)
            merge_into(acc, oth, idx)

    return fold_in, merge_into, warp_merge


def _direct_row_load_fails(n: int) -> bool:
    """Whether TileLang 0.1.15 cannot lower a load of one fixed column of ``n``-element rows
    (see :func:`tileops.kernels.norm._direct_row_load_fails`: a stride pattern of ``n`` is kept
    in a 16-bit signed lane count); the variance's shift is read at column 0."""
    return n % (1 << 16) >= 1 << 15


def _wrap(body, x_shape, x_dtype, outs: list[tuple[tuple, str]]):
    """The prim_func ``main(X, *outs)`` around ``body`` (a macro taking the same buffers), for
    the one to three outputs a program writes (the final output(s), or the workspace and its
    indices)."""
    _, T = tl()
    if len(outs) == 1:
        (s0, d0), = outs

        @T.prim_func
        def main(X: T.Tensor(x_shape, x_dtype), Y0: T.Tensor(s0, d0)):
            body(X, Y0, None)
    else:
        (s0, d0), (s1, d1) = outs

        @T.prim_func
        def main(X: T.Tensor(x_shape, x_dtype), Y0: T.Tensor(s0, d0), Y1: T.Tensor(s1, d1)):
            body(X, Y0, Y1)
    return main


def _out_buffers(ar: _Arith, kept: tuple, splits: int) -> list[tuple[tuple, str]]:
    """What a main program writes: the output(s) of shape ``kept`` (the row program's
    ``(M,)``, the column program's ``(outer, inner)``), or with splits the workspace
    ``(parts, splits, *kept)`` and, for the arg kinds, its ``(splits, *kept)`` indices (the
    moments keep their shift as a third part, read back from split 0)."""
    if splits == 1:
        n = 2 if ar.kind is ReduceKind.VAR_MEAN else 1
        return [(kept, ar.out)] * n
    parts = ar.nparts + (1 if ar.kind in _MOMENTS else 0)
    outs = [((parts, splits, *kept), ar.acc)]
    if ar.arg:
        outs.append(((splits, *kept), "int32"))
    return outs


def row_program(kind: ReduceKind, n: int, dtype: str, correction: float,
                tpr: int, rpc: int, vec: int, per: int, splits: int):
    """The row kernel over an ``(M, n)`` view, ``M`` a launch-time size (not compiled)."""
    _, T = tl()
    m = T.dynamic("M")
    ar = _Arith(kind, dtype, n, correction)
    store = _storage(dtype)
    acc_t, nparts, arg, moments = ar.acc, ar.nparts, ar.arg, kind in _MOMENTS
    threads = tpr * rpc
    wpr = tpr // _WARP
    chunk = tpr * per * vec
    seg = _row_segment(n, splits, chunk, vec)
    steps = -(-seg // chunk)
    exact = splits * seg == n and steps * chunk == seg  # no column predicate
    spread = moments and _direct_row_load_fails(n)
    slots = rpc * wpr if wpr > 1 else 1  # one per warp: the cross-warp partials
    fold_in, merge_into, warp_merge = _merging(ar)

    @T.macro
    def body(X, Y0, Y1):
        with T.Kernel(T.ceildiv(m, rpc), splits, threads=threads) as (bx, by):
            tx = T.get_thread_binding()
            lane = tx % tpr
            row = bx * rpc + tx // tpr
            rr = T.min(row, m - 1)
            buf = T.alloc_local((per * vec,), store)
            acc = T.alloc_local((nparts,), acc_t)
            oth = T.alloc_local((nparts,), acc_t)
            idx = T.alloc_local((2,), "int32")  # the index, a shuffled one
            sh = T.alloc_local((1,), "float32")
            take = T.alloc_local((1,), "bool")
            red = T.alloc_shared((slots * nparts,), acc_t)
            redi = T.alloc_shared((slots if arg else 1,), "int32")
            ident = ar.identity()
            for k in T.unroll(nparts):
                acc[k] = ident[0] if nparts == 1 else T.cast(0, acc_t)
            idx[0] = _INT_MAX
            sh[0] = T.cast(0, "float32")
            if moments:
                if spread:  # lanes read columns 0..31, lane 0's is the shift
                    sh[0] = T.shfl_sync(T.cast(X[rr, tx % _WARP], "float32"), 0)
                else:
                    sh[0] = T.cast(X[rr, 0], "float32")
            lim = T.min(by * seg + seg, n)
            for step in T.serial(steps):
                for v in T.unroll(per):
                    col = by * seg + step * chunk + (v * tpr + lane) * vec
                    if row < m and (exact or col < lim):
                        for i in T.vectorized(vec):
                            buf[v * vec + i] = X[row, col + i]
                for v in T.unroll(per):
                    col = by * seg + step * chunk + (v * tpr + lane) * vec
                    if row < m and (exact or col < lim):
                        for i in T.unroll(vec):
                            fold_in(acc, idx, take, 0, 1, ar.widen(buf[v * vec + i]), col + i,
                                    sh[0])
            # across the row's lanes: shuffles, then (several warps a row) shared memory
            warp_merge(acc, oth, idx)
            if wpr > 1:
                base = (tx // tpr) * wpr
                if lane % _WARP == 0:
                    for k in T.unroll(nparts):
                        red[(base + lane // _WARP) * nparts + k] = acc[k]
                    if arg:
                        redi[base + lane // _WARP] = idx[0]
                T.sync_threads()
                for k in T.unroll(nparts):
                    acc[k] = red[base * nparts + k]
                if arg:
                    idx[0] = redi[base]
                for w in T.unroll(wpr - 1):
                    for k in T.unroll(nparts):
                        oth[k] = red[(base + w + 1) * nparts + k]
                    if arg:
                        idx[1] = redi[base + w + 1]
                    merge_into(acc, oth, idx)
            if row < m and lane == 0:
                if splits == 1:
                    outs = ar.outputs(tuple(acc[k] for k in range(nparts)), idx[0], sh[0])
                    Y0[row] = outs[0]
                    if kind is ReduceKind.VAR_MEAN:
                        Y1[row] = outs[1]
                else:
                    for k in T.unroll(nparts):
                        Y0[k, by, row] = acc[k]
                    if moments:
                        Y0[nparts, by, row] = sh[0]
                    if arg:
                        Y1[by, row] = idx[0]

    return _wrap(body, (m, n), store, _out_buffers(ar, (m,), splits))


def column_program(kind: ReduceKind, r: int, inner: int, dtype: str, correction: float,
                   tcols: int, ty: int, vec: int, per: int, splits: int):
    """The column kernel over an ``(outer, r, inner)`` view, ``outer`` a launch-time size,
    writing ``(outer, inner)`` outputs (not compiled)."""
    _, T = tl()
    outer = T.dynamic("outer")
    ar = _Arith(kind, dtype, r, correction)
    store = _storage(dtype)
    acc_t, nparts, arg, moments = ar.acc, ar.nparts, ar.arg, kind in _MOMENTS
    threads = tcols * ty
    width = tcols * vec  # columns a CTA
    seg = _column_segment(r, splits, ty * per)
    steps = -(-seg // (ty * per))
    exact_rows = splits * seg == r and steps * ty * per == seg
    exact_cols = inner % width == 0
    rounds = -(-width // threads)  # columns a thread combines in the last step
    blocks = -(-inner // width)
    fold_in, merge_into, _ = _merging(ar)
    ident = ar.identity()

    @T.macro
    def body(X, Y0, Y1):
        # the column blocks of every outer index along x (gridDim.y stops at 65535; outer
        # need not), the splits along y
        with T.Kernel(blocks * outer, splits, threads=threads) as (bxo, bs):
            bo = bxo // blocks
            bx = bxo % blocks
            tx = T.get_thread_binding()
            c = tx % tcols
            t = tx // tcols
            col = bx * width + c * vec
            buf = T.alloc_local((per * vec,), store)
            acc = T.alloc_local((nparts * vec,), acc_t)
            idx = T.alloc_local((vec,), "int32")
            sh = T.alloc_local((vec,), "float32")
            take = T.alloc_local((1,), "bool")
            one = T.alloc_local((nparts,), acc_t)
            oth = T.alloc_local((nparts,), acc_t)
            pair = T.alloc_local((2,), "int32")
            red = T.alloc_shared((nparts * ty * width,), acc_t)
            redi = T.alloc_shared((ty * width if arg else 1,), "int32")
            for q in T.unroll(nparts * vec):
                acc[q] = ident[0] if nparts == 1 else T.cast(0, acc_t)
            for i in T.unroll(vec):
                idx[i] = _INT_MAX
                sh[i] = T.cast(0, "float32")
                if moments:
                    sh[i] = T.cast(X[bo, 0, T.min(col, inner - vec) + i], "float32")
            lim = T.min(bs * seg + seg, r)
            for step in T.serial(steps):
                for v in T.unroll(per):
                    row = bs * seg + (step * per + v) * ty + t
                    if (exact_rows or row < lim) and (exact_cols or col < inner):
                        for i in T.vectorized(vec):
                            buf[v * vec + i] = X[bo, row, col + i]
                for v in T.unroll(per):
                    row = bs * seg + (step * per + v) * ty + t
                    if (exact_rows or row < lim) and (exact_cols or col < inner):
                        for i in T.unroll(vec):
                            fold_in(acc, idx, take, i, vec, ar.widen(buf[v * vec + i]), row,
                                    sh[i])
            for i in T.unroll(vec):
                for k in T.unroll(nparts):
                    red[(k * ty + t) * width + c * vec + i] = acc[k * vec + i]
                if arg:
                    redi[t * width + c * vec + i] = idx[i]
            T.sync_threads()
            # each of the CTA's columns: its ty partials, in row order
            for q in T.unroll(rounds):
                e = q * threads + tx
                gcol = bx * width + e
                if e < width and gcol < inner:
                    for k in T.unroll(nparts):
                        one[k] = red[k * ty * width + e]
                    pair[0] = redi[e] if arg else 0
                    for j in T.serial(ty - 1):
                        for k in T.unroll(nparts):
                            oth[k] = red[(k * ty + j + 1) * width + e]
                        pair[1] = redi[(j + 1) * width + e] if arg else 0
                        merge_into(one, oth, pair)
                    if splits == 1:
                        outs = ar.outputs(tuple(one[k] for k in range(nparts)), pair[0],
                                          T.cast(X[bo, 0, gcol], "float32") if moments
                                          else None)
                        Y0[bo, gcol] = outs[0]
                        if kind is ReduceKind.VAR_MEAN:
                            Y1[bo, gcol] = outs[1]
                    else:
                        for k in T.unroll(nparts):
                            Y0[k, bs, bo, gcol] = one[k]
                        if moments:
                            Y0[nparts, bs, bo, gcol] = T.cast(X[bo, 0, gcol], "float32")
                        if arg:
                            Y1[bs, bo, gcol] = pair[0]

    return _wrap(body, (outer, r, inner), store, _out_buffers(ar, (outer, inner), splits))


#: outputs a CTA of the finish combines (a warp each)
_FINISH_PER_CTA = 8


def finish_program(kind: ReduceKind, splits: int, dtype: str, r: int, correction: float):
    """The second pass of a split: a warp per output reads its ``splits`` partial states
    (lane ``l`` the splits ``l, l + 32, ...``, in order), merges them with shuffles and writes
    the output; the outputs' count ``P`` is a launch-time size, the main program's workspace
    handed over as ``(parts, splits, P)`` (not compiled)."""
    _, T = tl()
    p = T.dynamic("P")
    ar = _Arith(kind, dtype, r, correction)
    acc_t, nparts, arg, moments = ar.acc, ar.nparts, ar.arg, kind in _MOMENTS
    parts = nparts + (1 if moments else 0)
    _, merge_into, warp_merge = _merging(ar)
    ident = ar.identity()
    rounds = -(-splits // _WARP)

    @T.macro
    def body(W, WI, Y0, Y1):
        with T.Kernel(T.ceildiv(p, _FINISH_PER_CTA), threads=_FINISH_PER_CTA * _WARP) as bx:
            tx = T.get_thread_binding()
            lane = tx % _WARP
            q = bx * _FINISH_PER_CTA + tx // _WARP
            qq = T.min(q, p - 1)
            acc = T.alloc_local((nparts,), acc_t)
            oth = T.alloc_local((nparts,), acc_t)
            idx = T.alloc_local((2,), "int32")
            for k in T.unroll(nparts):
                acc[k] = ident[0] if nparts == 1 else T.cast(0, acc_t)
            idx[0] = _INT_MAX
            # unrolled (rounds <= 32), so a lane's loads are all in flight before it merges
            for s in T.unroll(rounds):
                if s * _WARP + lane < splits:
                    for k in T.unroll(nparts):
                        oth[k] = W[k, s * _WARP + lane, qq]
                    if arg:
                        idx[1] = WI[s * _WARP + lane, qq]
                    else:
                        idx[1] = 0
                    merge_into(acc, oth, idx)
            warp_merge(acc, oth, idx)
            if lane == 0 and q < p:
                outs = ar.outputs(tuple(acc[k] for k in range(nparts)), idx[0],
                                  W[nparts, 0, q] if moments else None)
                Y0[q] = outs[0]
                if kind is ReduceKind.VAR_MEAN:
                    Y1[q] = outs[1]

    ws = ((parts, splits, p), acc_t)
    out = ((p,), ar.out)
    if arg:
        @T.prim_func
        def main(W: T.Tensor(*ws), WI: T.Tensor((splits, p), "int32"), Y0: T.Tensor(*out)):
            body(W, WI, Y0, None)
    elif kind is ReduceKind.VAR_MEAN:
        @T.prim_func
        def main(W: T.Tensor(*ws), Y0: T.Tensor(*out), Y1: T.Tensor(*out)):
            body(W, None, Y0, Y1)
    else:
        @T.prim_func
        def main(W: T.Tensor(*ws), Y0: T.Tensor(*out)):
            body(W, None, Y0, None)
    return main


@stored(maxsize=256)
def build_row_kernel(kind: ReduceKind, n: int, dtype: str, correction: float, splits: int,
                     target: str | None = None):
    """Compile the row kernel for rows of ``n`` split ``splits`` ways (cached per
    configuration; the row count is the launch's)."""
    plan = (*row_shape(n, dtype), splits)
    return compile_program(row_program(kind, n, dtype, correction, *plan), target)


@stored(maxsize=256)
def build_column_kernel(kind: ReduceKind, r: int, inner: int, dtype: str, correction: float,
                        splits: int, target: str | None = None):
    """Compile the column kernel for ``(outer, r, inner)`` views with ``r`` split ``splits``
    ways (cached per configuration; ``outer`` is the launch's)."""
    plan = (*column_shape(inner, dtype), splits)
    return compile_program(column_program(kind, r, inner, dtype, correction, *plan), target)


@stored(maxsize=256)
def build_finish_kernel(kind: ReduceKind, splits: int, dtype: str, r: int, correction: float,
                        target: str | None = None):
    """Compile the finish of ``splits`` partial states an output (the outputs' count is the
    launch's)."""
    return compile_program(finish_program(kind, splits, dtype, r, correction), target)


# --- the implementations -------------------------------------------------------------------------


def _index_refusal(spec: ReductionSpec) -> str | None:
    """The programs index in int32 (TileLang's default for these sizes): a view of 2^31
    elements or more is refused rather than wrapped (a workspace is far smaller: splits are
    made only where the output is small)."""
    if spec.outer * spec.r * spec.inner >= 1 << 31:
        return (f"indexes in int32: {spec.outer} x {spec.r} x {spec.inner} elements is "
                f"2^31 or more")
    return None


class _ReductionKernel(Kernel, ReductionInterface):
    """What the two programs' entries share. An entry serves every call of its
    :meth:`identity`: calls that differ in ``outer`` alone (and map to the same split count)
    share it and its compiled programs, so each call takes its sizes from ``x``. An empty call
    (no outputs or an empty run) builds nothing and has an identity of its own (split count
    0)."""

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})

    @classmethod
    def _splits(cls, spec: ReductionSpec) -> int:
        if spec.outer * spec.inner == 0 or spec.r == 0:
            return 0
        return cls._plan(spec)[-1]

    def __init__(self, spec: ReductionSpec) -> None:
        super().__init__(spec)
        import torch

        self._torch = torch
        k = spec.kind
        self._two = k is ReduceKind.VAR_MEAN
        self._arg = k in _ARG
        self._bool_in = spec.dtype == "bool"
        self._bool_out = spec.out_dtype == "bool"
        self.splits = self._splits(spec)
        self.program = self.finish = None
        if self.splits == 0:
            return
        self.program = self._build(spec, self.splits)
        if self.splits > 1:
            self.finish = build_finish_kernel(k, self.splits, spec.dtype, spec.r,
                                              spec.correction)
            self._parts = _parts(k) + (1 if k in _MOMENTS else 0)
            self._ws_dtype = getattr(torch, _acc_dtype(k, spec.dtype))

    def __call__(self, x, out, out2) -> None:
        if self.splits == 0:
            self._fill_empty(out, out2)
            return
        u8 = self._torch.uint8
        if self._bool_in:
            x = x.view(u8)
        if self._bool_out:
            out = out.view(u8)
        outer, _, inner = x.shape
        x, kept = self._view(x)
        if self.finish is None:
            if self._two:
                self.program(x, out.view(kept), out2.view(kept))
            else:
                self.program(x, out.view(kept))
            return
        torch, p = self._torch, outer * inner
        ws = torch.empty((self._parts, self.splits, *kept), dtype=self._ws_dtype,
                         device=x.device)
        flat = ws.view(self._parts, self.splits, p)
        if self._arg:
            wi = torch.empty((self.splits, *kept), dtype=torch.int32, device=x.device)
            self.program(x, ws, wi)
            self.finish(flat, wi.view(self.splits, p), out)
        elif self._two:
            self.program(x, ws)
            self.finish(flat, out, out2)
        else:
            self.program(x, ws)
            self.finish(flat, out)

    def _fill_empty(self, out, out2) -> None:
        """An empty reduced run gives torch's value of the empty reduction (sum 0, prod 1,
        all True, any False, NaN for mean and the moments; the spec refuses amax/amin/argmax
        of none); an empty output has nothing to write."""
        if out.numel() == 0:
            return
        k = self.spec.kind
        value = {ReduceKind.SUM: 0, ReduceKind.PROD: 1, ReduceKind.L2NORM: 0,
                 ReduceKind.ALL: True, ReduceKind.ANY: False}.get(k, float("nan"))
        out.fill_(value)
        if out2 is not None:
            out2.fill_(float("nan"))


class ReductionRowKernel(_ReductionKernel):
    """``inner == 1``: each row of the ``(outer, r)`` view reduced by ``tpr`` threads (see
    :func:`row_plan`), split across CTAs for few long rows."""

    @classmethod
    def region_refusal(cls, spec: ReductionSpec) -> str | None:
        if spec.inner != 1:
            return f"reduces rows (inner = 1), not columns (inner = {spec.inner})"
        return _index_refusal(spec)

    @classmethod
    def identity(cls, spec: ReductionSpec):
        return (spec.kind, spec.r, spec.dtype, spec.correction, cls._splits(spec),
                spec.device)

    @staticmethod
    def _plan(spec: ReductionSpec):
        return row_plan(spec.outer, spec.r, spec.dtype)

    @staticmethod
    def _build(spec: ReductionSpec, splits: int):
        return build_row_kernel(spec.kind, spec.r, spec.dtype, spec.correction, splits)

    @staticmethod
    def _view(x):
        """The program's ``X`` is ``(M, n)``, its outputs ``(M,)``."""
        return x.view(x.shape[0], x.shape[1]), (x.shape[0],)


class ReductionColumnKernel(_ReductionKernel):
    """Any ``(outer, r, inner)`` view: threads over ``inner``, coalesced, walking ``r`` (see
    :func:`column_plan`); the general implementation (``inner == 1`` is a column of width one,
    correct but a warp a row is better)."""

    general = True

    @classmethod
    def region_refusal(cls, spec: ReductionSpec) -> str | None:
        return _index_refusal(spec)

    @classmethod
    def identity(cls, spec: ReductionSpec):
        return (spec.kind, spec.r, spec.inner, spec.dtype, spec.correction,
                cls._splits(spec), spec.device)

    @staticmethod
    def _plan(spec: ReductionSpec):
        return column_plan(spec.outer, spec.r, spec.inner, spec.dtype)

    @staticmethod
    def _build(spec: ReductionSpec, splits: int):
        return build_column_kernel(spec.kind, spec.r, spec.inner, spec.dtype, spec.correction,
                                   splits)

    @staticmethod
    def _view(x):
        """The program's ``X`` is the ``(outer, r, inner)`` view, its outputs
        ``(outer, inner)``."""
        return x, (x.shape[0], x.shape[2])
