"""torch dtype -> spec dtype name, for building kernel call specs (the signature package's
torch adapter already holds the mapping), and the refusal of a dtype the in-tree kernels do
not serve (:class:`UnservedDtypeError`, exported by the package)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from tileops.signature import torch_adapter

NAMES = torch_adapter().names


class UnservedDtypeError(TypeError):
    """A call in a dtype the op's in-tree kernels do not serve, which the ``reference`` target
    serves: ``op`` (the op's class name), ``dtype`` (the refused dtype's name), ``served``
    (the names the kernels serve, sorted) and ``kernels`` (the kernels, in words)."""

    def __init__(self, op: str, dtype: str, served: Collection[str], kernels: str) -> None:
        self.op, self.dtype, self.kernels = op, dtype, kernels
        self.served = tuple(sorted(served))
        super().__init__(f"{op}: the in-tree {kernels} kernels serve {', '.join(self.served)}, "
                         f"not {dtype}; construct the op with target='reference' for {dtype}")

    def __reduce__(self) -> tuple:
        return type(self), (self.op, self.dtype, self.served, self.kernels)


def refuse_unserved(op: Any, dtype: Any, served: Collection[str], kernels: str) -> None:
    """Refuse a call in ``dtype`` when it is none of ``served`` (the dtype names the in-tree
    ``kernels`` state in their call specs) with :class:`UnservedDtypeError`, naming the op and
    the target that serves it: an entry admits more (float64 for gradient checks, float32 for
    the GEMM), which the ``reference`` target serves."""
    name = NAMES.get(dtype, str(dtype))
    if name not in served:
        raise UnservedDtypeError(type(op).__name__, name, served, kernels)
