"""Computed dtypes (``promote(TA, TB)``, ``result_type(TA, len(SA), TB, len(SB))``,
``promote_int_to_float(T)``, ``with_numbers(T, min, max)``, and a choice between dtypes by their
comparison, ``uint8 if T == uint8 else bool``) as one dictionary lookup per call.

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
``torch.set_default_dtype(torch.float64)``; so does ``with_numbers`` where one of its numbers
is a float. Its numbers are construction params, folded to their values at the point (a float
param keeps the int a caller passed: an int is int64 beside tensors, a float the default).
"""

from __future__ import annotations

import ast
import threading
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

__all__ = ["MAX_TABLE", "SPLIT", "DTypeTable", "Lookup", "is_dtype_call", "is_dtype_expr", "lookup"]

#: the most combinations a dtype table may have (three operands of every dtype and their
#: ranks stay far below it); beyond it the entry is refused when generating
MAX_TABLE = 1 << 16
#: the combinations above which a table's nested dtype calls get tables of their own
SPLIT = 1 << 10
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
    #: the names of the dtypes it may give
    results: tuple[str, ...] = ()


def is_dtype_call(node: E.Node) -> bool:
    return isinstance(node, E.Call) and node.func in DTYPE_PRIMITIVES


def is_dtype_expr(node: E.Node) -> bool:
    """A computed dtype: a dtype primitive's call, or a conditional whose branches are dtypes
    and whose test compares dtypes (``uint8 if T == uint8 else bool``: torch.all keeps a uint8
    input's dtype)."""
    return is_dtype_call(node) or isinstance(node, E.IfExp)


def lookup(compiler: Any, node: E.Node, leaf_code: Callable[[E.Node], ast.expr],
           split: bool = False) -> Lookup:
    """The lookup of the folded dtype expression ``node`` (:func:`is_dtype_expr`).
    ``compiler`` is the point's ``ExprCompiler`` (kinds, adapter, namespace); ``leaf_code``
    compiles a key component. A table of more than :data:`SPLIT` combinations is ``split``:
    each nested dtype call that cannot miss is looked up first, in a table of its own, and
    its result is a key component of the outer one (clamp's ``with_numbers(result_type(...),
    min, max)``: 8000 and 40 entries, not 32000), so a point is generated in milliseconds."""
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
        if is_dtype_call(a) and split and a is not node:
            inner = lookup(compiler, a, leaf_code)
            if inner.total:
                return slot(a, inner.results, code=inner.code)
        if is_dtype_call(a):
            return template(a)  # type: ignore[arg-type]
        if isinstance(a, E.IfExp):
            return E.IfExp(test(a.test), dtype_arg(a.body), dtype_arg(a.orelse))
        if isinstance(a, E.Str) and a.value in DTYPES:  # a dtype param, folded
            return E.Name(a.value)
        if isinstance(a, E.Name):
            k = compiler.plan.kinds.get(a.id)
            if isinstance(k, DTypeK) and (a.id in compiler.sig.forall or a.id in compiler.sig.let):
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

    def number_arg(a: E.Node) -> E.Node:
        """A Python number (with_numbers'), folded: a construction param's value or a
        literal. Only its type is read (an int is int64, a float the default dtype), so it
        is passed on as a literal of that type (an infinite float param has no literal)."""
        if isinstance(a, E.UnaryOp) and a.op == "-":
            a = a.operand
        if isinstance(a, E.Name) and a.id in compiler.const:
            v = compiler.const[a.id]
            a = (E.NoneLit() if v is None else E.Bool(v) if isinstance(v, bool) else
                 E.Int(0) if isinstance(v, int) else E.Float(0.0) if isinstance(v, float)
                 else a)
        if isinstance(a, E.Int):
            return E.Int(0)
        if isinstance(a, E.Float):
            return E.Float(0.0)
        if isinstance(a, E.Bool | E.NoneLit):
            return a
        raise GenError(f"{E.unparse(node)}: {E.unparse(a)} cannot be compiled as a number "
                       f"argument (a construction param or a literal)")

    def rank_arg(a: E.Node) -> E.Node:
        if isinstance(a, E.Int):
            return a
        return slot(a, (True, False), rank=True)  # all torch's rule reads of a rank

    def template(call: E.Call) -> E.Call:
        prim = PRIMITIVES[call.func]
        kinds = [prim.param_kind(i) for i in range(len(call.args))]
        args = tuple(dtype_arg(a) if k == "dtype" else number_arg(a) if k == "number"
                     else rank_arg(a) for a, k in zip(call.args, kinds, strict=True))
        kwargs = tuple((k, dtype_arg(v)) for k, v in call.kwargs)
        reads_default = compiler.adapter.default_float is not None and not kwargs and (
            (call.func == "promote_int_to_float" and len(args) == 1)
            or (call.func == "with_numbers" and any(isinstance(a, E.Float) for a in args[1:])))
        if reads_default and call.func == "promote_int_to_float":
            args = (*args, default_arg())
        elif reads_default:  # a float number is the default dtype at the call
            kwargs = (("default", default_arg()),)
        return E.Call(call.func, args, kwargs)

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
    if count > SPLIT and not split and any(is_dtype_call(n) for n in E.walk(node)
                                           if n is not node):
        return lookup(compiler, node, leaf_code, split=True)
    if count > MAX_TABLE:
        raise GenError(f"{text}: its dtype table would have {count} entries, more than "
                       f"{MAX_TABLE}; narrow the DType unions it reads")
    natives = compiler.adapter.natives
    entries = _entries(tmpl, tuple(s[1] for s in slots), natives)
    if not slots and not entries:  # constant arguments without a result
        raise GenError(f"{text} has no value: {no_promotion(list(E.names(tmpl)))}")
    total = len(entries) == count
    values = set(entries.values())
    leaves = tuple((E.unparse(s[0]), ast.unparse(s[2])) for s in slots)

    def reason(names: list[Any]) -> str:
        return no_promotion([n for n in names if isinstance(n, str)])

    results = tuple(compiler.adapter.name_of(v) for v in values)
    if total and len(values) == 1:  # one dtype whatever the call
        return Lookup(ast.Name(compiler._name("D", values.pop()), ast.Load()), True, True,
                      leaves, reason, results)
    table = compiler._name("DX", DTypeTable(entries, text))
    keys = [s[3] for s in slots]
    key = keys[0] if len(keys) == 1 else ast.Tuple(keys, ast.Load())
    return Lookup(ast.Subscript(ast.Name(table, ast.Load()), key, ast.Load()), total, False,
                  leaves, reason, results)


#: (template, the slots' values, the natives' identity) -> the table's entries: a template
#: (its numbers reduced to their types, its leaves to slots) recurs across construction points
#: (clamp's result dtype at every pair of number bounds of the same types), so its table is
#: computed once
_TABLES: dict[tuple, dict] = {}
_TABLES_LOCK = threading.Lock()


def _entries(tmpl: E.Node, values: tuple[tuple[Any, ...], ...], natives: Any) -> dict:
    """The native table of ``tmpl`` over every combination of its slots' ``values`` (a rank
    slot's True is a 0-dim rank): key (one component unwrapped) -> native dtype; a
    combination with no result is left out."""
    key = (tmpl, values, id(natives))
    got = _TABLES.get(key)
    if got is not None and got[0] is natives:
        return got[1]
    fn = _compiled(tmpl)
    names = [f"_{i}" for i in range(len(values))]
    entries: dict[Any, Any] = {}
    for combo in product(*values):
        scope = {n: (0 if v is True else 1) if isinstance(v, bool) else v
                 for n, v in zip(names, combo, strict=True)}
        try:
            name = fn(scope)
        except (EvalError, PrimitiveError, TypeError, ValueError):
            continue  # no result: left out, so the call is refused
        if name not in natives:
            continue
        key_parts = tuple(v if isinstance(v, bool) else natives[v] for v in combo)
        entries[key_parts[0] if len(key_parts) == 1 else key_parts] = natives[name]
    with _TABLES_LOCK:
        _TABLES[key] = (natives, entries)
    return entries


def _compiled(node: E.Node) -> Callable[[dict], Any]:
    """``node`` (a dtype template: slots, dtype names, numbers, dtype primitives' calls,
    conditionals) as a function of the slots' values, each primitive's call memoised by its
    arguments (a nested call is computed once per combination of the slots it reads, not
    once per combination of all); anything else through the spec's evaluator."""
    if isinstance(node, E.Name):
        if node.id.startswith("_"):
            n = node.id
            return lambda sc: sc[n]
        if node.id in DTYPES:
            v = node.id
            return lambda sc: v
    if isinstance(node, E.Int | E.Float | E.Bool | E.NoneLit):
        c = None if isinstance(node, E.NoneLit) else node.value
        return lambda sc: c
    if isinstance(node, E.UnaryOp) and node.op == "-" and isinstance(node.operand,
                                                                      E.Int | E.Float):
        c = -node.operand.value
        return lambda sc: c
    if isinstance(node, E.UnaryOp) and node.op == "not":
        f = _compiled(node.operand)
        return lambda sc: not f(sc)
    if isinstance(node, E.BoolOp):
        fs = [_compiled(v) for v in node.values]
        if node.op == "and":
            return lambda sc: all(f(sc) for f in fs)
        return lambda sc: any(f(sc) for f in fs)
    if isinstance(node, E.Compare) and len(node.ops) == 1 and node.ops[0] in ("==", "!="):
        a, b = _compiled(node.left), _compiled(node.comparators[0])
        if node.ops[0] == "==":
            return lambda sc: a(sc) == b(sc)
        return lambda sc: a(sc) != b(sc)
    if isinstance(node, E.IfExp):
        t, a, b = _compiled(node.test), _compiled(node.body), _compiled(node.orelse)
        return lambda sc: a(sc) if t(sc) else b(sc)
    if isinstance(node, E.Call) and node.func in PRIMITIVES and not any(
            isinstance(a, E.Starred) for a in node.args):
        impl = PRIMITIVES[node.func].impl
        args = [_compiled(a) for a in node.args]
        kwargs = [(k, _compiled(v)) for k, v in node.kwargs]
        memo: dict[tuple, Any] = {}

        def call(sc: dict) -> Any:
            a = tuple(f(sc) for f in args)
            kw = tuple((k, f(sc)) for k, f in kwargs)
            key = (a, kw)
            if key not in memo:
                try:
                    memo[key] = (True, impl(*a, **dict(kw)))
                except (PrimitiveError, TypeError, ValueError) as exc:
                    memo[key] = (False, exc)
            ok, v = memo[key]
            if not ok:
                raise v
            return v

        return call
    return lambda sc: evaluate(node, Scope(sc))
