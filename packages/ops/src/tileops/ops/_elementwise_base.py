"""The elementwise family's base, :class:`ElementwiseOp` (see :mod:`tileops.ops.elementwise`
for what it owns), and the helpers the forward ops and the gradients share."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from tileops.kernels import elementwise as _k
from tileops.runtime import Op
from tileops.runtime.memory import is_dense, keepable

from ._dtypes import NAMES, refuse_unserved

__all__ = ["MAX_CONSTS", "ElementwiseOp", "refuse_overflow"]

#: the 0-dim constants an elementwise op keeps (ones, scales, counts) before it starts over
MAX_CONSTS = 64

#: the storage dtypes the generator's call spec states it serves
_SERVED = _k.DTYPES_SERVED
_HALF = (torch.float16, torch.bfloat16)
#: the integer dtypes whose values a 16-bit float does not all hold (torch casts an operand to
#: the common dtype before its math: an int32 beside a float16 is rounded to float16 first)
_WIDE_INTS = frozenset({torch.int16, torch.int32, torch.int64})
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


def refuse_overflow(op: Any, name: str, value: Any, dtype: torch.dtype,
                    converts: bool = False) -> None:
    """Refuse, by name, a number ``dtype`` cannot hold, as torch's scalar conversion refuses it
    ("value cannot be converted to type ... without overflow"): an integer outside an integer
    dtype's range, a finite float past a floating dtype's largest value. A bool, None, a
    float beside an integer dtype (it promotes) and an infinity or NaN pass, unless
    ``converts``: the number is converted to an integer ``dtype`` (masked_fill's value,
    hardtanh's bounds, an integer sum's alpha), where an infinity or NaN has no value either."""
    if value is None or isinstance(value, bool) or dtype is torch.bool:
        return
    if converts and not dtype.is_floating_point and isinstance(value, float) and \
            (value != value or abs(value) == float("inf")):
        raise RuntimeError(f"{type(op).__name__}: {name} is {value!r}, which "
                           f"{NAMES.get(dtype, dtype)} cannot hold; torch refuses to convert it "
                           f"(value cannot be converted without overflow)")
    if dtype.is_floating_point:
        try:
            v = float(value)
        except OverflowError:  # an int past every float: past this dtype's largest too
            v = None
        if v is None or (v == v and abs(v) != float("inf") and abs(v) > torch.finfo(dtype).max):
            lo, hi = -torch.finfo(dtype).max, torch.finfo(dtype).max
        else:
            return
    elif isinstance(value, int):
        info = torch.iinfo(dtype)
        if info.min <= value <= info.max:
            return
        if info.min == 0 and -info.max <= value < 0:
            # torch's checked conversion lets a negative number wrap into an unsigned dtype
            # (-1 beside uint8 is 255); the in-tree kernels take the bound as written
            raise RuntimeError(
                f"{type(op).__name__}: {name} is {value!r} beside "
                f"{NAMES.get(dtype, dtype)}, which torch wraps to {value % (info.max + 1)}; "
                f"pass {value % (info.max + 1)} (a negative number is not taken into an "
                f"unsigned dtype here)")
        lo, hi = info.min, info.max
    elif isinstance(value, float) and value.is_integer():
        return refuse_overflow(op, name, int(value), dtype)
    else:
        return
    raise RuntimeError(f"{type(op).__name__}: {name} is {value!r}, outside the values "
                       f"{NAMES.get(dtype, dtype)} holds ([{lo:g}, {hi:g}]); torch refuses to "
                       f"convert it (value cannot be converted without overflow)")


def _noop(*tensors: Any) -> None:
    """The entry of an empty call: nothing to read or write."""


def torch_layout(inputs: tuple, shape: tuple) -> tuple[int, ...] | None:
    """The strides torch's TensorIterator gives a fresh output of ``shape`` computed from
    ``inputs`` (None: contiguous). Inputs of ``shape`` that share the strides of a
    non-overlapping and dense tensor hand them on (its fast setup); otherwise the dims are
    ordered by the inputs' strides, the first input that tells two dims apart deciding
    (broadcast dims tell nothing; equal strides put the smaller extent inner), and the output
    is contiguous in that order (``reorder_dimensions``). A transposed input gives a
    transposed output; a contiguous first input a contiguous one. Inputs that do not
    broadcast to ``shape`` (a gated op's ``[*B, 2N]``, a gradient's larger ``dout``) take no
    part.

    torch states the same rule in Python as ``torch._prims_common.
    compute_elementwise_output_strides``, which the tests hold this to wherever an input is
    not contiguous (the only calls the ops make): it is private, wants its operands expanded
    to one shape first, and took 24 us a call against 7 here. Where every input is contiguous
    the answer is contiguous without a look, on the ops' common path; torch differs there
    only for inputs whose extent-1 dims carry permuted strides (``[1, 2, 1]`` strided
    ``(1, 1, 1)`` plus ``[2, 1, 1]`` strided ``(1, 2, 2)``: torch's output is column-major)."""
    nd = len(shape)
    ts = [t for t in inputs if isinstance(t, torch.Tensor)]
    if nd < 2 or all(t.is_contiguous() for t in ts):
        return None
    ts = [t for t in ts if t.dim() <= nd and all(
        n in (1, o) for n, o in zip(reversed(t.shape), reversed(shape), strict=False))]
    if not ts:
        return None
    if all(tuple(t.shape) == tuple(shape) for t in ts):
        first = ts[0].stride()
        if all(t.stride() == first for t in ts) and is_dense(shape, first):
            return tuple(first)
    ops = [_expanded_strides(t, shape) for t in ts]

    def should_swap(d0: int, d1: int) -> int:
        for st in ops:
            s0, s1 = st[d0], st[d1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(reversed(range(nd)))  # innermost first
    for i in range(1, nd):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    if perm == list(reversed(range(nd))):
        return None
    strides = [0] * nd
    step = 1
    for d in perm:
        strides[d] = step
        step *= shape[d]
    return tuple(strides)


def _expanded_strides(t: torch.Tensor, shape: tuple) -> tuple[int, ...]:
    """``t.expand(shape).stride()`` without the view (torch's ``inferExpandGeometry``): a dim
    of extent 1 broadcast to more is 0, and a new leading dim takes the extent times the
    stride of the dim after it (so one of extent 1 still orders the dims, as in torch); a
    0-dim tensor's are all 0."""
    nd, tdim = len(shape), t.dim()
    if tdim == 0:  # a scalar expands with no stride at all
        return (0,) * nd
    sizes, strides = t.shape, t.stride()
    out = [0] * nd
    for i in range(nd - 1, -1, -1):
        dim = tdim - nd + i
        if dim >= 0:
            size, stride = sizes[dim], strides[dim]
        else:
            size, stride = 1, (shape[i + 1] * out[i + 1] if i + 1 < nd else 1)
        out[i] = 0 if size != shape[i] else stride
    return tuple(out)


class ElementwiseOp(Op):
    """Family base of the elementwise ops (see the module docstring). A leaf sets :attr:`fn`
    (or overrides :meth:`fn_name`) and :meth:`torch_fn`; :meth:`constants` reads the fn's
    constants from the op's params of the same names."""

    #: the scalar function of the generator (a key of ``SCALAR_FNS``)
    fn: ClassVar[str]
    kernel_types = {_k.ElementwiseInterface: (_k.ElementwiseFlatKernel, _k.ElementwiseRowsKernel,
                                              _k.ElementwiseStridedKernel)}

    def output_layout(self, inputs: tuple, shape: tuple) -> tuple[int, ...] | None:
        """torch's layout of the outputs (:func:`torch_layout`): an output in its inputs' own
        memory order, so a transposed or permuted input is read and written as one flat run,
        as torch does."""
        for t in inputs:  # the common case first, at a few tens of ns an input
            if t is not None and not t.is_contiguous():
                return torch_layout(inputs, tuple(shape))
        return None

    def derive(self) -> None:
        self._fn = self.fn_name()
        self._consts = self.constants()
        plan = type(self)._signature
        self._n_in = len(plan.input_names)  # type: ignore[union-attr]
        #: the 0-dim operands a call makes (:meth:`_const`), per (value, device, dtype)
        self._scalars: dict[tuple, torch.Tensor] = {}

    def _const(self, value: float, like: torch.Tensor,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """A 0-dim ``value`` on ``like``'s device in ``dtype`` (``like``'s by default), kept
        for the next calls: at most :data:`MAX_CONSTS` of them (a gradient's counts and
        scales vary with the shapes), none a fake or meta one nor one a graph capture fills
        only at replay."""
        dtype = like.dtype if dtype is None else dtype
        key = (value, like.device, dtype)
        t = self._scalars.get(key)
        if t is None:
            t = torch.full((), value, dtype=dtype, device=like.device)
            if keepable(t):
                with self._lock:
                    if len(self._scalars) >= MAX_CONSTS:
                        self._scalars.clear()
                    self._scalars[key] = t
        return t

    def fn_name(self) -> str:
        return self.fn

    def constants(self) -> tuple:
        """The fn's constants, in its declared order: the op's params of those names."""
        return tuple(getattr(self, p) for p in _k.SCALAR_FNS[self._fn].params)

    # --- the call -------------------------------------------------------------------------------

    def forward(self, call: Any, *tensors: Any) -> None:
        n = self._n_in
        ins = [t for t in tensors[:n] if t is not None]
        self._launch(call, self.rounded_operands(ins) if self.rounds_operands else ins,
                     tensors[n:])

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
        self.refuse_params(ins)
        if outs[0].numel() == 0:
            with self._lock:
                self._entries_by_call[key] = _noop
            return _noop
        via = self.rounded_to(ins)
        if via is not None:
            return self._rounding_entry(key, call, ins, outs, form, via)
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

    def refuse_params(self, ins: list) -> None:
        """Refuse, by name, a param the call's operands cannot take (a bound outside x's
        dtype's range); run on a kernel entry's first call and by the reference. None by
        default."""

    def rounded_to(self, ins: list) -> torch.dtype | None:
        """The 16-bit common dtype that integer operands with dims (:data:`_WIDE_INTS`) are
        rounded to before the math, as torch casts every operand to the common dtype (an
        int32 2049 beside a float16 is 2048); None where no operand needs it. A 0-dim operand
        keeps its precision, as a CUDA kernel of torch takes a CPU scalar (and as a Python
        number operand is held)."""
        if not any(t.dtype in _WIDE_INTS and t.dim() for t in ins):
            return None
        common = self.operand_dtype([t for t in ins if t.dtype is not torch.bool])
        return common if common in _HALF else None

    def _rounding_entry(self, key: tuple, call: Any, ins: list, outs: Any, form: tuple,
                        via: torch.dtype) -> Any:
        """The entry of a call whose integer operands are rounded to ``via`` first: a copy
        of each (a rare call: integers beside 16-bit floats), then the entry of the rounded
        call."""
        wide = [i for i, t in enumerate(ins) if t.dtype in _WIDE_INTS and t.dim()]
        rounded = [t.to(via) if i in wide else t for i, t in enumerate(ins)]
        inner = self._entry((key, via), call, rounded, outs, form)

        def entry(*tensors: Any) -> None:
            args = list(tensors)
            for i in wide:
                args[i] = args[i].to(via)
            inner(*args)

        with self._lock:
            self._entries_by_call[key] = entry
        return entry

    def compute_dtype(self, ins: list, outs: Any) -> torch.dtype:
        """The dtype the math runs in: the output's, float16 and bfloat16 widened to float32
        (torch's opmath type). A bool output (a comparison, a test) reads its operands'; a
        comparison (:attr:`rounds_operands`) compares in their common dtype itself, each
        operand converted to it first, as torch compares (a 0-dim float32 0.1 or an int 2049
        beside float16 is rounded to float16; the function then widens both exactly)."""
        dtype = outs[0].dtype
        if dtype is torch.bool:
            dtype = self.operand_dtype(ins)
            if self.rounds_operands:
                return dtype
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

    #: every operand converted to the operands' common dtype before the math, as torch's
    #: kernels of comparisons, remainder and pow take them (a 0-dim float32 0.1 beside float16
    #: is float16's 0.1 there), where the arithmetic kernels hold a 0-dim operand in its own
    #: (an op may round some operands only: :meth:`rounds_operand`)
    rounds_operands: ClassVar[bool] = False

    def rounds_operand(self, i: int) -> bool:
        """Whether operand ``i`` is rounded, where :attr:`rounds_operands`: every one, unless
        an op's torch kernel holds one in its own precision (a division's divisor)."""
        return True

    def rounded_operands(self, ins: list) -> list:
        """``ins`` with each 0-dim operand of another dtype converted to the common dtype (a
        copy of one element), where :attr:`rounds_operands` (and :meth:`rounds_operand`);
        operands with dims are rounded by :meth:`rounded_to` and the kernels."""
        if not self.rounds_operands:
            return ins
        common = self.operand_dtype([t for t in ins if t is not None])
        return [t.to(common) if t is not None and not t.dim() and t.dtype != common
                and t.dtype is not torch.bool and self.rounds_operand(i) else t
                for i, t in enumerate(ins)]

    def reference(self, call: Any, *inputs: Any) -> tuple:
        self.refuse_params([t for t in inputs if t is not None])
        inputs = tuple(self.rounded_operands(list(inputs)))
        via = self.rounded_to([t for t in inputs if t is not None])
        if via is not None:  # integers beside 16-bit floats: rounded first, as torch does
            inputs = tuple(t.to(via) if t is not None and t.dtype in _WIDE_INTS and t.dim()
                           else t for t in inputs)
        out = self.torch_fn(*[_wide(t) for t in inputs])
        return out if isinstance(out, tuple) else (out,)

    def eager(self) -> Any:
        inplace = getattr(self, "inplace", False)
        fn = self.torch_fn

        def eager(*inputs: Any) -> Any:
            return fn(*inputs, inplace=inplace)

        return eager
