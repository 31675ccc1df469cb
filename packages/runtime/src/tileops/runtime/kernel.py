"""Kernel slots and their implementations, and how one implementation is chosen.

- A :class:`KernelInterface` is one *slot* an op uses: the type of the call spec its
  implementations are told about (``call_spec``) and the parameters of their ``forward``.
- A :class:`Kernel` is one implementation: the devices and architectures it runs on, the region
  of calls it serves (``refusal(spec)`` returns why not, or None), whether it is the slot's
  ``general`` fallback, the siblings it is ``preferred_over``, and how to build its entry
  (``entry_for``) once per ``identity``.

Selection inside a slot (:func:`select`): every implementation that does not refuse applies.
Exactly one specialised one runs; with none, the ``general`` one runs; two specialised ones are
an ambiguity error naming both (unless one is declared ``preferred_over`` the other); nothing
applicable is an error listing each implementation's refusal. Declaration order decides nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Mapping
from typing import Any, ClassVar

import msgspec

from .errors import AmbiguousKernelError, NoKernelError

__all__ = ["CallSpec", "Kernel", "KernelInterface", "device_arch", "select"]


class CallSpec(msgspec.Struct, frozen=True):
    """Base of the call specs implementations are told about. Every spec carries the device;
    an interface subclasses it with what its implementations need (sizes, dtypes, flags)."""

    device: Any

    def check_fields(self, *, choices: Mapping[str, Collection[str]] | None = None,
                     sizes: Iterable[str] = (), flags: Iterable[str] = ()) -> None:
        """Refuse, naming the spec and the field, a field that is none of its ``choices``
        (ValueError), a size that is not an int >= 0 (ValueError; a bool is not a size) or a
        flag that is not a bool (TypeError): what a subclass's ``__post_init__`` checks of
        its fields, stated once."""
        name = type(self).__name__
        for f, allowed in (choices or {}).items():
            v = getattr(self, f)
            if v not in allowed:
                raise ValueError(f"{name}.{f} must be one of {', '.join(sorted(allowed))}, "
                                 f"got {v!r}")
        for f in sizes:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}.{f} must be a size (an int >= 0), got {v!r}")
        for f in flags:
            v = getattr(self, f)
            if not isinstance(v, bool):
                raise TypeError(f"{name}.{f} must be a bool, got {v!r}")


class KernelInterface:
    """One kernel slot. Subclasses set ``call_spec`` (a :class:`CallSpec` subclass) and
    ``slot`` (the key a caller's ``kernel_map`` may use) and declare ``forward``."""

    slot: ClassVar[str] = ""
    call_spec: ClassVar[type[CallSpec]] = CallSpec

    def forward(self, *args: Any) -> Any:  # pragma: no cover - declared by each interface
        raise NotImplementedError


_ARCH_CACHE: dict[Any, tuple[int, int] | None] = {}


def device_arch(device: Any) -> tuple[int, int] | None:
    """The compute capability of a CUDA device (cached); None for other devices. Only called
    when a kernel is first selected, never at construction."""
    if getattr(device, "type", None) != "cuda":
        return None
    arch = _ARCH_CACHE.get(device)
    if arch is None:
        import torch

        arch = tuple(torch.cuda.get_device_capability(device))  # type: ignore[assignment]
        _ARCH_CACHE[device] = arch
    return arch


class Kernel:
    """Base of kernel implementations. An implementation also inherits its interface."""

    #: device types this implementation runs on ("cuda", "cpu", "meta", ...)
    devices: ClassVar[tuple[str, ...]] = ("cuda",)
    #: compute capabilities it was written for; None: any
    supported_archs: ClassVar[frozenset[tuple[int, int]] | None] = None
    #: the slot's fallback, run where no specialised implementation applies
    general: ClassVar[bool] = False
    #: siblings this one wins over when both apply
    preferred_over: ClassVar[tuple[type[Kernel], ...]] = ()

    @classmethod
    def region_refusal(cls, spec: Any) -> str | None:
        """Why ``spec`` is outside the region this implementation serves, or None. The region
        is stated positively by each implementation (e.g. ``N * itemsize <= 64 KiB``)."""
        return None

    @classmethod
    def refusal(cls, spec: Any) -> str | None:
        """Why this implementation cannot serve ``spec`` (device, architecture, region)."""
        device = getattr(spec, "device", None)
        dtype = getattr(device, "type", None)
        if dtype is not None and dtype not in cls.devices:
            return f"runs on {' or '.join(cls.devices)}, not {dtype}"
        if cls.supported_archs is not None and dtype == "cuda":
            arch = device_arch(device)
            if arch not in cls.supported_archs:
                archs = ", ".join(f"sm_{a}{b}" for a, b in sorted(cls.supported_archs))
                return f"written for {archs}, not sm_{arch[0]}{arch[1]}" if arch else \
                    f"written for {archs}"
        return cls.region_refusal(spec)

    @classmethod
    def identity(cls, spec: Any) -> Hashable:
        """What the built entry depends on; calls with equal identities share one entry."""
        return spec

    @classmethod
    def entry_for(cls, spec: Any, op: Any) -> Any:
        """Build the entry (a callable) for ``spec``. Runs once per (class, identity)."""
        return cls(spec)  # type: ignore[call-arg]

    def __init__(self, spec: Any) -> None:
        self.spec = spec


def select(interface: type, candidates: Iterable[type[Kernel]], spec: Any) -> type[Kernel]:
    """The implementation of ``interface`` that serves ``spec`` (see the module docstring)."""
    candidates = tuple(candidates)
    refusals: dict[type[Kernel], str] = {}
    applicable: list[type[Kernel]] = []
    for k in candidates:
        why = k.refusal(spec)
        if why is None:
            applicable.append(k)
        else:
            refusals[k] = why
    claimants = [k for k in applicable if not k.general]
    beaten = {loser for k in claimants for loser in k.preferred_over}
    special = [k for k in claimants if k not in beaten]
    name = getattr(interface, "slot", "") or interface.__name__
    if claimants and not special:  # every claimant is beaten by another: a preference cycle
        names = " and ".join(k.__name__ for k in claimants)
        raise AmbiguousKernelError(
            f"{name}: {names} claim {spec!r} and each is preferred_over another; break the "
            f"cycle"
        )
    if len(special) == 1:
        return special[0]
    if len(special) > 1:
        names = " and ".join(k.__name__ for k in special)
        raise AmbiguousKernelError(
            f"{name}: {names} both claim {spec!r}; narrow one region or declare "
            f"preferred_over"
        )
    general = [k for k in applicable if k.general]
    if len(general) == 1:
        return general[0]
    if len(general) > 1:
        raise AmbiguousKernelError(
            f"{name}: more than one general implementation applies: "
            + ", ".join(k.__name__ for k in general)
        )
    if not candidates:
        raise NoKernelError(f"{name}: no implementation is installed")
    lines = "\n".join(f"  {k.__name__}: {why}" for k, why in refusals.items())
    raise NoKernelError(f"{name}: no implementation serves {spec!r}:\n{lines}")
