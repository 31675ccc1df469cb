"""How a layer holds its op: built from the layer's own attributes, never pickled.

A layer's op is a function of a few of the layer's attributes (its *config*: the op params it
shares by name, plus ``target``), so the layer, not the op, is what is saved and copied. The
op instance is left out of the layer's pickled state and rebuilt from the config where the
layer is restored; this holds whether or not op instances pickle, and a restored layer starts
with a fresh binding (the target is chosen again at its first call, on its new machine).

When the op is (re)built:

- at construction, so a bad param is refused where the layer is made, by the op's own
  construction check;
- in ``__setstate__`` (``copy.deepcopy``, ``pickle``, ``torch.load(weights_only=False)``) and
  after ``_apply`` (``.to()``, ``.cuda()``, ``.half()``...): eagerly, so that the first call
  after ``model.to("cuda"); torch.compile(model)`` does not construct an op while tracing, and
  so that an op bound to a target on one device is not reused on another (an op binds its
  target at its first call and keeps it);
- after a config attribute is assigned (``layer.eps = 1e-3``): the op is rebuilt then (a
  compiled call cannot construct one), or, where that assignment leaves the config
  half-written (assignments happen one attribute at a time) and the construction refuses it,
  at the next call, whose error is then the op's own. Two threads racing that rebuild each
  build an equal op and the last one stored wins; nothing is shared between them.

A config attribute given as a dict or a list (a rotary layer's ``scaling``, a pool's
``kernel_size=[2, 2]``) is held read only (:class:`ReadOnlyDict`, :class:`ReadOnlyList`, its
items too): a change in place would not reach the op built from it, so it is refused by name,
and assigning a new value rebuilds the op as any assignment does. The containers are a dict
and a list (equal to what was given, the same repr); ``dict(layer.scaling)`` or
``{**layer.scaling, "factor": 4.0}`` is a writable copy.
"""

from __future__ import annotations

from typing import Any, ClassVar

from tileops.runtime import Op

__all__ = ["HoldsOp", "PassesTarget", "ReadOnlyDict", "ReadOnlyList"]


def _refuse(where: tuple[str, str, str]) -> TypeError:
    layer, attr, path = where
    return TypeError(f"{layer}.{attr}{path} is read only: the layer's op is built from {attr}, "
                     f"and a change in place would not reach it; assign a new value "
                     f"(layer.{attr} = ...), which rebuilds the op")


def read_only(value: Any, where: tuple[str, str, str]) -> Any:
    """``value`` with every dict and list in it held read only (see the module docstring);
    ``where`` is (the layer's class name, the attribute, the path to ``value`` in it), for
    the refusal's message. Any other value is itself."""
    layer, attr, path = where
    if isinstance(value, dict):
        return ReadOnlyDict({k: read_only(v, (layer, attr, f"{path}[{k!r}]"))
                             for k, v in value.items()}, where)
    if isinstance(value, list):
        return ReadOnlyList([read_only(v, (layer, attr, f"{path}[{i}]"))
                             for i, v in enumerate(value)], where)
    return value


class ReadOnlyDict(dict):
    """A layer's config dict, read only: every change in place is refused by name."""

    __slots__ = ("_where",)

    def __init__(self, items: dict, where: tuple[str, str, str]) -> None:
        super().__init__(items)
        self._where = where

    def _refused(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(self._where)

    __setitem__ = __delitem__ = __ior__ = _refused
    clear = pop = popitem = setdefault = update = _refused

    def __reduce__(self) -> tuple:  # copies and pickles as the same read-only dict
        return type(self), (dict(self), self._where)


class ReadOnlyList(list):
    """A layer's config list, read only: every change in place is refused by name."""

    __slots__ = ("_where",)

    def __init__(self, items: list, where: tuple[str, str, str]) -> None:
        super().__init__(items)
        self._where = where

    def _refused(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(self._where)

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refused
    append = extend = insert = pop = remove = clear = sort = reverse = _refused

    def __reduce__(self) -> tuple:
        return type(self), (list(self), self._where)


class HoldsOp:
    """Mixin of the layers (before the ``torch.nn.Module`` base in the bases): holds
    ``op_class(**{a: getattr(self, a) for a in op_attrs}, **op_fixed, target=self.target)``.

    A layer sets :attr:`op_class`, :attr:`op_attrs` (its attributes passed to the op under
    the same name) and :attr:`op_fixed` (params it always passes), sets ``self.target`` and
    then calls :meth:`_build_op` at the end of its ``__init__``."""

    op_class: ClassVar[type[Op]]
    op_attrs: ClassVar[tuple[str, ...]] = ()
    op_fixed: ClassVar[dict[str, Any]] = {}
    #: the op, or None where a config attribute changed since it was built
    _op: Op | None = None
    target: str | None

    @property
    def op(self) -> Op:
        """The op instance this layer runs."""
        op = self._op
        if op is None:
            op = self._build_op()
        return op

    def _build_op(self) -> Op:
        params = {a: getattr(self, a) for a in self.op_attrs}
        op = self.op_class(**params, **self.op_fixed, target=self.target)
        self.__dict__["_op"] = op
        return op

    def _target_repr(self) -> str:
        """``, target='...'`` for ``extra_repr`` where a target is set, else nothing."""
        return "" if self.target is None else f", target={self.target!r}"

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.op_attrs:
            value = read_only(value, (type(self).__name__, name, ""))
        super().__setattr__(name, value)  # type: ignore[misc]
        if name == "target" or name in self.op_attrs:
            built = "_op" in self.__dict__  # past __init__: the layer held an op
            self.__dict__["_op"] = None
            if built:
                # rebuilt now, where it can be (a compiled call cannot construct one); a
                # config half-written by this assignment is built at the next call instead,
                # whose error, if it is one, the op's construction check names
                try:
                    self._build_op()
                except Exception:  # noqa: BLE001 - see above
                    self.__dict__["_op"] = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()  # type: ignore[misc]
        state.pop("_op", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        self._build_op()

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        module = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        self._build_op()
        return module


class PassesTarget:
    """Mixin of the layers made of other layers (before ``torch.nn.Module`` in the bases):
    ``target`` is every part's. Assigning it after construction sets it on each child layer
    that holds one (each rebuilds its op) and rebuilds the ops this layer holds itself
    (:meth:`_build_held`, also run after ``_apply``: a move builds fresh ops, which choose
    their target again on the new device). A layer calls :meth:`_parts_done` at the end of
    its ``__init__``."""

    target: str | None

    def _build_held(self) -> None:
        """Build the ops this layer holds itself, from its attributes (none by default)."""

    def _parts_done(self) -> None:
        self.__dict__["_parts_built"] = True

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        module = super()._apply(fn, *args, **kwargs)  # type: ignore[misc]
        self._build_held()
        return module

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)  # type: ignore[misc]
        if name == "target" and "_parts_built" in self.__dict__:
            for child in self.children():  # type: ignore[attr-defined]
                if isinstance(child, (HoldsOp, PassesTarget)):
                    child.target = value
            self._build_held()
