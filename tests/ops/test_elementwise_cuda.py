"""The elementwise family on the in-tree kernels (marked ``cuda``): what the harness's
workloads do not reach. Broadcasting and promotion against torch over random shapes and dtype
pairs, in-place calls on strided views and the refusal of overlapping ones, gated ops on
strided inputs, and the cached call (one entry per layout, none rebuilt)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tileops.ops import (
    AddFwdOp,
    DivBwdOp,
    DivFwdOp,
    EqFwdOp,
    GeluFwdOp,
    LerpBwdOp,
    MaximumFwdOp,
    MulFwdOp,
    PowFwdOp,
    ReluFwdOp,
    SiluAndMulFwdOp,
    SiluFwdOp,
    WhereFwdOp,
)

pytestmark = pytest.mark.cuda

DTYPES = [torch.bool, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32]


def _tensor(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g, device="cuda") > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, device="cuda") * 3).to(dtype)
    return torch.randint(-20, 20, shape, generator=g, device="cuda").to(dtype)


@st.composite
def _pair(draw):
    rank = draw(st.integers(0, 4))
    base = draw(st.lists(st.integers(1, 33), min_size=rank, max_size=rank))
    out = []
    for _ in range(2):
        keep = draw(st.integers(0, rank))
        out.append(tuple(1 if draw(st.booleans()) else d for d in base[rank - keep:]))
    return out


BINARY = [(AddFwdOp(), torch.add), (MulFwdOp(), torch.mul), (MaximumFwdOp(), torch.maximum),
          (EqFwdOp(), torch.eq)]


@settings(max_examples=40, deadline=None)
@given(shapes=_pair(), da=st.sampled_from(DTYPES), db=st.sampled_from(DTYPES),
       which=st.integers(0, len(BINARY) - 1), transpose=st.booleans())
def test_binary_matches_torch_over_shapes_and_dtypes(shapes, da, db, which, transpose):
    op, fn = BINARY[which]
    a, b = _tensor(shapes[0], da, 1), _tensor(shapes[1], db, 2)
    if transpose and a.dim() >= 2:
        a = a.transpose(-1, -2).contiguous().transpose(-1, -2)  # same shape, strided
    want = fn(a, b)
    got = op(a, b)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_inplace_on_a_strided_view_writes_the_view():
    base = torch.randn(64, 130, device="cuda", dtype=torch.bfloat16)
    view = base[:, 1:129:2]  # every other column: strided, misaligned start
    want = base.clone()
    want[:, 1:129:2] = F.silu(want[:, 1:129:2].float()).to(torch.bfloat16)
    assert SiluFwdOp(inplace=True)(view) is view
    torch.testing.assert_close(base, want, rtol=0, atol=0)


def test_inplace_on_an_overlapping_view_is_refused_and_the_op_stays_usable():
    x = torch.randn(1, 256, device="cuda").expand(8, 256)
    op = ReluFwdOp(inplace=True)
    with pytest.raises(RuntimeError, match=r"^ReluFwdOp\(inplace=True\): x is written in "
                                           r"place, but its elements share memory \(an "
                                           r"expanded or overlapping view of shape \(8, 256\) "
                                           r"and strides \(0, 1\)\)"):
        op(x)
    y = torch.randn(8, 256, device="cuda")
    want = F.relu(y)
    assert op(y) is y
    torch.testing.assert_close(y, want, rtol=0, atol=0)


def test_gated_op_reads_a_strided_input_without_copies():
    x = torch.randn(32, 2 * 1000 + 6, device="cuda", dtype=torch.bfloat16)[:, 3:2003]
    gate, up = x.chunk(2, dim=-1)
    want = (F.silu(gate.float()) * up.float()).to(torch.bfloat16)
    torch.testing.assert_close(SiluAndMulFwdOp()(x), want, rtol=1e-2, atol=1e-2)


def test_bool_outputs_and_conditions():
    a = torch.randn(300, 7, device="cuda", dtype=torch.bfloat16)
    b = torch.tensor(0.25, device="cuda")
    eq = EqFwdOp()(a, a)
    assert eq.dtype is torch.bool and bool(eq.all())
    cond = a > 0
    torch.testing.assert_close(WhereFwdOp()(cond, a, b), torch.where(cond, a, b), rtol=0, atol=0)


def test_one_entry_per_layout_and_the_cached_call_builds_nothing():
    op = GeluFwdOp(approximate="tanh")
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    op(x)
    entries = dict(op._entries_by_call)
    for _ in range(3):
        op(x)
    assert op._entries_by_call == entries
    op(torch.randn(17, 512, device="cuda", dtype=torch.bfloat16))  # a new size: a new key
    new = [k for k in op._entries_by_call if k not in entries]
    # the call's key, and the kernel's own memo of the new spec
    assert len(new) == 2 and sum(k[0] == x.device for k in new) == 1, new
    with pytest.raises(TypeError, match=r"^PowFwdOp: the in-tree elementwise kernels compute "
                                        r"pow in a floating dtype, not int32; construct the op "
                                        r"with target='reference' for an integer power$"):
        PowFwdOp()(torch.arange(4, device="cuda", dtype=torch.int32),
                   torch.arange(4, device="cuda", dtype=torch.int32))
    ints = torch.arange(4, dtype=torch.int32)
    torch.testing.assert_close(PowFwdOp(target="reference")(ints, ints), ints ** ints)


def test_integer_division_rounds_as_torch():
    a = torch.randint(-50, 50, (1000,), device="cuda", dtype=torch.int32)
    b = torch.randint(1, 9, (1000,), device="cuda", dtype=torch.int32) * \
        (torch.randint(0, 2, (1000,), device="cuda", dtype=torch.int32) * 2 - 1)
    for mode in ("trunc", "floor"):
        torch.testing.assert_close(DivFwdOp(rounding_mode=mode)(a, b),
                                   torch.div(a, b, rounding_mode=mode), rtol=0, atol=0)
    out = DivFwdOp()(a, b)
    assert out.dtype is torch.float32
    torch.testing.assert_close(out, torch.div(a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_broadcast_gradient_sums_its_terms_before_rounding(dtype):
    """The gradient of a broadcast input (a bias) whose terms nearly cancel: each column sums
    4096 terms of about 1 to about 1, which 16-bit terms would miss by some 5% (their rounding
    errors add up while the sum cancels); the float32 terms summed and rounded once are within
    the final rounding of float64."""
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(4096, 256, generator=g, device="cuda").to(dtype)
    a[-1] = (1 - a[:-1].double().sum(0)).to(dtype)  # each column's sum near 1
    b = (torch.rand(256, generator=g, device="cuda") + 1).to(dtype)
    dout = torch.ones(4096, 256, device="cuda", dtype=dtype)
    total = a.double().sum(0)
    assert total.abs().min() > 0.5
    _, db = DivBwdOp(grad_a=False, grad_b=True)(dout, a, b)
    ref = -total / b.double() ** 2
    err = (db.double() - ref).abs() / ref.abs()
    assert err.max() <= 2.0 ** -8, float(err.max())
    # lerp's weight gradient over a broadcast weight: dout (end - start), the same sum
    _, _, dw = LerpBwdOp(grad_start=False, grad_end=False, grad_weight=True)(
        dout, torch.zeros_like(a), a, b)
    err = (dw.double() - total).abs() / total.abs()
    assert err.max() <= 2.0 ** -8, float(err.max())


def test_permuted_inputs_give_outputs_in_their_layout():
    """A transposed or ``[B, S, H, D]``-as-``[B, H, S, D]`` input gives an output in its own
    memory order, as torch's (the kernels read and write both as one flat run), with torch's
    values; an in-place call on a transposed view writes it."""
    x = torch.randn(4, 256, 8, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    y = SiluFwdOp()(x)
    assert y.stride() == x.stride() == F.silu(x).stride()
    torch.testing.assert_close(y, F.silu(x), rtol=2 ** -7, atol=0)
    a = torch.randn(512, 300, device="cuda", dtype=torch.float16).t()
    b = torch.randn(512, 300, device="cuda", dtype=torch.float16).t()
    z = AddFwdOp()(a, b)
    assert z.stride() == torch.add(a, b).stride() == (1, 300)
    assert torch.equal(z, torch.add(a, b))
    w = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16)
    v = w.t()
    want = torch.relu(v)
    assert ReluFwdOp(inplace=True)(v) is v and torch.equal(v, want)
