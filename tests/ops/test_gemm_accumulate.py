"""GemmAccumulateFwdOp (``c += op(a) @ op(b)``) on the reference target (CPU): against float64
over the transposes, odd sizes, M = 0 and 1, K = 0 (c unchanged), by hypothesis over the
shapes; the effect (c itself returned and written, read and written in the traffic); the
refusals of a c that cannot be written in place; and the in-tree forward's call spec and its
write-back of a c the kernels cannot write as it is (a stand-in kernel, no GPU)."""

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tileops.ops import GemmAccumulateFwdOp, GemmFwdOp  # noqa: E402
from tileops.signature import SignatureCallError  # noqa: E402

TRANS = [(False, False), (False, True), (True, False), (True, True)]
#: (M, N, K): one of each, a tile multiple, sizes that are none, M = 1, K = 1
SIZES = [(1, 1, 1), (1, 64, 32), (7, 13, 1), (33, 17, 65), (128, 96, 80)]


def _operands(m, n, k, ta, tb, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + 131 * m + 17 * n + k)
    c = torch.randn((m, n), generator=g).to(dtype)
    a = torch.randn((k, m) if ta else (m, k), generator=g).to(dtype)
    b = torch.randn((n, k) if tb else (k, n), generator=g).to(dtype)
    return c, a, b


def _ref64(c, a, b, ta, tb):
    a, b = a.double(), b.double()
    return c.double() + (a.T if ta else a) @ (b.T if tb else b)


def _close(out, c, a, b, ta, tb) -> bool:
    """Within the float64 result's one rounding to ``out``'s dtype plus the fp32 sum's bound
    (K + 1 additions, each off by at most 2^-24 of the sum of magnitudes, elementwise)."""
    ref = _ref64(c, a, b, ta, tb)
    a, b = a.double().abs(), b.double().abs()
    mags = c.double().abs() + (a.T if ta else a) @ (b.T if tb else b)
    k = a.shape[0] if ta else a.shape[-1]
    bound = torch.finfo(out.dtype).eps * ref.abs() + (k + 1) * 2.0 ** -24 * mags
    return bool(((out.double() - ref).abs() <= bound).all())


@pytest.mark.parametrize(("trans_a", "trans_b"), TRANS, ids=["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize(("m", "n", "k"), SIZES, ids=[f"{m}x{n}x{k}" for m, n, k in SIZES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_reference_against_float64(trans_a, trans_b, m, n, k, dtype):
    c, a, b = _operands(m, n, k, trans_a, trans_b, dtype)
    c0 = c.clone()
    op = GemmAccumulateFwdOp(trans_a=trans_a, trans_b=trans_b)
    out = op(c, a, b)
    assert out is c and op.serving_target == "reference"
    assert c.shape == (m, n) and c.dtype == dtype
    assert _close(c, c0, a, b, trans_a, trans_b)


def test_the_sum_is_rounded_once():
    """c + a @ b in fp32, then one rounding to bfloat16: not the product rounded first."""
    c, a, b = _operands(64, 48, 96, False, False, torch.bfloat16, seed=3)
    once = (c.float() + a.float() @ b.float()).to(torch.bfloat16)
    twice = c + (a.float() @ b.float()).to(torch.bfloat16)
    assert not torch.equal(once, twice)  # the inputs tell the two apart
    GemmAccumulateFwdOp()(c, a, b)
    assert torch.equal(c, once)


def test_float64_is_exact_in_float64():
    c, a, b = _operands(33, 17, 65, True, False, torch.float64)
    ref = _ref64(c, a, b, True, False)
    GemmAccumulateFwdOp(trans_a=True)(c, a, b)
    assert torch.allclose(c, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("m", "n", "k"), [(0, 5, 3), (4, 0, 3), (0, 0, 0), (4, 5, 0), (1, 5, 0)])
def test_empty_calls_and_k0_leave_c_as_it_is(m, n, k):
    c, a, b = _operands(m, n, k, False, False, torch.bfloat16)
    before = c.clone()
    op = GemmAccumulateFwdOp()
    assert op(c, a, b) is c
    assert torch.equal(c, before)  # K = 0: a sum of nothing adds nothing


_shapes = st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 40),
                    st.booleans(), st.booleans(),
                    st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))


@settings(max_examples=60, deadline=None)
@given(_shapes)
def test_any_shape_and_layout_against_float64(case):
    m, n, k, ta, tb, dtype = case
    c, a, b = _operands(m, n, k, ta, tb, dtype, seed=7)
    c0 = c.clone()
    assert GemmAccumulateFwdOp(trans_a=ta, trans_b=tb)(c, a, b) is c
    assert _close(c, c0, a, b, ta, tb)


def test_accumulating_twice_adds_twice():
    c, a, b = _operands(16, 24, 8, False, True, torch.float64)
    ref = _ref64(c, a, b, False, True)
    ref = ref + (ref - c)
    op = GemmAccumulateFwdOp(trans_b=True)
    op(c, a, b)
    op(c, a, b)
    assert torch.allclose(c, ref, rtol=1e-12, atol=1e-12)


def test_the_effect_and_the_traffic_follow_the_spec():
    c, a, b = _operands(4, 6, 3, False, False, torch.bfloat16)
    op = GemmAccumulateFwdOp()
    op(c, a, b)
    assert op.last_call.written_inputs == ("c",)
    flops, traffic = op.eval_roofline()
    assert flops == 2 * 4 * 6 * 3
    assert traffic == 2 * (2 * 4 * 6 + 4 * 3 + 3 * 6)  # c read and written, a and b read


@pytest.mark.parametrize("view", ["strided", "column-major", "offset"])
def test_a_view_of_c_is_written_through(view):
    c0, a, b = _operands(9, 10, 7, False, False, torch.bfloat16)
    if view == "strided":
        c = torch.empty(9, 20, dtype=torch.bfloat16)[:, ::2]
    elif view == "column-major":
        c = torch.empty(10, 9, dtype=torch.bfloat16).T
    else:
        c = torch.empty(91, dtype=torch.bfloat16)[1:].view(9, 10)
    c.copy_(c0)
    assert GemmAccumulateFwdOp()(c, a, b) is c
    assert _close(c, c0, a, b, False, False)


# --- refusals ------------------------------------------------------------------------------------


def test_c_of_the_wrong_shape_is_refused_by_the_signature():
    c, a, b = _operands(8, 16, 32, False, False, torch.bfloat16)
    with pytest.raises(SignatureCallError) as info:
        GemmAccumulateFwdOp()(c[:, :15], a, b)
    msg = str(info.value)
    assert "GemmAccumulateFwdOp" in msg and "N bound to 15 by c.shape[1], but b.shape[1] is 16" \
        in msg


def test_c_of_another_dtype_is_refused_by_the_signature():
    c, a, b = _operands(8, 16, 32, False, False, torch.bfloat16)
    with pytest.raises(SignatureCallError) as info:
        GemmAccumulateFwdOp()(c.float(), a, b)
    assert "float32" in str(info.value) and "bfloat16" in str(info.value)


def test_an_expanded_c_is_refused():
    _, a, b = _operands(5, 7, 3, False, False, torch.float32)
    c = torch.zeros(1, 7).expand(5, 7)
    with pytest.raises(RuntimeError) as info:
        GemmAccumulateFwdOp()(c, a, b)
    assert str(info.value) == (
        f"{GemmAccumulateFwdOp()!r}: c is written in place, but its elements share memory (an "
        "expanded or overlapping view of shape (5, 7) and strides (0, 1)), so what an element "
        "would hold is ambiguous; pass a tensor that owns its elements (.contiguous())")


@pytest.mark.parametrize("other", ["a", "b"])
def test_a_c_sharing_memory_with_an_operand_is_refused_and_nothing_is_written(other):
    buf = torch.arange(60, dtype=torch.float32).view(12, 5)
    before = buf.clone()
    c = buf[:4]  # rows 0-3: bytes [0, 80)
    if other == "a":
        a, b = buf[3:7, :3], torch.ones(3, 5)  # rows 3-6 (bytes [60, 132)), overlapping c
    else:
        a, b = torch.ones(4, 3), buf[2:5, :]  # rows 2-4: bytes [40, 100)
    with pytest.raises(RuntimeError) as info:
        GemmAccumulateFwdOp()(c, a, b)
    span = "[60, 132)" if other == "a" else "[40, 100)"
    assert str(info.value) == (
        f"GemmAccumulateFwdOp: c is written in place, but it shares memory with {other} (bytes "
        f"[0, 80) and {span} of one storage), which the product reads while c is written; "
        f"pass a copy of {other} ({other}.clone())")
    assert torch.equal(buf, before)


def test_disjoint_views_of_one_storage_are_accepted():
    buf = torch.randn(12, 5, dtype=torch.float64)
    c, a, b = buf[:4], buf[4:8, :3], buf[8:11]
    ref = _ref64(c, a, b, False, False)
    GemmAccumulateFwdOp()(c, a, b)
    assert torch.allclose(c, ref)


def test_interleaved_views_with_no_common_element_are_accepted():
    """c and a the left and right column blocks of one buffer: their byte ranges interleave
    but share no element, so the product is served as torch's addmm_ serves it (it was
    refused); blocks that do share elements (overlapping columns, every other column) are
    still refused."""
    buf = torch.randn(4, 8, dtype=torch.float64)
    c, a, e = buf[:, :4], buf[:, 4:], torch.eye(4, dtype=torch.float64)
    want = c.clone().addmm_(a, e)
    out = GemmAccumulateFwdOp()(c, a, e)
    assert out.data_ptr() == c.data_ptr() and torch.equal(c, want)
    for a in (buf[:, 2:6], buf[:, ::2]):
        with pytest.raises(RuntimeError, match="c is written in place, but it shares memory "
                                               "with a"):
            GemmAccumulateFwdOp()(buf[:, :4], a, e)


def test_an_operand_requiring_grad_is_refused():
    c, a, b = _operands(4, 6, 3, False, False, torch.float32)
    with pytest.raises(RuntimeError, match="GemmAccumulateFwdOp"):
        GemmAccumulateFwdOp()(c, a.requires_grad_(), b)


# --- the in-tree forward (a stand-in kernel: the call spec and the layout it is handed) --------


def _stand_in(op, seen):
    """Route the op's kernel selection to a CPU function doing what the slot's accumulating
    entry does, recording the spec and the tensors it is given."""

    def kernel(iface, spec):
        def run(a, b, c):
            seen.append((spec, c))
            am = a.float().T if spec.trans_a else a.float()
            bm = b.float().T if spec.trans_b else b.float()
            assert c.is_contiguous() and c.data_ptr() % 16 == 0  # what the kernels write
            c.copy_(c.float() + am @ bm)
        return run

    op.kernel = kernel


@pytest.mark.parametrize(("ta", "tb"), TRANS, ids=["nn", "nt", "tn", "tt"])
def test_forward_hands_the_accumulating_spec_and_c_itself(ta, tb):
    from tileops.kernels.gemm import GemmSpec

    c, a, b = _operands(128, 64, 96, ta, tb, torch.bfloat16)
    c0 = c.clone()
    op = GemmAccumulateFwdOp(trans_a=ta, trans_b=tb)
    seen = []
    _stand_in(op, seen)
    op.forward(op._point.check(c, a, b), c, a, b, c)
    (spec, given), = seen
    assert type(spec) is GemmSpec and spec.accumulate is True
    assert (spec.m, spec.n, spec.k, spec.trans_a, spec.trans_b) == (128, 64, 96, ta, tb)
    assert given is c  # contiguous and aligned: written directly
    assert _close(c, c0, a, b, ta, tb)


@pytest.mark.parametrize("view", ["strided", "offset"])
def test_forward_writes_back_a_c_the_kernels_cannot_write(view):
    c0, a, b = _operands(16, 24, 8, False, False, torch.bfloat16)
    if view == "strided":
        c = torch.empty(16, 48, dtype=torch.bfloat16)[:, ::2]
    else:
        c = torch.empty(16 * 24 + 1, dtype=torch.bfloat16)[1:].view(16, 24)
    c.copy_(c0)
    op = GemmAccumulateFwdOp()
    seen = []
    _stand_in(op, seen)
    op.forward(op._point.check(c, a, b), c, a, b, c)
    (_, given), = seen
    assert given is not c
    assert _close(c, c0, a, b, False, False)


def test_forward_refuses_before_any_kernel_runs():
    buf = torch.zeros(12, 8, dtype=torch.bfloat16)
    op = GemmAccumulateFwdOp()
    seen = []
    _stand_in(op, seen)
    c, a, b = buf[:4], buf[2:6], torch.zeros(8, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="shares memory with a"):
        op.forward(op._point.check(c, a, b), c, a, b, c)
    assert seen == []


def test_the_plain_product_hands_a_plain_spec():
    op = GemmFwdOp()
    seen = []
    op.kernel = lambda iface, spec: seen.append(spec) or (lambda a, b, c: None)
    _, a, b = _operands(8, 16, 32, False, False, torch.bfloat16)
    op.forward(op._point.check(a, b), a, b, torch.empty(8, 16, dtype=torch.bfloat16))
    assert seen[0].accumulate is False
