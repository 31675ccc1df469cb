"""The norm ops' TileLang kernels on the GPU, against an fp64 reference.

Grid: row lengths N that exercise every code path (1 and 7: shorter than a warp, scalar
accesses; 128: several rows a CTA; 4096/8192: LLM hidden sizes, 16-byte accesses; 4097: a
length no vector divides; 65536: too wide for registers, the looped kernel), row counts
(1, 3, 2048, 32768) and extra batch dims. Inputs are fresh random values; outputs are poisoned
(the allocator hands back memory just filled with NaN) so an unwritten element fails.
Beyond the grid, every row length from 1 to 2**20 must work: hypothesis samples that space, with
the lengths TileLang once failed to lower (N mod 2**16 >= 2**15: 100000, 2**20 - 1) explicit.
"""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from tileops.ops import FusedAddRMSNormFwdOp, LayerNormFwdOp, RMSNormFwdOp  # noqa: E402


def rms_norm_reference(x, weight, dims, eps):
    """fp64 RMSNorm over the last ``dims`` axes (computed here, independent of the op's)."""
    axes = tuple(range(-dims, 0))
    out = x * torch.rsqrt(x.pow(2).mean(dim=axes, keepdim=True) + eps)
    return out if weight is None else out * weight


def layer_norm_reference(x, weight, bias, dims, eps):
    axes = tuple(range(-dims, 0))
    mean = x.mean(dim=axes, keepdim=True)
    out = (x - mean) * torch.rsqrt((x - mean).pow(2).mean(dim=axes, keepdim=True) + eps)
    out = out if weight is None else out * weight
    return out if bias is None else out + bias

pytestmark = pytest.mark.cuda

# relative L2 error bounds: one rounding of the output dominates (bf16 8 bits, fp16 11 bits)
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
NS = (1, 7, 128, 4096, 4097, 8192, 65536)
ROWS = (1, 3, 2048, 32768)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _grid():
    for n in NS:
        for m in ROWS:
            if m * n > 2**27:  # keep the fp64 reference within a few GB
                continue
            for dt in DTYPES:
                yield pytest.param(m, n, dt, id=f"m{m}-n{n}-{str(dt)[6:]}")


def _poison(numel: int, dtype) -> None:
    junk = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
    del junk


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    assert not torch.isnan(out).any(), "an output element was never written"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize(("m", "n", "dtype"), list(_grid()))
def test_rms_norm(m, n, dtype):
    x = torch.randn(m, n, dtype=dtype, device="cuda")
    w = torch.randn(n, dtype=dtype, device="cuda")
    op = RMSNormFwdOp(normalized_shape=[n], eps=1e-6)
    _poison(m * n, dtype)
    y = op(x, w)
    assert op.serving_target == "tileops"
    ref = rms_norm_reference(x.double(), w.double(), 1, 1e-6)
    assert _rel(y, ref) < TOL[dtype]


@pytest.mark.parametrize(("m", "n", "dtype"), list(_grid()))
def test_layer_norm(m, n, dtype):
    x = torch.randn(m, n, dtype=dtype, device="cuda") * 3 + 1
    w = torch.randn(n, dtype=dtype, device="cuda")
    b = torch.randn(n, dtype=dtype, device="cuda")
    op = LayerNormFwdOp(normalized_shape=n)
    _poison(m * n, dtype)
    y = op(x, w, b)
    ref = layer_norm_reference(x.double(), w.double(), b.double(), 1, 1e-5)
    if n == 1:  # a single element normalizes to exactly the bias
        ref = b.double().expand(m, 1)
    assert _rel(y, ref) < TOL[dtype]


@pytest.mark.parametrize(("m", "n", "dtype"), list(_grid()))
@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
def test_fused_add_rms_norm(m, n, dtype, inplace):
    x = torch.randn(m, n, dtype=dtype, device="cuda")
    r = torch.randn(m, n, dtype=dtype, device="cuda")
    w = torch.randn(n, dtype=dtype, device="cuda")
    s_ref = (x.double() + r.double()).to(dtype)  # residual_out is rounded to the dtype
    ref = rms_norm_reference(s_ref.double(), w.double(), 1, 1e-6)
    op = FusedAddRMSNormFwdOp(eps=1e-6, inplace=inplace)
    _poison(2 * m * n, dtype)
    y, s = op(x, r, w)
    if inplace:
        assert y is x and s is r
    assert torch.equal(s, s_ref)
    assert _rel(y, ref) < TOL[dtype]


# Any row length: the register kernel's lengths (up to 2**15) drawn as often as the looped one's;
# a few rows (the latency plan) or more than FEW_ROWS. Each example builds a kernel (seconds).
ANY_N = st.one_of(st.integers(1, 1 << 15), st.integers(1, 1 << 20))
ANY_ROWS = st.sampled_from([1, 5, 160])
ANY_DTYPE = st.sampled_from(DTYPES)
SAMPLED = settings(max_examples=15, deadline=None)


def _rows(m: int, n: int) -> int:
    """``m`` rows, fewer where the row is wide: at most 2**24 elements (the fp64 reference)."""
    return max(1, min(m, (1 << 24) // n))


@SAMPLED
@given(n=ANY_N, m=ANY_ROWS, dtype=ANY_DTYPE, weight=st.booleans())
@example(n=100000, m=5, dtype=torch.bfloat16, weight=True)
@example(n=(1 << 20) - 1, m=1, dtype=torch.float16, weight=False)
def test_rms_norm_any_row_length(n, m, dtype, weight):
    m = _rows(m, n)
    x = torch.randn(m, n, dtype=dtype, device="cuda")
    w = torch.randn(n, dtype=dtype, device="cuda") if weight else None
    op = RMSNormFwdOp(normalized_shape=[n], eps=1e-6)
    _poison(m * n, dtype)
    y = op(x, w)
    assert op.serving_target == "tileops"
    ref = rms_norm_reference(x.double(), None if w is None else w.double(), 1, 1e-6)
    assert _rel(y, ref) < TOL[dtype]


@SAMPLED
@given(n=ANY_N, m=ANY_ROWS, dtype=ANY_DTYPE, weight=st.booleans(), bias=st.booleans())
@example(n=100000, m=5, dtype=torch.bfloat16, weight=True, bias=True)
@example(n=(1 << 20) - 1, m=1, dtype=torch.float32, weight=False, bias=True)
@example(n=32768, m=160, dtype=torch.float32, weight=True, bias=False)
def test_layer_norm_any_row_length(n, m, dtype, weight, bias):
    m = _rows(m, n)
    x = torch.randn(m, n, dtype=dtype, device="cuda") * 3 + 1
    w = torch.randn(n, dtype=dtype, device="cuda") if weight else None
    b = torch.randn(n, dtype=dtype, device="cuda") if bias else None
    op = LayerNormFwdOp(normalized_shape=n)
    _poison(m * n, dtype)
    y = op(x, w, b)
    assert op.serving_target == "tileops"
    if n == 1:  # a single element normalizes to exactly zero, then the bias
        ref = torch.zeros(m, 1, dtype=torch.float64, device="cuda")
        ref = ref if b is None else ref + b.double()
        assert torch.equal(y.double(), ref)
        return
    ref = layer_norm_reference(x.double(), None if w is None else w.double(),
                               None if b is None else b.double(), 1, 1e-5)
    assert _rel(y, ref) < TOL[dtype]


@SAMPLED
@given(n=ANY_N, m=ANY_ROWS, dtype=ANY_DTYPE, weight=st.booleans(), inplace=st.booleans())
@example(n=100000, m=5, dtype=torch.bfloat16, weight=True, inplace=False)
@example(n=(1 << 20) - 1, m=1, dtype=torch.float16, weight=True, inplace=True)
def test_fused_add_rms_norm_any_row_length(n, m, dtype, weight, inplace):
    m = _rows(m, n)
    x = torch.randn(m, n, dtype=dtype, device="cuda")
    r = torch.randn(m, n, dtype=dtype, device="cuda")
    w = torch.randn(n, dtype=dtype, device="cuda") if weight else None
    s_ref = (x.double() + r.double()).to(dtype)  # residual_out is rounded to the dtype
    ref = rms_norm_reference(s_ref.double(), None if w is None else w.double(), 1, 1e-6)
    op = FusedAddRMSNormFwdOp(eps=1e-6, inplace=inplace)
    _poison(2 * m * n, dtype)
    y, s = op(x, r, w)
    assert op.serving_target == "tileops"
    assert torch.equal(s, s_ref)
    assert _rel(y, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batch_dims_and_no_weight(dtype):
    x = torch.randn(4, 3, 5, 4096, dtype=dtype, device="cuda")
    y = RMSNormFwdOp(normalized_shape=[4096])(x)
    # eps None: float32's epsilon for a bfloat16 x too (the math's dtype), as torch's rms_norm
    ref = rms_norm_reference(x.double(), None, 1, torch.finfo(torch.float32).eps)
    assert y.shape == x.shape and _rel(y, ref) < TOL[dtype]
    x2 = torch.randn(6, 8, 64, dtype=dtype, device="cuda")  # normalized over two axes
    y2 = LayerNormFwdOp(normalized_shape=[8, 64])(x2)
    ref2 = layer_norm_reference(x2.double(), None, None, 2, 1e-5)
    assert _rel(y2, ref2) < TOL[dtype]


def test_non_contiguous_input_is_handled():
    base = torch.randn(4096, 256, dtype=torch.bfloat16, device="cuda")
    x = base.t()  # (256, 4096), strides (1, 256)
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    y = RMSNormFwdOp(normalized_shape=[4096], eps=1e-6)(x, w)
    ref = rms_norm_reference(x.double(), w.double(), 1, 1e-6)
    assert _rel(y, ref) < TOL[torch.bfloat16]


def test_cuda_graph_replay_matches_eager():
    ops = [
        (RMSNormFwdOp(normalized_shape=[4096], eps=1e-6), 1),
        (LayerNormFwdOp(normalized_shape=[4096]), 2),
        (FusedAddRMSNormFwdOp(), 2),
    ]
    for op, _ in ops:
        x = torch.randn(8, 4096, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
        args = (x, x.clone(), w) if isinstance(op, FusedAddRMSNormFwdOp) else (
            (x, w, w) if isinstance(op, LayerNormFwdOp) else (x, w))
        eager = op(*args)  # warm-up: builds the kernel outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            captured = op(*args)
        g.replay()
        torch.cuda.synchronize()
        eager = eager if isinstance(eager, tuple) else (eager,)
        captured = captured if isinstance(captured, tuple) else (captured,)
        for a, b in zip(eager, captured, strict=True):
            assert torch.equal(a, b)


def _norm_cases():
    x = torch.randn(64, 4096, dtype=torch.bfloat16, device="cuda")
    r = torch.randn(64, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, dtype=torch.bfloat16, device="cuda")
    return [
        (RMSNormFwdOp(normalized_shape=[4096], eps=1e-6), (x, w)),
        (LayerNormFwdOp(normalized_shape=[4096]), (x, w, w)),
        (FusedAddRMSNormFwdOp(), (x, r, w)),
    ]


def test_torch_compile_fullgraph_cold_builds_nothing_while_tracing():
    import operator

    for op, args in _norm_cases():
        torch._dynamo.reset()
        graphs = []

        def backend(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm.forward

        assert not op._built_entries  # cold: this instance has built nothing
        compiled = torch.compile(lambda *a, op=op: op(*a), backend=backend, fullgraph=True)
        got = compiled(*args)
        calls = [n.target for n in graphs[0].graph.nodes
                 if n.op == "call_function" and n.target is not operator.getitem]
        assert len(calls) == 1
        name = "tileops::" + str(calls[0]).split(".")[1]  # tileops.<name>.default
        assert name in type(op).compile_op_names
        want = op(*args)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def test_capture_before_warm_up_raises_a_clear_error():
    op = RMSNormFwdOp(normalized_shape=[4096], eps=1e-6)
    x = torch.randn(8, 4096, dtype=torch.bfloat16, device="cuda")
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="during CUDA graph capture"), torch.cuda.graph(g):
        op(x)
    torch.cuda.synchronize()
    assert op.last_call is None and op.serving_target is None  # the failed call kept nothing
    op(x)  # and the op is still usable


def test_misaligned_views_are_handled_or_refused():
    n = 4096
    base = torch.randn(8 * n + 1, dtype=torch.bfloat16, device="cuda")
    x = base[1:].view(8, n)  # starts 2 bytes past a 16-byte boundary
    w = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    y = RMSNormFwdOp(normalized_shape=[n], eps=1e-6)(x, w)
    assert _rel(y, rms_norm_reference(x.double(), w.double(), 1, 1e-6)) < TOL[torch.bfloat16]
    r = torch.randn(8, n, dtype=torch.bfloat16, device="cuda")
    # in place on a misaligned view: the kernel runs on aligned copies, and the results are
    # written back into the caller's x and residual
    x2, r2 = x.clone(), r.clone()
    xi = torch.randn(8 * n + 1, dtype=torch.bfloat16, device="cuda")[1:].view(8, n)
    xi.copy_(x2)
    y_in, s_in = FusedAddRMSNormFwdOp(inplace=True)(xi, r2, w)
    assert y_in is xi and s_in is r2
    s_ref = (x2.float() + r.float()).to(torch.bfloat16)
    assert torch.equal(r2, s_ref)
    assert _rel(xi, rms_norm_reference(s_ref.double(), w.double(), 1, 1e-6)) < \
        TOL[torch.bfloat16]
    y, s = FusedAddRMSNormFwdOp()(x, r, w)  # out of place: handled
    assert torch.equal(s, (x.float() + r.float()).to(torch.bfloat16))


# --- the cluster kernel: fewer rows than SMs of rows of 128 KiB or more ----------------------

@pytest.mark.parametrize(("m", "n", "dtype"), [
    (8, 131072, torch.bfloat16), (1, 131072, torch.bfloat16), (16, 100000, torch.bfloat16),
    (3, 65536, torch.float32), (32, 65536, torch.float16), (33, 98304, torch.bfloat16),
    (2, 65537, torch.bfloat16),
])
def test_cluster_kernel_matches_float64(m, n, dtype):
    """Few rows of a wide row through the cluster kernel (the ops' own choice there): each
    norm against float64, the cluster kernel the one that ran, a fused add's residual exact."""
    from tileops.kernels.norm import RowNormClusterKernel, cluster_plan

    assert cluster_plan(m, n, str(dtype)[6:]) is not None  # each case splits its rows
    x = torch.randn(m, n, dtype=dtype, device="cuda") * 2 + 0.5
    w = torch.randn(n, dtype=dtype, device="cuda")
    b = torch.randn(n, dtype=dtype, device="cuda")
    r = torch.randn(m, n, dtype=dtype, device="cuda")
    cases = [
        (RMSNormFwdOp(normalized_shape=[n], eps=1e-6), (x, w),
         lambda: rms_norm_reference(x.double(), w.double(), 1, 1e-6)),
        (LayerNormFwdOp(normalized_shape=n), (x, w, b),
         lambda: layer_norm_reference(x.double(), w.double(), b.double(), 1, 1e-5)),
    ]
    for op, args, ref in cases:
        _poison(m * n, dtype)
        y = op(*args)
        assert _rel(y, ref()) < TOL[dtype], type(op).__name__
        built = [type(e) for es in op.built_entries.values() for e in es.values()]
        assert built == [RowNormClusterKernel], built
    add = FusedAddRMSNormFwdOp(eps=1e-6)
    y, s = add(x, r, w)
    s_ref = (x.float() + r.float()).to(dtype)
    assert torch.equal(s, s_ref)
    assert _rel(y, rms_norm_reference(s_ref.double(), w.double(), 1, 1e-6)) < TOL[dtype]


# --- the split kernel: few RMS rows of 256-512 KiB or more ----------------------------------

@pytest.mark.parametrize(("m", "n", "dtype", "affine"), [
    (16, 131072, torch.bfloat16, True), (33, 131072, torch.bfloat16, True),
    (64, 262144, torch.bfloat16, True), (48, 140000, torch.float16, True),
    (24, 131073, torch.bfloat16, True), (20, 65536, torch.float32, True),
    (40, 131072, torch.bfloat16, False), (1, 1048576, torch.bfloat16, True),
    (6, 300000, torch.float16, True), (33, 524288, torch.bfloat16, True),
])
def test_split_kernel_matches_float64(m, n, dtype, affine):
    """Few rows of a wide RMS row through the split kernel (the op's own choice there), against
    float64: predicated last shares, scalar accesses, no weight; the kernel the one that ran,
    and the same result from a second call (the partials are summed in one order)."""
    from tileops.kernels.norm import RowNormSplitKernel

    x = torch.randn(m, n, dtype=dtype, device="cuda") * 2 + 0.5
    w = torch.randn(n, dtype=dtype, device="cuda") if affine else None
    op = RMSNormFwdOp(normalized_shape=[n], eps=1e-6)
    _poison(m * n, dtype)
    y = op(x, w)
    want = rms_norm_reference(x.double(), w.double() if affine else None, 1, 1e-6)
    assert _rel(y, want) < TOL[dtype]
    built = [type(e) for es in op.built_entries.values() for e in es.values()]
    assert built == [RowNormSplitKernel], built
    assert torch.equal(op(x, w), y)
