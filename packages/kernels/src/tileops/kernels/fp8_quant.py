"""Quantising a ``[M, K]`` bfloat16 / float16 / float32 tensor to float8 with float32 scales.

Every scale block (the whole tensor, a row, a 1 x 128 group along a row, a 128 x 128 block)
gets ``scale = max(amax(|x|), AMAX_FLOOR) / fp8_max`` and its elements ``q = clamp(x / scale,
-fp8_max, fp8_max)`` cast to the fp8 dtype (round to nearest even): the convention of
torch._scaled_mm and DeepGEMM, dequantised = ``q * scale``. The scales are written in
row-major block order: ``[1]`` (the op's ``[]`` viewed flat), ``[M, 1]``, ``[M, ceil(K / 128)]``,
``[ceil(M / 128), ceil(K / 128)]``.

The programs walk the tensor in tiles of ``rows`` rows by 128 columns held in registers as
float32 (an element outside ``[M, K]`` reads as 0, which changes no absolute maximum, and is
not written). ``M`` is a launch-time size (one program serves every row count); ``K``, the
dtypes and the granularity are compiled in. One pass for a group or a block (the tile is the
scale block, or ``rows`` of them), two for a row (the row's maximum over its tiles, then the
quotients: the second read of a CTA's rows is served by L2) and two programs for the tensor.
Where a maximum runs over several tiles (a row, the tensor's partials), each thread keeps an
elementwise running maximum of its share and the threads reduce it once, after the last tile,
not once a tile (a named-barrier reduction every 128 columns). The tensor's programs:
:func:`amax_program` folds the rows into at most :data:`TENSOR_PARTIALS` partial maxima (a grid
of that many CTAs walking the row tiles), and the quantising program reduces those partials
(4 KiB at most, from L2) in every CTA before its own tiles.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
from typing import Any, Literal, NamedTuple, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface

from ._store import stored
from ._tilelang import compile_program, tl

__all__ = [
    "AMAX_FLOOR",
    "FP8_MAX",
    "GROUP",
    "TENSOR_PARTIALS",
    "Fp8QuantDType",
    "Fp8QuantInterface",
    "Fp8QuantKernel",
    "Fp8QuantSpec",
    "Granularity",
    "QuantPlan",
    "amax_program",
    "build_amax_kernel",
    "build_quant_kernel",
    "quant_plan",
    "quant_program",
    "tensor_partials",
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
    """A launch plan: ``rows`` rows a tile, ``tiles`` 128-column tiles a CTA walks along K
    (all of them for a row), ``threads`` a CTA."""

    rows: int
    tiles: int
    threads: int


def quant_plan(spec: Fp8QuantSpec) -> QuantPlan:
    """The plan of a call. A block is one 128 x 128 tile (64 float32 registers a thread at
    256 threads); a group walks four tiles of 32 rows (8 KiB of bfloat16 a load); a row and
    the tensor walk 16-row tiles of the whole row (rows of up to a few thousand columns are
    then read by few CTAs at a time, long contiguous runs)."""
    chunks = -(-spec.k // GROUP)
    g = spec.granularity
    if g is Granularity.BLOCK:
        return QuantPlan(GROUP, 1, 256)
    if g is Granularity.GROUP:
        return QuantPlan(32, min(4, max(chunks, 1)), 128)
    if g is Granularity.ROW:
        return QuantPlan(16, max(chunks, 1), 128)
    return QuantPlan(16, min(8, max(chunks, 1)), 128)


def tensor_partials(m: int, rows: int) -> int:
    """The partial maxima of the tensor granularity for ``m`` rows (at least 1)."""
    return max(1, min(TENSOR_PARTIALS, -(-m // rows)))


def _inside(T, M, k: int, r, col):
    """Whether element ``(r, col)`` is inside ``[M, k]`` (the column test only where ``k``
    is not a multiple of the tile width)."""
    if k % GROUP:
        return T.And(r < M, col < k)
    return r < M


def _loader(T, M, k: int, rows: int):
    """The tile load every program shares: ``load(X, xf, r0, c)`` fills the float32 fragment
    with rows ``r0 ...`` of tile ``c`` of ``X`` (0 outside ``[M, k]``)."""

    @T.macro
    def load(X, xf, r0, c):
        for i, j in T.Parallel(rows, GROUP):
            xf[i, j] = T.if_then_else(_inside(T, M, k, r0 + i, c * GROUP + j),
                                      T.Cast("float32", X[r0 + i, c * GROUP + j]),
                                      T.float32(0))

    return load


def _folder(T, rows: int):
    """``fold(acc, xf)``: the running elementwise ``|x|`` maximum of a row's tiles, reduced
    across threads once after the last tile instead of after each."""

    @T.macro
    def fold(acc, xf):
        for i, j in T.Parallel(rows, GROUP):
            acc[i, j] = T.max(acc[i, j], T.abs(xf[i, j]))

    return fold


def quant_program(k: int, dtype: str, fp8_dtype: str, granularity: Granularity,
                  plan: QuantPlan):
    """The quantising prim_func (``M`` dynamic). Arguments ``(X, Q, S)``, and for the tensor
    granularity ``(X, PART, Q, S)`` with ``PART`` the partial maxima of :func:`amax_program`
    and ``S`` the scale viewed ``[1]``."""
    _, T = tl()
    M = T.dynamic("M")
    rows, tiles, threads = plan
    chunks = -(-k // GROUP)
    fmax = FP8_MAX[fp8_dtype]
    g = granularity
    grid_x = 1 if g is Granularity.ROW else -(-chunks // tiles)
    s_shape = {Granularity.TENSOR: (1,), Granularity.ROW: (M, 1),
               Granularity.GROUP: (M, chunks),
               Granularity.BLOCK: (T.ceildiv(M, GROUP), chunks)}[g]
    load = _loader(T, M, k, rows)
    fold = _folder(T, rows)

    @T.macro
    def store(Q, xf, s, r0, c):
        for i, j in T.Parallel(rows, GROUP):
            if _inside(T, M, k, r0 + i, c * GROUP + j):
                Q[r0 + i, c * GROUP + j] = T.Cast(fp8_dtype,
                                                  T.clamp(xf[i, j] / s[i], -fmax, fmax))

    # One scale for the whole tile (a block, the tensor) is a register of every thread: as a
    # fragment broadcast over the tile's rows, layout inference replicates the tile itself
    # into every thread.
    @T.macro
    def store_uniform(Q, xf, sc, r0, c):
        for i, j in T.Parallel(rows, GROUP):
            if _inside(T, M, k, r0 + i, c * GROUP + j):
                Q[r0 + i, c * GROUP + j] = T.Cast(fp8_dtype,
                                                  T.clamp(xf[i, j] / sc[0], -fmax, fmax))

    @T.macro
    def scales_of(s, src):
        for i in T.Parallel(rows):
            s[i] = T.max(src[i], AMAX_FLOOR) / fmax

    @T.macro
    def body(X, PART, Q, S):
        with T.Kernel(grid_x, T.ceildiv(M, rows), threads=threads) as (bx, by):
            xf = T.alloc_fragment((rows, GROUP), "float32")
            amax = T.alloc_fragment((rows,), "float32")
            run = T.alloc_fragment((rows,), "float32")
            s = T.alloc_fragment((rows,), "float32")
            whole = T.alloc_fragment((1,), "float32")
            sc = T.alloc_local((1,), "float32")
            r0 = by * rows
            if g is Granularity.ROW:
                acc = T.alloc_fragment((rows, GROUP), "float32")
                T.fill(acc, 0.0)
                for c in T.serial(chunks):
                    load(X, xf, r0, c)
                    fold(acc, xf)
                T.reduce_max(acc, run, dim=1)
                scales_of(s, run)
                for i in T.Parallel(rows):
                    if r0 + i < M:
                        S[r0 + i, 0] = s[i]
                for c in T.serial(chunks):
                    load(X, xf, r0, c)
                    store(Q, xf, s, r0, c)
            elif g is Granularity.BLOCK:
                load(X, xf, r0, bx)
                T.reduce_absmax(xf, amax, dim=1)
                T.reduce_max(amax, whole, dim=0)
                sc[0] = T.max(whole[0], AMAX_FLOOR) / fmax
                S[by, bx] = sc[0]
                store_uniform(Q, xf, sc, r0, bx)
            elif g is Granularity.GROUP:
                for t in T.serial(tiles):
                    if bx * tiles + t < chunks:
                        load(X, xf, r0, bx * tiles + t)
                        T.reduce_absmax(xf, amax, dim=1)
                        scales_of(s, amax)
                        for i in T.Parallel(rows):
                            if r0 + i < M:
                                S[r0 + i, bx * tiles + t] = s[i]
                        store(Q, xf, s, r0, bx * tiles + t)
            else:  # the tensor: its maximum from the partials, then this CTA's tiles
                parts = T.alloc_fragment((TENSOR_PARTIALS,), "float32")
                for i in T.Parallel(TENSOR_PARTIALS):
                    parts[i] = T.if_then_else(i < PART.shape[0], PART[i], T.float32(0))
                T.reduce_max(parts, whole, dim=0)
                sc[0] = T.max(whole[0], AMAX_FLOOR) / fmax
                if T.And(bx == 0, by == 0):
                    S[0] = sc[0]
                for t in T.serial(tiles):
                    if bx * tiles + t < chunks:
                        load(X, xf, r0, bx * tiles + t)
                        store_uniform(Q, xf, sc, r0, bx * tiles + t)

    if g is Granularity.TENSOR:
        P = T.dynamic("P")

        @T.prim_func
        def quant_tensor(X: T.Tensor((M, k), dtype), PART: T.Tensor((P,), "float32"),
                         Q: T.Tensor((M, k), fp8_dtype), S: T.Tensor(s_shape, "float32")):
            body(X, PART, Q, S)

        return quant_tensor

    @T.prim_func
    def quant(X: T.Tensor((M, k), dtype), Q: T.Tensor((M, k), fp8_dtype),
              S: T.Tensor(s_shape, "float32")):
        body(X, None, Q, S)

    return quant


def amax_program(k: int, dtype: str, plan: QuantPlan):
    """``PART[p]`` = the absolute maximum of the row tiles ``p, p + P, ...`` of ``X`` (``P``
    the length of ``PART``, a launch-time size, as ``M``)."""
    _, T = tl()
    M = T.dynamic("M")
    P = T.dynamic("P")
    rows, _, threads = plan
    chunks = -(-k // GROUP)
    load = _loader(T, M, k, rows)
    fold = _folder(T, rows)

    @T.prim_func
    def amax(X: T.Tensor((M, k), dtype), PART: T.Tensor((P,), "float32")):
        with T.Kernel(P, threads=threads) as p:
            xf = T.alloc_fragment((rows, GROUP), "float32")
            acc = T.alloc_fragment((rows, GROUP), "float32")
            run = T.alloc_fragment((rows,), "float32")
            whole = T.alloc_fragment((1,), "float32")
            T.fill(acc, 0.0)
            for t in T.serial(T.ceildiv(T.ceildiv(M, rows) - p, P)):
                for c in T.serial(chunks):
                    load(X, xf, (p + t * P) * rows, c)
                    fold(acc, xf)
            T.reduce_max(acc, run, dim=1)
            T.reduce_max(run, whole, dim=0)
            PART[p] = whole[0]

    return amax


@stored(maxsize=64)
def build_quant_kernel(k: int, dtype: str, fp8_dtype: str, granularity: Granularity,
                       plan: QuantPlan, target: str | None = None):
    """Compile :func:`quant_program` (cached per process; TileLang also caches on disk)."""
    return compile_program(quant_program(k, dtype, fp8_dtype, granularity, plan), target)


@stored(maxsize=32)
def build_amax_kernel(k: int, dtype: str, plan: QuantPlan, target: str | None = None):
    """Compile :func:`amax_program`."""
    return compile_program(amax_program(k, dtype, plan), target)


class Fp8QuantKernel(Kernel, Fp8QuantInterface):
    """Every quantising call on sm_80+ (the fp8 conversions need sm_89 for hardware cvt;
    TileLang emits the software conversion below it). One entry serves every ``M``."""

    general = True
    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})

    @classmethod
    def identity(cls, spec: Fp8QuantSpec) -> Any:
        return (spec.device, spec.k, spec.dtype, spec.fp8_dtype, spec.granularity)

    def __init__(self, spec: Fp8QuantSpec) -> None:
        super().__init__(spec)
        self.plan = quant_plan(spec)
        self.program = None if spec.k == 0 else build_quant_kernel(
            spec.k, spec.dtype, spec.fp8_dtype, spec.granularity, self.plan)
        self.amax = None
        if spec.k and spec.granularity is Granularity.TENSOR:
            self.amax = build_amax_kernel(spec.k, spec.dtype, self.plan)

    def __call__(self, x, q, scale) -> None:
        import torch

        m = x.shape[0]
        g = self.spec.granularity
        if m == 0 or self.program is None:  # no element: each scale block is empty
            scale.fill_(AMAX_FLOOR / FP8_MAX[self.spec.fp8_dtype])
            return
        if g is Granularity.TENSOR:
            part = torch.empty(tensor_partials(m, self.plan.rows), dtype=torch.float32,
                               device=x.device)
            self.amax(x, part)
            self.program(x, part, q, scale.view(1))
        else:
            self.program(x, q, scale)
