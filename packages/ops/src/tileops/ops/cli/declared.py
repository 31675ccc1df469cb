"""SHIM, to be deleted: an op's float64 reference and its contenders, read from the per-op
tables of :mod:`tileops.ops.cli_refs` until ``Op.fp64_reference`` and ``Op.contenders`` exist.

The two functions have the signatures of those methods (an op instance first), so switching is
replacing ``fp64_reference(op, inputs)`` with ``op.fp64_reference(*inputs)`` and
``contenders(op)`` with ``op.contenders()`` in :mod:`.runner` and :mod:`.bench`, then deleting
this module and ``cli_refs.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tileops.runtime import REFERENCE, Op, targets

from ..cli_refs import EAGER, FP64

__all__ = ["contenders", "fp64_reference"]


def fp64_reference(op: Op, inputs: Sequence[Any]) -> tuple | None:
    """The op's outputs in float64 for ``inputs`` (absent optional ones as None), in the
    order of the entry's ``outputs``; the inputs are not written.

    ``cli_refs.FP64`` where it has the op; otherwise the ``reference`` target's builder for
    the op, run on float64 copies of the floating-point inputs into float64 outputs (the
    reference builders compute in float64 when handed float64). None when the op has
    neither."""
    cls = type(op)
    plan = cls._signature
    if plan.name in FP64:
        return FP64[plan.name](op, *inputs)
    builder = targets.builder_for(REFERENCE, cls)
    if builder is None:
        return None
    point = plan.construct(**{n: getattr(op, n) for n in plan.param_names})
    call = point.check(*inputs)  # shapes, dtypes and the effect branch of the real call

    def wide(t):
        if t is None:
            return None
        return t.to(torch.float64) if t.is_floating_point() else t.clone()

    inputs64 = [wide(t) for t in inputs]
    written = set(call.branch[0])
    outs: list[torch.Tensor | None] = []
    _, out_shapes, out_dtypes = call.derived()
    for decl, shape, dtype in zip(plan.sig.outputs.values(), out_shapes, out_dtypes,
                                  strict=True):
        if shape is None:
            outs.append(None)
        elif decl.alias and decl.alias in written:  # the output is that (written) input
            outs.append(inputs64[plan.input_names.index(decl.alias)])
        else:
            dt = torch.float64 if dtype.is_floating_point else dtype
            outs.append(torch.empty(tuple(shape), dtype=dt, device=call.device))
    builder(op, call)(*inputs64, *outs)
    return tuple(outs)


def contenders(op: Op) -> dict[str, Callable[..., Any]]:
    """Named equivalents of ``op`` in this process: ``"torch"``, its torch eager equivalent
    from ``cli_refs.EAGER`` (taking the op's inputs, with its effects), where the table has
    the op; no peers."""
    make = EAGER.get(type(op)._signature.name)
    return {} if make is None else {"torch": make(op)}
