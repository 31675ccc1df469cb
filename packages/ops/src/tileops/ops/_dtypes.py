"""torch dtype -> spec dtype name, for building kernel call specs (the signature package's
torch adapter already holds the mapping), and the refusal of a dtype the in-tree kernels do
not serve."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from tileops.signature import torch_adapter

NAMES = torch_adapter().names


def refuse_unserved(op: Any, dtype: Any, served: Collection[str], kernels: str) -> None:
    """Refuse a call in ``dtype`` when it is none of ``served`` (the dtype names the in-tree
    ``kernels`` state in their call specs), naming the op and the target that serves it: an
    entry admits more (float64 for gradient checks, float32 for the GEMM), which the
    ``reference`` target serves."""
    name = NAMES.get(dtype, str(dtype))
    if name not in served:
        raise TypeError(f"{type(op).__name__}: the in-tree {kernels} kernels serve "
                        f"{', '.join(sorted(served))}, not {name}; construct the op with "
                        f"target='reference' for {name}")
