"""The top-k family on the CPU: how TopkFwdOp hands a call to the ``topk_fwd`` slot (the
``(rows, n)`` view, the copy of a strided or misaligned input, the ``(rows, k)`` outputs), the
answer its entry promises (ties keep the lowest indices, NaN above every number, -0.0 equal
to 0.0, the same order whatever ``sorted`` says) against cases written out, the refusals'
text, and the kernel's plan and bound: the order-preserving keys the program compares
(mirrored here in torch integer arithmetic) order every value as torch does, and the bound
the program starts from never passes the k-th largest, over hypothesis rows. The program
compiles in tests/kernels/test_topk_compile.py and runs on a GPU in
tests/kernels/test_topk_cuda.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tileops.ops as ops
from tileops.kernels import topk as K
from tileops.runtime import Kernel
from tileops.signature import SignatureCallError

launched: list[tuple] = []


class TorchTopkSlot(Kernel, K.TopkInterface):
    """The slot on the CPU: checks what the op hands over, then answers with a stable sort."""

    devices = ("cpu",)
    general = True

    @classmethod
    def entry_for(cls, spec, op):
        def run(x, values, indices):
            launched.append((spec.rows, spec.n, spec.k, spec.dtype, spec.largest))
            assert tuple(x.shape) == (spec.rows, spec.n) and x.is_contiguous()
            assert x.data_ptr() % 16 == 0
            assert tuple(values.shape) == tuple(indices.shape) == (spec.rows, spec.k)
            assert indices.dtype == torch.int64 and values.dtype == x.dtype
            v, i = torch.sort(x, dim=1, descending=spec.largest, stable=True)
            values.copy_(v[:, :spec.k])
            indices.copy_(i[:, :spec.k])

        return run


def _in_tree(**params):
    return ops.TopkFwdOp(kernel_map={"topk_fwd": TorchTopkSlot}, **params)


@pytest.mark.parametrize(("shape", "k", "view"), [
    ((5, 7), 3, (5, 7)),
    ((2, 3, 9), 4, (6, 9)),
    ((9,), 9, (1, 9)),  # one row, every element
    ((0, 6), 2, (0, 6)),  # no rows
])
def test_the_rows_are_handed_over_as_a_matrix(shape, k, view):
    x = torch.randn(shape)
    vals, idx = _in_tree(k=k)(x)
    assert launched.pop() == (*view, k, "float32", True)
    assert vals.shape == idx.shape == (*shape[:-1], k)
    torch.testing.assert_close(vals, torch.topk(x, k).values)


def test_a_strided_or_misaligned_input_is_copied_and_the_caller_keeps_its_tensor():
    base = torch.randn(12, 10)
    for x in (base.t(), base[:, 1:], base.view(-1)[1:100].view(9, 11)):
        before = x.clone()
        vals, idx = _in_tree(k=3, largest=False)(x)
        launched.pop()
        torch.testing.assert_close(vals, torch.topk(x, 3, largest=False).values)
        assert torch.equal(torch.gather(x, 1, idx), vals)
        assert torch.equal(x, before)


_NAN, _INF = float("nan"), float("inf")


@pytest.mark.parametrize(("row", "k", "largest", "values", "indices"), [
    # equal values: the lowest indices, in index order
    ([1.0, 3.0, 3.0, 2.0, 3.0], 2, True, [3.0, 3.0], [1, 2]),
    ([1.0, 3.0, 3.0, 2.0, 3.0], 4, True, [3.0, 3.0, 3.0, 2.0], [1, 2, 4, 3]),
    ([2.0, 1.0, 1.0, 1.0], 2, False, [1.0, 1.0], [1, 2]),
    # NaN above every number, and infinities in their place
    ([0.0, _NAN, _INF, -_INF, _NAN], 3, True, [_NAN, _NAN, _INF], [1, 4, 2]),
    ([0.0, _NAN, _INF, -_INF, _NAN], 2, False, [-_INF, 0.0], [3, 0]),
    ([_NAN, 1.0], 2, False, [1.0, _NAN], [1, 0]),
    # -0.0 equals 0.0: index order between them, each keeping its sign
    ([-0.0, 0.0, -1.0], 2, True, [-0.0, 0.0], [0, 1]),
    ([0.0, -0.0, 1.0], 2, False, [0.0, -0.0], [0, 1]),
])
@pytest.mark.parametrize("sort", [True, False])
def test_the_answer_is_the_stable_sorts(row, k, largest, values, indices, sort):
    x = torch.tensor([row])
    for op in (_in_tree(k=k, largest=largest, sorted=sort),
               ops.TopkFwdOp(k=k, largest=largest, sorted=sort, target="reference")):
        vals, idx = op(x)
        launched.clear()
        assert idx.tolist() == [indices]
        assert torch.equal(vals.isnan(), torch.tensor([values]).isnan())
        got = vals[0].tolist()
        for g, w in zip(got, values, strict=True):
            assert (math.isnan(g) and math.isnan(w)) or (g == w and math.copysign(1, g)
                                                         == math.copysign(1, w))


@pytest.mark.parametrize("dtype", ["float64", "int32", "uint8"])
def test_a_dtype_the_kernels_lack_is_refused_by_name_on_the_in_tree_kernels(dtype):
    with pytest.raises(TypeError) as err:
        _in_tree(k=1)(torch.zeros(2, 3, dtype=getattr(torch, dtype)))
    assert str(err.value) == (
        f"TopkFwdOp: the in-tree top-k kernels serve bfloat16, float16, float32, not {dtype}; "
        f"construct the op with target='reference' for {dtype}")
    assert not launched


@pytest.mark.parametrize(("k", "dim", "shape", "bound"), [
    (8, -1, (3, 7), "k = 8"),
    (4, 0, (3, 7), "k = 4"),
])
def test_a_bad_k_is_refused_naming_the_rule_and_the_sizes(k, dim, shape, bound):
    with pytest.raises(Exception) as err:
        ops.TopkFwdOp(k=k, dim=dim)(torch.zeros(shape))
    text = str(err.value)
    assert text.startswith("TopkFwdOp: argument x does not match the signature")
    assert "because:  refinement 'k <= size_at(S, dim)' does not hold (" in text
    assert bound in text and "S = [3, 7]" in text


@pytest.mark.parametrize(("dim", "shape", "why"), [
    (2, (3, 7), "dim 2 is out of range for a tensor of rank 2 (expected an axis in [-2, 1])"),
    (-3, (3, 7), "dim -3 is out of range for a tensor of rank 2 (expected an axis in [-2, 1])"),
    (1, (), "dim 1 is out of range for a tensor of rank 0 (expected an axis in [-1, 0])"),
])
def test_a_bad_dim_is_refused_naming_the_rank_and_the_range(dim, shape, why):
    op = ops.TopkFwdOp(k=1, dim=dim, target="reference")
    with pytest.raises(Exception) as err:
        op(torch.zeros(shape))
    text = str(err.value)
    assert text.startswith("TopkFwdOp: ") and why in text
    # the op stays usable: a tensor with that axis is served
    x = torch.randn(3, 7, 5)
    assert op(x)[0].shape == tuple(1 if d == dim % 3 else n for d, n in enumerate(x.shape))


def test_a_negative_k_is_refused_where_the_op_is_made_naming_it():
    """k < 0 fits no tensor: refused at construction by its own rule (the call's output shape
    was computed first and blamed x)."""
    from tileops.signature import ConstructionError

    with pytest.raises(ConstructionError) as err:
        ops.TopkFwdOp(k=-1)
    text = str(err.value)
    assert text.startswith("TopkFwdOp: ") and "k = -1" in text
    assert "refinement 'k >= 0' does not hold" in text


@pytest.mark.parametrize("dim", [0, 1, -3])
def test_any_dim_is_the_last_dim_moved_there(dim):
    x = torch.randn(5, 9, 4, generator=torch.Generator().manual_seed(0))
    op = ops.TopkFwdOp(k=3, dim=dim, target="reference")
    vals, idx = op(x)
    want_v, want_i = torch.topk(x, 3, dim=dim)
    assert torch.equal(vals, want_v) and torch.equal(idx, want_i)


def test_the_call_spec_refuses_a_k_above_the_row():
    with pytest.raises(ValueError, match=r"TopkSpec: k \(8\) exceeds the row length \(7\)"):
        K.TopkSpec(device="cuda", rows=1, n=7, k=8, dtype="float32", largest=True)


# --- the plan and the bound ------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 1 << 19), data=st.data(),
       dtype=st.sampled_from(["float16", "bfloat16", "float32"]), lean=st.booleans())
def test_the_plan_fits_the_row(n, data, dtype, lean):
    k = data.draw(st.integers(0, min(n, 1024)))
    threads, vec, pre, cap, sort, got_lean = K.topk_plan(n, k, dtype, lean)
    assert got_lean is lean
    most, most_pre = (K._LEAN_THREADS, K._LEAN_PRE) if lean else (K._MAX_THREADS, K._PRE)
    assert threads & (threads - 1) == 0 and 32 <= threads <= most
    assert n % vec == 0 and vec * K._ITEMSIZE[dtype] <= 16
    assert 1 <= pre <= most_pre and (pre - 1) * threads * vec < n  # every held chunk has some
    assert cap & (cap - 1) == 0 and cap <= K._CAP_LARGE
    assert sort & (sort - 1) == 0 and sort >= 2 * k  # the k kept and as many ties
    smem = cap * 8 + sort * 8 + K._BINS * 4
    assert smem <= 227 * 1024  # an H100/H200 CTA's shared memory


def _keys(x: torch.Tensor, largest: bool) -> torch.Tensor:
    """The program's keys of ``x`` (see the kernels module): int64 holding the unsigned key."""
    name = str(x.dtype).removeprefix("torch.")
    bits, inf = K._KEY[name]
    raw = x.view(torch.int32 if bits == 32 else torch.int16).to(torch.int64) & ((1 << bits) - 1)
    full, sign = (1 << bits) - 1, 1 << (bits - 1)
    mag = raw & (full >> 1)
    ordered = torch.where(raw >= sign, (~raw) & full, raw | sign)
    kv = torch.where(mag > inf, full, torch.where(mag == 0, sign, ordered))
    return kv if largest else full - kv


def _bound(kv: torch.Tensor, k: int, plan: tuple) -> int:
    """The program's bound for one row of keys: the k-th largest of the held chunks' thread
    maxima (piece maxima for k above the thread count), 0 where they are fewer than k."""
    threads, vec, pre = plan[:3]
    held = torch.zeros(pre * threads * vec, dtype=torch.int64)
    m = min(kv.numel(), held.numel())
    held[:m] = kv[:m]
    pieces = held.view(pre, threads, vec).amax(2)
    maxima = pieces.amax(0) if k <= threads else pieces.flatten()
    if maxima.numel() < k or k == 0:
        return 0
    return int(maxima.sort(descending=True).values[k - 1])


_SPECIAL = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1.0, -1.0, 1e-40, -1e-40]


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 5000), data=st.data(), largest=st.booleans(),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       kind=st.sampled_from(["normal", "few-values", "ascending", "descending", "special"]))
def test_the_keys_order_as_torch_and_the_bound_keeps_the_k_largest(n, data, largest, dtype,
                                                                    kind):
    k = data.draw(st.integers(1, min(n, 1024)))
    g = torch.Generator().manual_seed(n * 7 + k)
    x = {"normal": lambda: torch.randn(n, generator=g),
         "few-values": lambda: torch.randint(0, 3, (n,), generator=g).float(),
         "ascending": lambda: torch.arange(n, dtype=torch.float32),
         "descending": lambda: -torch.arange(n, dtype=torch.float32),
         "special": lambda: torch.tensor(_SPECIAL)[torch.randint(0, len(_SPECIAL), (n,),
                                                                 generator=g)]}[kind]().to(dtype)
    kv = _keys(x, largest)
    # the greatest (key, -index) pairs are the stable sort's first k, in its order
    order = sorted(range(n), key=lambda i: (-int(kv[i]), i))[:k]
    want = torch.sort(x.float(), descending=largest, stable=True).indices[:k]
    assert order == want.tolist()
    for lean in (True, False):
        bound = _bound(kv, k, K.topk_plan(n, k, str(dtype).removeprefix("torch."), lean))
        assert int((kv >= bound).sum()) >= k
        assert bound <= int(kv[order[-1]])


def _bound_value(t: int, dtype: torch.dtype, largest: bool) -> float:
    """The lean filter's value of bound key ``t``, as the program computes it."""
    bits = K._KEY[str(dtype).removeprefix("torch.")][0]
    full, sign = (1 << bits) - 1, 1 << (bits - 1)
    if t == 0:
        return -math.inf if largest else math.inf
    kv = t if largest else full - t
    b = kv ^ sign if kv >= sign else (~kv) & full
    signed = b - (1 << bits) if b >= sign else b
    as_int = torch.int32 if bits == 32 else torch.int16
    return float(torch.tensor([signed], dtype=as_int).view(dtype).float())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("largest", [True, False])
def test_the_lean_filter_passes_exactly_the_keys_reaching_the_bound(dtype, largest):
    """Every 16-bit value (a sample of 32-bit ones with the special values) against bounds of
    every kind (signed zeros, subnormals, infinities, NaN's key, no bound): the float
    comparison passes a number exactly where its key reaches the bound (without nvcc's flush
    of subnormals; the flush is monotone, so it can only pass more), and every NaN passes
    (the smallest's NaN needlessly: a superset is harmless, the rounds select by key)."""
    if dtype == torch.float32:
        g = torch.Generator().manual_seed(0)
        raw = torch.cat([torch.randint(-(1 << 31), 1 << 31, (60000,), generator=g),
                         torch.tensor([0, 1, 0x7F800000, 0x7FC00000, 0x00800000])])
        raw = torch.cat([raw, raw | (1 << 31) - (1 << 32)]).to(torch.int32)
    else:
        raw = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    x = raw.view(dtype)
    kv = _keys(x, largest)
    f = x.float()
    # a bound is an element's key (the k-th largest of some elements' keys), or 0
    tiny = torch.finfo(dtype).smallest_normal
    special = torch.tensor(_SPECIAL + [tiny, -tiny, tiny / 4, -tiny / 4]).to(dtype)
    bounds = {0} | {int(v) for v in kv[::1999]} | {int(v) for v in _keys(special, largest)}
    t = torch.tensor(sorted(bounds))[:, None]  # every bound at once: few large tensor ops
    lo = torch.tensor([_bound_value(int(b), dtype, largest) for b in t])[:, None]
    nan = f.isnan()
    passes = (f >= lo if largest else f <= lo) | nan
    want = kv >= t
    wrong = (passes != want)[:, ~nan].any(dim=1)
    assert not wrong.any(), t[wrong].flatten().tolist()
    assert passes[:, nan].all()  # NaN is kept by the largest, and passed on by the smallest


def test_the_bound_keeps_few_candidates_of_logits():
    """What the buffer sizes are chosen for: normal logits fit the buffer (the one pass), at
    k = 50 in a quarter of the earlier plan's and half the lean plan's (about 400 of 128256,
    800 of 262144; both plans hold the same 16384 elements for the bound; k = 1024 keeps
    8%)."""
    for n, k, share, lean_share in ((128256, 50, 4, 2), (262144, 50, 4, 2),
                                    (131072, 1024, 1, 1)):
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        kv = _keys(x, True)
        for lean, part in ((True, lean_share), (False, share)):
            plan = K.topk_plan(n, k, "bfloat16", lean)
            assert int((kv >= _bound(kv, k, plan)).sum()) <= plan[3] // part


def test_few_rows_are_split_and_many_are_not():
    assert K.split_plan(1, 262144, 50) == 64  # one row over 64 CTAs of 4096
    assert K.split_plan(64, 131072, 1024) == 4  # segments keep 8 k
    assert K.split_plan(4096, 128256, 50) == 1
    assert K.split_plan(3, 7, 2) == 1
    assert K.split_plan(1, 40961, 2) == 1  # no power of two divides an odd row


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 3), log_segs=st.integers(1, 4), k=st.integers(1, 40),
       largest=st.booleans(), few=st.booleans())
def test_a_split_row_merges_into_the_one_pass_answer(monkeypatch_build, rows, log_segs, k,
                                                      largest, few):
    """The split's orchestration (the segments as rows, the merge, the positions mapped back)
    over programs that answer as the one-pass program promises (a stable sort's first k),
    on rows of few distinct values, where every tie matters."""
    segs = 1 << log_segs
    sub = max(K._MIN_SEGMENT, K._MIN_SEGMENT_K * k)
    n = segs * sub
    assert K.split_plan(rows, n, k) == segs
    g = torch.Generator().manual_seed(rows * 1000 + k)
    x = (torch.randint(0, 4, (rows, n), generator=g).float() if few
         else torch.randn(rows, n, generator=g))
    kernel = K.TopkRadixKernel(K.TopkSpec(device="cuda", rows=rows, n=n, k=k,
                                          dtype="float32", largest=largest))
    values = torch.empty(rows, k)
    indices = torch.empty(rows, k, dtype=torch.int64)
    kernel(x, values, indices)
    want_v, want_i = torch.sort(x, dim=1, descending=largest, stable=True)
    assert torch.equal(indices, want_i[:, :k]) and torch.equal(values, want_v[:, :k])


@pytest.fixture(scope="module")
def monkeypatch_build():
    """build_topk answering with a stable sort on the CPU, so that a kernel object can be made
    and called without compiling."""
    def build(n, k, dtype, largest, target=None, plan=None):
        def program(x, v, i):
            assert tuple(x.shape[1:]) == (n,) and x.is_contiguous()
            sv, si = torch.sort(x, dim=1, descending=largest, stable=True)
            v.copy_(sv[:, :k])
            i.copy_(si[:, :k])
        return program

    mp = pytest.MonkeyPatch()
    mp.setattr(K, "build_topk", build)
    yield
    mp.undo()


@pytest.mark.parametrize(("dim", "k", "largest"), [(-1, 3, True), (0, 2, False), (1, 9, True),
                                                     (-1, 0, True)])
def test_the_values_train_as_torch_and_the_node_keeps_no_copy_of_x(dim, k, largest):
    x = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    h = x * 2  # an intermediate nothing else keeps
    values, indices = ops.TopkFwdOp(k=k, dim=dim, largest=largest)(h)
    kept_indices, kept_x = values.grad_fn.saved_tensors
    assert torch.equal(kept_indices, indices)
    assert kept_x.shape == h.shape and all(s == 0 for s in kept_x.stride())  # a stand-in
    dv = torch.randn_like(values)
    (got,) = torch.autograd.grad(values, x, dv)
    want_v, _ = torch.topk(x * 2, k, dim=dim, largest=largest)
    want = torch.autograd.grad(want_v, x, dv)[0] if k else torch.zeros_like(x)
    torch.testing.assert_close(got, want)


# --- the gradient's indices ---------------------------------------------------------------------


def _bad_index_calls():
    """(what is wrong, the call's indices, the exception, the message) for a TopkBwdOp(k=2)
    called directly with dvalues [3, 2] and x [3, 7]."""
    good = [[0, 1], [1, 2], [3, 4]]
    return [
        ("past the row", [[0, 9], [1, 2], [3, 4]], IndexError,
         "TopkBwdOp: argument indices holds 9 at indices[0, 1]; expected positions along x's "
         "dim -1 (x is [3, 7]) in [0, 7), as torch.topk returns them"),
        ("negative", [[0, 1], [1, 2], [-1, 4]], IndexError,
         "TopkBwdOp: argument indices holds -1 at indices[2, 0]; expected positions along x's "
         "dim -1 (x is [3, 7]) in [0, 7), as torch.topk returns them"),
        ("twice in a run", [[0, 1], [2, 2], [3, 4]], IndexError,
         "TopkBwdOp: argument indices holds 2 twice in indices[1, :]; expected distinct "
         "positions along x's dim -1 (x is [3, 7]) in each run, as torch.topk returns them "
         "(the scatter would keep one of the two values)"),
        ("int32", torch.tensor(good, dtype=torch.int32), SignatureCallError,
         "indices.dtype must be int64, but is int32"),
        ("fewer rows", good[:2], SignatureCallError,
         "O is [3, 2] (bound by dvalues.shape[0:]), but that part of the shape is [2, 2]"),
        ("k + 1 per row", [[0, 1, 2], [1, 2, 3], [3, 4, 5]], SignatureCallError,
         "O is [3, 2] (bound by dvalues.shape[0:]), but that part of the shape is [3, 3]"),
    ]


@pytest.mark.parametrize("target", ["reference", "in-tree"])
@pytest.mark.parametrize(("what", "indices", "error", "message"), _bad_index_calls())
def test_top_k_s_gradient_called_directly_refuses_indices_the_forward_cannot_return(
        target, what, indices, error, message):
    """TopkBwdOp called directly (not by the forward's gradient): an index outside the row,
    one twice in a run (torch's scatter would raise naming neither, on a GPU a device-side
    assert, or keep one of the values), the wrong dtype or shape: refused naming the op, the
    argument, what was expected and what was seen; the op serves the next call."""
    from tileops.runtime import targets

    op = ops.TopkBwdOp(k=2, target=targets.IN_TREE if target == "in-tree" else target)
    x, dv = torch.randn(3, 7), torch.randn(3, 2)
    idx = indices if isinstance(indices, torch.Tensor) else torch.tensor(indices)
    with pytest.raises(error) as exc:
        op(dv, idx, x)
    text = str(exc.value)
    assert text.startswith("TopkBwdOp") and message in text, text
    if error is SignatureCallError:
        assert exc.value.argument == "indices"
    good = torch.tensor([[0, 6], [1, 2], [5, 4]])
    torch.testing.assert_close(op(dv, good, x), torch.zeros(3, 7).scatter(1, good, dv))


def test_the_forward_s_own_gradient_reads_no_index_on_the_host(monkeypatch):
    """The backward op a forward builds for its gradient takes the forward's indices (autograd
    refuses them changed in place) and checks none on the host; one built directly does."""
    from tileops.ops import topk as topk_module
    from tileops.runtime import targets

    fwd = _in_tree(k=3, target=targets.IN_TREE)  # its gradient in-tree too
    x = torch.randn(4, 9, requires_grad=True)
    values, indices = fwd(x)
    reads = []
    monkeypatch.setattr(topk_module, "first_outside",
                        lambda *a: reads.append(a) or None)
    (got,) = torch.autograd.grad(values, x, torch.ones_like(values))
    torch.testing.assert_close(got, torch.zeros(4, 9).scatter(1, indices, 1.0))
    assert reads == []
    (bwd,) = fwd._backward_ops.values()
    assert bwd._fed_by_forward and not bwd.checks_indices(indices)
    assert ops.TopkBwdOp(k=3).checks_indices(indices)
    with pytest.raises(IndexError, match="TopkBwdOp: argument indices holds 9"):
        bwd.reference(None, torch.ones(4, 3), indices.clamp(max=0) + 9, x)  # its reference
    values, indices = fwd(x)
    with torch.no_grad():
        indices.add_(0)  # a change in place: autograd refuses the saved indices
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(values.sum(), x)


@pytest.mark.parametrize("k", [0, 1])
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_0_dim_input_is_torchs_one_element(k, dim, dtype):
    """torch.topk of a 0-dim tensor, k 0 or 1: the element and index 0, both 0-dim (it was
    refused); the gradient is the upstream one; k = 2 is refused naming the length."""
    x = torch.tensor(2.5, dtype=dtype, requires_grad=True)
    vals, idx = ops.TopkFwdOp(k=k, dim=dim)(x)
    want_v, want_i = torch.topk(x.detach(), k, dim=dim)
    assert vals.shape == idx.shape == () and torch.equal(vals.detach(), want_v)
    assert torch.equal(idx, want_i) and idx.dtype == torch.int64
    (vals * 3).backward()
    assert x.grad.dtype == dtype and float(x.grad) == 3.0
    with pytest.raises(Exception, match="a length of 2 does not fit"):
        ops.TopkFwdOp(k=2, dim=dim)(x)


def test_the_gradient_op_of_a_0_dim_input_checks_its_index():
    """TopkBwdOp called directly on a 0-dim x: dvalues back in place at index 0; any other
    index is refused by name."""
    x, dv = torch.tensor(1.0, dtype=torch.float64), torch.tensor(4.0, dtype=torch.float64)
    op = ops.TopkBwdOp(k=1)
    assert torch.equal(op(dv, torch.tensor(0), x), dv)
    with pytest.raises(IndexError, match="argument indices is 3; expected 0"):
        op(dv, torch.tensor(3), x)
    assert torch.equal(op(dv, torch.tensor(0), x), dv)
