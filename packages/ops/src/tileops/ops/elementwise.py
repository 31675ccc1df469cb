"""The elementwise family: unary math, activations, binary ops, gated activations, gradients.

Every op of the family is one scalar function of the kernels' generator
(:mod:`tileops.kernels.elementwise`): the op names it (:attr:`ElementwiseOp.fn`, or
:meth:`~ElementwiseOp.fn_name` where a param chooses it) and states its constants
(:meth:`~ElementwiseOp.constants`), and :class:`ElementwiseOp`, the family base, owns the call:

- the operands: the entry's input tensors in order (absent optional ones left out), and the
  outputs: fresh tensors of the broadcast shape laid out as torch's TensorIterator lays them
  out (:meth:`ElementwiseOp.output_layout`: contiguous for contiguous inputs, a transposed
  or permuted input's output in its memory order, which the kernels then read and write as
  one flat run), or, in place, the input object itself. A gated op hands over the two
  halves of ``x`` (``x[..., :N]`` and ``x[..., N:]``) as strided views, and its gradient
  the two halves of ``dx`` as outputs: nothing is copied.
- the cached call: one dict lookup keyed by what the kernel's plan depends on (the device,
  each operand's dtype, shape, strides and address alignment); on a miss the base builds the
  :class:`~tileops.kernels.elementwise.ElementwiseSpec` and the slot's entry.
- the compute dtype: torch's. The math runs in the promoted dtype of the operands (the
  output's, or for a comparison the operands' common one), float16 and bfloat16 widened to
  float32, as torch's own kernels compute.
- the refusals: a dtype the in-tree kernels do not serve (float64: the ``reference`` target
  serves it). An in-place write of a tensor whose elements share memory (an expanded view),
  which torch refuses too, is refused by the runtime for every op that writes an input.

The ops' references and eager functions are torch's own functions, stated once per leaf
(:meth:`ElementwiseOp.torch_fn`); a gradient's reference is torch's closed-form backward
(``aten.*_backward``), not autograd, since a reference may run inside a compiled graph's
custom op where autograd does not record. The base lives in ``_elementwise_base`` and the
gradients in ``_elementwise_grads``; this module exports the family.
"""

from __future__ import annotations

import numbers
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from tileops.runtime.fastpath import class_function
from tileops.runtime.memory import partially_overlap

from ._dtypes import NAMES
from ._elementwise_base import _HALF, ElementwiseOp, _wide, refuse_overflow
from ._elementwise_grads import (
    AbsBwdOp,
    AddBwdOp,
    BinaryBwdOp,
    ClampBwdOp,
    CosBwdOp,
    DivBwdOp,
    EluBwdOp,
    ErfBwdOp,
    ExpBwdOp,
    Expm1BwdOp,
    GatedBwdOp,
    GeluAndMulBwdOp,
    GeluBwdOp,
    GeluTanhAndMulBwdOp,
    HardsigmoidBwdOp,
    HardswishBwdOp,
    HardtanhBwdOp,
    LeakyReluBwdOp,
    LerpBwdOp,
    Log1pBwdOp,
    LogBwdOp,
    MaskedFillBwdOp,
    MaximumBwdOp,
    MinimumBwdOp,
    MishBwdOp,
    MulBwdOp,
    NegBwdOp,
    PowBwdOp,
    ReciprocalBwdOp,
    ReluBwdOp,
    RemainderBwdOp,
    RsqrtBwdOp,
    SeluBwdOp,
    SigmoidBwdOp,
    SiluAndMulBwdOp,
    SiluBwdOp,
    SinBwdOp,
    SoftplusBwdOp,
    SqrtBwdOp,
    SubBwdOp,
    SwiGLUBwdOp,
    TanhBwdOp,
    WhereBwdOp,
)

__all__ = [
    "AbsBwdOp", "AbsFwdOp", "AddBwdOp", "AddFwdOp", "BinaryBwdOp", "BinaryOp", "CeilFwdOp",
    "ClampBwdOp", "ClampFwdOp", "CosBwdOp", "CosFwdOp", "DivBwdOp", "DivFwdOp", "ElementwiseOp",
    "EluBwdOp", "EluFwdOp", "EqFwdOp", "ErfBwdOp", "ErfFwdOp", "ExpBwdOp", "ExpFwdOp",
    "Expm1BwdOp", "Expm1FwdOp", "FloorFwdOp", "GatedBwdOp", "GatedOp", "GeFwdOp",
    "GeluAndMulBwdOp", "GeluAndMulFwdOp", "GeluBwdOp", "GeluFwdOp", "GeluTanhAndMulBwdOp",
    "GeluTanhAndMulFwdOp", "GtFwdOp", "HardsigmoidBwdOp", "HardsigmoidFwdOp", "HardswishBwdOp",
    "HardswishFwdOp", "HardtanhBwdOp", "HardtanhFwdOp", "IsfiniteFwdOp", "IsinfFwdOp",
    "IsnanFwdOp", "LeFwdOp", "LeakyReluBwdOp", "LeakyReluFwdOp", "LerpBwdOp", "LerpFwdOp",
    "Log1pBwdOp", "Log1pFwdOp", "LogBwdOp", "LogFwdOp", "LtFwdOp", "MaskedFillBwdOp",
    "MaskedFillFwdOp", "MaximumBwdOp", "MaximumFwdOp", "MinimumBwdOp", "MinimumFwdOp", "MishBwdOp",
    "MishFwdOp", "MulBwdOp", "MulFwdOp", "NeFwdOp", "NegBwdOp", "NegFwdOp", "PowBwdOp", "PowFwdOp",
    "ReciprocalBwdOp", "ReciprocalFwdOp", "ReluBwdOp", "ReluFwdOp", "RemainderBwdOp",
    "RemainderFwdOp", "RoundFwdOp", "RsqrtBwdOp", "RsqrtFwdOp", "SeluBwdOp", "SeluFwdOp",
    "SigmoidBwdOp", "SigmoidFwdOp", "SignFwdOp", "SiluAndMulBwdOp", "SiluAndMulFwdOp", "SiluBwdOp",
    "SiluFwdOp", "SinBwdOp", "SinFwdOp", "SoftplusBwdOp", "SoftplusFwdOp", "SqrtBwdOp",
    "SqrtFwdOp", "StepBwdOp", "SubBwdOp", "SubFwdOp", "SwiGLUBwdOp", "SwiGLUFwdOp", "TanhBwdOp", "TanhFwdOp",
    "TruncFwdOp", "WhereBwdOp", "WhereFwdOp",
]


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


class StepBwdOp(ElementwiseOp):
    """The gradient of the step functions (sign, floor, ceil, round, trunc): zero everywhere,
    as torch's (``zeros_like(grad)``); ``dy`` is read for its shape only (the spec's
    ``shape_only``), so the call is a fill of ``dx``."""

    fn = "mul"  # no kernel runs: the gradient is a fill

    def output_layout(self, inputs: tuple, shape: tuple) -> tuple[int, ...] | None:
        return None  # dx contiguous whatever dy's strides (an expanded dy included)

    def forward(self, call, dy, dx) -> None:
        dx.zero_()

    def torch_fn(self, dy, inplace=False):
        return torch.zeros(dy.shape, dtype=dy.dtype, device=dy.device)


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
        # torch's gelu has no in-place form: written back (from a copy where autograd saves it)
        y = F.gelu(_saved_copy(x) if inplace else x, approximate=self.approximate)
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
        # no in-place form in torch: written back (from a copy where autograd saves it)
        y = F.softplus(_saved_copy(x) if inplace else x, self.beta, self.threshold)
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

    def refuse_params(self, ins: list) -> None:
        for name in ("min_val", "max_val"):
            refuse_overflow(self, f"param {name}", getattr(self, name), ins[0].dtype,
                            converts=True)

    def torch_fn(self, x, inplace=False):
        return F.hardtanh(x, self.min_val, self.max_val, inplace=inplace)


def _saved_copy(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it where autograd would save it for a function whose result is then
    written back into ``x`` (the in-place form of a function torch has none of): the write
    would change what the function's gradient reads."""
    return x.clone() if x.requires_grad and torch.is_grad_enabled() else x


def _number_operand(op: Any, name: str, value: Any, other: torch.Tensor,
                    device: torch.device, widen: bool, keep_int: bool,
                    dims: bool) -> torch.Tensor:
    """The number ``value`` as the 0-dim tensor that gives torch's result beside ``other``,
    the tensor operand (where there is none, a 0-dim tensor of the first number); ``dims``:
    a tensor operand whose rank counts in the result's dtype has dims (a 0-dim number tensor
    then counts by its category only, as torch counts a number):

    - a bool stays bool, the lowest category (so an op refusing bools refuses it too);
    - an int is held exactly in int64 with ``dims`` (they then keep the tensor's dtype; and
      with ``keep_int``, for a true division computed in floats); else it takes torch's
      result dtype, wrapping as torch's cast does (-1 beside uint8 is 255);
    - a float takes the tensor's dtype if floating, else torch's default
      (``torch.get_default_dtype()`` at the call, a float16 default included); beside a
      float16 or bfloat16 tensor, with ``dims`` and ``widen``, it is held in float32, the
      precision torch's arithmetic kernels take a scalar in (the dims still give the result
      the tensor's dtype), where a comparison rounds it to the tensor's dtype first, as torch
      compares. A call of 0-dim tensors only gets ``dims`` by viewing them with one dim
      (:class:`TakesNumbers`)."""
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{type(op).__name__}: argument {name} is the number {value!r} of type "
                        f"{type(value).__name__}; expected a tensor, or a real number "
                        f"(bool, int or float)")
    if isinstance(value, bool):
        return torch.tensor(value, device=device)
    if isinstance(value, numbers.Integral) and not -2**63 <= int(value) < 2**63:
        # past int64: beside a floating tensor torch takes it as a float (as a float
        # operand is taken); beside integers it has no int64 to be held in
        if not other.dtype.is_floating_point:
            raise RuntimeError(
                f"{type(op).__name__}: argument {name} is an int of {int(value).bit_length()} "
                f"bits; beside a {str(other.dtype).removeprefix('torch.')} tensor it is held "
                f"in int64, which it does not fit (torch refuses it too); pass a float or a "
                f"tensor")
        try:
            value = float(value)
        except OverflowError:
            raise RuntimeError(
                f"{type(op).__name__}: argument {name} is an int of {int(value).bit_length()} "
                f"bits, past the largest float (about 1.8e308)") from None
    if isinstance(value, numbers.Integral):
        exact = torch.tensor(int(value), dtype=torch.int64, device=device)
        if dims or keep_int:
            return exact
        return exact.to(torch.int64 if other.dtype == torch.bool else other.dtype)
    # torch.result_type(other, value), written out so that tracing folds it; beside integers
    # the number's dtype is the result's (a float16 default stays float16)
    if not other.dtype.is_floating_point:
        return torch.tensor(float(value), dtype=torch.get_default_dtype(), device=device)
    dtype = other.dtype
    if widen and dims and dtype in _HALF:
        dtype = torch.float32
    return torch.tensor(float(value), dtype=dtype, device=device)


def _takes_dtype_of(number: Any, t: torch.Tensor) -> bool:
    """Whether the Python ``number`` is converted to ``t``'s dtype beside it (torch's
    promotion, written out so that tracing folds it): a real number beside a floating tensor,
    an integer beside an integer one; a bool, or a float beside integers, is not."""
    if not _is_number(number) or isinstance(number, bool) or not isinstance(number, numbers.Real):
        return False
    if t.is_floating_point():
        return True
    return isinstance(number, numbers.Integral) and t.dtype is not torch.bool


def _is_number(value: Any) -> bool:
    # a tensor first: the call of tensors pays one C-level isinstance an operand
    return not isinstance(value, torch.Tensor) and isinstance(value, numbers.Number)


class TakesNumbers:
    """Mixin of the ops whose torch function takes a Python number for some operands
    (``torch.add(x, 1)``, ``torch.where(c, x, 0.0)``): :attr:`number_inputs` names them. A
    call with a number there runs with it as a 0-dim tensor on the tensors' device
    (:func:`_number_operand`) through the general call, the entry's check seeing tensors only;
    a call of tensors goes straight to the call the runtime generates for the class (built
    with the first instance, not on a traced call). At least one operand must be a tensor, as
    in torch."""

    #: the inputs that may be Python numbers (none: the class takes tensors only)
    number_inputs: ClassVar[tuple[str, ...]] = ()
    #: whether a number beside a 16-bit float tensor is held in float32 (arithmetic), or
    #: rounded to the tensor's dtype (a comparison)
    numbers_widen: ClassVar[bool] = True
    #: the input a number is made beside (its dtype and dims), or None: the first tensor
    #: among :attr:`number_inputs`, else a 0-dim tensor of the first number
    numbers_beside: ClassVar[str | None] = None
    #: whether a number is taken as a float whatever its type (lerp's weight: torch's
    #: ``lerp(a, b, 1)`` and ``lerp(a, b, True)`` weigh by 1.0)
    numbers_as_float: ClassVar[bool] = False
    #: the inputs whose ranks count in the result's dtype beside a number (None: the
    #: :attr:`number_inputs`): where none of them has dims, a number beside a 16-bit float
    #: is held in float32 all the same, the 0-dim tensors viewed with one dim for the call
    #: (so that the number's 0-dim float32 counts by its category only, as torch counts a
    #: number) and the result viewed back to 0-dim
    numbers_ranked: ClassVar[tuple[str, ...] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # set before Op's hook runs, which then generates no __call__ of its own
        if cls.number_inputs:
            cls.__call__ = TakesNumbers._call_with_numbers  # type: ignore[method-assign]
        super().__init_subclass__(**kwargs)

    def derive(self) -> None:
        super().derive()  # type: ignore[misc]
        cls = type(self)
        if cls.number_inputs and "_tensor_call" not in cls.__dict__:
            type.__setattr__(cls, "_tensor_call",
                             class_function(cls._signature))  # type: ignore[attr-defined]

    def refuse_numbers(self, given: dict[str, Any]) -> None:
        """Refuse, by name, a number torch's function refuses for its value (a leaf's hook;
        ``given`` maps the call's inputs to what was passed); the default refuses none."""

    def number_widens(self, name: str) -> bool:
        """Whether a number given as input ``name`` beside a 16-bit float tensor is held in
        float32 or rounded to the tensor's dtype (:attr:`numbers_widen`, unless an op's torch
        kernel takes its operands apart: a rounding division's)."""
        return type(self).numbers_widen

    def numbers_keep_ints(self) -> bool:
        """Whether an integer number is held exactly (int64) beside a 0-dim tensor too: where
        the op computes in floats whatever its integer operands (a true division)."""
        return False

    def _call_with_numbers(self, *args: Any, **kwargs: Any) -> Any:
        for a in args:  # the hot path: a loop of C-level isinstance, no call a tensor
            if not isinstance(a, torch.Tensor) and isinstance(a, numbers.Number):
                break
        else:
            if not kwargs or not any(map(_is_number, kwargs.values())):
                return type(self)._tensor_call(self, *args, **kwargs)  # type: ignore[attr-defined]
        cls = type(self)
        names = cls._signature.input_names  # type: ignore[attr-defined]
        # (too many or too few positional arguments: the general call refuses them by name)
        given = [*zip(names, args, strict=False),
                 *((k, v) for k, v in kwargs.items() if k in names)]
        tensors = [v for _, v in given if isinstance(v, torch.Tensor)]
        numbers_at = [n for n, v in given if _is_number(v)]
        refused = [n for n in numbers_at if n not in cls.number_inputs]
        if refused:
            raise TypeError(f"{cls.__name__}: argument {refused[0]} is the number "
                            f"{dict(given)[refused[0]]!r}; expected a tensor (only "
                            f"{' and '.join(cls.number_inputs)} may be numbers)")
        if not tensors:
            said = (f"argument {numbers_at[0]} is a number" if len(numbers_at) == 1 else
                    f"arguments {' and '.join(numbers_at)} are all numbers")
            raise TypeError(f"{cls.__name__}: {said}; expected at least one tensor operand, as "
                            f"torch's function does")
        named = dict(given)
        self.refuse_numbers(named)
        # the tensor beside the numbers (a, or b, of a binary op); for where's two numbers a
        # 0-dim tensor of the first, so that they promote as torch's 0-dim tensors of them
        beside = [v for n, v in given if n in cls.number_inputs and isinstance(v, torch.Tensor)]
        if isinstance(named.get(cls.numbers_beside), torch.Tensor):
            beside = [named[cls.numbers_beside]]
        other = beside[0] if beside else torch.tensor(named[numbers_at[0]])
        ranked = [v for n, v in given if n in (cls.numbers_ranked or cls.number_inputs)
                  and isinstance(v, torch.Tensor)]
        dims = any(t.dim() for t in ranked)
        lifted: frozenset[str] = frozenset()
        if not dims and any(map(self.number_widens, numbers_at)) and other.dtype in _HALF and \
                ranked and \
                not any(k in cls._signature.output_names for k in kwargs):  # type: ignore[attr-defined]
            lifted, dims = frozenset(n for n, v in given if any(v is t for t in ranked)), True
        device, keep_ints = tensors[0].device, self.numbers_keep_ints()

        def operand(n: str, v: Any) -> Any:
            if not _is_number(v):
                return v.reshape(1) if n in lifted else v
            if cls.numbers_as_float and isinstance(v, numbers.Real):
                v = float(v)
            return _number_operand(self, n, v, other, device, self.number_widens(n),
                                   keep_ints, dims)

        args = tuple(operand(n, v) for n, v in zip(names, args, strict=False)) + \
            args[len(names):]
        kwargs = {k: operand(k, v) for k, v in kwargs.items()}
        out = self._result(self._general_call(args, kwargs))  # type: ignore[attr-defined]
        if lifted and not any(t.dim() for t in tensors):  # torch's result is 0-dim
            return out.reshape(())
        return out


class ClampFwdOp(ElementwiseOp):
    """Scalar bounds (``min``, ``max``) compile into the kernel (``clamp``); tensor bounds
    (``min_bound``, ``max_bound``) are operands of ``clamp_tensor``, an absent one passed as
    ``x`` itself under a flag that says it bounds nothing, and a number bound beside a tensor
    one as a 0-dim tensor of y's dtype, expanded. A tensor bound broadcasts to x's shape, as
    the entry states (``expands_to``): the kernel reads its expanded view, a broadcast axis
    with stride 0, not a copy.

    y's dtype is the entry's ``R``: torch's promotion of x, the tensor bounds and the numbers
    (an int32 x beside ``min=1`` stays int32, beside ``min=0.5`` is float32, beside a float32
    tensor bound too); every operand is taken into it (the kernels cast on load and compute in
    it, float16 and bfloat16 through float32), so the bounds compare as torch compares them.
    In place, y is x and ``R`` may be wider than x's dtype (an int16 of a uint8 x beside an
    int8 bound): the result is computed in ``R`` and cast into x, as torch casts it."""

    fn = "clamp"

    def derive(self) -> None:
        super().derive()
        #: the result dtypes the number bounds were checked against (once each)
        self._numbers_fit: set[torch.dtype] = set()
        #: the entry's R of a call: y's dtype, but for one in place, which is x's
        self._result = self.index_reader("R")

    def constants(self) -> tuple:
        lo, hi = self.min, self.max
        return (0.0 if lo is None else float(lo), 0.0 if hi is None else float(hi),
                lo is not None, hi is not None)

    def refuse_params(self, ins: list) -> None:
        """None here: the number bounds are checked against y's dtype (:meth:`_refuse_numbers`),
        which the operands alone do not give."""

    def _refuse_numbers(self, dtype: torch.dtype) -> None:
        """Refuse a number bound that y's ``dtype`` cannot hold, as torch refuses to convert
        it (300 beside int8; -1 beside uint8, which torch wraps, by name)."""
        if dtype in self._numbers_fit:
            return
        for name in ("min", "max"):
            refuse_overflow(self, f"param {name}", getattr(self, name), dtype)
        self._numbers_fit.add(dtype)

    def _refuse_overlap(self, x: torch.Tensor, min_bound: Any, max_bound: Any) -> None:
        """In place, a bound sharing part of x's memory is refused, as torch refuses it: the
        result would depend on the order of the writes."""
        if not self.inplace:
            return
        for name, bound in (("min_bound", min_bound), ("max_bound", max_bound)):
            if bound is not None and partially_overlap(x, bound):
                raise RuntimeError(
                    f"{self!r}: x is written in place and shares memory with {name} "
                    f"(overlapping views of one storage), so the result would depend on the "
                    f"order of the writes, as torch refuses it too; pass a copy of {name} "
                    f"(.clone())")

    def forward(self, call, x, min_bound, max_bound, y) -> None:
        self._refuse_overlap(x, min_bound, max_bound)
        out = y
        if self.inplace:
            dtype = self._result(call)[0]
            if dtype != y.dtype:  # torch computes in R and casts into x (int16 into uint8)
                out = torch.empty(y.shape, dtype=dtype, device=y.device)
        self._refuse_numbers(out.dtype)
        if min_bound is None and max_bound is None:
            self._launch(call, [x], (out,))
        else:
            lo = (min_bound.expand(x.shape) if min_bound is not None
                  else self._bound(self.min, out))
            hi = (max_bound.expand(x.shape) if max_bound is not None
                  else self._bound(self.max, out))
            form = ("clamp_tensor", (lo is not None, hi is not None))
            self._launch(call, [x, x if lo is None else lo, x if hi is None else hi], (out,),
                         form)
        if out is not y:
            y.copy_(out)

    @staticmethod
    def _bound(value: Any, y: torch.Tensor) -> torch.Tensor | None:
        """A number bound beside a tensor bound: a 0-dim tensor of y's dtype, expanded."""
        if value is None:
            return None
        return torch.full((), value, dtype=y.dtype, device=y.device).expand(y.shape)

    def reference(self, call, x, min_bound, max_bound):
        self._refuse_overlap(x, min_bound, max_bound)
        dtype = self._result(call)[0]  # (in place, the target casts it into x)
        self._refuse_numbers(dtype)

        def taken(t):  # an operand in y's dtype, computed in float32 where that is 16-bit
            return None if t is None else _wide(t.to(dtype))

        return (self.torch_fn(taken(x), taken(min_bound), taken(max_bound)),)

    def torch_fn(self, x, min_bound=None, max_bound=None, inplace=False):
        if min_bound is None and max_bound is None:
            return torch.clamp_(x, self.min, self.max) if inplace else \
                torch.clamp(x, self.min, self.max)
        if (self.min is None or min_bound is not None) and \
                (self.max is None or max_bound is not None):  # torch's tensor form
            return torch.clamp_(x, min_bound, max_bound) if inplace else \
                torch.clamp(x, min_bound, max_bound)
        # a bound of each spelling (torch.clamp takes two numbers or two tensors): the number
        # as a 0-dim tensor of the dtype torch's promotion of all four gives, then its
        # tensor form
        dtype = _promoted(x, min_bound, max_bound, self.min, self.max)

        def bound(tensor, value):
            if tensor is not None:
                return tensor.to(dtype)
            return None if value is None else torch.full((), value, dtype=dtype,
                                                         device=x.device)

        lo, hi = bound(min_bound, self.min), bound(max_bound, self.max)
        if inplace:
            return torch.clamp_(x, lo, hi)
        return torch.clamp(x.to(dtype), lo, hi)


def _promoted(*operands: Any) -> torch.dtype:
    """torch's result dtype of tensors and Python numbers (None: absent), as its elementwise
    ops promote them (a number counts only where its category is higher, below a 0-dim
    tensor)."""
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

    given = [o for o in operands if o is not None]
    return elementwise_dtypes(*given,
                              type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]


# --- binary ops: broadcasting and torch's promotion -----------------------------------------


class BinaryOp(TakesNumbers, ElementwiseOp):
    """Base of the binary ops ``out = f(a, b)``: the shapes broadcast and the dtypes promote
    as the entry states (``broadcast(SA, SB)``, ``result_type(...)``); a 0-dim or
    one-element operand is read once per vector (stride 0). Either operand may be a Python
    number, as in torch (:class:`TakesNumbers`), except for maximum and minimum, whose torch
    functions take tensors only."""

    #: torch's function of two tensors
    binary: ClassVar[Any]
    number_inputs = ("a", "b")

    def reference(self, call: Any, *inputs: Any) -> tuple:
        try:
            return super().reference(call, *inputs)
        except RuntimeError as exc:  # torch's integer division by zero names nothing
            if str(exc) != "ZeroDivisionError":
                raise
            raise ZeroDivisionError(
                f"{type(self).__name__}: integer division by zero (b holds a 0 and the "
                f"quotient is an integer), which has no value") from None

    def torch_fn(self, a, b, inplace=False):
        return type(self).binary(a, b)


def _refuse_fractional_alpha(op: Any, ins: list) -> None:
    """An integer sum or difference scales by an integer: a fractional ``alpha`` beside
    integer operands is refused by name, as torch refuses a floating one, and so is one the
    result's integer dtype cannot hold (torch converts it: 1000 has no int8)."""
    alpha = op.alpha
    if len(ins) < 2:
        return
    common = torch.result_type(ins[0], ins[1])
    if float(alpha).is_integer():
        if not common.is_floating_point:
            refuse_overflow(op, "param alpha", int(alpha), common)
        return
    if not common.is_floating_point:
        raise RuntimeError(f"{type(op).__name__}: param alpha is {alpha!r} and the operands "
                           f"are {NAMES.get(common, common)}; an integer result cannot scale by "
                           f"a fraction (torch refuses a floating alpha for integral inputs)")


def _alpha(alpha: float, a: torch.Tensor, b: torch.Tensor) -> float | int:
    """``alpha`` as torch takes it: an int for integral operands."""
    if not torch.result_type(a, b).is_floating_point and float(alpha).is_integer():
        return int(alpha)
    return alpha


class AddFwdOp(BinaryOp):
    fn = "add"

    def refuse_params(self, ins: list) -> None:
        _refuse_fractional_alpha(self, ins)

    def torch_fn(self, a, b, inplace=False):
        return torch.add(a, b, alpha=_alpha(self.alpha, a, b))


class SubFwdOp(BinaryOp):
    fn = "sub"

    def refuse_params(self, ins: list) -> None:
        _refuse_fractional_alpha(self, ins)

    def torch_fn(self, a, b, inplace=False):
        return torch.sub(a, b, alpha=_alpha(self.alpha, a, b))


class MulFwdOp(BinaryOp):
    fn = "mul"
    binary = torch.mul


class DivFwdOp(BinaryOp):
    """``torch.div``. With ``rounding_mode`` ``'trunc'`` or ``'floor'`` a number or 0-dim
    numerator beside a 16-bit float tensor is first rounded to that tensor's dtype, while a
    number or 0-dim divisor keeps its precision, as torch's kernels take them (the numerator
    as the dtype's value, the divisor's reciprocal in float32); the quotient is truncated or
    floored in float32, the float32 result (torch's 16-bit trunc rounds the quotient to the
    dtype first, and its CPU floor rounds each step, which may move a result by one)."""

    def numbers_keep_ints(self) -> bool:
        return self.rounding_mode is None

    @property
    def rounds_operands(self) -> bool:  # type: ignore[override]
        return self.rounding_mode is not None

    @property
    def reference_widens(self) -> frozenset[str]:  # type: ignore[override]
        # the float64 reference sees a rounded numerator as called
        return frozenset({"a", "b"}) if self.rounding_mode is not None else frozenset()

    def rounds_operand(self, i: int) -> bool:
        return i == 0

    def number_widens(self, name: str) -> bool:
        return self.rounding_mode is None or name != "a"

    def fn_name(self) -> str:
        return {None: "div", "trunc": "div_trunc", "floor": "div_floor"}[self.rounding_mode]

    def constants(self) -> tuple:
        return ()

    def refuse_params(self, ins: list) -> None:
        if self.rounding_mode is not None:
            _refuse_bool(self, ins, f"division with rounding_mode={self.rounding_mode!r}")

    def torch_fn(self, a, b, inplace=False):
        return torch.div(a, b, rounding_mode=self.rounding_mode)


def _refuse_bool(op: Any, ins: list, what: str) -> None:
    """Refuse, by name, operands whose common dtype is bool where torch's kernel has no bool
    form ("not implemented for 'Bool'")."""
    if len(ins) == 2 and torch.result_type(ins[0], ins[1]) is torch.bool:
        raise TypeError(f"{type(op).__name__}: a and b are bool, and {what} has no bool form "
                        f"(torch refuses it too); pass integer or floating operands")


def _binary(name: str, fn: str, torch_fn: Any, doc: str, numbers: bool = True,
            widen: bool = True, rounds: bool = False) -> type[BinaryOp]:
    """A binary leaf; ``rounds``: its operands are converted to their common dtype first
    (:attr:`~ElementwiseOp.rounds_operands`), so its float64 reference sees them as called."""
    return type(name, (BinaryOp,), {"fn": fn, "binary": staticmethod(torch_fn), "__doc__": doc,
                                    "__module__": __name__, "__qualname__": name,
                                    "number_inputs": ("a", "b") if numbers else (),
                                    "numbers_widen": widen, "rounds_operands": rounds,
                                    "reference_widens": frozenset({"a", "b"}) if rounds
                                    else frozenset()})


class PowFwdOp(BinaryOp):
    """``torch.pow``. The in-tree function computes in a floating dtype; an integer power
    (torch's exponentiation by squaring) is served by the ``reference`` target."""

    fn = "pow"
    binary = torch.pow
    # torch's pow takes every operand in the common dtype (a number or 0-dim exponent 1e-8
    # beside float16 is 0 there, so x ** 1e-8 is 1), and so does the in-tree function
    numbers_widen = False
    rounds_operands = True
    reference_widens = frozenset({"a", "b"})  # the float64 reference sees them as called

    def refuse_params(self, ins: list) -> None:
        _refuse_bool(self, ins, "pow")

    def refuse_numbers(self, given: dict[str, Any]) -> None:
        a, b = given.get("a"), given.get("b")
        if isinstance(a, torch.Tensor) and _takes_dtype_of(b, a):
            refuse_overflow(self, "argument b", b, a.dtype)  # an exponent of a's dtype
        if isinstance(a, torch.Tensor) and not a.is_floating_point() and \
                isinstance(b, numbers.Integral) and not isinstance(b, bool) and b < 0:
            raise RuntimeError(f"{type(self).__name__}: argument b is the negative integer {b} "
                               f"and a is {NAMES.get(a.dtype, a.dtype)}; an integer to a "
                               f"negative integer power is not an integer (torch refuses it "
                               f"too); pass a floating a or b")

    def refuse_compute(self, compute: torch.dtype) -> None:
        if not compute.is_floating_point:
            name = NAMES.get(compute, str(compute))
            raise TypeError(f"{type(self).__name__}: the in-tree elementwise kernels compute "
                            f"pow in a floating dtype, not {name}; construct the op with "
                            f"target='reference' for an integer power")


MaximumFwdOp = _binary("MaximumFwdOp", "maximum", torch.maximum, "``torch.maximum``.",
                       numbers=False)
MinimumFwdOp = _binary("MinimumFwdOp", "minimum", torch.minimum, "``torch.minimum``.",
                       numbers=False)
RemainderFwdOp = _binary("RemainderFwdOp", "remainder", torch.remainder,
                         "``torch.remainder``: the operands converted to their common dtype "
                         "first (a number or a 0-dim float32 beside float16 rounded to it), as "
                         "torch's kernel takes them, then the math in float32.", widen=False,
                         rounds=True)


def _comparison(name: str) -> type[BinaryOp]:
    """``torch.<name>``: the operands converted to their common dtype first (a number, a 0-dim
    float32 or an int 2049 beside float16 rounded to it), as torch compares."""
    return _binary(f"{name.capitalize()}FwdOp", name, getattr(torch, name),
                   f"``torch.{name}``.", widen=False, rounds=True)


EqFwdOp, NeFwdOp, LtFwdOp, LeFwdOp, GtFwdOp, GeFwdOp = (
    _comparison(n) for n in ("eq", "ne", "lt", "le", "gt", "ge"))


class WhereFwdOp(TakesNumbers, ElementwiseOp):
    """``torch.where``: ``a`` and ``b`` may be Python numbers (:class:`TakesNumbers`); an
    integer number beside an integer tensor must fit its dtype, as torch checks."""

    fn = "where"
    number_inputs = ("a", "b")

    def refuse_numbers(self, given: dict[str, Any]) -> None:
        a, b = given.get("a"), given.get("b")
        for name, number, other in (("a", a, b), ("b", b, a)):
            if isinstance(other, torch.Tensor) and not other.is_floating_point() and \
                    _takes_dtype_of(number, other):
                refuse_overflow(self, f"argument {name}", number, other.dtype)

    def torch_fn(self, cond, a, b, inplace=False):
        return torch.where(cond, a, b)


class MaskedFillFwdOp(ElementwiseOp):
    fn = "masked_fill"

    def output_layout(self, inputs: tuple, shape: tuple) -> tuple[int, ...] | None:
        return None  # torch's masked_fill clones x contiguous, whatever x's layout

    def refuse_params(self, ins: list) -> None:
        refuse_overflow(self, "param value", self.value, ins[0].dtype, converts=True)

    def torch_fn(self, x, mask, inplace=False):
        value = self.value
        if not x.is_floating_point() and float(value).is_integer():
            value = int(value)
        return x.masked_fill(mask, value)


class LerpFwdOp(TakesNumbers, ElementwiseOp):
    """``torch.lerp``: the weight may be a Python number (:class:`TakesNumbers`), held in
    float32 beside a 16-bit ``start``, as torch's lerp takes a number (a 0-dim weight of
    another floating dtype is read in its own, as the entry states)."""

    fn = "lerp"
    number_inputs = ("weight",)
    numbers_beside = "start"
    numbers_ranked = ("start", "end")
    numbers_as_float = True

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
        # the halves by one chunk call (about 2 us of host time, against 3 for two slices):
        # two views of N each, the spec holding the last axis at 2N with N > 0
        self._launch(call, list(x.chunk(2, -1)), (y,))

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
