"""The mixture-of-experts kernels on a GPU, called through the ops (the layout, the slots,
their entries), on fresh random inputs, against float64 computed on the CPU by the ops'
references and by plain loops: the grouped GEMM over uneven loads (empty experts, one expert
with eight times the rows of the others, loads off the tile, rows after the last segment),
aligned and masked layouts, odd N and K (no 16-byte rows), both weight layouts; the routing
(ties, groups, the bias); the permutations (exact: they move rows); the gradients of the grouped
GEMM, the unpermutation, the routing and the permutation; the fused layer at the Mixtral and
DeepSeek-V3 shapes of a few tokens, and tileops.nn.MoE's training step. The grouped GEMM's
warp-specialized program (sm_90) runs on the same loads, into an output of NaNs (every row of
it must be written), from a CUDA graph replayed over a new routing, and under the op's tuning.

``python3 tests/kernels/test_moe_cuda.py --prebuild --workers 15`` compiles exactly the
programs these tests, the spec workloads and the sweep use in spawned processes first, so the
tests load them from TileLang's disk cache. ``python3 tests/kernels/test_moe_cuda.py --sweep
[--out DIR]`` times the grouped GEMM's two programs and torch._grouped_mm side by side on the
bar's shapes (TFLOP/s, each cell checked against float64).
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]

import pytest

torch = pytest.importorskip("torch")

from tileops.kernels import grouped_gemm as G  # noqa: E402
from tileops.kernels import moe as K  # noqa: E402
from tileops.kernels import moe_group as MG  # noqa: E402

sys.path.append(str(Path(__file__).parent))  # the shared routings, beside this file
from _moe_routings import ROUTINGS, routing_inputs  # noqa: E402

pytestmark = pytest.mark.cuda
if __name__ not in ("__main__", "__mp_main__") and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

#: (loads an expert, n, k, dtype, trans_b, alignment): contiguous grouped GEMMs
GEMMS = [
    ([512] * 64, 2048, 4096, torch.bfloat16, True, 1),  # the bar's shape, even loads
    ([2048, 0, 256, 0, 256, 256, 0, 256] * 8, 2048, 4096, torch.bfloat16, True, 1),  # uneven
    ([300, 0, 77, 1, 129, 0, 64, 5], 257, 200, torch.bfloat16, True, 1),  # off every tile
    ([300, 0, 77, 1, 129, 0, 64, 5], 256, 7, torch.float16, False, 1),  # odd K: no 16-byte rows
    ([40, 0, 3, 1], 512, 512, torch.bfloat16, True, 128),  # DeepGEMM's 128-row alignment
    ([1, 2, 0, 1], 4096, 7168, torch.bfloat16, True, 1),  # decode: 64-row tiles
    ([300, 0, 77, 1, 129, 0, 64, 5], 256, 200, torch.float16, False, 1),  # b (E, K, N), TMA rows
]
#: (experts, max_m, counts, n, k, dtype, trans_b): masked grouped GEMMs
MASKED = [
    (8, 256, [256, 0, 100, 1, 255, 128, 0, 64], 2048, 4096, torch.bfloat16, True),
    (4, 96, [96, 0, 5, 70], 200, 7, torch.float16, False),
    # blocks off the tile (the second tile's box clipped at max_m), odd N: c's rows stored a row
    # at a time, negative and overflowing counts clamped
    (4, 100, [100, -3, 37, 164], 257, 200, torch.bfloat16, True),
]
#: routing configurations (experts, top_k, options)
ROUTES = [
    (8, 2, dict()),  # Mixtral
    (256, 8, dict(scoring="sigmoid", num_groups=8, topk_groups=4, routed_scaling_factor=2.5,
                  bias=True)),  # DeepSeek-V3
    (64, 6, dict(renormalize=False)),
    (5, 2, dict(scoring="sigmoid")),
]
#: (tokens, hidden, top_k, experts, layout, dtype): permutations
PERMUTES = [
    (8192, 4096, 2, 8, dict(), torch.bfloat16),
    (300, 7168, 8, 256, dict(contiguous=dict(packing="aligned", metadata_kind="offsets",
                                            alignment=128)), torch.bfloat16),
    (300, 4097, 4, 16, dict(masked=dict(max_m=64)), torch.float16),
    (1, 4096, 2, 8, dict(), torch.bfloat16),
]
#: fused layers (tokens, hidden, intermediate, experts, top_k, options)
FUSED = [
    (64, 4096, 1024, 8, 2, dict()),
    (1, 4096, 1024, 8, 2, dict()),
    (64, 1024, 256, 64, 8, dict(scoring="sigmoid", num_groups=8, topk_groups=4,
                                routed_scaling_factor=2.5, bias=True)),
    (33, 512, 256, 8, 2, dict(layout=dict(masked=dict(max_m=16)))),
]


def _rel(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _tol(dtype):
    return 1e-2 if dtype == torch.bfloat16 else 2e-3


# --- grouped GEMM -----------------------------------------------------------------------------


def _contiguous_case(case):
    """``a``, ``b``, the offsets (on the CPU), the op's layout param (None: the default) and
    the float64 result of a case of GEMMS: rows after the last segment included (zero)."""
    loads, n, k, dtype, trans_b, align = case
    seg = [-(-c // align) * align for c in loads]
    m = sum(seg) + 3 * align  # rows after the last segment: zero in c
    offsets = torch.tensor([0] + torch.tensor(seg).cumsum(0).tolist(), dtype=torch.int32)
    e = len(loads)
    g = torch.Generator(device="cuda").manual_seed(m + n)
    a = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    b = (torch.randn(e, *((n, k) if trans_b else (k, n)), device="cuda", generator=g)
         / k ** 0.5).to(dtype)
    layout = (dict(contiguous=dict(packing="aligned", metadata_kind="offsets", alignment=align))
              if align > 1 else None)
    return a, b, offsets, layout, _loop_reference(a, b, offsets, trans_b)


def _loop_reference(a, b, offsets, trans_b):
    """float64 on the CPU, an expert at a time over its segment (offsets read as given)."""
    ref = torch.zeros(a.shape[0], b.shape[1] if trans_b else b.shape[2], dtype=torch.float64)
    bb = b.double().cpu()
    for i in range(b.shape[0]):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        ref[lo:hi] = a[lo:hi].double().cpu() @ (bb[i].T if trans_b else bb[i])
    return ref


def _masked_case(case):
    """``a``, ``b``, the counts (on the GPU) and the float64 result of a case of MASKED (each
    count clamped into ``[0, max_m]``, as the kernels read it)."""
    e, max_m, counts, n, k, dtype, trans_b = case
    g = torch.Generator(device="cuda").manual_seed(max_m + k)
    a = torch.randn(e, max_m, k, device="cuda", generator=g).to(dtype)
    b = (torch.randn(e, *((n, k) if trans_b else (k, n)), device="cuda", generator=g)
         / k ** 0.5).to(dtype)
    meta = torch.tensor(counts, dtype=torch.int32, device="cuda")
    ref = torch.zeros(e, max_m, n, dtype=torch.float64)
    for i, cnt in enumerate(_valid(case)):
        bi = b[i].double().cpu()
        ref[i, :cnt] = a[i, :cnt].double().cpu() @ (bi.T if trans_b else bi)
    return a, b, meta, ref


@pytest.mark.parametrize("case", GEMMS, ids=lambda c: f"e{len(c[0])}-n{c[1]}-k{c[2]}")
def test_contiguous_grouped_gemm(case):
    from tileops.ops import GroupedGemmFwdOp

    a, b, offsets, layout, ref = _contiguous_case(case)
    dtype, trans_b = case[3], case[4]
    op = GroupedGemmFwdOp(trans_b=trans_b, **({"layout": layout} if layout else {}))
    c = op(a, b, offsets.cuda())
    assert _rel(c, ref) < _tol(dtype)
    assert not c[int(offsets[-1]):].any()  # the rows of no expert


def _valid(case) -> list[int]:
    """The rows of each block a masked case computes: its counts clamped into [0, max_m]."""
    return [min(max(c, 0), case[1]) for c in case[2]]


@pytest.mark.parametrize("case", MASKED, ids=lambda c: f"e{c[0]}-max{c[1]}-k{c[4]}")
def test_masked_grouped_gemm(case):
    from tileops.ops import GroupedGemmFwdOp

    a, b, meta, ref = _masked_case(case)
    e, max_m, _, _, _, dtype, trans_b = case
    c = GroupedGemmFwdOp(trans_b=trans_b, layout=dict(masked=dict(max_m=max_m)))(a, b, meta)
    assert _rel(c, ref) < _tol(dtype)
    for i, cnt in enumerate(_valid(case)):
        assert not c[i, cnt:].any()  # past each block's count


# --- the warp-specialized grouped GEMM (sm_90) ---------------------------------------------------

HOPPER = (9, 0)
on_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == HOPPER),
    reason="the warp-specialized program is written for sm_90")
_NAME = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _gemm_spec(m, e, n, k, dtype, trans_b, masked=False, max_m=0):
    layout = G.GroupedLayoutKind.MASKED if masked else G.GroupedLayoutKind.CONTIGUOUS
    return G.GroupedGemmSpec(device="cuda", m=m, e=e, n=n, k=k, dtype=dtype, trans_b=trans_b,
                             layout=layout, max_m=max_m)


def _ws_holds(n, k, dtype, trans_b) -> bool:
    return G.ws_refusal(_gemm_spec(1, 1, n, k, _NAME[dtype], trans_b), HOPPER) is None


def _sms() -> int:
    return G.sm_count(torch.device("cuda")) if torch.cuda.is_available() else 132


def _program(spec, program):
    """``program`` built for ``spec`` as the kernel would build it."""
    cfg = G.choose_config(spec, program, HOPPER)
    assert cfg.program is program
    sms = _sms() if program is G.GroupedProgram.WARP_SPECIALIZED else 132
    return G.build_grouped_gemm(spec.e, spec.n, spec.k, spec.dtype, spec.trans_b, spec.layout,
                                spec.max_m, cfg, None, sms)


def _ws_program(spec):
    """The warp-specialized program for ``spec`` (the kernel's choice on sm_90)."""
    return _program(spec, G.GroupedProgram.WARP_SPECIALIZED)


#: the cases of GEMMS whose rows TMA can load (odd K is the pipelined program's; the masked
#: layout is too: the warp-specialized program refuses it, see ws_refusal)
WS_GEMMS = [c for c in GEMMS if _ws_holds(c[1], c[2], c[3], c[4])]


@on_hopper
@pytest.mark.parametrize("case", WS_GEMMS, ids=lambda c: f"e{len(c[0])}-n{c[1]}-k{c[2]}")
def test_warp_specialized_contiguous_grouped_gemm(case):
    a, b, offsets, _, ref = _contiguous_case(case)
    loads, n, k, dtype, trans_b, _ = case
    m = a.shape[0]
    c = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)  # every row is written
    _ws_program(_gemm_spec(m, len(loads), n, k, _NAME[dtype], trans_b))(a, b, offsets.cuda(), c)
    assert not c.isnan().any()
    assert _rel(c, ref) < _tol(dtype)
    assert not c[int(offsets[-1]):].any()  # the rows of no expert


@pytest.mark.parametrize("case", GEMMS, ids=lambda c: f"e{len(c[0])}-n{c[1]}-k{c[2]}")
def test_pipelined_contiguous_grouped_gemm(case):
    """The pipelined program on every case (the op runs the warp-specialized one where it
    holds on sm_90, so this is the only test of the pipelined one on those cases there)."""
    a, b, offsets, _, ref = _contiguous_case(case)
    loads, n, k, dtype, trans_b, _ = case
    m = a.shape[0]
    c = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)  # every row is written
    _program(_gemm_spec(m, len(loads), n, k, _NAME[dtype], trans_b),
             G.GroupedProgram.PIPELINED)(a, b, offsets.cuda(), c)
    assert not c.isnan().any()
    assert _rel(c, ref) < _tol(dtype)
    assert not c[int(offsets[-1]):].any()


#: the graph test's routings over 2048 rows of 8 experts: even, then uneven (two experts empty,
#: one with eight times another's rows, segments off the tile, zero rows at the end)
GRAPH_ROUTES = ([256] * 8, [1024, 0, 128, 77, 300, 0, 129, 190])


@on_hopper
def test_warp_specialized_program_replays_a_new_routing_from_a_cuda_graph():
    """The offsets are read on the device: a graph captured over one routing serves another
    written into the same metadata tensor (no host sync, nothing re-planned)."""
    e, n, k, m = 8, 512, 1024, 2048
    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b = (torch.randn(e, n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    ends = [torch.tensor([0, *torch.tensor(r).cumsum(0).tolist()], dtype=torch.int32)
            for r in GRAPH_ROUTES]
    meta = ends[0].cuda()
    c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    prog = _ws_program(_gemm_spec(m, e, n, k, "bfloat16", True))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        prog(a, b, meta, c)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prog(a, b, meta, c)
    for offsets in (ends[1], ends[0]):
        meta.copy_(offsets)
        c.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not c.isnan().any()
        assert _rel(c, _loop_reference(a, b, offsets, True)) < 1e-2
        assert not c[int(offsets[-1]):].any()


@on_hopper
def test_a_tuned_grouped_gemm_is_right_with_the_program_it_keeps():
    """``tune=True``: the first call times the pipelined and the warp-specialized program on
    its tensors (the choice itself is tested on the CPU) and keeps the faster; the first and a
    second call are right whichever it kept."""
    from tileops.ops import GroupedGemmFwdOp

    a, b, offsets, _, ref = _contiguous_case(GEMMS[1])
    op = GroupedGemmFwdOp(trans_b=True, tune=True)
    first = op(a, b, offsets.cuda())
    second = op(a, b, offsets.cuda())
    assert _rel(first, ref) < 1e-2 and _rel(second, ref) < 1e-2


# --- routing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ROUTES, ids=lambda c: f"e{c[0]}-k{c[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gating(case, dtype):
    from tileops.ops import MoeTopkGatingFwdOp

    e, top_k, opts = case
    opts = dict(opts)
    bias = opts.pop("bias", False)
    m = 4099
    g = torch.Generator(device="cuda").manual_seed(e * 10 + top_k)
    logits = torch.randn(m, e, device="cuda", generator=g).to(dtype)
    logits[:7] = torch.randint(-2, 3, (7, e), device="cuda", generator=g).to(dtype)  # ties
    b = torch.randn(e, device="cuda", generator=g) / 10 if bias else None
    op = MoeTopkGatingFwdOp(top_k=top_k, **opts)
    w, ids = op(logits, b)
    w_ref, ids_ref = op.fp64_reference(logits, b)
    if not bias and opts.get("num_groups", 1) == 1:
        # the picks compare the logits themselves: exactly the reference's
        assert torch.equal(ids.cpu(), ids_ref.cpu())
    else:  # float32 scores against float64 ones: the picks may differ only at near-ties
        same = (ids.cpu() == ids_ref.cpu()).all(1)
        assert same.float().mean() > 0.999
    assert _rel(w[same] if bias else w, w_ref[same] if bias else w_ref) < 1e-5


@pytest.mark.parametrize(("case", "lanes"), [
    pytest.param(c, lanes, id=f"{c[0]}-lanes{lanes}") for c in ROUTINGS
    for lanes in sorted({1, K.gating_lanes(c[1], c[5])})])
def test_both_routing_programs_give_the_reference_s_picks(case, lanes):
    """A thread a token and a warp a token (where the experts take it) over the routings the
    host run holds the first to (ties, NaNs, groups, lanes left empty): the reference's picks
    exactly, the weights within float32 rounding."""
    from tileops.ops._moe_layout import gating_reference

    _, e, top_k, scoring, renormalize, groups, kept, scale, bias, _ = case
    m = 1031  # 258 CTAs of four warps, the last partly idle
    x, b = routing_inputs(torch, case, m)
    w_ref, ids_ref = gating_reference(x, b, top_k=top_k, scoring=scoring,
                                      renormalize=renormalize, num_groups=groups,
                                      topk_groups=kept, scale=scale)
    prog = K.build_gating(e, top_k, "float32", scoring, renormalize, groups, kept, scale, bias,
                          None, lanes)
    w = torch.full((m, top_k), float("nan"), device="cuda")
    ids = torch.full((m, top_k), -9, device="cuda", dtype=torch.int32)
    prog(x.cuda(), (b if bias else torch.zeros(e)).cuda(), w, ids)
    torch.cuda.synchronize()
    assert torch.equal(ids.cpu().long(), ids_ref.long())
    assert torch.allclose(w.cpu(), w_ref.float(), rtol=1e-5, atol=1e-6, equal_nan=True)


# --- permutations -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", PERMUTES, ids=lambda c: f"m{c[0]}-h{c[1]}-k{c[2]}")
def test_permute_and_unpermute(case):
    from tileops.ops import MoePermuteAlignFwdOp, MoeUnpermuteFwdOp

    m, h, k, e, layout, dtype = case
    g = torch.Generator(device="cuda").manual_seed(m + h)
    x = torch.randn(m, h, device="cuda", generator=g).to(dtype)
    hot = torch.rand(m, k, device="cuda", generator=g) < 0.3  # expert 0 hot, the last empty
    ids = torch.where(hot, 0, torch.randint(0, e - 1, (m, k), device="cuda", generator=g))
    ids = ids.to(torch.int32)
    op = MoePermuteAlignFwdOp(num_experts=e, **({"layout": layout} if layout else {}))
    y, meta, rows = op(x, ids)
    y_ref, meta_ref, rows_ref = op.fp64_reference(x, ids)
    assert torch.equal(meta.cpu(), meta_ref.cpu()) and torch.equal(rows.cpu(), rows_ref.cpu())
    assert torch.equal(y.double().cpu(), y_ref.double().cpu())  # rows moved exactly
    w = torch.rand(m, k, device="cuda", generator=g)
    un = MoeUnpermuteFwdOp()
    out = un(y.view(-1, h), rows, w)
    assert _rel(out, un.fp64_reference(y.view(-1, h), rows, w)[0]) < _tol(dtype)


#: (experts, picks, layout): the grouping kernel against the torch grouping
GROUPINGS = [
    (8, 2, {}),
    (256, 8, dict(contiguous=dict(packing="aligned", metadata_kind="offsets", alignment=128))),
    (256, 8, dict(contiguous=dict(packing="aligned", metadata_kind="per_row", alignment=128))),
    (16, 4, dict(masked=dict(max_m=5))),
    (5, 3, dict(contiguous=dict(packing="aligned", metadata_kind="offsets", alignment=4))),
]


def _group_args(e, k, layout):
    """build_group's arguments for a layout spelled as the spec spells it."""
    if "masked" in layout:
        return (e, k, "masked", layout["masked"]["max_m"], 1)
    c = layout.get("contiguous", {})
    kind = "per_row" if c.get("metadata_kind") == "per_row" else "offsets"
    return (e, k, kind, 0, c.get("alignment", 1))


@pytest.mark.parametrize("case", GROUPINGS, ids=lambda c: f"e{c[0]}-k{c[1]}-{c[2]}")
#: 128 tokens of top-8 are the one-launch program's most slots; 129 the chunked programs'
@pytest.mark.parametrize("m", [0, 1, 5, 64, 128, 129, 700])
def test_grouping_kernel_is_the_torch_grouping(case, m):
    """The grouping kernel's rows, metadata and row tokens are the torch grouping's, exactly:
    no tokens, slots over several chunks, ids with dropped slots (negative, or past the
    experts), a hot expert, an empty one."""
    from tileops.ops._moe_layout import LayoutValue, group_slots

    e, k, layout = case
    args = _group_args(e, k, layout)
    lay = LayoutValue(masked=args[2] == "masked", max_m=args[3], alignment=args[4],
                      per_row=args[2] == "per_row")
    g = torch.Generator(device="cuda").manual_seed(m * e + k)
    ids = torch.randint(-1, e + 1, (m, k), device="cuda", generator=g)
    ids = torch.where(torch.rand(m, k, device="cuda", generator=g) < 0.3, 0, ids)
    ids = torch.where(ids == e - 1, 1 % e, ids).to(torch.int32)  # the last expert empty
    if m % 2:  # ids a view 4 bytes into its storage
        ids = torch.cat([ids.new_zeros(1), ids.reshape(-1)])[1:].view(m, k)
        assert ids.data_ptr() % 16
    kernel = MG.MoeGroupKernel(MG.MoeGroupSpec(device=torch.device("cuda"), e=e, k=k,
                                               metadata=args[2], max_m=args[3],
                                               alignment=args[4]))
    want = group_slots(ids, e, lay)
    rows = torch.full((m, k), -9, dtype=torch.int32, device="cuda")
    meta = torch.full(want.metadata.shape, -9, dtype=torch.int32, device="cuda")
    src = torch.full(want.src.shape, -9, dtype=torch.int32, device="cuda")
    kernel(ids, meta, rows, src)
    assert torch.equal(rows, want.rows) and torch.equal(meta, want.metadata)
    assert torch.equal(src, want.src)


# --- gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", GEMMS[1:4], ids=lambda c: f"e{len(c[0])}-n{c[1]}-k{c[2]}")
def test_grouped_gemm_gradient(case):
    """da through the grouped GEMM kernel (the other weight layout), db a segment at a time,
    both against float64 loops."""
    from tileops.ops import GroupedGemmBwdOp

    loads, n, k, dtype, trans_b, _ = case
    m = sum(loads) + 5
    offsets = torch.tensor([0] + torch.tensor(loads).cumsum(0).tolist(), dtype=torch.int32)
    e = len(loads)
    g = torch.Generator(device="cuda").manual_seed(m + 2 * n)
    a = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    b = (torch.randn(e, *((n, k) if trans_b else (k, n)), device="cuda", generator=g)
         / k ** 0.5).to(dtype)
    dc = torch.randn(m, n, device="cuda", generator=g).to(dtype)
    da, db = GroupedGemmBwdOp(trans_b=trans_b)(a, b, offsets.cuda(), dc)
    da_ref = torch.zeros(m, k, dtype=torch.float64)
    db_ref = torch.zeros(b.shape, dtype=torch.float64)
    ad, bd, dcd = a.double().cpu(), b.double().cpu(), dc.double().cpu()
    for i in range(e):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        op_b = bd[i].T if trans_b else bd[i]  # [K, N]
        da_ref[lo:hi] = dcd[lo:hi] @ op_b.T
        grad = ad[lo:hi].T @ dcd[lo:hi]  # [K, N]
        db_ref[i] = grad.T if trans_b else grad
    assert _rel(da, da_ref) < _tol(dtype) and _rel(db, db_ref) < _tol(dtype)
    assert not da[int(offsets[-1]):].any()


def test_unpermutation_gradient():
    """The gates' gradient through the warp-a-token kernel, the rows' in torch ops."""
    from tileops.ops import MoeUnpermuteBwdOp

    m, h, k = 300, 4096, 2
    g = torch.Generator(device="cuda").manual_seed(11)
    rows = torch.randperm(m * k, device="cuda", generator=g).view(m, k).to(torch.int32)
    rows[::7, 1] = -1  # dropped picks
    y = torch.randn(m * k, h, device="cuda", generator=g).to(torch.bfloat16)
    un = MoeUnpermuteBwdOp()
    dout = torch.randn(m, h, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(m, k, device="cuda", generator=g)
    got, ref = un(dout, y, rows, w), un.fp64_reference(dout, y, rows, w)
    assert _rel(got[0], ref[0]) < 1e-2 and _rel(got[1], ref[1]) < 1e-5


def test_grouped_gemm_gradient_of_no_rows():
    """An expert-parallel rank may receive no rows: zero weight gradients, an empty da."""
    from tileops.ops import GroupedGemmBwdOp

    e, n, k = 4, 256, 512
    a = torch.empty(0, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(e, n, k, device="cuda").to(torch.bfloat16)
    dc = torch.empty(0, n, device="cuda", dtype=torch.bfloat16)
    da, db = GroupedGemmBwdOp(trans_b=True)(a, b, torch.zeros(e + 1, dtype=torch.int32,
                                                              device="cuda"), dc)
    assert da.shape == (0, k) and db.shape == b.shape and not db.any()


@pytest.mark.parametrize("case", ROUTES, ids=lambda c: f"e{c[0]}-k{c[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gating_gradient(case, dtype):
    """The weights' gradient in the logits at the forward's own picks (the bias and the
    groups chose them), against the float64 closed form."""
    from tileops.ops import MoeTopkGatingBwdOp, MoeTopkGatingFwdOp

    e, top_k, opts = case
    opts = dict(opts)
    bias = opts.pop("bias", False)
    m = 4099
    g = torch.Generator(device="cuda").manual_seed(e * 10 + top_k + 1)
    logits = torch.randn(m, e, device="cuda", generator=g).to(dtype)
    b = torch.randn(e, device="cuda", generator=g) / 10 if bias else None
    _, ids = MoeTopkGatingFwdOp(top_k=top_k, **opts)(logits, b)
    bwd = MoeTopkGatingBwdOp(top_k=top_k, **{n: v for n, v in opts.items() if n in (
        "scoring", "renormalize", "routed_scaling_factor")})
    dw = torch.randn(m, top_k, device="cuda", generator=g)
    got = bwd(dw, logits, ids)
    assert got.dtype == dtype
    assert _rel(got, bwd.fp64_reference(dw, logits, ids)[0]) < (1e-2 if dtype ==
                                                                  torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("case", PERMUTES, ids=lambda c: f"m{c[0]}-h{c[1]}-k{c[2]}")
def test_permutation_gradient(case):
    """The unit-weight unpermutation of the grouped rows' gradient, over the forward's rows
    (dropped picks, rows a routing names twice never: one slot a row)."""
    from tileops.ops import MoePermuteAlignBwdOp, MoePermuteAlignFwdOp

    m, h, k, e, layout, dtype = case
    g = torch.Generator(device="cuda").manual_seed(m + h + 1)
    x = torch.randn(m, h, device="cuda", generator=g).to(dtype)
    ids = torch.randint(0, e, (m, k), device="cuda", generator=g).to(torch.int32)
    y, _, rows = MoePermuteAlignFwdOp(num_experts=e, **({"layout": layout} if layout else {}))(
        x, ids)
    dy = torch.randn(y.shape, device="cuda", generator=g).to(dtype)
    bwd = MoePermuteAlignBwdOp()
    assert _rel(bwd(dy, rows), bwd.fp64_reference(dy, rows)[0]) < _tol(dtype)


#: the training step's sizes (tokens, hidden, intermediate), Mixtral's routing over 8 experts
TRAIN_M, TRAIN_H, TRAIN_I = 64, 128, 64


def test_layer_training_step():
    """tileops.nn.MoE's training path on the GPU (every stage's forward and gradient kernels)
    against the same layer in float64 on the CPU. The tokens and the router are small
    integers over 8, so the bfloat16 logits are exact and both route alike."""
    import copy

    from tileops.nn import MoE

    torch.manual_seed(12)
    layer = MoE.mixtral(hidden_size=TRAIN_H, intermediate_size=TRAIN_I, num_experts=8,
                        device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.gate.weight.copy_(torch.randint(-1, 2, layer.gate.weight.shape) / 8)
    ref = copy.deepcopy(layer).to("cpu", torch.float64)
    x = torch.randint(-1, 2, (TRAIN_M, TRAIN_H), device="cuda").to(torch.bfloat16)
    g = torch.randn(TRAIN_M, TRAIN_H, device="cuda").to(torch.bfloat16)
    xg, xr = x.clone().requires_grad_(), x.double().cpu().requires_grad_()
    out, out_ref = layer(xg), ref(xr)
    out.backward(g)
    out_ref.backward(g.double().cpu())
    assert _rel(out, out_ref) < 1e-2
    for got, want in [(xg.grad, xr.grad), (layer.w13.grad, ref.w13.grad),
                      (layer.w2.grad, ref.w2.grad), (layer.gate.weight.grad,
                                                     ref.gate.weight.grad)]:
        assert _rel(got, want) < 2e-2



# --- the fused layer ----------------------------------------------------------------------------


@pytest.mark.parametrize("case", FUSED, ids=lambda c: f"m{c[0]}-h{c[1]}-e{c[3]}")
def test_fused_layer(case):
    from tileops.ops import FusedMoeFwdOp

    m, h, inter, e, top_k, opts = case
    opts = dict(opts)
    bias = opts.pop("bias", False)
    g = torch.Generator(device="cuda").manual_seed(m * h + e)
    dt = torch.bfloat16
    x = torch.randn(m, h, device="cuda", generator=g).to(dt)
    logits = torch.randn(m, e, device="cuda", generator=g).to(dt)
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h ** 0.5).to(dt)
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) / inter ** 0.5).to(dt)
    b = torch.randn(e, device="cuda", generator=g) / 10 if bias else None
    op = FusedMoeFwdOp(num_experts=e, top_k=top_k, **opts)
    out = op(x, logits, w13, w2, b)
    assert [s.name for s in op.last_call.stages] == ["route", "permute", "gate_up", "act",
                                                      "down", "unpermute"]
    assert _rel(out, op.fp64_reference(x, logits, w13, w2, b)[0]) < 1e-2


# --- the prebuild ----------------------------------------------------------------------------


def _layout_of(params):
    """(masked, max_m, alignment) of a case's ``layout`` param (the spec's spelling)."""
    lay = params.get("layout") or {"contiguous": {"alignment": 1}}
    if "masked" in lay:
        return True, lay["masked"]["max_m"], 1
    return False, 0, lay["contiguous"].get("alignment", 1)


def program_keys():
    """(builder, arguments) of every program the file and the spec workloads (at full size:
    the grouped GEMM's tile follows the rows an expert) compile, deduplicated."""
    from tileops.ops import (
        FusedMoeFwdOp,
        GroupedGemmFwdOp,
        MoePermuteAlignBwdOp,
        MoePermuteAlignFwdOp,
        MoeTopkGatingBwdOp,
        MoeTopkGatingFwdOp,
        MoeUnpermuteBwdOp,
        MoeUnpermuteFwdOp,
    )
    from tileops.ops.workloads import cases_of

    keys = []

    def gemm(m, e, n, k, dtype, trans_b, masked=False, max_m=0):
        spec = _gemm_spec(m, e, n, k, dtype, trans_b, masked, max_m)
        keys.append(("gemm", (e, n, k, dtype, trans_b, spec.layout, max_m,
                              G.choose_config(spec, G.GroupedProgram.PIPELINED), None, 132)))
        if G.ws_refusal(spec, HOPPER) is None:  # the kernel's choice on sm_90, the sweep's
            cfg = G.choose_config(spec, G.GroupedProgram.WARP_SPECIALIZED, HOPPER)
            keys.append(("gemm", (e, n, k, dtype, trans_b, spec.layout, max_m, cfg, None,
                                  _sms())))

    def gating(e, top_k, dtype, scoring="softmax", renormalize=True, num_groups=1,
               topk_groups=1, routed_scaling_factor=1.0, bias=False):
        keys.append(("gating", (e, top_k, dtype, scoring, renormalize, num_groups,
                                topk_groups, float(routed_scaling_factor), bool(bias))))

    def gating_bwd(e, top_k, dtype, scoring="softmax", renormalize=True,
                   routed_scaling_factor=1.0, **_):  # the groups and the bias: not its own
        keys.append(("gating_bwd", (e, top_k, dtype, scoring, renormalize,
                                    float(routed_scaling_factor))))

    def rows_of(h, k, dtype):
        keys.extend([("permute", (h, dtype)), ("unpermute", (h, k, dtype))])

    def group(m, k, e, layout):  # the grouping kernel's programs (sizes are launch-time)
        keys.append(("group", _group_args(e, k, layout)))

    name = _NAME
    for loads, n, k, dt, tb, align in GEMMS:
        gemm(sum(-(-c // align) * align for c in loads) + 3 * align, len(loads), n, k,
             name[dt], tb)
    gemm(2048, 8, 512, 1024, "bfloat16", True)  # the graph test's
    for loads, n, k, dt, tb, _ in GEMMS[1:4]:  # the gradients' da: reduction over N
        gemm(sum(loads) + 5, len(loads), k, n, name[dt], not tb)
    for e, max_m, _, n, k, dt, tb in MASKED:
        gemm(e * max_m, e, n, k, name[dt], tb, True, max_m)
    for e, top_k, opts in ROUTES:
        for dt in ("bfloat16", "float32"):
            gating(e, top_k, dt, **opts)
    for _, e, top_k, scoring, renorm, groups, kept, scale, bias, _ in ROUTINGS:
        for lanes in {1, K.gating_lanes(e, groups)}:  # test_both_routing_programs_...
            keys.append(("gating", (e, top_k, "float32", scoring, renorm, groups, kept, scale,
                                    bias, None, lanes)))
    for m, h, k, e, layout, dt in PERMUTES:
        rows_of(h, k, name[dt])
        group(m, k, e, layout)
    for e, k, layout in GROUPINGS:
        keys.append(("group", _group_args(e, k, layout)))
    for m, h, inter, e, top_k, opts in FUSED:
        opts = dict(opts)
        masked, max_m, _ = _layout_of(opts)
        rows = e * max_m if masked else m * top_k
        gemm(rows, e, 2 * inter, h, "bfloat16", True, masked, max_m)
        gemm(rows, e, h, inter, "bfloat16", True, masked, max_m)
        rows_of(h, top_k, "bfloat16")
        group(m, top_k, e, opts.pop("layout", None) or {})
        gating(e, top_k, "bfloat16", **opts)
    served = ("bfloat16", "float16")
    for c in cases_of(GroupedGemmFwdOp):
        v, (masked, max_m, _) = c.values, _layout_of(c.params)
        if c.dtypes["T"] in served:
            gemm(v["M"] * (v["E"] if masked else 1), v["E"], v["N"], v["K"], c.dtypes["T"],
                 bool(c.params.get("trans_b", False)), masked, max_m)
    for _, case, n, k in _sweep_cells(cases_of(GroupedGemmFwdOp, labels=SWEEP)):
        s = _cell_spec(case, n, k)
        for cfg in _sweep_configs(s, HOPPER):
            keys.append(("gemm", (s.e, n, k, s.dtype, s.trans_b, s.layout, s.max_m, cfg, None,
                                  _sms() if cfg.program is G.GroupedProgram.WARP_SPECIALIZED
                                  else 132)))
    for c in cases_of(MoeTopkGatingFwdOp):
        if c.dtypes["T"] in (*served, "float32"):
            bias = any(i.name == "correction_bias" and i.shape is not None for i in c.inputs)
            gating(c.values["E"], dtype=c.dtypes["T"], bias=bias, **c.params)
    for c in cases_of(MoePermuteAlignFwdOp):
        if c.dtypes["T"] in served:
            keys.append(("permute", (c.values["H"], c.dtypes["T"])))
        group(c.values["M"], c.values["K"], c.params["num_experts"], c.params.get("layout") or {})
    for c in cases_of(MoeUnpermuteFwdOp):
        if c.dtypes["T"] in served:
            keys.append(("unpermute", (c.values["H"], c.values["K"], c.dtypes["T"])))
    for c in cases_of(MoeUnpermuteBwdOp):
        if c.dtypes["T"] in served:
            keys.append(("gate_grad", (c.values["H"], c.values["K"], c.dtypes["T"])))
    keys.append(("gate_grad", (4096, 2, "bfloat16")))  # test_unpermutation_gradient
    for e, top_k, opts in ROUTES:  # test_gating_gradient
        for dt in ("bfloat16", "float32"):
            gating_bwd(e, top_k, dt, **opts)
    for c in cases_of(MoeTopkGatingBwdOp):
        if c.dtypes["T"] in (*served, "float32"):
            gating_bwd(c.values["E"], dtype=c.dtypes["T"], **c.params)
    for c in cases_of(MoePermuteAlignBwdOp):  # the unpermutation's program, unit weights
        if c.dtypes["T"] in served:
            keys.append(("unpermute", (c.values["H"], c.values["K"], c.dtypes["T"])))
    # test_layer_training_step: both products, both da (reduction over N), the rows, the
    # routing and their gradients
    rows = TRAIN_M * 2
    gemm(rows, 8, 2 * TRAIN_I, TRAIN_H, "bfloat16", True)
    gemm(rows, 8, TRAIN_H, TRAIN_I, "bfloat16", True)
    gemm(rows, 8, TRAIN_H, 2 * TRAIN_I, "bfloat16", False)
    gemm(rows, 8, TRAIN_I, TRAIN_H, "bfloat16", False)
    rows_of(TRAIN_H, 2, "bfloat16")
    group(TRAIN_M, 2, 8, {})
    keys.append(("gate_grad", (TRAIN_H, 2, "bfloat16")))
    gating(8, 2, "bfloat16")
    gating_bwd(8, 2, "bfloat16")
    for c in cases_of(FusedMoeFwdOp):
        v, p, dt = c.values, dict(c.params), c.dtypes["T"]
        if dt not in served:
            continue
        masked, max_m, align = _layout_of(p)
        e, top_k = p["num_experts"], p["top_k"]
        rows = e * max_m if masked else v["M"] * top_k + e * (align - 1)
        gemm(rows, e, 2 * v["I"], v["H"], dt, True, masked, max_m)
        gemm(rows, e, v["H"], v["I"], dt, True, masked, max_m)
        rows_of(v["H"], top_k, dt)
        group(v["M"], top_k, e, p.pop("layout", None) or {})
        p.pop("num_experts")
        bias = any(i.name == "correction_bias" and i.shape is not None for i in c.inputs)
        gating(e, dtype=dt, bias=bias, **p)
    return list(dict.fromkeys(keys))


def _build(key):
    kind, args = key
    {"gemm": G.build_grouped_gemm, "gating": K.build_gating, "permute": K.build_permute,
     "unpermute": K.build_unpermute, "gate_grad": K.build_gate_grad,
     "gating_bwd": K.build_gating_bwd, "group": MG.build_group}[kind](*args)


def _describe(key) -> str:
    return f"moe {key[0]} {key[1]}"


# --- the sweep -------------------------------------------------------------------------------

#: the sweep's spec workloads: the bar's E64 shape with even and uneven loads, Mixtral-8x7B's up
#: projection (its down projection is built over the same routing, :func:`_sweep_cells`),
#: DeepSeek-V3's 128-row aligned segments and 64-row masked blocks
SWEEP = ["e64-m512-k4096-n2048", "e64-uneven-k4096-n2048", "mixtral-up-uneven-m8192",
         "deepseek-up-aligned128", "deepseek-down-masked64"]
#: other tiles of the warp-specialized program the sweep times beside the kernel's choice
#: (the dense GEMM's 128x128 with 128-deep K steps and its 64x128), where they differ from it:
#: which tile reaches the bar's 730 TFLOP/s, and DeepSeek-V3's up projection (0.86x of
#: torch._grouped_mm with 128x256 tiles)
WS_CANDIDATES = (
    G.GroupedGemmConfig(128, 128, 128, 3, 256, G.GroupedProgram.WARP_SPECIALIZED),
    G.GroupedGemmConfig(64, 128, 64, 4, 128, G.GroupedProgram.WARP_SPECIALIZED),
)


def _sweep_configs(spec, arch) -> list:
    """The configurations a sweep cell times: each program's choice for ``spec``, then the
    :data:`WS_CANDIDATES` where the warp-specialized program holds."""
    out = []
    for program in G.GroupedProgram:
        cfg = G.choose_config(spec, program, arch)
        if cfg.program is program:  # else the warp-specialized program does not hold here
            out.append(cfg)
    if G.ws_refusal(spec, arch) is None:
        out += [c for c in WS_CANDIDATES if c not in out]
    return out


def _sweep_cells(cases):
    """``(label, case, n, k)`` of every sweep cell: each case as it is, and after Mixtral's up
    projection its down one (N its K, K half its N) over the same routing."""
    out = []
    for c in cases:
        out.append((c.label, c, c.values["N"], c.values["K"]))
        if c.label.startswith("mixtral-up"):
            out.append((c.label.replace("-up-", "-down-"), c, c.values["K"], c.values["N"] // 2))
    return out


def _cell_spec(case, n, k):
    masked, max_m, _ = _layout_of(case.params)
    v = case.values
    return _gemm_spec(v["M"] * (v["E"] if masked else 1), v["E"], n, k, case.dtypes["T"],
                      bool(case.params.get("trans_b", False)), masked, max_m)


def _reference64(a, b, meta, spec):
    """float64 on the GPU, an expert at a time (the metadata clamped as the kernels clamp
    it), the routed rows and the end of the segments (masked: the blocks' rows)."""
    trans_b = spec.trans_b
    ref = torch.zeros(*a.shape[:-1], spec.n, dtype=torch.float64, device=a.device)
    rows, lo = 0, 0
    meta = meta.tolist()
    for e in range(spec.e):
        bt = b[e].double().T if trans_b else b[e].double()
        if spec.layout is G.GroupedLayoutKind.MASKED:
            cnt = G.masked_rows(meta[e], spec.max_m)
            ref[e, :cnt] = a[e, :cnt].double() @ bt
            rows += cnt
        else:
            hi = G.segment_end(meta[e + 1], lo, a.shape[0])
            ref[lo:hi] = a[lo:hi].double() @ bt
            rows, lo = rows + hi - lo, hi
    return ref, rows, a.shape[0] if spec.layout is G.GroupedLayoutKind.MASKED else lo


def _sweep_cell(label, case, n, k, arch) -> list[dict]:
    """One cell of the sweep: its table printed, a result a contender returned."""
    from tileops.kernels.gemm import _time_ms
    from tileops.ops import GroupedGemmFwdOp
    from tileops.ops.moe import _grouped_mm_peer
    from tileops.ops.workloads import make_inputs

    spec = _cell_spec(case, n, k)
    a, b, meta = make_inputs(case, "cuda")
    if (n, k) != (case.values["N"], case.values["K"]):  # the down projection's operands
        g = torch.Generator(device="cuda").manual_seed(n + k)
        a = torch.randn(*a.shape[:-1], k, device="cuda", generator=g).to(a.dtype)
        b = torch.randn(spec.e, *((n, k) if spec.trans_b else (k, n)), device="cuda",
                        generator=g).to(b.dtype)
    op = GroupedGemmFwdOp(**case.params)
    ref, rows, end = _reference64(a, b, meta, spec)
    masked = spec.layout is G.GroupedLayoutKind.MASKED
    valid = ((torch.arange(spec.max_m, device="cuda") < meta.clamp(0, spec.max_m)[:, None])
             if masked else None)

    def program_of(cfg, sms):
        prog = G.build_grouped_gemm(spec.e, n, k, spec.dtype, spec.trans_b, spec.layout,
                                    spec.max_m, cfg, None, sms)
        c = torch.empty(*a.shape[:-1], n, device="cuda", dtype=a.dtype)
        return lambda: (prog(a, b, meta, c), c)[1]

    contenders = {}  # name -> (call, whether its rows of no expert must be zero)
    for cfg in _sweep_configs(spec, arch):
        sms = _sms() if cfg.program is G.GroupedProgram.WARP_SPECIALIZED else 132
        name = f"{cfg.program.value} {'x'.join(map(str, cfg[:3]))}/st{cfg.stages}"
        contenders[name] = (program_of(cfg, sms), True)
    peer = _grouped_mm_peer(op)
    if peer is not None:
        contenders["torch._grouped_mm"] = (lambda: peer(a, b, meta), False)
    print(f"{label}  E{spec.e} x {tuple(a.shape[:-1])} rows ({rows} routed) x K{k} -> N{n}"
          f"  {'NT' if spec.trans_b else 'NN'} {spec.layout.value}", flush=True)
    base = None
    results = []
    for name, (fn, ours) in sorted(contenders.items(),
                                   key=lambda kv: kv[0] != "torch._grouped_mm"):
        ms = _time_ms(fn)
        out = fn()
        torch.cuda.synchronize()
        if masked:
            err = _rel(out * valid[..., None], ref)
            zeros = not (out * ~valid[..., None]).any()
        else:
            err = _rel(out[:end], ref[:end])
            zeros = not out[end:].any()
        ok = err < 1e-2 and (zeros or not ours)
        base = ms if name == "torch._grouped_mm" else base
        ratio = f"x{base / ms:.3f}" if base else "      "
        print(f"  {name:34s} {ms * 1e3:9.1f} us {2 * rows * n * k / ms / 1e9:7.1f} TF  "
              f"{ratio}  {'ok' if ok else 'BAD'} {err:.1e}", flush=True)
        results.append(dict(label=label, contender=name, ms=ms, rows=rows, n=n, k=k,
                            e=spec.e, layout=spec.layout.value, rel_err=err, ok=ok))
    return results


def sweep(argv=None) -> int:
    """Time the grouped GEMM's programs and torch._grouped_mm on every cell of :data:`SWEEP`,
    print one table a cell and write grouped_gemm_sweep.json under ``--out``; 1 when any
    output fails its check."""
    import argparse
    import json

    from tileops.ops import GroupedGemmFwdOp
    from tileops.ops.workloads import cases_of

    ap = argparse.ArgumentParser(description="the grouped GEMM's programs side by side")
    ap.add_argument("--sweep", action="store_true", required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    arch = torch.cuda.get_device_capability()
    print(f"grouped GEMM sweep on {torch.cuda.get_device_name()}, torch {torch.__version__}: "
          f"CUDA-graph replay times (best of 3 x 10 launches), operands warm; TF = TFLOP/s of "
          f"the routed rows; x = torch._grouped_mm's time / this time; check: relative L2 error "
          f"of the routed rows against float64 < 1e-2, and the TileOPs programs' other rows "
          f"zero", flush=True)
    results = []
    for label, case, n, k in _sweep_cells(cases_of(GroupedGemmFwdOp, labels=SWEEP)):
        results += _sweep_cell(label, case, n, k, arch)
        torch.cuda.empty_cache()
    failed = sum(not r["ok"] for r in results)
    if args.out:
        path = Path(args.out) / "grouped_gemm_sweep.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=1))
        print(f"wrote {path}")
    print(f"{len(results)} cells, {failed} failed their check")
    return 1 if failed else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--sweep" in argv:
        return sweep(argv)
    from _prebuild import main as prebuild  # beside this file, which runs as a script here

    return prebuild(program_keys, _build, _describe, argv)


if __name__ == "__main__":
    sys.exit(main())
