"""The mixture-of-experts kernels' programs run on the host, thread by thread
(tests/kernels/_host_run.py), against the family's torch references (which live in the ops
package, so these tests are the ops package's): the grouping kernel against the torch
grouping, the routing program against the routing's reference."""

import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.kernels import moe as K

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None,
                                reason="compiling for sm_90 needs nvcc (the CUDA toolkit)")


def _host_run():
    """tests/kernels/_host_run.py (the test modules import as files)."""
    import sys
    from pathlib import Path

    sys.path.append(str(Path(__file__).parents[1] / "kernels"))
    import _host_run

    return _host_run


#: (experts, picks, metadata, max_m, alignment): each layout's programs
GROUP_LAYOUTS = [
    pytest.param(8, 2, "offsets", 0, 1, id="tight-offsets"),
    pytest.param(6, 3, "offsets", 0, 4, id="aligned-offsets"),
    pytest.param(6, 3, "per_row", 0, 4, id="aligned-per-row"),
    pytest.param(5, 2, "masked", 3, 1, id="masked"),
]


@needs_nvcc
@pytest.mark.parametrize(("e", "k", "metadata", "max_m", "alignment"), GROUP_LAYOUTS)
@settings(max_examples=10, deadline=None)
@given(m=st.one_of(st.integers(0, 40), st.integers(150, 300)), data=st.data())
def test_the_grouping_kernel_is_the_torch_grouping_on_the_host(e, k, metadata, max_m,
                                                               alignment, m, data):
    """The grouping kernel's three chunked launches, and its one-launch program where the
    slots take it, every thread run on the host (a CTA that shares memory a block at a time,
    its threads meeting at the barriers), each give the torch grouping's rows, metadata and
    row tokens exactly, over drawn routings: no tokens, slots over several chunks, ids past
    either end of the experts (dropped), repeats, empty experts, blocks that overflow
    ``max_m``."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from tileops.kernels import moe_group as MG
    from tileops.ops._moe_layout import LayoutValue, group_slots

    run = _host_run()
    n = m * k
    hot = data.draw(st.integers(-2, e + 1))  # one id drawn often: an expert's block overflows
    ids = np.array(data.draw(st.lists(st.one_of(st.integers(-2, e + 1), st.just(hot)),
                                      min_size=n, max_size=n)), dtype=np.int32)
    lay = LayoutValue(masked=metadata == "masked", max_m=max_m, alignment=alignment,
                      per_row=metadata == "per_row")
    want = group_slots(torch.from_numpy(ids).view(m, k), e, lay)
    r, keys, chunks = lay.rows(n, e), e + 1, max(1, -(-n // MG.CHUNK))
    count, scan, place, small = (p.get_kernel_source() for p in MG.build_group(
        e, k, metadata, max_m, alignment, "sm_90"))
    arr = lambda size, fill: run.shared_array(np, size, np.int32, fill)  # noqa: E731
    cnt, base, off, rank = arr(chunks * keys, -5), arr(chunks * keys, -5), arr(keys, -5), \
        arr(max(n, 1), -5)
    src, rows, meta = arr(r, -7), arr(n, -9), arr(want.metadata.numel(), -9)
    sizes = {"N": n, "R": r, "C": chunks}

    def launch(source, blocks, threads, **tensors):
        assert run.run_kernel(source, {**tensors, **sizes}, (max(1, blocks), 1), threads) is None

    launch(count, chunks + -(-r // MG.CHUNK), MG.CHUNK, Ids=ids, Cnt=cnt, Rank=rank, Src=src)
    launch(scan, 1, MG._SCAN_THREADS, Cnt=cnt, Base=base, Off=off, Meta=meta)
    if n:
        launch(place, -(-n // 256), 256, Ids=ids, Base=base, Rank=rank, Off=off, Rows=rows,
               Src=src)
    assert np.array_equal(rows, want.rows.numpy().reshape(-1))
    assert np.array_equal(meta, want.metadata.numpy())
    assert np.array_equal(src, want.src.numpy())
    if n <= MG.SMALL:  # the one-launch program, on fresh outputs
        src, rows, meta = arr(r, -7), arr(n, -9), arr(want.metadata.numel(), -9)
        launch(small, 1, MG.SMALL, Ids=ids, Meta=meta, Rows=rows, Src=src)
        assert np.array_equal(rows, want.rows.numpy().reshape(-1))
        assert np.array_equal(meta, want.metadata.numpy())
        assert np.array_equal(src, want.src.numpy())


@needs_nvcc
@pytest.mark.parametrize(("e", "k", "metadata", "max_m", "alignment"), GROUP_LAYOUTS[:2])
@pytest.mark.parametrize("m", [3, 600])
def test_the_grouping_kernel_s_whole_call_is_the_torch_grouping_on_the_host(
        monkeypatch, e, k, metadata, max_m, alignment, m):
    """MoeGroupKernel's call as the op makes it, its programs run on the host (HostProgram):
    the one-launch program for a few slots, the chunked ones with the workspace the call
    carves (counts, bases, offsets, ranks) for many."""
    torch = pytest.importorskip("torch")
    from tileops.kernels import moe_group as MG
    from tileops.ops._moe_layout import LayoutValue, group_slots

    run = _host_run()
    build = MG.build_group
    monkeypatch.setattr(MG, "build_group", lambda *a: tuple(
        run.HostProgram(p) for p in build(*a, "sm_90")))
    g = torch.Generator().manual_seed(m * e)
    ids = torch.randint(-1, e + 1, (m, k), generator=g, dtype=torch.int32)
    lay = LayoutValue(masked=metadata == "masked", max_m=max_m, alignment=alignment,
                      per_row=metadata == "per_row")
    want = group_slots(ids, e, lay)
    kernel = MG.MoeGroupKernel(MG.MoeGroupSpec(device=torch.device("cpu"), e=e, k=k,
                                               metadata=metadata, max_m=max_m,
                                               alignment=alignment))
    rows = torch.full((m, k), -9, dtype=torch.int32)
    meta = torch.full(want.metadata.shape, -9, dtype=torch.int32)
    src = torch.full(want.src.shape, -9, dtype=torch.int32)
    kernel(ids, meta, rows, src)
    assert torch.equal(rows, want.rows) and torch.equal(meta, want.metadata)
    assert torch.equal(src, want.src)


def _routings():
    """tests/kernels/_moe_routings.py's cases, as parameters."""
    import sys
    from pathlib import Path

    sys.path.append(str(Path(__file__).parents[1] / "kernels"))
    from _moe_routings import ROUTINGS

    return [pytest.param(c, id=c[0]) for c in ROUTINGS]


def _lanes_of(cases):
    """Each routing with each program that serves it: a thread a token, and a warp a token
    where the experts take it (:func:`gating_lanes`)."""
    return [pytest.param(c.values[0], lanes, id=f"{c.id}-lanes{lanes}") for c in cases
            for lanes in sorted({1, K.gating_lanes(c.values[0][1], c.values[0][5])})]


@needs_nvcc
@pytest.mark.parametrize(("case", "lanes"), _lanes_of(_routings()))
def test_the_routing_is_the_reference_s_on_the_host(case, lanes):
    """The routing programs, every thread run on the host (a warp a token's lanes in
    lockstep at its shuffles): the picks are the reference's exactly (ties to the lowest id,
    groups by their scores' sums, NaNs first), the weights within float32 rounding."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from _moe_routings import routing_inputs

    from tileops.ops._moe_layout import gating_reference

    run = _host_run()
    _, e, top_k, scoring, renormalize, groups, kept, scale, bias, _ = case
    # a thread a token: two CTAs, the second partly idle; a warp a token: four CTAs of four
    # tokens, the last with one (its lanes run as host threads, which cost)
    m = 131 if lanes == 1 else 13
    x, b = routing_inputs(torch, case, m)
    w_ref, ids_ref = gating_reference(x, b, top_k=top_k, scoring=scoring,
                                      renormalize=renormalize, num_groups=groups,
                                      topk_groups=kept, scale=scale)
    src = K.build_gating(e, top_k, "float32", scoring, renormalize, groups, kept, scale, bias,
                         "sm_90", lanes).get_kernel_source()
    W = run.shared_array(np, m * top_k, np.float32, np.nan)
    Ids = run.shared_array(np, m * top_k, np.int32, -9)
    bias_arr = (b if bias else torch.zeros(e)).numpy().astype(np.float32)
    tokens = 128 // lanes  # a CTA's: the last partly idle
    assert run.run_kernel(src, {"X": np.ascontiguousarray(x.numpy()), "Bias": bias_arr,
                                "W": W, "Ids": Ids, "M": m}, (-(-m // tokens), 1), 128) is None
    assert np.array_equal(Ids.reshape(m, top_k), ids_ref.numpy())
    assert np.allclose(W.reshape(m, top_k), w_ref.numpy(), rtol=1e-5, atol=1e-6,
                       equal_nan=True)


#: (experts, top_k, scoring, renormalize, scale): the routings' gradients
GATING_GRADS = [
    pytest.param(8, 2, "softmax", True, 1.0, id="mixtral"),
    pytest.param(256, 8, "sigmoid", True, 2.5, id="deepseek"),
    pytest.param(64, 6, "softmax", False, 1.0, id="no-renorm"),
    pytest.param(60, 4, "softmax", True, 1.0, id="sixty"),
    pytest.param(600, 20, "sigmoid", False, 1.0, id="wide-600"),
]


@needs_nvcc
@pytest.mark.parametrize(("e", "top_k", "scoring", "renormalize", "scale"), GATING_GRADS)
def test_the_routing_s_gradient_is_the_reference_s_on_the_host(e, top_k, scoring, renormalize,
                                                               scale):
    """Both programs of the routing's gradient (a thread a token; a warp a token from 32
    experts on, its lanes in lockstep) run on the host, at picks with a repeated id and one
    outside ``[0, E)``: the float64 closed form's ``dlogits`` within float32 rounding."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from tileops.ops._moe_layout import gating_bwd_reference

    run = _host_run()
    g = torch.Generator().manual_seed(e + top_k)
    for lanes in sorted({1, K.gating_lanes(e, 1)}):
        m = 131 if lanes == 1 else 13
        x = torch.randn(m, e, generator=g)
        ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(m)]).int()
        ids[0, 1] = ids[0, 0]  # a repeated id: both picks' gradients in its column
        ids[1, 0] = e  # outside: no score, no column
        dw = torch.randn(m, top_k, generator=g)
        want = gating_bwd_reference(dw.double(), x.double(), ids, top_k=top_k,
                                    scoring=scoring, renormalize=renormalize, scale=scale)
        src = K.build_gating_bwd(e, top_k, "float32", scoring, renormalize, scale, "sm_90",
                                 lanes).get_kernel_source()
        dx = run.shared_array(np, m * e, np.float32, np.nan)
        tokens = 128 // lanes
        assert run.run_kernel(src, {"DW": dw.numpy(), "X": np.ascontiguousarray(x.numpy()),
                                    "Ids": ids.numpy(), "DX": dx, "M": m},
                              (-(-m // tokens), 1), 128) is None
        assert np.allclose(dx.reshape(m, e), want.numpy(), rtol=1e-5, atol=1e-6), lanes


@needs_nvcc
@pytest.mark.parametrize(("h", "dtype"), [(37, "bfloat16"), (4097, "float16"),
                                          (64, "float16"), (4096, "bfloat16"),
                                          (8200, "bfloat16")])
def test_the_unpermutation_program_sums_the_picks_on_the_host(h, dtype):
    """The unpermutation, every thread of its CTAs (a token each, :func:`unpermute_threads`)
    run on the host: each token's picked rows weighted and summed in float32, a dropped pick
    (row -1) adding nothing; the reference's result rounded once. Rows of odd lengths read
    element by element (fewer than the CTA's threads, and 4097: five steps of 1024) and of
    16-byte vectors (8 of 128 threads, 512 for 4096, 1025 vectors: two steps of 1024)."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from tileops.ops._moe_layout import unpermute_reference

    run = _host_run()
    m, k, r = 9, 3, 31
    g = torch.Generator().manual_seed(h)
    rows = torch.randint(-1, r, (m, k), generator=g, dtype=torch.int32)
    w = torch.rand(m, k, generator=g)
    tdt = getattr(torch, dtype)
    y = torch.randn(r, h, generator=g).to(tdt)
    want = unpermute_reference(y.float(), rows, w).to(tdt)

    out = run.shared_array(np, m * h, np.uint16, 0xFFFF)
    src = K.build_unpermute(h, k, dtype, "sm_90").get_kernel_source()
    assert run.run_kernel(src, {"Y": run.host_array(y), "Rows": rows.numpy(),
                                "W": w.numpy(), "Out": out, "M": m, "R": r},
                          (m, 1), K.unpermute_threads(h, dtype)) is None
    got = torch.from_numpy(out.view(np.int16).copy()).view(tdt).reshape(m, h)
    # float32 sums of the same terms in the same order: equal, but for the last rounding
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert (got != want).float().mean() < 0.01


@needs_nvcc
@pytest.mark.parametrize(("h", "dtype"), [(37, "bfloat16"), (64, "float16"), (1100, "bfloat16")])
def test_the_gates_gradient_program_is_the_reference_s_on_the_host(h, dtype):
    """The unpermutation's gradient for its gates (a warp a token, the lanes' partial dot
    products reduced by shuffles), its lanes run in lockstep on the host: ``dout . y[row]`` a
    pick, 0 for a dropped one, within float32 rounding of the reference's."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from tileops.ops._moe_layout import unpermute_bwd_reference

    run = _host_run()
    m, k, r = 7, 3, 19
    g = torch.Generator().manual_seed(h)
    rows = torch.randint(-1, r, (m, k), generator=g, dtype=torch.int32)
    tdt = getattr(torch, dtype)
    dout = torch.randn(m, h, generator=g).to(tdt)
    y = torch.randn(r, h, generator=g).to(tdt)
    _, want = unpermute_bwd_reference(dout.float(), y.float(), rows, torch.ones(m, k),
                                      grad_y=False, grad_weights=True)

    dw = run.shared_array(np, m * k, np.float32, np.nan)
    src = K.build_gate_grad(h, k, dtype, "sm_90").get_kernel_source()
    assert run.run_kernel(src, {"Dout": run.host_array(dout), "Y": run.host_array(y), "Rows": rows.numpy(),
                                "DW": dw, "M": m, "R": r}, (m, 1), 32) is None
    assert np.allclose(dw.reshape(m, k), want.numpy(), rtol=1e-5, atol=1e-4)


@needs_nvcc
def test_the_warp_routing_s_keys_order_the_picks_as_the_sort_on_the_host():
    """The warp program's pick keys (one unsigned 64-bit max a step), computed by a TileLang
    program run on the host over values with every edge (NaNs of both signs, infinities,
    zeros of both signs, subnormals, ties) and ids: sorted descending they give the order of
    torch's stable descending sort, as :func:`_before` states it; no key is 0 (no candidate)."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from tileops.kernels._tilelang import compile_program, tl

    _, T = tl()
    n = 512

    @T.prim_func
    def main(V: T.Tensor((n,), "float32"), Out: T.Tensor((n,), "uint64")):
        with T.Kernel(n // 128, threads=128) as bx:
            i = bx * 128 + T.get_thread_binding(0)
            Out[i] = K._pick_key(T, V[i], i)

    src = compile_program(main, "sm_90").get_kernel_source()
    rng = np.random.default_rng(5)
    edges = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 1.0, -1.0,
                      3.4e38, -3.4e38, 1.5, 1.5, -2.0, -2.0], dtype=np.float32)
    nan_bits = np.array([0x7FC00001, 0xFFC00000, 0x7F800001], dtype=np.uint32).view(np.float32)
    v = np.concatenate([edges, nan_bits, rng.choice(edges, 100),
                        rng.integers(-3, 3, n - 119).astype(np.float32)])
    run = _host_run()
    out = run.shared_array(np, n, np.uint64, 0)
    assert run.run_kernel(src, {"V": np.ascontiguousarray(v), "Out": out}, (n // 128, 1),
                          128) is None
    assert (out != 0).all() and len(set(out.tolist())) == n  # the ids make every key unique
    by_key = sorted(range(n), key=lambda i: -int(out[i]))
    want = torch.sort(torch.from_numpy(v), descending=True, stable=True).indices.tolist()
    assert by_key == want


@needs_nvcc
@pytest.mark.parametrize(("h", "dtype"), [(64, "float16"), (37, "bfloat16")])
@pytest.mark.parametrize("layout", ["tight", "aligned", "masked"])
def test_the_permutation_program_moves_the_rows_on_the_host(h, dtype, layout):
    """The permutation, every thread run on the host: a CTA a token writes its row to each of
    its slots' rows, the CTAs past the tokens zero the rows no slot fills; the result is
    the reference's (16-byte vectors along the rows, and element by element for an odd
    length)."""
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    from tileops.ops._moe_layout import LayoutValue, group_slots, permute_reference

    run = _host_run()
    m, k, e = 23, 3, 5
    lay = {"tight": LayoutValue(masked=False), "aligned": LayoutValue(masked=False, alignment=4),
           "masked": LayoutValue(masked=True, max_m=6)}[layout]
    g = torch.Generator().manual_seed(h + m)
    ids = torch.randint(-1, e + 1, (m, k), generator=g, dtype=torch.int32)
    x = torch.randn(m, h, generator=g)
    grouping = group_slots(ids, e, lay)
    want = permute_reference(x, ids, e, lay)[0].reshape(-1, h)
    r = grouping.src.numel()
    src = K.build_permute(h, dtype, "sm_90").get_kernel_source()
    # the host's 16-bit values as their bits: bfloat16 the upper half of float32's, float16
    # numpy's own
    if dtype == "float16":
        X = x.to(torch.float16).numpy().view(np.uint16)
        want = want.to(torch.float16).numpy().view(np.uint16)
    else:
        X = (x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
        want = want.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    Y = run.shared_array(np, r * h, np.uint16, 0xFFFF)
    assert run.run_kernel(src, {"X": np.ascontiguousarray(X), "Rows": grouping.rows.numpy(),
                                "Src": grouping.src.numpy(), "Y": Y, "M": m, "R": r, "K": k},
                          (m + -(-r // K._ZERO_ROWS), 1), 128) is None
    assert np.array_equal(Y.reshape(r, h), want)
