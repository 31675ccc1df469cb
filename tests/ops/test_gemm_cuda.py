"""GemmFwdOp's TileLang kernels on the GPU, against an fp64 reference.

Grid: the four transpose combinations over sizes that reach every implementation and tile
configuration the heuristic picks: decode (M = 1, 16-row tiles, or the one-row kernel when
``b`` is stored ``(N, K)``; M = 48, 64-row tiles),
M = 128 (64x64 tiles), 2048 (128x256), a size that is not a tile multiple (1000), one that
breaks 16-byte alignment (333 x 4097 x 4095: the padded kernel), K = 1 and 1 x 1 x 1 (the
general kernel); split-K configurations and every Hopper tile in both tile orders (persistent
and one CTA per tile), run directly, over the transposes.
Inputs are fresh random values; outputs are poisoned (the allocator hands back memory just
filled with NaN) so an unwritten element fails.
"""

import pytest

torch = pytest.importorskip("torch")

from tileops.ops import GemmFwdOp  # noqa: E402

pytestmark = pytest.mark.cuda

TRANS = [(False, False), (False, True), (True, False), (True, True)]
#: (M, N, K)
SIZES = [(1, 4096, 4096), (48, 256, 512), (128, 4096, 4096), (1000, 1000, 1000),
         (2048, 4096, 4096), (333, 4097, 4095), (7, 13, 1), (1, 1, 1)]
FP16_SIZES = [(1, 4096, 4096), (2048, 4096, 4096), (333, 4097, 4095)]
TOL = 1e-2  # relative L2 error, bf16 and fp16 outputs


def cases():
    for m, n, k in SIZES:
        for ta, tb in TRANS:
            yield pytest.param(m, n, k, ta, tb, torch.bfloat16,
                               id=f"{m}x{n}x{k}-{'NT'[ta]}{'NT'[tb]}-bf16")
    for m, n, k in FP16_SIZES:
        for ta, tb in ((False, False), (False, True)):
            yield pytest.param(m, n, k, ta, tb, torch.float16,
                               id=f"{m}x{n}x{k}-{'NT'[ta]}{'NT'[tb]}-fp16")


def _operands(m, n, k, ta, tb, dtype):
    g = torch.Generator(device="cuda").manual_seed(m * 7919 + n * 31 + k)
    a = torch.randn((k, m) if ta else (m, k), dtype=dtype, device="cuda", generator=g)
    b = torch.randn((n, k) if tb else (k, n), dtype=dtype, device="cuda", generator=g)
    return a, b


def _ref(a, b, ta, tb):
    a, b = a.double(), b.double()
    return (a.T if ta else a) @ (b.T if tb else b)


def _poison(numel: int, dtype) -> None:
    junk = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
    del junk


def _rel(out, ref) -> float:
    out = out.double()
    assert not torch.isnan(out).any(), "an output element was never written"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize(("m", "n", "k", "ta", "tb", "dtype"), list(cases()))
def test_gemm(m, n, k, ta, tb, dtype):
    a, b = _operands(m, n, k, ta, tb, dtype)
    op = GemmFwdOp(trans_a=ta, trans_b=tb)
    _poison(m * n, dtype)
    c = op(a, b)
    assert op.serving_target == "tileops"
    assert c.shape == (m, n) and c.dtype == dtype
    assert _rel(c, _ref(a, b, ta, tb)) < TOL


def test_which_implementation_serves():
    from tileops.kernels.gemm import (
        GemmGemvKernel,
        GemmGeneralKernel,
        GemmHopperKernel,
        GemmPaddedKernel,
        GemmSmallMKernel,
    )

    want = {(1, 4096, 4096, False): GemmSmallMKernel, (2048, 4096, 4096, False): GemmHopperKernel,
            (333, 4097, 4095, False): GemmPaddedKernel, (7, 13, 1, False): GemmGeneralKernel,
            (1, 4096, 4096, True): GemmGemvKernel, (1, 13, 5, True): GemmGeneralKernel}
    if torch.cuda.get_device_capability() != (9, 0):
        want[(2048, 4096, 4096, False)] = want[(333, 4097, 4095, False)] = GemmGeneralKernel
    for (m, n, k, tb), impl in want.items():
        op = GemmFwdOp(trans_b=tb)
        op(*_operands(m, n, k, False, tb, torch.bfloat16))
        built = [type(e) for entries in op.built_entries.values() for e in entries.values()]
        assert built == [impl], (m, n, k, tb, built)


def _split_cases():
    from tileops.kernels.gemm import HOPPER_SPLIT_CONFIGS, SMALL_M_SPLIT_CONFIGS

    for name, (m, n, k) in (("128x128s4", (1000, 1000, 1000)), ("128x256s2", (200, 512, 4096)),
                            ("64x128s2", (136, 4096, 72))):
        for ta, tb in TRANS:
            yield pytest.param(HOPPER_SPLIT_CONFIGS[name], m, n, k, ta, tb,
                               id=f"{name}-{m}x{n}x{k}-{'NT'[ta]}{'NT'[tb]}")
    for name, (m, n, k) in (("16x256s8", (1, 4096, 4096)), ("16x64s4", (5, 1000, 1000)),
                            ("64x64s2", (48, 256, 520))):
        for ta, tb in ((False, False), (False, True)):
            yield pytest.param(SMALL_M_SPLIT_CONFIGS[name], m, n, k, ta, tb,
                               id=f"{name}-{m}x{n}x{k}-{'NT'[ta]}{'NT'[tb]}")


def _run_directly(cfg, m, n, k, ta, tb) -> None:
    """Run ``cfg`` on the TMA implementation of M's range (bypassing the heuristic) and check
    the output against the fp64 reference."""
    from tileops.kernels.gemm import SMALL_M, GemmHopperKernel, GemmPlan, GemmSmallMKernel, m_bucket

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA kernels need sm_90")
    a, b = _operands(m, n, k, ta, tb, torch.bfloat16)
    impl = GemmSmallMKernel if m <= SMALL_M else GemmHopperKernel
    kern = impl(GemmPlan(a.device, m_bucket(m), n, k, "bfloat16", ta, tb, True))
    kern.config, kern.program = cfg, kern._build(cfg)
    c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    kern(a, b, c)
    assert _rel(c, _ref(a, b, ta, tb)) < TOL


@pytest.mark.parametrize(("cfg", "m", "n", "k", "ta", "tb"), list(_split_cases()))
def test_split_k_configurations(cfg, m, n, k, ta, tb):
    _run_directly(cfg, m, n, k, ta, tb)


def _tile_order_cases():
    """Every Hopper tile in both tile orders (the heuristic's and the other), run directly:
    a persistent grid with several tiles a CTA and tails on every side (128x256), fewer
    tiles than CTAs (128x128: 16 tiles; 64x128: 128), and many small tiles (64x64)."""
    from tileops.kernels.gemm import HOPPER_CONFIGS, HOPPER_ORDER_CONFIGS

    other_order = {(c.block_m, c.block_n): c for c in HOPPER_ORDER_CONFIGS.values()}
    # M a multiple of 8: a transposed a's rows are M long, and TMA needs them 16-byte aligned
    sizes = {"128x256": (2104, 4104, 264), "128x128": (136, 1000, 1000),
             "64x128": (1000, 1000, 1000), "64x64": (4104, 520, 72)}
    for name, (cfg, _) in HOPPER_CONFIGS.items():
        m, n, k = sizes[name]
        for c in (cfg, other_order[cfg.block_m, cfg.block_n]):
            for ta, tb in TRANS:
                yield pytest.param(c, m, n, k, ta, tb,
                                   id=f"{c.label()}-{m}x{n}x{k}-{'NT'[ta]}{'NT'[tb]}")


@pytest.mark.parametrize(("cfg", "m", "n", "k", "ta", "tb"), list(_tile_order_cases()))
def test_tile_orders(cfg, m, n, k, ta, tb):
    _run_directly(cfg, m, n, k, ta, tb)  # every M here is above the decode range


#: one-row calls with b stored (N, K): N not a multiple of the rows per CTA, K past the last
#: whole iteration, the smallest K, a wide N, K of the down projection
GEMV_SIZES = [(1, 1001, 4104), (1, 13, 8), (1, 14336, 4096), (1, 4096, 14336)]


def _gemv_cases():
    from tileops.kernels.gemm import GEMV_CONFIGS

    for m, n, k in GEMV_SIZES:
        for ta in (False, True):
            for dtype in (torch.bfloat16, torch.float16):
                yield pytest.param(None, m, n, k, ta, dtype,
                                   id=f"{m}x{n}x{k}-{'NT'[ta]}T-{str(dtype)[6:]}")
    for name, cfg in GEMV_CONFIGS.items():  # every configuration, run directly
        for ta in (False, True):
            yield pytest.param(cfg, 1, 1001, 4104, ta, torch.bfloat16, id=f"{name}-{'NT'[ta]}T")


@pytest.mark.parametrize(("cfg", "m", "n", "k", "ta", "dtype"), list(_gemv_cases()))
def test_gemv(cfg, m, n, k, ta, dtype):
    from tileops.kernels.gemm import GemmGemvKernel, GemmPlan

    a, b = _operands(m, n, k, ta, True, dtype)
    _poison(m * n, dtype)
    if cfg is None:  # through the op: the one-row kernel serves it
        op = GemmFwdOp(trans_a=ta, trans_b=True)
        c = op(a, b)
        built = [type(e) for entries in op.built_entries.values() for e in entries.values()]
        assert built == [GemmGemvKernel]
    else:
        name = str(dtype).split(".")[1]
        kern = GemmGemvKernel(GemmPlan(a.device, 1, n, k, name, ta, True, False))
        kern.config, kern.program = cfg, kern._build(cfg)
        c = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        kern(a, b, c)
    assert _rel(c, _ref(a, b, ta, True)) < TOL


def test_offset_view_runs_on_the_general_kernel():
    a, b = _operands(64, 256, 256, False, False, torch.bfloat16)
    # the same values at a base pointer 2 bytes past a 16-byte boundary: no TMA
    a2 = torch.empty(64 * 256 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(64, 256)
    a2.copy_(a)
    c = GemmFwdOp()(a2, b)
    assert _rel(c, _ref(a2, b, False, False)) < TOL


def test_non_contiguous_inputs():
    a, b = _operands(256, 512, 384, False, False, torch.bfloat16)
    op = GemmFwdOp(trans_a=True, trans_b=True)
    c = op(a.T, b.T)  # (K, M) and (N, K) views with unit stride on the wrong axis
    assert _rel(c, _ref(a, b, False, False)) < TOL


def test_tune_times_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("TILEOPS_CACHE_DIR", str(tmp_path))
    a, b = _operands(2048, 4096, 4096, False, False, torch.bfloat16)
    op = GemmFwdOp(tune=True)
    c = op(a, b)
    assert _rel(c, _ref(a, b, False, False)) < TOL
    files = list((tmp_path / "gemm").glob("*.json"))
    assert len(files) == 1
    c2 = GemmFwdOp(tune=True)(a, b)  # a second op reads the cached choice
    assert torch.equal(c, c2)


def test_cuda_graph_replay_matches_eager():
    op = GemmFwdOp(trans_b=True)
    a, b = _operands(16, 4096, 4096, False, True, torch.bfloat16)
    eager = op(a, b)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = op(a, b)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, captured)


def test_torch_compile_fullgraph_cold_builds_nothing_while_tracing():
    import operator

    a, b = _operands(128, 4096, 4096, False, True, torch.bfloat16)
    op = GemmFwdOp(trans_b=True)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    assert not op._built_entries  # cold: this instance has built nothing
    compiled = torch.compile(lambda x, y: op(x, y), backend=backend, fullgraph=True)
    got = compiled(a, b)
    calls = [n.target for n in graphs[0].graph.nodes
             if n.op == "call_function" and n.target is not operator.getitem]
    assert len(calls) == 1
    name = "tileops::" + str(calls[0]).split(".")[1]
    assert name in type(op).compile_op_names
    assert torch.equal(got, op(a, b))
    assert _rel(got, _ref(a, b, False, True)) < TOL


@pytest.mark.parametrize(("m", "n", "k", "tb"), [(0, 256, 64, False), (16, 0, 64, False),
                                                (16, 256, 0, False), (1, 8, 0, False),
                                                (0, 256, 64, True), (1, 8, 0, True),
                                                (1, 0, 64, True)])
def test_degenerate_sizes_launch_nothing_and_fill_zeros(m, n, k, tb):
    a, b = _operands(m, n, k, False, tb, torch.bfloat16)
    _poison(m * n, torch.bfloat16)
    c = GemmFwdOp(trans_b=tb)(a, b)
    assert c.shape == (m, n)
    assert torch.equal(c, torch.zeros(m, n, dtype=torch.bfloat16, device="cuda"))


@pytest.mark.parametrize(("m", "n", "k", "tb"), [(1, 4096, 4096, False), (1, 4096, 4096, True),
                                                (128, 1024, 1024, False),
                                                (1000, 1000, 1000, False),
                                                (2048, 2048, 1024, True)])
def test_launches_see_the_previous_kernels_writes(m, n, k, tb):
    """The TMA programs and the one-row kernel start before the previous kernel ends
    (programmatic dependent launch)
    and wait for it before their first read: an input written by the kernel just before (a
    torch kernel, or this op's own previous call) is read in full, every time."""
    a, b = _operands(m, n, k, False, tb, torch.bfloat16)
    e = torch.randn(n, n, dtype=torch.bfloat16, device="cuda") / n ** 0.5
    op, op2 = GemmFwdOp(trans_b=tb), GemmFwdOp(trans_b=tb)
    op(a, b), op2(op(a, b), e)  # build both entries first
    seen = []
    for _ in range(20):
        a.normal_()  # written by the kernel right before the GEMM that reads it
        c = op(a, b)
        d = op2(c, e)  # reads what the GEMM right before wrote
        seen.append((a.clone(), c, d))
    for a_i, c, d in seen:
        assert _rel(c, _ref(a_i, b, False, tb)) < TOL
        assert _rel(d, _ref(c, e, False, tb)) < TOL
