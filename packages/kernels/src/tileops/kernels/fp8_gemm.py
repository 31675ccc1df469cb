"""The fp8 GEMM ``c = (a * a_scale) @ (b * b_scale)^T + bias`` in TileLang, for sm_90.

``a`` is ``[M, K]`` and ``b`` ``[N, K]``, both K-major and row-major contiguous, as wgmma's fp8
forms need (no transposed fp8 operand exists); both are float8_e4m3fn or both float8_e5m2
(TileLang 0.1.15's Hopper GEMM refuses a mixed pair). The
products accumulate in float32 registers; ``c`` is bfloat16, float16 or float32, and so is
``bias``. ``M`` is a launch-time size (one compiled program serves every M); ``N``, ``K``, the
dtypes, the scaling and the tile configuration are compiled in.

Scales (float32, dequantised = fp8 * scale; the ops module states their shapes):

- tensor and row (:class:`GemmFp8ScaledKernel`): the scales factor out of the sum over K, so
  the main loop is the plain fp8 GEMM (TMA loads into a ``stages``-deep pipeline, wgmma) and
  the epilogue multiplies the accumulator by ``a_scale * b_scale`` (a row's and a column's for
  ``row``: both staged in shared memory once a tile) and adds the bias before the one
  rounding to ``c``'s dtype.
- block (:class:`GemmFp8BlockKernel`, DeepSeek-V3's 1 x 128 groups of ``a`` and 128 x 128
  blocks of ``b``): the scale changes every 128 steps of K, so each 128-deep K step's wgmma
  writes a fresh float32 partial that is promoted into a second float32 accumulator scaled by
  ``a_scale[m, k / 128] * b_scale[n / 128, k / 128]`` (the row's factor read into registers
  by the math threads each step, before the step's wgmma).

Accumulation: Hopper's fp8 wgmma keeps about 14 bits of its accumulator (DeepSeek-V3's
measurement), not float32's 24. The block kernel's promotion every 128 products bounds that
error to one step's partial; the tensor and row kernels accumulate the whole of K in wgmma, as
torch._scaled_mm does with ``use_fast_accum=True`` (its default promotes), which is why the ops
module declares both forms as peers. Promoting there too needs a second 128 x 256 accumulator,
more registers than a thread has: ``Fp8Config.promote`` on 128 x 128 tiles does it, a candidate
of benchmarks/fp8.py's sweep.

Tiles (:func:`choose_fp8_config`): 128 x 256 x 128 (two math warpgroups), 128 x 128 x 128 or
64 x 128 x 128 for M above the decode range, by a wave model, one CTA a tile (a persistent
grid, ``Fp8Config.persistent``, is a candidate of benchmarks/fp8.py's sweep, not yet
measured); 64 x 64 x 256 for M up to 64 (decode: ``b`` is read once, by ``N / 64`` CTAs
streaming deep K tiles); 128 x 128 x 128, 64 x 128 x 128 and 64 x 64 x 128 for block scales
(a K step is one scale block). Tile rows past ``M`` and columns past ``N`` or ``K`` are
zero-filled on load (TMA does it natively) and not stored.

Decode calls stream ``b`` (``N x K`` bytes) once, so what bounds them is the bytes each SM has
in flight. The 64 x 64 tile runs one CTA an SM (TileLang's setmaxnreg gives its math warpgroup
240 registers a thread, and its four stages take 136 KB): 128 CTAs at N = 8192, two waves at
14336. The swapped tiles (``Fp8Config.swap``, :func:`_swapped_program`) compute the tile
transposed, ``b``'s 64 rows on wgmma's 64-row side and ``a``'s 16 on its narrow side, so a
stage holds no padding (20 KB at K steps of 256, where the 64-row tile's was 32 KB, 12 of them
zeros): two or three CTAs an SM fit, and K may be split over several CTAs a tile (float32
partial sums in a workspace, then :func:`fp8_reduce_program` adds them, scales, adds the bias
and rounds once). On an H100 (benchmarks/fp8.py's decode sweep, 2026-12-07) the unsplit
swapped tile at two CTAs an SM was the fastest configuration on every decode shape and scaling
(16 x 8192 x 8192 per tensor 25.0 us against the 64 x 64 tile's 28.0 and torch._scaled_mm's
24.8; row-wise 25.2 against 28.3 and 38.4; 16 x 14336 x 4096 22.9 against 26.9-30.4 and
23.1-25.8; block-scaled 25.5 against 30.3), and every split one slower (the reduction's
launch and its pass over the partials): :func:`swapped_decode_config` gives that tile, and
:func:`choose_fp8_config` takes it for up to :data:`SWAP_M` rows where the tiles are whole
(``N`` a multiple of 64, ``K`` of the K step: the region the sweep checked on the GPU).
:data:`SWAPPED_DECODE` switches it off. A split stays a configuration the sweep times.

TMA needs 16-byte aligned rows: ``K`` a multiple of 16 (fp8 rows of ``a`` and ``b``) and ``N``
times ``c``'s element size a multiple of 16; calls that break it run the same programs with
plain predicated copies (``tma=False``), slower but any shape.
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
from typing import Any, Literal, NamedTuple, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface

from ._store import stored
from ._tilelang import compile_program, tl
from .gemm import sm_count

__all__ = [
    "BLOCK",
    "DECODE_M",
    "Fp8Config",
    "Fp8SplitLaunch",
    "GemmFp8BlockKernel",
    "GemmFp8Interface",
    "GemmFp8OutDType",
    "GemmFp8ScaledKernel",
    "GemmFp8Spec",
    "SWAPPED_DECODE",
    "SWAP_M",
    "Scaling",
    "build_fp8_gemm_kernel",
    "build_fp8_reduce_kernel",
    "choose_fp8_config",
    "fp8_gemm_launch",
    "fp8_gemm_program",
    "fp8_reduce_program",
    "fp8_tma_aligned",
    "swapped_decode_config",
    "takes_swapped_decode",
]

#: the width of a scale block along K (and of b's blocks along N)
BLOCK = 128
#: SMs of an H100 / H200: the persistent grid's CTAs
_SMS = 132
#: registers a thread of the persistent program's load warpgroup and of its math warpgroups
#: keep (setmaxnreg), as the dense GEMM's: 40 x 128 + 232 x 256 fits the SM's 64K
_LOAD_NREG, _MATH_NREG = 40, 232
#: calls with at most this many rows take the decode tiles
DECODE_M = 64
#: calls with at most this many rows (per tensor and row-wise, TMA-aligned) may take the
#: swapped tile (:func:`swapped_decode_config`)
SWAP_M = 16
#: whether :func:`choose_fp8_config` gives those calls the swapped tile (ahead of the 64 x 64
#: tile on every decode shape of benchmarks/fp8.py's sweep on an H100)
SWAPPED_DECODE = True

Fp8DType = Literal["float8_e4m3fn", "float8_e5m2"]
GemmFp8OutDType = Literal["bfloat16", "float16", "float32"]
_OUT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class Scaling(enum.Enum):
    """How the operands are scaled: per tensor, per row of each, or in blocks."""

    TENSOR = "tensor"
    ROW = "row"
    BLOCK = "block"


class GemmFp8Spec(CallSpec, frozen=True, kw_only=True):
    """An fp8 GEMM call: the solved sizes, the operands' and the output's dtypes, the scaling
    and whether a bias is added."""

    m: int
    n: int
    k: int
    a_dtype: Fp8DType
    b_dtype: Fp8DType
    out_dtype: GemmFp8OutDType
    scaling: Scaling
    has_bias: bool

    def __post_init__(self) -> None:
        fp8 = frozenset(get_args(Fp8DType))
        if self.a_dtype != self.b_dtype:
            raise ValueError(f"GemmFp8Spec: a and b must share one fp8 dtype, got "
                             f"{self.a_dtype} and {self.b_dtype}")
        self.check_fields(choices={"a_dtype": fp8, "b_dtype": fp8,
                                   "out_dtype": frozenset(get_args(GemmFp8OutDType)),
                                   "scaling": frozenset(Scaling)},
                          sizes=("m", "n", "k"), flags=("has_bias",))


class GemmFp8Interface(KernelInterface):
    """One slot: ``forward(a, b, a_scale, b_scale, bias, c)`` writes ``c`` (``bias`` may be
    None; a per-tensor scale is handed as its 0-dim tensor)."""

    slot = "gemm_fp8"
    call_spec = GemmFp8Spec


class Fp8Config(NamedTuple):
    """A tile configuration: block tile, pipeline depth, threads, swizzle panel (0: off),
    whether the global -> shared copies are TMA's, whether the grid is persistent (one CTA an
    SM walking the output tiles, its warp roles written out: :func:`_persistent_program`;
    per-tensor and row-wise scales only), and the math warpgroups' split of the tile:
    ``"square"`` (TileLang's balanced split: two warpgroups on 128 x 256 take 128 x 128 each,
    two wgmma of 64 x 128) or ``"row"`` (each warpgroup 64 full rows: one wgmma of 64 x
    ``block_n``). ``promote`` (per-tensor and row-wise scales): each K step's wgmma partial is
    added into a second float32 accumulator, as block scales need anyway, so wgmma's own
    accumulation spans one step, not the whole of K (torch._scaled_mm's default accuracy).

    ``swap`` (decode, :func:`_swapped_program`): the tile is computed transposed, ``b``'s
    ``block_n`` rows as wgmma's 64-row operand and ``a``'s ``block_m`` (8 to 64) rows as its
    narrow one, so no row of the shared tiles or the product is padding; ``resident`` CTAs an
    SM (registers capped for them, none moved between warpgroups); ``split`` CTAs along K a
    tile, writing float32 partial sums that :func:`fp8_reduce_program` adds and scales."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    threads: int
    panel: int = 8
    tma: bool = True
    persistent: bool = False
    policy: str = "square"
    promote: bool = False
    swap: bool = False
    split: int = 1
    resident: int = 1

    def label(self) -> str:
        return ("x".join(map(str, self[:3])) + f"/st{self.stages}" + ("" if self.tma else "/plain")
                + ("p" if self.persistent else "") + ("r" if self.policy == "row" else "")
                + ("+" if self.promote else "") + ("t" if self.swap else "")
                + (f"s{self.split}" if self.split > 1 else "")
                + (f"x{self.resident}" if self.resident > 1 else ""))


#: the configurations :func:`choose_fp8_config` picks from, with a relative cost a FLOP
#: (bigger tiles reuse more of each load), by region: epilogue scales above the decode range,
#: block scales above it, and either at decode sizes
FP8_CONFIGS: dict[str, Fp8Config] = {
    "128x256": Fp8Config(128, 256, 128, 3, 256),
    "128x128": Fp8Config(128, 128, 128, 4, 256),
    "64x128": Fp8Config(64, 128, 128, 4, 128),
    "decode": Fp8Config(64, 64, 256, 4, 128, 0),
    # each warpgroup 64 rows x 128 (a balanced split would run two 64 x 64 wgmma a step each)
    "block": Fp8Config(128, 128, 128, 4, 256, policy="row"),
    "block-64x128": Fp8Config(64, 128, 128, 4, 128),
    "block-decode": Fp8Config(64, 64, 128, 6, 128, 0),
}
_WEIGHED = {
    "scaled": (("128x256", 1.0), ("128x128", 1.12), ("64x128", 1.3), ("decode", 1.6)),
    "block": (("block", 1.0), ("block-64x128", 1.2), ("block-decode", 1.5)),
}


def fp8_tma_aligned(n: int, k: int, out_dtype: str) -> bool:
    """Whether every stored row meets TMA's 16 bytes: ``a``'s and ``b``'s K fp8 elements and
    ``c``'s N elements (base pointers are 16-byte aligned: the op copies a view that is not)."""
    return k % 16 == 0 and (n * _OUT_BYTES[out_dtype]) % 16 == 0


def swapped_decode_config(spec: GemmFp8Spec) -> Fp8Config:
    """The swapped tile of a call of at most :data:`SWAP_M` rows: ``16 x 64 x 256`` (the
    product ``b_tile[64, 256] @ a_tile[16, 256]^T``), four stages (80 KB) and two CTAs an SM,
    K not split (each split was slower on the GPU, see the module's notes); 128-deep steps
    (a scale block) and eight stages for block scales."""
    block = spec.scaling is Scaling.BLOCK
    bk, stages = (BLOCK, 8) if block else (256, 4)
    return Fp8Config(16, 64, bk, stages, 128, 0, swap=True, split=1, resident=2)


def takes_swapped_decode(spec: GemmFp8Spec) -> bool:
    """Whether :func:`choose_fp8_config` gives ``spec`` the swapped tile: at most
    :data:`SWAP_M` rows, rows TMA can copy, and whole tiles (``N`` a multiple of 64, ``K`` of
    the K step), where :data:`SWAPPED_DECODE` is on."""
    if not (SWAPPED_DECODE and spec.m <= SWAP_M
            and fp8_tma_aligned(spec.n, spec.k, spec.out_dtype)):
        return False
    cfg = swapped_decode_config(spec)
    return spec.n % cfg.block_n == 0 and spec.k % cfg.block_k == 0


def choose_fp8_config(spec: GemmFp8Spec) -> Fp8Config:
    """The tile configuration of a call: at decode sizes the 64 x 64 tiles (``b`` streamed by
    ``N / 64`` CTAs); above, the candidate of least ``waves x tile area x cost`` (the dense
    GEMM's model, :data:`_WEIGHED`; a float32 ``c`` leaves out 128 x 256, whose staged output
    would not fit), so a short call (M = 128 against N = 4096) takes tiles that fill the SMs.
    Plain copies where a row breaks TMA's alignment."""
    block = spec.scaling is Scaling.BLOCK
    aligned = fp8_tma_aligned(spec.n, spec.k, spec.out_dtype)
    if takes_swapped_decode(spec):
        return swapped_decode_config(spec)
    if spec.m <= DECODE_M:
        cfg = FP8_CONFIGS["block-decode" if block else "decode"]
    else:
        best = None
        for name, eff in _WEIGHED["block" if block else "scaled"]:
            c = FP8_CONFIGS[name]
            if spec.out_dtype == "float32" and c.block_m * c.block_n > 128 * 128:
                continue
            tiles = -(-spec.m // c.block_m) * -(-spec.n // c.block_n)
            cost = -(-tiles // _SMS) * c.block_m * c.block_n * eff
            if best is None or cost < best[0]:
                best = (cost, c)
        assert best is not None
        cfg = best[1]
    if not aligned:
        cfg = cfg._replace(tma=False)
    return cfg


def _policy(T, cfg: Fp8Config):
    return T.GemmWarpPolicy.FullRow if cfg.policy == "row" else T.GemmWarpPolicy.Square


def fp8_gemm_program(n: int, k: int, a_dtype: str, b_dtype: str, out_dtype: str,
                     scaling: Scaling, has_bias: bool, cfg: Fp8Config, sms: int = _SMS):
    """The prim_func ``(A, B, SA, SB, BIAS, C)`` (``BIAS`` ``[n]``, unread without a bias;
    ``SA``, ``SB`` ``[1]`` per tensor, ``[M, 1]`` / ``[n, 1]`` per row, ``[M, ceil(k / 128)]`` /
    ``[ceil(n / 128), ceil(k / 128)]`` in blocks), ``M`` dynamic."""
    block = scaling is Scaling.BLOCK
    if cfg.promote and (block or cfg.persistent):
        raise ValueError(f"promote is for one-CTA-a-tile programs of per-tensor and row-wise "
                         f"scales (block scales always promote), got {scaling.value} scales "
                         f"and {cfg.label()}")
    if block and (cfg.block_k != BLOCK or BLOCK % cfg.block_n):
        raise ValueError(f"block scales need 128-deep K tiles and block_n dividing 128, got "
                         f"{cfg.label()}")
    if cfg.swap:
        if cfg.persistent or cfg.promote or cfg.block_n % 64 or not 8 <= cfg.block_m <= 64 \
                or cfg.block_m % 8 or cfg.split < 1 or cfg.resident < 1:
            raise ValueError(f"a swapped tile is block_n rows of b (a multiple of 64) by "
                             f"block_m rows of a (8 to 64, a multiple of 8), one CTA a tile "
                             f"and split, unpromoted, got {cfg.label()}")
        return _swapped_program(n, k, a_dtype, b_dtype, out_dtype, scaling, has_bias, cfg)
    if cfg.split > 1 or cfg.resident > 1:
        raise ValueError(f"split and resident are the swapped tile's, got {cfg.label()}")
    if cfg.persistent:
        if block or not cfg.tma:
            raise ValueError(f"a persistent grid serves per-tensor and row-wise scales through "
                             f"TMA, got {scaling.value} scales and {cfg.label()}")
        return _persistent_program(n, k, a_dtype, b_dtype, out_dtype, scaling, has_bias, cfg,
                                   sms)
    _, T = tl()
    M = T.dynamic("M")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    stages, threads, panel = cfg.stages, cfg.threads, cfg.panel
    ann = None if cfg.tma else {"disable_tma": True}
    kb = -(-k // BLOCK)
    policy = _policy(T, cfg)
    sa_shape, sb_shape = {Scaling.TENSOR: ((1,), (1,)), Scaling.ROW: ((M, 1), (n, 1)),
                          Scaling.BLOCK: ((M, kb), (-(-n // BLOCK), kb))}[scaling]
    iters = -(-k // bk)
    f32 = "float32"

    @T.prim_func
    def gemm_fp8(
        A: T.Tensor((M, k), a_dtype),
        B: T.Tensor((n, k), b_dtype),
        SA: T.Tensor(sa_shape, f32),
        SB: T.Tensor(sb_shape, f32),
        BIAS: T.Tensor((n,), out_dtype),
        C: T.Tensor((M, n), out_dtype),
    ):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(M, bm), threads=threads) as (bx, by):
            A_s = T.alloc_shared((bm, bk), a_dtype)
            B_s = T.alloc_shared((bn, bk), b_dtype)
            C_l = T.alloc_fragment((bm, bn), f32)
            if scaling is Scaling.ROW or has_bias:
                col_s = T.alloc_shared((bn,), f32)  # b's factor (or the bias) of each column
            if panel:
                T.use_swizzle(panel_size=panel)
            if block or cfg.promote:
                acc = T.alloc_fragment((bm, bn), f32)
                if block:
                    step_l = T.alloc_fragment((bm,), f32)  # the step's factor of each row
                T.clear(acc)
                for ko in T.Pipelined(iters, num_stages=stages):
                    T.copy(A[by * bm, ko * bk], A_s, annotations=ann)
                    T.copy(B[bx * bn, ko * bk], B_s, annotations=ann)
                    # read by the math threads (registers, issued before the wgmma): staged in
                    # shared memory, the scales would be a producer's copy, and a producer
                    # warpgroup as wide as the math ones halves the registers of each
                    if block:
                        for i in T.Parallel(bm):
                            step_l[i] = T.if_then_else(
                                by * bm + i < M,
                                SA[by * bm + i, ko] * SB[(bx * bn) // BLOCK, ko], T.float32(0))
                    T.gemm(A_s, B_s, C_l, transpose_B=True, clear_accum=True, policy=policy)
                    if block:
                        for i, j in T.Parallel(bm, bn):
                            acc[i, j] += C_l[i, j] * step_l[i]
                    else:
                        for i, j in T.Parallel(bm, bn):
                            acc[i, j] += C_l[i, j]
                for i, j in T.Parallel(bm, bn):
                    C_l[i, j] = acc[i, j]
            else:
                T.clear(C_l)
                for ko in T.Pipelined(iters, num_stages=stages):
                    T.copy(A[by * bm, ko * bk], A_s, annotations=ann)
                    T.copy(B[bx * bn, ko * bk], B_s, annotations=ann)
                    T.gemm(A_s, B_s, C_l, transpose_B=True, policy=policy)
            if not block:
                if scaling is Scaling.ROW:
                    row_s = T.alloc_shared((bm,), f32)  # a's factor of each row of the tile
                    for i in T.Parallel(bm):
                        row_s[i] = T.if_then_else(by * bm + i < M, SA[by * bm + i, 0],
                                                  T.float32(0))
                    for j in T.Parallel(bn):
                        col_s[j] = T.if_then_else(bx * bn + j < n, SB[bx * bn + j, 0],
                                                  T.float32(0))
                    for i, j in T.Parallel(bm, bn):
                        C_l[i, j] = C_l[i, j] * row_s[i] * col_s[j]
                else:
                    for i, j in T.Parallel(bm, bn):
                        C_l[i, j] = C_l[i, j] * (SA[0] * SB[0])
            if has_bias:
                for j in T.Parallel(bn):
                    col_s[j] = T.if_then_else(bx * bn + j < n, T.Cast(f32, BIAS[bx * bn + j]),
                                              T.float32(0))
                for i, j in T.Parallel(bm, bn):
                    C_l[i, j] = C_l[i, j] + col_s[j]
            C_s = T.alloc_shared((bm, bn), out_dtype)
            T.copy(C_l, C_s)
            T.copy(C_s, C[by * bm, bx * bn], annotations=ann)

    return gemm_fp8


def _swapped_program(n: int, k: int, a_dtype: str, b_dtype: str, out_dtype: str,
                     scaling: Scaling, has_bias: bool, cfg: Fp8Config):
    """:func:`fp8_gemm_program` for a few rows of ``a`` (decode): the tile ``c[bm, bn]`` is
    computed as its transpose ``b_tile @ a_tile^T`` (wgmma ``64 x bm``: ``b``'s rows fill
    wgmma's 64-row side, ``a``'s few rows its narrow side), so the shared tiles and the
    product hold no padding rows and a stage is ``bn x bk`` bytes of ``b`` and ``bm x bk`` of
    ``a`` (the 64-row tile's ``a`` stage was as large as its ``b`` one at 16 rows, three
    quarters of it TMA's zero fill). The decode call streams ``b`` once; what it is bound by
    is the bytes in flight on each SM, so the program is sized for ``cfg.resident`` CTAs an
    SM: TileLang's load warpgroup keeps its registers (no setmaxnreg, which would give the
    math warpgroup 240 a thread and the SM one CTA) and ptxas caps them for ``resident``.

    ``cfg.split`` CTAs share a tile's K steps (grid ``(n / bn, M / bm, split)``, CTA ``z``
    taking steps ``z * its .. z * its + its - 1``; steps past K load zeros, TMA's or the
    predicated copy's fill). Split, the last operand is the float32 workspace ``W[split, M,
    n]`` of each CTA's unscaled partial (block scales: its promoted, scaled one) and the
    scales, bias and rounding are :func:`fp8_reduce_program`'s; unsplit, they are applied here
    and the tile is transposed through shared memory into ``C``."""
    _, T = tl()
    M = T.dynamic("M")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    stages, threads, split, resident = cfg.stages, cfg.threads, cfg.split, cfg.resident
    ann = None if cfg.tma else {"disable_tma": True}
    block = scaling is Scaling.BLOCK
    row = scaling is Scaling.ROW
    kb = -(-k // BLOCK)
    sa_shape, sb_shape = {Scaling.TENSOR: ((1,), (1,)), Scaling.ROW: ((M, 1), (n, 1)),
                          Scaling.BLOCK: ((M, kb), (-(-n // BLOCK), kb))}[scaling]
    steps = -(-k // bk)
    its = -(-steps // split)  # K steps of each CTA
    f32 = "float32"
    c_shape, c_dtype = ((split, M, n), f32) if split > 1 else ((M, n), out_dtype)

    @T.prim_func
    def gemm_fp8_swapped(
        A: T.Tensor((M, k), a_dtype),
        B: T.Tensor((n, k), b_dtype),
        SA: T.Tensor(sa_shape, f32),
        SB: T.Tensor(sb_shape, f32),
        BIAS: T.Tensor((n,), out_dtype),
        C: T.Tensor(c_shape, c_dtype),
    ):
        with T.Kernel(T.ceildiv(n, bn), T.ceildiv(M, bm), split, threads=threads) as (
                bx, by, bz):
            T.disable_warp_group_reg_alloc()
            if resident > 1:
                T.annotate_min_blocks_per_sm(resident)
            A_s = T.alloc_shared((bm, bk), a_dtype)
            B_s = T.alloc_shared((bn, bk), b_dtype)
            C_t = T.alloc_fragment((bn, bm), f32)  # the tile transposed: [column, row]
            if block:
                acc = T.alloc_fragment((bn, bm), f32)
                step_l = T.alloc_fragment((bm,), f32)  # the step's factor of each row of c
                T.clear(acc)
                for ko in T.Pipelined(its, num_stages=stages):
                    kt = bz * its + ko
                    T.copy(A[by * bm, kt * bk], A_s, annotations=ann)
                    T.copy(B[bx * bn, kt * bk], B_s, annotations=ann)
                    for j in T.Parallel(bm):
                        step_l[j] = T.if_then_else(
                            T.And(by * bm + j < M, kt < kb),
                            SA[by * bm + j, kt] * SB[(bx * bn) // BLOCK, kt], T.float32(0))
                    T.gemm(B_s, A_s, C_t, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(bn, bm):
                        acc[i, j] += C_t[i, j] * step_l[j]
                for i, j in T.Parallel(bn, bm):
                    C_t[i, j] = acc[i, j]
            else:
                T.clear(C_t)
                for ko in T.Pipelined(its, num_stages=stages):
                    kt = bz * its + ko
                    T.copy(A[by * bm, kt * bk], A_s, annotations=ann)
                    T.copy(B[bx * bn, kt * bk], B_s, annotations=ann)
                    T.gemm(B_s, A_s, C_t, transpose_B=True)
            if split > 1:  # the partial, from registers (rows past M and columns past n dropped)
                for i, j in T.Parallel(bn, bm):
                    if T.And(by * bm + j < M, bx * bn + i < n):
                        C[bz, by * bm + j, bx * bn + i] = C_t[i, j]
            else:
                C_s = T.alloc_shared((bm, bn), out_dtype)
                for i, j in T.Parallel(bn, bm):
                    v = C_t[i, j]
                    if row:
                        v = v * T.if_then_else(T.And(by * bm + j < M, bx * bn + i < n),
                                               SA[by * bm + j, 0] * SB[bx * bn + i, 0],
                                               T.float32(0))
                    elif not block:
                        v = v * (SA[0] * SB[0])
                    if has_bias:
                        v = v + T.if_then_else(bx * bn + i < n,
                                               T.Cast(f32, BIAS[bx * bn + i]), T.float32(0))
                    C_s[j, i] = T.Cast(out_dtype, v)
                T.copy(C_s, C[by * bm, bx * bn], annotations=ann)

    return gemm_fp8_swapped


#: the split reduction's tile (rows, columns) and threads: a thread's four columns in a row
_REDUCE_TILE = (4, 256, 256)


def fp8_reduce_program(n: int, k: int, out_dtype: str, scaling: Scaling, has_bias: bool,
                       split: int):
    """The second program of a split call (:func:`_swapped_program`): ``C[m, j] = (sum_s
    W[s, m, j]) * a_scale[m] * b_scale[j] + bias[j]`` (per tensor: the two scalars; block
    scales: no factor, the partials are scaled), summed in float32 in split order and rounded
    once; the prim_func ``(W, SA, SB, BIAS, C)``, ``M`` dynamic."""
    _, T = tl()
    M = T.dynamic("M")
    rm, rn, threads = _REDUCE_TILE
    kb = -(-k // BLOCK)
    sa_shape, sb_shape = {Scaling.TENSOR: ((1,), (1,)), Scaling.ROW: ((M, 1), (n, 1)),
                          Scaling.BLOCK: ((M, kb), (-(-n // BLOCK), kb))}[scaling]
    f32 = "float32"
    row = scaling is Scaling.ROW

    @T.prim_func
    def main(
        W: T.Tensor((split, M, n), f32),
        SA: T.Tensor(sa_shape, f32),
        SB: T.Tensor(sb_shape, f32),
        BIAS: T.Tensor((n,), out_dtype),
        C: T.Tensor((M, n), out_dtype),
    ):
        with T.Kernel(T.ceildiv(n, rn), T.ceildiv(M, rm), threads=threads) as (bx, by):
            acc = T.alloc_fragment((rm, rn), f32)
            for i, j in T.Parallel(rm, rn):
                acc[i, j] = T.if_then_else(T.And(by * rm + i < M, bx * rn + j < n),
                                           W[0, by * rm + i, bx * rn + j], T.float32(0))
            for s in T.unroll(1, split):
                for i, j in T.Parallel(rm, rn):
                    acc[i, j] += T.if_then_else(T.And(by * rm + i < M, bx * rn + j < n),
                                                W[s, by * rm + i, bx * rn + j], T.float32(0))
            for i, j in T.Parallel(rm, rn):
                if T.And(by * rm + i < M, bx * rn + j < n):
                    v = acc[i, j]
                    if row:
                        v = v * (SA[by * rm + i, 0] * SB[bx * rn + j, 0])
                    elif scaling is Scaling.TENSOR:
                        v = v * (SA[0] * SB[0])
                    if has_bias:
                        v = v + T.Cast(f32, BIAS[bx * rn + j])
                    C[by * rm + i, bx * rn + j] = T.Cast(out_dtype, v)

    return main


def _persistent_program(n: int, k: int, a_dtype: str, b_dtype: str, out_dtype: str,
                        scaling: Scaling, has_bias: bool, cfg: Fp8Config, sms: int):
    """:func:`fp8_gemm_program` on a persistent grid (the dense GEMM's
    ``_persistent_program``, with the fp8 epilogue): ``sms`` CTAs, CTA ``w`` computing the tiles
    ``w, w + sms, ...`` of the swizzled order; one warp issues every tile's TMA loads into the
    ``stages``-deep ring while the math warpgroups run wgmma, scale (and bias) each finished
    tile in registers and store it, so a tile's loads overlap the previous tile's epilogue.
    The scales are read from global memory by the math threads (each its rows' and columns'),
    not staged: a staged copy would be a load role's, outside the tile's math."""
    _, T = tl()
    M = T.dynamic("M")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    stages, threads, panel = cfg.stages, cfg.threads, max(cfg.panel, 1)
    iters = -(-k // bk)
    n_tiles = -(-n // bn)
    sa_shape, sb_shape = ((1,), (1,)) if scaling is Scaling.TENSOR else ((M, 1), (n, 1))
    row = scaling is Scaling.ROW
    f32 = "float32"
    ws = T.WSID
    policy = _policy(T, cfg)
    math_warps = threads // 32
    load = [T.WSSync.producer_acquire("ring", stage=0), "load_a", "load_b",
            T.WSSync.producer_commit("ring", stage=0)]
    mma = [T.WSSync.consumer_wait("ring", stage=stages - 1), "mma",
           T.WSSync.consumer_release("ring", stage=stages - 1)]

    @T.prim_func
    def gemm_fp8_persistent(
        A: T.Tensor((M, k), a_dtype),
        B: T.Tensor((n, k), b_dtype),
        SA: T.Tensor(sa_shape, f32),
        SB: T.Tensor(sb_shape, f32),
        BIAS: T.Tensor((n,), out_dtype),
        C: T.Tensor((M, n), out_dtype),
    ):
        with T.Kernel(sms, threads=threads) as wid:
            A_s = T.alloc_shared((bm, bk), a_dtype)
            B_s = T.alloc_shared((bn, bk), b_dtype)
            C_l = T.alloc_fragment((bm, bn), f32)
            C_s = T.alloc_shared((bm, bn), out_dtype)
            m_tiles = T.ceildiv(M, bm)
            order = T.PersistentTileScheduler(m_tiles, n_tiles, sms, swizzle_size=panel,
                                              column_major=False, stateful=False)
            T.annotate_ws_schedule(T.WSSchedule(
                num_warps=4 + math_warps,
                roles=[T.WSRole("load", warps_lo=0, warps_hi=1, max_nreg=_LOAD_NREG),
                       T.WSRole("math", warps_lo=4, warps_hi=4 + math_warps,
                                max_nreg=_MATH_NREG)],
                pipelines=[T.WSPipeline("ring", [A_s, B_s], depth=stages)],
                scopes=[
                    T.WSScope("k_steps", {"load": load, "math": mma}),
                    T.WSScope("tiles", {
                        "load": ["coord", "k_steps"],
                        "math": ["coord", "clear", "k_steps", "scale", "to_shared", "store"],
                    }),
                    T.WSScope(T.WSScope.ROOT, {"load": ["tiles"], "math": ["tiles"]}),
                ]))
            for i in T.serial(T.ceildiv(m_tiles * n_tiles - wid, sms), annotations={ws: "tiles"}):
                with T.ws_op("coord"):
                    by, bx = order.coord(i * sms + wid)
                T.clear(C_l, annotations={ws: "clear"})
                for ko in T.Pipelined(iters, num_stages=stages, annotations={ws: "k_steps"}):
                    T.copy(A[by * bm, ko * bk], A_s, annotations={ws: "load_a"})
                    T.copy(B[bx * bn, ko * bk], B_s, annotations={ws: "load_b"})
                    T.gemm(A_s, B_s, C_l, transpose_B=True, policy=policy,
                           annotations={ws: "mma"})
                with T.ws_op("scale"):
                    for r, j in T.Parallel(bm, bn):
                        if row:
                            C_l[r, j] = C_l[r, j] * T.if_then_else(
                                T.And(by * bm + r < M, bx * bn + j < n),
                                SA[by * bm + r, 0] * SB[bx * bn + j, 0], T.float32(0))
                        else:
                            C_l[r, j] = C_l[r, j] * (SA[0] * SB[0])
                        if has_bias:
                            C_l[r, j] = C_l[r, j] + T.if_then_else(
                                bx * bn + j < n, T.Cast(f32, BIAS[bx * bn + j]), T.float32(0))
                T.copy(C_l, C_s, annotations={ws: "to_shared"})
                T.copy(C_s, C[by * bm, bx * bn], annotations={ws: "store"})

    return gemm_fp8_persistent


@stored(maxsize=128)
def build_fp8_gemm_kernel(n: int, k: int, a_dtype: str, b_dtype: str, out_dtype: str,
                          scaling: Scaling, has_bias: bool, cfg: Fp8Config,
                          target: str | None = None, sms: int = _SMS):
    """Compile :func:`fp8_gemm_program` (cached per process; TileLang also caches on disk);
    ``sms``: the persistent grid's CTAs (the device's SMs; only a persistent program reads
    it)."""
    return compile_program(fp8_gemm_program(n, k, a_dtype, b_dtype, out_dtype, scaling,
                                            has_bias, cfg, sms if cfg.persistent else _SMS),
                           target)


@stored(maxsize=32)
def build_fp8_reduce_kernel(n: int, k: int, out_dtype: str, scaling: Scaling, has_bias: bool,
                            split: int, target: str | None = None):
    """Compile :func:`fp8_reduce_program` (cached per process and on disk, as the others)."""
    return compile_program(fp8_reduce_program(n, k, out_dtype, scaling, has_bias, split), target)


class Fp8SplitLaunch:
    """A split call (``cfg.split > 1``): the main program writes its float32 partial sums into
    a workspace taken from torch's caching allocator on the call's stream (graph capture and
    several streams are safe), the reduction scales, biases and rounds them into ``c``; called
    as the unsplit program is, ``(a, b, a_scale, b_scale, bias, c)``."""

    def __init__(self, main, reduce, split: int, n: int) -> None:
        self.main, self.reduce, self.split, self.n = main, reduce, split, n

    def __call__(self, a, b, a_scale, b_scale, bias, c) -> None:
        import torch

        work = torch.empty((self.split, c.shape[0], self.n), dtype=torch.float32,
                           device=c.device)
        self.main(a, b, a_scale, b_scale, bias, work)
        self.reduce(work, a_scale, b_scale, bias, c)


def fp8_gemm_launch(n: int, k: int, a_dtype: str, b_dtype: str, out_dtype: str,
                    scaling: Scaling, has_bias: bool, cfg: Fp8Config,
                    target: str | None = None, sms: int = _SMS):
    """What a call of ``cfg`` runs, called ``(a, b, a_scale, b_scale, bias, c)``: the compiled
    program, or for a split its :class:`Fp8SplitLaunch` of two."""
    main = build_fp8_gemm_kernel(n, k, a_dtype, b_dtype, out_dtype, scaling, has_bias, cfg,
                                 target, sms)
    if cfg.split == 1:
        return main
    return Fp8SplitLaunch(main, build_fp8_reduce_kernel(n, k, out_dtype, scaling, has_bias,
                                                        cfg.split, target), cfg.split, n)


class _Fp8GemmKernel(Kernel, GemmFp8Interface):
    devices = ("cuda",)
    supported_archs = frozenset({(9, 0)})  # wgmma's fp8 forms

    @classmethod
    def identity(cls, spec: GemmFp8Spec) -> Any:
        # the program depends on M only through the decode / prefill tiles
        return (spec.device, spec.n, spec.k, spec.a_dtype, spec.b_dtype, spec.out_dtype,
                spec.scaling, spec.has_bias, choose_fp8_config(spec))

    def __init__(self, spec: GemmFp8Spec) -> None:
        super().__init__(spec)
        self.config = choose_fp8_config(spec)
        self.program = None if spec.n == 0 or spec.k == 0 else fp8_gemm_launch(
            spec.n, spec.k, spec.a_dtype, spec.b_dtype, spec.out_dtype, spec.scaling,
            spec.has_bias, self.config, None, sm_count(spec.device))

    def __call__(self, a, b, a_scale, b_scale, bias, c) -> None:
        if c.numel() == 0:
            return
        if self.program is None:  # K = 0: the empty sum, plus the bias
            c.zero_()
            if bias is not None:
                c.add_(bias)
            return
        if self.spec.scaling is Scaling.TENSOR:
            a_scale, b_scale = a_scale.view(1), b_scale.view(1)
        # an absent bias is never read: c's first row stands in for the argument
        self.program(a, b, a_scale, b_scale, c[0] if bias is None else bias, c)


class GemmFp8ScaledKernel(_Fp8GemmKernel):
    """Per-tensor and row-wise scales: the plain fp8 GEMM, scales and bias in the epilogue."""

    @classmethod
    def region_refusal(cls, spec: GemmFp8Spec) -> str | None:
        if spec.scaling is Scaling.BLOCK:
            return "serves per-tensor and row-wise scales (block scales change along K)"
        return None


class GemmFp8BlockKernel(_Fp8GemmKernel):
    """Block scales: each 128-deep K step's partial promoted into a scaled accumulator."""

    @classmethod
    def region_refusal(cls, spec: GemmFp8Spec) -> str | None:
        if spec.scaling is not Scaling.BLOCK:
            return "serves block scales (1 x 128 groups of a, 128 x 128 blocks of b)"
        return None
