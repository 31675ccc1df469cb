"""The elementwise family's own behaviour: torch's calling conventions, broadcasting and type
promotion against torch over random shapes and dtype pairs, the effects of ``inplace``, the
clamp's two spellings of a bound, and the in-place gradient rule. The generic harness covers
every entry's numerics, bad inputs, compile, fake tensors and gradients; these run on the CPU
through the ``reference`` target, and ``test_elementwise_cuda.py`` on the in-tree kernels."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import tileops.ops as ops
from tileops.ops import (
    AddFwdOp,
    ClampFwdOp,
    DivFwdOp,
    EqFwdOp,
    ExpFwdOp,
    GeFwdOp,
    GeluAndMulFwdOp,
    GeluFwdOp,
    GeluTanhAndMulFwdOp,
    GtFwdOp,
    HardtanhFwdOp,
    LeFwdOp,
    LerpFwdOp,
    LtFwdOp,
    MaskedFillFwdOp,
    MaximumFwdOp,
    MinimumFwdOp,
    MulFwdOp,
    NeFwdOp,
    NegFwdOp,
    PowFwdOp,
    ReluFwdOp,
    RemainderFwdOp,
    SiluAndMulFwdOp,
    SiluBwdOp,
    SiluFwdOp,
    SubFwdOp,
    SwiGLUFwdOp,
    WhereFwdOp,
)
from tileops.signature import SignatureCallError

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64]


def _tensor(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    lo = 0 if dtype is torch.uint8 else -20
    return torch.randint(lo, 20, shape, generator=g).to(dtype)


# --- calling conventions ------------------------------------------------------------------


def test_inplace_activation_returns_its_input_written():
    x = torch.randn(4, 7)
    want = F.relu(x)
    y = ReluFwdOp(inplace=True)(x)
    assert y is x
    torch.testing.assert_close(x, want)


def test_out_of_place_activation_leaves_its_input():
    x = torch.randn(4, 7)
    before = x.clone()
    y = SiluFwdOp()(x)
    assert y is not x and y.data_ptr() != x.data_ptr()
    torch.testing.assert_close(x, before, rtol=0, atol=0)
    torch.testing.assert_close(y, F.silu(x))


def test_gelu_approximate_is_an_enum_param():
    x = torch.randn(64, dtype=torch.float64)
    torch.testing.assert_close(GeluFwdOp(approximate="tanh")(x), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(GeluFwdOp()(x), F.gelu(x))
    with pytest.raises(Exception, match="approximate"):
        GeluFwdOp(approximate="sigmoid")


def test_add_alpha_and_clamp_bounds_are_params():
    a, b = torch.randn(3, 5), torch.randn(5)
    torch.testing.assert_close(AddFwdOp(alpha=2.5)(a, b), torch.add(a, b, alpha=2.5))
    torch.testing.assert_close(SubFwdOp(alpha=0.5)(a, b), torch.sub(a, b, alpha=0.5))
    torch.testing.assert_close(ClampFwdOp(min=-0.5, max=0.25)(a), a.clamp(-0.5, 0.25))
    torch.testing.assert_close(ClampFwdOp(max=0.25)(a), a.clamp(max=0.25))


def test_clamp_tensor_bounds_and_refusals():
    x = torch.randn(4, 6)
    lo = torch.full((4, 6), -0.1)
    hi = torch.rand(6).expand(4, 6)  # an expanded view
    torch.testing.assert_close(ClampFwdOp()(x, lo, hi), torch.clamp(x, lo, hi))
    torch.testing.assert_close(ClampFwdOp()(x, None, hi), torch.clamp(x, max=hi))
    # bounds that broadcast to x, as torch.clamp takes them: a row, a column, a 0-dim
    for low, high in ((torch.rand(6) - 1, torch.rand(4, 1)), (torch.tensor(-0.2), None),
                      (None, torch.rand(1, 1, 6)[0])):
        torch.testing.assert_close(ClampFwdOp()(x, low, high), torch.clamp(x, low, high))
        y = x.clone()
        assert ClampFwdOp(inplace=True)(y, low, high) is y
        torch.testing.assert_close(y, torch.clamp(x, low, high))
    # a bound that would broadcast x to a larger shape, or does not broadcast: refused by name
    for name, bad in (("min_bound", torch.zeros(2, 4, 6)), ("max_bound", torch.zeros(3, 6))):
        with pytest.raises(SignatureCallError) as exc:
            ClampFwdOp()(x, **{name: bad})
        assert str(exc.value).startswith(f"ClampFwdOp: argument {name} does not match")
        assert "expands_to(S" in str(exc.value)
    with pytest.raises(SignatureCallError, match="ClampFwdOp"):
        ClampFwdOp(min=0.0)(x, lo)  # min given twice: a number and a tensor
    with pytest.raises(SignatureCallError, match=r"present\(min\) or present\(max\)"):
        ClampFwdOp()(x)  # no bound at all, which torch refuses too


def test_gated_conventions():
    x = torch.randn(3, 2 * 8, dtype=torch.float64)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMulFwdOp()(x), F.silu(gate) * up)
    a, b = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    torch.testing.assert_close(SwiGLUFwdOp()(a, b), F.silu(a) * b)
    with pytest.raises(SignatureCallError, match="SiluAndMulFwdOp"):
        SiluAndMulFwdOp()(torch.randn(3, 7))  # an odd last axis has no two halves


@pytest.mark.parametrize("shape", [(3, 16), (2, 1, 8), (0, 6), (2, 3, 2)])
def test_gated_forward_hands_the_kernel_both_halves_as_views_of_x(shape):
    """The gated ops' in-tree forward, through a plain-PyTorch elementwise slot on the CPU:
    the kernel gets the gate and the up halves as views of x (x read once, nothing copied),
    at every rank and with no rows, and the result is the activation of one times the
    other."""
    from tileops.kernels.elementwise import ElementwiseInterface
    from tileops.runtime import Kernel

    seen = []

    class TorchGated(Kernel, ElementwiseInterface):
        devices = ("cpu",)
        general = True

        def __call__(self, gate, up, y):
            seen.append((gate, up))
            act = {"silu_and_mul": F.silu, "gelu_and_mul": F.gelu,
                   "gelu_tanh_and_mul": lambda t: F.gelu(t, approximate="tanh")}[self.spec.fn]
            y.copy_(act(gate) * up)

    x = torch.randn(shape, dtype=torch.float64)
    n = shape[-1] // 2
    for cls, act in ((SiluAndMulFwdOp, F.silu), (GeluAndMulFwdOp, F.gelu),
                     (GeluTanhAndMulFwdOp, lambda t: F.gelu(t, approximate="tanh"))):
        seen.clear()
        y = cls(kernel_map={"elementwise": TorchGated})(x)
        torch.testing.assert_close(y, act(x[..., :n]) * x[..., n:])
        if x.numel():
            gate, up = seen[-1]
            assert gate.shape == up.shape == y.shape
            assert gate.data_ptr() == x.data_ptr()
            assert up.data_ptr() == x.data_ptr() + n * x.element_size()


def test_each_call_gets_outputs_of_its_own_shape_dtype_and_layout():
    """One op called with shapes, dtypes and layouts changing from call to call: each output
    is allocated for its own call (the allocation reuses the last call's derivation only for
    an equal call record), contiguous like a contiguous first input of its shape and dtype."""
    op = AddFwdOp()
    calls = [(torch.randn(3, 4), torch.randn(3, 4)),
             (torch.randn(3, 1), torch.randn(3, 4)),  # broadcast: not x's shape
             (torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(3, 4)),  # promoted
             (torch.randn(3, 4), torch.randn(3, 4)),
             (torch.randn(4, 3).T, torch.randn(3, 4)),  # a transposed x: torch's layout
             (torch.randn(2, 3, 4)[:, :, :2], torch.randn(2, 3, 2)),
             (torch.randn(3, 4), torch.randn(3, 4))]
    for a, b in calls * 2:
        got, want = op(a, b), torch.add(a, b)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want)
        assert got.data_ptr() not in (a.data_ptr(), b.data_ptr())


def test_integer_inputs_of_float_math_give_float32():
    x = torch.arange(6, dtype=torch.int32)
    y = ExpFwdOp()(x)
    assert y.dtype is torch.float32
    torch.testing.assert_close(y, torch.exp(x))


#: the dtypes torch takes as its default (torch.set_default_dtype)
DEFAULTS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
#: calls where integers become floating: the op, its arguments made from an integer x
DEFAULT_CALLS = [
    *[(op, lambda x: (x,)) for op in (ExpFwdOp(), ops.SqrtFwdOp(), ops.SinFwdOp(),
                                      ops.SigmoidFwdOp(), ops.ReciprocalFwdOp(),
                                      ops.RsqrtFwdOp(), ops.ErfFwdOp())],
    (DivFwdOp(), lambda x: (x, x + 7)),
    (DivFwdOp(), lambda x: (x, 3)),
    (DivFwdOp(), lambda x: (7, x + 7)),
    (AddFwdOp(), lambda x: (x, 1.5)),
    (MulFwdOp(), lambda x: (0.25, x)),
    (PowFwdOp(), lambda x: (x, 0.5)),
    (WhereFwdOp(), lambda x: (x > 2, 1.5, x)),
    (WhereFwdOp(), lambda x: (x > 2, 1.5, -2.0)),
]


@settings(max_examples=60, deadline=None)
@given(defaults=st.lists(st.sampled_from(DEFAULTS), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64]),
       shape=st.one_of(st.just(()), st.lists(st.integers(1, 3), min_size=1, max_size=2)),
       which=st.integers(0, len(DEFAULT_CALLS) - 1))
def test_integers_made_floating_take_torchs_default_dtype_at_each_call(defaults, dtype, shape,
                                                                       which):
    """Under ``torch.set_default_dtype`` an integer input of float math, an integer true
    division and an integer beside a Python float give torch's default dtype, read at each
    call: the same op instance called under one default and then another answers each (no
    call cached under one serves the next)."""
    op, args = DEFAULT_CALLS[which]
    x = _tensor(tuple(shape), dtype, 4).abs() if dtype is not torch.bool else \
        _tensor(tuple(shape), dtype, 4)
    try:
        for default in defaults:
            torch.set_default_dtype(default)
            want = op.torch_fn(*args(x))
            got = op(*args(x))
            assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype)
            torch.testing.assert_close(got, want, equal_nan=True)
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_compiled_call_follows_the_default_dtype():
    torch._dynamo.reset()
    sqrt, div = ops.SqrtFwdOp(), DivFwdOp()
    f = torch.compile(lambda x: (sqrt(x), div(x, 2), div(x, x + 1)), fullgraph=True)
    x = torch.arange(5)
    try:
        for default in (torch.float32, torch.float64, torch.float32):
            torch.set_default_dtype(default)
            got = f(x)
            assert [t.dtype for t in got] == [default] * 3
            torch.testing.assert_close(got[0], torch.sqrt(x))
    finally:
        torch.set_default_dtype(torch.float32)


def test_div_rounding_modes_follow_torch_dtypes():
    a = torch.tensor([7, -7, 9], dtype=torch.int32)
    b = torch.tensor([2, 2, -4], dtype=torch.int32)
    assert DivFwdOp()(a, b).dtype is torch.float32
    for mode in ("trunc", "floor"):
        out = DivFwdOp(rounding_mode=mode)(a, b)
        assert out.dtype is torch.int32
        torch.testing.assert_close(out, torch.div(a, b, rounding_mode=mode), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32,
                                   torch.int64])
def test_integer_activations_are_torchs(dtype):
    """relu, hardtanh (its float bounds truncated toward zero) and neg of integers, as torch
    computes them, in place too; hardtanh's default bounds are negative, which torch refuses
    for uint8, and so does the op."""
    lo = 0 if dtype is torch.uint8 else -100
    x = torch.randint(lo, 100, (7, 9), dtype=dtype, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ReluFwdOp()(x), F.relu(x))
    y = x.clone()
    assert ReluFwdOp(inplace=True)(y) is y and torch.equal(y, F.relu(x))
    assert torch.equal(NegFwdOp()(x), torch.neg(x))
    if dtype is torch.uint8:
        with pytest.raises(SignatureCallError, match=r"^HardtanhFwdOp: argument x does not "
                                                     r"match the signature"):
            HardtanhFwdOp()(x)
        return
    for bounds in ((-1.0, 1.0), (-2.5, 3.5), (-7.9, -0.5)):
        got = HardtanhFwdOp(min_val=bounds[0], max_val=bounds[1])(x)
        assert got.dtype is dtype and torch.equal(got, F.hardtanh(x, *bounds)), bounds


def test_clamp_promotes_an_integer_tensor_beside_a_float_bound_as_torch():
    """torch.clamp(int, -0.5) is a float tensor (torch's wrapped-number promotion), an int
    bound keeps the integer dtype; in place, a float bound of an integer x is refused by the
    entry's rule, as torch refuses it."""
    x = torch.arange(-3, 4, dtype=torch.int32)
    got = ClampFwdOp(min=-0.5, max=2)(x)
    want = torch.clamp(x, -0.5, 2)
    assert got.dtype is want.dtype is torch.float32 and torch.equal(got, want)
    got = ClampFwdOp(min=-1, max=2)(x)
    assert got.dtype is torch.int32 and torch.equal(got, torch.clamp(x, -1, 2))
    with pytest.raises(RuntimeError, match="can't be cast to the desired output type"):
        x.clone().clamp_(-0.5, 2)
    with pytest.raises(SignatureCallError) as exc:
        ClampFwdOp(min=-0.5, max=2, inplace=True)(x.clone())
    assert str(exc.value).splitlines()[:4] == [
        "ClampFwdOp: argument x does not match the signature",
        "  expected: not inplace or result_type(T, 1, R, 0) == T",
        "  seen:     x: i32[7]",
        "  because:  refinement 'not inplace or result_type(T, 1, R, 0) == T' does not hold "
        "(inplace = True, T = torch.int32, R = torch.float32)"]


# --- broadcasting and promotion against torch ---------------------------------------------


@st.composite
def _broadcast_pair(draw):
    """Two shapes that broadcast: a common shape, each side dropping leading axes and setting
    some axes to 1."""
    rank = draw(st.integers(0, 4))
    base = draw(st.lists(st.integers(1, 5), min_size=rank, max_size=rank))
    out = []
    for _ in range(2):
        keep = draw(st.integers(0, rank))
        shape = [1 if draw(st.booleans()) else d for d in base[rank - keep:]]
        out.append(tuple(shape))
    return out


BINARY = [(AddFwdOp(), torch.add), (SubFwdOp(), torch.sub), (MulFwdOp(), torch.mul),
          (DivFwdOp(), torch.div), (PowFwdOp(), torch.pow), (MaximumFwdOp(), torch.maximum),
          (MinimumFwdOp(), torch.minimum), (EqFwdOp(), torch.eq), (NeFwdOp(), torch.ne),
          (LtFwdOp(), torch.lt), (LeFwdOp(), torch.le), (GtFwdOp(), torch.gt),
          (GeFwdOp(), torch.ge)]
#: the functions whose result is exact in any dtype (selection and comparison)
EXACT = (torch.maximum, torch.minimum, torch.eq, torch.ne, torch.lt, torch.le, torch.gt,
         torch.ge)
#: what torch raises for operands its function refuses (sub of bools, an integer to a negative
#: integer power), and what the ops raise for them (a signature's refusal by name included)
REFUSED = (RuntimeError, TypeError, SignatureCallError)


def _check_like_torch(got, want, wide):
    """``got`` has ``want``'s shape and dtype and its values: exact where the result is, else
    within the dtype's tolerance of ``wide`` (the float64 result) rounded to it."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.dtype, want.dtype)
    if not want.is_floating_point() or wide is None:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    else:  # the dtype's own tolerance
        torch.testing.assert_close(got, wide.to(want.dtype), equal_nan=True)


@settings(max_examples=80, deadline=None)
@given(shapes=_broadcast_pair(), da=st.sampled_from(DTYPES), db=st.sampled_from(DTYPES),
       which=st.integers(0, len(BINARY) - 1))
def test_binary_broadcasting_and_promotion_match_torch(shapes, da, db, which):
    op, fn = BINARY[which]
    a, b = _tensor(shapes[0], da, 1), _tensor(shapes[1], db, 2)
    try:
        want = fn(a, b)
    except REFUSED:
        with pytest.raises(REFUSED):
            op(a, b)
        return
    wide = None if fn in EXACT else fn(a.double(), b.double())
    _check_like_torch(op(a, b), want, wide)


#: the ops whose torch function takes a Python number, as the Python operator spelling it
NUMBER_OPS = [(AddFwdOp(), operator.add), (SubFwdOp(), operator.sub),
              (MulFwdOp(), operator.mul), (DivFwdOp(), operator.truediv),
              (PowFwdOp(), operator.pow), (EqFwdOp(), operator.eq), (NeFwdOp(), operator.ne),
              (LtFwdOp(), operator.lt), (GeFwdOp(), operator.ge)]


@settings(max_examples=80, deadline=None)
@given(shape=st.lists(st.integers(1, 4), max_size=3), dtype=st.sampled_from(DTYPES),
       number=st.one_of(st.booleans(), st.integers(-5, 5),
                        st.floats(-4.0, 4.0, allow_nan=False).map(lambda v: round(v, 3))),
       left=st.booleans(), which=st.integers(0, len(NUMBER_OPS) - 1))
def test_python_number_operands_promote_as_torch(shape, dtype, number, left, which):
    """A Python number on either side (``AddFwdOp()(x, 0.5)``, ``PowFwdOp()(2, x)``): the
    result has the dtype, shape and values of torch's (a number takes part in promotion by
    its category only: float16 + 0.5 is float16, int32 + 0.5 float32, a float64 tensor's
    number keeps float64 precision); what torch refuses, the op refuses."""
    op, fn = NUMBER_OPS[which]
    # torch's pow of a bool tensor answers the exponents 0 and 1 before its dtype check (and
    # refuses the rest); the op refuses a bool power, as torch's tensor-tensor pow does
    assume(not (fn is operator.pow and dtype is torch.bool))
    t = _tensor(tuple(shape), dtype, 3)
    args = (number, t) if left else (t, number)
    try:
        want = fn(*args)
    except REFUSED:
        with pytest.raises(REFUSED):
            op(*args)
        return
    got = op(*args)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.dtype, want.dtype)
    if not want.is_floating_point():
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        return
    # torch's CPU kernels round a number to a float16 or bfloat16 tensor's dtype first, its
    # CUDA kernels hold it in float32 as the op does beside a tensor with dims: within the
    # dtype's tolerance of torch's result here, or of the exact result rounded to the dtype
    try:
        torch.testing.assert_close(got, want, equal_nan=True)
    except AssertionError:
        wide = fn(*[a.double() if isinstance(a, torch.Tensor) else a for a in args])
        torch.testing.assert_close(got, wide.to(want.dtype), equal_nan=True)


def test_number_operands_are_refused_where_torch_refuses_them():
    x = torch.randn(3)
    for call, message in (
            (lambda: AddFwdOp()(1, 2.0), "AddFwdOp: arguments a and b are all numbers; "
                                         "expected at least one tensor operand, as torch's "
                                         "function does"),
            (lambda: WhereFwdOp()(True, x, x), "WhereFwdOp: argument cond is the number True; "
                                               "expected a tensor (only a and b may be "
                                               "numbers)"),
            (lambda: MulFwdOp()(x, 1j), "MulFwdOp: argument b is the number 1j of type "
                                        "complex; expected a tensor, or a real number (bool, "
                                        "int or float)")):
        with pytest.raises(TypeError) as exc:
            call()
        assert str(exc.value) == message
    with pytest.raises(SignatureCallError, match=r"^MaximumFwdOp: argument b does not match"):
        MaximumFwdOp()(x, 1.0)  # torch.maximum takes tensors only
    torch.testing.assert_close(WhereFwdOp()(x > 0, x, 0.0), torch.where(x > 0, x, 0.0))


def test_an_int_past_int64_is_a_float_beside_floats_and_refused_beside_ints():
    x = torch.randn(3, dtype=torch.float64)
    for number in (2**63, -(2**70)):  # torch takes the first (and refuses the second)
        torch.testing.assert_close(AddFwdOp()(x, number), x + float(number))
        torch.testing.assert_close(MulFwdOp()(number, x), float(number) * x)
    torch.testing.assert_close(AddFwdOp()(x, 2**63), x + 2**63)
    for call, message in (
            (lambda: AddFwdOp()(torch.arange(3), 2**63),
             "AddFwdOp: argument b is an int of 64 bits; beside a int64 tensor it is held in "
             "int64, which it does not fit (torch refuses it too); pass a float or a tensor"),
            (lambda: AddFwdOp()(x, 10**400),
             "AddFwdOp: argument b is an int of 1329 bits, past the largest float (about "
             "1.8e308)")):
        with pytest.raises(RuntimeError) as exc:
            call()
        assert str(exc.value) == message


FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(1, 4), max_size=3), dtype=st.sampled_from(FLOATS),
       weight=st.one_of(st.booleans(), st.integers(-3, 3),
                        st.floats(-2.0, 2.0, allow_nan=False).map(lambda v: round(v, 3)),
                        st.sampled_from(FLOATS)))
def test_lerp_takes_a_number_or_any_0_dim_float_weight_as_torch(shape, dtype, weight):
    """``LerpFwdOp()(a, b, 0.3)``, an int or bool weight (torch weighs by its float), or a
    0-dim weight tensor of any floating dtype: torch's dtype and shape, and values within the
    dtype's tolerance of the float64 result (the number held in float32 beside a 16-bit
    ``start`` with dims, where torch's CPU kernel rounds it to the dtype first)."""
    a, b = _tensor(tuple(shape), dtype, 1), _tensor(tuple(shape), dtype, 2)
    w = torch.tensor(0.37, dtype=weight) if isinstance(weight, torch.dtype) else weight
    want = torch.lerp(a, b, w)
    got = LerpFwdOp()(a, b, w)
    wide_w = w.double() if isinstance(w, torch.Tensor) else float(w)
    _check_like_torch(got, want, torch.lerp(a.double(), b.double(), wide_w))


def test_lerp_refuses_what_torch_refuses_by_name():
    a = torch.randn(4, 3)
    for call, message in (
            (lambda: LerpFwdOp()(0.5, a, 0.3), "LerpFwdOp: argument start is the number 0.5; "
                                               "expected a tensor (only weight may be numbers)"),
            (lambda: LerpFwdOp()(a, a, 1j), "LerpFwdOp: argument weight is the number 1j of "
                                            "type complex; expected a tensor, or a real number "
                                            "(bool, int or float)")):
        with pytest.raises(TypeError) as exc:
            call()
        assert str(exc.value) == message
    with pytest.raises(RuntimeError):  # torch: a weight with dims has start's dtype
        torch.lerp(a, a, torch.full((3,), 0.3, dtype=torch.float64))
    with pytest.raises(SignatureCallError) as exc:
        LerpFwdOp()(a, a, torch.full((3,), 0.3, dtype=torch.float64))
    text = str(exc.value)
    assert text.startswith("LerpFwdOp: ")
    assert ("because:  refinement 'W == T or len(SW) == 0' does not hold (W = torch.float64, "
            "T = torch.float32, SW = [3])") in text


def test_shapes_that_do_not_broadcast_are_refused_by_name():
    with pytest.raises(SignatureCallError) as exc:
        AddFwdOp()(torch.randn(2, 3), torch.randn(4, 3))
    text = str(exc.value)
    assert "AddFwdOp" in text and "(2, 3)" in text and "(4, 3)" in text


def test_where_promotes_a_and_b_and_broadcasts_three():
    cond = torch.rand(4, 1) > 0.5
    a = torch.randn(5, dtype=torch.bfloat16)
    b = torch.tensor(2.0, dtype=torch.float32)  # 0-dim: same category, does not promote
    out = WhereFwdOp()(cond, a, b)
    want = torch.where(cond, a, b)
    assert out.dtype == want.dtype == torch.bfloat16 and out.shape == want.shape
    torch.testing.assert_close(out, want, rtol=0, atol=0)


# --- in place and gradients ---------------------------------------------------------------


def test_inplace_relu_differentiates_from_its_output():
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    h = x * 1.0  # a non-leaf: torch lets it be written in place
    y = ReluFwdOp(inplace=True)(h)
    assert y is h
    (y * torch.arange(15.0, dtype=torch.float64).view(5, 3)).sum().backward()
    want = (x.detach() > 0).double() * torch.arange(15.0, dtype=torch.float64).view(5, 3)
    torch.testing.assert_close(x.grad, want)


def test_inplace_op_whose_gradient_reads_its_input_differentiates_as_torchs():
    # the gradient reads x, which the write destroys: the node saves a copy taken before it
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    h = x * 1.0
    out = SiluFwdOp(inplace=True)(h)
    assert out is h
    torch.testing.assert_close(h.detach(), F.silu(x.detach()))
    g = torch.randn(5, 3, dtype=torch.float64)
    got, = torch.autograd.grad(h, x, g)
    xt = x.detach().clone().requires_grad_()
    ht = xt * 1.0
    F.silu(ht, inplace=True)
    want, = torch.autograd.grad(ht, xt, g)
    torch.testing.assert_close(got, want)


# --- the outputs' layout --------------------------------------------------------------------


def _strides_of_extents(t):
    """``t``'s strides over its dims of extent above 1 (an extent-1 dim's stride addresses
    nothing, and torch's own vary there)."""
    return [s for s, n in zip(t.stride(), t.shape, strict=True) if n != 1]


@st.composite
def _views(draw):
    """One to three operands of a common shape: each a permutation of a tensor, a slice of
    one with a step, or broadcast over some dims (size 1 or fewer dims)."""
    nd = draw(st.integers(2, 4))
    shape = draw(st.lists(st.integers(1, 5), min_size=nd, max_size=nd))
    views = []
    for _ in range(draw(st.integers(1, 3))):
        own = list(shape)
        if views and draw(st.booleans()):
            own = [n if draw(st.booleans()) else 1 for n in shape][draw(st.integers(0, nd - 1)):]
        perm = draw(st.permutations(range(len(own))))
        step = draw(st.sampled_from([1, 1, 2]))
        base = torch.randn([own[p] * step for p in perm])[tuple(slice(None, None, step)
                                                               for _ in perm)]
        views.append(base.permute([perm.index(i) for i in range(len(own))]))
    return views


@settings(max_examples=150, deadline=None)
@given(views=_views())
def test_outputs_take_torchs_layout(views):
    """An output is laid out as torch's TensorIterator lays it out (a transposed input gives
    a transposed output, the first operand that orders two dims deciding), so a permuted
    input is one flat run for the kernels; its values are torch's."""
    if len(views) == 1:
        op, want = SiluFwdOp(), F.silu(views[0])
    elif len(views) == 2:
        op, want = AddFwdOp(), torch.add(*views)
    else:
        op, want = WhereFwdOp(), torch.where(views[0] > 0, views[1], views[2])
        views = [views[0] > 0, views[1], views[2]]
    for _ in range(2):  # the general call, then the fused one
        got = op(*views)
        assert _strides_of_extents(got) == _strides_of_extents(want), (
            [(tuple(v.shape), v.stride()) for v in views], got.stride(), want.stride())
        torch.testing.assert_close(got, want)


@settings(max_examples=300, deadline=None)
@given(views=_views(), first_broadcast=st.booleans())
def test_torch_layout_is_torchs_own_rule_wherever_an_input_is_strided(views, first_broadcast):
    """:func:`torch_layout` (which the ops consult only where an input is not contiguous) gives
    the strides of torch's own rule, ``torch._prims_common.compute_elementwise_output_strides``
    over the operands broadcast to the output's shape (private, and some three times slower
    a call), on every drawn set of views, the first one broadcast too."""
    from torch._prims_common import compute_elementwise_output_strides

    from tileops.ops._elementwise_base import torch_layout

    if first_broadcast and len(views) > 1:
        views = [views[0][tuple(slice(0, 1) for _ in views[0].shape)], *views[1:]]
    shape = tuple(torch.broadcast_shapes(*(v.shape for v in views)))
    if all(v.is_contiguous() for v in views):
        assert torch_layout(tuple(views), shape) is None
        return
    got = torch_layout(tuple(views), shape) or torch.empty(shape).stride()
    want = compute_elementwise_output_strides(*(v.expand(shape) for v in views))
    keep = [n != 1 for n in shape]
    assert [s for s, k in zip(got, keep, strict=True) if k] == \
        [s for s, k in zip(want, keep, strict=True) if k], ([(tuple(v.shape), v.stride())
                                                             for v in views], got, want)


def test_a_new_leading_dim_of_extent_one_orders_the_dims_as_torchs_expand_does():
    """A new leading dim takes the extent times the stride of the dim after it, as torch's
    expand gives it (not 0): here it decides the order torch's rule picks, where a stride of
    0 would have let the last operand transpose the output. The expansion itself against
    torch's over drawn shapes and strides."""
    from torch._prims_common import compute_elementwise_output_strides

    from tileops.ops._elementwise_base import _expanded_strides, torch_layout

    views = (torch.randn(1).as_strided((1, 1, 1), (4, 2, 1)),
             torch.randn(2).as_strided((2, 1), (1, 1)),
             torch.randn(64).as_strided((1, 1, 2), (2, 16, 4)))
    shape = (1, 2, 2)
    want = compute_elementwise_output_strides(*(v.expand(shape) for v in views))
    assert (torch_layout(views, shape) or torch.empty(shape).stride()) == want == (4, 2, 1)
    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        nd = int(torch.randint(1, 5, (1,), generator=g))
        out = tuple(int(d) for d in torch.randint(1, 4, (nd,), generator=g))
        keep = int(torch.randint(0, nd + 1, (1,), generator=g))
        own = tuple(1 if float(torch.rand(1, generator=g)) < 0.4 else d
                    for d in out[nd - keep:])
        strides = tuple(int(s) for s in torch.randint(0, 9, (len(own),), generator=g))
        t = torch.randn(256).as_strided(own, strides)
        assert _expanded_strides(t, out) == t.expand(out).stride(), (own, strides, out)


def test_a_transposed_input_gives_a_transposed_output_also_under_compile():
    """The compile boundary's fake output has the eager call's strides."""
    x = torch.randn(6, 4, 5).transpose(1, 2)
    op = GeluFwdOp()

    def fn(t):
        y = op(t)
        return y, torch.tensor(y.stride())  # read while tracing: the fake's strides

    y, fake_strides = torch.compile(fn, fullgraph=True, backend="eager")(x)
    assert y.stride() == x.stride() == tuple(fake_strides.tolist())
    torch.testing.assert_close(y, F.gelu(x))
    a, b = torch.randn(5, 7).t(), torch.randn(5, 7).t()
    assert AddFwdOp()(a, b).stride() == torch.add(a, b).stride() == (1, 7)


@pytest.mark.parametrize("which", ["dy", "x"])
def test_a_gradients_output_takes_torchs_layout_eagerly_and_under_compile(which):
    """An output like one of several inputs follows every input's layout, as torch's: the
    eager call (general and fused) and the compile boundary's fake agree with
    ``aten.silu_backward`` whichever input is transposed."""
    dy, x = torch.randn(7, 5), torch.randn(7, 5)
    if which == "dy":
        dy = torch.randn(5, 7).t()
    else:
        x = torch.randn(5, 7).t()
    op = SiluBwdOp()
    want = torch.ops.aten.silu_backward(dy, x)
    for _ in range(2):
        got = op(dy, x)
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want)

    def fn(a, b):
        y = op(a, b)
        return y, torch.tensor(y.stride())

    y, fake = torch.compile(fn, fullgraph=True, backend="eager")(dy, x)
    assert tuple(fake.tolist()) == y.stride() == want.stride()


def test_number_operands_compile_and_train():
    """Under torch.compile (one frame, fullgraph) a number operand becomes a constant of the
    graph, and the tensor operand's gradient is torch's."""
    torch._dynamo.reset()
    add, mul, where = AddFwdOp(), MulFwdOp(), WhereFwdOp()

    def f(x):
        return where(x > 0, mul(add(x, 1.5), 2), 0.0)

    g = torch.compile(f, fullgraph=True, dynamic=False)
    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    y = g(x)
    torch.testing.assert_close(y, torch.where(x > 0, (x + 1.5) * 2, 0.0))
    y.sum().backward()
    torch.testing.assert_close(x.grad, (x.detach() > 0).double() * 2)
    # lerp's number weight, beside a 16-bit start: held in float32 inside the graph too
    lerp = LerpFwdOp()
    s = torch.randn(4, 3, dtype=torch.bfloat16, requires_grad=True)
    e = torch.randn(3, dtype=torch.bfloat16)
    y = torch.compile(lambda s, e: lerp(s, e, 0.3), fullgraph=True, dynamic=False)(s, e)
    torch.testing.assert_close(y, torch.lerp(s.float(), e.float(), 0.3).bfloat16())
    y.float().sum().backward()
    torch.testing.assert_close(s.grad, torch.full((4, 3), 0.7, dtype=torch.bfloat16))


def test_a_gated_op_recompiled_for_dynamic_sizes():
    """torch.compile recompiles a function whose sizes change with symbolic sizes: the gated
    ops' [*B, 2 * N] input is solved for N by // and % (a symbolic size takes no divmod), and
    the gradient follows, at every size."""
    torch._dynamo.reset()
    op = SiluAndMulFwdOp()
    g = torch.compile(op, fullgraph=True)
    for n in (8, 12, 20):  # the second size recompiles with a dynamic one
        x = torch.randn(3, 2 * n, dtype=torch.float64, requires_grad=True)
        y = g(x)
        want = F.silu(x[:, :n]) * x[:, n:]
        torch.testing.assert_close(y, want)
        (gx,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(gx, torch.autograd.grad(want.sum(), x)[0])


_I8 = torch.tensor([1, 2], dtype=torch.int8)
_F16 = torch.tensor([1.0, 2.0], dtype=torch.float16)
_C = torch.tensor([True, False])


@pytest.mark.parametrize(("call", "torch_call", "message"), [
    (lambda: WhereFwdOp()(_C, _I8, 300), lambda: torch.where(_C, _I8, 300),
     "WhereFwdOp: argument b is 300, outside the values int8 holds ([-128, 127])"),
    (lambda: PowFwdOp()(_F16, 1e5), lambda: torch.pow(_F16, 1e5),
     "PowFwdOp: argument b is 100000.0, outside the values float16 holds ([-65504, 65504])"),
    (lambda: PowFwdOp()(_I8.to(torch.uint8), 300), lambda: torch.pow(_I8.to(torch.uint8), 300),
     "PowFwdOp: argument b is 300, outside the values uint8 holds ([0, 255])"),
    (lambda: MaskedFillFwdOp(value=1e5)(_F16, _C), lambda: _F16.masked_fill(_C, 1e5),
     "MaskedFillFwdOp: param value is 100000.0, outside the values float16 holds"),
    (lambda: ClampFwdOp(max=300)(_I8), lambda: _I8.clamp(max=300),
     "ClampFwdOp: param max is 300, outside the values int8 holds ([-128, 127])"),
    (lambda: HardtanhFwdOp(min_val=-1e5, max_val=1e5)(_F16),
     lambda: F.hardtanh(_F16, -1e5, 1e5),
     "HardtanhFwdOp: param min_val is -100000.0, outside the values float16 holds"),
])
def test_a_number_its_tensor_cannot_hold_is_refused_as_torch_refuses_it(call, torch_call,
                                                                       message):
    with pytest.raises(RuntimeError, match="without overflow"):
        torch_call()
    with pytest.raises(RuntimeError) as exc:
        call()
    assert str(exc.value).startswith(message)


def test_numbers_torch_converts_are_taken():
    # torch wraps add's integer (its own arithmetic), promotes a float beside integers, and
    # turns a float16 where's large float into inf: so does the op
    torch.testing.assert_close(AddFwdOp()(_I8, 300), _I8 + 300)
    torch.testing.assert_close(WhereFwdOp()(_C, _I8, 2.5), torch.where(_C, _I8, 2.5))
    torch.testing.assert_close(WhereFwdOp()(_C, _F16, 1e5), torch.where(_C, _F16, 1e5))
    torch.testing.assert_close(PowFwdOp()(_I8, 300.0), torch.pow(_I8, 300.0))
    torch.testing.assert_close(MaskedFillFwdOp(value=float("nan"))(_F16, _C),
                               _F16.masked_fill(_C, float("nan")), equal_nan=True)


def test_clamp_in_place_refuses_a_bound_sharing_part_of_x_as_torch_does():
    y = 4 - torch.arange(8.0)
    with pytest.raises(RuntimeError, match="some elements of the input tensor and the "
                                           "written-to tensor refer to a single memory"):
        t = y.clone()
        torch.clamp_(t[1:], t[:-1])
    for bound in ("min_bound", "max_bound"):
        with pytest.raises(RuntimeError) as exc:
            ClampFwdOp(inplace=True)(y[1:], **{bound: y[:-1]})
        assert str(exc.value).endswith(
            f"x is written in place and shares memory with {bound} (overlapping views of one "
            f"storage), so the result would depend on the order of the writes, as torch "
            f"refuses it too; pass a copy of {bound} (.clone())")
    assert torch.equal(y, 4 - torch.arange(8.0))  # nothing written
    # the same view, or disjoint views of one storage, are fine (torch takes them too)
    assert torch.equal(ClampFwdOp(inplace=True)(y, max_bound=y), 4 - torch.arange(8.0))
    got = ClampFwdOp(inplace=True)(y[:4], y[4:])
    assert got is not None and torch.equal(y[:4], torch.tensor([4.0, 3.0, 2.0, 1.0]))


def test_integer_arithmetic_torch_refuses_is_refused_naming_the_op():
    a = torch.tensor([1, 2])
    for op, message in ((AddFwdOp(alpha=1.5), "AddFwdOp: param alpha is 1.5 and the operands "
                                              "are int64; an integer result cannot scale by a "
                                              "fraction"),
                        (SubFwdOp(alpha=0.5), "SubFwdOp: param alpha is 0.5")):
        with pytest.raises(RuntimeError, match="alpha must not be a floating point"):
            torch.add(a, a, alpha=1.5)
        with pytest.raises(RuntimeError) as exc:
            op(a, a)
        assert str(exc.value).startswith(message)
        torch.testing.assert_close(op(a.double(), a), op.torch_fn(a.double(), a))  # floats
    for op in (DivFwdOp(rounding_mode="floor"), DivFwdOp(rounding_mode="trunc"),
               RemainderFwdOp()):
        with pytest.raises(ZeroDivisionError) as exc:
            op(a, torch.tensor([0, 1]))
        assert str(exc.value) == (f"{type(op).__name__}: integer division by zero (b holds a "
                                  f"0 and the quotient is an integer), which has no value")
        b = torch.tensor([3, 1])
        torch.testing.assert_close(op(a, b), op.torch_fn(a, b))


def test_an_integer_past_every_float_is_refused_by_name():
    with pytest.raises(OverflowError):
        torch.pow(_F16, 10**400)
    with pytest.raises(RuntimeError, match=r"^PowFwdOp: argument b is 1000+, outside the values "
                                           r"float16 holds"):
        PowFwdOp()(_F16, 10**400)


# --- operands converted to the common dtype first: comparisons and remainder ------------------


@pytest.mark.parametrize(("op", "a", "b"), [
    (ops.EqFwdOp, torch.tensor([2048.0]).half(), 2049),  # 2049 has no float16: it is 2048
    (ops.EqFwdOp, torch.tensor([2048.0]).half(), torch.tensor(2049)),
    (ops.EqFwdOp, torch.tensor([0.1]).half(), torch.tensor(0.1)),  # float16's 0.1
    (ops.LtFwdOp, torch.tensor([0.1]).half(), torch.tensor(0.1)),
    (ops.GeFwdOp, torch.tensor([256.0]).bfloat16(), 257),
    (ops.NeFwdOp, torch.tensor([256.0]).bfloat16(), torch.tensor(257.0, dtype=torch.float64)),
    (ops.RemainderFwdOp, torch.tensor([5.3]).half(), 0.1),
    (ops.RemainderFwdOp, torch.tensor([5.3]).half(), torch.tensor(0.1)),
])
def test_comparisons_and_remainder_convert_the_operands_to_the_common_dtype(op, a, b):
    want = op.binary(a, b)
    got = op()(a, b)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_comparison_kernel_converts_in_the_common_dtype():
    # the in-tree call compares in float16 itself (the operands converted to it), not in
    # float32 as the arithmetic kernels compute
    op = ops.EqFwdOp()
    a, b = torch.tensor([2048.0]).half(), torch.tensor(2049)
    assert op.compute_dtype([a, b], [torch.empty(1, dtype=torch.bool)]) == torch.float16
    add = ops.AddFwdOp()
    assert add.compute_dtype([a, b], [torch.empty(1, dtype=torch.float16)]) == torch.float32


def test_hardtanh_refuses_min_val_above_max_val_at_construction():
    with pytest.raises(Exception, match=r"HardtanhFwdOp: construction param min_val, max_val "
                                        r"does not match the signature"):
        ops.HardtanhFwdOp(min_val=2.0, max_val=-1.0)
    x = torch.tensor([-3.0, 0.5, 3.0])
    # a NaN bound passes, as torch's F.hardtanh lets it
    torch.testing.assert_close(ops.HardtanhFwdOp(min_val=float("nan"), max_val=1.0)(x),
                               F.hardtanh(x, float("nan"), 1.0), equal_nan=True)


@pytest.mark.parametrize(("make", "args", "message"), [
    (lambda: ops.AddFwdOp(alpha=1000), lambda: (torch.ones(2, dtype=torch.int8),) * 2,
     r"AddFwdOp: param alpha is 1000, outside the values int8 holds"),
    (lambda: ops.SubFwdOp(alpha=300), lambda: (torch.ones(2, dtype=torch.uint8),) * 2,
     r"SubFwdOp: param alpha is 300, outside the values uint8 holds"),
    (lambda: ops.MaskedFillFwdOp(value=float("nan")),
     lambda: (torch.ones(2, dtype=torch.int32), torch.ones(2, dtype=torch.bool)),
     r"MaskedFillFwdOp: param value is nan, which int32 cannot hold"),
    (lambda: ops.MaskedFillFwdOp(value=float("inf")),
     lambda: (torch.ones(2, dtype=torch.int64), torch.ones(2, dtype=torch.bool)),
     r"MaskedFillFwdOp: param value is inf, which int64 cannot hold"),
    (lambda: ops.HardtanhFwdOp(min_val=float("-inf")),
     lambda: (torch.ones(2, dtype=torch.int32),),
     r"HardtanhFwdOp: param min_val is -inf, which int32 cannot hold"),
])
def test_a_number_converted_to_an_integer_dtype_that_cannot_hold_it_is_refused(make, args,
                                                                              message):
    op = make()
    with pytest.raises(RuntimeError, match=message):
        op(*args())
    # the op stays usable
    assert op(*[t.float() if t.dtype != torch.bool else t for t in args()]).shape == (2,)


def test_masked_fill_answers_contiguous_as_torch():
    x = torch.randn(3, 4).t()
    m = x > 0
    got = ops.MaskedFillFwdOp(value=0.0)(x, m)
    want = x.masked_fill(m, 0.0)
    assert got.is_contiguous() and got.stride() == want.stride()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(("make", "args", "message"), [
    (lambda: ops.DivFwdOp(rounding_mode="floor"), lambda b: (b, b),
     r"DivFwdOp: a and b are bool, and division with rounding_mode='floor' has no bool form"),
    (lambda: ops.DivFwdOp(rounding_mode="trunc"), lambda b: (b, True),
     r"DivFwdOp: a and b are bool, and division with rounding_mode='trunc' has no bool form"),
    (lambda: ops.PowFwdOp(), lambda b: (b, b), r"PowFwdOp: a and b are bool, and pow has no"),
])
def test_ops_torch_has_no_bool_form_for_refuse_bool_operands_by_name(make, args, message):
    b = torch.tensor([True, False])
    with pytest.raises(TypeError, match=message):
        make()(*args(b))
    # bool beside an integer promotes, and is served
    assert make()(b, torch.tensor([1, 2], dtype=torch.int8)).dtype == torch.int8


#: the ops whose torch function takes a bool operand beside a non-bool one and refuses two
#: bools (sub refuses a bool operand beside anything)
BOOL_BESIDE = {"remainder": (RemainderFwdOp, torch.remainder), "sub": (SubFwdOp, torch.sub)}


def _bool_operand(kind, shape, seed):
    if kind == "tensor":
        return _tensor(shape, torch.bool, seed)
    return kind == "True"


@pytest.mark.parametrize("other", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(BOOL_BESIDE))
def test_a_bool_operand_beside_every_dtype_is_served_or_refused_as_torch(name, other):
    """A bool tensor (0-dim or with dims) or True/False on either side of a tensor of every
    dtype: where torch answers, torch's dtype, shape and values; where torch refuses (two
    bools, an integer by zero, sub of a bool), the op refuses, and two bools by the spec's
    refinement, naming the op and the dtypes."""
    op, fn = BOOL_BESIDE[name]
    op = op()
    shapes = (((2, 3), (2, 3)), ((), (2, 3)), ((2, 3), ()), ((3,), (2, 1)), ((), ()))
    served = 0
    for kind in ("tensor", "True", "False"):
        for bool_shape, other_shape in shapes:
            if kind != "tensor" and bool_shape != ():
                continue
            for bool_left in (True, False):
                flag = _bool_operand(kind, bool_shape, 5)
                t = _tensor(other_shape, other, 6)
                args = (flag, t) if bool_left else (t, flag)
                try:
                    want = fn(*args)
                except REFUSED as exc:
                    with pytest.raises((*REFUSED, ZeroDivisionError)) as got_exc:
                        op(*args)
                    if other is torch.bool and "not implemented for 'Bool'" in str(exc):
                        assert isinstance(got_exc.value, SignatureCallError)
                        text = str(got_exc.value)
                        assert text.startswith(f"{type(op).__name__}: ") and (
                            "refinement 'result_type(TA, len(SA), TB, len(SB)) != bool' does "
                            "not hold (TA = torch.bool") in text, text
                    continue
                got = op(*args)
                served += 1
                assert got.shape == want.shape and got.dtype == want.dtype, \
                    (args, got.dtype, want.dtype)
                torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # remainder serves a bool beside every other dtype; sub serves none
    assert (served > 0) == (name == "remainder" and other is not torch.bool)


def test_remainder_of_a_bool_operand_examples():
    op = RemainderFwdOp()
    assert torch.equal(op(torch.tensor([5, 7]), True), torch.tensor([0, 0]))
    assert torch.equal(op(torch.tensor([3]), torch.tensor([True])), torch.tensor([0]))
    assert torch.equal(op(True, torch.tensor([3, 2])), torch.tensor([1, 1]))
    got = op(torch.tensor([True, False]), torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    assert got.dtype is torch.bfloat16 and torch.equal(got, torch.tensor([1.0, -0.0]).bfloat16())
    with pytest.raises(ZeroDivisionError, match=r"^RemainderFwdOp: integer division by zero"):
        op(torch.tensor([5, 7]), False)  # torch refuses it too
    with pytest.raises(SignatureCallError, match=r"^RemainderFwdOp: "):
        op(torch.tensor([True]), torch.tensor(True))


def test_a_negative_number_beside_an_unsigned_dtype_names_the_value_torch_wraps_it_to():
    u = torch.tensor([1, 200], dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"WhereFwdOp: argument b is -1 beside uint8, which "
                                           r"torch wraps to 255; pass 255"):
        ops.WhereFwdOp()(u > 100, u, -1)
    with pytest.raises(RuntimeError, match=r"ClampFwdOp: param min is -1 beside uint8, which "
                                           r"torch wraps to 255"):
        ops.ClampFwdOp(min=-1)(u)
    # past -255 torch refuses the conversion as well
    with pytest.raises(RuntimeError, match=r"argument b is -300, outside the values uint8 holds"):
        ops.WhereFwdOp()(u > 100, u, -300)
    torch.testing.assert_close(ops.WhereFwdOp()(u > 100, u, 255), torch.where(u > 100, u, -1))


# --- a Python number beside a 0-dim or n-dim tensor ------------------------------------------

_HALF = (torch.float16, torch.bfloat16)


def _lerp_end(t):
    return (t * 0 + 3).to(t.dtype) if t.is_floating_point() else t


#: (name, the op's call, torch's call, whether the op holds the number in its op math (float32
#: beside a 16-bit tensor) rather than converting it to the tensor's dtype first)
NUMBER_CALLS = [
    ("add", lambda t, n, left: AddFwdOp()(*((n, t) if left else (t, n))),
     lambda t, n, left: torch.add(*((n, t) if left else (t, n))), True),
    ("add alpha", lambda t, n, left: AddFwdOp(alpha=2.0)(*((n, t) if left else (t, n))),
     lambda t, n, left: torch.add(*((n, t) if left else (t, n)), alpha=2), True),
    ("sub", lambda t, n, left: SubFwdOp()(*((n, t) if left else (t, n))),
     lambda t, n, left: torch.sub(*((n, t) if left else (t, n))), True),
    ("mul", lambda t, n, left: MulFwdOp()(*((n, t) if left else (t, n))),
     lambda t, n, left: torch.mul(*((n, t) if left else (t, n))), True),
    ("div", lambda t, n, left: DivFwdOp()(*((n, t) if left else (t, n))),
     lambda t, n, left: torch.div(*((n, t) if left else (t, n))), True),
    # a rounding division holds a number divisor, and rounds a number numerator (left)
    ("div floor", lambda t, n, left: DivFwdOp(rounding_mode="floor")(*((n, t) if left else (t, n))),
     lambda t, n, left: torch.div(*((n, t) if left else (t, n)), rounding_mode="floor"),
     "divisor"),
    ("div trunc", lambda t, n, left: DivFwdOp(rounding_mode="trunc")(*((n, t) if left else (t, n))),
     lambda t, n, left: torch.div(*((n, t) if left else (t, n)), rounding_mode="trunc"),
     "divisor"),
    # pow rounds a number to the tensor's dtype (257 beside bfloat16 is 256), as torch does
    ("pow", lambda t, n, left: PowFwdOp()(*((n, t) if left else (t, n))),
     lambda t, n, left: torch.pow(*((n, t) if left else (t, n))), False),
    ("remainder", lambda t, n, left: RemainderFwdOp()(*((n, t) if left else (t, n))),
     lambda t, n, left: torch.remainder(*((n, t) if left else (t, n))), False),
    ("eq", lambda t, n, left: EqFwdOp()(*((n, t) if left else (t, n))),
     lambda t, n, left: torch.eq(t, n), False),
    ("lt", lambda t, n, left: LtFwdOp()(*((n, t) if left else (t, n))),
     lambda t, n, left: torch.gt(t, n) if left else torch.lt(t, n), False),
    ("ge", lambda t, n, left: GeFwdOp()(*((n, t) if left else (t, n))),
     lambda t, n, left: torch.le(t, n) if left else torch.ge(t, n), False),
    ("where", lambda t, n, left: WhereFwdOp()(*((t > 0, n, t) if left else (t > 0, t, n))),
     lambda t, n, left: torch.where(*((t > 0, n, t) if left else (t > 0, t, n))), False),
    ("lerp", lambda t, n, left: LerpFwdOp()(t, _lerp_end(t), n),
     lambda t, n, left: torch.lerp(t, _lerp_end(t), float(n)), True),
    ("clamp", lambda t, n, left: ClampFwdOp(**{"max" if left else "min": n})(t),
     lambda t, n, left: torch.clamp(t, **{"max" if left else "min": n}), False),
    ("masked_fill", lambda t, n, left: MaskedFillFwdOp(value=n)(t, t > 0),
     lambda t, n, left: t.masked_fill(t > 0, n), False),
]


@settings(max_examples=300, deadline=None)
@given(shape=st.one_of(st.just(()), st.lists(st.integers(1, 3), min_size=1, max_size=2)),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 5),
       number=st.one_of(st.booleans(), st.integers(-300, 300),
                        st.floats(-8.0, 8.0, allow_nan=False).map(lambda v: round(v, 4))),
       left=st.booleans(), which=st.integers(0, len(NUMBER_CALLS) - 1))
@example(shape=(), dtype=torch.float64, seed=0, number=0.5938, left=False, which=7)
@example(shape=(2,), dtype=torch.float64, seed=1, number=0.5938, left=True, which=7)
@example(shape=(2,), dtype=torch.bfloat16, seed=0, number=257, left=False, which=7)
@example(shape=(2,), dtype=torch.float16, seed=0, number=2049, left=True, which=5)
@example(shape=(2,), dtype=torch.float16, seed=0, number=2049, left=False, which=6)
def test_a_number_beside_a_0_dim_or_n_dim_tensor_is_held_as_torch_holds_it(
        shape, dtype, seed, number, left, which):
    """A Python number beside a tensor of any dtype, 0-dim or with dims: torch's dtype and
    shape, and torch's values computed in its op math: an arithmetic op holds the number in
    float32 beside a float16 or bfloat16 tensor (a 0-dim one too: ``bf16(3) * 1.0039`` is
    3.0156, not 3 * bf16(1.0039)) and rounds only the result, as torch's CUDA kernels do and
    its CPU kernels of mul, div and lerp; a comparison, remainder, a selection or a bound
    converts it to the tensor's dtype first, as torch does. Every other dtype: torch's values
    exactly. What torch refuses, the op refuses."""
    name, call, torch_call, holds = NUMBER_CALLS[which]
    # a rounding division's number numerator is the tensor's dtype's value, its quotient the
    # float32 one truncated or floored (torch's 16-bit kernels round the quotient first)
    numerator = holds == "divisor" and left
    holds = holds is True or holds == "divisor"
    t = _tensor(tuple(shape), dtype, seed)
    if name in ("lerp", "clamp", "masked_fill"):
        assume(not isinstance(number, bool))  # a float param; lerp's own test takes bools
    if name == "lerp":
        assume(t.is_floating_point())
    if name == "clamp":  # a float bound of an integer x is refused by name (its own test)
        assume(t.is_floating_point() or not isinstance(number, float))
        assume(dtype is not torch.bool)  # the entry takes no bool x
    if name == "pow":  # the op refuses a bool power (see the test of numbers above)
        assume(dtype is not torch.bool)
    try:
        want = torch_call(t, number, left)
    except (*REFUSED, ZeroDivisionError):
        with pytest.raises((*REFUSED, ZeroDivisionError)):
            call(t, number, left)
        return
    try:
        got = call(t, number, left)
    except RuntimeError as exc:  # a negative number beside uint8, refused by name (its test)
        if dtype is torch.uint8 and "which torch wraps to" in str(exc):
            return
        raise
    assert got.shape == want.shape and got.dtype == want.dtype, (got.dtype, want.dtype)
    if holds and dtype in _HALF:
        held = torch.tensor(number, dtype=dtype).item() if numerator else number
        want = torch_call(t.float(), held, left).to(want.dtype)
    if name == "pow" and not isinstance(number, bool) and want.is_floating_point():
        # torch's CPU pow takes a Python number in double precision, its 0-dim tensor of the
        # number (as the op holds it) in the result's: the two forms of torch's own are one
        # rounding apart (pow(4.0, 1.0312) is 4.17680550 and 4.17680597 in float32)
        held = torch.tensor(number, dtype=want.dtype)  # the number in the result's dtype
        want_held = torch.pow(*((held, t) if left else (t, held)))
        if want_held.dtype == want.dtype and not (holds and dtype in _HALF):
            want = want_held
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", _HALF)
def test_a_number_beside_a_0_dim_16_bit_tensor_is_not_rounded_first(dtype):
    """The calls torch's CPU kernels hold the number in float32 for too: the same values as
    torch's, a 0-dim result of the tensor's dtype, and torch's gradient."""
    x = torch.tensor(3.0, dtype=dtype, requires_grad=True)
    for op, fn in ((MulFwdOp(), torch.mul), (DivFwdOp(), torch.div)):
        for n in (1.0039, 1.001, 257, 2049):
            got, want = op(x, n), fn(x, n)
            assert got.shape == () and got.dtype == dtype
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            (g,), (w,) = torch.autograd.grad(got, x), torch.autograd.grad(want, x)
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    got = MulFwdOp()(torch.tensor(3.0, dtype=torch.bfloat16), 1.0039)
    assert got.item() == 3.015625  # 3 * bf16(1.0039) would be 3.0
    end = torch.tensor(2.0, dtype=dtype)
    for w in (0.3333, 0.1, 0.77):
        torch.testing.assert_close(LerpFwdOp()(x.detach(), end, w), torch.lerp(x.detach(), end, w),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("dtype", _HALF)
def test_pow_takes_a_number_or_0_dim_operand_in_the_16_bit_dtype_as_torch(dtype):
    """torch's pow converts a number or 0-dim exponent (and base) to the tensor's dtype before
    the math: 1e-8 is 0 in float16, so x ** 1e-8 is 1 even for a negative x; 70000 is inf."""
    x = torch.tensor([-2.0, 0.0, 1.5, 3.0], dtype=dtype)
    e = torch.tensor([0.001, 0.5, 2.0, -1.0], dtype=dtype)
    op = ops.PowFwdOp()
    for got, want in ((op(x, 1e-8), torch.pow(x, 1e-8)),
                      (op(x, torch.tensor(1e-8)), torch.pow(x, torch.tensor(1e-8))),
                      (op(x, 1.0039), torch.pow(x, 1.0039)),
                      (op(1e-8, e), torch.pow(1e-8, e)),
                      (op(70000.0, e), torch.pow(70000.0, e)),
                      (op(torch.tensor(1.0039), e), torch.pow(torch.tensor(1.0039), e))):
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    if dtype is torch.float16:  # bfloat16 holds 1e-8 (and -2 ** 1e-8 is nan there)
        assert op(x, 1e-8).tolist() == [1.0] * 4


@pytest.mark.parametrize("dtype", _HALF)
@pytest.mark.parametrize("mode", ["trunc", "floor"])
def test_a_rounding_division_rounds_a_number_numerator_but_not_a_divisor(dtype, mode):
    """torch's trunc and floor divisions take a number or 0-dim numerator in the tensor's
    dtype (70000 is inf in float16, 1e-8 is 0, so 0 / 0 is nan) and a number divisor in
    float32 (a reciprocal): the op matches both."""
    d = torch.tensor([1.5, -2.0, 0.0, 3.0], dtype=dtype)
    op = DivFwdOp(rounding_mode=mode)
    for a, b in ((70000.0, d), (1e-8, d), (torch.tensor(1e-8), d), (d, 1.0039),
                 (d, torch.tensor(1.0039)), (d * 1000, 1.0039)):
        got, want = op(a, b), torch.div(a, b, rounding_mode=mode)
        assert got.dtype == want.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    # a true division keeps the number numerator's precision, as torch's
    got, want = DivFwdOp()(1.0039, d[:2]), torch.div(1.0039, d[:2])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
