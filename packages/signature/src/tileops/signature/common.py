"""What the generator's modules share: its two internal exceptions, the records it hands
between them (a failure's description, a hot-path body) and the formatting of values in
messages. Imports nothing of the package, so every other module can import it."""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FastBody", "Failure", "GenError", "LazyConflict", "ev", "fmt_value", "shape_text",
           "tuple_code"]


class GenError(Exception):
    """The entry cannot be compiled at this construction point (reported as a SpecError)."""


class LazyConflict(Exception):
    """A Shape index is sliced from different inputs in different presence branches: the
    generator starts over, slicing it eagerly."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


@dataclass(frozen=True)
class FastBody:
    """One body of a point's hot-path ``check``, as parsed statements, for a caller that fuses
    the check into a function of its own (the runtime's fused op call): run ``statements``
    under ``try`` (a miss raises), then ``record`` is the call's record. Chosen by
    ``presence`` (optional input -> given).

    The nodes are the statements the point's own ``check`` is compiled from, as parsed (with
    the positions of that parse). Every caller of the point gets the same nodes: copy them
    (``copy.deepcopy``) before placing them in a tree of one's own.
    """

    presence: dict[str, bool]
    statements: tuple[ast.stmt, ...]
    record: ast.expr
    #: what the statements and the record read without binding it: the inputs
    #: (``t_<input>``), the point's ``namespace`` entries, builtins
    reads: frozenset[str]
    #: what the statements bind (``s_<input>`` and ``d_<input>`` of each given input, the
    #: indices a later check reads): code placed after them may read these
    binds: frozenset[str]
    #: the effect branch of this body when no ``out=`` buffer is given
    branch: tuple

    @classmethod
    def of(cls, presence: dict[str, bool], parsed: list[ast.stmt], branch: tuple) -> FastBody:
        """From a body's statements as parsed, the closing ``return <record>`` last."""
        *statements, ret = parsed
        assert isinstance(ret, ast.Return) and ret.value is not None
        stored: set[str] = set()
        loaded: set[str] = set()
        for node in (n for st in parsed for n in ast.walk(st)):
            if isinstance(node, ast.Name):
                (stored if isinstance(node.ctx, ast.Store) else loaded).add(node.id)
        return cls(dict(presence), tuple(statements), ret.value, frozenset(loaded - stored),
                   frozenset(stored), branch)


@dataclass
class Failure:
    """One check's failure, described once when generating: the call error raised when that
    check fails is built from it and the failing call's locals (``ConstructionPoint._fail``)."""

    argument: str
    expected: str
    because: Callable[[dict], str]
    bound: tuple[str, ...]
    location: str


def fmt_value(v: Any) -> str:
    """A param or index value as messages show it: ``[4096]``, ``'mean'``, ``1e-06``; an int
    of more than 256 bits by its size (a huge int's digits are slow to print, and past 4300 of
    them Python refuses to)."""
    if isinstance(v, tuple | list):
        return "[" + ", ".join(map(fmt_value, v)) + "]"
    if isinstance(v, int) and v.bit_length() > 256:
        return f"<an int of {v.bit_length()} bits>"
    return repr(v) if isinstance(v, str) else str(v)


def shape_text(s: Any) -> str:
    """A shape as messages show it: ``[2, 4096]``. Entries are shown as they are, so a shape
    refused for holding a non-size shows it (``[True, 3.5, -1]``); an integer that is not an
    ``int`` (a numpy scalar, a symbolic size) shows its value; a shape that is not a tuple or
    list shows its repr."""
    if not isinstance(s, tuple | list):
        return repr(s)
    return "[" + ", ".join(str(x) if hasattr(x, "__index__") and not isinstance(x, bool)
                           else repr(x) for x in s) + "]"


def tuple_code(items: list[str]) -> str:
    """Source of a tuple display: ``()``, ``(a,)``, ``(a, b)``."""
    if not items:
        return "()"
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def ev(code: str, env: dict) -> Any:
    """Evaluate a generated sub-expression against a failing call's locals (slow path only,
    for the error message; the code is our own generated text)."""
    return eval(code, {"len": len, "tuple": tuple}, env)  # noqa: S307
