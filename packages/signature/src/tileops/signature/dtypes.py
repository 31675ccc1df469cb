"""Computed dtypes (``promote(TA, TB)``, ``result_type(TA, len(SA), TB, len(SB))``,
``promote_int_to_float(T)``, and a choice between dtypes by their comparison, ``uint8 if T ==
uint8 else bool``) as one dictionary lookup per call.

A dtype expression's value depends only on the dtypes its DType indices take, each from its
finite union, and on whether each rank argument is 0 (torch's ``result_type`` reads nothing
else of a rank). So the whole expression, however nested, is evaluated once per combination
when generating, by the spec's own primitives over dtype names, and the generated code looks
the native result up by the combination, ``_DX3[(i_TA, len(i_SA) == 0, i_TB, len(i_SB) == 0)]``
(a lone key is not wrapped in a tuple). Combinations with no result (torch refuses
float8 mixed with another dtype; a complex32 result has no spec name) are left out of the
table; a call that reaches one is refused by name (the body checks it; anywhere else the
table's own miss raises a ``PrimitiveError``). A table that holds every combination cannot
miss once the inputs' dtypes are checked, and one whose every entry is one dtype is that
dtype: the generator then emits no lookup where nothing reads the value.

The key components are code built from the folded AST (``i_<index>``, the compiled rank
expression), never from spec text. ``promote_int_to_float(T)`` adds one more: the library's
default floating dtype, read at each call through the adapter (``torch.get_default_dtype()``),
so the table answers ``float64`` for an integer ``T`` under
``torch.set_default_dtype(torch.float64)``.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from itertools import product
from typing import Any

from tileops.spec import DTYPES, EvalError, Scope, evaluate
from tileops.spec import expr as E
from tileops.spec.dtypes import DEFAULT_FLOATS
from tileops.spec.kinds import DTypeK
from tileops.spec.primitives import DTYPE_PRIMITIVES, PRIMITIVES, PrimitiveError, no_promotion

from .common import GenError

__all__ = ["MAX_TABLE", "DTypeTable", "Lookup", "is_dtype_call", "is_dtype_expr", "lookup"]

#: the most combinations a dtype table may have (three operands of every dtype and their
#: ranks stay far below it); beyond it the entry is refused when generating
MAX_TABLE = 1 << 16
#: the leaf of the default floating dtype (``promote_int_to_float(T)`` without one): the
#: adapter reads it at each call, so a call under ``torch.set_default_dtype(torch.float64)``
#: looks up its own entry
_DEFAULT = E.Call("default_dtype")


class DTypeTable(dict):
    """The table of one dtype expression: key -> native dtype. A missing key is a
    combination with no result; looking it up raises a ``PrimitiveError`` (a ValueError,
    which a check reports as the signature failing on these dtypes)."""

    def __init__(self, entries: dict, text: str) -> None:
        super().__init__(entries)
        self.text = text

    def __missing__(self, key: Any) -> Any:
        raise PrimitiveError(f"{self.text} has no dtype for the key {key!r}")


@dataclass(frozen=True)
class Lookup:
    """A compiled dtype expression: ``code`` gives its native value (a lookup, or a name of
    the namespace when it is one dtype whatever the call), ``total`` says no call that passed
    the input checks can miss, and ``leaves`` are the ``(text, code)`` of each key component,
    for messages."""

    code: ast.expr
    total: bool
    constant: bool
    leaves: tuple[tuple[str, str], ...]
    #: the spec names of the leaves' values at a failing call -> why there is no result
    reason: Callable[[list[Any]], str]


def is_dtype_call(node: E.Node) -> bool:
    return isinstance(node, E.Call) and node.func in DTYPE_PRIMITIVES


def is_dtype_expr(node: E.Node) -> bool:
    """A computed dtype: a dtype primitive's call, or a conditional whose branches are dtypes
    and whose test compares dtypes (``uint8 if T == uint8 else bool``: torch.all keeps a uint8
    input's dtype)."""
    return is_dtype_call(node) or isinstance(node, E.IfExp)


def lookup(compiler: Any, node: E.Node, leaf_code: Callable[[E.Node], ast.expr]) -> Lookup:
    """The lookup of the folded dtype expression ``node`` (:func:`is_dtype_expr`). ``compiler`` is the point's
    ``ExprCompiler`` (kinds, adapter, namespace); ``leaf_code`` compiles a key component."""
    # leaf, its values, the code of its value, the key component (a rank's is "== 0")
    slots: list[tuple[E.Node, tuple[Any, ...], ast.expr, ast.expr]] = []

    def slot(leaf: E.Node, values: tuple[Any, ...], rank: bool = False,
             code: ast.expr | None = None) -> E.Name:
        for i, s in enumerate(slots):
            if s[0] == leaf:
                return E.Name(f"_{i}")
        code = leaf_code(leaf) if code is None else code
        key = ast.Compare(code, [ast.Eq()], [ast.Constant(0)]) if rank else code
        slots.append((leaf, values, code, key))
        return E.Name(f"_{len(slots) - 1}")

    def dtype_arg(a: E.Node) -> E.Node:
        if is_dtype_call(a):
            return template(a)  # type: ignore[arg-type]
        if isinstance(a, E.IfExp):
            return E.IfExp(test(a.test), dtype_arg(a.body), dtype_arg(a.orelse))
        if isinstance(a, E.Str) and a.value in DTYPES:  # a dtype param, folded
            return E.Name(a.value)
        if isinstance(a, E.Name):
            k = compiler.plan.kinds.get(a.id)
            if isinstance(k, DTypeK) and a.id in compiler.sig.forall:
                return slot(a, tuple(m for m in k.members if m in compiler.adapter.natives))
            if a.id in DTYPES and a.id not in compiler.const:
                return a
        raise GenError(f"{E.unparse(node)}: {E.unparse(a)} cannot be compiled as a dtype "
                       f"argument (an index, a dtype name, a dtype primitive's call or a "
                       f"conditional between them)")

    def test(t: E.Node) -> E.Node:
        """A conditional's test: dtypes compared (``==``, ``!=``), combined by ``and``,
        ``or``, ``not``."""
        if isinstance(t, E.Bool):
            return t
        if isinstance(t, E.UnaryOp) and t.op == "not":
            return E.UnaryOp("not", test(t.operand))
        if isinstance(t, E.BoolOp):
            return E.BoolOp(t.op, tuple(test(v) for v in t.values))
        if isinstance(t, E.Compare) and set(t.ops) <= {"==", "!="}:
            return E.Compare(dtype_arg(t.left), t.ops, tuple(dtype_arg(c) for c in t.comparators))
        raise GenError(f"{E.unparse(node)}: the test {E.unparse(t)} cannot be compiled: a "
                       f"dtype conditional compares dtypes (== or !=)")

    def rank_arg(a: E.Node) -> E.Node:
        if isinstance(a, E.Int):
            return a
        return slot(a, (True, False), rank=True)  # all torch's rule reads of a rank

    def template(call: E.Call) -> E.Call:
        prim = PRIMITIVES[call.func]
        args = tuple(dtype_arg(a) if prim.param_kind(i) == "dtype" else rank_arg(a)
                     for i, a in enumerate(call.args))
        if call.func == "promote_int_to_float" and len(args) == 1 and \
                compiler.adapter.default_float is not None:
            args = (*args, default_arg())
        return E.Call(call.func, args)

    def default_arg() -> E.Name:
        """The library's default floating dtype, read at the call (a key component)."""
        read = compiler._name("F", compiler.adapter.default_float)
        return slot(_DEFAULT, tuple(d for d in DEFAULT_FLOATS if d in compiler.adapter.natives),
                    code=ast.Call(ast.Name(read, ast.Load()), [], []))

    tmpl = dtype_arg(node)
    text = E.unparse(node)
    sizes = [len(s[1]) for s in slots]
    count = 1
    for s in sizes:
        count *= s
    if count > MAX_TABLE:
        raise GenError(f"{text}: its dtype table would have {count} entries, more than "
                       f"{MAX_TABLE}; narrow the DType unions it reads")
    natives = compiler.adapter.natives
    entries: dict[Any, Any] = {}
    for combo in product(*(s[1] for s in slots)):
        scope = {f"_{i}": (0 if v is True else 1) if isinstance(v, bool) else v
                 for i, v in enumerate(combo)}
        try:
            name = evaluate(tmpl, Scope(scope))
        except EvalError:
            continue  # no result: left out, so the call is refused
        if name not in natives:
            continue
        key_parts = tuple(v if isinstance(v, bool) else natives[v] for v in combo)
        entries[key_parts[0] if len(key_parts) == 1 else key_parts] = natives[name]
    if not slots and not entries:  # constant arguments without a result
        raise GenError(f"{text} has no value: {no_promotion(list(E.names(tmpl)))}")
    total = len(entries) == count
    values = set(entries.values())
    leaves = tuple((E.unparse(s[0]), ast.unparse(s[2])) for s in slots)

    def reason(names: list[Any]) -> str:
        return no_promotion([n for n in names if isinstance(n, str)])

    if total and len(values) == 1:  # one dtype whatever the call
        return Lookup(ast.Name(compiler._name("D", values.pop()), ast.Load()), True, True,
                      leaves, reason)
    table = compiler._name("DX", DTypeTable(entries, text))
    keys = [s[3] for s in slots]
    key = keys[0] if len(keys) == 1 else ast.Tuple(keys, ast.Load())
    return Lookup(ast.Subscript(ast.Name(table, ast.Load()), key, ast.Load()), total, False,
                  leaves, reason)
