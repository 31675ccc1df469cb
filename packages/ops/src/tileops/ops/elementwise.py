"""The elementwise family: unary math, activations, binary ops, gated activations, gradients.

Every op of the family is one scalar function of the kernels' generator
(:mod:`tileops.kernels.elementwise`): the op names it (:attr:`ElementwiseOp.fn`, or
:meth:`~ElementwiseOp.fn_name` where a param chooses it) and states its constants
(:meth:`~ElementwiseOp.constants`), and :class:`ElementwiseOp`, the family base, owns the call:

- the operands: the entry's input tensors in order (absent optional ones left out), and the
  outputs, fresh contiguous tensors of the broadcast shape or, in place, the input object
  itself. A gated op hands over the two halves of ``x`` (``x[..., :N]`` and ``x[..., N:]``)
  as strided views, and its gradient the two halves of ``dx`` as outputs: nothing is copied.
- the cached call: one dict lookup keyed by what the kernel's plan depends on (the device,
  each operand's dtype, shape, strides and address alignment); on a miss the base builds the
  :class:`~tileops.kernels.elementwise.ElementwiseSpec` and the slot's entry.
- the compute dtype: torch's. The math runs in the promoted dtype of the operands (the
  output's, or for a comparison the operands' common one), float16 and bfloat16 widened to
  float32, as torch's own kernels compute.
- the refusals: a dtype the in-tree kernels do not serve (float64: the ``reference`` target
  serves it), and an in-place write of a tensor whose elements share memory (an expanded
  view), which torch refuses too.

The ops' references and eager functions are torch's own functions, stated once per leaf
(:meth:`ElementwiseOp.torch_fn`); a gradient's reference is torch's closed-form backward
(``aten.*_backward``), not autograd, since a reference may run inside a compiled graph's
custom op where autograd does not record.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from tileops.kernels import elementwise as _k
from tileops.runtime import Op

from ._dtypes import NAMES, refuse_unserved

__all__ = [
    "AbsFwdOp", "AddBwdOp", "AddFwdOp", "BinaryBwdOp", "BinaryOp", "CeilFwdOp", "ClampBwdOp",
    "ClampFwdOp", "CosFwdOp", "DivBwdOp", "DivFwdOp", "ElementwiseOp", "EluBwdOp", "EluFwdOp",
    "EqFwdOp", "ErfFwdOp", "ExpFwdOp", "Expm1FwdOp", "FloorFwdOp", "GatedBwdOp", "GatedOp",
    "GeFwdOp", "GeluAndMulBwdOp", "GeluAndMulFwdOp", "GeluBwdOp", "GeluFwdOp",
    "GeluTanhAndMulBwdOp", "GeluTanhAndMulFwdOp", "GtFwdOp", "HardsigmoidBwdOp",
    "HardsigmoidFwdOp", "HardswishBwdOp", "HardswishFwdOp", "HardtanhBwdOp", "HardtanhFwdOp",
    "IsfiniteFwdOp", "IsinfFwdOp", "IsnanFwdOp", "LeFwdOp", "LeakyReluBwdOp", "LeakyReluFwdOp",
    "LerpBwdOp", "LerpFwdOp", "Log1pFwdOp", "LogFwdOp", "LtFwdOp", "MaskedFillBwdOp",
    "MaskedFillFwdOp", "MaximumBwdOp", "MaximumFwdOp", "MinimumBwdOp", "MinimumFwdOp", "MishBwdOp",
    "MishFwdOp", "MulBwdOp", "MulFwdOp", "NeFwdOp", "NegFwdOp", "PowFwdOp", "ReciprocalFwdOp",
    "ReluBwdOp", "ReluFwdOp", "RemainderFwdOp", "RoundFwdOp", "RsqrtFwdOp", "SeluBwdOp",
    "SeluFwdOp", "SigmoidFwdOp", "SignFwdOp", "SiluAndMulBwdOp", "SiluAndMulFwdOp", "SiluBwdOp",
    "SiluFwdOp", "SinFwdOp", "SoftplusBwdOp", "SoftplusFwdOp", "SqrtFwdOp", "SubBwdOp", "SubFwdOp",
    "SwiGLUBwdOp", "SwiGLUFwdOp", "TanhFwdOp", "TruncFwdOp", "WhereBwdOp", "WhereFwdOp",
]

#: the storage dtypes the generator's call spec states it serves
_SERVED = _k.DTYPES_SERVED
_HALF = (torch.float16, torch.bfloat16)
#: torch's SELU constants (torch.nn.functional.selu)
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
_aten = torch.ops.aten


def _wide(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` in float32 where it is float16 or bfloat16 (the references compute there)."""
    return t.float() if t is not None and t.dtype in _HALF else t


def _align(t: torch.Tensor) -> int:
    """The largest power-of-two byte alignment of ``t``'s address, at most 16."""
    p, a = t.data_ptr(), 16
    while a > 1 and p % a:
        a //= 2
    return a


def _noop(*tensors: Any) -> None:
    """The entry of an empty call: nothing to read or write."""


class ElementwiseOp(Op):
    """Family base of the elementwise ops (see the module docstring). A leaf sets :attr:`fn`
    (or overrides :meth:`fn_name`) and :meth:`torch_fn`; :meth:`constants` reads the fn's
    constants from the op's params of the same names."""

    #: the scalar function of the generator (a key of ``SCALAR_FNS``)
    fn: ClassVar[str]
    kernel_types = {_k.ElementwiseInterface: (_k.ElementwiseFlatKernel, _k.ElementwiseRowsKernel,
                                              _k.ElementwiseStridedKernel)}

    def derive(self) -> None:
        self._fn = self.fn_name()
        self._consts = self.constants()
        plan = type(self)._signature
        self._n_in = len(plan.input_names)  # type: ignore[union-attr]

    def fn_name(self) -> str:
        return self.fn

    def constants(self) -> tuple:
        """The fn's constants, in its declared order: the op's params of those names."""
        return tuple(getattr(self, p) for p in _k.SCALAR_FNS[self._fn].params)

    # --- the call -------------------------------------------------------------------------------

    def forward(self, call: Any, *tensors: Any) -> None:
        n = self._n_in
        self._launch(call, [t for t in tensors[:n] if t is not None], tensors[n:])

    def _launch(self, call: Any, ins: list, outs: Any, form: tuple | None = None) -> None:
        """Run the slot on ``ins`` and ``outs``; ``form`` is ``(fn, constants)`` where a call
        runs another function than the op's own (the tensor bounds of a clamp)."""
        key = (call.device, form, *[(t.dtype, t.shape, t.stride(), t.data_ptr() & 15)
                                    for t in ins],
               *[(t.dtype, t.stride(), t.data_ptr() & 15) for t in outs])
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            entry = self._entry(key, call, ins, outs, form or (self._fn, self._consts))
        entry(*ins, *outs)

    def _entry(self, key: tuple, call: Any, ins: list, outs: Any, form: tuple) -> Any:
        """The entry of a call not seen before: refusals, then the spec and the slot's entry
        (an empty call gets a no-op, memoised under the same key)."""
        for t in (*ins, *outs):
            refuse_unserved(self, t.dtype, _SERVED, "elementwise")
        for o in outs:
            if any(o is t for t in ins) and torch._debug_has_internal_overlap(o) == 1:
                name = self._signature.input_names[[t is o for t in ins].index(True)]
                raise RuntimeError(
                    f"{self!r}: {name} has elements that share memory (an expanded or "
                    f"overlapping view of shape {tuple(o.shape)} and strides {o.stride()}), so "
                    f"writing it in place is ambiguous; pass a tensor that owns its elements "
                    f"(.contiguous()) or construct the op with inplace=False")
        if outs[0].numel() == 0:
            with self._lock:
                self._entries_by_call[key] = _noop
            return _noop
        compute = self.compute_dtype(ins, outs)
        self.refuse_compute(compute)
        return self.kernel_for(key, _k.ElementwiseInterface, lambda: _k.ElementwiseSpec(
            device=call.device, fn=form[0], params=form[1],
            in_dtypes=tuple(NAMES[t.dtype] for t in ins),
            out_dtypes=tuple(NAMES[t.dtype] for t in outs), compute=NAMES[compute],
            out_shape=tuple(outs[0].shape), in_shapes=tuple(tuple(t.shape) for t in ins),
            in_strides=tuple(t.stride() for t in ins), in_align=tuple(_align(t) for t in ins),
            out_strides=tuple(t.stride() for t in outs),
            out_align=tuple(_align(t) for t in outs)))

    def compute_dtype(self, ins: list, outs: Any) -> torch.dtype:
        """The dtype the math runs in: the output's, float16 and bfloat16 widened to float32
        (torch's opmath type). A bool output (a comparison, a test) reads its operands'."""
        dtype = outs[0].dtype
        if dtype is torch.bool:
            dtype = self.operand_dtype(ins)
        return torch.float32 if dtype in _HALF else dtype

    def refuse_compute(self, compute: torch.dtype) -> None:
        """Refuse, by name, a compute dtype the op's in-tree function does not serve (the
        entry admits it: the ``reference`` target serves it); the default serves every one."""

    def operand_dtype(self, ins: list) -> torch.dtype:
        """The common dtype of the operands: torch's ``result_type`` (a 0-dim operand takes
        part only if its category is higher)."""
        if len(ins) == 1:
            return ins[0].dtype
        if len(ins) == 2:
            return torch.result_type(ins[0], ins[1])
        dtype = ins[0].dtype
        for t in ins[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        return dtype

    # --- the declared equivalents ---------------------------------------------------------------

    def torch_fn(self, *inputs: Any, inplace: bool = False) -> Any:
        """torch's function of the op, with its params (``inplace`` writes the first input);
        the reference and the eager contender both call it."""
        raise NotImplementedError(f"{type(self).__name__} declares no torch function")

    def reference(self, call: Any, *inputs: Any) -> tuple:
        out = self.torch_fn(*[_wide(t) for t in inputs])
        return out if isinstance(out, tuple) else (out,)

    def eager(self) -> Any:
        inplace = getattr(self, "inplace", False)
        fn = self.torch_fn

        def eager(*inputs: Any) -> Any:
            return fn(*inputs, inplace=inplace)

        return eager


# --- unary math ----------------------------------------------------------------------------------


def _unary(name: str, fn: str, torch_fn: Any, doc: str) -> type[ElementwiseOp]:
    """A unary math leaf: its scalar function and torch's (they are one line each, so they
    are declared by this table rather than written out as classes of one line)."""

    def call(self: Any, x: Any, inplace: bool = False) -> Any:
        return torch_fn(x)

    return type(name, (ElementwiseOp,), {"fn": fn, "torch_fn": call, "__doc__": doc,
                                         "__module__": __name__, "__qualname__": name})


ExpFwdOp = _unary("ExpFwdOp", "exp", torch.exp, "``torch.exp``.")
Expm1FwdOp = _unary("Expm1FwdOp", "expm1", torch.expm1, "``torch.expm1``.")
LogFwdOp = _unary("LogFwdOp", "log", torch.log, "``torch.log``.")
Log1pFwdOp = _unary("Log1pFwdOp", "log1p", torch.log1p, "``torch.log1p``.")
SqrtFwdOp = _unary("SqrtFwdOp", "sqrt", torch.sqrt, "``torch.sqrt``.")
RsqrtFwdOp = _unary("RsqrtFwdOp", "rsqrt", torch.rsqrt, "``torch.rsqrt``.")
ReciprocalFwdOp = _unary("ReciprocalFwdOp", "reciprocal", torch.reciprocal,
                         "``torch.reciprocal``.")
SinFwdOp = _unary("SinFwdOp", "sin", torch.sin, "``torch.sin``.")
CosFwdOp = _unary("CosFwdOp", "cos", torch.cos, "``torch.cos``.")
TanhFwdOp = _unary("TanhFwdOp", "tanh", torch.tanh, "``torch.tanh``.")
SigmoidFwdOp = _unary("SigmoidFwdOp", "sigmoid", torch.sigmoid, "``torch.sigmoid``.")
ErfFwdOp = _unary("ErfFwdOp", "erf", torch.erf, "``torch.erf``.")
AbsFwdOp = _unary("AbsFwdOp", "abs", torch.abs, "``torch.abs``.")
NegFwdOp = _unary("NegFwdOp", "neg", torch.neg, "``torch.neg``.")
SignFwdOp = _unary("SignFwdOp", "sign", torch.sign, "``torch.sign``.")
FloorFwdOp = _unary("FloorFwdOp", "floor", torch.floor, "``torch.floor``.")
CeilFwdOp = _unary("CeilFwdOp", "ceil", torch.ceil, "``torch.ceil``.")
RoundFwdOp = _unary("RoundFwdOp", "round", torch.round, "``torch.round`` (ties to even).")
TruncFwdOp = _unary("TruncFwdOp", "trunc", torch.trunc, "``torch.trunc``.")
IsnanFwdOp = _unary("IsnanFwdOp", "isnan", torch.isnan, "``torch.isnan``.")
IsinfFwdOp = _unary("IsinfFwdOp", "isinf", torch.isinf, "``torch.isinf``.")
IsfiniteFwdOp = _unary("IsfiniteFwdOp", "isfinite", torch.isfinite, "``torch.isfinite``.")


# --- activations (inplace) ---------------------------------------------------------------------


class ReluFwdOp(ElementwiseOp):
    fn = "relu"

    def torch_fn(self, x, inplace=False):
        return F.relu(x, inplace=inplace)


class GeluFwdOp(ElementwiseOp):
    def fn_name(self) -> str:
        return "gelu_tanh" if self.approximate == "tanh" else "gelu"

    def torch_fn(self, x, inplace=False):
        y = F.gelu(x, approximate=self.approximate)  # torch's gelu has no in-place form
        return x.copy_(y) if inplace else y


class SiluFwdOp(ElementwiseOp):
    fn = "silu"

    def torch_fn(self, x, inplace=False):
        return F.silu(x, inplace=inplace)


class MishFwdOp(ElementwiseOp):
    fn = "mish"

    def torch_fn(self, x, inplace=False):
        return F.mish(x, inplace=inplace)


class SoftplusFwdOp(ElementwiseOp):
    fn = "softplus"

    def torch_fn(self, x, inplace=False):
        y = F.softplus(x, self.beta, self.threshold)  # no in-place form in torch
        return x.copy_(y) if inplace else y


class LeakyReluFwdOp(ElementwiseOp):
    fn = "leaky_relu"

    def torch_fn(self, x, inplace=False):
        return F.leaky_relu(x, self.negative_slope, inplace=inplace)


class EluFwdOp(ElementwiseOp):
    fn = "elu"

    def torch_fn(self, x, inplace=False):
        return F.elu(x, self.alpha, inplace=inplace)


class SeluFwdOp(ElementwiseOp):
    fn = "selu"

    def torch_fn(self, x, inplace=False):
        return F.selu(x, inplace=inplace)


class HardswishFwdOp(ElementwiseOp):
    fn = "hardswish"

    def torch_fn(self, x, inplace=False):
        return F.hardswish(x, inplace=inplace)


class HardsigmoidFwdOp(ElementwiseOp):
    fn = "hardsigmoid"

    def torch_fn(self, x, inplace=False):
        return F.hardsigmoid(x, inplace=inplace)


class HardtanhFwdOp(ElementwiseOp):
    fn = "hardtanh"

    def torch_fn(self, x, inplace=False):
        return F.hardtanh(x, self.min_val, self.max_val, inplace=inplace)


class ClampFwdOp(ElementwiseOp):
    """Scalar bounds (``min``, ``max``) compile into the kernel (``clamp``); tensor bounds
    (``min_bound``, ``max_bound``) are operands of ``clamp_tensor``, an absent one passed as
    ``x`` itself under a flag that says it bounds nothing."""

    fn = "clamp"

    def constants(self) -> tuple:
        lo, hi = self.min, self.max
        return (0.0 if lo is None else float(lo), 0.0 if hi is None else float(hi),
                lo is not None, hi is not None)

    def forward(self, call, x, min_bound, max_bound, y) -> None:
        if min_bound is None and max_bound is None:
            self._launch(call, [x], (y,))
            return
        form = ("clamp_tensor", (min_bound is not None, max_bound is not None))
        self._launch(call, [x, x if min_bound is None else min_bound,
                            x if max_bound is None else max_bound], (y,), form)

    def torch_fn(self, x, min_bound=None, max_bound=None, inplace=False):
        if min_bound is not None or max_bound is not None:
            return torch.clamp(x, min_bound, max_bound, out=x if inplace else None)
        return torch.clamp_(x, self.min, self.max) if inplace else \
            torch.clamp(x, self.min, self.max)


# --- binary ops: broadcasting and torch's promotion -----------------------------------------


class BinaryOp(ElementwiseOp):
    """Base of the binary ops ``out = f(a, b)``: the shapes broadcast and the dtypes promote
    as the entry states (``broadcast(SA, SB)``, ``result_type(...)``); a 0-dim or
    one-element operand is read once per vector (stride 0)."""

    #: torch's function of two tensors
    binary: ClassVar[Any]

    def torch_fn(self, a, b, inplace=False):
        return type(self).binary(a, b)


def _alpha(alpha: float, a: torch.Tensor, b: torch.Tensor) -> float | int:
    """``alpha`` as torch takes it: an int for integral operands."""
    if not torch.result_type(a, b).is_floating_point and float(alpha).is_integer():
        return int(alpha)
    return alpha


class AddFwdOp(BinaryOp):
    fn = "add"

    def torch_fn(self, a, b, inplace=False):
        return torch.add(a, b, alpha=_alpha(self.alpha, a, b))


class SubFwdOp(BinaryOp):
    fn = "sub"

    def torch_fn(self, a, b, inplace=False):
        return torch.sub(a, b, alpha=_alpha(self.alpha, a, b))


class MulFwdOp(BinaryOp):
    fn = "mul"
    binary = torch.mul


class DivFwdOp(BinaryOp):
    def fn_name(self) -> str:
        return {None: "div", "trunc": "div_trunc", "floor": "div_floor"}[self.rounding_mode]

    def constants(self) -> tuple:
        return ()

    def torch_fn(self, a, b, inplace=False):
        return torch.div(a, b, rounding_mode=self.rounding_mode)


def _binary(name: str, fn: str, torch_fn: Any, doc: str) -> type[BinaryOp]:
    return type(name, (BinaryOp,), {"fn": fn, "binary": staticmethod(torch_fn), "__doc__": doc,
                                    "__module__": __name__, "__qualname__": name})


class PowFwdOp(BinaryOp):
    """``torch.pow``. The in-tree function computes in a floating dtype; an integer power
    (torch's exponentiation by squaring) is served by the ``reference`` target."""

    fn = "pow"
    binary = torch.pow

    def refuse_compute(self, compute: torch.dtype) -> None:
        if not compute.is_floating_point:
            name = NAMES.get(compute, str(compute))
            raise TypeError(f"{type(self).__name__}: the in-tree elementwise kernels compute "
                            f"pow in a floating dtype, not {name}; construct the op with "
                            f"target='reference' for an integer power")


MaximumFwdOp = _binary("MaximumFwdOp", "maximum", torch.maximum, "``torch.maximum``.")
MinimumFwdOp = _binary("MinimumFwdOp", "minimum", torch.minimum, "``torch.minimum``.")
RemainderFwdOp = _binary("RemainderFwdOp", "remainder", torch.remainder,
                         "``torch.remainder``.")
EqFwdOp = _binary("EqFwdOp", "eq", torch.eq, "``torch.eq``.")
NeFwdOp = _binary("NeFwdOp", "ne", torch.ne, "``torch.ne``.")
LtFwdOp = _binary("LtFwdOp", "lt", torch.lt, "``torch.lt``.")
LeFwdOp = _binary("LeFwdOp", "le", torch.le, "``torch.le``.")
GtFwdOp = _binary("GtFwdOp", "gt", torch.gt, "``torch.gt``.")
GeFwdOp = _binary("GeFwdOp", "ge", torch.ge, "``torch.ge``.")


class WhereFwdOp(ElementwiseOp):
    fn = "where"

    def torch_fn(self, cond, a, b, inplace=False):
        return torch.where(cond, a, b)


class MaskedFillFwdOp(ElementwiseOp):
    fn = "masked_fill"

    def torch_fn(self, x, mask, inplace=False):
        value = self.value
        if not x.is_floating_point() and float(value).is_integer():
            value = int(value)
        return x.masked_fill(mask, value)


class LerpFwdOp(ElementwiseOp):
    fn = "lerp"

    def torch_fn(self, start, end, weight, inplace=False):
        return torch.lerp(start, end, weight)


# --- gated activations ------------------------------------------------------------------------


class GatedOp(ElementwiseOp):
    """Base of the gated activations of one ``[*B, 2N]`` input (vLLM's layout: the gate,
    then the up projection): the two halves are handed to the kernel as strided views of
    ``x``, so the call reads ``x`` once and writes ``y``."""

    #: torch's activation of the gate
    act: ClassVar[Any]

    def forward(self, call, x, y) -> None:
        n = y.shape[-1]
        self._launch(call, [x[..., :n], x[..., n:]], (y,))

    def torch_fn(self, x, inplace=False):
        gate, up = x.chunk(2, dim=-1)
        return type(self).act(gate) * up


class SiluAndMulFwdOp(GatedOp):
    fn = "silu_and_mul"
    act = staticmethod(F.silu)


class GeluAndMulFwdOp(GatedOp):
    fn = "gelu_and_mul"
    act = staticmethod(F.gelu)


class GeluTanhAndMulFwdOp(GatedOp):
    fn = "gelu_tanh_and_mul"
    act = staticmethod(lambda t: F.gelu(t, approximate="tanh"))


class SwiGLUFwdOp(ElementwiseOp):
    """``silu(a) * b`` of two tensors (Liger-Kernel's convention)."""

    fn = "silu_and_mul"

    def torch_fn(self, a, b, inplace=False):
        return F.silu(a) * b

    peers = {"liger": lambda op: _liger_swiglu()}


def _liger_swiglu() -> Any:
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return LigerSiLUMulFunction.apply


# --- gradients ---------------------------------------------------------------------------------


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
    broadcast; where it was, into a buffer of ``dout``'s dtype that is then summed over the
    broadcast axes (torch's ``sum_to_size``, as torch's own autograd reduces). A leaf states
    each gradient as :meth:`grads`: ``(fn, constants, operands)`` per input, or None for a
    gradient that is zero."""

    def fn_name(self) -> str:
        return ""  # each gradient names its own function (grads)

    def constants(self) -> tuple:
        return ()

    def grads(self, dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple:
        raise NotImplementedError

    def derive(self) -> None:
        super().derive()
        #: the 0-dim constants the gradients multiply by, per (value, device, dtype)
        self._scalars: dict[tuple, torch.Tensor] = {}

    def _const(self, value: float, like: torch.Tensor) -> torch.Tensor:
        """A 0-dim ``value`` on ``like``'s device in its dtype, made once per instance."""
        key = (value, like.device, like.dtype)
        t = self._scalars.get(key)
        if t is None:
            t = torch.full((), value, dtype=like.dtype, device=like.device)
            with self._lock:
                self._scalars[key] = t
        return t

    def forward(self, call, dout, a, b, da, db) -> None:
        for g, form in zip((da, db), self.grads(dout, a, b), strict=True):
            if g is None:
                continue
            if form is None:
                g.zero_()
                continue
            fn, consts, operands = form
            if g.shape == dout.shape:
                self._launch(call, list(operands), (g,), (fn, consts))
            else:
                full = torch.empty(dout.shape, dtype=dout.dtype, device=dout.device)
                self._launch(call, list(operands), (full,), (fn, consts))
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
            if g is None:
                continue
            if g.shape == dout.shape:
                self._launch(call, list(ops), (g,), ("where", ()))
            else:
                full = torch.empty(dout.shape, dtype=dout.dtype, device=dout.device)
                self._launch(call, list(ops), (full,), ("where", ()))
                g.copy_(full.sum_to_size(g.shape))

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
            out = g if g.shape == shape else torch.empty(shape, dtype=dout.dtype, device=dev)
            self._launch(call, [mask, zero, w], (out,), ("where", ()))
            if out is not g:
                g.copy_(out.sum_to_size(g.shape))

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
            out = g if g.shape == shape else torch.empty(shape, dtype=dout.dtype, device=dev)
            self._launch(call, operands, (out,), ("mul", ()))
            if out is not g:
                g.copy_(out.sum_to_size(g.shape))

    def reference(self, call, dout, start, end, weight):
        return self.torch_fn(*[_wide(t) for t in (dout, start, end, weight)])

    def torch_fn(self, dout, start, end, weight, inplace=False):
        return (self._reduce(dout * (1 - weight) if self.grad_start else None, start),
                self._reduce(dout * weight if self.grad_end else None, end),
                self._reduce(dout * (end - start) if self.grad_weight else None, weight))


class ClampBwdOp(BinaryBwdOp):
    """``dx = dy`` where ``lo <= x <= hi`` (torch's clamp gradient: a bound passes at
    equality), else zero: one comparison launch per bound given (a number as a 0-dim
    constant, or the bound tensor), then ``where``s, the last written into ``dx``."""

    def forward(self, call, dy, x, min_bound, max_bound, dx) -> None:
        shape, dev = dy.shape, dy.device
        bounds = []
        for tensor, value, cmp in ((min_bound, self.min, "ge"), (max_bound, self.max, "le")):
            if tensor is not None or value is not None:
                bounds.append((cmp, tensor if tensor is not None else self._const(value, x)))
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
        return (torch.where(keep, dy, torch.zeros((), dtype=dy.dtype, device=dy.device)),)


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
                self._reduce(-dout * a / (b * b) if self.grad_b else None, b))
