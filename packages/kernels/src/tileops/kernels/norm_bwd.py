"""Backward of the row normalizations (RMSNorm, fused add + RMSNorm, LayerNorm) in TileLang.

One slot, :class:`RowNormBwdInterface` (``row_norm_bwd``); an entry is called as
``entry(dy, dres, x, weight, dx, dweight, dbias)`` with ``(rows, n)`` views and ``(n,)``
vectors, None where absent. For the fused add ``x`` is the forward's saved ``residual_out``
and ``dres`` the gradient that reached ``residual_out``: ``dx = rms_bwd(dy, x, weight) + dres``
(the one gradient of both ``x`` and ``residual``).

No statistic is saved by the forward: each row's ``rstd`` (and LayerNorm's mean) is
recomputed here from ``x``, in the same pass that reduces ``sum(g * x)`` (``g = dy * weight``),
so the backward reads ``dy`` and ``x`` once and writes ``dx`` once, the traffic floor. The
formulas, with ``xhat = (x - mean) * rstd`` (``mean = 0`` for RMS):

- RMS: ``dx = rstd * (g - xhat * mean(g * xhat))``
- LAYER: ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``
- ``dweight = sum over rows of dy * xhat``, ``dbias = sum over rows of dy``.

The column sums (``dweight``, ``dbias``) are not accumulated with atomics: the main program
runs on a persistent grid of ``G`` CTAs (a few per SM), each walking its rows and keeping its
share of the partial sums in fp32 (on chip, or for wide rows in its own row of the
workspace), then writing one partial row per row slot into an fp32 workspace
``(G, slots, k * n)``; a second, small program (:func:`colsum_program`) sums the ``G * slots``
partial rows and stores ``dweight``/``dbias`` in the weight's dtype (the storage dtype, or
float32 for a float32 weight: rounded once from the fp32 sum). The workspace is
``G * slots * k * n * 4`` bytes (8.6 MB for 8192 columns: about 2% of a 32768-row call's
traffic). A call of one row needs neither: its register program stores the row's
``dy * xhat`` and ``dy`` as the sums (:meth:`RowNormBwdRegisterKernel.direct`).

Two implementations:

:class:`RowNormBwdRegisterKernel` -- a row's ``x`` and ``dy`` held in registers (at most
    :data:`_BWD_HELD_BYTES` of each a thread, up to 512 threads a row: rows up to 32 KiB);
    narrow rows pack 8 rows (a warp each) into a CTA. The fp32 column partials of the
    thread's columns stay on chip across all the rows the CTA walks: in registers, or (many
    LayerNorm rows wider than 256 threads' two accesses) in shared memory (the plan's
    ``smem_partials``; see :func:`bwd_register_plan`).
:class:`RowNormBwdLoopedKernel` -- the general one, any ``n``: 1024 threads a row, two passes
    over the row in chunks (sums, then ``dx`` with the second read mostly from L2); the CTA's
    partial column sums live in its workspace row (read, added to, written per row).

Arithmetic is fp32; outputs are stored in the storage dtype. Rows whose length is not a
multiple of the 16-byte vector are read with the widest aligned access (as the forward).
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

from typing import Any, ClassVar, NamedTuple

from tileops.runtime import CallSpec, Kernel, KernelInterface

from ._store import stored
from ._tilelang import compile_program, tl
from .gemm import sm_count
from .norm import (
    _ITEMSIZE,
    _ROW_NORM_DTYPES,
    FEW_ROWS,
    RowNormDType,
    RowNormKind,
    _pow2_at_least,
    _vec,
)

__all__ = [
    "BwdRegisterPlan",
    "RowNormBwdInterface",
    "RowNormBwdLoopedKernel",
    "RowNormBwdRegisterKernel",
    "RowNormBwdSpec",
    "bwd_looped_plan",
    "bwd_register_plan",
    "build_bwd_looped_kernel",
    "build_bwd_register_kernel",
    "build_colsum_kernel",
    "colsum_plan",
    "ctas_per_sm",
    "grid_ctas",
    "colsum_program",
    "looped_bwd_program",
    "register_bwd_program",
]

_WARP = 32
#: bytes of ``x`` (and as many of ``dy``) one thread of the register kernel holds: 64 bytes is
#: four 16-byte accesses of each in flight, eight in all (the forward's best count), and keeps
#: a thread near 110 registers with the fp32 partials of its 32 bf16 columns, so two
#: 256-thread CTAs fit an SM's register file
_BWD_HELD_BYTES = 64
_BWD_MAX_REGISTER_THREADS = 512
_LOOPED_THREADS = 1024
#: resident threads an SM is planned for (the persistent grid is SMs x 512 // CTA threads)
_RESIDENT_THREADS = 512
#: many-row LayerNorm calls of at most this many rows keep register partials on one CTA an
#: SM where a row spreads over at most 256 threads (bwd_register_plan; measured at 2048 rows)
_LAYER_REGISTER_ROWS = 2048
#: bytes each thread of the column-sum program has in flight (its loads before adding)
_COLSUM_INFLIGHT_BYTES = 64
#: CTAs the column sum aims for: about one an SM of an H100/H200 (132)
_COLSUM_CTAS = 128


class RowNormBwdSpec(CallSpec, frozen=True, kw_only=True):
    """What a row-norm backward implementation is told about a call."""

    kind: RowNormKind
    rows: int  # rows of the (rows, n) views
    n: int  # row length
    dtype: RowNormDType  # storage dtype name
    eps: float
    has_weight: bool  # the forward was given a weight
    grad_weight: bool  # dweight is wanted (only meaningful with a weight)
    grad_bias: bool  # dbias is wanted (LAYER only)
    #: the dtype dweight and dbias are stored in (the weight's: the storage dtype or float32);
    #: None: the storage dtype. The weight itself is handed over in the storage dtype
    sum_dtype: RowNormDType | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, RowNormKind):
            raise TypeError(f"RowNormBwdSpec.kind must be a RowNormKind, got {self.kind!r}")
        self.check_fields(choices={"dtype": _ROW_NORM_DTYPES}, sizes=("rows", "n"),
                          flags=("has_weight", "grad_weight", "grad_bias"))
        if self.sum_dtype is not None and self.sum_dtype not in (self.dtype, "float32"):
            raise ValueError(f"RowNormBwdSpec.sum_dtype must be the storage dtype "
                             f"({self.dtype}) or float32, got {self.sum_dtype!r}")
        if self.grad_weight and not self.has_weight:
            raise ValueError("RowNormBwdSpec: grad_weight needs has_weight (there is no "
                             "weight to take the gradient of)")
        if self.grad_bias and self.kind is not RowNormKind.LAYER:
            raise ValueError(f"RowNormBwdSpec: only LAYER has a bias gradient, not {self.kind}")

    @property
    def few_rows(self) -> bool:
        """Fewer rows than :data:`~tileops.kernels.norm.FEW_ROWS`: the latency-bound plan."""
        return self.rows < FEW_ROWS

    @property
    def out_dtype(self) -> str:
        """The dtype ``dweight`` and ``dbias`` are stored in."""
        return self.sum_dtype or self.dtype

    @property
    def sums(self) -> int:
        """Column sums the call computes: ``dweight`` and/or ``dbias`` (0, 1 or 2)."""
        return int(self.grad_weight) + int(self.grad_bias)


class RowNormBwdInterface(KernelInterface):
    """One slot: the gradients of a row normalization.

    ``forward(dy, dres, x, weight, dx, dweight, dbias)``: ``dy``, ``dres``, ``x``, ``dx`` are
    contiguous 16-byte-aligned ``(rows, n)`` views, ``weight``, ``dweight``, ``dbias``
    ``(n,)``; None where absent. ``dres`` is given only for ADD_RMS (whose ``x`` is the saved
    ``residual_out``); ``dweight`` iff ``grad_weight`` (and a weight), ``dbias`` iff
    ``grad_bias`` (LAYER). ``weight`` and ``dx`` are in the storage dtype, ``dweight`` and
    ``dbias`` in the spec's :attr:`~RowNormBwdSpec.out_dtype` (summed in fp32 and rounded
    once to it).
    """

    slot = "row_norm_bwd"
    call_spec = RowNormBwdSpec


# --- plans ------------------------------------------------------------------------------------


class BwdRegisterPlan(NamedTuple):
    """The launch plan of the register backward: every knob a sweep may set.

    ``tpr`` threads a row, ``rpc`` rows a CTA, each thread holding ``per`` accesses of ``vec``
    elements of ``x`` and ``dy``; ``resident`` threads an SM the persistent grid and the
    ``__launch_bounds__`` minimum are planned for (65536 // resident registers a thread);
    ``smem_partials``: the fp32 column partials live in shared memory (each thread its own
    words) rather than registers.
    """

    tpr: int
    rpc: int
    vec: int
    per: int
    resident: int
    smem_partials: bool


def _spread(n: int, dtype: str, few_rows: bool, held_bytes: int) -> tuple[int, int, int, int]:
    """``(tpr, rpc, vec, per)`` holding at most about ``held_bytes`` of ``x`` a thread (see
    :func:`bwd_register_plan`); ``per`` is 0 when the row does not fit 512 threads."""
    item = _ITEMSIZE[dtype]
    vec = _vec(n, dtype)
    width = vec * item
    nv = -(-n // vec)
    if few_rows:
        tpr = min(_BWD_MAX_REGISTER_THREADS, max(_WARP, _pow2_at_least(-(-nv // 2))))
    else:
        want = max(1, held_bytes // width)
        tpr = _pow2_at_least(-(-nv // want))
        tpr = _WARP if tpr <= _WARP else min(_BWD_MAX_REGISTER_THREADS, max(128, tpr))
    per = -(-nv // tpr)
    if per * width > held_bytes:
        tpr = min(_BWD_MAX_REGISTER_THREADS, _pow2_at_least(-(-nv * width // held_bytes)))
        per = -(-nv // tpr)
        if per * width > held_bytes:
            per = 0
    rpc = 256 // _WARP if tpr == _WARP and not few_rows else 1
    return tpr, rpc, vec, per


def bwd_register_plan(n: int, dtype: str, few_rows: bool = False, kind: str = "rms",
                      rows: int | None = None) -> BwdRegisterPlan | None:
    """The :class:`BwdRegisterPlan` of the register backward, or None when a row does not
    fit: each thread holds ``per`` accesses of ``vec`` elements of ``x`` and of ``dy`` (and
    the fp32 column partials of those ``per * vec`` columns).

    Derived from the forward's sweep (benchmarks/results/norm_sweep.txt) and
    ptxas's register counts at the 128-register cap of :data:`_RESIDENT_THREADS`:

    - many rows: about four accesses of each of ``x`` and ``dy`` a thread (64 bytes each), so
      eight loads are in flight as in the forward's best plans; 128 to 512 threads a row
      (8192 x bf16: 256 x 4; 16384 x bf16: 512 x 4; 4097 x bf16, one element an access:
      256 x 17). Rows of at most a warp's share pack 8 rows (a warp each) into a CTA.
    - few rows (latency-bound): spread a row over as many threads as give each at most two
      accesses, as the forward.
    - LAYER holds half as much a thread (two 16-byte accesses of each: 4096 x bf16 on 256
      threads) wherever that leaves at least two CTAs an SM (at most 256 threads a row), so
      its dweight and dbias partials stay in registers: nvcc keeps the fp32 values of ``x``
      and ``g`` live across the second reduction, and at four accesses the partials spill
      (416 bytes a thread for 4096 x bf16, 106 registers and none spilled at two). Wider rows
      (one 512-thread CTA an SM would have no other CTA's loads in flight across its
      barriers) keep four accesses with the partials in shared memory; with few rows a CTA
      walks about one row and is alone on its SM either way, so any row of at most two
      accesses a thread keeps them in registers (8192 x bf16 on 512 threads).

    A thread holds at most :data:`_BWD_HELD_BYTES` of ``x``; wider rows spread over up to 512
    threads (a 1024-thread CTA has 64 registers a thread, fewer than the held row, its
    partials and the weight need), beyond that the looped kernel runs.

    Swept on the H200 (``benchmarks/results/sweep_norm_bwd.txt``, 2026-12-01), LayerNorm rows
    that keep four accesses a thread keep their partials in registers too where a CTA walks
    few rows: with few rows (128 x 16384 bf16 on 512 threads: 23 us against 52 with shared
    partials) and, on one 256-thread CTA an SM, up to :data:`_LAYER_REGISTER_ROWS` rows
    (2048 x 8192 bf16: 52 us against 76); at 32768 rows shared partials on two CTAs an SM are
    the fastest (495 us against 611), and at 2048 x 16384 too (122 against 145). ``rows``
    (the call's row count) picks between them; None plans for many rows.
    """
    tpr, rpc, vec, per = _spread(n, dtype, few_rows, _BWD_HELD_BYTES)
    if per == 0:
        return None
    if kind == "layer":
        half = _spread(n, dtype, few_rows, _BWD_HELD_BYTES // 2)
        if half[3] and (few_rows or half[0] <= _RESIDENT_THREADS // 2):
            return BwdRegisterPlan(*half, _RESIDENT_THREADS, False)
        if few_rows:
            return BwdRegisterPlan(tpr, rpc, vec, per, _RESIDENT_THREADS, False)
        if rows is not None and rows <= _LAYER_REGISTER_ROWS and tpr * rpc <= 256:
            return BwdRegisterPlan(tpr, rpc, vec, per, tpr * rpc, False)
        return BwdRegisterPlan(tpr, rpc, vec, per, _RESIDENT_THREADS, True)
    return BwdRegisterPlan(tpr, rpc, vec, per, _RESIDENT_THREADS, False)


def bwd_looped_plan(n: int, dtype: str) -> tuple[int, int, int]:
    """``(threads, vec, per)``: each pass walks the row in chunks of threads * vec * per."""
    return _LOOPED_THREADS, _vec(n, dtype), 2


def ctas_per_sm(threads: int, resident: int = _RESIDENT_THREADS) -> int:
    """CTAs of ``threads`` planned to share an SM: ``resident`` threads an SM (by default
    :data:`_RESIDENT_THREADS`: sixteen warps, 128 registers a thread). The register program
    is compiled with that as its ``__launch_bounds__`` minimum, so the compiler keeps within
    the registers it needs."""
    return max(1, resident // threads)


def grid_ctas(rows: int, rows_per_cta: int, threads: int, sms: int,
              resident: int = _RESIDENT_THREADS) -> int:
    """CTAs of the persistent grid for ``rows``: one per group of ``rows_per_cta`` rows, at
    most as many as are resident at once (:func:`ctas_per_sm` an SM), so no CTA waits for a
    second wave while the others have finished."""
    return max(1, min(-(-rows // rows_per_cta), sms * ctas_per_sm(threads, resident)))


def colsum_plan(cols: int) -> tuple[int, int, int]:
    """``(warps, vec, unroll)`` of the column-sum program: a CTA sums a tile of ``32 * vec``
    fp32 columns, its ``warps`` warps splitting the partial rows, each thread loading
    ``unroll`` of them before adding.

    The column count fixes the CTA count (``cols / (32 * vec)``), so ``vec`` is the widest
    access (at most 16 bytes, dividing ``cols``) that still gives about
    :data:`_COLSUM_CTAS` CTAs: with 16-byte loads 4096 columns had 32 CTAs and 8192 had 64,
    a quarter and a half of the SMs, while the partials (just written, mostly in L2) are read
    at the rate of the loads in flight. ``unroll`` keeps :data:`_COLSUM_INFLIGHT_BYTES` a
    thread in flight whatever ``vec`` (4 loads of 16 bytes, 16 of 4), so each CTA has 32 KiB
    in flight and the narrower tiles add CTAs, not fewer bytes a CTA."""
    vec = 4
    while vec > 1 and (cols % vec or -(-cols // (_WARP * vec)) < _COLSUM_CTAS):
        vec //= 2
    return 16, vec, _COLSUM_INFLIGHT_BYTES // (4 * vec)


# --- TileLang programs ------------------------------------------------------------------------


def _main_params(body, add: bool, has_weight: bool, has_ws: bool, shapes: dict, dtype: str):
    """The prim_func taking exactly the tensors present, in the order
    ``dy, [dres], x, [weight], dx, [workspace]`` (each absent tensor would cost the launch its
    DLPack conversion, as the forward's ``_with_params`` explains)."""
    _, T = tl()
    sm, sn, sws = shapes["row"], shapes["vec"], shapes["ws"]
    f32 = "float32"
    if add and has_weight and has_ws:
        @T.prim_func
        def main(DY: T.Tensor(sm, dtype), DR: T.Tensor(sm, dtype), X: T.Tensor(sm, dtype),
                 W: T.Tensor(sn, dtype), DX: T.Tensor(sm, dtype), WS: T.Tensor(sws, f32)):
            body(DY, DR, X, W, DX, WS)
    elif add and has_weight:
        @T.prim_func
        def main(DY: T.Tensor(sm, dtype), DR: T.Tensor(sm, dtype), X: T.Tensor(sm, dtype),
                 W: T.Tensor(sn, dtype), DX: T.Tensor(sm, dtype)):
            body(DY, DR, X, W, DX, None)
    elif add:
        @T.prim_func
        def main(DY: T.Tensor(sm, dtype), DR: T.Tensor(sm, dtype), X: T.Tensor(sm, dtype),
                 DX: T.Tensor(sm, dtype)):
            body(DY, DR, X, None, DX, None)
    elif has_weight and has_ws:
        @T.prim_func
        def main(DY: T.Tensor(sm, dtype), X: T.Tensor(sm, dtype), W: T.Tensor(sn, dtype),
                 DX: T.Tensor(sm, dtype), WS: T.Tensor(sws, f32)):
            body(DY, None, X, W, DX, WS)
    elif has_weight:
        @T.prim_func
        def main(DY: T.Tensor(sm, dtype), X: T.Tensor(sm, dtype), W: T.Tensor(sn, dtype),
                 DX: T.Tensor(sm, dtype)):
            body(DY, None, X, W, DX, None)
    elif has_ws:  # LAYER without a weight, with dbias
        @T.prim_func
        def main(DY: T.Tensor(sm, dtype), X: T.Tensor(sm, dtype), DX: T.Tensor(sm, dtype),
                 WS: T.Tensor(sws, f32)):
            body(DY, None, X, None, DX, WS)
    else:
        @T.prim_func
        def main(DY: T.Tensor(sm, dtype), X: T.Tensor(sm, dtype), DX: T.Tensor(sm, dtype)):
            body(DY, None, X, None, DX, None)
    return main


def _direct_params(body, add: bool, has_weight: bool, grad_weight: bool, grad_bias: bool,
                   shapes: dict, dtype: str, odt: str):
    """The prim_func of a direct program (one row: its ``dweight``/``dbias`` are written by
    the main program itself), taking ``dy, [dres], x, [weight], dx, [dweight], [dbias]``; at
    least one of the two sums is wanted (``grad_weight`` implies a weight, the fused add has
    no bias); ``dweight`` and ``dbias`` are of ``odt``."""
    _, T = tl()
    sm, sn = shapes["row"], shapes["vec"]
    if add:
        @T.prim_func
        def main(DY: T.Tensor(sm, dtype), DR: T.Tensor(sm, dtype), X: T.Tensor(sm, dtype),
                 W: T.Tensor(sn, dtype), DX: T.Tensor(sm, dtype), DW: T.Tensor(sn, odt)):
            body(DY, DR, X, W, DX, None, DW, None)
    elif grad_weight and grad_bias:
        @T.prim_func
        def main(DY: T.Tensor(sm, dtype), X: T.Tensor(sm, dtype), W: T.Tensor(sn, dtype),
                 DX: T.Tensor(sm, dtype), DW: T.Tensor(sn, odt), DB: T.Tensor(sn, odt)):
            body(DY, None, X, W, DX, None, DW, DB)
    elif grad_weight:
        @T.prim_func
        def main(DY: T.Tensor(sm, dtype), X: T.Tensor(sm, dtype), W: T.Tensor(sn, dtype),
                 DX: T.Tensor(sm, dtype), DW: T.Tensor(sn, odt)):
            body(DY, None, X, W, DX, None, DW, None)
    elif has_weight:
        @T.prim_func
        def main(DY: T.Tensor(sm, dtype), X: T.Tensor(sm, dtype), W: T.Tensor(sn, dtype),
                 DX: T.Tensor(sm, dtype), DB: T.Tensor(sn, odt)):
            body(DY, None, X, W, DX, None, None, DB)
    else:
        @T.prim_func
        def main(DY: T.Tensor(sm, dtype), X: T.Tensor(sm, dtype), DX: T.Tensor(sm, dtype),
                 DB: T.Tensor(sn, odt)):
            body(DY, None, X, None, DX, None, None, DB)
    return main


def _check_sums(kind: str, has_weight: bool, grad_weight: bool, grad_bias: bool) -> None:
    if grad_weight and not has_weight:
        raise ValueError("grad_weight needs a weight")
    if grad_bias and kind != "layer":
        raise ValueError(f"only layer has a bias gradient, not {kind}")


def register_bwd_program(kind: str, n: int, dtype: str, eps: float, has_weight: bool,
                         grad_weight: bool, grad_bias: bool, tpr: int, rpc: int, vec: int,
                         per: int, resident: int, smem_partials: bool, direct: bool = False,
                         out_dtype: str | None = None):
    """The TileLang prim_func of the register backward (not compiled).

    ``M`` (rows) and, where column sums are wanted, ``G`` (CTAs: the workspace's first
    dimension) are launch-time sizes; without column sums the grid is one CTA per ``rpc``
    rows. CTA ``b`` walks row groups ``b, b + G, ...``; the cross-warp reduction buffers
    alternate by the parity of the step, so one barrier a reduction suffices.

    ``direct``: the program serves one row (a single CTA, ``rpc`` 1) and stores its
    ``dy * xhat`` and ``dy`` as ``dweight`` and ``dbias`` itself, with no workspace and no
    column-sum launch (which for one row is a second kernel on the critical path), in
    ``out_dtype`` (None: ``dtype``), each rounded once from its fp32 sum.
    """
    _check_sums(kind, has_weight, grad_weight, grad_bias)
    odt = out_dtype or dtype
    _, T = tl()
    M = T.dynamic("M")
    add, layer = kind == "add_rms", kind == "layer"
    k = int(grad_weight) + int(grad_bias)
    if direct and (rpc != 1 or k == 0):
        raise ValueError(f"a direct program stores one row's sums: it needs rows_per_cta 1 "
                         f"and a wanted sum, got rows_per_cta {rpc} and {k} sums")
    has_ws = k > 0 and not direct
    G = T.dynamic("G") if has_ws else None
    shapes = {"row": (M, n), "vec": (n,), "ws": (G, rpc, k * n) if has_ws else (1,)}
    threads = tpr * rpc
    wpr = tpr // _WARP
    held = per * vec
    exact = n == tpr * per * vec
    f32 = "float32"
    inv_n = 1.0 / n
    # sums reduced across a row: round 1 (sum x^2 and sum g*x for RMS; sum x for LAYER) and
    # round 2 (LAYER: centred sum of squares, sum g, sum g*(x - mean))
    r1 = 1 if layer else 2
    r2 = 3 if layer else 0
    nred = r1 + r2
    ws_vec = min(vec, 4)  # fp32 stores of at most 16 bytes
    resident = ctas_per_sm(threads, resident)
    # the weight is read with x and dy only where round 1 needs it (RMS's sum of g * x); the
    # other reads of it come per access where used, from L1: holding it across the
    # reductions would cost 16 registers a thread (157 against 128 for 8192 x bf16).
    # The fused add's dres is read with x and dy and held (16 registers at 8192 x bf16, the
    # 4 spilled bytes the program had without it): it comes from DRAM, and read after the
    # reductions its loads started only when the row's sums were done, one access at a
    # time at the register cap, so each row waited out DRAM latency twice
    rms_w = has_weight and not layer
    shared_pw = smem_partials

    def at(j, tx):
        """Where partial ``j`` of thread ``tx`` lives (in shared memory, a thread's words
        are ``threads`` apart, so a warp's accesses hit 32 banks)."""
        return j * threads + tx if shared_pw else j

    @T.macro
    def body(DY, DR, X, W, DX, WS, DW, DB):
        grid = G if has_ws else T.ceildiv(M, rpc)
        steps = T.ceildiv(T.ceildiv(M, rpc), G) if has_ws else 1
        with T.Kernel(grid, threads=threads) as bx:
            if resident > 1:  # registers capped so the planned CTAs fit an SM together
                T.annotate_min_blocks_per_sm(resident)
            tx = T.get_thread_binding()
            lane = tx % tpr
            slot = tx // tpr
            hx = T.alloc_local((held,), dtype)
            hdy = T.alloc_local((held,), dtype)
            hw = T.alloc_local((held if rms_w else 1,), dtype)
            wv = T.alloc_local((vec,), dtype)
            hdr = T.alloc_local((held if add else 1,), dtype)
            hs = T.alloc_local((vec,), odt) if direct else None  # a direct program's sums
            if shared_pw:
                pw = T.alloc_shared((held * threads if grad_weight else 1,), f32)
                pb = T.alloc_shared((held * threads if grad_bias else 1,), f32)
            else:
                pw = T.alloc_local((held if grad_weight else 1,), f32)
                pb = T.alloc_local((held if grad_bias else 1,), f32)
            acc = T.alloc_local((nred,), f32)
            red = T.alloc_shared((2 * nred * rpc * wpr if wpr > 1 else 1,), f32)
            for j in T.unroll(held):
                if grad_weight:
                    pw[at(j, tx)] = T.cast(0, f32)
                if grad_bias:
                    pb[at(j, tx)] = T.cast(0, f32)
            for step in T.serial(steps):
                row = (step * grid + bx) * rpc + slot
                par = step % 2
                for j in T.unroll(nred):
                    acc[j] = T.cast(0, f32)
                for v in T.unroll(per):
                    col = (v * tpr + lane) * vec
                    if row < M and (exact or col < n):
                        for i in T.vectorized(vec):
                            hx[v * vec + i] = X[row, col + i]
                        for i in T.vectorized(vec):
                            hdy[v * vec + i] = DY[row, col + i]
                        if rms_w:
                            for i in T.vectorized(vec):
                                hw[v * vec + i] = W[col + i]
                        if add:
                            for i in T.vectorized(vec):
                                hdr[v * vec + i] = DR[row, col + i]
                    else:
                        for i in T.unroll(vec):
                            hx[v * vec + i] = T.cast(0, dtype)
                            hdy[v * vec + i] = T.cast(0, dtype)
                            if rms_w:
                                hw[v * vec + i] = T.cast(0, dtype)
                            if add:
                                hdr[v * vec + i] = T.cast(0, dtype)
                # round 1
                for j in T.unroll(held):
                    xv = T.cast(hx[j], f32)
                    if layer:
                        acc[0] += xv
                    else:
                        g = T.cast(hdy[j], f32)
                        if has_weight:
                            g = g * T.cast(hw[j], f32)
                        acc[0] += xv * xv
                        acc[1] += g * xv
                for s in T.unroll(5):
                    for j in T.unroll(r1):
                        acc[j] += T.shfl_xor(acc[j], 16 >> s)
                if wpr > 1:
                    base = par * nred * rpc * wpr
                    if lane % _WARP == 0:
                        for j in T.unroll(r1):
                            red[base + (j * rpc + slot) * wpr + lane // _WARP] = acc[j]
                    T.sync_threads()
                    for j in T.unroll(r1):
                        acc[j] = T.cast(0, f32)
                        for w in T.unroll(wpr):
                            acc[j] += red[base + (j * rpc + slot) * wpr + w]
                if layer:
                    # round 2, centred from the held values (exact two-pass variance)
                    mean = acc[0] * inv_n
                    for v in T.unroll(per):
                        col = (v * tpr + lane) * vec
                        if exact or col < n:  # padding holds 0, which is not the mean
                            if has_weight:
                                for i in T.vectorized(vec):
                                    wv[i] = W[col + i]
                            for i in T.unroll(vec):
                                d = T.cast(hx[v * vec + i], f32) - mean
                                g = T.cast(hdy[v * vec + i], f32)
                                if has_weight:
                                    g = g * T.cast(wv[i], f32)
                                acc[1] += d * d
                                acc[2] += g
                                acc[3] += g * d
                    for s in T.unroll(5):
                        for j in T.unroll(r2):
                            acc[1 + j] += T.shfl_xor(acc[1 + j], 16 >> s)
                    if wpr > 1:
                        base = par * nred * rpc * wpr
                        if lane % _WARP == 0:
                            for j in T.unroll(r2):
                                red[base + ((1 + j) * rpc + slot) * wpr + lane // _WARP] = \
                                    acc[1 + j]
                        T.sync_threads()
                        for j in T.unroll(r2):
                            acc[1 + j] = T.cast(0, f32)
                            for w in T.unroll(wpr):
                                acc[1 + j] += red[base + ((1 + j) * rpc + slot) * wpr + w]
                    # acc: mean, rstd, mean(g), mean(g * xhat)
                    acc[1] = T.rsqrt(acc[1] * inv_n + eps)
                    acc[0] = mean
                    acc[2] = acc[2] * inv_n
                    acc[3] = acc[3] * inv_n * acc[1]
                else:
                    # acc: rstd, rstd^2 * mean(g * x)
                    acc[0] = T.rsqrt(acc[0] * inv_n + eps)
                    acc[1] = acc[1] * inv_n * acc[0] * acc[0]
                for v in T.unroll(per):
                    col = (v * tpr + lane) * vec
                    if row < M and (exact or col < n):
                        if has_weight:
                            for i in T.vectorized(vec):
                                wv[i] = W[col + i]
                    else:  # dx is not stored; the zeros keep the partial sums exact
                        for i in T.unroll(vec):
                            wv[i] = T.cast(0, dtype)
                    for i in T.unroll(vec):
                        j = v * vec + i
                        dyv = T.cast(hdy[j], f32)
                        g = dyv * T.cast(wv[i], f32) if has_weight else dyv
                        if layer:
                            xhat = (T.cast(hx[j], f32) - acc[0]) * acc[1]
                            dxv = acc[1] * (g - acc[2] - xhat * acc[3])
                        else:
                            xhat = T.cast(hx[j], f32) * acc[0]
                            dxv = acc[0] * (g - T.cast(hx[j], f32) * acc[1])
                        if add:
                            dxv = dxv + T.cast(hdr[j], f32)
                        if grad_weight:
                            pw[at(j, tx)] += dyv * xhat
                        if grad_bias:
                            pb[at(j, tx)] += dyv
                        hx[j] = T.cast(dxv, dtype)
                    if row < M and (exact or col < n):
                        for i in T.vectorized(vec):
                            DX[row, col + i] = hx[v * vec + i]
            if has_ws:
                for v in T.unroll(per):
                    col = (v * tpr + lane) * vec
                    if exact or col < n:
                        for q in T.unroll(vec // ws_vec):
                            j = v * vec + q * ws_vec
                            if grad_weight and shared_pw:
                                for i in T.unroll(ws_vec):
                                    WS[bx, slot, col + q * ws_vec + i] = pw[at(j + i, tx)]
                            elif grad_weight:
                                for i in T.vectorized(ws_vec):
                                    WS[bx, slot, col + q * ws_vec + i] = pw[j + i]
                            if grad_bias and shared_pw:
                                for i in T.unroll(ws_vec):
                                    WS[bx, slot, (k - 1) * n + col + q * ws_vec + i] = \
                                        pb[at(j + i, tx)]
                            elif grad_bias:
                                for i in T.vectorized(ws_vec):
                                    WS[bx, slot, (k - 1) * n + col + q * ws_vec + i] = \
                                        pb[j + i]

            if direct:
                for v in T.unroll(per):
                    col = (v * tpr + lane) * vec
                    if exact or col < n:
                        if grad_weight:
                            for i in T.unroll(vec):
                                hs[i] = T.cast(pw[at(v * vec + i, tx)], odt)
                            for i in T.vectorized(vec):
                                DW[col + i] = hs[i]
                        if grad_bias:
                            for i in T.unroll(vec):
                                hs[i] = T.cast(pb[at(v * vec + i, tx)], odt)
                            for i in T.vectorized(vec):
                                DB[col + i] = hs[i]

    if direct:
        return _direct_params(body, add, has_weight, grad_weight, grad_bias, shapes, dtype,
                              odt)

    @T.macro
    def ws_body(DY, DR, X, W, DX, WS):
        body(DY, DR, X, W, DX, WS, None, None)

    return _main_params(ws_body, add, has_weight, has_ws, shapes, dtype)


def colsum_program(rpc: int, n: int, k: int, dtype: str, warps: int, vec: int, unroll: int,
                   out_dtype: str | None = None):
    """Sum the partial rows of the workspace ``(G, rpc, k * n)`` into ``dweight`` (columns
    ``[0, n)``) and/or ``dbias`` (the last ``n``), stored in ``out_dtype`` (None: ``dtype``,
    the storage dtype; float32 for a float32 weight), each rounded once from its fp32 sum. ``G`` is a launch-time
    size. A CTA takes ``32 * vec`` columns; its warps split the ``G * rpc`` partial rows and
    combine through shared memory."""
    _, T = tl()
    G = T.dynamic("G")
    cols = k * n
    tile = _WARP * vec
    threads = warps * _WARP
    f32 = "float32"
    both = k == 2
    dtype = out_dtype or dtype

    @T.macro
    def body(WS, O1, O2):
        with T.Kernel(T.ceildiv(cols, tile), threads=threads) as bx:
            tx = T.get_thread_binding()
            lane = tx % _WARP
            warp = tx // _WARP
            piece = T.alloc_local((unroll * vec,), f32)
            acc = T.alloc_local((vec,), f32)
            red = T.alloc_shared((warps, tile), f32)
            col = bx * tile + lane * vec
            for i in T.unroll(vec):
                acc[i] = T.cast(0, f32)
            for step in T.serial(T.ceildiv(G * rpc, warps * unroll)):
                for u in T.unroll(unroll):  # the loads first: several in flight
                    p = (step * unroll + u) * warps + warp
                    if p < G * rpc and col < cols:
                        for i in T.vectorized(vec):
                            piece[u * vec + i] = WS[p // rpc, p % rpc, col + i]
                    else:
                        for i in T.unroll(vec):
                            piece[u * vec + i] = T.cast(0, f32)
                for u in T.unroll(unroll):
                    for i in T.unroll(vec):
                        acc[i] += piece[u * vec + i]
            for i in T.unroll(vec):
                red[warp, lane * vec + i] = acc[i]
            T.sync_threads()
            if warp == 0 and col < cols:
                for w in T.unroll(warps - 1):
                    for i in T.unroll(vec):
                        acc[i] += red[w + 1, lane * vec + i]
                for i in T.unroll(vec):
                    if both:
                        if col + i < n:
                            O1[col + i] = T.cast(acc[i], dtype)
                        else:
                            O2[col + i - n] = T.cast(acc[i], dtype)
                    else:
                        O1[col + i] = T.cast(acc[i], dtype)

    sws = (G, rpc, cols)
    if k == 2:
        @T.prim_func
        def main(WS: T.Tensor(sws, f32), DW: T.Tensor((n,), dtype), DB: T.Tensor((n,), dtype)):
            body(WS, DW, DB)
    else:
        @T.prim_func
        def main(WS: T.Tensor(sws, f32), OUT: T.Tensor((n,), dtype)):
            body(WS, OUT, None)
    return main


def looped_bwd_program(kind: str, n: int, dtype: str, eps: float, has_weight: bool,
                       grad_weight: bool, grad_bias: bool, threads: int, vec: int, per: int):
    """The general backward (not compiled): a CTA a row at a time, two passes over the row
    in chunks of ``threads * vec * per``. Pass one reduces the row's sums (LayerNorm shifted
    by the row's first element, as the forward's looped kernel); pass two reads the row again
    (from L2 unless the rows in flight exceed it), writes ``dx`` and adds ``dy * xhat`` (and
    ``dy``) into the CTA's workspace row (``WS[b, 0, :]``, written on the CTA's first row and
    added to on the next ones: no CTA touches another's row, so nothing is atomic).

    The shift is read by the warp's lanes from columns ``0..31`` and broadcast from lane 0
    (``__shfl_sync``) for every row of at least 32 elements: a load of one fixed column of a
    launch-time row does not lower in TileLang 0.1.15 for about half the row lengths (see
    :func:`tileops.kernels.norm._direct_row_load_fails`); narrower rows load it directly.
    """
    _check_sums(kind, has_weight, grad_weight, grad_bias)
    _, T = tl()
    M = T.dynamic("M")
    add, layer = kind == "add_rms", kind == "layer"
    k = int(grad_weight) + int(grad_bias)
    has_ws = k > 0
    G = T.dynamic("G") if has_ws else None
    shapes = {"row": (M, n), "vec": (n,), "ws": (G, 1, k * n) if has_ws else (1,)}
    chunk = threads * vec * per
    nsteps = -(-n // chunk)
    warps = threads // _WARP
    f32 = "float32"
    inv_n = 1.0 / n
    nred = 4 if layer else 2  # sums: LAYER d, d^2, g, g*d (d = x - shift); RMS x^2, g*x
    ws_vec = min(vec, 4)
    spread = n >= _WARP

    @T.macro
    def partial(WS, bx, c, rstep, dst, at):
        """``ws_vec`` running sums from the CTA's workspace row (zero on its first row)."""
        if rstep > 0:
            for i in T.vectorized(ws_vec):
                dst[at + i] = WS[bx, 0, c + i]
        else:
            for i in T.unroll(ws_vec):
                dst[at + i] = T.cast(0, f32)

    @T.macro
    def load(X, DY, W, px, pdy, pw, row, col):
        """The access at ``col`` of the row's ``x`` and ``dy`` (and of ``weight``), as both
        passes read it."""
        for i in T.vectorized(vec):
            px[i] = X[row, col + i]
        for i in T.vectorized(vec):
            pdy[i] = DY[row, col + i]
        if has_weight:
            for i in T.vectorized(vec):
                pw[i] = W[col + i]

    @T.macro
    def body(DY, DR, X, W, DX, WS):
        grid = G if has_ws else M
        rsteps = T.ceildiv(M, G) if has_ws else 1
        with T.Kernel(grid, threads=threads) as bx:
            tx = T.get_thread_binding()
            px = T.alloc_local((vec,), dtype)
            pdy = T.alloc_local((vec,), dtype)
            pw = T.alloc_local((vec,), dtype)
            pdr = T.alloc_local((vec,), dtype)
            part = T.alloc_local((vec,), f32)
            partb = T.alloc_local((vec,), f32)
            acc = T.alloc_local((nred + 1,), f32)  # the sums, then the shift
            red = T.alloc_shared((2 * nred * warps,), f32)
            for rstep in T.serial(rsteps):
                row = rstep * grid + bx
                base = (rstep % 2) * nred * warps
                if row < M:
                    for j in T.unroll(nred):
                        acc[j] = T.cast(0, f32)
                    if not layer:
                        acc[nred] = T.cast(0, f32)
                    elif spread:
                        acc[nred] = T.shfl_sync(T.cast(X[row, tx % _WARP], f32), 0)
                    else:
                        acc[nred] = T.cast(X[row, 0], f32)
                    for cs in T.serial(nsteps):
                        for v in T.unroll(per):
                            col = cs * chunk + (v * threads + tx) * vec
                            if col < n:
                                load(X, DY, W, px, pdy, pw, row, col)
                                for i in T.unroll(vec):
                                    d = T.cast(px[i], f32) - acc[nred]
                                    g = T.cast(pdy[i], f32)
                                    if has_weight:
                                        g = g * T.cast(pw[i], f32)
                                    if layer:
                                        acc[0] += d
                                        acc[1] += d * d
                                        acc[2] += g
                                        acc[3] += g * d
                                    else:
                                        acc[0] += d * d
                                        acc[1] += g * d
                    for s in T.unroll(5):
                        for j in T.unroll(nred):
                            acc[j] += T.shfl_xor(acc[j], 16 >> s)
                    if tx % _WARP == 0:
                        for j in T.unroll(nred):
                            red[base + j * warps + tx // _WARP] = acc[j]
                    T.sync_threads()
                    for j in T.unroll(nred):
                        acc[j] = T.cast(0, f32)
                        for w in T.unroll(warps):
                            acc[j] += red[base + j * warps + w]
                    if layer:
                        # acc: mean, rstd, mean(g), mean(g * xhat)
                        dm = acc[0] * inv_n
                        rstd = T.rsqrt(T.max(acc[1] * inv_n - dm * dm, T.cast(0, f32)) + eps)
                        acc[3] = (acc[3] - dm * acc[2]) * inv_n * rstd
                        acc[2] = acc[2] * inv_n
                        acc[1] = rstd
                        acc[0] = acc[nred] + dm
                    else:
                        # acc: rstd, rstd^2 * mean(g * x)
                        acc[0] = T.rsqrt(acc[0] * inv_n + eps)
                        acc[1] = acc[1] * inv_n * acc[0] * acc[0]
                    for cs in T.serial(nsteps):
                        for v in T.unroll(per):
                            col = cs * chunk + (v * threads + tx) * vec
                            if col < n:
                                load(X, DY, W, px, pdy, pw, row, col)
                                if add:
                                    for i in T.vectorized(vec):
                                        pdr[i] = DR[row, col + i]
                                for q in T.unroll(vec // ws_vec):  # the running sums
                                    if grad_weight:
                                        partial(WS, bx, col + q * ws_vec, rstep,
                                                part, q * ws_vec)
                                    if grad_bias:
                                        partial(WS, bx, (k - 1) * n + col + q * ws_vec, rstep,
                                                partb, q * ws_vec)
                                for i in T.unroll(vec):
                                    dyv = T.cast(pdy[i], f32)
                                    g = dyv * T.cast(pw[i], f32) if has_weight else dyv
                                    if layer:
                                        xhat = (T.cast(px[i], f32) - acc[0]) * acc[1]
                                        dxv = acc[1] * (g - acc[2] - xhat * acc[3])
                                    else:
                                        xhat = T.cast(px[i], f32) * acc[0]
                                        dxv = acc[0] * (g - T.cast(px[i], f32) * acc[1])
                                    if add:
                                        dxv = dxv + T.cast(pdr[i], f32)
                                    if grad_weight:
                                        part[i] += dyv * xhat
                                    if grad_bias:
                                        partb[i] += dyv
                                    px[i] = T.cast(dxv, dtype)
                                for i in T.vectorized(vec):
                                    DX[row, col + i] = px[i]
                                for q in T.unroll(vec // ws_vec):
                                    if grad_weight:
                                        for i in T.vectorized(ws_vec):
                                            WS[bx, 0, col + q * ws_vec + i] = \
                                                part[q * ws_vec + i]
                                    if grad_bias:
                                        for i in T.vectorized(ws_vec):
                                            WS[bx, 0, (k - 1) * n + col + q * ws_vec + i] = \
                                                partb[q * ws_vec + i]

    return _main_params(body, add, has_weight, has_ws, shapes, dtype)


@stored(maxsize=256)
def build_bwd_register_kernel(kind: str, n: int, dtype: str, eps: float, has_weight: bool,
                              grad_weight: bool, grad_bias: bool, target: str | None = None,
                              plan: BwdRegisterPlan | None = None,
                              few_rows: bool = False, direct: bool = False,
                              out_dtype: str | None = None):
    """Compile the register backward (cached per configuration). ``plan`` overrides
    :func:`bwd_register_plan` (any :class:`BwdRegisterPlan`), for tuning; ``direct``: the
    one-row program storing dweight/dbias itself, in ``out_dtype`` (see
    :func:`register_bwd_program`)."""
    plan = plan or bwd_register_plan(n, dtype, few_rows, kind)
    if plan is None:
        raise ValueError(f"a row of {n} {dtype} does not fit the register backward")
    prog = register_bwd_program(kind, n, dtype, eps, has_weight, grad_weight, grad_bias, *plan,
                                direct, out_dtype if direct else None)
    return compile_program(prog, target)


@stored(maxsize=256)
def build_colsum_kernel(rpc: int, n: int, k: int, dtype: str, target: str | None = None,
                        out_dtype: str | None = None):
    """Compile the column-sum program (cached per configuration), storing in ``out_dtype``
    (None: ``dtype``)."""
    return compile_program(colsum_program(rpc, n, k, dtype, *colsum_plan(k * n),
                                          out_dtype), target)


@stored(maxsize=256)
def build_bwd_looped_kernel(kind: str, n: int, dtype: str, eps: float, has_weight: bool,
                            grad_weight: bool, grad_bias: bool, target: str | None = None,
                            plan: tuple[int, int, int] | None = None, few_rows: bool = False,
                            direct: bool = False, out_dtype: str | None = None):
    """Compile the looped backward (cached per configuration); ``plan`` overrides
    :func:`bwd_looped_plan` (``(threads, vec, per)``). ``few_rows``, ``direct`` and
    ``out_dtype`` are accepted for the uniform builder signature (its sums are stored by
    the column-sum program); the looped entry never asks for ``direct``
    (:meth:`_RowNormBwdKernel.direct` is False) and ``few_rows`` changes nothing (one CTA a
    row either way)."""
    if direct:
        raise ValueError("the looped backward has no direct program (its one-row sums go "
                         "through the workspace)")
    threads, vec, per = plan or bwd_looped_plan(n, dtype)
    prog = looped_bwd_program(kind, n, dtype, eps, has_weight, grad_weight, grad_bias, threads,
                              vec, per)
    return compile_program(prog, target)


# --- the implementations ----------------------------------------------------------------------


class _RowNormBwdKernel(Kernel, RowNormBwdInterface):
    """An entry: the main program, the column-sum program where ``dweight``/``dbias`` are
    wanted, and the workspace between them.

    The workspace ``(G_max, slots, sums * n)`` fp32 is allocated once per entry, on its first
    call (from torch's caching allocator, on the entry's device), sized for the largest grid
    the device runs; a call uses its first ``G`` rows (a view made once per ``G``). Every
    row a call uses is written whole by the main program before the column sum reads it, so
    it is never cleared. One entry serves calls in stream order: two calls of one entry
    running at once on different streams would share it.
    """

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    _build: ClassVar[Any] = None

    @classmethod
    def identity(cls, spec: RowNormBwdSpec):
        # the program depends on the row count only through the launch plan it picks
        return (spec.kind, spec.n, spec.dtype, spec.eps, spec.has_weight, spec.grad_weight,
                spec.grad_bias, spec.device, spec.few_rows, cls.direct(spec), spec.out_dtype)

    @classmethod
    def direct(cls, spec: RowNormBwdSpec) -> bool:
        """Whether the entry's main program stores the column sums itself (no workspace, no
        column-sum launch)."""
        return False

    @classmethod
    def _shape(cls, spec: RowNormBwdSpec) -> tuple[int, int, int]:
        """``(rows_per_cta, threads, resident)`` of the entry's main program (``resident``:
        the threads an SM its grid is planned for)."""
        raise NotImplementedError

    @classmethod
    def _plan(cls, spec: RowNormBwdSpec) -> Any:
        """The launch plan handed to the builder (None: the builder's own)."""
        return None

    def __init__(self, spec: RowNormBwdSpec) -> None:
        super().__init__(spec)
        self._empty = spec.n == 0  # nothing to compute, nothing compiled
        self._rpc, self._threads, self._resident = type(self)._shape(spec)
        self._sms = sm_count(spec.device)
        self._ws: Any = None
        self._views: dict[int, Any] = {}
        if self._empty:
            return
        self._direct = type(self).direct(spec)
        self.program = type(self)._build(spec.kind.value, spec.n, spec.dtype, spec.eps,
                                         spec.has_weight, spec.grad_weight, spec.grad_bias,
                                         None, type(self)._plan(spec), spec.few_rows,
                                         self._direct, spec.out_dtype)
        self.colsum = (build_colsum_kernel(self._rpc, spec.n, spec.sums, spec.dtype,
                                           out_dtype=spec.out_dtype)
                       if spec.sums and not self._direct else None)
        self._present = (spec.kind is RowNormKind.ADD_RMS, spec.has_weight)

    def grid(self, rows: int) -> int:
        """CTAs of the main program for ``rows`` (the workspace rows a call uses)."""
        return grid_ctas(rows, self._rpc, self._threads, self._sms, self._resident)

    def _workspace(self, g: int, device: Any):
        view = self._views.get(g)
        if view is None:
            import torch

            if self._ws is None:
                g_max = self.grid(1 << 62)
                self._ws = torch.empty((g_max, self._rpc, self.spec.sums * self.spec.n),
                                       dtype=torch.float32, device=device)
            view = self._views[g] = self._ws[:g]
        return view

    def __call__(self, dy, dres, x, weight, dx, dweight, dbias) -> None:
        rows = dy.shape[0]
        if rows == 0 or self._empty:
            for out in (dweight, dbias):  # a sum over no rows (or of no columns)
                if out is not None:
                    out.zero_()
            return
        add, has_w = self._present
        ws = None
        if self.colsum is not None:
            ws = self._workspace(self.grid(rows), dy.device)
        args = [dy]
        if add:
            args.append(dres)
        args.append(x)
        if has_w:
            args.append(weight)
        args.append(dx)
        if ws is not None:
            args.append(ws)
        elif self._direct:
            if rows != 1:
                raise ValueError(f"a one-row row_norm_bwd entry was called with {rows} rows")
            args.extend(out for out in (dweight, dbias) if out is not None)
        self.program(*args)
        if ws is not None:
            if dweight is not None and dbias is not None:
                self.colsum(ws, dweight, dbias)
            else:
                self.colsum(ws, dweight if dweight is not None else dbias)


class RowNormBwdRegisterKernel(_RowNormBwdKernel):
    """Rows held in registers: ``x`` and ``dy`` read once, 16-byte accesses where the row
    length allows; column partials in registers across the CTA's rows."""

    _build = staticmethod(build_bwd_register_kernel)

    @classmethod
    def region_refusal(cls, spec: RowNormBwdSpec) -> str | None:
        if bwd_register_plan(spec.n, spec.dtype, spec.few_rows, spec.kind.value) is None:
            return (f"a row of {spec.n} x {spec.dtype} exceeds the {_BWD_HELD_BYTES} bytes of "
                    f"x a thread holds at {_BWD_MAX_REGISTER_THREADS} threads")
        return None

    @classmethod
    def direct(cls, spec: RowNormBwdSpec) -> bool:
        """One row with a sum wanted: the row's CTA stores ``dweight``/``dbias`` itself (the
        column sum would be a second launch over one partial row)."""
        return spec.rows == 1 and spec.sums > 0

    @classmethod
    def identity(cls, spec: RowNormBwdSpec):
        # the row count matters through the plan it picks (few, up to 2048, more)
        return (*super().identity(spec), cls._plan(spec))

    @classmethod
    def _plan(cls, spec: RowNormBwdSpec) -> BwdRegisterPlan | None:
        return bwd_register_plan(spec.n, spec.dtype, spec.few_rows, spec.kind.value,
                                 spec.rows)

    @classmethod
    def _shape(cls, spec: RowNormBwdSpec) -> tuple[int, int, int]:
        plan = cls._plan(spec)
        if plan is None:  # refused; only a forced selection gets here
            raise ValueError(f"a row of {spec.n} {spec.dtype} does not fit the register "
                             f"backward")
        return plan.rpc, plan.tpr * plan.rpc, plan.resident


class RowNormBwdLoopedKernel(_RowNormBwdKernel):
    """Any row length: two passes over the row in chunks; column partials in the
    workspace."""

    general = True
    _build = staticmethod(build_bwd_looped_kernel)

    @classmethod
    def _shape(cls, spec: RowNormBwdSpec) -> tuple[int, int, int]:
        return 1, bwd_looped_plan(max(spec.n, 1), spec.dtype)[0], _RESIDENT_THREADS
