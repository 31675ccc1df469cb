"""The mixture-of-experts kernels on a GPU, called through the ops (the layout, the slots,
their entries), on fresh random inputs, against float64 computed on the CPU by the ops'
references and by plain loops: the grouped GEMM over uneven loads (empty experts, one expert
with eight times the rows of the others, loads off the tile, rows after the last segment),
aligned and masked layouts, odd N and K (no 16-byte rows), both weight layouts; the routing
(ties, groups, the bias); the permutations (exact: they move rows); the gradients of the grouped
GEMM, the unpermutation, the routing and the permutation; the fused layer at the Mixtral and
DeepSeek-V3 shapes of a few tokens, and tileops.nn.MoE's training step.

``python3 tests/kernels/test_moe_cuda.py --prebuild --workers 15`` compiles exactly the
programs these tests and the spec workloads use in spawned processes first, so the tests load
them from TileLang's disk cache.
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
]
#: (experts, max_m, counts, n, k, dtype, trans_b): masked grouped GEMMs
MASKED = [
    (8, 256, [256, 0, 100, 1, 255, 128, 0, 64], 2048, 4096, torch.bfloat16, True),
    (4, 96, [96, 0, 5, 70], 200, 7, torch.float16, False),
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


@pytest.mark.parametrize("case", GEMMS, ids=lambda c: f"e{len(c[0])}-n{c[1]}-k{c[2]}")
def test_contiguous_grouped_gemm(case):
    from tileops.ops import GroupedGemmFwdOp

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
    op = GroupedGemmFwdOp(trans_b=trans_b, **({"layout": layout} if layout else {}))
    c = op(a, b, offsets.cuda())
    ref = torch.zeros(m, n, dtype=torch.float64)
    bb = b.double().cpu()
    for i in range(e):
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        ref[lo:hi] = a[lo:hi].double().cpu() @ (bb[i].T if trans_b else bb[i])
    assert _rel(c, ref) < _tol(dtype)
    assert not c[int(offsets[-1]):].any()  # the rows of no expert


@pytest.mark.parametrize("case", MASKED, ids=lambda c: f"e{c[0]}-max{c[1]}-k{c[4]}")
def test_masked_grouped_gemm(case):
    from tileops.ops import GroupedGemmFwdOp

    e, max_m, counts, n, k, dtype, trans_b = case
    g = torch.Generator(device="cuda").manual_seed(max_m + k)
    a = torch.randn(e, max_m, k, device="cuda", generator=g).to(dtype)
    b = (torch.randn(e, *((n, k) if trans_b else (k, n)), device="cuda", generator=g)
         / k ** 0.5).to(dtype)
    meta = torch.tensor(counts, dtype=torch.int32, device="cuda")
    c = GroupedGemmFwdOp(trans_b=trans_b, layout=dict(masked=dict(max_m=max_m)))(a, b, meta)
    ref = torch.zeros(e, max_m, n, dtype=torch.float64)
    for i, cnt in enumerate(counts):
        bi = b[i].double().cpu()
        ref[i, :cnt] = a[i, :cnt].double().cpu() @ (bi.T if trans_b else bi)
    assert _rel(c, ref) < _tol(dtype)
    for i, cnt in enumerate(counts):
        assert not c[i, cnt:].any()  # past each block's count


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
        layout = G.GroupedLayoutKind.MASKED if masked else G.GroupedLayoutKind.CONTIGUOUS
        spec = G.GroupedGemmSpec(device="cuda", m=m, e=e, n=n, k=k, dtype=dtype,
                                 trans_b=trans_b, layout=layout, max_m=max_m)
        keys.append(("gemm", (e, n, k, dtype, trans_b, layout, max_m, G.choose_config(spec))))

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

    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
    for loads, n, k, dt, tb, align in GEMMS:
        gemm(sum(-(-c // align) * align for c in loads) + 3 * align, len(loads), n, k,
             name[dt], tb)
    for loads, n, k, dt, tb, _ in GEMMS[1:4]:  # the gradients' da: reduction over N
        gemm(sum(loads) + 5, len(loads), k, n, name[dt], not tb)
    for e, max_m, _, n, k, dt, tb in MASKED:
        gemm(e * max_m, e, n, k, name[dt], tb, True, max_m)
    for e, top_k, opts in ROUTES:
        for dt in ("bfloat16", "float32"):
            gating(e, top_k, dt, **opts)
    for _, h, k, _, _, dt in PERMUTES:
        rows_of(h, k, name[dt])
    for m, h, inter, e, top_k, opts in FUSED:
        opts = dict(opts)
        masked, max_m, _ = _layout_of(opts)
        rows = e * max_m if masked else m * top_k
        gemm(rows, e, 2 * inter, h, "bfloat16", True, masked, max_m)
        gemm(rows, e, h, inter, "bfloat16", True, masked, max_m)
        rows_of(h, top_k, "bfloat16")
        opts.pop("layout", None)
        gating(e, top_k, "bfloat16", **opts)
    served = ("bfloat16", "float16")
    for c in cases_of(GroupedGemmFwdOp):
        v, (masked, max_m, _) = c.values, _layout_of(c.params)
        if c.dtypes["T"] in served:
            gemm(v["M"] * (v["E"] if masked else 1), v["E"], v["N"], v["K"], c.dtypes["T"],
                 bool(c.params.get("trans_b", False)), masked, max_m)
    for c in cases_of(MoeTopkGatingFwdOp):
        if c.dtypes["T"] in (*served, "float32"):
            bias = any(i.name == "correction_bias" and i.shape is not None for i in c.inputs)
            gating(c.values["E"], dtype=c.dtypes["T"], bias=bias, **c.params)
    for c in cases_of(MoePermuteAlignFwdOp):
        if c.dtypes["T"] in served:
            keys.append(("permute", (c.values["H"], c.dtypes["T"])))
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
        p.pop("layout", None)
        p.pop("num_experts")
        bias = any(i.name == "correction_bias" and i.shape is not None for i in c.inputs)
        gating(e, dtype=dt, bias=bias, **p)
    return list(dict.fromkeys(keys))


def _build(key):
    kind, args = key
    {"gemm": G.build_grouped_gemm, "gating": K.build_gating, "permute": K.build_permute,
     "unpermute": K.build_unpermute, "gate_grad": K.build_gate_grad,
     "gating_bwd": K.build_gating_bwd}[kind](*args)


def _describe(key) -> str:
    return f"moe {key[0]} {key[1]}"


def main(argv=None) -> int:
    from _prebuild import main as prebuild  # beside this file, which runs as a script here

    return prebuild(program_keys, _build, _describe, argv)


if __name__ == "__main__":
    sys.exit(main())
