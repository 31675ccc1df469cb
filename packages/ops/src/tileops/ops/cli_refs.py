"""What the ``tileops`` command compares ops with, per op class.

- :data:`FP64`: the float64 reference of each op (the functions of
  :mod:`tileops.ops.reference`, called on ``.double()`` inputs). ``FP64[name](op, *inputs)``
  returns the op's outputs in float64, in the order of the entry's ``outputs``; it reads the
  inputs and never writes them. An op missing here is checked against its ``reference``
  target builder run on float64 copies of the inputs
  (:func:`tileops.ops.cli.declared.fp64_reference`).
- :data:`EAGER`: the torch eager equivalent of each op (the entry's ``ref_api``).
  ``EAGER[name](op)`` returns a callable taking the op's inputs (absent optional ones as None)
  and returning its outputs; it has the op's effects (an in-place op writes its inputs), so
  ``torch.compile`` of it is the compiled contender.

An op missing from :data:`EAGER` has no eager or compiled contender in ``tileops bench``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .reference import layer_norm_reference, rms_norm_reference

__all__ = ["EAGER", "FP64"]


def _d(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.double()


def _rms_fp64(op: Any, x: torch.Tensor, weight: torch.Tensor | None = None) -> tuple:
    eps = op.eps if op.eps is not None else torch.finfo(x.dtype).eps
    return (rms_norm_reference(x.double(), _d(weight), len(op.normalized_shape), eps),)


def _fused_add_rms_fp64(op: Any, x: torch.Tensor, residual: torch.Tensor,
                        weight: torch.Tensor | None = None) -> tuple:
    # the spec rounds residual_out to the storage dtype, and y normalizes that rounded value
    s = (x.double() + residual.double()).to(x.dtype).double()
    return rms_norm_reference(s, _d(weight), 1, op.eps), s


def _layer_fp64(op: Any, x: torch.Tensor, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> tuple:
    return (layer_norm_reference(x.double(), _d(weight), _d(bias), len(op.normalized_shape),
                                 op.eps),)


FP64: dict[str, Callable[..., tuple]] = {
    "RMSNormFwdOp": _rms_fp64,
    "FusedAddRMSNormFwdOp": _fused_add_rms_fp64,
    "LayerNormFwdOp": _layer_fp64,
}


def _rms_eager(op: Any) -> Callable[..., Any]:
    shape, eps = list(op.normalized_shape), op.eps

    def rms_norm(x, weight=None):  # torch.nn.functional.rms_norm
        return F.rms_norm(x, shape, weight, eps)

    return rms_norm


def _fused_add_rms_eager(op: Any) -> Callable[..., Any]:
    eps, inplace = op.eps, op.inplace

    def fused_add_rms_norm(x, residual, weight=None):  # add, then F.rms_norm
        if inplace:
            residual.add_(x)
            x.copy_(F.rms_norm(residual, [x.shape[-1]], weight, eps))
            return x, residual
        s = x + residual
        return F.rms_norm(s, [x.shape[-1]], weight, eps), s

    return fused_add_rms_norm


def _layer_eager(op: Any) -> Callable[..., Any]:
    shape, eps = list(op.normalized_shape), op.eps

    def layer_norm(x, weight=None, bias=None):  # torch.nn.functional.layer_norm
        return F.layer_norm(x, shape, weight, bias, eps)

    return layer_norm


def _gemm_eager(op: Any) -> Callable[..., Any]:
    trans_a, trans_b = op.trans_a, op.trans_b

    def matmul(a, b):  # torch.matmul
        return torch.matmul(a.T if trans_a else a, b.T if trans_b else b)

    return matmul


EAGER: dict[str, Callable[[Any], Callable[..., Any]]] = {
    "RMSNormFwdOp": _rms_eager,
    "FusedAddRMSNormFwdOp": _fused_add_rms_eager,
    "LayerNormFwdOp": _layer_eager,
    "GemmFwdOp": _gemm_eager,
}
