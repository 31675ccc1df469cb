"""The attention forward kernel lowers and compiles for sm_90a on a machine without a GPU, and
its launch plans and call specs hold over the input space.

Two dense programs, the varlen one and the backward are compiled, each standing for the code
paths named on its line (a compile takes 10-30 seconds; the sizes are launch-time, so a
program serves every batch and length; the GPU tests' prebuild compiles every program they
run, 192/128 and the unmasked one among them); the plans, the loops' bounds and the varlen
grid are checked over their input spaces without compiling.
"""

import math
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from tileops.kernels import attention as A  # noqa: E402

sys.path.append(str(Path(__file__).parent))  # the ptxas guard, beside this file
from _ptxas import assert_asynchronous, ptxas_report  # noqa: E402

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90a needs nvcc (the CUDA toolkit)")

HOPPER = "sm_90a"  # wgmma and the warp-specialized register split need the a-variant

PROGRAMS = [
    # causal GQA 8:2 (the key-tile loop's end, the mask, the reversed tile order), the output
    # staged through shared memory
    pytest.param(dict(layout="bshd", heads=8, heads_kv=2, dim=128, dim_v=128,
                      dtype="bfloat16", left=-1, right=0, softcap=None, masked=True),
                 id="bshd-bf16-d128-gqa-causal"),
    # [B, H, S, D], float16, D = 256 (64 keys a step, the output written from registers), a
    # left-only window (the loop's start) and a softcap (tanh before the mask)
    pytest.param(dict(layout="bhsd", heads=4, heads_kv=4, dim=256, dim_v=256,
                      dtype="float16", left=64, right=-1, softcap=30.0, masked=True),
                 id="bhsd-fp16-d256-left-window-softcap"),
]


@needs_nvcc
@pytest.mark.parametrize("args", PROGRAMS)
def test_program_compiles_for_sm90a(args):
    plan = A.attention_plan(args["dim"], args["dim_v"])
    prog = A.attention_fwd_program(scale=1.0 / math.sqrt(args["dim"]), plan=plan, **args)
    from tileops.kernels._tilelang import compile_program

    src = compile_program(prog, HOPPER).get_kernel_source()
    assert "wgmma" in src  # both products on the Hopper tensor cores
    assert "LSE[" in src  # the log-sum-exp is written
    assert ("tanh" in src) == (args["softcap"] is not None)
    assert ("O_shared" in src) == plan.staged_output


@needs_nvcc
@pytest.mark.parametrize("args", PROGRAMS)
def test_the_overlapped_program_releases_a_stage_after_its_product_completes(args):
    """The overlapped schedule: tile j's scores product, then tile j - 1's output product, both
    in flight (``wgmma`` without a wait); the scores product's wait (one group left) before
    the softmax, the output product's after it. TileLang's pipeline releases a key or value
    stage after the stage's last use in the step, so the program reads each stage once after
    its product's wait: no release (an ``arrive`` on an empty barrier) may come between a
    product's issue and that wait, or the load two steps on could overwrite the tile under
    the product."""
    plan = A.attention_plan(args["dim"], args["dim_v"])._replace(overlap=True, turns=False)
    prog = A.attention_fwd_program(scale=1.0 / math.sqrt(args["dim"]), plan=plan, **args)
    from tileops.kernels._tilelang import compile_program

    src = compile_program(prog, HOPPER).get_kernel_source()
    body = src[src.index("warpgroup_reg_alloc"):]
    body = body[:body.index("LSE[")]  # the math warpgroups' key-tile loop
    t = _T[args["dtype"]]
    # in this order: both products issued, the scores product's wait, a fence of the scores'
    # registers (so no read of them moves above the wait), the keys' touch, the key stage's
    # release, the output product's wait, fences of its registers, the values' touch, the
    # value stage's release
    marks = ["wgmma_ss<", "wgmma_rs<", "wait_wgmma<1>",
             "warpgroup_fence_operand(reinterpret_cast<float*>(acc_s + 0)",
             f"touch[0] = (({t}*)K_shared)", "].arrive();", "wait_wgmma<0>();\n      tl::",
             "warpgroup_fence_operand(reinterpret_cast<float*>(acc_o + 0)",
             "warpgroup_fence_operand(reinterpret_cast<uint32_t*>(acc_s_cast + 0)",
             f"touch[0] = (({t}*)V_shared)", "].arrive();"]
    at = 0
    for m in marks:
        found = body.find(m, at)
        assert found >= 0, f"{m!r} not found after offset {at}"
        at = found + len(m)
    # exactly the two releases, none between a product's issue and its wait
    assert body.count("].arrive();") == 2
    plain = A.attention_fwd_program(scale=1.0 / math.sqrt(args["dim"]),
                                    plan=plan._replace(overlap=False), **args)
    assert "touch" not in compile_program(plain, HOPPER).get_kernel_source()


_T = {"bfloat16": "bfloat16_t", "float16": "half_t"}


@needs_nvcc
@pytest.mark.parametrize("args", PROGRAMS)
@pytest.mark.parametrize("overlap,turns", [(False, False), (True, False), (True, True)],
                         ids=["plain", "overlap", "turns"])
def test_ptxas_keeps_the_products_asynchronous(args, overlap, turns, tmp_path):
    """ptxas serializes every ``wgmma`` of a function (warning C7514) where it cannot prove
    that no other instruction touches a product's accumulator between its issue and its wait:
    a product or a wait under a condition is enough. The overlapped schedule issues both
    products and the scores product's wait in every step for that reason (the last step's
    scores product and the first step's output product, of zero probabilities, are spare
    work); the program is built with TileLang's own headers and no register spills."""
    from tileops.kernels._tilelang import compile_program

    plan = A.attention_plan(args["dim"], args["dim_v"])._replace(overlap=overlap, turns=turns)
    prog = A.attention_fwd_program(scale=1.0 / math.sqrt(args["dim"]), plan=plan, **args)
    assert_asynchronous(ptxas_report(compile_program(prog, HOPPER).get_kernel_source(),
                                     tmp_path, "attention"))


def test_the_program_key_names_the_schedule(monkeypatch):
    """A program built with one schedule (plain, overlapped, overlapped with turns) is never
    served for another (the kernel store keys by the program key); the turns come only with
    the overlap."""
    keys = set()
    monkeypatch.setattr(A, "PLAIN_UP_TO", 0)
    for overlap, turns in ((False, False), (False, True), (True, False), (True, True)):
        monkeypatch.setattr(A, "OVERLAP", overlap)
        monkeypatch.setattr(A, "TURNS", turns)
        key = A.program_key(_spec())
        assert key[-2:] == (overlap, overlap and turns)
        keys.add(key)
    assert len(keys) == 3


#: the persistent forward's programs: PROGRAMS' two and the short-row bar's (B16 S1024 H32 D64
#: causal, where one CTA a tile pays its fixed cost for 4.5 key tiles on average)
PERSISTENT_PROGRAMS = [*PROGRAMS, pytest.param(
    dict(layout="bshd", heads=32, heads_kv=32, dim=64, dim_v=64, dtype="bfloat16", left=-1,
         right=0, softcap=None, masked=True), id="bshd-bf16-d64-causal")]


@needs_nvcc
@pytest.mark.parametrize("args", PERSISTENT_PROGRAMS)
@pytest.mark.parametrize("overlap,turns", [(False, False), (True, True)], ids=["plain", "turns"])
def test_persistent_program_keeps_its_loads_running_across_tiles(args, overlap, turns,
                                                                 tmp_path):
    """The persistent forward (:attr:`~tileops.kernels.attention.AttentionPlan.persistent`):
    the load warp's own loop over the CTA's work tiles issues each tile's queries once the
    math warpgroups released the previous tile's (after its last scores product, before its
    epilogue) and then the tile's key and value steps, waiting on nothing else, so it loads
    the next tile under this one's epilogue; the rings' slot and phase come from a step count
    run on across tiles. The math warpgroups give the first turn once a CTA, not once a
    tile. ptxas serializes no product, injects no wait and spills nothing."""
    from tileops.kernels._tilelang import compile_program

    plan = A.attention_plan(args["dim"], args["dim_v"])._replace(
        overlap=overlap, turns=turns, persistent=A.SMS)
    prog = A.attention_fwd_program(scale=1.0 / math.sqrt(args["dim"]), plan=plan, **args)
    src = compile_program(prog, HOPPER).get_kernel_source()
    load = src[src.index("warpgroup_reg_dealloc"):src.index("warpgroup_reg_alloc")]
    math_wgs = src[src.index("warpgroup_reg_alloc"):]
    # the load warp: a tile loop holding the queries' ring and the key steps' loop
    marks = ["for (int w = 0;", "q_empty[0].wait(((w & 1) ^ 1));", "tma_load(Q_desc",
             "q_full[0].arrive();", "for (int ", "int s = (step & 1);",
             "k_empty[((int64_t)s)].wait((phase ^ 1));", "tma_load(K_desc",
             "k_full[((int64_t)s)].arrive();", "v_empty[((int64_t)s)].wait((phase ^ 1));",
             "tma_load(V_desc", "v_full[((int64_t)s)].arrive();", "step = (step + 1);"]
    at = 0
    for m in marks:
        found = load.find(m, at)
        assert found >= 0, f"{m!r} not found in the load warp after offset {at}"
        at = found + len(m)
    assert "__syncthreads" not in load and "sync_thread_partial" not in load
    assert "wgmma" not in load
    # the math warpgroups: the queries released after the tile's steps, before the epilogue
    tiles = math_wgs.index("for (int w_1 = 0;")
    assert math_wgs.index("q_full[0].wait((w_1 & 1));") > tiles
    release = math_wgs.index("q_empty[0].arrive();")
    assert math_wgs.rindex("wgmma", 0, release) < release < math_wgs.index("LSE[")
    assert ("__named_barrier_arrive(8, 256)" in math_wgs[:tiles]) == turns
    assert_asynchronous(ptxas_report(src, tmp_path, "attention"))


def test_the_program_key_names_the_persistent_grid(monkeypatch):
    """A persistent program is never served for one CTA a tile, nor one of another grid."""
    keys = set()
    for persistent in (0, 5, A.SMS):
        monkeypatch.setattr(A, "PERSISTENT", persistent)
        key = A.program_key(_spec())
        assert key[-3] == persistent and A.attention_plan(128, 128).persistent == persistent
        keys.add(key)
    assert len(keys) == 3
    monkeypatch.undo()
    assert A.PERSISTENT == 0  # served: one CTA a tile


def test_short_calls_take_the_plain_schedule(monkeypatch):
    """A call of at most :data:`~tileops.kernels.attention.PLAIN_UP_TO` keys (1024, served)
    is keyed (and so built and served) with the plain schedule, a longer one with the plan's;
    0 gives every call the plan's."""
    assert A.PLAIN_UP_TO == 1024
    plan = A.attention_plan(128, 128)
    served = (plan.overlap, plan.turns)
    assert served == (True, True)
    assert A.program_key(_spec(seq_kv=1024))[-2:] == (False, False)
    assert A.program_key(_spec(seq_kv=100))[-2:] == (False, False)
    assert A.program_key(_spec(seq_kv=1025))[-2:] == served
    monkeypatch.setattr(A, "PLAIN_UP_TO", 0)
    assert A.program_key(_spec(seq_kv=100))[-2:] == served


# --- plans and call specs (no compile) -------------------------------------------------------

#: the shared memory an H100/H200 CTA may use
SMEM_LIMIT = 227 * 1024


def _smem(dim: int, dim_v: int, plan: A.AttentionPlan, itemsize: int = 2) -> int:
    q = plan.block_m * dim
    kv = plan.stages * plan.block_n * (dim + dim_v)
    o = plan.block_m * dim_v if plan.staged_output else 0
    return itemsize * (q + kv + o)


@pytest.mark.parametrize(("dim", "dim_v"), sorted(A.HEAD_DIMS))
def test_every_served_plan_fits_a_cta(dim, dim_v):
    plan = A.attention_plan(dim, dim_v)
    assert _smem(dim, dim_v, plan) <= SMEM_LIMIT
    # the fp32 accumulators a consumer thread holds (scores and output), under the 255
    # registers a thread may have with room for the rest
    consumers = plan.threads
    held = (plan.block_m * plan.block_n + plan.block_m * dim_v) // consumers
    assert held <= 160
    assert plan.block_m % 64 == 0 and plan.block_n % 16 == 0


@pytest.mark.parametrize(("seq_kv", "window", "masked"), [
    (1024, (-1, -1), False), (1000, (-1, -1), True), (1024, (-1, 0), True),
    (1024, (16, -1), True)])
def test_the_mask_is_compiled_in_where_a_call_needs_it(seq_kv, window, masked):
    spec = _spec(seq_kv=seq_kv, window_left=window[0], window_right=window[1])
    assert A.needs_mask(spec, A.attention_plan(128, 128)) is masked
    # the sizes are not part of the program: another batch and query length share it
    other = _spec(batch=7, seq_q=3, seq_kv=seq_kv, window_left=window[0],
                  window_right=window[1])
    assert A.AttentionFwdKernel.identity(spec) == A.AttentionFwdKernel.identity(other)


def test_backward_head_dims_are_refused_by_name():
    from tileops.kernels import attention_bwd as AB

    assert AB.AttentionBwdKernel.region_refusal(_spec(dim=256, dim_v=256)) == (
        "head dims D = 256, D_v = 256 are none of the D/D_v pairs the backward serves, "
        "64/64, 128/128")
    assert AB.AttentionBwdKernel.region_refusal(_spec()) is None


def test_head_dims_outside_the_served_pairs_are_refused_by_name():
    spec = _spec(dim=96, dim_v=96)
    assert A.AttentionFwdKernel.region_refusal(spec) == (
        "head dims D = 96, D_v = 96 are none of the served D/D_v pairs 64/64, 128/128, "
        "192/128, 256/256")
    assert A.AttentionFwdKernel.region_refusal(_spec()) is None


def _spec(**kw):
    fields = dict(device=torch.device("cuda", 0), batch=2, seq_q=100, seq_kv=100, heads=8,
                  heads_kv=2, dim=128, dim_v=128, dtype="bfloat16",
                  layout=A.AttentionLayout.BSHD, scale=0.125, window_left=-1,
                  window_right=0, softcap=None)
    fields.update(kw)
    return A.AttentionFwdSpec(**fields)


@pytest.mark.parametrize(("kw", "error", "text"), [
    (dict(heads=8, heads_kv=3), ValueError,
     "AttentionFwdSpec: 8 query heads do not form groups of 3 key heads"),
    (dict(heads_kv=0), ValueError, "AttentionFwdSpec: 8 query heads do not form groups of 0 "
                                   "key heads"),
    (dict(scale=0.0), ValueError, "AttentionFwdSpec.scale must be > 0, got 0.0"),
    (dict(window_left=-2), ValueError, "AttentionFwdSpec: window bounds are >= -1, got (-2, 0)"),
    (dict(softcap=-1.0), ValueError, "AttentionFwdSpec.softcap must be > 0, got -1.0"),
    (dict(dtype="float32"), ValueError,
     "AttentionFwdSpec.dtype must be one of bfloat16, float16, got 'float32'"),
    (dict(layout="bshd"), TypeError,
     "AttentionFwdSpec.layout must be an AttentionLayout, got 'bshd'"),
])
def test_call_spec_refuses_what_no_call_can_be(kw, error, text):
    with pytest.raises(error) as exc:
        _spec(**kw)
    assert str(exc.value) == text


@settings(max_examples=300, deadline=None)
@given(seq_q=st.integers(1, 700), seq_kv=st.integers(1, 700),
       left=st.integers(-1, 300), right=st.integers(-1, 300),
       bn=st.sampled_from([64, 128]), data=st.data())
def test_key_tile_loop_covers_every_visible_key(seq_q, seq_kv, left, right, bn, data):
    """Every key a row of a query tile sees lies in the tiles the loop visits, and the loop
    visits no tile wholly outside the keys (bottom-right aligned mask): the program's own
    formulas, evaluated on ints."""
    bm = 128
    tile = data.draw(st.integers(0, (seq_q - 1) // bm))
    start = A.first_key_tile(tile * bm, seq_q, seq_kv, left, bn)
    end = A.key_tiles_end(tile * bm, seq_q, seq_kv, left, right, bm, bn)
    rows = range(tile * bm, min(seq_q, (tile + 1) * bm))
    seen = set()
    for i in rows:
        diag = i + seq_kv - seq_q
        lo = 0 if left < 0 else max(0, diag - left)
        hi = seq_kv - 1 if right < 0 else min(seq_kv - 1, diag + right)
        seen.update(range(lo, hi + 1))
    visited = set(range(start * bn, end * bn))
    assert seen <= visited
    assert end * bn - bn < seq_kv or start == end


@needs_nvcc
@settings(max_examples=300, deadline=None)
@given(seq_q=st.integers(1, 700), seq_kv=st.integers(1, 700),
       left=st.integers(-1, 300), right=st.integers(-1, 300),
       bn=st.sampled_from([64, 128]), data=st.data())
def test_the_tiles_left_unmasked_are_seen_whole_by_every_row(seq_q, seq_kv, left, right, bn,
                                                             data):
    """The program masks the scores of a key tile unless :func:`full_key_tiles` puts it in
    its whole range: every key of such a tile is in ``S_kv`` and in every row's window (the
    tile's rows past ``S_q`` included), and in a dense call (no window, ``S_kv`` a multiple of
    the tile) no tile is masked. The program's own formulas, evaluated on ints."""
    bm = 128
    tile = data.draw(st.integers(0, (seq_q - 1) // bm))
    r0 = tile * bm
    start, end = A.full_key_tiles(r0, seq_q, seq_kv, left, right, bm, bn)
    for kt in range(start, end):
        for i in range(r0, r0 + bm):
            diag = i + seq_kv - seq_q
            lo = 0 if left < 0 else diag - left
            hi = seq_kv - 1 if right < 0 else min(seq_kv - 1, diag + right)
            assert lo <= kt * bn and kt * bn + bn - 1 <= hi, (kt, i)
    first = A.first_key_tile(r0, seq_q, seq_kv, left, bn)
    last = A.key_tiles_end(r0, seq_q, seq_kv, left, right, bm, bn)
    if left < 0 and right < 0:
        assert (start, end) == (0, seq_kv // bn)  # only a tail past S_kv is masked
        assert last - first - (end - start) == (seq_kv % bn != 0)


@pytest.mark.parametrize("fast", [True, False])
def test_fast_math_is_the_plans_choice(fast):
    """The default plan compiles with TileLang's fast math (nvcc's --use_fast_math, through
    the prim_func's pass configs); a plan without it carries none."""
    plan = A.attention_plan(128, 128)
    assert plan.fast_math
    prog = A.attention_fwd_program("bshd", 8, 8, 128, 128, "bfloat16", 128 ** -0.5, -1, -1,
                                   None, False, plan._replace(fast_math=fast))
    configs = dict(prog.attrs["tilelang_pass_configs"]) if "tilelang_pass_configs" in \
        (prog.attrs or {}) else {}
    assert bool(configs.get("tl.enable_fast_math", False)) is fast


@pytest.mark.parametrize("masked", [True, False])
def test_the_mask_is_applied_on_the_tiles_seen_in_part_only(masked):
    """A masked program branches on the key tile: the select runs only outside the whole
    tiles; an unmasked one has no such branch in its loop. The plain schedule has no other
    branch there; the served one (turns) adds its first turn and the overlapped products'
    guards of the spare step, the same masked or not."""
    plan = A.attention_plan(128, 128)
    assert plan.overlap and plan.turns

    def branches(p):
        prog = A.attention_fwd_program("bshd", 8, 2, 128, 128, "bfloat16", 128 ** -0.5, -1,
                                       0 if masked else -1, None, masked, p)
        return [line.strip() for line in prog.script().splitlines()
                if line.strip().startswith("if ")]

    # causal, no left side: every tile starts whole (the start is 0), the end is the diagonal's
    mask = ["if kt < 0 or kt >= whole_end:"] if masked else []
    assert branches(plan._replace(overlap=False, turns=False)) == [*mask, "if r0 + i < S_q:"]
    assert branches(plan) == ["if kt == start and wg == 0:", "if kt < end:", *mask,
                              "if kt < end:", "if r0 + i < S_q:"]
    windowed = A.attention_fwd_program("bshd", 8, 2, 128, 128, "bfloat16", 128 ** -0.5, 256, 0,
                                       None, True, plan)
    assert "if kt < whole_start or kt >= whole_end:" in windowed.script()


def test_varlen_program_compiles_for_sm90a():
    """The packed program: GQA, causal; the mask on the key tiles a row sees in part only (the
    whole tiles of :func:`full_key_tiles` over the sequence's own lengths, whose property the
    hypothesis test above holds); a tile within its sequence stored through shared memory by
    one bulk copy, the sequence's last tile row by row."""
    plan = A.attention_plan(128, 128)
    prog = A.attention_varlen_program(8, 2, 128, 128, "bfloat16", 128 ** -0.5, -1, 0, None,
                                      plan)
    branches = [line.strip() for line in prog.script().splitlines()
                if line.strip().startswith("if ")]
    assert "if kt < 0 or kt >= whole_end:" in branches
    assert "if r0 + 128 <= len_q:" in branches
    from tileops.kernels._tilelang import compile_program

    src = compile_program(prog, HOPPER).get_kernel_source()
    assert "wgmma" in src and "TileBatch[" in src and "CuK[" in src
    assert "tma_store(Out_desc" in src  # the whole tiles' bulk store
    assert "Out + " in src  # the last tile's rows


@settings(max_examples=200, deadline=None)
@given(lens=st.lists(st.integers(0, 700), min_size=1, max_size=12),
       bm=st.sampled_from([64, 128]))
def test_tile_batches_cover_every_row_once(lens, bm):
    """The varlen grid: each CTA's tile, read as the program reads it (its sequence from
    TileBatch, its first row from the sequence's first tile number), covers rows of its own
    sequence only, and together the CTAs cover every packed row exactly once."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    tb = A.tile_batches(torch.tensor(cu, dtype=torch.int32), cu[-1], bm)
    assert tb.dtype == torch.int32 and tb.numel() == cu[-1] // bm + len(lens)
    covered = []
    for g, b in enumerate(tb.tolist()):
        r0 = (g - (cu[b] // bm + b)) * bm
        assert r0 >= 0
        covered += range(cu[b] + r0, cu[b] + min(r0 + bm, max(r0, lens[b])))
    assert sorted(covered) == list(range(cu[-1]))


# --- the backward ------------------------------------------------------------------------------


@needs_nvcc
def test_backward_program_compiles_for_sm90a():
    """The gradients' program: GQA 8:2, a causal window bounded on the left (the query-tile
    loop's start and end), a softcap (tanh kept for its derivative), dQ added atomically."""
    from tileops.kernels import attention_bwd as AB
    from tileops.kernels._tilelang import compile_program

    plan = AB.attention_bwd_plan(128, 128)
    prog = AB.attention_bwd_program("bshd", 8, 2, 128, 128, "bfloat16", 128 ** -0.5, 64, 0,
                                    30.0, plan)
    src = compile_program(prog, HOPPER).get_kernel_source()
    assert "tanh" in src and "AtomicAdd" in src and "wgmma" in src


@needs_nvcc
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_backward_with_the_fragment_ordered_dq_compiles_for_sm90a(layout):
    """The plan's fragment-ordered dQ: the atomic adds go to the reordered float32 buffer of
    whole 8-row blocks (its own length S_dq), and the second program casts it back."""
    from tileops.kernels import attention_bwd as AB
    from tileops.kernels._tilelang import compile_program

    plan = AB.attention_bwd_plan(128, 128)._replace(dq_fragment_order=True)
    prog = AB.attention_bwd_program(layout, 8, 2, 128, 128, "bfloat16", 128 ** -0.5, 64, 0,
                                    30.0, plan)
    src = compile_program(prog, HOPPER).get_kernel_source()
    assert "AtomicAdd" in src and "S_dq" in src and "wgmma" in src
    default = AB.attention_bwd_program(layout, 8, 2, 128, 128, "bfloat16", 128 ** -0.5, 64, 0,
                                       30.0, AB.attention_bwd_plan(128, 128))
    assert "S_dq" not in default.script()  # the default plan's program is as it was
    post = compile_program(AB.attention_bwd_dq_program(layout, 8, 128, "bfloat16"), HOPPER)
    assert "S_dq" in post.get_kernel_source() and "bfloat16" in post.get_kernel_source()


@needs_nvcc
@pytest.mark.parametrize(("layout", "dim", "right", "softcap", "sdp_async"), [
    ("bshd", 128, -1, None, True), ("bshd", 128, 0, 30.0, True), ("bhsd", 128, 0, None, False),
    ("bshd", 64, 0, None, True)], ids=["d128", "d128-causal-softcap", "bhsd-causal-sync",
                                       "d64-causal"])
def test_backward_with_tma_reduced_dq_compiles_for_sm90a(layout, dim, right, softcap,
                                                         sdp_async):
    """64 query rows a step, each step's dQ tile added by one TMA reduce-add from shared
    memory (no per-element atomics), optionally with the scores' and dP's products in flight
    together: every layout, mask and head dim the backward serves."""
    from tileops.kernels import attention_bwd as AB
    from tileops.kernels._tilelang import compile_program

    plan = AB.attention_bwd_plan(dim, dim)._replace(block_m=64, dq_tma=True,
                                                    sdp_async=sdp_async)
    prog = AB.attention_bwd_program(layout, 8, 2, dim, dim, "bfloat16", dim ** -0.5, -1, right,
                                    softcap, plan)
    src = compile_program(prog, HOPPER).get_kernel_source()
    assert "tma_store_add" in src and "AtomicAdd" not in src and "wgmma" in src
    assert ("wait_wgmma<1>" in src) == sdp_async
    # dK / dV in the storage dtype only where no group is reduced (here 8:2: float32 partials)
    assert "float* __restrict__ dK" in src
    mha = AB.attention_bwd_program(layout, 8, 8, dim, dim, "bfloat16", dim ** -0.5, -1, right,
                                   softcap, plan._replace(kv_direct=True))
    assert "bfloat16_t* __restrict__ dK" in compile_program(mha, HOPPER).get_kernel_source()
    with pytest.raises(ValueError, match="dq_tma adds dQ tiles in its layout"):
        AB.attention_bwd_program(layout, 8, 2, dim, dim, "bfloat16", 0.1, -1, right, softcap,
                                 plan._replace(dq_fragment_order=True))


#: the sm_90 backward's schedules (STATS_TMA, OVERLAP): the served one, the statistics loaded
#: by TMA, and that with the last three products issued back to back
BWD_SCHEDULES = [pytest.param((False, False), id="plain"),
                 pytest.param((True, False), id="stats-tma"),
                 pytest.param((True, True), id="overlap")]


@needs_nvcc
@pytest.mark.parametrize("schedule", BWD_SCHEDULES)
@pytest.mark.parametrize(("heads_kv", "dim", "right"), [(8, 64, 0), (2, 128, -1)],
                         ids=["d64-mha-causal", "d128-gqa"])
def test_ptxas_keeps_the_served_backward_s_products_asynchronous(heads_kv, dim, right, schedule,
                                                                  tmp_path):
    """The sm_90 backward the ops serve (:class:`AttentionBwdTmaKernel`'s plan, under each
    schedule of its module flags): the scores' and dP's products in flight together, issued
    back to back with no use of a product's registers before its wait. dP's product clears its
    accumulator itself (its first step does not add): a clear of dP between the two issues
    (copies of the zero the scores' accumulator started from) made ptxas wait for the scores'
    product before it (C7517). With the overlap, dV's, dQ's and dK's products each waited for
    one behind. No serialization, no injected wait, no spill, for MHA (dK and dV in the
    storage dtype) and GQA (float32 partials), causal or not."""
    from tileops.kernels import attention_bwd as AB
    from tileops.kernels._tilelang import compile_program

    stats_tma, overlap = schedule
    plan = AB.attention_bwd_plan(dim, dim)._replace(**AB.AttentionBwdTmaKernel.plan_fields,
                                                    stats_tma=stats_tma, overlap=overlap)
    prog = AB.attention_bwd_program("bshd", 8, heads_kv, dim, dim, "bfloat16", dim ** -0.5, -1,
                                    right, None, plan)
    src = compile_program(prog, HOPPER).get_kernel_source()
    assert src.count("wait_wgmma<1>") == (4 if overlap else 1)
    # the statistics by TMA: their tensor maps, and no consumer's load of them; the pipeline
    # then needs one producer warpgroup (384 threads, 240 registers a math thread)
    assert ("LSE_desc" in src and "Delta_desc" in src) == stats_tma
    assert f"__launch_bounds__({384 if stats_tma else 512}, 1)" in src
    assert_asynchronous(ptxas_report(src, tmp_path, "attention_bwd"))


@needs_nvcc
@pytest.mark.parametrize(("layout", "softcap"), [("bhsd", None), ("bshd", 30.0)],
                         ids=["bhsd", "bshd-softcap"])
def test_backward_overlap_compiles_for_every_layout_and_softcap(layout, softcap, tmp_path):
    """The overlapped schedule in [B, H, S, D] and with a softcap (tanh's derivative folded
    into P before dV's product is issued: the scores' registers kept to dS under it spilled 84
    bytes): no serialization, no injected wait, no spill."""
    from tileops.kernels import attention_bwd as AB
    from tileops.kernels._tilelang import compile_program

    plan = AB.attention_bwd_plan(128, 128)._replace(**AB.AttentionBwdTmaKernel.plan_fields,
                                                    stats_tma=True, overlap=True)
    prog = AB.attention_bwd_program(layout, 8, 8, 128, 128, "bfloat16", 128 ** -0.5, -1, 0,
                                    softcap, plan)
    src = compile_program(prog, HOPPER).get_kernel_source()
    assert ("tanh" in src) == (softcap is not None) and "tma_store_add" in src
    assert_asynchronous(ptxas_report(src, tmp_path, "attention_bwd"))
    with pytest.raises(ValueError, match="overlap issues the products asynchronously"):
        AB.attention_bwd_program(layout, 8, 8, 128, 128, "bfloat16", 0.1, -1, 0, softcap,
                                 plan._replace(sdp_async=False))


@pytest.mark.parametrize("bshd", [True, False])
def test_the_fragment_order_is_a_permutation_of_whole_row_blocks(bshd):
    """Every (row, column) of 8-row blocks of a 128-wide head lands on its own word of the
    reordered buffer, within the buffer's size (rows rounded up to DQ_ROW_BLOCK)."""
    from tileops.kernels import attention_bwd as AB

    fn = AB.dq_fragment_layout(bshd)
    rows, heads, dim = 2 * AB.DQ_ROW_BLOCK, 3, 128
    seen = set()
    for r in range(rows):
        for h in range(heads):
            for d in range(dim):
                idx = fn(0, r, h, d) if bshd else fn(0, h, r, d)
                extents = ([1, rows // 8, heads, dim // 8, 2, 32] if bshd else
                           [1, heads, rows // 8, dim // 8, 2, 32])
                assert all(0 <= i < n for i, n in zip(idx, extents, strict=True))
                seen.add(tuple(idx))
    assert len(seen) == rows * heads * dim


@settings(max_examples=300, deadline=None)
@given(seq_q=st.integers(1, 700), seq_kv=st.integers(1, 700),
       left=st.integers(-1, 300), right=st.integers(-1, 300),
       bn=st.sampled_from([64, 128]), data=st.data())
def test_query_tile_loop_covers_every_row_that_sees_the_keys(seq_q, seq_kv, left, right, bn,
                                                             data):
    """The backward's loop over query tiles for a key tile visits every row that sees one of
    its keys and no tile wholly past S_q (the program's formulas, evaluated on ints)."""
    from tileops.kernels import attention_bwd as AB

    bm = 32
    tile = data.draw(st.integers(0, (seq_kv - 1) // bn))
    j0 = tile * bn
    start = AB.first_query_tile(j0, seq_q, seq_kv, right, bm)
    end = AB.query_tiles_end(j0, seq_q, seq_kv, left, right, bn, bm)
    rows = set()
    for i in range(seq_q):
        diag = i + seq_kv - seq_q
        lo = 0 if left < 0 else max(0, diag - left)
        hi = seq_kv - 1 if right < 0 else min(seq_kv - 1, diag + right)
        if lo <= hi and max(lo, j0) <= min(hi, j0 + bn - 1):
            rows.add(i)
    assert rows <= set(range(start * bm, end * bm))
    assert end * bm - bm < seq_q or start == end


@needs_nvcc
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("with_dlse", [False, True], ids=["delta", "delta-minus-dlse"])
@pytest.mark.parametrize("tile", [0, 64], ids=["rows", "tiles"])
def test_the_backward_delta_program_compiles_for_sm90a(layout, with_dlse, tile):
    """Delta = rowsum(dO * O) (- dLSE) from the storage dtype in float32, rows past S_q not
    written; in whole tiles (STATS_TMA) with the log-sum-exp times log2(e) beside it, every row
    of the tiles written."""
    from tileops.kernels import attention_bwd as AB
    from tileops.kernels._tilelang import compile_program

    src = compile_program(AB.attention_bwd_delta_program(layout, 8, 128, "bfloat16", with_dlse,
                                                         tile=tile),
                          HOPPER).get_kernel_source()
    assert ("DLSE" in src) == with_dlse and "float* __restrict__ Delta" in src
    assert "S_q" in src  # the row guard
    assert ("float* __restrict__ LSE2" in src and "S_t" in src) == bool(tile)
    with pytest.raises(ValueError, match="not whole CTAs"):
        AB.attention_bwd_delta_program(layout, 8, 128, "bfloat16", with_dlse, tile=48)


@settings(max_examples=400, deadline=None)
@given(seq_q=st.integers(1, 600), seq_kv=st.integers(1, 600),
       left=st.integers(-1, 300), right=st.integers(-1, 300),
       bm=st.sampled_from([32, 64]), data=st.data())
def test_a_whole_tile_pair_sees_every_key_of_its_tiles(seq_q, seq_kv, left, right, bm, data):
    """The backward skips the mask on a (key tile, query tile) pair only where every row of
    the query tile exists and sees every key of the key tile, and skips it wherever that holds
    (the program's formula, evaluated on ints)."""
    from tileops.kernels import attention_bwd as AB

    bn = 128
    j0 = data.draw(st.integers(0, (seq_kv - 1) // bn)) * bn
    i0 = data.draw(st.integers(0, (seq_q - 1) // bm)) * bm
    offset = seq_kv - seq_q

    def seen(i, j):
        diag = i + offset
        return (i < seq_q and j < seq_kv and (left < 0 or j >= diag - left)
                and (right < 0 or j <= diag + right))

    every = all(seen(i, j) for i in range(i0, i0 + bm) for j in range(j0, j0 + bn))
    assert bool(AB.whole_tile_pair(j0, i0, seq_q, seq_kv, left, right, bn, bm)) == every
