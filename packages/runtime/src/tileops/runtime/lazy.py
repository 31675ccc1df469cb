"""An op class's generated members, built when the class is first used rather than when it is
defined.

``import tileops.ops`` defines every shipped op class (more than a hundred and forty). Building
each one's signature plan, generated ``__init__`` and ``__call__`` (ASTs compiled to code),
docstring and gradient record at definition made the import cost most of what it cost beyond
torch, for classes a program mostly never constructs; the objects it allocated also made the
import end in a full garbage collection over every object of the process. ``Op.__init_subclass__``
therefore does only what must fail at definition (the entry is found, its param names clash
with nothing) and leaves the rest to :func:`defer`: each member becomes a :class:`_Deferred`
descriptor, and the first access of any of them (constructing the class reads ``__init__``;
``cls._signature``, ``help(cls)``, ``cls.__call__``) builds them all at once, under one lock,
and stores the real values on the class in the descriptors' place. From then on the class is
exactly what an eager build would have made: plain attributes, no descriptor in the way of a
call or of tracing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from torch.compiler import is_dynamo_compiling

__all__ = ["defer", "is_deferred"]

#: one lock for every class: a build reads other classes (a gradient's backward class is
#: looked up, not built), and it is reentrant because a builder may read a member of its own
#: class that it has already set
_lock = threading.RLock()


class _Deferred:
    """A class attribute standing in for a member not built yet (see the module docstring)."""

    __slots__ = ("build", "name", "owner")

    def __init__(self, owner: type, name: str, build: Callable[[type], Mapping[str, Any]]):
        self.owner = owner
        self.name = name
        self.build = build

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        owner = self.owner
        if is_dynamo_compiling() and owner.__dict__.get(self.name) is self:
            # the build generates and compiles code under a lock: nothing tracing can follow
            raise RuntimeError(
                f"{owner.__name__}: an op class is built at its first use, which cannot happen "
                f"inside torch.compile; construct an instance of it once before the compiled "
                f"function (and call that instance inside)")
        with _lock:
            # another thread (or this build, reentering) may have replaced the stand-ins
            if owner.__dict__.get(self.name) is self:
                members = self.build(owner)
                for name, value in members.items():
                    if isinstance(owner.__dict__.get(name), _Deferred):
                        type.__setattr__(owner, name, value)
        value = owner.__dict__[self.name]
        get = getattr(type(value), "__get__", None)
        return value if get is None else get(value, obj, objtype)

    def __repr__(self) -> str:
        return f"<{self.owner.__qualname__}.{self.name}, built on first use>"


def defer(cls: type, names: tuple[str, ...], build: Callable[[type], Mapping[str, Any]]) -> None:
    """Stand ``names`` on ``cls`` in for the members ``build(cls)`` returns (a mapping with
    every one of ``names``), built on the first access of any of them."""
    for name in names:
        type.__setattr__(cls, name, _Deferred(cls, name, build))


def is_deferred(cls: type, name: str) -> bool:
    """Whether ``cls``'s own ``name`` is still a stand-in (tests and introspection)."""
    return isinstance(cls.__dict__.get(name), _Deferred)
