"""Dense GEMM ``c = op(a) @ op(b)`` in TileLang, ``op`` a transpose or not.

Every kernel computes a ``(M, N)`` output from ``a`` (``(M, K)``, or ``(K, M)`` when
``trans_a``) and ``b`` (``(K, N)``, or ``(N, K)`` when ``trans_b``), all row-major contiguous.
``M`` is a launch-time size (one compiled program serves every M), ``N``, ``K``, the dtype,
the transposes and the tile configuration are compiled in. Accumulation is fp32.

Shared tiles are laid out as the operand is stored (``(block_K, block_M)`` for a transposed
``a``) and ``T.gemm(..., transpose_A=trans_a, transpose_B=trans_b)`` reads them as such;
on sm_90 that lowers to wgmma (tiles of 64 rows a warpgroup) or mma.sync (16-row tiles).

Five implementations serve the one slot :class:`GemmFwdInterface`:

:class:`GemmHopperKernel` -- sm_90, M above the decode range: TMA loads into a 3-6 stage
    pipeline, warp-specialized (a load warp issues the TMA copies, one or two math
    warpgroups run wgmma), 128x256 / 128x128 / 64x128 / 64x64 block tiles chosen per shape
    by :func:`choose_config` (wave count times per-tile cost), in a swizzled tile order: a
    persistent grid (one CTA per SM looping over its tiles, the next tile's loads
    overlapping this tile's store; :func:`_persistent_program`) for the three larger tiles,
    one CTA per tile for the 64x64 ones.
:class:`GemmSmallMKernel` -- decode (``M <= 64``), sm_80 to sm_90: 16- or 64-row tiles,
    64- or 128-column tiles with 256-deep K tiles (long contiguous rows of ``b`` per copy).
:class:`GemmGemvKernel` -- ``M = 1`` with ``b`` stored ``(N, K)`` (decode through an
    nn.Linear weight), sm_80+: a warp per row of ``b``, 16-byte loads, no tensor cores;
    preferred over the small-M kernel where both apply.
:class:`GemmPaddedKernel` -- sm_90, large calls whose rows break TMA alignment (odd ``K`` or
    ``N``): the operands are copied into zero-padded aligned buffers and the Hopper program
    runs on those.
:class:`GemmGeneralKernel` -- the general one: any shape, any alignment, sm_80+: 64x64x32
    tiles, 2 stages, plain (non-TMA) copies with bounds predicates.

Any configuration may split K (``GemmConfig.split``): CTAs write fp32 partial sums to a
workspace and a second kernel (:func:`splitk_reduce_program`) sums and casts them. The
heuristic does not pick a split today (none beat the unsplit tiles on the H200 sweep,
benchmarks/results/gemm_sweep.txt); tuning tries them.

Stream-K (``GemmConfig.stream_k``, :data:`HOPPER_STREAM_K_CONFIGS`; among the candidates the
sweep times, tried by the tuner only under :data:`TUNE_STREAM_K`, never the heuristic's pick,
and not yet run on a GPU): a persistent grid of one CTA per SM
that does not quantize by waves. Where the output tiles do not fill whole waves, as many
tiles as the last partial wave and one whole wave before it hold (the first of the swizzled
order, run first) are shared out by K iterations, each CTA taking an equal contiguous run of
(tile, K step) iterations; the rest are walked whole, a tile a CTA at a time. A tile
whose K steps several CTAs hold is summed in fp32 by the CTA that holds its first steps, from
the other CTAs' partial sums in a workspace, each published under a flag
(:func:`_stream_k_program`, :class:`StreamKLaunch`). For the shapes with few tiles and short
K where the persistent grid loses to cuBLAS (5001 x 1000 x 1000: 160 tiles of 128 x 256 on
132 SMs, 28 CTAs running two tiles), each CTA then runs 19 or 20 K steps of the 2560 where
the slowest ran 32. With ``accumulate`` the CTA that stores a tile adds ``C``'s prior values
to the finished sum, through the shared tile, before its store.

The accumulating form (``GemmSpec.accumulate``: ``c += op(a) @ op(b)``, torch's ``addmm_``) is
a compile-time flag of every program: the fp32 accumulator starts from the loaded ``C`` tile
instead of zero (the persistent program loads it per tile on the math warpgroups' side, where
the plain one clears), a split-K call's reduction adds ``C`` to the partial sums, and the
one-row program adds it to its warp's sum; each sum is rounded once. With the flag off the
programs are what they were before it existed (their source is pinned by a compile test).
Every implementation and configuration has its accumulating twin.

TMA needs every row stride a multiple of 16 bytes and 16-byte aligned base pointers; calls
that do not meet that (odd ``K`` or ``N``, a transposed ``a`` with ``M % 8 != 0``, offset
views) are outside the region of the two TMA kernels (``GemmPlan.aligned`` is False) and run
on the padded or the general one. Tiles that overhang ``M``, ``N`` or ``K`` are zero-filled
on load (TMA does that natively; plain copies are predicated) and clipped on store.

Tuning (``request_tune()``): the entry times a few configurations on the first call's own
tensors and keeps the fastest; the choice is cached on disk under
``tileops.runtime.env.cache_part("gemm")``, one json file per (implementation, arch, dtype,
transposes, shape bucket, kernel source hash), written atomically; an entry that fails to
decode for any reason, or holds a configuration that is not among the implementation's
candidates, is rebuilt, and a cache that cannot be written warns once and tunes on.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface, device_arch, env, log
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

from ._store import stored
from ._tilelang import compile_program, tl

__all__ = [
    "GemmConfig",
    "GemmFwdInterface",
    "GemmGemvKernel",
    "GemmGeneralKernel",
    "GemmHopperKernel",
    "GemmPaddedKernel",
    "GemmSmallMKernel",
    "GemmDType",
    "GemmPlan",
    "GemmSpec",
    "HOPPER_CONFIGS",
    "PAD_MIN_FLOPS",
    "HOPPER_DEEP_CONFIGS",
    "HOPPER_ORDER_CONFIGS",
    "HOPPER_SPLIT_CONFIGS",
    "HOPPER_STREAM_K_CONFIGS",
    "SMALL_M_CONFIGS",
    "SMALL_M_DEEP_CONFIGS",
    "SMALL_M_SPLIT_CONFIGS",
    "SplitKLaunch",
    "StreamKLaunch",
    "GENERAL_CONFIG",
    "GEMV_CONFIGS",
    "SMALL_M",
    "build_gemm_kernel",
    "build_gemv_kernel",
    "build_reduce_kernel",
    "uses_pdl",
    "choose_config",
    "gemm_program",
    "gemv_program",
    "k_iterations",
    "splitk_reduce_program",
    "StreamKMath",
    "stream_k_schedule",
    "m_bucket",
    "program_sms",
    "sm_count",
    "TuningCacheWarning",
    "tune_key",
    "load_tuned",
    "store_tuned",
]

#: calls with at most this many rows are decode-like (served by the small-M kernel)
SMALL_M = 64
#: SMs of an H100 / H200 (the wave model of the heuristic)
_SMS = 132


class GemmConfig(NamedTuple):
    """A tile configuration: block tile, pipeline depth, threads, swizzle panel (0: off),
    whether global->shared copies may use TMA, warp policy ("square" | "col"), the split-K
    factor (1: each CTA runs the whole K; ``s > 1``: ``s`` CTAs per output tile each run a
    ``1/s`` share of K into an fp32 workspace that a second kernel sums and casts), and
    whether the grid is persistent (one CTA per SM walking the output tiles in swizzled
    order; not with a split), and whether that grid shares the K iterations of its last
    tiles out evenly (stream-K, :func:`_stream_k_program`; a persistent grid)."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    threads: int
    panel: int = 8
    tma: bool = True
    policy: str = "square"
    split: int = 1
    persistent: bool = False
    stream_k: bool = False

    def label(self) -> str:
        """``128x256x64/st3`` (``128x128x64s2/st4`` for a split, ``128x256x64/st3p`` for a
        persistent one, ``128x256x64/st3sk`` for stream-K): in log lines and sweeps."""
        return ("x".join(map(str, self[:3])) + (f"s{self.split}" if self.split > 1 else "")
                + f"/st{self.stages}"
                + ("sk" if self.stream_k else "p" if self.persistent else ""))


#: Hopper configurations the heuristic weighs, with a relative per-FLOP cost (bigger tiles
#: reuse more). Deep K tiles and pipelines where the tile is small: the shapes that pick
#: those have few K tiles per CTA in flight. Persistent grids for the three larger tiles; the
#: 64x64 tiles serve short calls (M = 128), where one CTA per tile was faster (set from
#: benchmarks/results/gemm_sweep.txt and gemm_sweep_order.txt).
HOPPER_CONFIGS: dict[str, tuple[GemmConfig, float]] = {
    "128x256": (GemmConfig(128, 256, 64, 3, 256, persistent=True), 1.0),
    "128x128": (GemmConfig(128, 128, 128, 3, 256, persistent=True), 1.12),
    "64x128": (GemmConfig(64, 128, 64, 4, 128, persistent=True), 1.3),
    "64x64": (GemmConfig(64, 64, 128, 6, 128), 1.6),
}
#: decode configurations: 16-row tiles (mma.sync) or 64-row (one warpgroup). Column tiles of
#: 64 (128 when N is wide) with 256-deep K tiles stream ``b`` at full bandwidth.
SMALL_M_CONFIGS: dict[str, GemmConfig] = {
    "16x64": GemmConfig(16, 64, 256, 4, 128, 0, True, "col"),
    "16x128": GemmConfig(16, 128, 256, 3, 128, 0, True, "col"),
    "64x64": GemmConfig(64, 64, 128, 4, 128, 0, True, "square"),
}
#: N from which decode calls take 128-column tiles
SMALL_M_WIDE_N = 8192
GENERAL_CONFIG = GemmConfig(64, 64, 32, 2, 128, 8, False, "square")
#: further candidates when tuning: the previous defaults and other pipeline depths
HOPPER_DEEP_CONFIGS: dict[str, GemmConfig] = {
    "128x128x64": GemmConfig(128, 128, 64, 4, 256),
    "64x64x128st4": GemmConfig(64, 64, 128, 4, 128),
    "64x128x128": GemmConfig(64, 128, 128, 4, 128),
    "64x128x64st8": GemmConfig(64, 128, 64, 8, 128),
}
HOPPER_SPLIT_CONFIGS: dict[str, GemmConfig] = {
    "128x128s2": GemmConfig(128, 128, 64, 4, 256, 8, True, "square", 2),
    "128x128s4": GemmConfig(128, 128, 64, 4, 256, 8, True, "square", 4),
    "128x256s2": GemmConfig(128, 256, 64, 3, 256, 8, True, "square", 2),
    "64x128s2": GemmConfig(64, 128, 64, 4, 128, 8, True, "square", 2),
}
#: stream-K grids (:func:`_stream_k_program`), among the tuning candidates (tried only under
#: :data:`TUNE_STREAM_K`), never chosen by the heuristic: not yet run on a GPU. The persistent
#: grid's two larger tiles: a 128 x 128 x 128 K step is the 128 x 256 x 64 one's work, its
#: partial sum half the bytes
HOPPER_STREAM_K_CONFIGS: dict[str, GemmConfig] = {
    "128x256sk": GemmConfig(128, 256, 64, 3, 256, persistent=True, stream_k=True),
    "128x128sk": GemmConfig(128, 128, 128, 3, 256, persistent=True, stream_k=True),
}
#: the heuristic's tiles in the other tile order (one CTA per tile <-> persistent)
HOPPER_ORDER_CONFIGS: dict[str, GemmConfig] = {
    name + ("g" if cfg.persistent else "p"): cfg._replace(persistent=not cfg.persistent)
    for name, (cfg, _) in HOPPER_CONFIGS.items()
}
SMALL_M_DEEP_CONFIGS: dict[str, GemmConfig] = {
    "16x32": GemmConfig(16, 32, 256, 4, 128, 0, True, "col"),
    "16x64st3": GemmConfig(16, 64, 256, 3, 128, 0, True, "col"),
}
SMALL_M_SPLIT_CONFIGS: dict[str, GemmConfig] = {
    "16x32s2": GemmConfig(16, 32, 256, 4, 128, 0, True, "col", 2),
    "16x64s2": GemmConfig(16, 64, 256, 3, 128, 0, True, "col", 2),
    "16x64s4": GemmConfig(16, 64, 256, 3, 128, 0, True, "col", 4),
    "16x128s4": GemmConfig(16, 128, 128, 4, 128, 0, True, "col", 4),
    "16x256s4": GemmConfig(16, 256, 64, 4, 128, 0, True, "col", 4),
    "16x256s8": GemmConfig(16, 256, 64, 4, 128, 0, True, "col", 8),
    "64x64s2": GemmConfig(64, 64, 128, 4, 128, 0, True, "square", 2),
}


#: one-row configurations (:func:`gemv_program`): ``block_n`` rows of ``b`` per CTA (a warp
#: each, ``threads = 32 * block_n``), ``stages`` 16-byte loads in flight per lane, ``block_k``
#: the K a warp covers per iteration (``32 * 8 * stages``)
GEMV_CONFIGS: dict[str, GemmConfig] = {
    "4x4": GemmConfig(1, 4, 1024, 4, 128, 0, False, "col"),
    "8x4": GemmConfig(1, 8, 1024, 4, 256, 0, False, "col"),
    "4x8": GemmConfig(1, 4, 2048, 8, 128, 0, False, "col"),
    "2x8": GemmConfig(1, 2, 2048, 8, 64, 0, False, "col"),
}


#: the storage dtypes the GEMM kernels are written for
GemmDType = Literal["float16", "bfloat16"]
_GEMM_DTYPES = frozenset(get_args(GemmDType))


class GemmSpec(CallSpec, frozen=True, kw_only=True):
    """What a GEMM implementation is told about a call: the solved sizes ``M``, ``N``, ``K``
    (exact), the storage dtype and the stored layouts of ``a`` and ``b``. How the call is
    launched (the bucket of ``M`` the heuristic reads, whether every row meets TMA's 16-byte
    alignment) is the implementations' to derive: :func:`plan_of`."""

    m: int
    n: int
    k: int
    dtype: GemmDType
    trans_a: bool  # a stored (K, M)
    trans_b: bool  # b stored (N, K)
    accumulate: bool = False  # c += op(a) @ op(b): c is read (fp32 sum, one rounding)

    def __post_init__(self) -> None:
        self.check_fields(choices={"dtype": _GEMM_DTYPES}, sizes=("m", "n", "k"),
                          flags=("trans_a", "trans_b", "accumulate"))


class GemmPlan(CallSpec, frozen=True):
    """The implementations' view of a call (:func:`plan_of`): ``m`` is the bucket of M
    (:func:`m_bucket`), ``aligned`` whether every TMA alignment requirement holds. One built
    entry serves every call of one plan."""

    m: int
    n: int
    k: int
    dtype: str
    trans_a: bool
    trans_b: bool
    aligned: bool = True
    accumulate: bool = False


def tma_aligned(m: int, n: int, k: int, dtype: str, trans_a: bool, trans_b: bool) -> bool:
    """Whether every stored row of the contiguous operands (a's: K, or M when transposed;
    b's: N, or K when transposed; c's: N) is a multiple of 16 bytes, as TMA needs (base
    pointers are 16-byte aligned: the op copies a view that is not)."""
    per = 16 // _ITEMSIZE[dtype]
    a_row = m if trans_a else k
    b_row = k if trans_b else n
    return a_row % per == 0 and b_row % per == 0 and n % per == 0


def plan_of(spec: GemmSpec | GemmPlan) -> GemmPlan:
    """The plan of a call (a plan is its own)."""
    if isinstance(spec, GemmPlan):
        return spec
    return GemmPlan(spec.device, m_bucket(spec.m), spec.n, spec.k, spec.dtype, spec.trans_a,
                    spec.trans_b,
                    tma_aligned(spec.m, spec.n, spec.k, spec.dtype, spec.trans_a, spec.trans_b),
                    spec.accumulate)


class GemmFwdInterface(KernelInterface):
    """One slot: ``forward(a, b, c)`` writes ``op(a) @ op(b)`` into ``c`` (adds it to ``c``'s
    values when the spec's ``accumulate``); ``a``, ``b`` and ``c`` are contiguous, ``a`` is
    ``(M, K)`` or ``(K, M)``, ``b`` ``(K, N)`` or ``(N, K)``, ``c`` shares memory with
    neither."""

    slot = "gemm_fwd"
    call_spec = GemmSpec


def m_bucket(m: int) -> int:
    """M rounded up to a power of two (at most 16384): the heuristic's view of M."""
    if m > 8192:
        return 16384
    return 1 if m <= 1 else 1 << (m - 1).bit_length()


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def choose_config(spec: GemmPlan) -> GemmConfig:
    """The tile configuration the heuristic picks for ``spec`` (by implementation region)."""
    if not spec.aligned:
        return GENERAL_CONFIG
    if spec.m <= SMALL_M:
        if spec.m > 16:
            return SMALL_M_CONFIGS["64x64"]
        return SMALL_M_CONFIGS["16x128" if spec.n >= SMALL_M_WIDE_N else "16x64"]
    best, best_cost = None, None
    for cfg, eff in HOPPER_CONFIGS.values():
        tiles = _ceil(spec.m, cfg.block_m) * _ceil(spec.n, cfg.block_n)
        cost = _ceil(tiles, _SMS) * cfg.block_m * cfg.block_n * eff
        if best_cost is None or cost < best_cost:
            best, best_cost = cfg, cost
    assert best is not None
    return best


# --- the TileLang program ----------------------------------------------------------------------


def k_iterations(k: int, block_k: int, split: int) -> int:
    """K-tile iterations of each CTA: the ``ceil(k / block_k)`` tiles shared by ``split``
    CTAs, the last of which may run past K (TMA and the predicated copies zero-fill it)."""
    return _ceil(_ceil(k, block_k), split)


def _pdl():
    """TileLang's programmatic-dependent-launch calls (sm_90+): ``(sync, trigger)``."""
    from tilelang.cuda.language import pdl_sync, pdl_trigger

    return pdl_sync, pdl_trigger


def _layout(T, n: int, k: int, trans_a: bool, trans_b: bool, cfg: GemmConfig):
    """What both tile orders share: the dynamic ``M``, the operands' shapes and their shared
    tiles as stored (``(K, M)`` / ``(block_K, block_M)`` for a transposed ``a``), and the
    warp policy."""
    M = T.dynamic("M")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    a_shape = (k, M) if trans_a else (M, k)
    b_shape = (n, k) if trans_b else (k, n)
    a_tile = (bk, bm) if trans_a else (bm, bk)
    b_tile = (bn, bk) if trans_b else (bk, bn)
    policy = T.GemmWarpPolicy.FullCol if cfg.policy == "col" else T.GemmWarpPolicy.Square
    return M, a_shape, b_shape, a_tile, b_tile, policy


def gemm_program(n: int, k: int, dtype: str, trans_a: bool, trans_b: bool, cfg: GemmConfig,
                 pdl: bool = False, sms: int = _SMS, accumulate: bool = False,
                 c_prefetch: bool = False):
    """The TileLang prim_func (not compiled): M dynamic, everything else static. With
    ``cfg.split > 1`` the third operand is the fp32 workspace ``(split, M, n)`` of partial
    sums (:func:`splitk_reduce_program` turns it into ``C``).

    Tile order: one CTA per output tile, rasterized by ``T.use_swizzle`` (panels of
    ``cfg.panel`` row tiles walked column by column), or with ``cfg.persistent`` a grid of
    ``sms`` CTAs walking the same order (:func:`_persistent_program`).

    ``pdl`` (sm_90+): the program is launched as a programmatic dependent launch, so its
    start (shared memory, barriers, descriptor prefetch) overlaps the previous kernel's tail;
    every thread waits for that kernel's completion before the first global read
    (``cudaGridDependencySynchronize``), and the CTA lets the next kernel start launching
    once its main loop is done (persistent: once its last tile's is).

    ``accumulate``: ``C += op(A) @ op(B)``, the accumulator loaded from ``C`` (cast to fp32;
    rows and columns past the edges read as zero and are never stored) where it is cleared
    otherwise, through the shared ``C`` tile: a straight copy into the accumulator's register
    fragment issued 4-byte loads one after another (C's fragment layout), which took the
    fused linear cross-entropy's ``dweight`` sum to 0.44 of cuBLAS's ``addmm_``. Not with a split: there the reduction adds ``C``
    (:func:`splitk_reduce_program`), and the main program's third operand is the workspace.
    ``c_prefetch`` (a persistent program that accumulates): the load warp fetches ``C``
    while the last MMAs of the tile run, and it is added before the store
    (:func:`_persistent_program`)."""
    if accumulate and cfg.split > 1:
        raise ValueError(f"a split-K program writes partial sums; its reduction accumulates "
                         f"(got accumulate=True with split={cfg.split})")
    if cfg.stream_k:
        if not cfg.persistent or cfg.split > 1 or not cfg.tma:
            raise ValueError(f"a stream-K program is a persistent grid loading through TMA, "
                             f"unsplit (got {cfg})")
        return _stream_k_program(n, k, dtype, trans_a, trans_b, cfg, pdl, sms, accumulate)
    if cfg.persistent:
        if cfg.split > 1:
            raise ValueError(f"a persistent tile order does not split K (got split={cfg.split})")
        if not cfg.tma:
            raise ValueError("a persistent tile order loads through TMA (got tma=False)")
        return _persistent_program(n, k, dtype, trans_a, trans_b, cfg, pdl, sms, accumulate,
                                   c_prefetch)
    _, T = tl()
    sync, trigger = _pdl() if pdl else (None, None)
    M, a_shape, b_shape, a_tile, b_tile, policy = _layout(T, n, k, trans_a, trans_b, cfg)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    ann = None if cfg.tma else {"disable_tma": True}
    panel = cfg.panel
    stages = cfg.stages
    threads = cfg.threads
    split = cfg.split
    iters = k_iterations(k, bk, split)
    accum = "float32"
    c_shape, c_dtype = ((split, M, n), accum) if split > 1 else ((M, n), dtype)

    @T.prim_func
    def main(
        A: T.Tensor(a_shape, dtype),
        B: T.Tensor(b_shape, dtype),
        C: T.Tensor(c_shape, c_dtype),
    ):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(M, bm), split, threads=threads) as (bx, by, bz):
            A_s = T.alloc_shared(a_tile, dtype)
            B_s = T.alloc_shared(b_tile, dtype)
            C_l = T.alloc_fragment((bm, bn), accum)
            C_s = T.alloc_shared((bm, bn), dtype) if split == 1 else None
            if panel:
                T.use_swizzle(panel_size=panel)
            if pdl:
                sync()
            if accumulate:  # through the shared C tile: coalesced 16-byte loads, all in flight
                T.copy(C[by * bm, bx * bn], C_s)
                T.copy(C_s, C_l)
            else:
                T.clear(C_l)
            for ko in T.Pipelined(iters, num_stages=stages):
                kt = bz * iters + ko
                if trans_a:
                    T.copy(A[kt * bk, by * bm], A_s, annotations=ann)
                else:
                    T.copy(A[by * bm, kt * bk], A_s, annotations=ann)
                if trans_b:
                    T.copy(B[bx * bn, kt * bk], B_s, annotations=ann)
                else:
                    T.copy(B[kt * bk, bx * bn], B_s, annotations=ann)
                T.gemm(A_s, B_s, C_l, transpose_A=trans_a, transpose_B=trans_b, policy=policy)
            if pdl:
                trigger()
            if split > 1:  # fp32 partial sums, stored from registers (rows past M dropped)
                T.copy(C_l, C[bz, by * bm, bx * bn])
            else:
                T.copy(C_l, C_s)
                T.copy(C_s, C[by * bm, bx * bn], annotations=ann)

    return main


#: whether the persistent programs that accumulate fetch ``C`` under the tile's last MMAs
#: (``c_prefetch`` of :func:`gemm_program`) instead of loading it before the first: the fused
#: loss's ``dweight += z.T @ h`` (128256 x 4096, K = 1024) took 1.93 ms against 2.91 (H100,
#: cuBLAS's ``addmm_`` 1.74-1.82), the same at K = 4096 (7.48 against 7.41;
#: benchmarks/results/gemm_accumulate_c*-h100-cuda0.md)
C_PREFETCH = True
#: whether tuning tries the stream-K configurations: off until they have run on a GPU (their
#: CTAs wait on each other's flags, so a fault there would stall the tuning call)
TUNE_STREAM_K = False

#: registers a thread of the persistent program's load warpgroup and of its math warpgroups
#: keep (``setmaxnreg``): 40 x 128 + 232 x 256 fits the SM's 64K with two math warpgroups
_LOAD_NREG, _MATH_NREG = 40, 232


def _persistent_program(n: int, k: int, dtype: str, trans_a: bool, trans_b: bool,
                        cfg: GemmConfig, pdl: bool, sms: int, accumulate: bool = False,
                        c_prefetch: bool = False):
    """:func:`gemm_program` with ``cfg.persistent``: ``sms`` CTAs, CTA ``w`` computing the
    tiles ``w, w + sms, ...`` of the swizzled order, with the warp roles written out
    (``T.WSSchedule``): one warp issues the TMA loads of every tile's K steps into the
    ``stages``-deep ring, the math warpgroups (``cfg.threads``) run wgmma and store each
    finished tile. The roles loop over the tiles independently, so the loads of a tile start
    while the previous tile is being stored; registers move from the load warpgroup to the
    math ones once per CTA. The persistent loop is the part an automatic split does not
    cover: specialized inside it, the registers would stay evenly spread (slower than one
    CTA per tile, benchmarks/results/gemm_sweep_order.txt).

    ``accumulate``: the math warpgroups load each tile's ``C`` into the accumulator where they
    would clear it: into the shared ``C`` tile (``load_c``, coalesced 16-byte loads, all in
    flight) and from there into the registers of the wgmma layout (``c_to_registers``). The
    load warp's ring is untouched, so the tile's operand loads are in flight meanwhile; the
    load of ``C`` itself does not overlap the MMAs.

    ``c_prefetch`` (with ``accumulate``): the load warp fetches the tile's ``C`` into the
    shared ``C`` tile with TMA once it has issued the tile's last K step, so the fetch runs
    under the tile's last MMAs; the math warpgroups clear the accumulator, and after their
    last MMA wait for the fetch, add the tile to the accumulator and store. A one-deep
    pipeline (``c``) orders the fetch after the previous tile's store has read the tile: the
    math warps release it after the store's read is complete. No shared memory beyond the
    plain program's; the sum is taken in another order (``C`` added last, in fp32)."""
    _, T = tl()
    sync, trigger = _pdl() if pdl else (None, None)
    M, a_shape, b_shape, a_tile, b_tile, policy = _layout(T, n, k, trans_a, trans_b, cfg)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    stages, threads, panel = cfg.stages, cfg.threads, max(cfg.panel, 1)
    iters = k_iterations(k, bk, 1)
    n_tiles = _ceil(n, bn)
    ws = T.WSID
    math_warps = threads // 32
    load = ([T.WSSync.producer_acquire("ring", stage=0), "load_a", "load_b",
             T.WSSync.producer_commit("ring", stage=0)])
    mma = ([T.WSSync.consumer_wait("ring", stage=stages - 1), "mma",
            T.WSSync.consumer_release("ring", stage=stages - 1)])
    root = ["pdl_wait", "tiles", "pdl_done"] if pdl else ["tiles"]
    prefetch = accumulate and c_prefetch
    init = ["load_c", "c_to_registers"] if accumulate and not prefetch else ["clear"]
    load_tile, math_tile = ["coord", "k_steps"], ["coord", *init, "k_steps", "to_shared", "store"]
    if prefetch:
        # the load warp fetches the tile's C into the shared C tile after its last K step is
        # issued (the math warps then run the tile's last MMAs), once the previous tile's
        # store has read it; the math warps add it to the accumulator before their store
        load_tile = [*load_tile, T.WSSync.producer_acquire("c", stage=0), "load_c",
                     T.WSSync.producer_commit("c", stage=0)]
        math_tile = ["coord", "clear", "k_steps", T.WSSync.consumer_wait("c", stage=0), "add_c",
                     "to_shared", "store", T.WSSync.consumer_release("c", stage=0)]

    @T.prim_func
    def persistent(
        A: T.Tensor(a_shape, dtype),
        B: T.Tensor(b_shape, dtype),
        C: T.Tensor((M, n), dtype),
    ):
        with T.Kernel(sms, threads=threads) as wid:
            A_s = T.alloc_shared(a_tile, dtype)
            B_s = T.alloc_shared(b_tile, dtype)
            C_l = T.alloc_fragment((bm, bn), "float32")
            C_s = T.alloc_shared((bm, bn), dtype)
            m_tiles = T.ceildiv(M, bm)
            order = T.PersistentTileScheduler(m_tiles, n_tiles, sms, swizzle_size=panel,
                                              column_major=False, stateful=False)
            T.annotate_ws_schedule(T.WSSchedule(
                num_warps=4 + math_warps,
                roles=[T.WSRole("load", warps_lo=0, warps_hi=1, max_nreg=_LOAD_NREG),
                       T.WSRole("math", warps_lo=4, warps_hi=4 + math_warps,
                                max_nreg=_MATH_NREG)],
                pipelines=[T.WSPipeline("ring", [A_s, B_s], depth=stages),
                           *([T.WSPipeline("c", [C_s], depth=1)] if prefetch else [])],
                scopes=[
                    T.WSScope("k_steps", {"load": load, "math": mma}),
                    T.WSScope("tiles", {"load": load_tile, "math": math_tile}),
                    T.WSScope(T.WSScope.ROOT, {"load": root, "math": root}),
                ]))
            if pdl:
                with T.ws_op("pdl_wait"):
                    sync()
            # this CTA's share of the tiles: wid, wid + sms, ... below m_tiles * n_tiles
            for i in T.serial(T.ceildiv(m_tiles * n_tiles - wid, sms), annotations={ws: "tiles"}):
                with T.ws_op("coord"):
                    by, bx = order.coord(i * sms + wid)
                if accumulate and not prefetch:
                    # through the shared C tile: coalesced 16-byte loads by the math threads,
                    # then each thread reads its fragment from shared memory
                    T.copy(C[by * bm, bx * bn], C_s, annotations={ws: "load_c"})
                    T.copy(C_s, C_l, annotations={ws: "c_to_registers"})
                else:
                    T.clear(C_l, annotations={ws: "clear"})
                for ko in T.Pipelined(iters, num_stages=stages, annotations={ws: "k_steps"}):
                    if trans_a:
                        T.copy(A[ko * bk, by * bm], A_s, annotations={ws: "load_a"})
                    else:
                        T.copy(A[by * bm, ko * bk], A_s, annotations={ws: "load_a"})
                    if trans_b:
                        T.copy(B[bx * bn, ko * bk], B_s, annotations={ws: "load_b"})
                    else:
                        T.copy(B[ko * bk, bx * bn], B_s, annotations={ws: "load_b"})
                    T.gemm(A_s, B_s, C_l, transpose_A=trans_a, transpose_B=trans_b,
                           policy=policy, annotations={ws: "mma"})
                if prefetch:
                    T.copy(C[by * bm, bx * bn], C_s, annotations={ws: "load_c"})
                    with T.ws_op("add_c"):
                        for r, c in T.Parallel(bm, bn):
                            C_l[r, c] += C_s[r, c]
                T.copy(C_l, C_s, annotations={ws: "to_shared"})
                T.copy(C_s, C[by * bm, bx * bn], annotations={ws: "store"})
            if pdl:
                with T.ws_op("pdl_done"):
                    trigger()

    return persistent


#: the named barrier the stream-K program's math warpgroups meet at around a fixup
#: (TileLang's own synchronisation uses the low ids)
_FIXUP_BARRIER = 10


class StreamKMath:
    """The stream-K program's split of the work, one formula a method, over Python ints
    (the defaults: :func:`stream_k_schedule`) or TIR expressions (``T.min``, ``T.max`` and
    ``T.if_then_else``: the program, which binds each result to a variable before the next
    use). ``//`` and ``%`` floor, as TIR's do; ``iters`` K steps a tile, ``sms`` CTAs.

    The tiles shared out by K iterations (:meth:`tiles`) are the first ones of the swizzled
    order; each CTA ``w`` takes iterations ``[lo, hi)`` of theirs (``q`` or ``q + 1`` of
    them, ``q, r = divmod(sk_tiles * iters, sms)``), a run of tile segments, then the other
    tiles whole, ``sk_tiles + w, sk_tiles + w + sms, ...``: its jobs."""

    def __init__(self, iters: int, sms: int, mn: Any = min, mx: Any = max,
                 select: Any = None) -> None:
        self.iters, self.sms, self.mn, self.mx = iters, sms, mn, mx
        self.select = select or (lambda cond, a, b: a if cond else b)

    def tiles(self, tiles: Any) -> Any:
        """Tiles shared out by K iterations: none where ``tiles`` fills whole waves, all of
        them where there are at most ``sms``, else as many as the last partial wave and one
        whole wave hold."""
        return self.select(tiles % self.sms == 0, 0,
                           self.mn(tiles, tiles % self.sms + self.sms))

    def lo(self, cta: Any, q: Any, r: Any) -> Any:
        """The first of CTA ``cta``'s iterations (``q + 1`` a CTA below ``r``, ``q`` after)."""
        return cta * q + self.mn(cta, r)

    def hi(self, lo: Any, cta: Any, q: Any, r: Any) -> Any:
        return lo + q + self.select(cta < r, 1, 0)

    def segments(self, lo: Any, hi: Any) -> Any:
        """The tiles ``[lo, hi)`` touches."""
        return self.select(hi > lo, (hi - 1) // self.iters - lo // self.iters + 1, 0)

    def jobs(self, n_seg: Any, tiles: Any, sk_tiles: Any, cta: Any) -> Any:
        """Segments, then whole tiles (``tiles - sk_tiles - cta`` may be negative: none)."""
        return n_seg + (tiles - sk_tiles - cta + self.sms - 1) // self.sms

    def tile(self, j: Any, n_seg: Any, lo: Any, sk_tiles: Any, cta: Any) -> Any:
        """The tile of job ``j``."""
        return self.select(j < n_seg, lo // self.iters + j,
                           sk_tiles + (j - n_seg) * self.sms + cta)

    def k0(self, j: Any, n_seg: Any, lo: Any, tile: Any) -> Any:
        """Job ``j``'s first K step of its tile."""
        return self.select(j < n_seg, self.mx(lo - tile * self.iters, 0), 0)

    def k1(self, j: Any, n_seg: Any, hi: Any, tile: Any) -> Any:
        """One past job ``j``'s last K step of its tile."""
        return self.select(j < n_seg, self.mn(hi - tile * self.iters, self.iters), self.iters)

    def last_cta(self, tile: Any, q: Any, r: Any) -> Any:
        """The CTA holding stream-K tile ``tile``'s last iteration."""
        last = tile * self.iters + self.iters - 1
        edge = r * (q + 1)
        return self.select(last < edge, last // (q + 1), r + (last - edge) // self.mx(q, 1))


def stream_k_schedule(tiles: int, iters: int, sms: int) -> list[list[tuple]]:
    """What each of the ``sms`` CTAs of the stream-K program does for ``tiles`` output tiles
    of ``iters`` K steps (:class:`StreamKMath` on Python ints): per CTA, its jobs in order,
    each ``(tile, k0, k1, peers)``, ``peers`` the CTAs whose partial sums it adds (the
    owner of a tile it starts and does not finish), empty otherwise."""
    sk = StreamKMath(iters, sms)
    sk_tiles = sk.tiles(tiles)
    q, r = sk_tiles * iters // sms, sk_tiles * iters % sms
    out = []
    for cta in range(sms):
        lo = sk.lo(cta, q, r)
        hi = sk.hi(lo, cta, q, r)
        n_seg = sk.segments(lo, hi)
        jobs = []
        for j in range(sk.jobs(n_seg, tiles, sk_tiles, cta)):
            tile = sk.tile(j, n_seg, lo, sk_tiles, cta)
            k0, k1 = sk.k0(j, n_seg, lo, tile), sk.k1(j, n_seg, hi, tile)
            peers = (range(cta + 1, sk.last_cta(tile, q, r) + 1) if k0 == 0 and k1 < iters
                     else range(0))
            jobs.append((tile, k0, k1, tuple(peers)))
        out.append(jobs)
    return out


def _stream_k_program(n: int, k: int, dtype: str, trans_a: bool, trans_b: bool,
                      cfg: GemmConfig, pdl: bool, sms: int, accumulate: bool = False):
    """:func:`gemm_program` with ``cfg.stream_k``: ``sms`` CTAs (all resident: one an SM)
    share the K iterations of the first :meth:`StreamKMath.tiles` output tiles evenly, CTA
    ``w`` taking a contiguous range of (tile, K step) iterations, then walk the remaining
    tiles whole, ``w, w + sms, ...`` after them, all in the persistent program's swizzled
    order (:class:`StreamKMath`, :func:`stream_k_schedule`). The fourth
    and fifth operands are a workspace of one fp32 tile a CTA and one flag a CTA (int32,
    zero between calls).

    A CTA's range is a run of tile segments. Only its first may start past a tile's first K
    step: the CTA writes that segment's fp32 sum into its workspace tile and raises its flag
    (release). The CTA whose segment starts a tile that it does not finish owns the tile:
    after its own segment (the last of its range) it waits for the flags of the CTAs after
    it that hold the tile's later K steps (acquire), adds their sums, clears their flags for
    the next call and stores the tile. Waits go from a CTA to later ones whose partial sum
    is their first segment, so with every CTA resident none can deadlock, and the wait is
    short: the later CTA wrote at its start what the owner needs at its end.

    The warp roles are written out, as in :func:`_persistent_program`, with explicit
    barriers: one warp of the last warpgroup issues the TMA loads of every segment's K steps
    into a ``stages``-deep ring (full / empty barrier pairs, phases running on across
    segments); the math warpgroups (the first ``cfg.threads`` threads) run wgmma and the
    segments' epilogues.

    ``accumulate``: the CTA that stores a tile (whole, or as its owner after adding the later
    CTAs' sums) first loads the tile's ``C`` into the shared ``C`` tile and adds it to the
    fp32 sum: one rounding, as the other programs' accumulating forms."""
    _, T = tl()
    sync, trigger = _pdl() if pdl else (None, None)
    M, a_shape, b_shape, a_tile, b_tile, policy = _layout(T, n, k, trans_a, trans_b, cfg)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    stages, threads, panel = cfg.stages, cfg.threads, max(cfg.panel, 1)
    iters = k_iterations(k, bk, 1)
    n_tiles = _ceil(n, bn)
    load_warp = threads  # the first thread of the load warp (the math threads come first)

    def a_at(A, by, ko):  # the tile of A at row tile by, K step ko, as stored
        return (A[ko * bk:ko * bk + bk, by * bm:by * bm + bm] if trans_a
                else A[by * bm:by * bm + bm, ko * bk:ko * bk + bk])

    def b_at(B, bx, ko):
        return (B[bx * bn:bx * bn + bn, ko * bk:ko * bk + bk] if trans_b
                else B[ko * bk:ko * bk + bk, bx * bn:bx * bn + bn])

    @T.prim_func
    def stream_k(
        A: T.Tensor(a_shape, dtype),
        B: T.Tensor(b_shape, dtype),
        C: T.Tensor((M, n), dtype),
        W: T.Tensor((sms, bm, bn), "float32"),
        F: T.Tensor((sms,), "int32"),
    ):
        with T.Kernel(sms, threads=threads + 128) as cta:
            A_s = T.alloc_shared((stages, *a_tile), dtype)
            B_s = T.alloc_shared((stages, *b_tile), dtype)
            C_s = T.alloc_shared((bm, bn), dtype)
            C_l = T.alloc_fragment((bm, bn), "float32")
            full = T.alloc_barrier([32] * stages)
            empty = T.alloc_barrier([threads] * stages)
            step = T.alloc_var("int32", init=0)  # K steps this role has run, all segments
            # the segment's tile, its row and column tiles and its K steps, in variables
            tile = T.alloc_var("int32")
            by = T.alloc_var("int32")
            bx = T.alloc_var("int32")
            k0 = T.alloc_var("int32")
            k1 = T.alloc_var("int32")
            # the call's split, each value in a variable (their expressions, repeated in
            # every index, grow the program manyfold)
            sk_tiles = T.alloc_var("int32")
            q = T.alloc_var("int32")
            r = T.alloc_var("int32")
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            n_seg = T.alloc_var("int32")
            n_jobs = T.alloc_var("int32")
            tid = T.get_thread_binding()
            m_tiles = T.ceildiv(M, bm)
            tiles = m_tiles * n_tiles
            order = T.PersistentTileScheduler(m_tiles, n_tiles, sms, swizzle_size=panel,
                                              column_major=False, stateful=False)
            sk = StreamKMath(iters, sms, T.min, T.max, T.if_then_else)
            sk_tiles = sk.tiles(tiles)
            q = sk_tiles * iters // sms
            r = sk_tiles * iters % sms
            # this CTA's iterations [lo, hi) of the stream-K tiles, its segments of them, and
            # its jobs: the segments, then whole tiles
            lo = sk.lo(cta, q, r)
            hi = sk.hi(lo, cta, q, r)
            n_seg = sk.segments(lo, hi)
            n_jobs = sk.jobs(n_seg, tiles, sk_tiles, cta)

            if tid >= load_warp:  # the load warpgroup: one warp issues, the rest idle
                T.set_max_nreg(_LOAD_NREG, 0)
                if tid < load_warp + 32:
                    if pdl:
                        sync()
                    for j in T.serial(n_jobs):
                        tile = sk.tile(j, n_seg, lo, sk_tiles, cta)
                        k0 = sk.k0(j, n_seg, lo, tile)
                        k1 = sk.k1(j, n_seg, hi, tile)
                        by, bx = order.coord(tile)
                        for ko in T.serial(k0, k1):
                            s = step % stages
                            phase = (step // stages) & 1
                            T.mbarrier_wait_parity(empty[s], phase ^ 1)
                            T.tma_copy(a_at(A, by, ko), A_s[s, :, :], barrier=full[s])
                            T.tma_copy(b_at(B, bx, ko), B_s[s, :, :], barrier=full[s])
                            T.mbarrier_arrive(full[s])
                            step = step + 1
                    if pdl:
                        trigger()
            else:  # the math warpgroups
                T.set_max_nreg(_MATH_NREG, 1)
                if pdl:
                    sync()
                for j in T.serial(n_jobs):
                    tile = sk.tile(j, n_seg, lo, sk_tiles, cta)
                    k0 = sk.k0(j, n_seg, lo, tile)
                    k1 = sk.k1(j, n_seg, hi, tile)
                    by, bx = order.coord(tile)
                    T.clear(C_l)
                    for _ko in T.serial(k0, k1):
                        s = step % stages
                        phase = (step // stages) & 1
                        T.mbarrier_wait_parity(full[s], phase)
                        T.gemm(A_s[s, :, :], B_s[s, :, :], C_l, transpose_A=trans_a,
                               transpose_B=trans_b, policy=policy)
                        T.mbarrier_arrive(empty[s])
                        step = step + 1
                    if k0 > 0:  # a later part of the tile's K: its sum to this CTA's tile
                        T.copy(C_l, W[cta, 0, 0])
                        # each thread's stores visible on the device (and kept before the
                        # barrier: TileLang's named barrier is not a compiler fence), then
                        # the flag
                        T.evaluate(T.call_extern("handle", "__threadfence"))
                        T.sync_threads(_FIXUP_BARRIER, threads)
                        if tid == 0:
                            T.atomic_store(F[cta], 1, memory_order="release")
                    else:
                        if k1 < iters:  # the tile's owner: the CTAs after it hold the rest
                            for p in T.serial(cta + 1, sk.last_cta(tile, q, r) + 1):
                                if tid == 0:
                                    while T.atomic_load(F[p], memory_order="acquire") == 0:
                                        T.evaluate(0)
                                    F[p] = 0
                                T.sync_threads(_FIXUP_BARRIER, threads)
                                # no thread's reads of the sum move above the barrier
                                T.evaluate(T.call_extern("handle", "__threadfence"))
                                for i, jj in T.Parallel(bm, bn):
                                    C_l[i, jj] += W[p, i, jj]
                        if accumulate:  # c's prior values through the shared tile, in fp32
                            # once the previous tile's store has read the shared tile (the
                            # thread that issued it waited for that; TileLang's own sync
                            # pass puts no barrier here)
                            T.sync_threads(_FIXUP_BARRIER, threads)
                            T.copy(C[by * bm, bx * bn], C_s)
                            for i, jj in T.Parallel(bm, bn):
                                C_l[i, jj] += C_s[i, jj]
                        T.copy(C_l, C_s)
                        T.copy(C_s, C[by * bm, bx * bn])
                if pdl:
                    trigger()

    return stream_k


#: tile of the split-K reduction (rows, columns) and its threads: 16-byte loads of fp32
_REDUCE_TILE = (16, 256, 256)


def splitk_reduce_program(n: int, dtype: str, split: int, pdl: bool = False,
                          accumulate: bool = False):
    """``C[m, j] = sum_s W[s, m, j]`` cast to ``dtype``: the second kernel of a split-K call
    (``pdl`` as in :func:`gemm_program`); with ``accumulate``, ``C[m, j] + sum_s W[s, m, j]``,
    summed in fp32 and rounded once."""
    _, T = tl()
    sync, _ = _pdl() if pdl else (None, None)
    M = T.dynamic("M")
    rm, rn, threads = _REDUCE_TILE

    @T.prim_func
    def main(W: T.Tensor((split, M, n), "float32"), C: T.Tensor((M, n), dtype)):
        with T.Kernel(T.ceildiv(n, rn), T.ceildiv(M, rm), threads=threads) as (bx, by):
            acc = T.alloc_fragment((rm, rn), "float32")
            part = T.alloc_fragment((rm, rn), "float32")
            if pdl:
                sync()
            T.copy(W[0, by * rm, bx * rn], acc)
            for s in T.unroll(1, split):
                T.copy(W[s, by * rm, bx * rn], part)
                for i, j in T.Parallel(rm, rn):
                    acc[i, j] += part[i, j]
            if accumulate:
                prior = T.alloc_fragment((rm, rn), dtype)
                T.copy(C[by * rm, bx * rn], prior)
                for i, j in T.Parallel(rm, rn):
                    acc[i, j] += T.cast(prior[i, j], "float32")
            T.copy(acc, C[by * rm, bx * rn])

    return main


#: 16-byte loads: elements of a 2-byte dtype per load
_VEC = 8


def gemv_program(n: int, k: int, dtype: str, trans_a: bool, cfg: GemmConfig,
                 pdl: bool = False, accumulate: bool = False):
    """``c[0, j] = sum_k a[k] * b[j, k]``: one row of ``a`` against ``b`` stored ``(N, K)``
    (``trans_b``), without tensor cores. A warp per row of ``b``: each lane reads 16-byte
    chunks of that row (a warp reads 512 contiguous bytes per load), ``cfg.stages`` chunks in
    flight per lane, fp32 sums reduced across the warp by shuffles. ``cfg.block_n`` rows per
    CTA (``cfg.threads == 32 * cfg.block_n``); ``a`` (``(1, K)`` or ``(K, 1)``: contiguous
    either way) is read through L1. Launched only for ``M == 1`` (an empty call launches
    nothing); ``K`` is a multiple of 8 (16-byte aligned rows), chunks past ``K`` read as 0
    and rows past ``N`` store nothing. ``accumulate``: lane 0 adds ``C[0, row]`` (in fp32) to
    the warp's sum before the one rounding."""
    _, T = tl()
    sync, trigger = _pdl() if pdl else (None, None)
    rows, unroll = cfg.block_n, cfg.stages
    lanes = 32
    step = lanes * _VEC * unroll  # K covered per iteration of a warp
    iters = _ceil(k, step)
    accum = "float32"
    a_shape = (k, 1) if trans_a else (1, k)

    @T.prim_func
    def main(
        A: T.Tensor(a_shape, dtype),
        B: T.Tensor((n, k), dtype),
        C: T.Tensor((1, n), dtype),
    ):
        with T.Kernel(T.ceildiv(n, rows), threads=(lanes, rows)) as bx:
            lane = T.get_thread_binding(0)
            r = T.get_thread_binding(1)
            row = bx * rows + r
            a_l = T.alloc_local((unroll, _VEC), dtype)
            b_l = T.alloc_local((unroll, _VEC), dtype)
            acc = T.alloc_local((1,), accum)
            red = T.alloc_local((1,), accum)
            if pdl:
                sync()
            T.clear(acc)
            for it in T.serial(iters):
                for u in T.unroll(unroll):  # every load of the iteration before any use
                    kc = it * step + u * lanes * _VEC + lane * _VEC
                    if kc < k and row < n:
                        for v in T.vectorized(_VEC):
                            b_l[u, v] = B[row, kc + v]
                        for v in T.vectorized(_VEC):
                            a_l[u, v] = A[kc + v, 0] if trans_a else A[0, kc + v]
                    else:
                        for v in T.vectorized(_VEC):
                            b_l[u, v] = T.cast(0, dtype)
                            a_l[u, v] = T.cast(0, dtype)
                for u in T.unroll(unroll):
                    for v in T.unroll(_VEC):
                        acc[0] += a_l[u, v].astype(accum) * b_l[u, v].astype(accum)
            if pdl:
                trigger()
            with T.attr(T.comm_reducer(lambda x, y: x + y, [T.Cast(accum, 0)]),
                        "reduce_scope", T.reinterpret(T.uint64(0), dtype="handle")):
                T.evaluate(T.tvm_thread_allreduce(T.uint32(1), acc[0], True, red[0], lane,
                                                  dtype="handle"))
            if lane == 0 and row < n:
                if accumulate:
                    C[0, row] = T.cast(red[0] + T.cast(C[0, row], accum), dtype)
                else:
                    C[0, row] = T.cast(red[0], dtype)

    return main


@stored(maxsize=256)
def build_gemm_kernel(n: int, k: int, dtype: str, trans_a: bool, trans_b: bool,
                      cfg: GemmConfig, target: str | None = None, pdl: bool = False,
                      sms: int = _SMS, accumulate: bool = False, c_prefetch: bool = False):
    """Compile the program for one configuration (cached per process; TileLang also caches
    on disk). ``target``: an arch such as ``"sm_90"``, or None for the current device;
    ``pdl`` only for sm_90+ (TileLang refuses it below); ``sms``: the persistent grid
    (:func:`program_sms`); ``accumulate`` and ``c_prefetch`` as in :func:`gemm_program`."""
    return compile_program(gemm_program(n, k, dtype, trans_a, trans_b, cfg, pdl, sms,
                                        accumulate, c_prefetch), target)


@stored(maxsize=64)
def build_gemv_kernel(n: int, k: int, dtype: str, trans_a: bool, cfg: GemmConfig,
                      target: str | None = None, pdl: bool = False, accumulate: bool = False):
    """Compile :func:`gemv_program` (cached per process and on disk, as the others)."""
    return compile_program(gemv_program(n, k, dtype, trans_a, cfg, pdl, accumulate), target)


@stored(maxsize=64)
def build_reduce_kernel(n: int, dtype: str, split: int, target: str | None = None,
                        pdl: bool = False, accumulate: bool = False):
    """Compile the split-K reduction for ``n`` columns and ``split`` partial sums (adding
    ``C`` with ``accumulate``)."""
    return compile_program(splitk_reduce_program(n, dtype, split, pdl, accumulate), target)


@functools.lru_cache(maxsize=16)
def sm_count(device: Any) -> int:
    """Streaming multiprocessors of a CUDA device: the size of a persistent grid (an
    H100 / H200's 132 for a device that is not CUDA, as when compiling without one)."""
    if getattr(device, "type", None) != "cuda":
        return _SMS
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def program_sms(cfg: GemmConfig, device: Any) -> int:
    """The ``sms`` a program of ``cfg`` is built with for ``device`` (only a persistent
    program depends on it; the others are built with the default, one compiled program)."""
    return sm_count(device) if cfg.persistent else _SMS


def uses_pdl(cfg: GemmConfig, arch: tuple[int, int] | None) -> bool:
    """Whether a program of ``cfg`` on a device of compute capability ``arch`` is built for
    programmatic dependent launch: the TMA configurations on sm_90+."""
    return cfg.tma and arch is not None and arch >= (9, 0)


class SplitKLaunch:
    """One split-K call: the main program writes ``split`` fp32 partial sums into a
    workspace taken from torch's caching allocator on the call's stream (so graph capture
    and several streams are safe), the reduction sums them into ``c`` (adds them to it, for
    an accumulating call: its reduction program reads ``c``)."""

    def __init__(self, main, reduce, split: int, n: int) -> None:
        self.main, self.reduce, self.split, self.n = main, reduce, split, n

    def __call__(self, a, b, c) -> None:
        import torch

        work = torch.empty((self.split, c.shape[0], self.n), dtype=torch.float32,
                           device=c.device)
        self.main(a, b, work)
        self.reduce(work, c)


class StreamKLaunch:
    """One stream-K call (:func:`_stream_k_program`): the program's workspace (one fp32 tile
    a CTA) and flags (one int32 a CTA) are allocated zeroed on a device's first call and
    shared by every later call on that device with the same grid and tile (the program
    leaves the flags zeroed, so a CUDA graph that captured a call replays it as well). Calls
    on one device must not run concurrently on several streams: they would share the
    flags. The first call on a device cannot be captured (nothing would zero the flags
    before the graph's first replay): it is refused there. The program's CTAs wait on one
    another, so all of them must be resident at once: the grid is the device's SM count,
    one CTA an SM (a device whose SMs are partly taken by kernels that never finish, or
    held back from the process, would hang it)."""

    #: (device, grid, tile rows, tile columns) -> (workspace, flags)
    _buffers: ClassVar[dict[tuple, tuple[Any, Any]]] = {}

    def __init__(self, main, sms: int, block_m: int, block_n: int) -> None:
        self.main, self.sms, self.block_m, self.block_n = main, sms, block_m, block_n

    def buffers(self, device) -> tuple[Any, Any]:
        """The workspace and flags of ``device`` (a CUDA device), allocated on first use."""
        import torch

        device = torch.device(device)
        if device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        key = (device, self.sms, self.block_m, self.block_n)
        found = StreamKLaunch._buffers.get(key)
        if found is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the stream-K GEMM's first call on a device cannot be "
                                   "captured in a CUDA graph (its flags are zeroed on that "
                                   "call): run it once outside capture first")
            found = (torch.empty((self.sms, self.block_m, self.block_n), dtype=torch.float32,
                                 device=device),
                     torch.zeros((self.sms,), dtype=torch.int32, device=device))
            StreamKLaunch._buffers[key] = found
        return found

    def __call__(self, a, b, c) -> None:
        work, flags = self.buffers(c.device)
        self.main(a, b, c, work, flags)


# --- the tuning cache --------------------------------------------------------------------------


class TuningCacheWarning(RuntimeWarning):
    """The tuning cache could not be written: the tuned choice serves this process only."""


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """Changes with the programs' source and TileLang's version, which is read from the
    installed distribution's metadata: naming a cache entry does not import TileLang."""
    text = "".join(inspect.getsource(f) for f in (_layout, gemm_program, _persistent_program,
                                                   _stream_k_program, StreamKMath,
                                                   splitk_reduce_program, gemv_program,
                                                   SplitKLaunch, StreamKLaunch))
    try:
        text += importlib.metadata.version("tilelang")
    except importlib.metadata.PackageNotFoundError:  # nothing can be compiled then either
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tune_key(arch: str, spec: GemmPlan, kernel: str) -> str:
    """The file stem of the cache entry for ``spec`` on ``arch`` (e.g. ``"sm_90"``) tuned by
    the implementation named ``kernel`` (a caller's ``kernel_map`` may send one call to
    another implementation, whose configurations mean other programs)."""
    return (f"{kernel}-{arch}-{spec.dtype}-{'T' if spec.trans_a else 'N'}"
            f"{'T' if spec.trans_b else 'N'}-m{spec.m}-n{spec.n}-k{spec.k}-"
            f"{'al' if spec.aligned else 'un'}-{'acc-' if spec.accumulate else ''}"
            f"{_source_hash()}")


def _cache_root() -> Path:
    return env.cache_part("gemm")


#: an entry is a few hundred bytes; a file larger than this is not one, and is not read whole
_MAX_ENTRY_BYTES = 1 << 16
#: the fields of GemmConfig by the check their values must pass
_POSITIVE = ("block_m", "block_n", "block_k", "stages", "threads", "split")
_BOOLS = ("tma", "persistent", "stream_k")
_POLICIES = ("square", "col")


def _read_entry(path: Path) -> bytes | None:
    """The bytes of the regular file at ``path``, or None: absent, unreadable, a directory, a
    FIFO or device (opened without blocking, then refused), or larger than an entry can be."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb") as f:
            fd = -1  # the file object owns it now
            data = f.read(_MAX_ENTRY_BYTES + 1)
    except OSError:
        return None
    finally:
        if fd >= 0:
            os.close(fd)
    return data if len(data) <= _MAX_ENTRY_BYTES else None


def _config_of(raw: object, key: str) -> GemmConfig | None:
    """The configuration a decoded entry holds, or None: the entry must be an object naming
    ``key`` whose ``config`` has exactly GemmConfig's fields, each of its type (``True`` is
    not an int here, nor ``1`` a bool) and in its range. Checks only, nothing raises."""
    if not isinstance(raw, dict) or raw.get("key") != key:
        return None
    cfg = raw.get("config")
    if not isinstance(cfg, dict) or set(cfg) != set(GemmConfig._fields):
        return None
    if any(type(cfg[f]) is not int or cfg[f] <= 0 for f in _POSITIVE):
        return None
    if type(cfg["panel"]) is not int or cfg["panel"] < 0:
        return None
    if any(type(cfg[f]) is not bool for f in _BOOLS):
        return None
    if type(cfg["policy"]) is not str or cfg["policy"] not in _POLICIES:
        return None
    return GemmConfig(**{f: cfg[f] for f in GemmConfig._fields})


def load_tuned(key: str) -> GemmConfig | None:
    """The cached configuration under ``key``, or None, whatever is in the file's place:
    absent or unreadable, not a regular file, too large, not UTF-8, not json, json nested
    deeper than the parser goes (RecursionError), or json that is not a valid entry for
    ``key``. Such an entry is ignored and the next tuning run replaces it (nothing in it is
    executed or unpickled; the caller also runs only one of its own candidates)."""
    data = _read_entry(_cache_root() / f"{key}.json")
    if data is None:
        return None
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError included
        return None
    return _config_of(raw, key)


#: cache directories already warned about, so a process warns once for each
_warned_unwritable: set[Path] = set()


def store_tuned(key: str, cfg: GemmConfig,
                timings: dict[str, float] | None = None) -> Path | None:
    """Write the entry atomically (a temporary file in the same directory, then rename) over
    whatever is in its place, a directory included (its name is this entry's, so nothing
    else owns it). Returns its path, or None where it cannot be written (a read-only or full
    disk, a file where a folder should be): the tuned choice then serves this process only,
    and the first such failure for a directory is one :class:`TuningCacheWarning`; tuning
    never fails a call for want of a cache."""
    root = _cache_root()
    path = root / f"{key}.json"
    body = json.dumps({"key": key, "config": cfg._asdict(), "timings_ms": timings or {}},
                      indent=1)
    try:
        root.mkdir(parents=True, exist_ok=True)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=root)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(body)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError as exc:
        if root not in _warned_unwritable:
            _warned_unwritable.add(root)
            warnings.warn(
                f"the GEMM tuning cache {root} cannot be written ({type(exc).__name__}: "
                f"{exc}); tuned configurations serve this process only (set "
                f"TILEOPS_CACHE_DIR to a writable directory)", TuningCacheWarning,
                stacklevel=2)
        return None
    return path


def _time_ms(fn, iters: int = 10) -> float:
    """Best of 3 timings of ``iters`` calls, replayed from a CUDA graph (device time: for a
    small GEMM the host's launch cost would otherwise decide); back-to-back launches where
    capture is not possible."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    run, per_run = fn, 1
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        run, per_run, iters = graph.replay, iters, 1
    except RuntimeError:  # e.g. capture refused: time eager launches instead
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(iters):
            run()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / (iters * per_run))
    return best


# --- the implementations -----------------------------------------------------------------------


class _GemmKernel(Kernel, GemmFwdInterface):
    devices = ("cuda",)
    #: candidate configurations when tuning (the heuristic's pick is always one)
    tune_candidates: ClassVar[tuple[GemmConfig, ...]] = ()

    @classmethod
    def config_for(cls, spec: GemmPlan) -> GemmConfig:
        return choose_config(spec)

    @classmethod
    def region_refusal(cls, spec: GemmSpec | GemmPlan) -> str | None:
        return cls.plan_refusal(plan_of(spec))

    @classmethod
    def plan_refusal(cls, spec: GemmPlan) -> str | None:
        """Why the plan is outside this implementation's region (see region_refusal)."""
        return None

    @classmethod
    def identity(cls, spec: GemmSpec | GemmPlan) -> Any:
        return plan_of(spec)

    @classmethod
    def entry_for(cls, spec: GemmSpec | GemmPlan, op: Any) -> Any:
        return cls(plan_of(spec))

    def __init__(self, spec: GemmSpec | GemmPlan) -> None:
        spec = plan_of(spec)
        super().__init__(spec)
        self.config = type(self).config_for(spec)
        # M is a launch-time size that may be 0 (its bucket is 1); N and K are known here, and
        # when either is 0 no call launches anything (nothing is compiled)
        self._degenerate = spec.m <= 1 or spec.n == 0 or spec.k == 0
        self.program = None if spec.n == 0 or spec.k == 0 else self._build(self.config)
        self._tune_pending = False

    def _build(self, cfg: GemmConfig):
        return self._build_for(self.spec, cfg)

    def _build_for(self, s: GemmPlan, cfg: GemmConfig):
        pdl = uses_pdl(cfg, device_arch(s.device))
        # a split call accumulates in its reduction, its main program is the plain one
        accumulate = s.accumulate and cfg.split == 1
        sms = program_sms(cfg, s.device)
        # the stream-K program adds c after a tile's fixup, it does not prefetch it
        prefetch = accumulate and cfg.persistent and not cfg.stream_k and C_PREFETCH
        main = build_gemm_kernel(s.n, s.k, s.dtype, s.trans_a, s.trans_b, cfg, None, pdl,
                                 sms, accumulate, prefetch)
        if cfg.stream_k:
            return StreamKLaunch(main, sms, cfg.block_m, cfg.block_n)
        if cfg.split == 1:
            return main
        return SplitKLaunch(main, build_reduce_kernel(s.n, s.dtype, cfg.split, None, pdl,
                                                      s.accumulate), cfg.split, s.n)

    def request_tune(self) -> None:
        """Tune on the next call (it needs real tensors on the device)."""
        self._tune_pending = True

    def _tune(self, a, b, c) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # timing needs its own graphs: tune on the first call outside capture
        self._tune_pending = False
        if self.spec.accumulate:  # the candidates' runs add into a copy, not the caller's c
            c = c.clone()
        arch = device_arch(a.device)
        arch_name = f"sm_{arch[0]}{arch[1]}" if arch else "unknown"
        key = tune_key(arch_name, self.spec, type(self).__name__)
        name = type(self).__name__
        cands = [self.config] + [c2 for c2 in type(self).tune_candidates if c2 != self.config
                                 and (TUNE_STREAM_K or not c2.stream_k)]
        cached = load_tuned(key)
        if cached is not None and cached in cands:  # anything else is not this one's to run
            log.info("%s: tuned configuration %s from the cache (%s)", name, cached.label(),
                     key)
            self.config, self.program = cached, self._build(cached)
            return
        log.info("%s: tuning %s over %d configurations", name, key, len(cands))
        timings: dict[str, float] = {}
        best = (float("inf"), self.config, self.program)
        for i, cfg in enumerate(cands, 1):
            try:
                prog = self._build(cfg)
                ms = _time_ms(lambda p=prog: p(a, b, c))
            except Exception as exc:  # noqa: BLE001 - a candidate that fails is skipped
                log.info("%s: [%d/%d] %s failed: %s: %s", name, i, len(cands), cfg.label(),
                         type(exc).__name__, str(exc)[-200:])
                continue
            log.info("%s: [%d/%d] %s %.4f ms", name, i, len(cands), cfg.label(), ms)
            timings[repr(tuple(cfg))] = ms
            if ms < best[0]:
                best = (ms, cfg, prog)
        _, self.config, self.program = best
        path = store_tuned(key, self.config, timings)
        log.info("%s: chose %s (%.4f ms), %s", name, self.config.label(), best[0],
                 f"cached in {path}" if path else "not cached (the cache cannot be written)")

    def __call__(self, a, b, c) -> None:
        if self._degenerate and self._degenerate_call(c):
            return
        if self._tune_pending:
            self._tune(a, b, c)
        self.program(a, b, c)  # type: ignore[misc] - None only where every call is degenerate

    def _degenerate_call(self, c) -> bool:
        """Handle an empty output or K = 0 (no launch: ``c`` is zeroed, or left as it is when
        accumulating); True when handled."""
        if c.numel() == 0:
            return True
        if self.spec.k == 0:
            if not self.spec.accumulate:
                c.zero_()
            return True
        return False


class GemmHopperKernel(_GemmKernel):
    """sm_90, M above the decode range: TMA + wgmma, tiles chosen per shape."""

    supported_archs = frozenset({(9, 0)})
    tune_candidates = (tuple(c for c, _ in HOPPER_CONFIGS.values())
                       + tuple(HOPPER_ORDER_CONFIGS.values())
                       + tuple(HOPPER_DEEP_CONFIGS.values())
                       + tuple(HOPPER_SPLIT_CONFIGS.values())
                       + tuple(HOPPER_STREAM_K_CONFIGS.values()))

    @classmethod
    def plan_refusal(cls, spec: GemmPlan) -> str | None:
        if spec.m <= SMALL_M:
            return f"serves M above {SMALL_M} (decode sizes go to the small-M kernel)"
        if not spec.aligned:
            return "needs 16-byte aligned rows and base pointers (TMA)"
        return None


class GemmSmallMKernel(_GemmKernel):
    """Decode sizes (M <= 64): short tiles, many CTAs along N, deep K tiles."""

    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    tune_candidates = (tuple(SMALL_M_CONFIGS.values()) + tuple(SMALL_M_DEEP_CONFIGS.values())
                       + tuple(SMALL_M_SPLIT_CONFIGS.values()))

    @classmethod
    def plan_refusal(cls, spec: GemmPlan) -> str | None:
        if spec.m > SMALL_M:
            return f"serves M up to {SMALL_M}"
        if not spec.aligned:
            return "needs 16-byte aligned rows and base pointers (TMA / 16-byte copies)"
        return None


class GemmGemvKernel(_GemmKernel):
    """One row of ``a`` (``M = 1``: decode) against ``b`` stored ``(N, K)`` (``trans_b``:
    nn.Linear's weight layout), sm_80+: a warp per row of ``b`` reading it in 16-byte chunks,
    no tensor cores (:func:`gemv_program`). A bandwidth-bound call: the whole of ``b`` is
    read once, at close to the device's copy rate. Preferred over the small-M kernel, whose
    16-row mma tiles use one row in sixteen and cover ``N`` with fewer CTAs."""

    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    preferred_over = (GemmSmallMKernel,)
    tune_candidates = tuple(GEMV_CONFIGS.values())

    @classmethod
    def config_for(cls, spec: GemmPlan) -> GemmConfig:
        return GEMV_CONFIGS["4x4"]

    @classmethod
    def plan_refusal(cls, spec: GemmPlan) -> str | None:
        if spec.m > 1:
            return "serves M = 1 (one row of a)"
        if not spec.trans_b:
            return "serves b stored (N, K) (trans_b: each output reads one contiguous row)"
        # base pointers are 16-byte aligned (the op copies a view that is not); a's and b's
        # rows of K elements then are too when K is a multiple of 8 (2-byte dtypes). N and a
        # transposed a's row length (M = 1) do not matter: c is stored element by element.
        if spec.k % _VEC:
            return "needs K a multiple of 8 (16-byte loads along K)"
        return None

    def _build_for(self, s: GemmPlan, cfg: GemmConfig):
        arch = device_arch(s.device)
        return build_gemv_kernel(s.n, s.k, s.dtype, s.trans_a, cfg, None,
                                 arch is not None and arch >= (9, 0), s.accumulate)


def _round8(x: int) -> int:
    return -(-x // 8) * 8


#: below this many flops (2 M N K) an unaligned call stays on the general kernel: copying the
#: operands into aligned buffers would cost more than it saves
PAD_MIN_FLOPS = 1 << 30


class GemmPaddedKernel(_GemmKernel):
    """sm_90, rows that break TMA's 16-byte alignment (odd ``K`` or ``N``), large calls: the
    operands are copied once into buffers whose row lengths are padded to a multiple of 8
    elements with zeros (``F.pad``: one read and one write each), the Hopper program runs on
    the padded sizes (zero rows and columns of K add nothing), and the ``(M, N)`` corner of
    its output is copied into ``c`` (an accumulating call pads ``c`` the same way first, so
    the program adds into the padded copy). The copies cost two passes over the operands; the
    alternative, 2-byte predicated loads on the general kernel, costs more above
    :data:`PAD_MIN_FLOPS`."""

    supported_archs = frozenset({(9, 0)})
    tune_candidates = GemmHopperKernel.tune_candidates

    @classmethod
    def padded_spec(cls, spec: GemmPlan) -> GemmPlan:
        """The aligned call the Hopper program runs (M stays, N and K round up to 8)."""
        return GemmPlan(spec.device, spec.m, _round8(spec.n), _round8(spec.k), spec.dtype,
                        spec.trans_a, spec.trans_b, True, spec.accumulate)

    @classmethod
    def config_for(cls, spec: GemmPlan) -> GemmConfig:
        return choose_config(cls.padded_spec(spec))

    @classmethod
    def plan_refusal(cls, spec: GemmPlan) -> str | None:
        if spec.aligned:
            return "serves calls whose rows break TMA alignment (aligned ones run unpadded)"
        if spec.m <= SMALL_M:
            return f"serves M above {SMALL_M} (padding would double a decode call's traffic)"
        if 2 * spec.m * spec.n * spec.k < PAD_MIN_FLOPS:
            return f"serves calls of at least {PAD_MIN_FLOPS} flops (padding costs more below)"
        return None

    def _build(self, cfg: GemmConfig):
        return self._build_for(self.padded_spec(self.spec), cfg)

    def __call__(self, a, b, c) -> None:
        import torch.nn.functional as F

        # no empty or K = 0 call reaches here: the region starts at 2^30 flops and M above 64
        m, n = c.shape
        s = self.spec
        kp, np_, mp = _round8(s.k), _round8(n), _round8(m)
        # pad each operand's stored row (and, for a transposed a, its stored rows: M is then
        # a row length) with zeros; F.pad pads the last dimension first
        a_p = F.pad(a, (0, mp - m, 0, kp - s.k) if s.trans_a else (0, kp - s.k))
        b_p = F.pad(b, (0, kp - s.k, 0, np_ - n) if s.trans_b else (0, np_ - n, 0, kp - s.k))
        rows = mp if s.trans_a else m
        c_p = F.pad(c, (0, np_ - n, 0, rows - m)) if s.accumulate else c.new_empty((rows, np_))
        if self._tune_pending:
            self._tune(a_p, b_p, c_p)
        self.program(a_p, b_p, c_p)
        c.copy_(c_p[:m, :n])


class GemmGeneralKernel(_GemmKernel):
    """Any shape and alignment, sm_80+: 64x64x32 tiles, 2 stages, predicated plain copies."""

    general = True
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})

    @classmethod
    def config_for(cls, spec: GemmPlan) -> GemmConfig:
        return GENERAL_CONFIG

    @classmethod
    def identity(cls, spec: GemmSpec | GemmPlan) -> Any:
        # the program depends on neither the M bucket nor the alignment
        return (spec.device, spec.n, spec.k, spec.dtype, spec.trans_a, spec.trans_b,
                spec.accumulate)

    def __init__(self, spec: GemmSpec | GemmPlan) -> None:
        super().__init__(spec)
        # one entry serves every M (its identity has no M bucket): any call may have M = 0
        self._degenerate = True
