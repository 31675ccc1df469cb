"""The cross-entropy kernels on a GPU against torch in float64, through the ops as a training
step calls them (the loss, then its backward).

Fresh random logits (3 sigma, so rows are neither uniform nor one-hot) and targets over the
whole vocabulary, one row in 32 ignored. Tolerances:
- the loss within 1e-3 relative of the float64 loss (per row for reduction none; ignored rows
  exactly 0);
- each gradient element within ``eps(dtype) + 1e-3`` relative of the float64 gradient (the
  element is computed in fp32 and rounded once to the logits' dtype), plus 1e-6 of the row's
  largest element (where the smoothing's constant cancels the softmax) and float16's smallest
  subnormal where it underflows (a softmax of 1e-9 is below float16's range).

``python3 tests/kernels/test_cross_entropy_cuda.py --prebuild --workers 15`` compiles every
program these tests use in spawned processes first, so the tests load them from TileLang's
disk cache; ``--sweep`` times the kept program's launch plans at the bar's shape (see
:func:`sweep`).
"""

import sys
from pathlib import Path

if __name__ == "__main__":  # the prebuild entry point imports from the packages' sources
    sys.path[:0] = [str(p) for p in sorted(
        (Path(__file__).resolve().parents[2] / "packages").glob("*/src"))]

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from tileops.kernels import cross_entropy as C  # noqa: E402

pytestmark = pytest.mark.cuda
if __name__ != "__main__" and not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EVERY = {"label_smoothing": 0.1, "lse_square_scale": 1e-4, "softcap": 30.0}

# (rows, classes, dtype, options): why each exists is on its line
CASES = [
    pytest.param(8192, 128256, "bfloat16", {}, id="bar-llama3"),
    pytest.param(4096, 32000, "float16", {"reduction": "sum"}, id="llama2-fp16-sum"),
    pytest.param(1024, 262144, "bfloat16", {}, id="v262144-past-l2"),
    pytest.param(3, 7, "float32", {}, id="tiny-fp32"),
    pytest.param(3, 7, "bfloat16", {"reduction": "none"}, id="tiny-none"),
    pytest.param(257, 4097, "bfloat16", {**EVERY, "reduction": "none"}, id="odd-every-option"),
    pytest.param(1000, 50257, "float32", {"label_smoothing": 0.1}, id="gpt2-fp32-smoothing"),
    pytest.param(512, 128256, "bfloat16", {"softcap": 30.0, "ignore_index": -1},
                 id="softcap-other-ignore-index"),
    pytest.param(600, 32000, "bfloat16", {"lse_square_scale": 1e-4}, id="z-loss-uneven-grid"),
    pytest.param(4096, 32000, "bfloat16", {"inplace_grad": True}, id="gradient-over-the-logits"),
]


def _inputs(n, v, dtype, ignore_index=-100, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (3 * torch.randn(n, v, generator=g, device="cuda")).to(DTYPES[dtype])
    t = torch.randint(0, v, (n,), generator=g, device="cuda")
    t[::32] = ignore_index
    return x, t


def _torch_loss(x, t, reduction="mean", label_smoothing=0.0, lse_square_scale=0.0,
                softcap=None, ignore_index=-100):
    z = x if softcap is None else softcap * torch.tanh(x / softcap)
    rows = F.cross_entropy(z, t, reduction="none", ignore_index=ignore_index,
                           label_smoothing=label_smoothing)
    valid = t != ignore_index
    rows = rows + torch.where(valid, lse_square_scale * torch.logsumexp(z, -1) ** 2, 0.0)
    if reduction == "none":
        return rows
    return rows.sum() if reduction == "sum" else rows.sum() / valid.sum()


def _check_grad(got, want, dtype):
    eps = torch.finfo(DTYPES[dtype]).eps
    # where the smoothing's -eps/V cancels the softmax, fp32's absolute error of the row
    # (1e-7 of its largest element) is all that is left of the value
    floor = 1e-6 * want.abs().amax(dim=-1, keepdim=True)
    if dtype == "float16":
        floor = floor + 2.0 ** -24
    err = (got.double() - want).abs()
    bad = err > (eps + 1e-3) * want.abs() + floor
    assert not bad.any(), (f"{int(bad.sum())} gradient elements off, the worst "
                           f"{float((err / want.abs().clamp_min(1e-30)).max()):.3g} relative")


@pytest.mark.parametrize(("n", "v", "dtype", "options"), CASES)
def test_loss_and_gradient_match_float64(n, v, dtype, options):
    from tileops.ops import CrossEntropyFwdOp

    op = CrossEntropyFwdOp(**options)
    x, t = _inputs(n, v, dtype, options.get("ignore_index", -100))
    xg = x.clone().requires_grad_(True)
    loss = op(xg, t)
    x64 = x.double().requires_grad_(True)
    want = _torch_loss(x64, t, **{k: v for k, v in options.items() if k != "inplace_grad"})
    assert loss.dtype == torch.float32 and loss.shape == want.shape
    torch.testing.assert_close(loss.double(), want, rtol=1e-3, atol=1e-6)
    if options.get("reduction") == "none":
        assert (loss[::32] == 0).all()
    dloss = torch.rand(want.shape, device="cuda", dtype=torch.float64) + 0.5
    loss.backward(dloss.float())
    (want_grad,) = torch.autograd.grad(want, x64, dloss)
    _check_grad(xg.grad, want_grad, dtype)
    assert (xg.grad[::32] == 0).all()  # ignored rows


# (rows, classes, dtype, options) of the kept gradient (a mean or sum loss in training)
KEPT = [
    pytest.param(8192, 128256, "bfloat16", {"inplace_grad": True}, id="bar-llama3-inplace"),
    pytest.param(1024, 262144, "bfloat16", {}, id="v262144-past-l2"),
    pytest.param(3, 7, "float32", {"reduction": "sum"}, id="tiny-fp32-sum"),
    pytest.param(257, 4097, "float16", {**EVERY, "inplace_grad": True}, id="odd-every-option"),
    pytest.param(600, 32000, "bfloat16", {"ignore_index": -1, "reduction": "sum"},
                 id="uneven-grid-other-ignore-index"),
]


@pytest.mark.parametrize(("n", "v", "dtype", "options"), KEPT)
def test_the_kept_gradient_of_a_unit_backward(n, v, dtype, options):
    """``loss.backward()``: the forward computed the loss and the gradient (over the logits
    with ``inplace_grad``), the backward's scale wrote nothing and no backward op was built."""
    from tileops.ops import CrossEntropyFwdOp

    op = CrossEntropyFwdOp(**options)
    x, t = _inputs(n, v, dtype, options.get("ignore_index", -100))
    leaf = x.clone().requires_grad_(True)
    z = leaf * 1  # a non-leaf, as an LM head's output is
    loss = op(z, t)
    x64 = x.double().requires_grad_(True)
    want = _torch_loss(x64, t, **{k: v for k, v in options.items() if k != "inplace_grad"})
    torch.testing.assert_close(loss.double(), want, rtol=1e-3, atol=1e-6)
    (want_grad,) = torch.autograd.grad(want, x64)
    if options.get("inplace_grad"):  # the logits hold the gradient after the forward
        _check_grad(z.detach(), want_grad, dtype)
    else:
        assert torch.equal(z.detach(), x)
    kept = z.detach().clone() if options.get("inplace_grad") else None
    loss.backward()
    _check_grad(leaf.grad, want_grad, dtype)
    if kept is not None:
        assert torch.equal(z.detach(), kept)  # the scale by 1 wrote nothing
    assert not op._backward_ops  # the backward op was never needed
    assert (leaf.grad[::32] == 0).all()  # ignored rows


def test_the_kept_gradient_scaled_by_other_upstream_gradients():
    from tileops.ops import CrossEntropyFwdOp

    x, t = _inputs(333, 50257, "bfloat16")
    x64 = x.double().requires_grad_(True)
    want = F.cross_entropy(x64, t)
    for scale in (0.25, 3.0, -1.0):
        xg = x.clone().requires_grad_(True)
        (scale * CrossEntropyFwdOp()(xg, t)).backward()
        (want_grad,) = torch.autograd.grad(scale * want, x64, retain_graph=True)
        _check_grad(xg.grad, want_grad, "bfloat16")


def test_inplace_grad_holds_no_second_logits_tensor():
    from tileops.ops import CrossEntropyFwdOp

    op = CrossEntropyFwdOp(inplace_grad=True)
    x, t = _inputs(4096, 32000, "bfloat16")
    leaf = x.clone().requires_grad_(True)
    op(leaf * 1, t).backward()  # built outside the measure
    leaf.grad = None
    torch.cuda.synchronize()
    z = leaf * 1
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    op(z, t).backward()
    torch.cuda.synchronize()
    # the gradient flows into leaf.grad (one N x V tensor, AccumulateGrad's own) from z's
    # storage: nothing else of the logits' size is allocated
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 1.5 * x.numel() * x.element_size(), extra


def test_every_row_ignored_gives_nan_and_zero_gradients():
    from tileops.ops import CrossEntropyFwdOp

    x, t = _inputs(64, 32000, "bfloat16")
    t[:] = -100
    xg = x.clone().requires_grad_(True)
    loss = CrossEntropyFwdOp()(xg, t)
    assert loss.isnan() and F.cross_entropy(x.float(), t).isnan()
    loss.backward()
    assert (xg.grad == 0).all()  # torch: 0 / 0 scales zero rows to NaN; rows are ignored
    assert CrossEntropyFwdOp(reduction="sum")(x, t) == 0


def test_a_target_outside_the_vocabulary_gives_nan_not_a_stray_read():
    from tileops.ops import CrossEntropyFwdOp

    x, t = _inputs(4, 100, "bfloat16")
    t[1], t[2] = 100, -5
    xg = x.clone().requires_grad_(True)
    loss = CrossEntropyFwdOp(reduction="none")(xg, t)
    assert loss[1].isnan() and loss[2].isnan() and loss[3].isfinite()
    loss.backward(torch.ones_like(loss))
    assert xg.grad[1:3].isnan().all() and xg.grad[3].isfinite().all()


def test_no_rows():
    from tileops.ops import CrossEntropyFwdOp

    x = torch.empty(0, 100, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.empty(0, device="cuda", dtype=torch.long)
    loss = CrossEntropyFwdOp()(x, t)
    assert loss.isnan()  # torch's mean over no rows
    loss.backward()
    assert x.grad.shape == (0, 100)


def test_cuda_graph_replays_the_training_step():
    from tileops.ops import CrossEntropyFwdOp

    op = CrossEntropyFwdOp()
    x, t = _inputs(256, 32000, "bfloat16")
    xg = x.clone().requires_grad_(True)
    op(xg, t).backward()  # build outside the capture
    xg.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the mean's count stays on the device: nothing syncs
        loss = op(xg, t)
        (grad,) = torch.autograd.grad(loss, xg)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(loss.double(), F.cross_entropy(x.double(), t), rtol=1e-3,
                               atol=1e-6)
    assert grad.isfinite().all()


# --- the cluster gradient program (installed through kernel_map until it is the default) -----

CLUSTER = [
    pytest.param(8192, 128256, "bfloat16", {"inplace_grad": True}, id="bar-llama3-inplace"),
    pytest.param(257, 151936, "bfloat16", {**EVERY, "reduction": "sum"}, id="every-option"),
    pytest.param(64, 262144, "bfloat16", {"ignore_index": -1}, id="v262144-other-ignore"),
    pytest.param(33, 128257, "float32", {}, id="odd-fp32"),
]


def _cluster_maps():
    return ({"cross_entropy_fwd": (C.CrossEntropyClusterFwdKernel, C.CrossEntropyFwdKernel)},
            {"cross_entropy_bwd": (C.CrossEntropyClusterBwdKernel, C.CrossEntropyBwdKernel)})


@pytest.mark.parametrize(("n", "v", "dtype", "options"), CLUSTER)
def test_cluster_programs_match_float64(n, v, dtype, options):
    """The kept gradient of a training step (the forward's cluster program) and the backward
    op's gradient for reduction none (the backward's), each against float64, the cluster
    kernels the ones that ran; a target outside the vocabulary gives a NaN row."""
    from tileops.ops import CrossEntropyBwdOp, CrossEntropyFwdOp

    fwd_map, bwd_map = _cluster_maps()
    assert C.cluster_plan(v, dtype) is not None  # each case takes the cluster program
    ignore = options.get("ignore_index", -100)
    loss_opts = {k: val for k, val in options.items() if k != "inplace_grad"}
    x, t = _inputs(n, v, dtype, ignore)
    op = CrossEntropyFwdOp(**options, kernel_map=fwd_map)
    leaf = x.clone().requires_grad_(True)
    loss = op(leaf * 1, t)  # a non-leaf, as an LM head's output is
    assert [type(e) for es in op.built_entries.values() for e in es.values()] == \
        [C.CrossEntropyClusterFwdKernel]
    x64 = x.double().requires_grad_(True)
    want = _torch_loss(x64, t, **loss_opts)
    torch.testing.assert_close(loss.double(), want, rtol=1e-3, atol=1e-6)
    loss.backward()
    (want_grad,) = torch.autograd.grad(want, x64)
    _check_grad(leaf.grad, want_grad, dtype)
    assert (leaf.grad[t == ignore] == 0).all()
    # the backward op, reduction none, a dloss a row, one target outside the vocabulary
    t[1] = v + 3
    bwd = CrossEntropyBwdOp(**{**loss_opts, "reduction": "none"}, kernel_map=bwd_map)
    dloss = torch.rand(n, device="cuda") + 0.5
    got = bwd(x, t, dloss)
    assert [type(e) for es in bwd.built_entries.values() for e in es.values()] == \
        [C.CrossEntropyClusterBwdKernel]
    keep = t != v + 3
    x64 = x.double()[keep].requires_grad_(True)
    per_row = _torch_loss(x64, t[keep], **{**loss_opts, "reduction": "none"})
    (want_b,) = torch.autograd.grad(per_row, x64, dloss[keep].double())
    _check_grad(got[keep], want_b, dtype)
    assert got[1].isnan().all() and (got[t == ignore] == 0).all()


#: the cluster program's variants the GPU test runs: (rows a cluster, bytes a thread, push)
VARIANT_CASES = [(1, 64, False), (16, 128, False), (4, 64, True), (16, 128, True)]
#: and the options it runs them with
VARIANT_OPTIONS = [(-100, 0.0, 0.0, None), (-100, 0.1, 1e-4, 30.0)]


@pytest.mark.parametrize(("rows", "held", "push"), VARIANT_CASES)
@pytest.mark.parametrize(("n", "options"), [(257, VARIANT_OPTIONS[0]),
                                            (33, VARIANT_OPTIONS[1])])
def test_cluster_program_variants_match_float64(rows, held, push, n, options):
    """The cluster program's sweep variants (rows a cluster, bytes of a row a thread, the
    triples pushed by asynchronous copies onto mbarriers): the gradient and each row's loss
    against float64, over 257 rows (a cluster's last rows past the end) with ignored rows,
    and with smoothing, z-loss and a softcap over 33; in place of the logits too."""
    v = 128256
    x, t = _inputs(n, v, "bfloat16")
    kept = C.build_cluster_rows_kernel(v, "bfloat16", options, False, with_loss=True,
                                       rows=rows, held=held, async_push=push)
    ignore, smoothing, zscale, softcap = options
    count = int((t != ignore).sum())
    g = torch.full((1,), 1.0 / count, device="cuda")
    per_row, d = torch.empty(n, device="cuda"), torch.empty_like(x)
    kwargs = dict(label_smoothing=smoothing, lse_square_scale=zscale, softcap=softcap,
                  ignore_index=ignore)
    x64 = x.double().requires_grad_(True)
    rows_loss = _torch_loss(x64, t, reduction="none", **kwargs)
    (want,) = torch.autograd.grad(rows_loss.sum() / count, x64)
    for inplace in (False, True):
        out = x.clone() if inplace else d
        kept(out if inplace else x, t, g, per_row, out)
        _check_grad(out, want, "bfloat16")
        torch.testing.assert_close(per_row.double(), rows_loss.detach(), rtol=1e-3, atol=1e-5)


# --- the prebuild ----------------------------------------------------------------------------


def program_keys(sms: int):
    """The distinct programs the file compiles: ``(builder, args)``, deduplicated."""
    configs = [(c.values[1], c.values[2], c.values[3]) for c in CASES]
    configs += [(c.values[1], c.values[2], c.values[3]) for c in KEPT]
    configs += [(32000, "bfloat16", {}), (100, "bfloat16", {"reduction": "none"}),
                (100, "bfloat16", {}), (50257, "bfloat16", {})]
    # the spec workloads' training steps that the harness runs (no case above has their options)
    configs += [(7, "bfloat16", {}), (128256, "bfloat16", {"softcap": 30.0}),
                (32000, "bfloat16", {"label_smoothing": 0.1}), (32000, "float32", {}),
                (32000, "bfloat16", {"reduction": "sum"})]
    keys = {}
    for v, dtype, o in configs:
        opts = (o.get("ignore_index", -100), float(o.get("label_smoothing", 0.0)),
                float(o.get("lse_square_scale", 0.0)), o.get("softcap"))
        red = o.get("reduction", "mean")
        keys[("rows", (v, dtype, opts, False, False, sms))] = None
        keys[("rows", (v, dtype, opts, True, red == "none", sms))] = None
        if red != "none":  # the kept gradient's program and its scale
            keys[("rows", (v, dtype, opts, True, False, sms, None, True))] = None
            keys[("scale", (v, dtype, sms))] = None
        if red != "none":
            keys[("finish", (opts[0], red == "mean", False))] = None
        if red == "mean":
            keys[("finish", (opts[0], True, True))] = None
    keys[("finish", (-100, False, False))] = None  # the all-ignored sum
    for rows, held, push in VARIANT_CASES:  # test_cluster_program_variants_match_float64
        for opts in VARIANT_OPTIONS:
            keys[("cluster", (128256, "bfloat16", opts, False, None, True, rows, held,
                              push))] = None
    for c in CLUSTER:  # the cluster programs: the kept gradient's and the backward's (none)
        v, dtype, o = c.values[1], c.values[2], c.values[3]
        opts = (o.get("ignore_index", -100), float(o.get("label_smoothing", 0.0)),
                float(o.get("lse_square_scale", 0.0)), o.get("softcap"))
        keys[("cluster", (v, dtype, opts, False, None, True))] = None
        keys[("cluster", (v, dtype, opts, True, None, False))] = None
        keys[("scale", (v, dtype, sms))] = None
        keys[("rows", (v, dtype, opts, True, True, sms))] = None
        red = o.get("reduction", "mean")
        keys[("finish", (opts[0], red == "mean", False))] = None
        if red == "mean":
            keys[("finish", (opts[0], True, True))] = None
    return list(keys)


#: the cluster program's (rows a cluster, bytes of a row a thread, asynchronous push) the
#: sweep times (the defaults: ``C._CLUSTER_ROWS``, ``C._CLUSTER_HELD_BYTES``, False)
CLUSTER_VARIANTS = ((1, 64, False), (4, 64, False), (16, 64, False), (64, 64, False),
                    (1, 128, False), (16, 128, False), (4, 64, True), (16, 64, True),
                    (64, 64, True), (16, 128, True))


def _build(key):
    {"rows": C.build_rows_kernel, "scale": C.build_scale_kernel,
     "finish": C.build_finish_kernel, "cluster": C.build_cluster_rows_kernel}[key[0]](*key[1])


def _describe(key) -> str:
    return f"{key[0]} {key[1][:2]}"


# --- the staged gradient program (the first chunks of a row kept in shared memory) -------------

#: (rows, classes, dtype, options, threads, per, CTAs an SM, staged chunks)
STAGED = [
    pytest.param(600, 128256, "bfloat16", {}, 512, 4, 2, 3, id="bar-width-two-ctas"),
    pytest.param(300, 128256, "bfloat16", {"label_smoothing": 0.1, "softcap": 30.0}, 512, 4,
                 1, 6, id="bar-width-one-cta-options"),
    pytest.param(257, 4097, "bfloat16", {}, 256, 4, 4, 1, id="odd-width-every-chunk"),
]


@pytest.mark.parametrize(("n", "v", "dtype", "options", "threads", "per", "per_sm", "staged"),
                         STAGED)
def test_the_staged_program_matches_float64(n, v, dtype, options, threads, per, per_sm,
                                            staged):
    """The kept gradient with its first chunks read back from shared memory: the same
    gradient and losses as float64, rows ignored included."""
    opts = (-100, options.get("label_smoothing", 0.0), 0.0, options.get("softcap"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    vec = C._vec(v, dtype)
    staged = min(staged, -(-v // (threads * vec * per)))
    prog = C.rows_program(v, dtype, opts, True, False, threads, vec, per, sms * per_sm,
                          with_loss=True, staged=staged)
    kernel = C.compile_program(prog, None)
    x, t = _inputs(n, v, dtype)
    keep = t != -100
    g = torch.full((1,), 1.0 / int(keep.sum()), device="cuda")
    per_row, d = torch.empty(n, device="cuda"), torch.empty_like(x)
    kernel(x, t, g, per_row, d)
    loss_opts = {k: o for k, o in options.items() if k in ("label_smoothing", "softcap")}
    x64 = x.double().requires_grad_()
    loss = _torch_loss(x64, t, **loss_opts)
    (want,) = torch.autograd.grad(loss, x64)
    _check_grad(d, want, dtype)
    rows = _torch_loss(x.double(), t, **{**loss_opts, "reduction": "none"})
    torch.testing.assert_close(per_row[keep].double(), rows[keep], rtol=1e-5, atol=1e-5)


# --- the sweep of the kept program's launch plans at the bar's shape ---------------------------

#: (threads, accesses a thread issues before it reduces, CTAs an SM): the rows in flight are
#: the grid (CTAs an SM times the SMs), whose bytes decide whether the second pass finds the row
#: in L2; the plan rows_plan gives is the first
SWEEP_PLANS = [(1024, 2, 1.0), (1024, 4, 1.0), (1024, 4, 0.75), (1024, 4, 0.5),
               (512, 4, 2.0), (512, 2, 2.0), (512, 4, 1.0), (512, 8, 1.0), (256, 4, 4.0),
               (256, 8, 2.0),
               # a fourth element: the row's first chunks kept in shared memory (rows_program's
               # staged), at most the row's chunks
               (512, 4, 2.0, 3), (512, 4, 1.0, 6), (1024, 4, 1.0, 3), (256, 4, 4.0, 1)]
SWEEP_SHAPE = (8192, 128256)


def _sweep_kernel(plan, sms, v):
    threads, per, per_sm, *rest = plan
    vec = C._vec(v, "bfloat16")
    staged = min(rest[0], -(-v // (threads * vec * per))) if rest else 0
    prog = C.rows_program(v, "bfloat16", (-100, 0.0, 0.0, None), True, False, threads, vec,
                          per, max(1, int(sms * per_sm)), with_loss=True, staged=staged)
    return C.compile_program(prog, None)


def _sweep_build(args):
    _sweep_kernel(*args)
    return args[0]


def _events(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def sweep(sms, workers, shape=SWEEP_SHAPE):
    """Time the kept program under each of :data:`SWEEP_PLANS` (compiled in parallel first),
    the gradient program and the whole training step as the op runs them, at the bar's shape;
    prints ms and the HBM bandwidth a read and a write of the logits would need at that time."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from tileops.ops import CrossEntropyFwdOp

    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        list(pool.map(_sweep_build, [(p, sms, shape[1]) for p in SWEEP_PLANS]))
        if C.cluster_plan(shape[1], "bfloat16") is not None:
            list(pool.map(_build, [("cluster", (shape[1], "bfloat16", (-100, 0.0, 0.0, None),
                                                False, None, True, rows, held, push))
                                   for rows, held, push in CLUSTER_VARIANTS]))
    n, v = shape
    print(f"{n} x {v} bfloat16; the default plan: {C.rows_plan(v, 'bfloat16', True, sms)}")
    x, t = _inputs(n, v, "bfloat16")
    g = torch.full((1,), 1.0 / int((t != -100).sum()), device="cuda")
    per_row, d = torch.empty(n, device="cuda"), torch.empty_like(x)
    moved = 2 * x.numel() * x.element_size()  # the logits read once, the gradient written once

    def line(what, ms):
        print(f"{what:<40} {ms:7.3f} ms {moved / ms / 1e9:6.2f} TB/s", flush=True)

    ref = None
    for plan in SWEEP_PLANS:
        k = _sweep_kernel(plan, sms, v)
        k(x, t, g, per_row, d)
        if ref is None:  # the first plan's gradient (the tested default of before) as the check
            ref = d.clone()
        off = (d.float() - ref.float()).abs().max().item() > 1e-2 * ref.float().abs().max().item()
        line(f"kept rows {plan}{' WRONG' if off else ''}",
             _events(lambda k=k: k(x, t, g, per_row, d)))
    grad = C.build_rows_kernel(v, "bfloat16", (-100, 0.0, 0.0, None), True, False, sms)
    line("gradient rows (the backward op's)", _events(lambda: grad(x, t, g, d)))
    clustered = C.cluster_plan(v, "bfloat16") is not None  # only rows past the L2's grid
    if clustered:
        # consecutive rows a cluster (the next one's read ahead), bytes of a row a thread
        for rows, held, push in CLUSTER_VARIANTS:
            kept = C.build_cluster_rows_kernel(v, "bfloat16", (-100, 0.0, 0.0, None), False,
                                               with_loss=True, rows=rows, held=held,
                                               async_push=push)
            kept(x, t, g, per_row, d)
            off = (d.float() - ref.float()).abs().max().item() > \
                1e-2 * ref.float().abs().max().item()
            line(f"kept rows, cluster {C.cluster_plan(v, 'bfloat16', held)}, {rows} rows"
                 f"{', async push' if push else ''}{' WRONG' if off else ''}",
                 _events(lambda k=kept: k(x, t, g, per_row, d)))
        cgrad = C.build_cluster_rows_kernel(v, "bfloat16", (-100, 0.0, 0.0, None), False)
        line("gradient rows, cluster", _events(lambda: cgrad(x, t, g, d)))
    scale = C.build_scale_kernel(v, "bfloat16", sms)
    one = torch.ones(1, device="cuda")
    line("scale by 1 (returns at once)", _events(lambda: scale(d, one)))
    fwd_map, _ = _cluster_maps()
    for inplace in (False, True):
        for name, kmap in (("", None), (", cluster", fwd_map))[:2 if clustered else 1]:
            op = CrossEntropyFwdOp(inplace_grad=inplace, kernel_map=kmap)
            leaf = x.clone().requires_grad_(True)
            line(f"training step, inplace_grad={inplace}{name}",
                 _events(lambda op=op, leaf=leaf: torch.autograd.grad(op(leaf * 1, t), leaf)))
    return 0


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="compile this file's programs in parallel, or "
                                             "time the kept program's launch plans")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prebuild", action="store_true")
    mode.add_argument("--sweep", action="store_true")
    ap.add_argument("--workers", type=int, default=15)
    ap.add_argument("--shape", type=int, nargs=2, default=SWEEP_SHAPE, metavar=("ROWS", "V"),
                    help="the sweep's logits (default: the bar's 8192 x 128256)")
    args = ap.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.sweep:
        return sweep(sms, args.workers, tuple(args.shape))
    from _prebuild import build_all  # beside this file, which runs as a script here

    return build_all(program_keys(sms), _build, _describe, args.workers)


if __name__ == "__main__":
    sys.exit(main())
