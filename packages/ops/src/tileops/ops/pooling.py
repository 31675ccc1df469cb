"""Max, average and adaptive pooling, and their gradients.

:class:`PoolOp` is the family base of the forward ops and :class:`PoolGradOp` of the
gradients. Every op pools ``nd`` spatial axes of a batched ``(N, C, *spatial)`` or unbatched
``(C, *spatial)`` input, so the bases own the flow they share:

- the window: the op's ``kernel_size``, ``stride`` (None: the kernel size), ``padding`` and
  ``dilation``, each an int or one int per axis as torch takes them (``per_axis`` in the
  spec), resolved once in :meth:`PoolOp.derive` to three axes (a 1-D or 2-D pool is a 3-D
  one whose leading axes have a window of 1), which is how the kernels see every call;
- layout: the input is read in place when it is contiguous or, batched in 2-D or 3-D, in
  torch's ``channels_last`` / ``channels_last_3d`` form; any other strides are copied to
  contiguous first. The forward's outputs are in the input's format, as torch's
  (:meth:`PoolOp.output_memory_format`; 3-D average pooling's are contiguous, as torch's,
  its channels-last input copied); the gradients' are contiguous;
- the call spec: :class:`~tileops.kernels.pooling.PoolSpec` from the input's and output's
  sizes, the window, the op's kind and flags; a call with no output element launches nothing.

A leaf op is its spec entry (``specs/pooling.yaml``), its :attr:`~PoolOp.kind` and ``nd``,
and its reference and torch eager function, each stated once here (torch's functional form;
Liger-Kernel has no pooling, so there are no peers).
"""

from __future__ import annotations

from typing import Any, ClassVar, get_args

import torch
import torch.nn.functional as F

from tileops.kernels.pooling import (
    PoolBwdInterface,
    PoolBwdKernel,
    PoolDType,
    PoolFwdInterface,
    PoolKernel,
    PoolKind,
    PoolLayout,
    PoolSpec,
)
from tileops.runtime import Op
from tileops.runtime.memory import first_outside
from tileops.signature.errors import ConstructionError

from ._dtypes import NAMES, refuse_unserved

__all__ = [
    "AdaptiveAvgPool2dBwdOp",
    "AdaptiveAvgPool2dFwdOp",
    "AdaptiveMaxPool2dBwdOp",
    "AdaptiveMaxPool2dFwdOp",
    "AvgPool1dBwdOp",
    "AvgPool1dFwdOp",
    "AvgPool2dBwdOp",
    "AvgPool2dFwdOp",
    "AvgPool3dBwdOp",
    "AvgPool3dFwdOp",
    "MaxPool1dBwdOp",
    "MaxPool1dFwdOp",
    "MaxPool2dBwdOp",
    "MaxPool2dFwdOp",
    "MaxPool3dBwdOp",
    "MaxPool3dFwdOp",
    "PoolGradOp",
    "PoolOp",
]

#: the dtypes the pooling kernels state they serve
_KERNEL_DTYPES = frozenset(get_args(PoolDType))
#: the params a torch caller may spell as a list (torch takes lists and tuples alike)
_WINDOW_PARAMS = ("kernel_size", "stride", "padding", "dilation", "output_size")
_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def per_axis(value: Any, nd: int, fallback: Any = None) -> tuple[int, ...]:
    """``value`` (an int, or one int per axis; None takes ``fallback``) as ``nd`` ints: the
    spec's ``per_axis`` over every axis."""
    if value is None:
        value = fallback
    if isinstance(value, int):
        return (value,) * nd
    value = tuple(value)
    return value * nd if len(value) == 1 else value


def _three(t: tuple[int, ...], fill: int) -> tuple[int, int, int]:
    """``t`` of one to three axes as three, leading axes of ``fill``."""
    return (fill,) * (3 - len(t)) + tuple(t)  # type: ignore[return-value]


def _channels_last(x: torch.Tensor, nd: int) -> bool:
    """Whether ``x``, a batched input of ``nd`` spatial axes, is channels last and not
    contiguous (a tensor that is both, one channel or one pixel, is read as planes; an
    unbatched one has no channels-last form: a 4-D unbatched 3-D input's strides are not
    ``channels_last``'s axes)."""
    fmt = _CHANNELS_LAST.get(x.dim())
    return (fmt is not None and x.dim() == nd + 2 and not x.is_contiguous()
            and x.is_contiguous(memory_format=fmt))


def _layout(x: torch.Tensor, nd: int) -> tuple[torch.Tensor, PoolLayout]:
    """``x`` as the kernels read it: itself when contiguous or channels last, else a copy."""
    if x.is_contiguous():
        return x, PoolLayout.PLANES
    if _channels_last(x, nd):
        return x, PoolLayout.CHANNELS_LAST
    return x.contiguous(), PoolLayout.PLANES


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or float64 when it is that already, contiguous: the references
    compute values, and torch's pools refuse some strides the ops read (an unbatched 3-D input
    in ``channels_last``'s)."""
    return (t if t.dtype == torch.float64 else t.float()).contiguous()


class _Window:
    """What the family's ops share about their window params."""

    nd: ClassVar[int]
    kind: ClassVar[PoolKind]
    adaptive: ClassVar[bool] = False

    @classmethod
    def normalize_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """A list where the spec takes a tuple (``kernel_size=[3, 3]``), as torch takes it, and
        an empty ``stride`` as None (the window's, as torch reads it); an adaptive pool's
        ``output_size`` of one item refused, as torch refuses it (a window's one-item tuple
        applies to every axis, as in torch)."""
        size = params.get("output_size")
        if cls.adaptive and isinstance(size, list | tuple) and len(size) != cls.nd:
            plan = cls._signature  # type: ignore[attr-defined]
            call = ", ".join(f"{k}={v!r}" for k, v in params.items())
            raise ConstructionError(
                cls.__name__, "output_size", f"output_size: an int or a tuple of {cls.nd} ints",
                f"{tuple(size)!r} ({len(size)} item{'s' if len(size) != 1 else ''})",
                f"torch's adaptive pools take an int or {cls.nd} sizes, one an axis", call, {},
                plan.where("signature.params.output_size"))
        if isinstance(params.get("stride"), list | tuple) and not params["stride"]:
            params = {**params, "stride": None}  # torch reads an empty stride as the window
        return {k: tuple(v) if k in _WINDOW_PARAMS and isinstance(v, list) else v
                for k, v in params.items()}

    def derive(self) -> None:
        nd = self.nd
        if self.adaptive:
            self._kernel = self._stride = self._dilation = (1, 1, 1)
            self._padding = (0, 0, 0)
            return
        kernel = per_axis(self.kernel_size, nd)
        self._kernel = _three(kernel, 1)
        self._stride = _three(per_axis(self.stride, nd, kernel), 1)
        self._padding = _three(per_axis(self.padding, nd), 0)
        self._dilation = _three(per_axis(getattr(self, "dilation", 1), nd), 1)
        self._divisor = getattr(self, "divisor_override", None) or 0

    def _spec(self, device: Any, dtype: torch.dtype, x_shape: tuple, y_shape: tuple,
              layout: PoolLayout, indices: bool) -> PoolSpec:
        nd = self.nd
        batch = x_shape[0] if len(x_shape) == nd + 2 else 1
        return PoolSpec(
            device=device, kind=self.kind, adaptive=self.adaptive, layout=layout, batch=batch,
            channels=x_shape[-nd - 1], size_in=_three(tuple(x_shape[-nd:]), 1),
            size_out=_three(tuple(y_shape[-nd:]), 1), kernel=self._kernel,
            stride=self._stride, padding=self._padding, dilation=self._dilation,
            count_include_pad=getattr(self, "count_include_pad", True),
            divisor=getattr(self, "_divisor", 0), indices=indices, dtype=NAMES[dtype])


class PoolOp(_Window, Op):
    """Family base of the forward ops (see the module docstring). A subclass sets
    :attr:`nd` and :attr:`kind` (and :attr:`adaptive`)."""

    kernel_types = {PoolFwdInterface: (PoolKernel,)}
    #: whether a channels-last input gives channels-last outputs (torch's pools but
    #: avg_pool3d)
    keeps_channels_last: ClassVar[bool] = True

    def output_memory_format(self, inputs: tuple) -> torch.memory_format:
        """The outputs' memory format: channels last for a channels-last input, as torch's
        pools give (the kernels then write them in that order), else contiguous."""
        x = inputs[0]
        if self.keeps_channels_last and _channels_last(x, self.nd):
            return _CHANNELS_LAST[x.dim()]
        return torch.contiguous_format

    def forward(self, call, x, y, indices=None) -> None:
        x, layout = (_layout(x, self.nd) if self.keeps_channels_last else
                     (x.contiguous(), PoolLayout.PLANES))
        key = (call.device, x.dtype, x.shape, layout, indices is not None)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            if y.numel() == 0:
                return
            refuse_unserved(self, x.dtype, _KERNEL_DTYPES, "pooling")
            entry = self.kernel_for(key, PoolFwdInterface, lambda: self._spec(
                call.device, x.dtype, tuple(x.shape), tuple(y.shape), layout,
                indices is not None))
        entry(x, y, indices)


class PoolGradOp(_Window, Op):
    """Family base of the gradients: ``dx`` from ``dy``, the forward's input and (max pooling)
    its indices, every tensor handed to the kernel contiguous (an expanded ``ones`` or a
    channels-last gradient is copied). The references state each gradient in closed form (a
    reference may run inside a compiled graph's custom op, where autograd does not record):
    max pooling's adds ``dy`` at each window's argmax, average pooling's is torch's
    ``avg_pool*d_backward`` (``_adaptive_avg_pool2d_backward`` for adaptive windows)."""

    kernel_types = {PoolBwdInterface: (PoolBwdKernel,)}

    def forward(self, call, dy, x, *rest) -> None:
        indices, dx = rest if len(rest) == 2 else (None, rest[0])
        if indices is not None and self.checks_indices(indices):  # a call made directly
            _refuse_bad_indices(self, indices, x.shape, self.nd)
        key = (call.device, x.dtype, x.shape, dy.shape, indices is not None)
        entry = self._entries_by_call.get(key)  # the cached call: one lookup
        if entry is None:
            if dx.numel() == 0:
                return
            refuse_unserved(self, x.dtype, _KERNEL_DTYPES, "pooling")
            entry = self.kernel_for(key, PoolBwdInterface, lambda: self._spec(
                call.device, x.dtype, tuple(x.shape), tuple(dy.shape), PoolLayout.PLANES,
                indices is not None))
        entry(dy.contiguous(), x.contiguous(),
              None if indices is None else indices.contiguous(), dx)


# --- max pooling ---------------------------------------------------------------------------------

_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG_POOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


class _MaxPoolFwd(PoolOp):
    kind = PoolKind.MAX

    def _refuse_windows_in_padding(self, x_shape: tuple) -> None:
        """Refuse, naming the op, the axis and the params, a call where some window's taps
        all fall in the padding: torch's max pooling gives it -inf and an index outside the
        input, which its backward then writes through. Every window has a tap at or past 0
        (the padding is at most half the window) and starts before the axis' end, so only a
        window starting in the left padding can miss, when the axis is shorter than the
        dilation: its first tap at or past 0 lies past the axis (a few int steps a call)."""
        nd = self.nd
        k, s, p, d = (per_axis(self.kernel_size, nd), per_axis(self.stride, nd,
                      per_axis(self.kernel_size, nd)), per_axis(self.padding, nd),
                      per_axis(self.dilation, nd))
        for a, n in enumerate(x_shape[-nd:]):
            if p[a] == 0 or n >= d[a] or n == 0:
                continue
            for o in range(-(-p[a] // s[a])):  # the windows that start in the left padding
                start = o * s[a] - p[a]
                first = start + d[a] * -(start // d[a])  # the first tap at or past 0
                if first >= n:
                    raise ValueError(
                        f"{type(self).__name__}: window {o} along axis {a} of x's last {nd} "
                        f"({n} elements) has every tap in the padding (kernel_size="
                        f"{self.kernel_size!r}, stride={self.stride!r}, padding="
                        f"{self.padding!r}, dilation={self.dilation!r}: taps {start} to "
                        f"{start + d[a] * (k[a] - 1)} every {d[a]}), where max pooling has no "
                        f"element to take; a dilation of at most {n} or less padding along "
                        f"that axis leaves none")

    def forward(self, call, x, y, indices=None) -> None:
        if (call.device, x.dtype, x.shape) not in self._windows_checked:
            self._refuse_windows_in_padding(tuple(x.shape))
            self._windows_checked.add((call.device, x.dtype, x.shape))
        super().forward(call, x, y, indices)

    def derive(self) -> None:
        super().derive()
        #: the input shapes whose windows were checked (each checked once)
        self._windows_checked: set = set()

    def _pool(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _MAX_POOL[self.nd](x, self.kernel_size, self.stride, self.padding,
                                  self.dilation, self.ceil_mode, return_indices=True)

    def reference(self, call, x):
        self._refuse_windows_in_padding(tuple(x.shape))
        y, idx = self._pool(_wide(x))
        return (y, idx if self.return_indices else None)

    def eager(self):
        fn, nd = _MAX_POOL[self.nd], self.nd
        k, s, p, d, c, r = (self.kernel_size, self.stride, self.padding, self.dilation,
                            self.ceil_mode, self.return_indices)

        def max_pool(x):  # torch.nn.functional.max_pool{nd}d
            return fn(x, k, s, p, d, c, return_indices=r)

        max_pool.__name__ = f"max_pool{nd}d"
        return max_pool


class MaxPool1dFwdOp(_MaxPoolFwd):
    nd = 1


class MaxPool2dFwdOp(_MaxPoolFwd):
    nd = 2


class MaxPool3dFwdOp(_MaxPoolFwd):
    nd = 3


class _AvgPoolFwd(PoolOp):
    kind = PoolKind.AVG

    def _args(self) -> tuple:
        args = (self.kernel_size, self.stride, self.padding, self.ceil_mode,
                self.count_include_pad)
        return args if self.nd == 1 else (*args, self.divisor_override)

    def reference(self, call, x):
        return (_AVG_POOL[self.nd](_wide(x), *self._args()),)

    def eager(self):
        fn, args = _AVG_POOL[self.nd], self._args()

        def avg_pool(x):  # torch.nn.functional.avg_pool{nd}d
            return fn(x, *args)

        avg_pool.__name__ = f"avg_pool{self.nd}d"
        return avg_pool


class AvgPool1dFwdOp(_AvgPoolFwd):
    nd = 1


class AvgPool2dFwdOp(_AvgPoolFwd):
    nd = 2


class AvgPool3dFwdOp(_AvgPoolFwd):
    nd = 3
    keeps_channels_last = False  # torch's avg_pool3d gives a contiguous output


class AdaptiveAvgPool2dFwdOp(PoolOp):
    nd, kind, adaptive = 2, PoolKind.AVG, True

    def reference(self, call, x):
        return (F.adaptive_avg_pool2d(_wide(x), self.output_size),)

    def eager(self):
        size = self.output_size

        def adaptive_avg_pool2d(x):  # torch.nn.functional.adaptive_avg_pool2d
            return F.adaptive_avg_pool2d(x, size)

        return adaptive_avg_pool2d


class AdaptiveMaxPool2dFwdOp(PoolOp):
    nd, kind, adaptive = 2, PoolKind.MAX, True

    def reference(self, call, x):
        y, idx = F.adaptive_max_pool2d(_wide(x), self.output_size, return_indices=True)
        return (y, idx if self.return_indices else None)

    def eager(self):
        size, r = self.output_size, self.return_indices

        def adaptive_max_pool2d(x):  # torch.nn.functional.adaptive_max_pool2d
            return F.adaptive_max_pool2d(x, size, return_indices=r)

        return adaptive_max_pool2d


# --- gradients -----------------------------------------------------------------------------------


def _refuse_bad_indices(op: Op, idx: torch.Tensor, x_shape: torch.Size, nd: int) -> None:
    """An index that is not an element of its plane (``indices`` as the forward returns them:
    flat positions in the ``nd`` spatial axes) is refused by name where the tensor holds data
    (the references; the in-tree call where the op is called directly, not by its forward's
    gradient: :meth:`~tileops.runtime.Op.checks_indices`, since the kernel would write out of
    bounds)."""
    plane = 1
    for n in x_shape[-nd:]:
        plane *= n
    bad = first_outside(idx, 0, plane)
    if bad is not None:
        at, value = bad
        raise IndexError(
            f"{type(op).__name__}: indices[{', '.join(map(str, at))}] is {value}: not a "
            f"position in its plane of x's last {nd} axes ({' x '.join(map(str, x_shape[-nd:]))}"
            f" = {plane} elements: [0, {plane}))")


def _scatter_max(dy: torch.Tensor, x_shape: torch.Size, idx: torch.Tensor,
                 nd: int) -> torch.Tensor:
    """``dx``: each window's ``dy`` added at its argmax (a flat index into its plane)."""
    planes = dy.shape[:-nd]
    dx = dy.new_zeros((*planes, *x_shape[-nd:])).flatten(-nd)
    dx.scatter_add_(-1, idx.flatten(-nd), dy.flatten(-nd))
    return dx.unflatten(-1, tuple(x_shape[-nd:]))


class _MaxPoolBwd(PoolGradOp):
    kind = PoolKind.MAX

    def _indices(self, x: torch.Tensor) -> torch.Tensor:
        return _MAX_POOL[self.nd](x, self.kernel_size, self.stride, self.padding,
                                  self.dilation, self.ceil_mode, return_indices=True)[1]

    def reference(self, call, dy, x, indices=None):
        if indices is not None:
            _refuse_bad_indices(self, indices, x.shape, self.nd)
        idx = self._indices(x) if indices is None else indices
        return (_scatter_max(_wide(dy), x.shape, idx, self.nd),)

    def eager(self):
        nd, find = self.nd, self._indices
        k, s, p, d, c = (per_axis(self.kernel_size, nd), self.stride, self.padding,
                         self.dilation, self.ceil_mode)
        s = per_axis(s, nd, k)
        p, d = per_axis(p, nd), per_axis(d, nd)

        def max_pool_backward(dy, x, indices=None):  # aten.max_pool{2,3}d_with_indices_backward
            idx = find(x) if indices is None else indices
            if nd == 3:
                return torch.ops.aten.max_pool3d_with_indices_backward(dy, x, k, s, p, d, c,
                                                                       idx)
            if nd == 2:
                return torch.ops.aten.max_pool2d_with_indices_backward(dy, x, k, s, p, d, c,
                                                                       idx)
            return torch.ops.aten.max_pool2d_with_indices_backward(
                dy.unsqueeze(-2), x.unsqueeze(-2), (1, *k), (1, *s), (0, *p), (1, *d), c,
                idx.unsqueeze(-2)).squeeze(-2)

        return max_pool_backward


class MaxPool1dBwdOp(_MaxPoolBwd):
    nd = 1


class MaxPool2dBwdOp(_MaxPoolBwd):
    nd = 2


class MaxPool3dBwdOp(_MaxPoolBwd):
    nd = 3


def _avg_pool_backward(dy, x, nd, kernel, stride, padding, ceil_mode, count_include_pad,
                       divisor_override):
    """torch's ``avg_pool{2,3}d_backward`` (a 1-D pool as a 2-D one of one row)."""
    if nd == 3:
        return torch.ops.aten.avg_pool3d_backward(dy, x, kernel, stride, padding, ceil_mode,
                                                  count_include_pad, divisor_override)
    if nd == 2:
        return torch.ops.aten.avg_pool2d_backward(dy, x, kernel, stride, padding, ceil_mode,
                                                  count_include_pad, divisor_override)
    return torch.ops.aten.avg_pool2d_backward(
        dy.unsqueeze(-2), x.unsqueeze(-2), (1, *kernel), (1, *stride), (0, *padding),
        ceil_mode, count_include_pad, None).squeeze(-2)


class _AvgPoolBwd(PoolGradOp):
    kind = PoolKind.AVG

    def _args(self) -> tuple:
        nd = self.nd
        k = per_axis(self.kernel_size, nd)
        return (nd, k, per_axis(self.stride, nd, k), per_axis(self.padding, nd),
                self.ceil_mode, self.count_include_pad, getattr(self, "divisor_override", None))

    def reference(self, call, dy, x):
        wdy = _wide(dy)
        return (_avg_pool_backward(wdy, x.to(wdy.dtype), *self._args()),)

    def eager(self):
        args = self._args()

        def avg_pool_backward(dy, x):  # aten.avg_pool{2,3}d_backward
            return _avg_pool_backward(dy, x, *args)

        return avg_pool_backward


class AvgPool1dBwdOp(_AvgPoolBwd):
    nd = 1


class AvgPool2dBwdOp(_AvgPoolBwd):
    nd = 2


class AvgPool3dBwdOp(_AvgPoolBwd):
    nd = 3


class AdaptiveAvgPool2dBwdOp(PoolGradOp):
    nd, kind, adaptive = 2, PoolKind.AVG, True

    def reference(self, call, dy, x):
        wdy = _wide(dy)
        return (torch.ops.aten._adaptive_avg_pool2d_backward(wdy, x.to(wdy.dtype)),)

    def eager(self):
        def adaptive_avg_pool2d_backward(dy, x):  # aten._adaptive_avg_pool2d_backward
            return torch.ops.aten._adaptive_avg_pool2d_backward(dy, x)

        return adaptive_avg_pool2d_backward


class AdaptiveMaxPool2dBwdOp(PoolGradOp):
    nd, kind, adaptive = 2, PoolKind.MAX, True

    def _indices(self, x: torch.Tensor) -> torch.Tensor:
        return F.adaptive_max_pool2d(x, self.output_size, return_indices=True)[1]

    def reference(self, call, dy, x, indices=None):
        if indices is not None:
            _refuse_bad_indices(self, indices, x.shape, 2)
        idx = self._indices(x) if indices is None else indices
        return (_scatter_max(_wide(dy), x.shape, idx, 2),)

    def eager(self):
        find = self._indices

        def adaptive_max_pool2d_backward(dy, x, indices=None):  # aten's
            idx = find(x) if indices is None else indices
            return torch.ops.aten.adaptive_max_pool2d_backward(dy, x, idx)

        return adaptive_max_pool2d_backward
