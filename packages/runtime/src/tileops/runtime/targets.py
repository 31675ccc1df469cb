"""Targets: named sets of builders that serve ops outside the in-tree kernels.

A builder is registered per (target, op class): ``builder(op, call) -> kernel``, where the
kernel is a callable ``kernel(*inputs, *outputs)`` that writes the outputs (an aliased output
is the input itself). Target kernels go through the same checks, records and failure handling
as in-tree kernels.

Which target serves an instance is decided at its first call: the one named at construction,
else the process default (``TILEOPS_TARGET`` or :func:`set_default_target`), else by device:
the in-tree kernels where one of them runs on the device, else the first registered target
with a builder for the op that runs on that device type (the ``reference`` target runs on
every device).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from . import env
from .errors import TargetError

__all__ = [
    "IN_TREE",
    "REFERENCE",
    "Builder",
    "builder_for",
    "default_target",
    "register_builder",
    "register_target",
    "set_default_target",
    "target_devices",
    "targets",
]

#: the name the in-tree (TileLang) kernels serve under
IN_TREE = "tileops"
#: plain PyTorch, any device: how every op runs without a GPU, and what tests compare against
REFERENCE = "reference"

Builder = Callable[[Any, Any], Callable[..., Any]]

_lock = threading.Lock()
_targets: dict[str, tuple[str, ...] | None] = {}
_builders: dict[str, dict[type, Builder]] = {}
_default: list[str | None] = [None]
_default_set = [False]


def register_target(name: str, devices: tuple[str, ...] | None = None) -> None:
    """Declare a target and the device types it runs on (None: any)."""
    if not name or not isinstance(name, str):
        raise ValueError(f"a target name is a non-empty string, got {name!r}")
    if name == IN_TREE:
        raise ValueError(f"{IN_TREE!r} names the in-tree kernels; choose another target name")
    with _lock:
        _targets[name] = devices
        _builders.setdefault(name, {})


def register_builder(target: str, op_cls: type, builder: Builder) -> None:
    """Register ``builder`` for ``op_cls`` (and its subclasses) under ``target``."""
    if target not in _targets:
        raise TargetError(f"unknown target {target!r}; registered: {', '.join(targets())}")
    if not callable(builder):
        raise TypeError(f"builder must be callable, got {type(builder).__name__}")
    with _lock:
        _builders[target][op_cls] = builder


def builder_for(target: str, op_cls: type) -> Builder | None:
    """The builder registered for ``op_cls`` (or its nearest base) under ``target``; for the
    ``reference`` target, else the generic one of an op that declares ``Op.reference``."""
    table = _builders.get(target, {})
    for klass in op_cls.__mro__:
        b = table.get(klass)
        if b is not None:
            return b
    if target == REFERENCE:
        return getattr(op_cls, "_reference_builder", None)
    return None


def targets() -> list[str]:
    return list(_targets)


def target_devices(name: str) -> tuple[str, ...] | None:
    return _targets[name]


def set_default_target(name: str | None) -> None:
    """Set (or clear, with None) the process default target. Overrides ``TILEOPS_TARGET``."""
    if name is not None and name != IN_TREE and name not in _targets:
        raise TargetError(f"unknown target {name!r}; registered: {', '.join(targets())}")
    _default[0] = name
    _default_set[0] = True


def default_target() -> str | None:
    if _default_set[0]:
        return _default[0]
    return env.default_target()


register_target(REFERENCE, None)
