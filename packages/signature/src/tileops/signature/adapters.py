"""Dtype adapters: how a signature plan reads the dtype and device of a tensor-like object.

A plan works on any object with ``.shape`` (a tuple of ints) and ``.dtype``. The adapter maps
spec dtype names (``bfloat16``) to the library's native dtype objects and back, gives their
item sizes, names the attribute a tensor holds its device in (``.device`` for torch; none for
numpy, whose arrays all live on the host, so its checks read and compare no device), and
supplies the comparison hook used by the symbolic variant of the generated checks (the runtime
plugs ``torch._check`` there so tracing under torch.compile records a runtime assertion
instead of specialising on a size).

Adapters import their library lazily: importing :mod:`tileops.signature` imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tileops.spec import DTYPES

__all__ = ["DTypeAdapter", "numpy_adapter", "torch_adapter"]

#: compact spelling used in error messages (``a: bf16[128, 4096]``)
SHORT = {
    "bool": "bool",
    "uint8": "u8",
    "int8": "i8",
    "int16": "i16",
    "int32": "i32",
    "int64": "i64",
    "float8_e4m3fn": "f8e4m3",
    "float8_e5m2": "f8e5m2",
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float64": "f64",
    "complex64": "c64",
    "complex128": "c128",
}


def _default_check(cond: Any, message: Callable[[], str]) -> None:
    if not cond:
        raise AssertionError(message())


class DTypeAdapter:
    """Maps spec dtype names to native dtypes. ``natives`` holds only the dtypes the library
    has (numpy has no bfloat16). ``device`` is the attribute a tensor's device is read from
    (the generated checks read ``t.<device>`` and compare the results with ``==``), or None
    for a library without devices: its checks compare none and its records' device is None."""

    def __init__(
        self,
        name: str,
        natives: dict[str, Any],
        check: Callable[[Any, Callable[[], str]], None] = _default_check,
        device: str | None = None,
    ) -> None:
        if device is not None and not device.isidentifier():
            raise ValueError(f"adapter {name!r}: device attribute {device!r} is not an "
                             f"identifier")
        self.name = name
        self.device = device
        self.natives = dict(natives)
        self.names = {v: k for k, v in self.natives.items()}
        self.itemsizes = {v: DTYPES[k] for k, v in self.natives.items()}
        self.check = check

    def native(self, name: str) -> Any:
        try:
            return self.natives[name]
        except KeyError:
            raise KeyError(f"{self.name} has no dtype {name!r}") from None

    def name_of(self, native: Any) -> str:
        n = self.names.get(native)
        return n if n is not None else str(native).replace("torch.", "")

    def short(self, native: Any) -> str:
        n = self.names.get(native)
        return SHORT.get(n, n) if n is not None else str(native)

    def __repr__(self) -> str:
        return f"DTypeAdapter({self.name!r})"


_cache: dict[str, DTypeAdapter] = {}


def torch_adapter() -> DTypeAdapter:
    """The adapter for ``torch.Tensor`` (and fake / meta tensors). Symbolic comparisons go
    through ``torch._check``."""
    if "torch" not in _cache:
        import torch

        natives = {n: getattr(torch, n) for n in DTYPES if isinstance(getattr(torch, n, None),
                                                                         torch.dtype)}

        def check(cond: Any, message: Callable[[], str]) -> None:
            torch._check(cond, message)

        _cache["torch"] = DTypeAdapter("torch", natives, check, device="device")
    return _cache["torch"]


def numpy_adapter() -> DTypeAdapter:
    """The adapter for ``numpy.ndarray``: no device (every array is on the host)."""
    if "numpy" not in _cache:
        import numpy as np

        natives = {}
        for n in DTYPES:
            try:
                natives[n] = np.dtype(n)
            except TypeError:
                continue
        _cache["numpy"] = DTypeAdapter("numpy", natives)
    return _cache["numpy"]
