"""Dtype adapters: how a signature plan reads the dtype and device of a tensor-like object.

A plan works on any object with ``.shape`` (a tuple of ints) and ``.dtype``. The adapter maps
spec dtype names (``bfloat16``) to the library's native dtype objects and back, gives their
item sizes, names the attribute a tensor holds its device in (``.device`` for torch; none for
numpy, whose arrays all live on the host, so its checks read and compare no device), and
supplies the comparison hook used by the symbolic variant of the generated checks (the runtime
plugs ``torch._check`` there so tracing under torch.compile records a runtime assertion
instead of specialising on a size), lists the library's array types, whose shapes are
sizes by construction (see :mod:`.sizes`: any other object's shape is checked entry by entry),
and reads the library's default floating dtype at a call (``torch.get_default_dtype``), which
``promote_int_to_float`` of an integer gives.

A dtype the adapter does not map (a numpy dtype handed to the torch adapter, a dtype of some
other library, a torch dtype with no spec name) is shown in messages by its repr and type
(``dtype('float32') (numpy.dtypes.Float32DType)``), never by a name that could read as one the
signature accepts.

Adapters import their library lazily: importing :mod:`tileops.signature` imports no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tileops.spec import DTYPES

from .sizes import normalize_shape, shape_problem

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
    for a library without devices: its checks compare none and its records' device is None.
    ``arrays`` are the library's array types (subclasses included) whose ``.shape`` is a
    tuple of sizes by construction; the checks read no entry of theirs, and check every entry
    of any other object's shape (none given: every shape is checked). A ``strict`` adapter
    takes its arrays only (torch's: what a kernel runs on is a ``torch.Tensor``, not an
    object that has a ``.shape`` and a ``.dtype``). ``default_float`` reads the library's
    default floating dtype (a native) at a call, which a computed dtype's
    ``promote_int_to_float`` of an integer then gives (torch's ``get_default_dtype``); None:
    the spec's, float32, whatever the call."""

    def __init__(
        self,
        name: str,
        natives: dict[str, Any],
        check: Callable[[Any, Callable[[], str]], None] = _default_check,
        device: str | None = None,
        arrays: tuple[type, ...] = (),
        strict: bool = False,
        default_float: Callable[[], Any] | None = None,
    ) -> None:
        if device is not None and not device.isidentifier():
            raise ValueError(f"adapter {name!r}: device attribute {device!r} is not an "
                             f"identifier")
        if not (isinstance(arrays, tuple) and all(isinstance(a, type) for a in arrays)):
            raise TypeError(f"adapter {name!r}: arrays must be a tuple of types, got "
                            f"{arrays!r}")
        if strict and not arrays:
            raise ValueError(f"adapter {name!r}: a strict adapter names its array types")
        self.name = name
        self.device = device
        self.arrays = arrays
        #: only ``arrays`` are tensors (an object with a ``.shape`` and a ``.dtype`` is not)
        self.strict = strict
        #: the exact types seen to be ``arrays`` (their subclasses included): the hot path
        #: tests ``type(t) in admitted``, one set lookup whatever the subclass (an
        #: ``isinstance`` of a ``torch.nn.Parameter`` runs torch's Python ``__instancecheck__``)
        self.admitted: set[type] = set(arrays)
        self.natives = dict(natives)
        self.names = {v: k for k, v in self.natives.items()}
        self.itemsizes = {v: DTYPES[k] for k, v in self.natives.items()}
        self.check = check
        self.default_float = default_float

    def native(self, name: str) -> Any:
        try:
            return self.natives[name]
        except KeyError:
            raise KeyError(f"{self.name} has no dtype {name!r}") from None

    def admit(self, t: Any, shape: Any) -> Any:
        """``shape``, the ``.shape`` of ``t``, when ``t`` is an array of the library (its type
        is then admitted: later calls test it with one set lookup); else ``shape`` as a tuple
        of ints, or None when it is not a tuple of sizes (:func:`.sizes.normalize_shape`)."""
        if isinstance(t, self.arrays):
            cls = type(t)
            # a subclass that keeps the library's shape attribute has the library's sizes (an
            # nn.Parameter, a fake tensor: symbolic sizes never forced); one that redefines
            # it is read entry by entry, as any other object
            if all(getattr(cls, "shape", None) is getattr(a, "shape", None)
                   for a in self.arrays if isinstance(t, a)):
                self.admitted.add(cls)
                return shape
            return normalize_shape(shape)
        return None if self.strict else normalize_shape(shape)

    def problem(self, name: str, t: Any) -> str:
        """Why ``t``, given for ``name``, is not admitted (:meth:`admit` refused it)."""
        if self.strict and not isinstance(t, self.arrays):
            kinds = " or ".join(f"{a.__module__}.{a.__qualname__}" for a in self.arrays)
            return (f"{name} must be a {kinds}, got {type(t).__module__}."
                    f"{type(t).__qualname__}")
        return shape_problem(name, t.shape)

    def spec_name(self, native: Any) -> str | None:
        """The spec name of ``native``, or None when this adapter does not map it (an
        unhashable object included)."""
        try:
            return self.names.get(native)
        except TypeError:
            return None

    def name_of(self, native: Any) -> str:
        """The spec name of ``native``; for one this adapter does not map, its repr and type
        (see :meth:`describe`)."""
        n = self.spec_name(native)
        return n if n is not None else self.describe(native)

    def short(self, native: Any) -> str:
        """The compact spelling (``bf16``); the repr of a dtype this adapter does not map."""
        n = self.spec_name(native)
        return SHORT.get(n, n) if n is not None else repr(native)

    def describe(self, native: Any) -> str:
        """A dtype object as messages show one this adapter does not map: its repr and its
        type, ``dtype('float32') (numpy.dtypes.Float32DType)``."""
        t = type(native)
        return f"{native!r} ({t.__module__}.{t.__qualname__})"

    def refusal(self, what: str, native: Any, accepted: str) -> str | None:
        """Why the dtype ``native``, read at ``what`` (``x.dtype``), is refused when this
        adapter does not map it; None when it does (the caller then says why it is not one
        of those ``accepted``)."""
        if self.spec_name(native) is not None:
            return None
        return (f"{what} is {self.describe(native)}, not a dtype the {self.name} adapter "
                f"maps; {accepted}")

    def __repr__(self) -> str:
        return f"DTypeAdapter({self.name!r})"


_cache: dict[str, DTypeAdapter] = {}


def torch_adapter(strict: bool = False) -> DTypeAdapter:
    """The adapter for ``torch.Tensor`` (and fake / meta tensors). Symbolic comparisons go
    through ``torch._check``. ``strict``: a ``torch.Tensor`` only (what a kernel runs on),
    where the plain adapter also checks any object with a ``.shape`` and a ``.dtype``."""
    if strict:
        if "torch-strict" not in _cache:
            ad = torch_adapter()
            _cache["torch-strict"] = DTypeAdapter("torch", ad.natives, ad.check, device="device",
                                                  arrays=ad.arrays, strict=True,
                                                  default_float=ad.default_float)
        return _cache["torch-strict"]
    if "torch" not in _cache:
        import torch

        natives = {n: getattr(torch, n) for n in DTYPES if isinstance(getattr(torch, n, None),
                                                                         torch.dtype)}

        def check(cond: Any, message: Callable[[], str]) -> None:
            torch._check(cond, message)

        _cache["torch"] = DTypeAdapter("torch", natives, check, device="device",
                                       arrays=(torch.Tensor,),
                                       default_float=torch.get_default_dtype)
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
        _cache["numpy"] = DTypeAdapter("numpy", natives, arrays=(np.ndarray,))
    return _cache["numpy"]
