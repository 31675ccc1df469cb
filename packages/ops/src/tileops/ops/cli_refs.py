"""What the ``tileops`` command compares ops with, read from each op's own declarations
(:meth:`tileops.runtime.Op.fp64_reference`, :meth:`tileops.runtime.Op.eager`).

- :data:`FP64`: ``FP64[name](op, *inputs)`` returns the op's outputs in float64.
- :data:`EAGER`: ``EAGER[name](op)`` returns the torch eager equivalent (or None).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import FusedAddRMSNormFwdOp, GemmFwdOp, LayerNormFwdOp, RMSNormFwdOp

__all__ = ["EAGER", "FP64"]

_OPS = (RMSNormFwdOp, FusedAddRMSNormFwdOp, LayerNormFwdOp, GemmFwdOp)

FP64: dict[str, Callable[..., tuple]] = {
    c.__name__: (lambda op, *inputs: op.fp64_reference(*inputs)) for c in _OPS}
EAGER: dict[str, Callable[[Any], Callable[..., Any]]] = {
    c.__name__: (lambda op: op.eager()) for c in _OPS}
