"""The elementwise family's gradients: the activations' and gated ops' (one scalar function
each, the forward's derivative, with torch's closed-form backward as the reference) and the
binary ops' (a few launches of forward scalar functions over the broadcast shape, reduced over
each input's broadcast axes). Exported by :mod:`tileops.ops.elementwise`."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from ._elementwise_base import _SELU_ALPHA, _SELU_SCALE, ElementwiseOp, _aten, _wide

__all__ = [
    "AddBwdOp", "BinaryBwdOp", "ClampBwdOp", "DivBwdOp", "EluBwdOp", "GatedBwdOp",
    "GeluAndMulBwdOp", "GeluBwdOp", "GeluTanhAndMulBwdOp", "HardsigmoidBwdOp", "HardswishBwdOp",
    "HardtanhBwdOp", "LeakyReluBwdOp", "LerpBwdOp", "MaskedFillBwdOp", "MaximumBwdOp",
    "MinimumBwdOp", "MishBwdOp", "MulBwdOp", "PowBwdOp", "ReluBwdOp", "RemainderBwdOp",
    "SeluBwdOp", "SiluAndMulBwdOp", "SiluBwdOp", "SoftplusBwdOp", "SubBwdOp", "SwiGLUBwdOp",
    "WhereBwdOp", *(f"{n}BwdOp" for n in ("Abs", "Cos", "Erf", "Exp", "Expm1", "Log", "Log1p",
                                         "Neg", "Reciprocal", "Rsqrt", "Sigmoid", "Sin",
                                         "Sqrt", "Tanh")),
]

class _ActivationBwd(ElementwiseOp):
    """Base of the activations' gradients ``dx = f(dy, x)`` (or of ``y`` where the forward
    saves its output): the scalar function is the forward's with ``_bwd``, its constants
    the forward's params of the same names; the reference is torch's closed-form backward."""

    def fn_name(self) -> str:
        return self.fn


class ReluBwdOp(_ActivationBwd):
    fn = "relu_bwd"

    def torch_fn(self, dy, y, inplace=False):
        return _aten.threshold_backward(dy, y, 0)


class GeluBwdOp(_ActivationBwd):
    def fn_name(self) -> str:
        return "gelu_tanh_bwd" if self.approximate == "tanh" else "gelu_bwd"

    def constants(self) -> tuple:
        return ()

    def torch_fn(self, dy, x, inplace=False):
        return _aten.gelu_backward(dy, x, approximate=self.approximate)


class SiluBwdOp(_ActivationBwd):
    fn = "silu_bwd"

    def torch_fn(self, dy, x, inplace=False):
        return _aten.silu_backward(dy, x)


class MishBwdOp(_ActivationBwd):
    fn = "mish_bwd"

    def torch_fn(self, dy, x, inplace=False):
        return _aten.mish_backward(dy, x)


class SoftplusBwdOp(_ActivationBwd):
    fn = "softplus_bwd"

    def torch_fn(self, dy, x, inplace=False):
        return _aten.softplus_backward(dy, x, self.beta, self.threshold)


class LeakyReluBwdOp(_ActivationBwd):
    fn = "leaky_relu_bwd"

    def torch_fn(self, dy, x, inplace=False):
        return _aten.leaky_relu_backward(dy, x, self.negative_slope, False)


class EluBwdOp(_ActivationBwd):
    fn = "elu_bwd"

    def torch_fn(self, dy, x, inplace=False):
        return _aten.elu_backward(dy, self.alpha, 1.0, 1.0, False, x)


class SeluBwdOp(_ActivationBwd):
    fn = "selu_bwd"

    def torch_fn(self, dy, x, inplace=False):
        return _aten.elu_backward(dy, _SELU_ALPHA, _SELU_SCALE, 1.0, False, x)


class HardswishBwdOp(_ActivationBwd):
    fn = "hardswish_bwd"

    def torch_fn(self, dy, x, inplace=False):
        return _aten.hardswish_backward(dy, x)


class HardsigmoidBwdOp(_ActivationBwd):
    fn = "hardsigmoid_bwd"

    def torch_fn(self, dy, x, inplace=False):
        return _aten.hardsigmoid_backward(dy, x)


class HardtanhBwdOp(_ActivationBwd):
    fn = "hardtanh_bwd"

    def torch_fn(self, dy, x, inplace=False):
        return _aten.hardtanh_backward(dy, x, self.min_val, self.max_val)


# --- the unary math's gradients -------------------------------------------------------------


def _math_bwd(name: str, fn: str, formula: Any, doc: str) -> type[ElementwiseOp]:
    """A unary math function's gradient: the scalar function ``fn`` of ``(dy, y)`` where the
    forward saves its output, ``(dy, x)`` where it saves its input (``(dy)`` alone for neg),
    and torch's formula of the same tensors, which is the reference and the eager contender
    (one line each: declared by the table below, not written out as classes)."""

    def torch_fn(self, *tensors: Any, inplace: bool = False) -> Any:
        return formula(*tensors)

    return type(name, (_ActivationBwd,), {"__module__": __name__, "__doc__": doc,
                                          "fn": fn, "torch_fn": torch_fn})


_TWO_OVER_SQRT_PI = 1.1283791670955126

AbsBwdOp = _math_bwd("AbsBwdOp", "abs_bwd", lambda dy, x: dy * torch.sign(x).nan_to_num(0.0),
                     "``dx = dy sgn(x)``: zero at 0 (and at NaN), as torch's.")
CosBwdOp = _math_bwd("CosBwdOp", "cos_bwd", lambda dy, x: dy * -torch.sin(x),
                     "``dx = -dy sin(x)``.")
ErfBwdOp = _math_bwd("ErfBwdOp", "erf_bwd",
                     lambda dy, x: dy * _TWO_OVER_SQRT_PI * torch.exp(-(x * x)),
                     "``dx = dy 2 / sqrt(pi) exp(-x^2)``.")
ExpBwdOp = _math_bwd("ExpBwdOp", "mul", lambda dy, y: dy * y,
                     "``dx = dy y`` from the output (the family's ``mul``).")
Expm1BwdOp = _math_bwd("Expm1BwdOp", "expm1_bwd", lambda dy, y: dy * (y + 1),
                       "``dx = dy (y + 1)`` from the output.")
LogBwdOp = _math_bwd("LogBwdOp", "div", lambda dy, x: dy / x,
                     "``dx = dy / x`` (the family's ``div``).")
Log1pBwdOp = _math_bwd("Log1pBwdOp", "log1p_bwd", lambda dy, x: dy / (x + 1),
                       "``dx = dy / (1 + x)``.")
NegBwdOp = _math_bwd("NegBwdOp", "neg", lambda dy: -dy, "``dx = -dy`` (the family's ``neg``).")
ReciprocalBwdOp = _math_bwd("ReciprocalBwdOp", "reciprocal_bwd", lambda dy, y: -dy * (y * y),
                            "``dx = -dy y^2`` from the output.")
RsqrtBwdOp = _math_bwd("RsqrtBwdOp", "rsqrt_bwd", lambda dy, y: -0.5 * dy * (y * y * y),
                       "``dx = -dy y^3 / 2`` from the output.")
SigmoidBwdOp = _math_bwd("SigmoidBwdOp", "sigmoid_bwd",
                         lambda dy, y: _aten.sigmoid_backward(dy, y),
                         "``dx = dy y (1 - y)`` from the output.")
SinBwdOp = _math_bwd("SinBwdOp", "sin_bwd", lambda dy, x: dy * torch.cos(x),
                     "``dx = dy cos(x)``.")
SqrtBwdOp = _math_bwd("SqrtBwdOp", "sqrt_bwd", lambda dy, y: dy / (2 * y),
                      "``dx = dy / (2 y)`` from the output.")
TanhBwdOp = _math_bwd("TanhBwdOp", "tanh_bwd", lambda dy, y: _aten.tanh_backward(dy, y),
                      "``dx = dy (1 - y^2)`` from the output.")


class GatedBwdOp(ElementwiseOp):
    """Base of the gated activations' gradients: ``dy`` and the two halves of ``x`` in, the
    two halves of ``dx`` out (strided views: ``dx`` is written once, nothing is copied)."""

    #: torch's activation of the gate and its closed-form backward ``(dy, gate) -> dgate``
    act: ClassVar[Any]
    act_bwd: ClassVar[Any]

    def forward(self, call, dy, x, dx) -> None:
        n = dy.shape[-1]
        self._launch(call, [dy, x[..., :n], x[..., n:]], (dx[..., :n], dx[..., n:]))

    def torch_fn(self, dy, x, inplace=False):
        gate, up = x.chunk(2, dim=-1)
        cls = type(self)
        return torch.cat([cls.act_bwd(dy * up, gate), dy * cls.act(gate)], dim=-1)


class SiluAndMulBwdOp(GatedBwdOp):
    fn = "silu_and_mul_bwd"
    act = staticmethod(F.silu)
    act_bwd = staticmethod(_aten.silu_backward)


class GeluAndMulBwdOp(GatedBwdOp):
    fn = "gelu_and_mul_bwd"
    act = staticmethod(F.gelu)
    act_bwd = staticmethod(lambda g, x: _aten.gelu_backward(g, x, approximate="none"))


class GeluTanhAndMulBwdOp(GatedBwdOp):
    fn = "gelu_tanh_and_mul_bwd"
    act = staticmethod(lambda t: F.gelu(t, approximate="tanh"))
    act_bwd = staticmethod(lambda g, x: _aten.gelu_backward(g, x, approximate="tanh"))


class SwiGLUBwdOp(ElementwiseOp):
    fn = "silu_and_mul_bwd"

    def torch_fn(self, dy, a, b, inplace=False):
        return _aten.silu_backward(dy * b, a), dy * F.silu(a)


class BinaryBwdOp(ElementwiseOp):
    """Base of the binary ops' gradients ``(dout, a, b) -> (da, db)``. Each wanted gradient is
    one launch of a forward scalar function (``mul``, ``div``, ...) over the broadcast shape,
    written straight into ``da`` / ``db`` (in its input's dtype) where that input was not
    broadcast; where it was, into a float32 buffer (float64 for float64) that is summed over
    the broadcast axes (torch's ``sum_to_size``) and rounded once into the gradient
    (:meth:`_into`). A leaf states
    each gradient as :meth:`grads`: ``(fn, constants, operands)`` per input, or None for a
    gradient that is zero."""

    def fn_name(self) -> str:
        return ""  # each gradient names its own function (grads)

    def constants(self) -> tuple:
        return ()

    def grads(self, dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple:
        raise NotImplementedError

    def forward(self, call, dout, a, b, da, db) -> None:
        for g, form in zip((da, db), self.grads(dout, a, b), strict=True):
            if g is None:
                continue
            if form is None:
                g.zero_()
                continue
            fn, consts, operands = form
            self._into(call, g, list(operands), (fn, consts), dout.shape)

    def _into(self, call, g: torch.Tensor, operands: list, form: tuple, shape) -> None:
        """Launch ``form`` over ``operands`` into the gradient ``g``; where ``g`` is smaller
        than the broadcast ``shape`` (its input was broadcast), into a float32 buffer (float64
        for a float64 ``g``) of ``shape``, summed over the broadcast axes and rounded once into
        ``g``. Terms rounded to 16 bits before the sum keep their rounding errors while the sum
        cancels: a bias's gradient over 32768 rows whose terms nearly cancel came out 1.4% from
        float64 in bfloat16 that way, where the sum of float32 terms is off by the final
        rounding only."""
        if g.shape == shape:
            self._launch(call, operands, (g,), form)
            return
        acc = torch.float64 if g.dtype is torch.float64 else torch.float32
        full = torch.empty(shape, dtype=acc, device=g.device)
        self._launch(call, operands, (full,), form)
        g.copy_(full.sum_to_size(g.shape))

    def reference(self, call, dout, a, b):
        # torch's autograd of the forward, in float32 (or float64): a closed form per leaf
        return self.torch_fn(*[_wide(t) for t in (dout, a, b)])

    def _reduce(self, g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
        return None if g is None else g.sum_to_size(like.shape).to(like.dtype)


class AddBwdOp(BinaryBwdOp):
    def grads(self, dout, a, b):
        return (("mul", (), (dout, self._const(1.0, dout))),
                ("mul", (), (dout, self._const(self.alpha, dout))))

    def torch_fn(self, dout, a, b, inplace=False):
        return (self._reduce(dout if self.grad_a else None, a),
                self._reduce(dout * self.alpha if self.grad_b else None, b))


class SubBwdOp(BinaryBwdOp):
    def grads(self, dout, a, b):
        return (("mul", (), (dout, self._const(1.0, dout))),
                ("mul", (), (dout, self._const(-self.alpha, dout))))

    def torch_fn(self, dout, a, b, inplace=False):
        return (self._reduce(dout if self.grad_a else None, a),
                self._reduce(-self.alpha * dout if self.grad_b else None, b))


class MulBwdOp(BinaryBwdOp):
    def grads(self, dout, a, b):
        return ("mul", (), (dout, b)), ("mul", (), (dout, a))

    def torch_fn(self, dout, a, b, inplace=False):
        return (self._reduce(dout * b if self.grad_a else None, a),
                self._reduce(dout * a if self.grad_b else None, b))


class WhereBwdOp(BinaryBwdOp):
    """``da`` is ``dout`` where ``cond`` holds, ``db`` where it does not (the condition is not
    differentiable)."""

    def forward(self, call, dout, cond, a, b, da, db) -> None:
        zero = self._const(0.0, dout)
        for g, ops in ((da, (cond, dout, zero)), (db, (cond, zero, dout))):
            if g is not None:
                self._into(call, g, list(ops), ("where", ()), dout.shape)

    def reference(self, call, dout, cond, a, b):
        return self.torch_fn(_wide(dout), cond, _wide(a), _wide(b))

    def torch_fn(self, dout, cond, a, b, inplace=False):
        zero = torch.zeros((), dtype=dout.dtype, device=dout.device)
        return (self._reduce(torch.where(cond, dout, zero) if self.grad_a else None, a),
                self._reduce(torch.where(cond, zero, dout) if self.grad_b else None, b))


class MaskedFillBwdOp(ElementwiseOp):
    """``dx`` is ``dout`` where the mask does not hold (``masked_fill`` with zero)."""

    fn = "masked_fill"

    def constants(self) -> tuple:
        return (0.0,)

    def torch_fn(self, dout, mask, inplace=False):
        return dout.masked_fill(mask, 0)


class _ExtremumBwd(BinaryBwdOp):
    """The gradients of ``maximum`` / ``minimum`` in torch's form: ``w = dout / 2`` where
    ``a == b`` else ``dout`` (a tie splits the gradient), then each side's ``w`` with zero
    where the other side won (``a < b`` for maximum's ``da``). Launches of the forward's
    scalar functions (``mul``, ``eq``, ``lt``/``gt``, ``where``) over the broadcast shape."""

    #: the comparison that zeroes each side's gradient: (for da, for db)
    losers: ClassVar[tuple[str, str]]

    def forward(self, call, dout, a, b, da, db) -> None:
        shape, dev = dout.shape, dout.device
        half = torch.empty(shape, dtype=dout.dtype, device=dev)
        self._launch(call, [dout, self._const(0.5, dout)], (half,), ("mul", ()))
        tie = torch.empty(shape, dtype=torch.bool, device=dev)
        self._launch(call, [a, b], (tie,), ("eq", ()))
        w = torch.empty(shape, dtype=dout.dtype, device=dev)
        self._launch(call, [tie, half, dout], (w,), ("where", ()))
        zero = self._const(0.0, dout)
        for g, lost in zip((da, db), self.losers, strict=True):
            if g is None:
                continue
            mask = torch.empty(shape, dtype=torch.bool, device=dev)
            self._launch(call, [a, b], (mask,), (lost, ()))
            self._into(call, g, [mask, zero, w], ("where", ()), shape)

    def torch_fn(self, dout, a, b, inplace=False):
        w = torch.where(a == b, dout / 2, dout)
        lose_a, lose_b = ((a < b), (a > b)) if self.losers == ("lt", "gt") else ((a > b), (a < b))
        return (self._reduce(w.masked_fill(lose_a, 0) if self.grad_a else None, a),
                self._reduce(w.masked_fill(lose_b, 0) if self.grad_b else None, b))


class MaximumBwdOp(_ExtremumBwd):
    losers = ("lt", "gt")


class MinimumBwdOp(_ExtremumBwd):
    losers = ("gt", "lt")


class LerpBwdOp(BinaryBwdOp):
    """``dstart = dout (1 - weight)``, ``dend = dout weight``, ``dweight = dout (end -
    start)`` (torch's lerp gradients), each launched over the broadcast shape and summed over
    its input's broadcast axes."""

    def forward(self, call, dout, start, end, weight, dstart, dend, dweight) -> None:
        shape, dev = dout.shape, dout.device
        plans = []
        if dstart is not None:
            rest = torch.empty(weight.shape, dtype=weight.dtype, device=dev)
            self._launch(call, [self._const(1.0, weight), weight], (rest,), ("sub", (1.0,)))
            plans.append((dstart, [dout, rest]))
        if dend is not None:
            plans.append((dend, [dout, weight]))
        if dweight is not None:
            diff = torch.empty(torch.broadcast_shapes(start.shape, end.shape),
                               dtype=dout.dtype, device=dev)
            self._launch(call, [end, start], (diff,), ("sub", (1.0,)))
            plans.append((dweight, [dout, diff]))
        for g, operands in plans:
            self._into(call, g, operands, ("mul", ()), shape)

    def reference(self, call, dout, start, end, weight):
        return self.torch_fn(*[_wide(t) for t in (dout, start, end, weight)])

    def torch_fn(self, dout, start, end, weight, inplace=False):
        return (self._reduce(dout * (1 - weight) if self.grad_start else None, start),
                self._reduce(dout * weight if self.grad_end else None, end),
                self._reduce(dout * (end - start) if self.grad_weight else None, weight))


class ClampBwdOp(BinaryBwdOp):
    """``dx = dy`` where ``lo <= x <= hi`` (torch's clamp gradient: a bound passes at
    equality), else zero: one comparison launch per bound given (a number as a 0-dim
    constant, or the bound tensor, compared with x in their promoted dtype as torch compares),
    then ``where``s, the last written into ``dx`` in x's dtype (``dy`` is the forward's
    promoted output's, as torch casts a gradient to its input's dtype)."""

    def forward(self, call, dy, x, min_bound, max_bound, dx) -> None:
        shape, dev = dy.shape, dy.device
        bounds = []
        for tensor, value, cmp in ((min_bound, self.min, "ge"), (max_bound, self.max, "le")):
            if tensor is not None or value is not None:
                bounds.append((cmp, tensor.expand(shape) if tensor is not None
                               else self._const(value, x)))
        if not bounds:
            dx.copy_(dy)
            return
        zero, cur = self._const(0.0, dy), dy
        for k, (cmp, bound) in enumerate(bounds):
            mask = torch.empty(shape, dtype=torch.bool, device=dev)
            self._launch(call, [x, bound], (mask,), (cmp, ()))
            out = dx if k == len(bounds) - 1 else torch.empty(shape, dtype=dy.dtype, device=dev)
            self._launch(call, [mask, cur, zero], (out,), ("where", ()))
            cur = out

    def reference(self, call, dy, x, min_bound, max_bound):
        return self.torch_fn(*[_wide(t) for t in (dy, x, min_bound, max_bound)])

    def torch_fn(self, dy, x, min_bound=None, max_bound=None, inplace=False):
        lo = min_bound if min_bound is not None else self.min
        hi = max_bound if max_bound is not None else self.max
        keep = torch.ones_like(x, dtype=torch.bool)
        if lo is not None:
            keep &= x >= lo
        if hi is not None:
            keep &= x <= hi
        return (torch.where(keep, dy, torch.zeros((), dtype=dy.dtype, device=dy.device))
                .to(x.dtype),)


class DivBwdOp(BinaryBwdOp):
    """``da = dout / b``, ``db = -dout a / b^2``; a rounded quotient is piecewise constant, so
    with a ``rounding_mode`` both gradients are zero, as torch's."""

    def grads(self, dout, a, b):
        if self.rounding_mode is not None:
            return None, None
        return ("div", (), (dout, b)), ("div_bwd_b", (), (dout, a, b))

    def torch_fn(self, dout, a, b, inplace=False):
        if self.rounding_mode is not None:
            return (torch.zeros_like(a) if self.grad_a else None,
                    torch.zeros_like(b) if self.grad_b else None)
        return (self._reduce(dout / b if self.grad_a else None, a),
                self._reduce(-(dout * ((a / b) / b)) if self.grad_b else None, b))


class PowBwdOp(BinaryBwdOp):
    """torch's pow gradients: ``da = dout b a^(b - 1)``, zero where ``b == 0``; ``db = dout
    a^b log(a)``, zero where ``a == 0`` and ``b >= 0`` (the limit torch takes); NaN where the
    power is (a negative base to a fractional exponent)."""

    def grads(self, dout, a, b):
        return ("pow_bwd_a", (), (dout, a, b)), ("pow_bwd_b", (), (dout, a, b))

    def torch_fn(self, dout, a, b, inplace=False):
        zero = torch.zeros((), dtype=dout.dtype, device=dout.device)
        da = db = None
        if self.grad_a:
            da = torch.where(b == 0, zero, dout * (b * a.pow(b - 1)))
        if self.grad_b:
            db = torch.where((a == 0) & (b >= 0), zero, dout * (a.pow(b) * a.log()))
        return self._reduce(da, a), self._reduce(db, b)


class RemainderBwdOp(BinaryBwdOp):
    """torch's remainder gradients: ``da = dout``, ``db = -dout floor(a / b)`` (``a - floor(a
    / b) b`` with the quotient's floor piecewise constant)."""

    def grads(self, dout, a, b):
        return (("mul", (), (dout, self._const(1.0, dout))),
                ("remainder_bwd_b", (), (dout, a, b)))

    def torch_fn(self, dout, a, b, inplace=False):
        return (self._reduce(dout if self.grad_a else None, a),
                self._reduce(-dout * torch.div(a, b, rounding_mode="floor")
                             if self.grad_b else None, b))
