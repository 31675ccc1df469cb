"""The mixture-of-experts kernels on a machine without a GPU: the launch facts each
implementation derives from a call (the tile, which calls share a built entry, the region) over
the input space, the warp-specialized grouped GEMM's tile schedule evaluated on ints (its
program's formulas) over routings, and one program for each code path lowering and compiling
for sm_90 (why it exists is on its line) with what its source must show."""

import re
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels import grouped_gemm as G
from tileops.kernels import moe as K

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")

CONTIGUOUS, MASKED = G.GroupedLayoutKind.CONTIGUOUS, G.GroupedLayoutKind.MASKED

sys.path.append(str(Path(__file__).parent))  # the ptxas guard, beside this file
from _ptxas import assert_asynchronous, ptxas_report  # noqa: E402


def _spec(**kw):
    base = dict(device="cpu", m=4096, e=8, n=256, k=512, dtype="bfloat16", trans_b=True,
                layout=CONTIGUOUS)
    return G.GroupedGemmSpec(**{**base, **kw})


# --- launch facts -----------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(m=st.integers(0, 1 << 17), e=st.integers(1, 512), max_m=st.integers(1, 1024),
       masked=st.booleans())
def test_the_tile_follows_the_rows_an_expert(m, e, max_m, masked) -> None:
    spec = _spec(m=m, e=e, layout=MASKED if masked else CONTIGUOUS,
                 max_m=max_m if masked else 0)
    cfg = G.choose_config(spec)
    rows = max_m if masked else m // e
    assert cfg.block_m == (128 if rows >= 128 else 64)
    assert cfg.threads == 2 * cfg.block_m  # a warpgroup a 64-row half
    # a contiguous call's rows matter only through the tile: one entry serves every M of it
    if not masked and m:
        same = G.GroupedGemmKernel.identity(_spec(m=(m // e) * e or 1, e=e))
        other = G.GroupedGemmKernel.identity(spec)
        assert (same == other) == (G.choose_config(_spec(m=(m // e) * e or 1, e=e)) == cfg)


def test_per_row_metadata_is_outside_the_kernel_region() -> None:
    refusal = G.GroupedGemmKernel.region_refusal(_spec(per_row=True))
    assert refusal == ("serves offsets or masked metadata (an expert per row is served by the "
                       "reference target)")
    assert G.GroupedGemmKernel.region_refusal(_spec()) is None


@pytest.mark.parametrize(("kw", "error", "text"), [
    (dict(dtype="float32"), ValueError,
     "GroupedGemmSpec.dtype must be one of bfloat16, float16, got 'float32'"),
    (dict(layout="masked"), TypeError,
     "GroupedGemmSpec.layout must be a GroupedLayoutKind, got 'masked'"),
    (dict(layout=MASKED), ValueError,
     "GroupedGemmSpec.max_m is the masked block's rows (> 0) and 0 for contiguous, got 0 for "
     "masked"),
    (dict(k=-1), ValueError, "GroupedGemmSpec.k must be a size (an int >= 0), got -1"),
])
def test_a_bad_grouped_gemm_spec_is_refused(kw, error, text) -> None:
    with pytest.raises(error) as info:
        _spec(**kw)
    assert str(info.value) == text


def test_a_gating_spec_checks_its_groups() -> None:
    with pytest.raises(ValueError) as info:
        K.MoeGatingSpec(device="cpu", e=10, top_k=2, dtype="bfloat16", scoring="softmax",
                        renormalize=True, num_groups=4, topk_groups=1, scale=1.0, bias=False)
    assert str(info.value) == "MoeGatingSpec.num_groups must divide e = 10, got 4"


@given(h=st.integers(1, 1 << 16), dtype=st.sampled_from(["bfloat16", "float16"]))
def test_rows_move_in_16_byte_vectors_where_they_divide(h, dtype) -> None:
    assert K.row_vector(h, dtype) == (8 if h % 8 == 0 else 1)


# --- the warp-specialized grouped GEMM's plan and schedule -------------------------------------

HOPPER = (9, 0)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 9000), k=st.integers(1, 9000), trans_b=st.booleans(),
       dtype=st.sampled_from(["bfloat16", "float16"]), masked=st.booleans(),
       arch=st.sampled_from([(9, 0), (8, 0), (8, 9), None]))
def test_the_warp_specialized_program_is_chosen_only_where_it_holds(n, k, trans_b, dtype, masked,
                                                                    arch) -> None:
    spec = _spec(n=n, k=k, trans_b=trans_b, dtype=dtype, layout=MASKED if masked else CONTIGUOUS,
                 max_m=96 if masked else 0)
    holds = arch == HOPPER and not masked and k % 8 == 0 and (trans_b or n % 8 == 0)
    assert (G.ws_refusal(spec, arch) is None) is holds
    ws = G.choose_config(spec, G.GroupedProgram.WARP_SPECIALIZED, arch)
    assert ws.program is (G.GroupedProgram.WARP_SPECIALIZED if holds
                          else G.GroupedProgram.PIPELINED)
    # the kernel's choice (no program named): the warp-specialized program wherever it holds
    assert G.choose_config(spec, arch=arch) == ws
    assert G.choose_config(spec, G.GroupedProgram.PIPELINED, arch).program \
        is G.GroupedProgram.PIPELINED
    assert G.choose_config(spec).program is G.GroupedProgram.PIPELINED  # no arch: none holds


@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 70000), e=st.integers(1, 300))
def test_a_handful_of_rows_takes_the_pipelined_program(m, e) -> None:
    """The kernel's choice on sm_90 with 16-byte rows: the pipelined program for a decode
    step's handful of routed rows (one token of DeepSeek-V3: 8 rows; two: 16), the
    warp-specialized one from 17 (64 tokens of Mixtral-8x7B: 128)."""
    spec = _spec(m=m, e=e, n=4096, k=7168)
    cfg = G.choose_config(spec, arch=HOPPER)
    assert (cfg.program is G.GroupedProgram.PIPELINED) is (m <= 16)
    assert cfg == G.choose_config(spec, cfg.program, HOPPER)  # the tile follows the rows
    masked = _spec(m=m, e=e, n=4096, k=7168, layout=MASKED, max_m=64)
    assert G.choose_config(masked, arch=HOPPER).program is G.GroupedProgram.PIPELINED


@settings(max_examples=120, deadline=None)
@given(m=st.integers(1, 4096), e=st.integers(1, 300), n=st.integers(1, 40000),
       arch=st.sampled_from([(9, 0), (8, 0), None]))
def test_the_pipelined_tile_narrows_where_its_ctas_would_leave_sms_idle(m, e, n, arch) -> None:
    """64-row tiles of 64 columns where a CTA a routed row and 128-column tile would be fewer
    than the 132 SMs (one token of Mixtral-8x7B's down projection: 2 x 32), else 128 columns;
    the masked layout and 128-row tiles keep theirs."""
    cfg = G.choose_config(_spec(m=m, e=e, n=n, k=4096), G.GroupedProgram.PIPELINED, arch)
    if m // e >= 128:
        assert cfg == G._WIDE
    else:
        thin = min(e, m) * -(-n // 128) < 132
        assert cfg == (G._THIN if thin else G._NARROW)
    masked = _spec(m=m, e=e, n=n, k=4096, layout=MASKED, max_m=64)
    assert G.choose_config(masked, G.GroupedProgram.PIPELINED, arch) == G._NARROW
    # one token of Mixtral-8x7B: the down projection thin, the up projection not
    down = _spec(m=2, e=8, n=4096, k=14336)
    up = _spec(m=2, e=8, n=28672, k=4096)
    assert G.choose_config(down, arch=HOPPER) == G._THIN
    assert G.choose_config(up, arch=HOPPER) == G._NARROW


@pytest.mark.parametrize(("kw", "arch", "text"), [
    (dict(), (8, 0), "runs on sm_90 (TMA loads, wgmma, setmaxnreg)"),
    (dict(per_row=True), HOPPER, "serves offsets or masked metadata"),
    (dict(layout=MASKED, max_m=96), HOPPER,
     "serves the contiguous layout only (its masked form stopped with an illegal instruction "
     "on the H200)"),
    (dict(k=4100), HOPPER, "needs K a multiple of 8 (TMA loads 16-byte rows of a and b)"),
    (dict(n=257, trans_b=False), HOPPER,
     "needs N a multiple of 8 with b stored (E, K, N) (TMA loads 16-byte rows of b)"),
])
def test_the_warp_specialized_program_says_why_not(kw, arch, text) -> None:
    assert G.ws_refusal(_spec(**kw), arch) == text


def test_odd_n_with_b_stored_n_by_k_is_the_warp_specialized_programs() -> None:
    # b's rows are of K; only c's rows break 16 bytes, and c is then stored row by row
    assert G.ws_refusal(_spec(n=257, trans_b=True), HOPPER) is None


def _segments(offsets, m):
    """The experts' rows by the metadata's contract (ends clamped into [previous end, M],
    the first segment from row 0): ``[(lo, hi)]`` and the first row after them."""
    out, lo = [], 0
    for off in offsets[1:]:
        hi = min(max(off, lo), m)
        out.append((lo, hi))
        lo = hi
    return out, lo


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_contiguous_schedule_covers_each_row_once_inside_its_segment(data) -> None:
    e = data.draw(st.one_of(st.integers(1, 12), st.integers(13, 300)), label="e")
    bm = data.draw(st.sampled_from([64, 128]), label="bm")
    bn = data.draw(st.sampled_from([128, 256]), label="bn")
    n = data.draw(st.integers(1, 700), label="n")
    # many experts mostly empty (a decode step's few routed rows over DeepSeek-V3's 256)
    loads = data.draw(st.lists(st.one_of(st.just(0), st.integers(0, 9 * bm // 2)
                                         if e <= 12 else st.integers(0, 2)), min_size=e,
                               max_size=e), label="loads")
    m = sum(loads) + data.draw(st.integers(0, 3 * bm), label="tail")
    offsets = [0]
    for c in loads:
        offsets.append(offsets[-1] + c)
    if data.draw(st.booleans(), label="corrupt"):  # out of range, decreasing: clamped
        offsets = data.draw(st.lists(st.integers(-bm, m + bm), min_size=e + 1, max_size=e + 1))
    sms = data.draw(st.integers(1, 9), label="sms")
    segs, tail = _segments(offsets, m)
    n_tiles = -(-n // bn)
    covered = {}
    for t in G.contiguous_schedule(offsets, m, n, bm, bn, sms):
        if t.expert >= 0:
            lo, hi = segs[t.expert]
            assert lo < hi  # an empty expert has no tile
            assert lo <= t.start < t.end <= hi and t.stop == hi  # inside its segment
            assert (t.start - lo) % bm == 0
        else:  # the zero rows after every segment: nothing computed
            lo, hi = tail, m
            assert tail <= t.start < t.end <= m and t.stop == t.start
        assert t.end - t.start <= bm
        # stored whole exactly when the box, clipped at M, holds only the tile's own rows
        assert t.whole == (min(t.start + bm, m) <= hi)
        for r in range(t.start, t.end):
            covered[r, t.col] = covered.get((r, t.col), 0) + 1
    assert covered == {(r, c * bn): 1 for r in range(m) for c in range(n_tiles)}


def _pipelined_rows(offsets: list[int], m: int, bm: int, rows: int) -> list[int]:
    """The rows the pipelined program's ``rows`` row slots write (its loop over the offsets,
    on ints), one entry a write; each tile's expert and bounds checked against the segments."""
    segs, _ = _segments(offsets, m)
    written = []
    for by in range(rows):
        ex, start, stop, end, tiles, lo = -1, 0, 0, 0, 0, 0
        for g, (_, hi) in enumerate(segs):
            count = -(-(hi - lo) // bm)
            if tiles <= by < tiles + count:
                ex, start, stop = g, lo + (by - tiles) * bm, hi
                end = min(lo + (by - tiles + 1) * bm, hi)
            tiles, lo = tiles + count, hi
        if by >= tiles:
            start = lo + (by - tiles) * bm
            stop, end = start, min(start + bm, m)
        assert ex < 0 or stop == segs[ex][1]
        written += range(start, end)
    return written


@settings(max_examples=80, deadline=None)
@given(e=st.integers(1, 300), m=st.integers(0, 40), bm=st.sampled_from([64, 128]),
       corrupt=st.booleans(), data=st.data())
def test_the_pipelined_grid_s_row_slots_hold_every_tile(e, m, bm, corrupt, data) -> None:
    """The pipelined program's slot search over the ``contiguous_slots`` row slots of its
    grid: every row written once, by the tile of its segment (or of the zero rows after the
    last), with few rows over many experts."""
    if corrupt:
        offsets = data.draw(st.lists(st.integers(-bm, m + bm), min_size=e + 1, max_size=e + 1))
    else:
        cuts = sorted(data.draw(st.lists(st.integers(0, m), min_size=e, max_size=e)))
        offsets = [0, *cuts]
    rows = G.contiguous_slots(m, e, bm)
    assert rows <= -(-m // bm) + e + 1  # never more than the old bound for any routing
    assert sorted(_pipelined_rows(offsets, m, bm, rows)) == list(range(m))


@pytest.mark.parametrize("bm", [64, 128])
@pytest.mark.parametrize("e", [1, 2, 7, 63, 64, 65, 200])
def test_the_row_slots_hold_the_most_pieces(e, bm) -> None:
    """The bound's worst case: every expert's segment and the zero rows after them one row
    each (``min(E, M) + 1`` pieces, a tile each), and the same with a tile and a row first;
    one slot fewer misses a row where the pieces fit in a tile (there the bound is exact)."""
    for lead in (0, bm):
        m = lead + e + 1
        offsets = [0, *(lead + g + 1 for g in range(e))]
        rows = G.contiguous_slots(m, e, bm)
        assert sorted(_pipelined_rows(offsets, m, bm, rows)) == list(range(m))
        if e + 1 <= bm:
            assert sorted(_pipelined_rows(offsets, m, bm, rows - 1)) != list(range(m))


@settings(max_examples=60, deadline=None)
@given(e=st.integers(1, 8), max_m=st.integers(1, 300), bm=st.sampled_from([64, 128]),
       n=st.integers(1, 600), sms=st.integers(1, 9), data=st.data())
def test_the_masked_schedule_covers_each_block_once(e, max_m, bm, n, sms, data) -> None:
    counts = data.draw(st.lists(st.integers(-3, max_m + 3), min_size=e, max_size=e))
    bn = 128
    covered = {}
    for t in G.masked_schedule(counts, max_m, n, bm, bn, sms):
        valid = min(max(counts[t.expert], 0), max_m)
        assert t.stop == valid and t.start % bm == 0
        assert t.end == min(t.start + bm, max_m)
        # whole: every row of the clipped box computed, or none (the cleared tile's zeros)
        assert t.whole == (valid >= t.end or valid <= t.start)
        for r in range(t.start, t.end):
            covered[t.expert, r, t.col] = covered.get((t.expert, r, t.col), 0) + 1
    assert covered == {(x, r, c * bn): 1 for x in range(e) for r in range(max_m)
                       for c in range(-(-n // bn))}


@given(rows=st.integers(1, 300), n_tiles=st.integers(1, 40), panel=st.integers(1, 9))
def test_panels_cover_every_slot_once_in_column_order(rows, n_tiles, panel) -> None:
    seen = [G.panel_slot(s, rows, n_tiles, panel) for s in range(rows * n_tiles)]
    assert sorted((r, c) for r, c, _ in seen) == [(r, c) for r in range(rows)
                                                  for c in range(n_tiles)]
    for (r, c, first), (r2, c2, first2) in zip(seen, seen[1:], strict=False):
        assert first <= r < first + panel and first <= first2  # panels never go back
        if first2 == first:  # inside a panel: down its rows, then the next column
            assert (c2, r2) > (c, r)


def test_each_cta_walks_its_panels_forward() -> None:
    # CTA w takes slots w, w + sms, ...: its panels never go back, so the cursor kept at a
    # panel's first row slot only moves on (the rows inside a panel are walked from it)
    offsets = [0, 300, 300, 377, 378, 507, 507, 571, 576]
    rows, n_tiles, sms = -(-600 // 64) + 9, 3, 5
    firsts = {w: [G.panel_slot(i * sms + w, rows, n_tiles)[2]
                  for i in range(-(-(rows * n_tiles - w) // sms))] for w in range(sms)}
    assert all(f == sorted(f) and f for f in firsts.values())
    tiles = G.contiguous_schedule(offsets, 600, 257, 64, 128, sms)
    assert {t.expert for t in tiles} == {0, 2, 3, 4, 6, 7, -1}  # 1 and 5 are empty


@pytest.mark.parametrize("faster", list(G.GroupedProgram))
def test_tuning_keeps_the_faster_program(monkeypatch, faster) -> None:
    """request_tune: the next call times both programs (stand-ins here) on its tensors, keeps
    the faster and runs it; sm_90 only, where the warp-specialized program holds."""
    ran = []

    def build(e, n, k, dtype, trans_b, layout, max_m, cfg, target=None, sms=132):
        return lambda a, b, meta, c: ran.append(cfg.program) or cfg.program

    monkeypatch.setattr(G, "build_grouped_gemm", build)
    monkeypatch.setattr(G, "_time_ms", lambda fn: 1.0 if fn() is faster else 2.0)
    monkeypatch.setattr(G, "device_arch", lambda device: HOPPER)
    kern = G.GroupedGemmKernel(_spec(m=32768, e=64, n=2048, k=4096))
    # the default on sm_90 until tuned
    assert kern.config.program is G.GroupedProgram.WARP_SPECIALIZED
    kern.request_tune()
    ran.clear()
    kern(None, None, None, None)
    assert kern.config.program is faster and ran[-1] is faster
    assert sorted(p.value for p in ran[:-1]) == ["pipelined", "warp_specialized"]
    ran.clear()
    kern(None, None, None, None)  # tuned once
    assert ran == [faster]


def test_tuning_off_hopper_times_nothing(monkeypatch) -> None:
    ran = []
    monkeypatch.setattr(G, "build_grouped_gemm",
                        lambda *args, **kw: lambda a, b, meta, c: ran.append("run"))
    monkeypatch.setattr(G, "_time_ms", lambda fn: pytest.fail("timed off sm_90"))
    monkeypatch.setattr(G, "device_arch", lambda device: (8, 0))
    kern = G.GroupedGemmKernel(_spec())
    kern.request_tune()
    kern(None, None, None, None)
    assert ran == ["run"] and kern.config.program is G.GroupedProgram.PIPELINED


# --- programs ---------------------------------------------------------------------------------


@needs_nvcc
@pytest.mark.parametrize(("e", "n", "k", "dtype", "trans_b", "layout", "max_m", "cfg"), [
    # the bar's shape: contiguous offsets walked by the scheduler, 128-row tiles, cp.async
    pytest.param(64, 2048, 4096, "bfloat16", True, CONTIGUOUS, 0, G._WIDE, id="contiguous-nt"),
    # masked blocks of an odd K (no 16-byte rows): 64-row tiles, b stored (E, K, N)
    pytest.param(8, 200, 7, "float16", False, MASKED, 96, G._NARROW, id="masked-nn-odd-k"),
    # a decode step's few CTAs: 64 x 64 tiles (one warpgroup's wgmma 64 columns wide)
    pytest.param(8, 4096, 14336, "bfloat16", True, CONTIGUOUS, 0, G._THIN, id="thin-decode"),
])
def test_grouped_gemm_compiles_for_sm90(e, n, k, dtype, trans_b, layout, max_m, cfg):
    src = G.build_grouped_gemm(e, n, k, dtype, trans_b, layout, max_m, cfg,
                               "sm_90").get_kernel_source()
    assert f"__launch_bounds__({cfg.threads}, 1)" in src
    assert "wgmma" in src  # T.gemm lowers to warpgroup MMA
    assert "tma_load" not in src  # the plain pipeline (the tile's rows are known late)
    if layout is CONTIGUOUS:
        # the cursor's walk of the offsets, stopping at the slot's expert
        assert f"if (!(((g[0] < {e}) && ((before[0] + cnt[0]) <= ((int)blockIdx.y))))) " \
            "{ break; }" in src
        assert "int M)" in src  # the rows are a launch-time size
    else:
        assert "min(max(Meta[" in src  # the block's count, clamped


@needs_nvcc
@pytest.mark.parametrize(("layout", "max_m", "program"), [
    (CONTIGUOUS, 0, G.GroupedProgram.WARP_SPECIALIZED),
    (MASKED, 512, G.GroupedProgram.PIPELINED),
], ids=["contiguous-ws", "masked-pipelined"])
def test_ptxas_keeps_the_served_products_asynchronous(layout, max_m, program, tmp_path):
    """The bar's grouped GEMM (64 experts of 512 rows, K 4096 -> N 2048), contiguous and
    masked, in the program the kernel serves on sm_90 (:func:`choose_config`): no wgmma
    serialized by ptxas, no wait of its own and no register spilled (``_ptxas``)."""
    e, n, k = 64, 2048, 4096
    spec = _spec(m=e * 512, e=e, n=n, k=k, layout=layout, max_m=max_m)
    cfg = G.choose_config(spec, arch=(9, 0))
    assert cfg.program is program and cfg.block_m == 128
    src = G.build_grouped_gemm(e, n, k, "bfloat16", True, layout, max_m, cfg, "sm_90a",
                               132).get_kernel_source()
    assert "wgmma" in src
    assert_asynchronous(ptxas_report(src, tmp_path, "grouped_gemm"))


def _ws_config(**kw):
    # the masked layout is refused to the op (ws_refusal) until its illegal instruction on the
    # H200 is found; its program is still built here from the same tile choice, so it stays
    # compiled for that work
    if kw.get("layout") is MASKED:
        kw = {**kw, "layout": CONTIGUOUS, "max_m": 0}
    cfg = G.choose_config(_spec(**kw), G.GroupedProgram.WARP_SPECIALIZED, HOPPER)
    assert cfg.program is G.GroupedProgram.WARP_SPECIALIZED
    return cfg


@needs_nvcc
@pytest.mark.parametrize(("e", "n", "k", "dtype", "trans_b", "layout", "max_m", "rows"), [
    # the bar's shape: 512 rows an expert, 128x256 tiles, two math warpgroups
    pytest.param(64, 2048, 4096, "bfloat16", True, CONTIGUOUS, 0, 32768, id="bar"),
    # an uneven routing of few rows an expert (256 experts, 8 rows on average): 64-row tiles,
    # one math warpgroup; b stored (E, K, N); the routing itself is read at launch
    pytest.param(256, 4096, 7168, "float16", False, CONTIGUOUS, 0, 2048, id="uneven-nn"),
    # DeepSeek-V3's masked blocks of 64 rows: 3-D boxes of a and c, clipped at the block
    pytest.param(256, 7168, 2048, "bfloat16", True, MASKED, 64, 256 * 64, id="masked"),
    # odd N and K off the K tile with b stored (E, N, K): c's rows are not 16-byte ones
    pytest.param(4, 257, 200, "bfloat16", True, CONTIGUOUS, 0, 300, id="odd-n"),
])
def test_warp_specialized_grouped_gemm_compiles_for_sm90a(e, n, k, dtype, trans_b, layout, max_m,
                                                          rows):
    cfg = _ws_config(m=rows, e=e, n=n, k=k, dtype=dtype, trans_b=trans_b, layout=layout,
                     max_m=max_m)
    src = G.build_grouped_gemm(e, n, k, dtype, trans_b, layout, max_m, cfg,
                               "sm_90a").get_kernel_source()
    assert f"__launch_bounds__({cfg.threads + 128}, 1)" in src  # a load warpgroup more
    assert "tma_load(A_desc" in src and "tma_load(B_desc" in src and "wgmma" in src
    # the split: warp 0 loads with its registers given up, the math warpgroups take them
    assert "if (((int)threadIdx.x) < 32) {" in src
    assert src.count("warpgroup_reg_dealloc<40>") == 2 and "warpgroup_reg_alloc<232>" in src
    assert ") / 132)" in src and "blockIdx.y" not in src  # persistent: 132 CTAs
    # whole boxes through TMA where c's rows are 16-byte ones; every tile row by row else
    assert ("tma_store(C_desc" in src) is (n % 8 == 0)
    if layout is CONTIGUOUS:
        assert "while (1)" in src and "min(max(Meta[1], 0), M)" in src  # the cursor
        assert "int M)" in src
    else:
        assert "Meta[ex[(int64_t)0]]" in src and "while (1)" not in src  # the block's count


def test_gating_takes_a_warp_a_token_from_32_experts_where_groups_are_whole_lanes():
    assert [K.gating_lanes(e, 1) for e in (2, 8, 31, 32, 60, 128, 256)] == [1] * 3 + [32] * 4
    # DeepSeek-V3's 256 in 8 groups (8 slots a lane, 4 lanes a group), DeepSeek-V2's 160 in 8
    # (5 slots, 4 lanes), 96 in 4 groups (3 slots, 8 lanes) or 8 (4 lanes), 192 in 8 (6 slots,
    # 4 lanes); groups off whole lanes take a thread a token: 64 in 64 groups of one (2 slots
    # a lane), 96 in 3 groups of 32 (3 slots a lane)
    assert K.gating_lanes(256, 8) == K.gating_lanes(160, 8) == 32
    assert K.gating_lanes(64, 64) == 1 and K.gating_lanes(96, 3) == 1
    assert K.gating_lanes(96, 4) == K.gating_lanes(96, 8) == K.gating_lanes(192, 8) == 32
    with pytest.raises(ValueError, match=r"build_gating: 64 experts in 64 groups take a thread "
                                         r"a token \(lanes 1\), not 32"):
        K.build_gating(64, 4, "float32", "sigmoid", True, 64, 8, 1.0, False, "sm_90", 32)


@needs_nvcc
def test_gating_compiles_for_sm90():
    # DeepSeek-V3's routing: sigmoid scores, a correction bias, 8 groups of 32, top-4 groups;
    # a thread a token holds the row in local memory
    src = K.build_gating(256, 8, "float32", "sigmoid", True, 8, 4, 2.5, True,
                         "sm_90", 1).get_kernel_source()
    assert "__launch_bounds__(128, 1)" in src and "__shfl" not in src
    assert "float choice[256]" in src and "int kept[8]" in src
    assert "Bias[" in src and "expf(" in src
    # the default, a warp a token: 8 slots a lane, the groups' two best merged over 4 lanes
    # (two shuffles each), the groups ranked from their first lanes, top-8 by 5-step
    # butterflies; sigmoid scores need no row max
    src = K.build_gating(256, 8, "float32", "sigmoid", True, 8, 4, 2.5, True,
                         "sm_90").get_kernel_source()
    assert "float choice[8]" in src and "float choice[256]" not in src
    assert "(h * 4), 32)" in src and re.search(r"for \(int (k\w*) = 0; \1 < 2; ", src)
    assert "acc[2], (1 << k" in src
    assert "__shfl_xor_sync" in src and "max(acc[0]" not in src
    # softmax over 60 (lanes 30 and 31 hold none): the row's max and sum over the warp
    src = K.build_gating(60, 4, "bfloat16", "softmax", True, 1, 1, 1.0, False,
                         "sm_90").get_kernel_source()
    assert "float score[2]" in src and "max(acc[0], __shfl_xor_sync" in src
    assert "(acc[1] + __shfl_xor_sync" in src


@needs_nvcc
@pytest.mark.parametrize(("e", "k", "dtype", "scoring", "renormalize", "scale"), [
    # Mixtral's: softmax over 8 (the row's max and exponential sum), renormalised top-2
    pytest.param(8, 2, "bfloat16", "softmax", True, 1.0, id="mixtral-softmax"),
    # DeepSeek-V3's: sigmoid over 256, renormalised top-8 scaled by 2.5
    pytest.param(256, 8, "float32", "sigmoid", True, 2.5, id="deepseek-sigmoid"),
])
def test_gating_gradient_compiles_for_sm90(e, k, dtype, scoring, renormalize, scale):
    src = K.build_gating_bwd(e, k, dtype, scoring, renormalize, scale,
                             "sm_90").get_kernel_source()
    assert "__launch_bounds__(128, 1)" in src
    # only the picks are held (no row of E in local memory); each column finds its picks
    assert f"float picked[{k}]" in src and f"float g[{k}]" in src and f"[{e}]" not in src
    assert "Ids[" in src and "expf(" in src
    assert ("max(acc[0]" in src) is (scoring == "softmax")  # only softmax reads the row's max
    # from 32 experts on a warp a token: a lane's columns l, l + 32, ...
    assert ("& 31)" in src) is (e >= 32)


@needs_nvcc
@pytest.mark.parametrize(("h", "dtype", "vector"), [
    pytest.param(7168, "bfloat16", True, id="16-byte-rows"),
    pytest.param(4097, "float16", False, id="odd-row-elementwise"),
])
def test_permutations_compile_for_sm90(h, dtype, vector):
    unperm = K.build_unpermute(h, 8, dtype, "sm_90").get_kernel_source()
    # a vector of the row a thread: 896 for 7168 in 16-byte vectors, 1024 (the most) for
    # 4097 elements one at a time
    assert f"__launch_bounds__({896 if vector else 1024}, 1)" in unperm
    assert [K.unpermute_threads(n, "bfloat16") for n in (8, 1024, 4096, 7168, 8200)] == [
        128, 128, 512, 896, 1024]
    assert ("uint4" in unperm) is vector
    assert "if (0 <= src)" in unperm  # a dropped pick contributes nothing
    if vector:  # the gather (its element-wise path is the unpermutation's) and the gates'
        perm = K.build_permute(h, dtype, "sm_90").get_kernel_source()
        assert "uint4" in perm and "Src[" in perm  # the gather reads each row's token
        # the gates' gradient: a warp a token, its sums reduced by shuffles
        grad = K.build_gate_grad(h, 8, dtype, "sm_90").get_kernel_source()
        assert "__launch_bounds__(32, 1)" in grad and "__shfl_down_sync" in grad
        assert "uint4" in grad


def test_a_grouping_spec_is_checked() -> None:
    from tileops.kernels.moe_group import MoeGroupSpec

    with pytest.raises(ValueError, match=r"MoeGroupSpec.max_m: a masked layout's block has "
                                         r"max_m >= 1 rows, and only a masked layout has one; "
                                         r"got max_m=0 for metadata 'masked'"):
        MoeGroupSpec(device=None, e=4, k=2, metadata="masked")
    with pytest.raises(ValueError, match=r"MoeGroupSpec.metadata must be one of masked, "
                                         r"offsets, per_row, got 'rows'"):
        MoeGroupSpec(device=None, e=4, k=2, metadata="rows")
    with pytest.raises(ValueError, match=r"MoeGroupSpec: e, k and alignment must be at least "
                                         r"1, got e=0, k=2, alignment=1"):
        MoeGroupSpec(device=None, e=0, k=2, metadata="offsets")


@needs_nvcc
@pytest.mark.parametrize(("metadata", "max_m", "alignment"), [
    ("offsets", 0, 1), ("offsets", 0, 128), ("per_row", 0, 128), ("masked", 64, 1)])
def test_grouping_programs_compile_for_sm90(metadata, max_m, alignment):
    """The grouping's programs lower and compile for every layout: no atomics (the order
    within an expert is the tokens'), the count's, the scan's and the one-launch program's
    CTAs exchanging through shared memory past barriers, the place's threads independent; the
    slot, row and chunk counts launch-time sizes (the programs take them as arguments). Their
    results are held to the torch grouping in tests/ops/test_moe_host.py."""
    from tileops.kernels import moe_group as MG

    sources = [p.get_kernel_source() for p in MG.build_group(256, 8, metadata, max_m,
                                                              alignment, "sm_90")]
    for src in sources:
        assert "atomic" not in src and "asm" not in src  # so the host can run them
    count, scan, place, small = sources
    assert "__syncthreads" in count and "__syncthreads" in scan and "__syncthreads" in small
    assert f"__launch_bounds__({MG.SMALL}, 1)" in small and "int N" in small
    assert "__shared__" not in place and "__syncthreads" not in place
    assert "int N" in count and "int C" in count and "int R" in count
    assert "int C" in scan and ("int R" in scan) is (metadata == "per_row")
    assert f"__launch_bounds__({MG._SCAN_THREADS}, 1)" in scan  # one CTA
    assert "int N" in place
    if metadata == "masked":
        assert f"* {max_m})" in place  # a slot's row in its expert's block: key * max_m + rank
