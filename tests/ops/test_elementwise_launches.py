"""The elementwise ops' in-tree path on the CPU: how each op hands its call to the
``elementwise`` slot (the operands, their views, the outputs, the scalar function and its
constants, the gradients' several launches and reductions), run through a stand-in
implementation of the slot that computes each scalar function with torch. The kernels'
own numerics are tested on the GPU (tests/kernels/test_elementwise_cuda.py); what this
checks is the ops' side of the slot, against each op's reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tileops.ops as ops
from tileops.kernels import elementwise as K
from tileops.runtime import Kernel

#: the scalar functions the cases below reach, as torch computes them
_FNS = {
    "mul": lambda p, a, b: a * b,
    "sub": lambda p, a, b: a - p[0] * b,
    "add": lambda p, a, b: a + p[0] * b,
    "div": lambda p, a, b: a / b,
    "div_bwd_b": lambda p, dy, a, b: -(dy * ((a / b) / b)),
    "pow_bwd_a": lambda p, dy, a, b: torch.where(b == 0, 0.0, dy * b * a.pow(b - 1)),
    "pow_bwd_b": lambda p, dy, a, b: torch.where((a == 0) & (b >= 0), 0.0,
                                                 dy * a.pow(b) * a.log()),
    "remainder_bwd_b": lambda p, dy, a, b: -dy * torch.div(a, b, rounding_mode="floor"),
    "eq": lambda p, a, b: a == b,
    "lt": lambda p, a, b: a < b,
    "gt": lambda p, a, b: a > b,
    "ge": lambda p, a, b: a >= b,
    "le": lambda p, a, b: a <= b,
    "where": lambda p, c, a, b: torch.where(c, a, b),
    "lerp": lambda p, s, e, w: torch.lerp(s, e, w),
    "masked_fill": lambda p, x, m: x.masked_fill(m, p[0]),
    "silu": lambda p, x: F.silu(x),
    "relu": lambda p, x: F.relu(x),
    "clamp": lambda p, x: x.clamp(p[0] if p[2] else None, p[1] if p[3] else None),
    "clamp_tensor": lambda p, x, lo, hi: x.clamp(lo if p[0] else None, hi if p[1] else None),
    "silu_and_mul": lambda p, a, b: F.silu(a) * b,
    "silu_and_mul_bwd": lambda p, dy, a, b: (torch.ops.aten.silu_backward(dy * b, a),
                                             dy * F.silu(a)),
}
launched: list[str] = []


class TorchSlot(Kernel, K.ElementwiseInterface):
    """The slot on the CPU: each call's scalar function by torch, in the spec's compute dtype,
    written into the outputs the op handed over (views of the caller's tensors included)."""

    devices = ("cpu",)
    general = True

    @classmethod
    def entry_for(cls, spec, op):
        fn = _FNS[spec.fn]
        compute = getattr(torch, spec.compute)

        def run(*tensors):
            launched.append(spec.fn)
            ins, outs = tensors[:len(spec.in_dtypes)], tensors[len(spec.in_dtypes):]
            for t, shape in zip(ins, spec.in_shapes, strict=True):
                assert tuple(t.shape) == shape
            got = fn(spec.params, *[t if t.dtype is torch.bool else t.to(compute) for t in ins])
            for o, g in zip(outs, got if isinstance(got, tuple) else (got,), strict=True):
                assert tuple(o.shape) == spec.out_shape
                o.copy_(g.expand(o.shape))

        return run


def _in_tree(cls, **params):
    return cls(kernel_map={"elementwise": TorchSlot}, **params)


def _pair(cls, **params):
    return _in_tree(cls, **params), cls(target="reference", **params)


def _close(got, want):
    """``got`` (the in-tree call's outputs, which ran through the slot) equal to ``want``."""
    assert launched, "the call did not run through the elementwise slot"
    launched.clear()
    for g, w in zip(got if isinstance(got, tuple) else (got,),
                    want if isinstance(want, tuple) else (want,), strict=True):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def _rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize(("name", "shapes"), [
    ("AddBwdOp", ((5, 3), (5, 3), (3,))), ("SubBwdOp", ((5, 3), (5, 1), (3,))),
    ("MulBwdOp", ((4, 5, 3), (5, 3), (4, 1, 3))), ("MaximumBwdOp", ((5, 3), (5, 3), (3,))),
    ("MinimumBwdOp", ((5, 3), (5, 3), ())), ("DivBwdOp", ((5, 3), (5, 3), (3,))),
    ("PowBwdOp", ((5, 3), (5, 3), (3,))), ("RemainderBwdOp", ((4, 5, 3), (5, 3), (4, 1, 3))),
])
def test_binary_gradients_launch_and_reduce_as_their_reference(name, shapes):
    cls = getattr(ops, name)
    dout, a, b = (_rand(*s, seed=i) for i, s in enumerate(shapes))
    if name in ("MaximumBwdOp", "MinimumBwdOp"):
        a[0] = b.expand(a.shape)[0]  # ties split the gradient
    if name == "PowBwdOp":  # positive bases (a fractional power of a negative one is NaN)
        a = a.abs() + 0.1
    for needs in ((True, True), (True, False), (False, True)):
        mine, ref = _pair(cls, grad_a=needs[0], grad_b=needs[1])
        _close(mine(dout, a, b), ref(dout, a, b))
        assert mine.serving_target == "tileops"


def test_where_and_masked_fill_gradients():
    dout, a, b = _rand(7, 5), _rand(5, seed=1), _rand(7, 5, seed=2)
    cond = _rand(7, 1, seed=3) > 0
    mine, ref = _pair(ops.WhereBwdOp)
    _close(mine(dout, cond, a, b), ref(dout, cond, a, b))
    mask = _rand(5, seed=4) > 0
    mine, ref = _pair(ops.MaskedFillBwdOp)
    _close(mine(dout, mask), ref(dout, mask))


def test_lerp_gradient_launches_each_wanted_term():
    dout, s, e, w = _rand(7, 5), _rand(7, 5, seed=1), _rand(5, seed=2), _rand(7, 1, seed=3)
    for flags in ((True, True, True), (False, True, False), (True, False, True)):
        params = dict(zip(("grad_start", "grad_end", "grad_weight"), flags, strict=True))
        mine, ref = _pair(ops.LerpBwdOp, **params)
        _close(mine(dout, s, e, w), ref(dout, s, e, w))


def test_lerp_hands_a_numbers_weight_over_in_float32_beside_16_bit_operands(monkeypatch):
    start, end = _rand(7, 5, dtype=torch.bfloat16), _rand(5, dtype=torch.bfloat16, seed=1)
    seen = []
    hand = TorchSlot.entry_for
    monkeypatch.setattr(TorchSlot, "entry_for",
                        lambda spec, op: seen.append(spec.in_dtypes) or hand(spec, op))
    got = _in_tree(ops.LerpFwdOp)(start, end, 0.3)
    assert seen == [("bfloat16", "bfloat16", "float32")]
    launched.clear()
    want = torch.lerp(start.float(), end.float(), 0.3).to(torch.bfloat16)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # its gradient: dstart and dend in bfloat16, dweight in the 0-dim weight's float32
    dout, w = _rand(7, 5, dtype=torch.bfloat16, seed=2), torch.tensor(0.3)
    got = _in_tree(ops.LerpBwdOp)(dout, start, end, w)
    launched.clear()
    assert [g.dtype for g in got] == [torch.bfloat16, torch.bfloat16, torch.float32]
    ref = ops.LerpBwdOp(target="reference")(dout, start, end, w)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_integers_beside_16_bit_floats_are_rounded_to_the_common_dtype_first(half, monkeypatch):
    # torch casts every operand to the common dtype before the math: int32 2049 beside a
    # float16 is 2048, 300001 is inf (bfloat16: -257 is -256)
    a = torch.tensor([[2049, 300001, -257, 7]] * 3, dtype=torch.int32)
    h = torch.tensor([2048.0, 1.0, 256.0, 0.5], dtype=half)
    seen = []
    hand = TorchSlot.entry_for
    monkeypatch.setattr(TorchSlot, "entry_for",
                        lambda spec, op: seen.append(spec.in_dtypes) or hand(spec, op))
    for name, fn in (("EqFwdOp", torch.eq), ("SubFwdOp", torch.sub), ("AddFwdOp", torch.add)):
        for args in ((a, h), (h, a)):
            seen.clear()
            got = _in_tree(getattr(ops, name))(*args)
            launched.clear()
            assert seen == [tuple(str(half).removeprefix("torch.") for _ in args)]
            torch.testing.assert_close(got, fn(*args), rtol=0, atol=0, equal_nan=True)
            ref = getattr(ops, name)(target="reference")(*args)
            torch.testing.assert_close(ref, fn(*args), rtol=0, atol=0, equal_nan=True)
    # a 0-dim integer keeps its value (as a CUDA kernel of torch takes a CPU scalar)
    got = _in_tree(ops.SubFwdOp)(torch.tensor(300001, dtype=torch.int32), h)
    launched.clear()
    torch.testing.assert_close(got, (300001 - h.float()).to(half))


def test_gated_ops_hand_over_the_halves_as_views():
    x = _rand(4, 2 * 6 + 2)[:, 1:13]  # a strided [4, 12] input
    mine, ref = _pair(ops.SiluAndMulFwdOp)
    _close(mine(x), ref(x))
    dy = _rand(4, 6, seed=5)
    mine, ref = _pair(ops.SiluAndMulBwdOp)
    _close(mine(dy, x), ref(dy, x))


def test_clamp_forms_and_inplace_write_the_callers_tensor():
    x = _rand(6, 4)
    mine, ref = _pair(ops.ClampFwdOp, min=-0.5)
    _close(mine(x), ref(x))
    lo, hi = torch.full((6, 4), -0.2), _rand(4, seed=7).expand(6, 4)
    mine, ref = _pair(ops.ClampFwdOp)
    _close(mine(x, lo, hi), ref(x, lo, hi))
    _close(mine(x, None, hi), ref(x, None, hi))
    # bounds that broadcast: the slot reads them expanded to x's shape
    row, col = _rand(4, seed=3) - 1, _rand(6, 1, seed=4).abs()
    _close(mine(x, row, col), ref(x, row, col))
    assert torch.equal(mine(x, None, torch.tensor(0.1)), x.clamp(max=0.1))
    launched.clear()
    # a number bound beside a tensor one bounds too, either way round, as torch's clamp
    for params, bounds in ((dict(min=0.1), (None, hi)), (dict(max=0.3), (lo, None)),
                           (dict(min=0.5), (None, torch.full((6, 4), 0.2)))):
        mine, ref = _pair(ops.ClampFwdOp, **params)
        got = mine(x, *bounds)
        _close(got, ref(x, *bounds))
        wide = [torch.full_like(x, v) for v in (params.get("min"), params.get("max"))
                if v is not None]
        want = torch.clamp(x, *(bounds[0] if bounds[0] is not None else wide[0],
                                bounds[1] if bounds[1] is not None else wide[0]))
        torch.testing.assert_close(got, want)
    y = x.clone()[:, ::2]  # a strided view, written in place
    want = F.relu(y)
    assert _in_tree(ops.ReluFwdOp, inplace=True)(y) is y
    _close(y, want)
    assert launched == []


@pytest.mark.parametrize(("params", "x", "bounds", "dtype"), [
    # an int32 x beside a float number: y is the default float, x cast on load
    (dict(min=-0.5, max=2), torch.arange(-3, 4, dtype=torch.int32), (), torch.float32),
    # beside an int number: x's own dtype; a bool x beside one: int64
    (dict(max=1), torch.arange(-3, 4, dtype=torch.int8), (), torch.int8),
    (dict(min=0, max=1), torch.tensor([True, False]), (), torch.int64),
    # tensor bounds of other dtypes: torch's promotion of the three
    ({}, _rand(3, 4, dtype=torch.bfloat16), (torch.full((4,), -0.3), None), torch.float32),
    ({}, torch.arange(12, dtype=torch.int16).view(3, 4),
     (torch.tensor(2, dtype=torch.int64), torch.full((3, 1), 9.5, dtype=torch.float16)),
     torch.float16),
    # a number beside a tensor bound: a 0-dim tensor of y's dtype
    (dict(max=7), torch.arange(12, dtype=torch.int32).view(3, 4),
     (torch.full((4,), 2, dtype=torch.int64), None), torch.int64),
])
def test_clamp_takes_every_operand_into_the_promoted_dtype(params, x, bounds, dtype):
    mine, ref = _pair(ops.ClampFwdOp, **params)
    got = mine(x, *bounds)
    assert got.dtype is dtype and launched
    want = ref(x, *bounds)
    assert want.dtype is dtype
    _close(got, want)
    if all(b is not None for b in bounds) and (bounds or not params.keys() - {"min", "max"}):
        lo, hi = bounds if bounds else (params.get("min"), params.get("max"))
        assert torch.equal(got, torch.clamp(x, lo, hi))  # torch's own form, where it has one


def test_clamp_in_place_computes_in_the_promoted_dtype_and_casts_into_x():
    """A uint8 x clamped in place by an int8 bound: torch computes in int16 and casts into
    x (-4 is 252 there), not in uint8 (where the bound would be 252 before the clamp)."""
    x = torch.tensor([[4, 4, 3, 0, 3], [1, 9, 2, 7, 0]], dtype=torch.uint8)
    lo, hi = torch.tensor(True), torch.tensor([[-4], [6]], dtype=torch.int8)
    want = x.clone().clamp_(lo, hi)
    for op in _pair(ops.ClampFwdOp, inplace=True):
        y = x.clone()
        assert op(y, lo, hi) is y
        assert torch.equal(y, want), (op, y)
    assert launched == ["clamp_tensor"]
    launched.clear()


def test_clamp_gradient_of_a_promoted_output_is_in_x_s_dtype():
    x = _rand(6, 4, dtype=torch.bfloat16, seed=1)
    dy = _rand(6, 4, seed=2)  # the gradient of a float32 y
    lo, hi = torch.full((4,), -0.3), torch.full((6, 1), 0.4, dtype=torch.float64)
    mine, ref = _pair(ops.ClampBwdOp)
    got = mine(dy, x, lo, hi)
    assert got.dtype is torch.bfloat16
    _close(got, ref(dy, x, lo, hi))
    xg = x.clone().requires_grad_()
    torch.clamp(xg, lo, hi).backward(dy.double())
    assert torch.equal(got, xg.grad)


def test_clamp_gradient_passes_where_the_bounds_hold():
    dy, x = _rand(6, 4), _rand(6, 4, seed=1)
    x[0, 0] = -0.5  # at a bound the gradient passes, as torch's
    for params, bounds in (({"min": -0.5}, ()), ({"min": -0.5, "max": 0.5}, ()),
                           ({}, (torch.full((6, 4), -0.3), _rand(6, 4, seed=2).abs())),
                           ({}, (torch.full((4,), -0.3), _rand(6, 1, seed=2).abs())),
                           ({"max": 0.5}, (torch.tensor(-0.3),))):
        mine, ref = _pair(ops.ClampBwdOp, **params)
        _close(mine(dy, x, *bounds), ref(dy, x, *bounds))


def test_a_number_bound_beside_a_tensor_bound_is_checked_before_it_is_made_a_tensor():
    x = _rand(4, dtype=torch.float16)
    hi = torch.full((4,), 1.0, dtype=torch.float16)
    with pytest.raises(RuntimeError) as exc:
        _in_tree(ops.ClampFwdOp, min=-1e5)(x, None, hi)
    assert str(exc.value).startswith("ClampFwdOp: param min is -100000.0, outside the values "
                                     "float16 holds")
    assert launched == []
