"""The functions of ``torch.nn.functional`` that TileOPs ops serve, with the same signatures
(plus a keyword-only ``target``, passed to the op), and the fused add + RMSNorm beside them.

A function call takes its op instance from one process-wide cache keyed by the op class and
its construction params (:func:`op_for`): an op is built once per distinct configuration and
then serves every call with it, so a functional call costs one dictionary lookup more than
calling the op. The cache is bounded (:data:`MAX_CACHED_OPS`, the oldest out first): a caller
sweeping ``eps`` or shapes does not grow it without end. An evicted op that a caller still holds
keeps working; the next lookup just builds another.

The layers (:mod:`tileops.nn`) hold their own op instances instead (see ``_holder.py``), and
share :func:`linear_with` with :func:`linear`.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
from torch.compiler import is_dynamo_compiling

from tileops.ops import FusedAddRMSNormFwdOp, GemmFwdOp, LayerNormFwdOp, RMSNormFwdOp
from tileops.runtime import Op

__all__ = [
    "MAX_CACHED_OPS",
    "OpCache",
    "autocast_operands",
    "fused_add_rms_norm",
    "in_input_dtype",
    "layer_norm",
    "linear",
    "linear_with",
    "op_for",
    "rms_norm",
]

#: how many op instances the functional cache keeps
MAX_CACHED_OPS = 256


def _freeze(value: Any) -> Any:
    """A hashable key for a param value, tagged by type: ``eps=1`` and ``eps=True`` are
    different params (the op may refuse one of them) and must not share an instance."""
    kind = type(value)
    if kind is list or kind is tuple:
        return (tuple, tuple([_freeze(v) for v in value]))
    return (kind, value)


class OpCache:
    """A bounded, thread-safe map from (op class, construction params) to an op instance.

    A hit is one key built and one ``dict.get``, without the lock (a single dict operation is
    atomic under the GIL, and locked inside the dict on free-threaded builds); the lock
    serialises insertion and eviction. An op is constructed outside it (construction generates
    the op's checks), and where two threads build the same configuration at once, the first one
    stored is what both get. The oldest entry goes first when the map is full: a hit does not
    reorder it (that would put every hit under the lock), and an evicted op that is needed
    again is rebuilt at the cost of one construction.

    The key holds the params in the caller's keyword order (the functions here pass one order
    each; another order only costs an instance more), each value tagged by type."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"OpCache: maxsize must be at least 1, got {maxsize}")
        self.maxsize = maxsize
        self._ops: dict[Any, Op] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ops)

    def get(self, cls: type[Op], **params: Any) -> Op:
        """The cached instance of ``cls(**params)``, built on a miss. Params that cannot be a
        key (a dict, say) build an uncached instance, so the op's own construction check is
        what refuses them."""
        key = (cls, *[(k, _freeze(v)) for k, v in params.items()])
        try:
            op = self._ops.get(key)
        except TypeError:  # unhashable
            return cls(**params)
        if op is not None:
            return op
        if is_dynamo_compiling():
            shown = ", ".join(f"{k}={v!r}" for k, v in params.items())
            raise RuntimeError(
                f"tileops.nn.functional: the {cls.__name__}({shown}) these arguments call is "
                f"built at their first call, which cannot happen inside torch.compile; call "
                f"the function once with them before compiling (or hold the op: "
                f"{cls.__name__}(...) made outside, called inside)")
        built = cls(**params)
        with self._lock:
            op = self._ops.setdefault(key, built)
            while len(self._ops) > self.maxsize:
                del self._ops[next(iter(self._ops))]
        return op

    def clear(self) -> None:
        with self._lock:
            self._ops.clear()


_cache = OpCache(MAX_CACHED_OPS)


def op_for(cls: type[Op], **params: Any) -> Op:
    """The process-wide cached instance of ``cls(**params)`` the functions here call."""
    return _cache.get(cls, **params)


def in_input_dtype(input: Any, *params: Any) -> tuple:
    """``params`` as the norm ops take them, as torch's norms take a weight (and bias) of
    another floating dtype (a float32 weight beside bfloat16 activations: mixed precision,
    autocast) and answer in the input's dtype. One in the input's dtype or in float32 is
    passed as it is: the ops take both, and compute a float32 one's gradient in float32 (a
    cast to the input's dtype would round it there). One of another floating dtype (float16
    beside bfloat16, float64 beside float32) is cast to the input's dtype differentiably, so
    its gradient comes back in its own dtype. Anything else is passed as it is, for the op's
    check to name."""
    if not isinstance(input, torch.Tensor) or not input.is_floating_point():
        return params
    dt = input.dtype
    return tuple(p.to(dt) if isinstance(p, torch.Tensor) and p.is_floating_point()
                 and p.dtype != dt and p.dtype != torch.float32 else p for p in params)


#: the dtypes autocast casts (a float64 operand it leaves as it is)
_AUTOCAST_CAST = (torch.float32, torch.float16, torch.bfloat16)


def autocast_operands(*operands: Any) -> tuple:
    """The operands of a matrix product as torch's autocast hands them to ``F.linear``: where
    autocast is on for the first one's device, each float32, float16 or bfloat16 tensor in
    autocast's dtype (differentiably); elsewhere, or off, as they are."""
    first = operands[0]
    if not isinstance(first, torch.Tensor):
        return operands
    device = first.device.type
    try:
        if not torch.is_autocast_enabled(device):
            return operands
        dt = torch.get_autocast_dtype(device)
    except RuntimeError:  # a device type autocast does not know
        return operands
    return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.dtype in _AUTOCAST_CAST
                 and t.dtype != dt else t for t in operands)


def rms_norm(input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
             eps: float | None = None, *, target: str | None = None) -> torch.Tensor:
    """``torch.nn.functional.rms_norm`` through :class:`~tileops.ops.RMSNormFwdOp`."""
    op = op_for(RMSNormFwdOp, normalized_shape=normalized_shape, eps=eps, target=target)
    return op(input, *in_input_dtype(input, weight))


def layer_norm(input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5, *,
               target: str | None = None) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` through :class:`~tileops.ops.LayerNormFwdOp`."""
    op = op_for(LayerNormFwdOp, normalized_shape=normalized_shape, eps=eps, target=target)
    return op(input, *in_input_dtype(input, weight, bias))


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor,
                       weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                       inplace: bool = False, target: str | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(input + residual) * weight, input + residual)`` through
    :class:`~tileops.ops.FusedAddRMSNormFwdOp` (no torch.nn.functional counterpart; with
    ``inplace`` the results are written into ``input`` and ``residual``)."""
    op = op_for(FusedAddRMSNormFwdOp, eps=eps, inplace=inplace, target=target)
    return op(input, residual, *in_input_dtype(input, weight))


def linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           target: str | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear``: ``input @ weight.T + bias`` through
    :class:`~tileops.ops.GemmFwdOp` (``trans_b=True``, the ``nn.Linear`` weight layout)."""
    return linear_with(op_for(GemmFwdOp, trans_b=True, target=target), input, weight, bias)


def linear_with(op: Op, input: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``input @ weight.T + bias`` with ``op`` a ``GemmFwdOp(trans_b=True)``.

    The op multiplies matrices, so the input's leading axes are flattened into its rows and
    restored on the result (a 1-D input is one row, as in torch). A 2-D input goes to the op
    as it is, and so does anything that is not a tensor: the op's check names what is wrong.
    The bias is added by torch (``y + bias``): no op adds it yet, and a GEMM epilogue that
    fuses it would replace this add. Since torch's add would promote a bias of another dtype
    (and broadcast one of another shape) silently, the bias is checked first. Under autocast
    the operands are first cast as autocast casts ``F.linear``'s (:func:`autocast_operands`)."""
    input, weight, bias = autocast_operands(input, weight, bias)
    if not isinstance(input, torch.Tensor) or input.dim() == 2:
        y = op(input, weight)
    else:
        if input.dim() == 0:
            raise ValueError(f"linear: argument input is a 0-dim tensor; expected at least one "
                             f"axis (its last is in_features), seen {_describe(input)}")
        y = op(input.reshape(math.prod(input.shape[:-1]), input.shape[-1]), weight)
        y = y.reshape(*input.shape[:-1], y.shape[-1])
    if bias is None:
        return y
    n = y.shape[-1]
    if not isinstance(bias, torch.Tensor) or bias.dtype != y.dtype or bias.shape != (n,):
        raise ValueError(f"linear: argument bias does not match the output; expected "
                         f"{_describe_as(y.dtype, (n,))} (the output's dtype, out_features), "
                         f"seen {_describe(bias)}")
    return y + bias


def _describe_as(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    return f"{str(dtype).removeprefix('torch.')}[{', '.join(map(str, shape))}]"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return _describe_as(value.dtype, tuple(value.shape))
    return type(value).__name__
