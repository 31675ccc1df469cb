"""Grouped GEMM in TileLang: a GEMM per expert over the rows an M-grouped layout gives it.

``c[rows of e] = a[rows of e] @ op(b[e])`` with ``b`` stored ``(E, K, N)``, or ``(E, N, K)``
when ``trans_b`` (nn.Linear's layout, and torch._grouped_mm's ``mat_b.transpose(-2, -1)``).
Two layouts (the ``MGroupedLayout`` ADT of the ops' types.yaml):

- contiguous: ``a`` is ``(M, K)``, expert ``e`` owns rows ``offsets[e]:offsets[e + 1]``
  (offsets clamped into ``[0, M]`` and made non-decreasing, so no metadata can send a tile out
  of bounds); rows past ``offsets[E]`` are zero in ``c``.
- masked: ``a`` is ``(E, max_m, K)``, expert ``e`` owns its block's first ``counts[e]`` rows
  (clamped into ``[0, max_m]``); the rest of the block is zero in ``c``.

Both programs run the dense GEMM's tile (shared tiles, ``T.gemm`` lowering to wgmma on sm_90,
fp32 accumulation) over the slots of a tile schedule that reads the metadata on the device:
one row slot a tile of each expert's rows, ``ceil(M / block_m) + min(E, M)`` for contiguous
(each segment, and the zero rows after the last one, rounds up to one partial tile at most,
and at most ``min(E, M)`` segments hold a row: DeepSeek-V3's 8 routed rows of one token take
9 row slots, not 258; a slot past the tiles of every expert and of the tail does nothing),
``E * ceil(max_m / block_m)`` for masked. A contiguous slot finds its expert by walking the
``E + 1`` offsets (a prefix of tile counts) up to it, so a call never synchronises with the
host and a CUDA graph replays it whatever the routing. Tiles overhang their expert's rows: the
loads read the next expert's rows (or zeros past ``M``), and the store writes only the
expert's own.

Two programs serve the slot, a field of :class:`GroupedGemmConfig` (:class:`GroupedProgram`):

- ``PIPELINED`` (:func:`grouped_gemm_program`, where the other does not hold): one CTA a slot
  of the grid above, the predicated copies of TileLang's grouped GEMM example in a plain
  ``T.Pipelined`` loop (warp specialization off: the slot's expert is known only after the
  scheduler's loop), sm_80 to sm_90, any alignment.
- ``WARP_SPECIALIZED`` (:func:`grouped_gemm_ws_program`, sm_90, 16-byte rows, contiguous; the
  default where it holds, :func:`choose_config`): the dense GEMM's persistent schedule
  (:func:`tileops.kernels.gemm._persistent_program`) over the same slots: one CTA an SM
  walking slots ``w, w + sms, ...`` of (row slot, column tile) in panels of :data:`PANEL` row
  slots taken column by column (the dense GEMM's swizzle), a load warp issuing TMA loads of
  ``a``'s and ``b[e]``'s tiles into a ring of shared stages, the math warpgroups (their
  registers raised by setmaxnreg) running wgmma and storing each tile. Every role walks the
  offsets itself: a cursor kept at the first row slot of the CTA's panel only moves forward
  (a CTA's panels never go back), and a copy of it walks on to the slot's row (the few
  experts of one panel), so a CTA reads the ``E + 1`` offsets about once in all, not once a
  tile.

A tile stays inside its segment because of what is stored, not of what is loaded. TMA clips a
box at the tensor's bounds, not the segment's: a tile's load of ``bm`` rows from its first row
reads the next expert's rows (zeros past ``M``, or past the masked block's ``max_m``, where the
box is clipped) into accumulator rows that are never stored. The store writes only the rows
``[start, end)`` of the tile's expert. Every tile goes from the fragment into shared memory;
a TMA store writes it when the box, clipped at the tensor's bounds, holds nothing else (a tile
whose rows all lie in its segment, or end at ``M`` / ``max_m``, or whose rows are all zero
rows), else the math threads copy it out a column a thread, each row and column predicated
(the last, partial tile of a segment; every tile when ``N`` breaks TMA's 16-byte rows of
``c``). :func:`contiguous_schedule` and
:func:`masked_schedule` evaluate the program's formulas on ints (the tests check them).
"""

# (no `from __future__ import annotations`: TileLang evaluates prim_func annotations)

import enum
from typing import Any, Literal, NamedTuple, get_args

from tileops.runtime import CallSpec, Kernel, KernelInterface, device_arch, log
from tileops.spec import DTYPES as _ITEMSIZE  # dtype name -> bytes

from ._store import stored
from ._tilelang import compile_program, tl
from .gemm import _LOAD_NREG, _MATH_NREG, _time_ms, sm_count

__all__ = [
    "GroupedGemmConfig",
    "GroupedGemmDType",
    "GroupedGemmInterface",
    "GroupedGemmKernel",
    "GroupedGemmSpec",
    "GroupedLayoutKind",
    "GroupedProgram",
    "SchedTile",
    "build_grouped_gemm",
    "choose_config",
    "contiguous_schedule",
    "contiguous_slots",
    "grouped_gemm_program",
    "grouped_gemm_ws_program",
    "masked_schedule",
    "panel_slot",
    "ws_refusal",
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


class GroupedProgram(enum.Enum):
    """Which program a configuration builds (the module docstring has both)."""

    PIPELINED = "pipelined"
    WARP_SPECIALIZED = "warp_specialized"


class GroupedGemmConfig(NamedTuple):
    """A tile: rows, columns, K depth, pipeline stages, math threads (the warp-specialized
    program adds a load warpgroup of 128), and the program."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    threads: int
    program: GroupedProgram = GroupedProgram.PIPELINED


#: 128-row tiles where the experts' rows fill them (two warpgroups of wgmma), 64-row tiles for
#: few rows an expert (decode: one warpgroup, half the rows wasted at most)
_WIDE = GroupedGemmConfig(128, 128, 64, 3, 256)
_NARROW = GroupedGemmConfig(64, 128, 64, 4, 128)
#: 64-column tiles where even a CTA a routed row and column tile would leave SMs idle (a
#: decode step's few experts over a short N: one token of Mixtral-8x7B's down projection, 2
#: experts x 32 column tiles of 128 = 64 CTAs, read its weights at 2.8 TB/s, 82.8 us against
#: a 54.6 us floor, where its up projection's 448 CTAs reached 93% of theirs)
_THIN = GroupedGemmConfig(64, 64, 64, 4, 128)
#: the warp-specialized program's tiles: the dense GEMM's persistent 128x256 and 64x128 ones
#: (HOPPER_CONFIGS in kernels/gemm.py, at cuBLAS on the H200's large shapes); shared memory of
#: the wide one: 3 stages of 48 KiB and the 64 KiB output tile
_WS_WIDE = GroupedGemmConfig(128, 256, 64, 3, 256, GroupedProgram.WARP_SPECIALIZED)
_WS_NARROW = GroupedGemmConfig(64, 128, 64, 4, 128, GroupedProgram.WARP_SPECIALIZED)


def ws_refusal(spec: GroupedGemmSpec, arch: tuple[int, int] | None) -> str | None:
    """Why the warp-specialized program cannot serve ``spec`` on a device of compute
    capability ``arch`` (None: it can): it is written for sm_90 (TMA, wgmma, setmaxnreg), for
    the contiguous layout (its masked form is refused, see below), and
    loads every operand through TMA, whose rows must be multiples of 16 bytes (base pointers
    are: the op copies a view that is not). ``c`` may have any N: its tiles are then copied
    out of shared memory by the math threads instead of a TMA store."""
    per = 16 // _ITEMSIZE[spec.dtype]
    if arch != (9, 0):
        return "runs on sm_90 (TMA loads, wgmma, setmaxnreg)"
    if spec.per_row:
        return "serves offsets or masked metadata"
    if spec.layout is GroupedLayoutKind.MASKED:
        # the H200 stopped the masked form with an illegal instruction (the contiguous form
        # matched float64 in the same run): refused until it is found and fixed
        return ("serves the contiguous layout only (its masked form stopped with an illegal "
                "instruction on the H200)")
    if spec.k % per:
        return f"needs K a multiple of {per} (TMA loads 16-byte rows of a and b)"
    if not spec.trans_b and spec.n % per:
        return (f"needs N a multiple of {per} with b stored (E, K, N) (TMA loads 16-byte rows "
                f"of b)")
    return None


#: routed rows up to which the kernel's choice is the pipelined program (a decode step of one
#: or two tokens: DeepSeek-V3 routes 8 rows a token, Mixtral-8x7B 2; 64 tokens route 512 / 128)
_FEW_ROWS = 16


def choose_config(spec: GroupedGemmSpec, program: GroupedProgram | None = None,
                  arch: tuple[int, int] | None = None) -> GroupedGemmConfig:
    """128-row tiles when an expert averages at least 128 rows, else 64-row ones (the
    pipelined program's 64 columns wide where even a CTA a routed row and 128-column tile
    would leave SMs idle: :data:`_THIN`), of ``program``; the warp-specialized program only
    where its preconditions hold on ``arch`` (:func:`ws_refusal`), else the pipelined one.

    ``program`` None (the kernel's choice): the warp-specialized program wherever it holds,
    else the pipelined one. On the H200, beside torch._grouped_mm on the bar's shapes (E64 x
    512 rows x K4096 -> N2048 even and uneven, Mixtral-8x7B's up and down projections at 8192
    tokens, DeepSeek-V3's up projection), the warp-specialized program ran at 0.86-1.10x of
    it (583-726 TFLOP/s) and the pipelined one at 0.57-0.82x (405-517): results/
    grouped_gemm_sweep-cuda0.json. Its persistent grid also walks the offsets about once a CTA,
    where each of the pipelined grid's CTAs scans them (DeepSeek-V3's 256 experts at 64 tokens:
    some 14,500 CTAs, each walking up to 256 offsets). Except for a handful of rows (at most
    :data:`_FEW_ROWS`: a decode step of a token or two), where the pipelined grid of a CTA a
    row slot and column tile puts more CTAs on reading the experts' weights than the
    persistent one's 132: the fused layer at one token, Mixtral-8x7B 223.0 us pipelined
    against 272.1 warp-specialized, DeepSeek-V3 229.9 against 299.0; at 64 tokens the
    warp-specialized program is the faster, 692.6 against 712.2 and 517.2 against 979.6
    (gpu_session_2026-12-04g.md). ``GroupedGemmFwdOp(tune=True)`` still times both on the
    first call and keeps the faster (:meth:`GroupedGemmKernel.request_tune`)."""
    rows = spec.max_m if spec.layout is GroupedLayoutKind.MASKED else spec.m // max(spec.e, 1)
    wide = rows >= 128
    if program is None:
        few = spec.layout is GroupedLayoutKind.CONTIGUOUS and spec.m <= _FEW_ROWS
        program = GroupedProgram.PIPELINED if few else GroupedProgram.WARP_SPECIALIZED
    if program is GroupedProgram.WARP_SPECIALIZED and ws_refusal(spec, arch) is None:
        return _WS_WIDE if wide else _WS_NARROW
    if wide:
        return _WIDE
    if (spec.layout is GroupedLayoutKind.CONTIGUOUS
            and min(spec.e, spec.m) * _ceil(spec.n, _NARROW.block_n) < _SMS):
        return _THIN
    return _NARROW


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


class _Operands(NamedTuple):
    """What both programs derive from the operands' geometry: ``b`` and its tile, the K steps
    and column tiles, the layout (``per`` row tiles a masked block, 0 contiguous), ``M`` (a
    launch-time size contiguous, ``max_m`` masked), the shapes of ``a``, ``c`` and the
    metadata, and the row slots (``ceil(M / bm) + min(E, M)`` contiguous, ``E * per``
    masked)."""

    b_shape: tuple
    b_tile: tuple
    iters: int
    n_tiles: int
    masked: bool
    per: int
    m: Any
    a_shape: tuple
    c_shape: tuple
    meta_len: int
    rows: Any


def _operands(T, e: int, n: int, k: int, trans_b: bool, layout: GroupedLayoutKind,
              max_m: int, bm: int, bn: int, bk: int) -> _Operands:
    masked = layout is GroupedLayoutKind.MASKED
    b_shape = (e, n, k) if trans_b else (e, k, n)
    b_tile = (bn, bk) if trans_b else (bk, bn)
    if masked:
        per = _ceil(max_m, bm)  # tiles of a block
        return _Operands(b_shape, b_tile, _ceil(k, bk), _ceil(n, bn), True, per, max_m,
                         (e, max_m, k), (e, max_m, n), e, e * per)
    m = T.dynamic("M")  # a launch-time size: one program serves every row count
    return _Operands(b_shape, b_tile, _ceil(k, bk), _ceil(n, bn), False, 0, m, (m, k), (m, n),
                     e + 1, T.max(T.ceildiv(m, bm) + T.min(m, e), 1))


def _walk(T, e: int, m, bm: int):
    """The cursor's walk, a TileLang macro both programs run (:func:`contiguous_schedule`
    runs it on ints): ``walk(meta, g, lo, hi, cnt, before, target)`` moves the cursor (expert
    ``g`` owns rows ``[lo, hi)``, its ``cnt`` row tiles start at row slot ``before``) forward
    to the expert whose tiles hold row slot ``target``, or past the last expert (``g == e``:
    the zero rows)."""

    @T.macro
    def walk(meta, g, lo, hi, cnt, before, target):
        while g[0] < e and target >= before[0] + cnt[0]:
            before[0] = before[0] + cnt[0]
            lo[0] = hi[0]
            g[0] = g[0] + 1
            if g[0] < e:
                hi[0] = segment_end(meta[g[0] + 1], lo[0], m, T.max, T.min)
                cnt[0] = row_tiles(lo[0], hi[0], bm)

    return walk


def grouped_gemm_program(e: int, n: int, k: int, dtype: str, trans_b: bool,
                         layout: GroupedLayoutKind, max_m: int, cfg: GroupedGemmConfig):
    """The TileLang prim_func (not compiled): the rows ``M`` of a contiguous ``a`` dynamic,
    everything else static (see the module docstring)."""
    _, T = tl()
    bm, bn, bk, stages, threads, _ = cfg
    accum = "float32"
    (b_shape, b_tile, iters, n_tiles, masked, per, m, a_shape, c_shape, meta_len,
     m_slots) = _operands(T, e, n, k, trans_b, layout, max_m, bm, bn, bk)
    # TMA needs 16-byte rows: a's and b's rows of K (b's of N when not trans_b)
    per_vec = 16 // _ITEMSIZE[dtype]
    ann = None if k % per_vec == 0 and (trans_b or n % per_vec == 0) else {"disable_tma": True}
    walk = _walk(T, e, m, bm)

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
                # the cursor from the first slot walked on to row slot `by` (the
                # warp-specialized program's walk): it stops at the slot's expert, so a CTA
                # reads the offsets up to its own, not all E of them
                g = T.alloc_local((1,), "int32")
                lo = T.alloc_local((1,), "int32")
                hi = T.alloc_local((1,), "int32")
                cnt = T.alloc_local((1,), "int32")
                before = T.alloc_local((1,), "int32")
                g[0] = 0
                lo[0] = 0
                before[0] = 0
                hi[0] = segment_end(Meta[1], 0, m, T.max, T.min)
                cnt[0] = row_tiles(0, hi[0], bm)
                walk(Meta, g, lo, hi, cnt, before, by)
                start[0] = tile_start(by, lo[0], before[0], bm)
                if g[0] < e:
                    ex[0] = g[0]
                    stop[0] = hi[0]
                    end[0] = T.min(start[0] + bm, hi[0])
                else:  # the rows after the last segment: zeros (ex stays -1)
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


# --- the warp-specialized program and its tile schedule ----------------------------------------
#
# The formulas below are the program's: it calls them on TIR expressions (``mx``/``mn`` are
# ``T.max``/``T.min``, ``either`` is ``T.Or``), :func:`contiguous_schedule` and
# :func:`masked_schedule` on ints.


def segment_end(offset, lo, m, mx=max, mn=min):
    """The end of an expert's rows: its offset clamped into ``[lo, m]`` (``lo`` the previous
    expert's end), so no metadata sends a tile outside ``a`` or backwards."""
    return mn(mx(offset, lo), m)


def row_tiles(lo, hi, bm: int):
    """Row tiles of ``bm`` rows covering ``[lo, hi)`` (``hi >= lo``)."""
    return (hi - lo + bm - 1) // bm


def tile_start(row, lo, before, bm: int):
    """The first row of row slot ``row`` in the segment from ``lo`` whose first tile is slot
    ``before`` (or in the zero rows from ``lo``, past every segment)."""
    return lo + (row - before) * bm


#: row slots of a panel: the slots walk every column tile of ``PANEL`` row slots before the
#: next ones (the dense GEMM's swizzle panel), so the CTAs of a wave share a few row tiles of
#: ``a`` and a band of ``b[e]``'s column tiles in L2 even where N has a hundred column tiles
PANEL = 8


def panel_slot(slot, rows, n_tiles: int, panel: int = PANEL, mn=min):
    """``(row slot, column tile, first row slot of the panel)`` of ``slot`` among ``rows *
    n_tiles``: panels of ``panel`` row slots (the last one shorter), walked column by column.
    A CTA's slots increase, so its panels never go back (its rows may, inside a panel)."""
    first = slot // (panel * n_tiles) * panel
    height = mn(panel, rows - first)
    rest = slot - first * n_tiles
    return first + rest % height, rest // height, first


def masked_rows(count, max_m: int, mx=max, mn=min):
    """A masked block's rows: its count clamped into ``[0, max_m]``."""
    return mn(mx(count, 0), max_m)


def whole_box(start, stop, end, bound, bm: int, masked: bool, either=lambda x, y: x or y):
    """Whether the store may write the tile's box whole (a TMA store, clipped at the tensor's
    bounds: ``M``, or the block's ``max_m``). Contiguous: the rows ``[start, end)`` end at the
    box's end or at ``M``, so the clipped box holds only them (a segment's rows, or zero rows).
    Masked: the box ends at the block or is clipped there, and its rows are all computed
    (``stop >= end``) or all zero (``stop <= start``, nothing computed: the cleared tile)."""
    if masked:
        return either(stop >= end, stop <= start)
    return either(end == start + bm, end == bound)


class SchedTile(NamedTuple):
    """One slot of the schedule as the program sees it: the expert (-1: the zero rows after
    every segment), the first row, the end of the computed rows (``stop``: rows ``[start,
    stop)`` come from the GEMM, ``[stop, end)`` are zeros), the end of the rows the store
    writes, the first column, and whether the box is stored whole (:func:`whole_box`)."""

    cta: int
    expert: int
    start: int
    stop: int
    end: int
    col: int
    whole: bool


def contiguous_slots(m: int, e: int, bm: int) -> int:
    """The contiguous program's row slots: ``ceil(m / bm) + min(e, m)`` (at least one: no grid
    is empty). The segments that hold a row (at most ``min(e, m)``) and the zero rows after the
    last one are ``P <= min(e, m) + 1`` pieces of the ``m`` rows, whose tiles number at most
    ``ceil(m / bm) + P - 1``; a row of each piece reaches it."""
    return max(1, _ceil(m, bm) + min(e, m))


def contiguous_schedule(offsets: list[int], m: int, n: int, bm: int, bn: int,
                        sms: int) -> list[SchedTile]:
    """The contiguous program's slots evaluated on ints, CTA by CTA, each CTA's cursor moving
    as the program's does (forward to the panel's first row slot, then a walk from there to the
    slot's row); slots that write nothing (past ``M``) are left out. ``offsets`` are the ``E +
    1`` metadata values (the first is not read: the segments start at 0)."""
    e = len(offsets) - 1
    n_tiles = _ceil(n, bn)
    rows = contiguous_slots(m, e, bm)

    def walk(cur, target):  # (g, lo, hi, cnt, before) moved on to the expert of row `target`
        g, lo, hi, cnt, before = cur
        while g < e and target >= before + cnt:
            before, lo, g = before + cnt, hi, g + 1
            if g < e:
                hi = segment_end(offsets[g + 1], lo, m)
                cnt = row_tiles(lo, hi, bm)
        return g, lo, hi, cnt, before

    out = []
    for wid in range(sms):
        hi = segment_end(offsets[1], 0, m)
        cursor = (0, 0, hi, row_tiles(0, hi, bm), 0)
        for i in range(_ceil(rows * n_tiles - wid, sms)):
            row, ct, first = panel_slot(i * sms + wid, rows, n_tiles)
            cursor = walk(cursor, first)
            g, lo, hi, _, before = walk(cursor, row)
            start = tile_start(row, lo, before, bm)
            if g < e:
                ex, stop, end = g, hi, min(start + bm, hi)
            else:
                ex, stop, end = -1, start, min(start + bm, m)
            if start < end:
                out.append(SchedTile(wid, ex, start, stop, end, ct * bn,
                                     whole_box(start, stop, end, m, bm, False)))
    return out


def masked_schedule(counts: list[int], max_m: int, n: int, bm: int, bn: int,
                    sms: int) -> list[SchedTile]:
    """The masked program's slots evaluated on ints (every slot writes its tile's rows of the
    block: computed ones, then zeros)."""
    e, per, n_tiles = len(counts), _ceil(max_m, bm), _ceil(n, bn)
    out = []
    for wid in range(sms):
        for i in range(_ceil(e * per * n_tiles - wid, sms)):
            row, ct, _ = panel_slot(i * sms + wid, e * per, n_tiles)
            col = ct * bn
            ex, start = row // per, row % per * bm
            stop, end = masked_rows(counts[ex], max_m), min(start + bm, max_m)
            out.append(SchedTile(wid, ex, start, stop, end, col,
                                 whole_box(start, stop, end, max_m, bm, True)))
    return out


#: SMs of an H100 / H200: the persistent grid a program is compiled for off the device
_SMS = 132


def grouped_gemm_ws_program(e: int, n: int, k: int, dtype: str, trans_b: bool,
                            layout: GroupedLayoutKind, max_m: int, cfg: GroupedGemmConfig,
                            sms: int = _SMS):
    """The warp-specialized TileLang prim_func (not compiled), same operands as
    :func:`grouped_gemm_program`: ``sms`` CTAs, CTA ``w`` walking the slots ``w, w + sms, ...``
    of ``(row slot, column tile)`` in :func:`panel_slot`'s order (the row slots of the pipelined
    grid: ``ceil(M / bm) + min(E, M)`` contiguous, ``E * ceil(max_m / bm)`` masked).

    Roles (``T.WSSchedule``, as the dense persistent program): warp 0 loads, the math
    warpgroups compute and store; both run ``coord`` (the cursor over the offsets, in each
    role's own registers: the same values, so every branch is taken alike by both), and the
    K loop of a slot runs only where the slot has rows to compute (a guard on the scope: the
    ring's phases are counted at run time). A slot's store: ``to_shared`` (the fragment into
    ``C_s``), then a TMA ``store`` where :func:`whole_box` holds and ``c``'s rows are 16-byte
    ones, else ``store_rows``: ``C_s`` copied out a column a thread (coalesced rows), each row
    and column predicated."""
    _, T = tl()
    bm, bn, bk, stages, threads, _ = cfg
    accum = "float32"
    ws = T.WSID
    (b_shape, b_tile, iters, n_tiles, masked, per, m, a_shape, c_shape, meta_len,
     rows) = _operands(T, e, n, k, trans_b, layout, max_m, bm, bn, bk)
    tma_store = n % (16 // _ITEMSIZE[dtype]) == 0  # c's rows of N
    load = [T.WSSync.producer_acquire("ring", stage=0), "load_a", "load_b",
            T.WSSync.producer_commit("ring", stage=0)]
    mma = [T.WSSync.consumer_wait("ring", stage=stages - 1), "mma",
           T.WSSync.consumer_release("ring", stage=stages - 1)]
    store = ["to_shared", "store", "store_rows"] if tma_store else ["to_shared", "store_rows"]
    root = ["tiles"] if masked else ["init", "tiles"]

    walk = _walk(T, e, m, bm)

    @T.prim_func
    def main(
        A: T.Tensor(a_shape, dtype),
        B: T.Tensor(b_shape, dtype),
        Meta: T.Tensor((meta_len,), "int32"),
        C: T.Tensor(c_shape, dtype),
    ):
        with T.Kernel(sms, threads=threads) as wid:
            A_s = T.alloc_shared((bm, bk), dtype)
            B_s = T.alloc_shared(b_tile, dtype)
            C_l = T.alloc_fragment((bm, bn), accum)
            C_s = T.alloc_shared((bm, bn), dtype)
            # the slot (SchedTile): expert, rows [start, stop) computed, [stop, end) zeros,
            # first column, stored whole
            ex = T.alloc_local((1,), "int32")
            start = T.alloc_local((1,), "int32")
            stop = T.alloc_local((1,), "int32")
            end = T.alloc_local((1,), "int32")
            col = T.alloc_local((1,), "int32")
            whole = T.alloc_local((1,), "int32")
            row_s = T.alloc_local((1,), "int32")  # the slot's row slot
            # the cursor: expert g owns rows [lo, hi), its cnt row tiles start at slot before;
            # kept at the panel's first row slot, and its copy (the *_t) walked on to the row
            g = T.alloc_local((1,), "int32")
            lo = T.alloc_local((1,), "int32")
            hi = T.alloc_local((1,), "int32")
            cnt = T.alloc_local((1,), "int32")
            before = T.alloc_local((1,), "int32")
            g_t = T.alloc_local((1,), "int32")
            lo_t = T.alloc_local((1,), "int32")
            hi_t = T.alloc_local((1,), "int32")
            cnt_t = T.alloc_local((1,), "int32")
            before_t = T.alloc_local((1,), "int32")
            T.annotate_ws_schedule(T.WSSchedule(
                num_warps=4 + threads // 32,
                roles=[T.WSRole("load", warps_lo=0, warps_hi=1, max_nreg=_LOAD_NREG),
                       T.WSRole("math", warps_lo=4, warps_hi=4 + threads // 32,
                                max_nreg=_MATH_NREG)],
                pipelines=[T.WSPipeline("ring", [A_s, B_s], depth=stages)],
                scopes=[
                    T.WSScope("k_steps", {"load": load, "math": mma}),
                    T.WSScope("tiles", {"load": ["coord", "k_steps"],
                                        "math": ["coord", "clear", "k_steps", *store]}),
                    T.WSScope(T.WSScope.ROOT, {"load": root, "math": root}),
                ]))
            if not masked:
                with T.ws_op("init"):
                    g[0] = 0
                    lo[0] = 0
                    before[0] = 0
                    hi[0] = segment_end(Meta[1], 0, m, T.max, T.min)
                    cnt[0] = row_tiles(0, hi[0], bm)
            for i in T.serial(T.ceildiv(rows * n_tiles - wid, sms), annotations={ws: "tiles"}):
                with T.ws_op("coord"):
                    row, ct, first = panel_slot(i * sms + wid, rows, n_tiles, PANEL, T.min)
                    row_s[0] = row  # evaluated once (the walk's test reads it each step)
                    col[0] = ct * bn
                    if masked:
                        ex[0] = row_s[0] // per
                        start[0] = row_s[0] % per * bm
                        stop[0] = masked_rows(Meta[ex[0]], max_m, T.max, T.min)
                        end[0] = T.min(start[0] + bm, max_m)
                    else:
                        walk(Meta, g, lo, hi, cnt, before, first)
                        g_t[0] = g[0]
                        lo_t[0] = lo[0]
                        hi_t[0] = hi[0]
                        cnt_t[0] = cnt[0]
                        before_t[0] = before[0]
                        walk(Meta, g_t, lo_t, hi_t, cnt_t, before_t, row_s[0])
                        start[0] = tile_start(row_s[0], lo_t[0], before_t[0], bm)
                        if g_t[0] < e:
                            ex[0] = g_t[0]
                            stop[0] = hi_t[0]
                            end[0] = T.min(start[0] + bm, hi_t[0])
                        else:  # the zero rows after the last segment (no b is read)
                            ex[0] = 0
                            stop[0] = start[0]
                            end[0] = T.min(start[0] + bm, m)
                    whole[0] = T.if_then_else(
                        whole_box(start[0], stop[0], end[0], m, bm, masked, T.Or), 1, 0)
                T.clear(C_l, annotations={ws: "clear"})
                if start[0] < stop[0]:
                    for ko in T.Pipelined(iters, num_stages=stages, annotations={ws: "k_steps"}):
                        if masked:
                            T.copy(A[ex[0], start[0]:start[0] + bm, ko * bk:(ko + 1) * bk], A_s,
                                   annotations={ws: "load_a"})
                        else:
                            T.copy(A[start[0]:start[0] + bm, ko * bk:(ko + 1) * bk], A_s,
                                   annotations={ws: "load_a"})
                        if trans_b:
                            T.copy(B[ex[0], col[0]:col[0] + bn, ko * bk:(ko + 1) * bk], B_s,
                                   annotations={ws: "load_b"})
                        else:
                            T.copy(B[ex[0], ko * bk:(ko + 1) * bk, col[0]:col[0] + bn], B_s,
                                   annotations={ws: "load_b"})
                        T.gemm(A_s, B_s, C_l, transpose_B=trans_b, annotations={ws: "mma"})
                if start[0] < end[0]:
                    T.copy(C_l, C_s, annotations={ws: "to_shared"})
                if tma_store and start[0] < end[0] and whole[0] == 1:
                    if masked:
                        T.copy(C_s, C[ex[0], start[0]:start[0] + bm, col[0]:col[0] + bn],
                               annotations={ws: "store"})
                    else:
                        T.copy(C_s, C[start[0]:start[0] + bm, col[0]:col[0] + bn],
                               annotations={ws: "store"})
                if start[0] < end[0] and (not tma_store or whole[0] == 0):
                    with T.ws_op("store_rows"):
                        for r, j in T.Parallel(bm, bn):
                            if start[0] + r < end[0] and col[0] + j < n:
                                if masked:
                                    C[ex[0], start[0] + r, col[0] + j] = T.if_then_else(
                                        start[0] + r < stop[0], C_s[r, j], T.cast(0, dtype))
                                else:  # contiguous: end <= stop, or a zero tile (cleared)
                                    C[start[0] + r, col[0] + j] = C_s[r, j]

    return main


@stored(maxsize=64)
def build_grouped_gemm(e: int, n: int, k: int, dtype: str, trans_b: bool,
                       layout: GroupedLayoutKind, max_m: int, cfg: GroupedGemmConfig,
                       target: str | None = None, sms: int = _SMS):
    """Compile the program of ``cfg`` (cached per process; TileLang caches on disk); ``sms``
    is the persistent grid of the warp-specialized one (the others ignore it)."""
    if cfg.program is GroupedProgram.WARP_SPECIALIZED:
        prog = grouped_gemm_ws_program(e, n, k, dtype, trans_b, layout, max_m, cfg, sms)
    else:
        prog = grouped_gemm_program(e, n, k, dtype, trans_b, layout, max_m, cfg)
    return compile_program(prog, target)


class GroupedGemmKernel(Kernel, GroupedGemmInterface):
    """sm_80 to sm_90, offsets or masked metadata, any sizes (predicated copies): on sm_90
    with 16-byte rows and offsets, the module's warp-specialized program, elsewhere the
    pipelined one (:func:`choose_config`); tuning (``tune=True`` on the op) times both where
    both hold and keeps the faster."""

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
                spec.max_m, spec.m == 0, choose_config(spec, arch=device_arch(spec.device)))

    def __init__(self, spec: GroupedGemmSpec) -> None:
        super().__init__(spec)
        self.config = choose_config(spec, arch=device_arch(spec.device))
        rows = spec.max_m if spec.layout is GroupedLayoutKind.MASKED else spec.m
        self._empty = rows == 0 or spec.e == 0 or spec.n == 0
        self._zero_k = spec.k == 0
        self._tune_pending = False
        self.program = None
        if not (self._empty or self._zero_k):
            self.program = self._build(self.config)

    def _build(self, cfg: GroupedGemmConfig):
        s = self.spec
        sms = sm_count(s.device) if cfg.program is GroupedProgram.WARP_SPECIALIZED else _SMS
        return build_grouped_gemm(s.e, s.n, s.k, s.dtype, s.trans_b, s.layout, s.max_m, cfg,
                                  None, sms)

    def request_tune(self) -> None:
        """On the next call, time both programs on its tensors and keep the faster, where the
        warp-specialized one applies (:func:`ws_refusal`); an entry that launches nothing
        has nothing to tune."""
        self._tune_pending = (self.program is not None
                              and ws_refusal(self.spec, device_arch(self.spec.device)) is None)

    def _tune(self, a, b, metadata, c) -> None:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # timing needs its own graphs: tune on the first call outside capture
        self._tune_pending = False
        arch = device_arch(self.spec.device)
        best = None
        for program in GroupedProgram:
            cfg = choose_config(self.spec, program, arch)
            try:
                built = self.program if cfg == self.config else self._build(cfg)
                ms = _time_ms(lambda p=built: p(a, b, metadata, c))
            except Exception as exc:  # noqa: BLE001 - a candidate that fails is skipped
                log.info("GroupedGemmKernel: %s failed: %s: %s", program.value,
                         type(exc).__name__, str(exc)[-200:])
                continue
            log.info("GroupedGemmKernel: %s %s %.4f ms", program.value, cfg[:5], ms)
            if best is None or ms < best[0]:
                best = (ms, cfg, built)
        if best is not None:
            _, self.config, self.program = best

    def __call__(self, a, b, metadata, c) -> None:
        if self.program is None:
            if self._zero_k:
                c.zero_()
            return
        if self._tune_pending:
            self._tune(a, b, metadata, c)
        self.program(a, b, metadata, c)
