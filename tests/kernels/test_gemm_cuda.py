"""The accumulating GEMM (``c += op(a) @ op(b)``: GemmAccumulateFwdOp, the slot's entries with
``GemmSpec.accumulate``) on a GPU against float64 ``c + op(a) @ op(b)``.

Grid: every implementation through the op (decode M = 1 on 16-row tiles and, with ``b`` stored
``(N, K)``, the one-row kernel; M = 48 on 64-row tiles; M = 128 on 64x64 tiles, one CTA per
tile; M = 2048 on the persistent 128x256 tiles; a size that is no tile multiple; one that breaks
16-byte alignment (333 x 4097 x 4095: the padded kernel); K = 1 and 1 x 1 x 1 on the general
kernel) over the four transposes; every Hopper tile in both tile orders and the split-K
configurations (whose reduction adds c), run directly; the fused linear cross-entropy's
dweight shape (128256 x 4096 += z.T @ h, 1024 and 2048 rows); K = 0 and empty calls (c
unchanged); a chain of accumulations into one c (each launch reads what the previous one
wrote: programmatic dependent launch); a strided c (written back); CUDA graph replay and
torch.compile. ``c`` starts as fresh random values (it is read, so it is not poisoned), its
memory checked to be written where it should: the result must match ``c + a @ b``, not
``a @ b``.

The stream-K grids (``HOPPER_STREAM_K_CONFIGS``) are also run directly for the plain product against float64 ``op(a) @ op(b)``, its output poisoned with NaN before
each call: the shapes it is for (few tiles, short K: 5001, 2999, 1000 and 8191 x 1000 x 1000,
333 x 4096 x 1000), one of whole waves and one of whole waves and a shared tail, M no
multiple of 128 and K none of 64, NN and NT (TN and TT at 1000^3, fp16 at 5001), each called
twice and then replayed twice from a CUDA graph (the flags a call leaves must be zero), each
stream-K tile; they accumulate among the directly run configurations.

``python3 tests/kernels/test_gemm_cuda.py --prebuild --workers 15`` compiles every program these
tests and ``tileops bench GemmAccumulateFwdOp`` (the spec workloads at full size) use in spawned
processes first, so they load them from TileLang's disk cache.
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]

import pytest

torch = pytest.importorskip("torch")

from tileops.kernels import gemm as G  # noqa: E402
from tileops.runtime import select  # noqa: E402

pytestmark = pytest.mark.cuda
if __name__ != "__main__" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = torch.device("cuda")
TRANS = [(False, False), (False, True), (True, False), (True, True)]
IMPLS = (G.GemmHopperKernel, G.GemmSmallMKernel, G.GemmGemvKernel, G.GemmPaddedKernel,
         G.GemmGeneralKernel)
#: (M, N, K) through the op: the implementation each reaches on an H200
SIZES = {(1, 4096, 4096): "small-M (gemv with b stored (N, K))", (48, 256, 512): "small-M 64x64",
         (128, 4096, 4096): "Hopper 64x64", (2048, 4096, 4096): "Hopper 128x256 persistent",
         (1000, 1000, 1000): "Hopper, tails", (333, 4097, 4095): "padded",
         (7, 13, 1): "general", (1, 1, 1): "general"}
FP16_SIZES = [(1, 4096, 4096), (2048, 4096, 4096), (333, 4097, 4095)]
#: the fused loss's dweight: [V, H] += z.T [V, rows] @ h [rows, H]
FLCE = [(128256, 4096, 1024), (128256, 4096, 2048)]
TOL = 1e-2  # relative L2 error, bf16 and fp16 outputs
NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _operands(m, n, k, ta, tb, dtype, device=DEV):
    g = torch.Generator(device=device).manual_seed(m * 7919 + n * 31 + k)
    c = torch.randn((m, n), dtype=dtype, device=device, generator=g)
    a = torch.randn((k, m) if ta else (m, k), dtype=dtype, device=device, generator=g)
    b = torch.randn((n, k) if tb else (k, n), dtype=dtype, device=device, generator=g)
    return c, a, b


def _ref(c, a, b, ta, tb):
    a, b = a.double(), b.double()
    return c.double() + (a.T if ta else a) @ (b.T if tb else b)


def _rel(out, ref) -> float:
    out = out.double()
    assert not torch.isnan(out).any(), "an output element is NaN"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _op(ta, tb):
    from tileops.ops import GemmAccumulateFwdOp

    return GemmAccumulateFwdOp(trans_a=ta, trans_b=tb)


def _op_cases():
    for (m, n, k), what in SIZES.items():
        for ta, tb in TRANS:
            yield pytest.param(m, n, k, ta, tb, torch.bfloat16,
                               id=f"{m}x{n}x{k}-{'NT'[ta]}{'NT'[tb]}-bf16 ({what})")
    for m, n, k in FP16_SIZES:
        for ta, tb in ((False, False), (False, True)):
            yield pytest.param(m, n, k, ta, tb, torch.float16,
                               id=f"{m}x{n}x{k}-{'NT'[ta]}{'NT'[tb]}-fp16")
    for m, n, k in FLCE:
        yield pytest.param(m, n, k, True, False, torch.bfloat16, id=f"flce-dweight-rows{k}")


@pytest.mark.parametrize(("m", "n", "k", "ta", "tb", "dtype"), list(_op_cases()))
def test_accumulate(m, n, k, ta, tb, dtype):
    c, a, b = _operands(m, n, k, ta, tb, dtype)
    ref = _ref(c, a, b, ta, tb)
    op = _op(ta, tb)
    assert op(c, a, b) is c
    assert op.serving_target == "tileops"
    assert _rel(c, ref) < TOL
    del ref
    torch.cuda.empty_cache()


def test_which_implementation_serves():
    want = {(1, 4096, 4096, False): G.GemmSmallMKernel, (1, 4096, 4096, True): G.GemmGemvKernel,
            (2048, 4096, 4096, False): G.GemmHopperKernel,
            (333, 4097, 4095, False): G.GemmPaddedKernel, (7, 13, 1, False): G.GemmGeneralKernel}
    if torch.cuda.get_device_capability() != (9, 0):
        want[(2048, 4096, 4096, False)] = want[(333, 4097, 4095, False)] = G.GemmGeneralKernel
    for (m, n, k, tb), impl in want.items():
        op = _op(False, tb)
        op(*_operands(m, n, k, False, tb, torch.bfloat16))
        built = [e for entries in op.built_entries.values() for e in entries.values()]
        assert [type(e) for e in built] == [impl], (m, n, k, tb, built)
        assert built[0].spec.accumulate


def test_the_sum_is_rounded_once():
    """c + a @ b summed in fp32 and rounded once is closer to float64 than the product rounded
    to bfloat16 first and then added (what two kernels, or an unfused epilogue, would give):
    c is large beside the product, so rounding the product first loses its low bits twice."""
    c, a, b = _operands(2048, 4096, 256, False, False, torch.bfloat16)
    c.mul_(16)
    ref = _ref(c, a, b, False, False)
    twice = (c.float() + (a @ b).float()).to(torch.bfloat16)
    _op(False, False)(c, a, b)
    once_err = (c.double() - ref).abs().mean().item()
    twice_err = (twice.double() - ref).abs().mean().item()
    assert once_err < 0.9 * twice_err, (once_err, twice_err)


def _plan(m, n, k, ta, tb, dtype="bfloat16"):
    return G.plan_of(G.GemmSpec(device=DEV, m=m, n=n, k=k, dtype=dtype, trans_a=ta,
                                trans_b=tb, accumulate=True))


def _split_cases():
    for name, (m, n, k) in (("128x128s4", (1000, 1000, 1000)), ("128x256s2", (200, 512, 4096)),
                            ("64x128s2", (136, 4096, 72))):
        for ta, tb in TRANS:
            yield pytest.param(G.HOPPER_SPLIT_CONFIGS[name], m, n, k, ta, tb,
                               id=f"{name}-{m}x{n}x{k}-{'NT'[ta]}{'NT'[tb]}")
    for name, (m, n, k) in (("16x256s8", (1, 4096, 4096)), ("16x64s4", (5, 1000, 1000)),
                            ("64x64s2", (48, 256, 520))):
        for ta, tb in ((False, False), (False, True)):
            yield pytest.param(G.SMALL_M_SPLIT_CONFIGS[name], m, n, k, ta, tb,
                               id=f"{name}-{m}x{n}x{k}-{'NT'[ta]}{'NT'[tb]}")


def _tile_order_cases():
    """Every Hopper tile in both tile orders (M a multiple of 8: a transposed a's rows are M
    long, and TMA needs them 16-byte aligned), tails on every side."""
    other = {(c.block_m, c.block_n): c for c in G.HOPPER_ORDER_CONFIGS.values()}
    sizes = {"128x256": (2104, 4104, 264), "128x128": (136, 1000, 1000),
             "64x128": (1000, 1000, 1000), "64x64": (4104, 520, 72)}
    for name, (cfg, _) in G.HOPPER_CONFIGS.items():
        m, n, k = sizes[name]
        for c in (cfg, other[cfg.block_m, cfg.block_n]):
            for ta, tb in TRANS:
                yield pytest.param(c, m, n, k, ta, tb,
                                   id=f"{c.label()}-{m}x{n}x{k}-{'NT'[ta]}{'NT'[tb]}")


def _stream_k_accumulate_cases():
    """Each stream-K tile accumulating: tiles shared by K steps (5001 and 1000 rows), whole
    waves with a shared tail (8191 x 4096), every layout."""
    for name, cfg in G.HOPPER_STREAM_K_CONFIGS.items():
        for (m, n, k), layouts in (((5001, 1000, 1000), TRANS[:2]), ((1000, 1000, 1000), TRANS[2:]),
                                   ((8191, 4096, 1000), TRANS[1:2])):
            for ta, tb in layouts:
                yield pytest.param(cfg, m, n, k, ta, tb,
                                   id=f"{name}-{m}x{n}x{k}-{'NT'[ta]}{'NT'[tb]}")


def _gemv_cases():
    for name, cfg in G.GEMV_CONFIGS.items():
        for ta in (False, True):
            yield pytest.param(cfg, 1, 1001, 4104, ta, True, id=f"gemv-{name}-{'NT'[ta]}T")


def _direct_cases():
    yield from _split_cases()
    yield from _tile_order_cases()
    yield from _stream_k_accumulate_cases()
    yield from _gemv_cases()


def _direct_impl(cfg, m):
    if cfg in G.GEMV_CONFIGS.values():
        return G.GemmGemvKernel
    return G.GemmSmallMKernel if m <= G.SMALL_M else G.GemmHopperKernel


@pytest.mark.parametrize(("cfg", "m", "n", "k", "ta", "tb"), list(_direct_cases()))
def test_configuration_accumulates(cfg, m, n, k, ta, tb):
    """A configuration run directly on the implementation of its kind (bypassing the
    heuristic): split-K's reduction adds c, both tile orders load it per tile."""
    if cfg.tma and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA kernels need sm_90")
    c, a, b = _operands(m, n, k, ta, tb, torch.bfloat16)
    ref = _ref(c, a, b, ta, tb)
    kern = _direct_impl(cfg, m)(_plan(m, n, k, ta, tb))
    kern.config, kern.program = cfg, kern._build(cfg)
    kern(a, b, c)
    assert _rel(c, ref) < TOL


@pytest.mark.parametrize(("cfg", "m", "n", "k", "ta", "tb"),
                         [p for p in _tile_order_cases() if p.values[0].persistent])
def test_the_persistent_programs_also_accumulate_with_c_loaded_first(monkeypatch, cfg, m, n,
                                                                      k, ta, tb):
    """The persistent tiles with C loaded by the math warps before the first MMA (``G.C_PREFETCH``
    off; test_configuration_accumulates runs the default, C fetched under the last MMAs)."""
    monkeypatch.setattr(G, "C_PREFETCH", False)
    test_configuration_accumulates(cfg, m, n, k, ta, tb)


@pytest.mark.parametrize(("m", "n", "k"), [(2048, 4096, 1024), (4096, 8192, 256)])
def test_a_chain_of_prefetching_accumulations_reads_each_previous_write(monkeypatch, m, n, k):
    """Twenty launches into one c, each starting before the previous one ends, with C
    fetched by the load warp (the fused loss's ``dweight`` sum)."""
    monkeypatch.setattr(G, "C_PREFETCH", True)
    c, a, b = _operands(m, n, k, True, False, torch.bfloat16)
    b.mul_(0.25)
    kern = G.GemmHopperKernel(_plan(m, n, k, True, False))  # built here: no cached entry
    assert kern.config.persistent
    ref = c.double()
    for i in range(20):
        a.normal_()
        ref = ref + _ref(torch.zeros_like(c), a, b, True, False)
        kern(a, b, c)
        assert _rel(c, ref) < 2 * TOL, i


@pytest.mark.parametrize(("m", "n", "k", "tb"), [(0, 256, 64, False), (16, 0, 64, False),
                                                (16, 256, 0, False), (1, 8, 0, True),
                                                (2048, 4096, 0, False), (0, 256, 64, True)])
def test_k0_and_empty_calls_leave_c_as_it_is(m, n, k, tb):
    c, a, b = _operands(m, n, k, False, tb, torch.bfloat16)
    before = c.clone()
    assert _op(False, tb)(c, a, b) is c
    assert torch.equal(c, before)


@pytest.mark.parametrize(("m", "n", "k", "ta"), [(1, 4096, 4096, False), (128, 1024, 1024, False),
                                                (2048, 2048, 1024, True),
                                                (333, 4097, 4095, False)])
def test_a_chain_of_accumulations_reads_each_previous_write(m, n, k, ta):
    """Each launch starts before the previous one ends (programmatic dependent launch) and
    must read c only after it: twenty accumulations into one c, as the fused loss's blocks,
    against the float64 running sum (twice the tolerance: c is rounded to bfloat16 twenty
    times, a relative error of about 4e-3 by the end; a launch that read a stale c would be
    off by a whole product)."""
    c, a, b = _operands(m, n, k, ta, False, torch.bfloat16)
    b.mul_(0.25)
    op = _op(ta, False)
    ref = c.double()
    for i in range(20):
        a.normal_()  # written by the kernel right before the GEMM that reads it
        ref = ref + _ref(torch.zeros_like(c), a, b, ta, False)
        op(c, a, b)
        assert _rel(c, ref) < 2 * TOL, i


def test_a_strided_c_is_written_back():
    c0, a, b = _operands(256, 512, 384, False, False, torch.bfloat16)
    ref = _ref(c0, a, b, False, False)
    c = torch.empty(256, 1024, dtype=torch.bfloat16, device=DEV)[:, ::2]
    c.copy_(c0)
    assert _op(False, False)(c, a, b) is c
    assert _rel(c, ref) < TOL


def test_a_c_overlapping_an_operand_is_refused_before_any_launch():
    buf = torch.randn(512, 256, dtype=torch.bfloat16, device=DEV)
    before = buf.clone()
    op = _op(False, False)
    with pytest.raises(RuntimeError, match="shares memory with a"):
        op(buf[:256], buf[128:384], torch.randn(256, 256, dtype=torch.bfloat16, device=DEV))
    torch.cuda.synchronize()
    assert torch.equal(buf, before) and not op.built_entries


def test_cuda_graph_replay_accumulates():
    c, a, b = _operands(2048, 4096, 1024, True, False, torch.bfloat16)
    op = _op(True, False)
    work = c.clone()
    op(work, a, b)  # builds the entry
    work.copy_(c)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        op(work, a, b)
    work.copy_(c)
    g.replay()
    g.replay()
    torch.cuda.synchronize()
    prod = _ref(torch.zeros_like(c), a, b, True, False)
    assert _rel(work, c.double() + 2 * prod) < TOL


def test_torch_compile_fullgraph_mutates_c():
    import operator

    c, a, b = _operands(128, 4096, 4096, False, True, torch.bfloat16)
    ref = _ref(c, a, b, False, True)
    op = _op(False, True)
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x, y, z: op(x, y, z), backend=backend, fullgraph=True)
    got = compiled(c, a, b)
    calls = [n.target for n in graphs[0].graph.nodes
             if n.op == "call_function" and n.target is not operator.getitem]
    assert len(calls) == 1
    assert torch.equal(got, c)  # the result is c, written in place
    assert _rel(c, ref) < TOL


# --- stream-K ---------------------------------------------------------------------------------

#: (M, N, K): the shapes with few tiles and short K (tiles of 128 x 256 on 132 SMs: 160, 96,
#: 32, 256 and 34), whole waves (528 tiles: none shared; 1056 of 128 x 128) and whole waves
#: with a shared tail (1024 tiles: 792 whole, 232 shared; 2048 of 128 x 128: 1848 and 200)
STREAM_K_SIZES = [(5001, 1000, 1000), (2999, 1000, 1000), (1000, 1000, 1000),
                  (333, 4096, 1000), (8191, 1000, 1000), (4224, 4096, 1000),
                  (8191, 4096, 1000)]


def _plain_plan(m, n, k, ta, tb, dtype="bfloat16"):
    return G.plan_of(G.GemmSpec(device=DEV, m=m, n=n, k=k, dtype=dtype, trans_a=ta,
                                trans_b=tb))


def _stream_k_cases():
    for name, cfg in G.HOPPER_STREAM_K_CONFIGS.items():
        for m, n, k in STREAM_K_SIZES:
            for ta, tb in ((False, False), (False, True)):
                yield pytest.param(cfg, m, n, k, ta, tb, torch.bfloat16,
                                   id=f"{name}-{m}x{n}x{k}-{'NT'[ta]}{'NT'[tb]}-bf16")
        for ta, tb in ((True, False), (True, True)):  # a transposed: M a multiple of 8 (TMA)
            yield pytest.param(cfg, 1000, 1000, 1000, ta, tb, torch.bfloat16,
                               id=f"{name}-1000x1000x1000-{'NT'[ta]}{'NT'[tb]}-bf16")
        yield pytest.param(cfg, 5001, 1000, 1000, False, True, torch.float16,
                           id=f"{name}-5001x1000x1000-NT-fp16")


@pytest.mark.parametrize(("cfg", "m", "n", "k", "ta", "tb", "dtype"), list(_stream_k_cases()))
def test_stream_k(cfg, m, n, k, ta, tb, dtype):
    """The stream-K program against float64, twice eagerly and twice from a graph, every
    element poisoned first; every flag zero after each call."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the stream-K program needs sm_90")
    _, a, b = _operands(m, n, k, ta, tb, dtype)
    ref = (a.T if ta else a).double() @ (b.T if tb else b).double()
    kern = G.GemmHopperKernel(_plain_plan(m, n, k, ta, tb, NAMES[dtype]))
    kern.config, kern.program = cfg, kern._build(cfg)
    assert isinstance(kern.program, G.StreamKLaunch)
    c = torch.empty((m, n), dtype=dtype, device=DEV)
    _, flags = kern.program.buffers(c.device)

    def check(run):
        c.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        assert _rel(c, ref) < TOL
        assert not flags.any(), flags.nonzero().flatten().tolist()

    for _ in range(2):  # the second call sees the flags the first one left
        check(lambda: kern(a, b, c))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern(a, b, c)
    for _ in range(2):
        check(graph.replay)


# --- the prebuild ----------------------------------------------------------------------------

#: (M, N, K, trans_a, trans_b) of the calls outside :func:`_op_cases` (bfloat16): the rounding,
#: the chains, the strided c, the graph
_OTHER_CALLS = [(2048, 4096, 256, False, False), (128, 1024, 1024, False, False),
                (2048, 2048, 1024, True, False), (256, 512, 384, False, False),
                (2048, 4096, 1024, True, False), (4096, 8192, 256, True, False)]


def _workload_calls():
    """The spec workloads of GemmAccumulateFwdOp at their full sizes (what ``tileops bench``
    runs): ``(M, N, K, trans_a, trans_b, dtype name)``."""
    from tileops.ops import GemmAccumulateFwdOp
    from tileops.ops.workloads import cases_of

    return [(v["M"], v["N"], v["K"], v["trans_a"], v["trans_b"], v["T"])
            for v in (case.values for case in cases_of(GemmAccumulateFwdOp, max_elements=0))]


def program_keys():
    """``(implementation, plan, configuration or None)`` of every entry the tests and the
    bench of the spec workloads build: the op's selection (the heuristic's configuration) and
    the directly run configurations."""
    keys = {}
    cases = [(m, n, k, ta, tb, NAMES[d]) for m, n, k, ta, tb, d in
             (p.values for p in _op_cases())]
    cases += [(*size, "bfloat16") for size in _OTHER_CALLS]
    cases += _workload_calls()
    for m, n, k, ta, tb, dt in cases:
        if n * k == 0:  # nothing is built (an empty M still builds its bucket's program)
            continue
        plan = _plan(m, n, k, ta, tb, dt)
        keys[(select(G.GemmFwdInterface, IMPLS, plan).__name__, plan, None)] = None
    for p in _direct_cases():
        cfg, m, n, k, ta, tb = p.values
        impl = _direct_impl(cfg, m)
        keys[(impl.__name__, _plan(m, n, k, ta, tb), cfg)] = None
    for p in _stream_k_cases():
        cfg, m, n, k, ta, tb, dtype = p.values
        keys[("GemmHopperKernel", _plain_plan(m, n, k, ta, tb, NAMES[dtype]), cfg)] = None
    return list(keys)


def _build(key):
    name, plan, cfg = key
    kern = getattr(G, name)(plan)  # builds the heuristic's program
    if cfg is not None:
        kern._build(cfg)
    if plan.accumulate and (cfg or kern.config).persistent:  # and the other form of C's load
        G.C_PREFETCH = not G.C_PREFETCH
        try:
            kern._build(cfg or kern.config)
        finally:
            G.C_PREFETCH = not G.C_PREFETCH


def _describe(key) -> str:
    name, plan, cfg = key
    return (f"{name} {plan.m}x{plan.n}x{plan.k} {'NT'[plan.trans_a]}{'NT'[plan.trans_b]} "
            f"{plan.dtype} {cfg.label() if cfg else 'heuristic'}")


def main(argv=None) -> int:
    from _prebuild import main as prebuild  # beside this file, which runs as a script here

    return prebuild(program_keys, _build, _describe, argv)


if __name__ == "__main__":
    sys.exit(main())
