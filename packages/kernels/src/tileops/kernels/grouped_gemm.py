"""Grouped GEMM in TileLang: a GEMM per expert over the rows an M-grouped layout gives it.

``c[rows of e] = a[rows of e] @ op(b[e])`` with ``b`` stored ``(E, K, N)``, or ``(E, N, K)``
when ``trans_b`` (nn.Linear's layout, and torch._grouped_mm's ``mat_b.transpose(-2, -1)``).
Two layouts (the ``MGroupedLayout`` ADT of the ops' types.yaml):

- contiguous: ``a`` is ``(M, K)``, expert ``e`` owns rows ``offsets[e]:offsets[e + 1]``
  (offsets clamped into ``[0, M]`` and made non-decreasing, so no metadata can send a tile out
  of bounds); rows past ``offsets[E]`` are zero in ``c``.
- masked: ``a`` is ``(E, max_m, K)``, expert ``e`` owns its block's first ``counts[e]`` rows
  (clamped into ``[0, max_m]``); the rest of the block is zero in ``c``.

The program is the dense GEMM's pipelined tile (shared tiles, ``T.gemm`` lowering to wgmma on
sm_90, fp32 accumulation) under a tile scheduler that reads the metadata on the device: the
grid's row axis has one slot a tile of each expert's rows, ``ceil(M / block_m) + E + 1`` for
contiguous (each expert's segment rounds up to one partial tile at most, and one more slot
covers the zero rows after the last segment; a slot past the tiles of every expert and of the
tail exits), ``E * ceil(max_m / block_m)`` for masked. A CTA of the contiguous layout walks
the ``E + 1`` offsets once to find its expert (a prefix of tile counts), so a call never
synchronises with the host and a CUDA graph replays it whatever the routing. Tiles overhang
their expert's rows: the loads read the next expert's rows (or zeros past ``M``), and the
store writes only the expert's own.

Copies are the predicated cp.async copies of TileLang's grouped GEMM example (the row offset
of a tile is known only on the device, so the TMA descriptors of the dense Hopper kernel, which
the warp-specialized persistent schedule builds around, are not used; that kernel's schedule
over this grid is the next step for the H200 bar, see benchmarks/gpu_moe.sh).
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
import functools
from typing import Literal, NamedTuple, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

from ._tilelang import compile_program, tl

__all__ = [
    "GroupedGemmConfig",
    "GroupedGemmDType",
    "GroupedGemmInterface",
    "GroupedGemmKernel",
    "GroupedGemmSpec",
    "GroupedLayoutKind",
    "build_grouped_gemm",
    "choose_config",
    "grouped_gemm_program",
]

GroupedGemmDType = Literal["float16", "bfloat16"]
_DTYPES = frozenset(get_args(GroupedGemmDType))


class GroupedLayoutKind(enum.Enum):
    """How the kernel finds an expert's rows: segments from ``E + 1`` offsets, or the first
    ``counts[e]`` rows of a ``max_m`` block."""

    CONTIGUOUS = "contiguous"
    MASKED = "masked"


class GroupedGemmSpec(CallSpec, frozen=True, kw_only=True):
    """A grouped GEMM call: ``m`` rows of ``a`` (contiguous; masked: ``max_m`` a block),
    ``e`` experts, ``n`` output columns, ``k`` the reduction, the dtype, whether ``b`` is stored
    ``(E, N, K)``, the layout kind and ``max_m`` (0 for contiguous), and whether the metadata
    is an expert per row (``per_row``, which no kernel serves: the reference target does)."""

    m: int
    e: int
    n: int
    k: int
    dtype: GroupedGemmDType
    trans_b: bool
    layout: GroupedLayoutKind
    max_m: int = 0
    per_row: bool = False

    def __post_init__(self) -> None:
        self.check_fields(choices={"dtype": _DTYPES}, sizes=("m", "e", "n", "k", "max_m"),
                          flags=("trans_b", "per_row"))
        if not isinstance(self.layout, GroupedLayoutKind):
            raise TypeError(f"GroupedGemmSpec.layout must be a GroupedLayoutKind, got "
                            f"{self.layout!r}")
        if (self.layout is GroupedLayoutKind.MASKED) != (self.max_m > 0) and self.m:
            raise ValueError(f"GroupedGemmSpec.max_m is the masked block's rows (> 0) and 0 "
                             f"for contiguous, got {self.max_m} for {self.layout.value}")


class GroupedGemmInterface(KernelInterface):
    """One slot: ``forward(a, b, metadata, c)``, every tensor contiguous, ``c`` written whole
    (rows of no expert zero)."""

    slot = "grouped_gemm_fwd"
    call_spec = GroupedGemmSpec


class GroupedGemmConfig(NamedTuple):
    """A tile: rows, columns, K depth, pipeline stages, threads."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    threads: int


#: 128-row tiles where the experts' rows fill them (two warpgroups of wgmma), 64-row tiles for
#: few rows an expert (decode: one warpgroup, half the rows wasted at most)
_WIDE = GroupedGemmConfig(128, 128, 64, 3, 256)
_NARROW = GroupedGemmConfig(64, 128, 64, 4, 128)


def choose_config(spec: GroupedGemmSpec) -> GroupedGemmConfig:
    """128-row tiles when an expert averages at least 128 rows, else 64-row ones."""
    rows = spec.max_m if spec.layout is GroupedLayoutKind.MASKED else spec.m // max(spec.e, 1)
    return _WIDE if rows >= 128 else _NARROW


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def grouped_gemm_program(e: int, n: int, k: int, dtype: str, trans_b: bool,
                         layout: GroupedLayoutKind, max_m: int, cfg: GroupedGemmConfig):
    """The TileLang prim_func (not compiled): the rows ``M`` of a contiguous ``a`` dynamic,
    everything else static (see the module docstring)."""
    _, T = tl()
    bm, bn, bk, stages, threads = cfg
    accum = "float32"
    b_shape = (e, n, k) if trans_b else (e, k, n)
    b_tile = (bn, bk) if trans_b else (bk, bn)
    iters = _ceil(k, bk)
    n_tiles = _ceil(n, bn)
    masked = layout is GroupedLayoutKind.MASKED
    # TMA needs 16-byte rows: a's and b's rows of K (b's of N when not trans_b)
    per_vec = 16 // _ITEMSIZE[dtype]
    ann = None if k % per_vec == 0 and (trans_b or n % per_vec == 0) else {"disable_tma": True}
    if masked:
        per = _ceil(max_m, bm)  # tiles of a block
        a_shape, c_shape, meta_len, m_slots = (e, max_m, k), (e, max_m, n), e, e * per
    else:  # M is a launch-time size: one program serves every row count
        per = 0
        m = T.dynamic("M")
        a_shape, c_shape, meta_len, m_slots = (m, k), (m, n), e + 1, T.ceildiv(m, bm) + e + 1

    @T.prim_func
    def main(
        A: T.Tensor(a_shape, dtype),
        B: T.Tensor(b_shape, dtype),
        Meta: T.Tensor((meta_len,), "int32"),
        C: T.Tensor(c_shape, dtype),
    ):
        with T.Kernel(n_tiles, m_slots, threads=threads) as (bx, by):
            A_s = T.alloc_shared((bm, bk), dtype)
            B_s = T.alloc_shared(b_tile, dtype)
            C_l = T.alloc_fragment((bm, bn), accum)
            # this slot's expert, its first row, the end of its rows and the end of the rows
            # this tile writes (zeros from `stop` to `end`); expert -1: nothing to compute
            ex = T.alloc_local((1,), "int32")
            start = T.alloc_local((1,), "int32")
            stop = T.alloc_local((1,), "int32")
            end = T.alloc_local((1,), "int32")
            ex[0] = -1
            start[0] = 0
            stop[0] = 0
            end[0] = 0
            if masked:
                ex[0] = by // per
                start[0] = (by % per) * bm
                stop[0] = T.min(T.max(Meta[by // per], 0), max_m)
                end[0] = T.min(start[0] + bm, max_m)
            else:
                tiles = T.alloc_local((1,), "int32")  # tiles of the experts before e
                lo = T.alloc_local((1,), "int32")  # offsets clamped and non-decreasing
                tiles[0] = 0
                lo[0] = 0
                for g in T.serial(e):
                    hi = T.min(T.max(Meta[g + 1], lo[0]), m)
                    count = T.ceildiv(hi - lo[0], bm)
                    if by >= tiles[0] and by < tiles[0] + count:
                        ex[0] = g
                        start[0] = lo[0] + (by - tiles[0]) * bm
                        stop[0] = hi
                        end[0] = T.min(lo[0] + (by - tiles[0] + 1) * bm, hi)
                    tiles[0] = tiles[0] + count
                    lo[0] = hi
                if by >= tiles[0]:  # the rows after the last segment: zeros
                    start[0] = lo[0] + (by - tiles[0]) * bm
                    stop[0] = start[0]
                    end[0] = T.min(start[0] + bm, m)
            T.clear(C_l)
            if ex[0] >= 0 and start[0] < stop[0]:
                for ko in T.Pipelined(iters, num_stages=stages):
                    if masked:
                        T.copy(A[ex[0], start[0]:start[0] + bm, ko * bk:(ko + 1) * bk], A_s, annotations=ann)
                    else:
                        T.copy(A[start[0]:start[0] + bm, ko * bk:(ko + 1) * bk], A_s, annotations=ann)
                    if trans_b:
                        T.copy(B[ex[0], bx * bn:(bx + 1) * bn, ko * bk:(ko + 1) * bk], B_s, annotations=ann)
                    else:
                        T.copy(B[ex[0], ko * bk:(ko + 1) * bk, bx * bn:(bx + 1) * bn], B_s, annotations=ann)
                    T.gemm(A_s, B_s, C_l, transpose_B=trans_b)
            for i, j in T.Parallel(bm, bn):
                row = start[0] + i
                col = bx * bn + j
                if row < end[0] and col < n:
                    if masked:
                        C[ex[0], row, col] = T.if_then_else(row < stop[0], C_l[i, j],
                                                            T.cast(0, accum)).astype(dtype)
                    else:
                        C[row, col] = T.if_then_else(row < stop[0], C_l[i, j],
                                                     T.cast(0, accum)).astype(dtype)

    # the tile's expert is known only after the scheduler's loop: TileLang's automatic warp
    # specialization would split the CTA into load and math warps before it (hoisting the
    # test of the expert above the loop that finds it), so the pipeline is a plain one
    return main.with_attr("tilelang_pass_configs", {"tl.disable_warp_specialized": True})


@functools.lru_cache(maxsize=64)
def build_grouped_gemm(e: int, n: int, k: int, dtype: str, trans_b: bool,
                       layout: GroupedLayoutKind, max_m: int, cfg: GroupedGemmConfig,
                       target: str | None = None):
    """Compile :func:`grouped_gemm_program` (cached per process; TileLang caches on disk)."""
    return compile_program(grouped_gemm_program(e, n, k, dtype, trans_b, layout, max_m, cfg),
                           target)


class GroupedGemmKernel(Kernel, GroupedGemmInterface):
    """sm_80 to sm_90, offsets or masked metadata, any sizes (predicated copies): the
    module's program for the call's shape."""

    devices = ("cuda",)
    supported_archs = frozenset({(8, 0), (8, 6), (8, 9), (9, 0)})
    general = True

    @classmethod
    def region_refusal(cls, spec: GroupedGemmSpec) -> str | None:
        if spec.per_row:
            return ("serves offsets or masked metadata (an expert per row is served by the "
                    "reference target)")
        return None

    @classmethod
    def identity(cls, spec: GroupedGemmSpec):
        # a contiguous call's rows matter only through the tile the heuristic picks (and
        # whether there are any); the program reads M at launch
        return (spec.device, spec.e, spec.n, spec.k, spec.dtype, spec.trans_b, spec.layout,
                spec.max_m, spec.m == 0, choose_config(spec))

    def __init__(self, spec: GroupedGemmSpec) -> None:
        super().__init__(spec)
        self.config = choose_config(spec)
        rows = spec.max_m if spec.layout is GroupedLayoutKind.MASKED else spec.m
        self._empty = rows == 0 or spec.e == 0 or spec.n == 0
        self._zero_k = spec.k == 0
        self.program = None
        if not (self._empty or self._zero_k):
            self.program = build_grouped_gemm(spec.e, spec.n, spec.k, spec.dtype, spec.trans_b,
                                              spec.layout, spec.max_m, self.config)

    def __call__(self, a, b, metadata, c) -> None:
        if self.program is None:
            if self._zero_k:
                c.zero_()
            return
        self.program(a, b, metadata, c)
