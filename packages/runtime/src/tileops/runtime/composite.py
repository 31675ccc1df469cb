"""What a composite op adds to :class:`~tileops.runtime.op.Op`: its delegates and the stages
its calls record (``docs/runtime-decisions.md``, Composite ops).

:class:`Composite` is a base of ``Op``, so every op has these methods; they act only where the
class declares ``delegate_types``. ``delegate_for(role, **params)`` builds the sub-op of a role
once per (role, params) and holds it, constructed with the parent's explicit target and its
tuning mode; ``with self.stage(name):`` around the sub-calls records each successful one in
that stage of the parent's call. Stage state is thread-local, set up by the ``Op`` instance
(``_delegate_stages``, ``_delegates``, ``_lock``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from tileops.spec import AdtValue

from .errors import StageError

if TYPE_CHECKING:  # pragma: no cover
    from tileops.signature import SignatureCall

    from .op import Op

__all__ = ["Composite"]


class Composite:
    """The delegate and stage methods of :class:`~tileops.runtime.op.Op`."""

    def delegate_for(self, role: str, **params: Any) -> Op:
        """The sub-op playing ``role`` with these construction params (built once, held)."""
        cls = self.delegate_types.get(role)
        if cls is None:
            raise LookupError(f"{type(self).__name__} declares no delegate {role!r}; "
                              f"delegate_types: {', '.join(self.delegate_types) or 'none'}")
        key = (role, tuple(sorted((k, _freeze(v)) for k, v in params.items())))
        op = self._delegates.get(key)
        if op is None:
            with self._lock:
                op = self._delegates.get(key)
                if op is None:
                    op = cls(target=self.target, tune=self._tune_requested, **params)
                    op._parent = self
                    self._delegates[key] = op
        return op

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Record the delegate calls made inside into the stage ``name`` of this call."""
        state = self._delegate_stages
        if getattr(state, "finished", None) is None:
            raise StageError(f"{type(self).__name__}: stage {name!r} opened outside the "
                             f"forward of a call; stages record a composite op's delegate "
                             f"calls (declare delegate_types)")
        declared = self._declared_stages
        if declared is not None and name not in declared:
            raise StageError(f"{type(self).__name__}: stage {name!r} is not declared in its "
                             f"spec's composition; declared: {', '.join(declared)}")
        if getattr(state, "current", None) is not None:
            raise StageError(f"{type(self).__name__}: stage {name!r} opened inside stage "
                             f"{state.current[0]!r}")
        calls: list[SignatureCall] = []
        state.current = (name, calls)
        try:
            yield
        finally:
            state.current = None
        state.finished.append((name, tuple(calls)))

    def _stage_sink(self, child: Op) -> list:
        current = getattr(self._delegate_stages, "current", None)
        if current is None:
            raise StageError(f"{type(child).__name__} was called by {type(self).__name__} outside "
                             f"any stage; wrap delegate calls in `with self.stage(name):`")
        return current[1]

    def _forward_in_stages(self, call: SignatureCall, inputs: tuple, outputs: tuple) -> Any:
        if not self.delegate_types:
            return self.forward(call, *inputs, *outputs)
        state = self._delegate_stages
        saved = (getattr(state, "current", None), getattr(state, "finished", None))
        state.current, state.finished = None, []
        try:
            result = self.forward(call, *inputs, *outputs)
            for name, calls in state.finished:
                call.add_stage(name, calls)
        finally:
            state.current, state.finished = saved
        return result


def _freeze(v: Any) -> Any:
    """A hashable key of a delegate's param value (lists, dicts and ADT values, whose fields
    are a mapping, included)."""
    if isinstance(v, AdtValue):
        return ("adt", v.constructor, _freeze(dict(v.fields)))
    if isinstance(v, list):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _freeze(x)) for k, x in v.items()))
    return v

