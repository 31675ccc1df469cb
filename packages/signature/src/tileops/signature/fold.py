"""Spec expressions at a construction point: folded to literals, families resolved, and
compiled to Python over the generated names.

Every expression of the entry (a shape, a dtype, a refinement, a let, a roofline formula)
reaches generated code through :class:`ExprCompiler`: :meth:`~ExprCompiler.fold` replaces each
subexpression that depends only on construction params (and the presence of optional inputs)
by its value, resolving type families (``Mat[trans_a, M, K]`` at ``trans_a = False`` is
``[M, K]``); :meth:`~ExprCompiler.code` turns what is left into Python source through an AST,
with indices renamed ``i_<index>`` and every constant with no literal form (a dtype object, a
primitive's implementation) interned in the generated code's namespace under a fresh name.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from tileops.spec import AdtValue, EvalError, Scope, evaluate
from tileops.spec import expr as E
from tileops.spec.evaluate import family_case
from tileops.spec.primitives import PRIMITIVES

from .common import GenError
from .dtypes import Lookup, is_dtype_call, lookup

if TYPE_CHECKING:  # pragma: no cover
    from .plan import ConstructionPoint

__all__ = ["ExprCompiler", "subst"]


class ExprCompiler:
    """Folds and compiles the expressions of one construction point. The subclass that
    writes the point's source (``gen_check.Generator``) sets ``namespace``, the globals of the
    generated code, before compiling anything."""

    namespace: dict[str, Any]
    #: folded dtype call -> its lookup, reset with the namespace its table is interned in
    dtype_lookups: dict[E.Node, Lookup]

    def __init__(self, point: ConstructionPoint) -> None:
        self.point = point
        self.plan = point.plan
        self.sig = point.plan.sig
        self.adapter = point.adapter
        self.const = point.constants

    def _name(self, prefix: str, value: Any) -> str:
        """Intern ``value`` in the namespace under a fresh name (``_<prefix><n>``)."""
        name = f"_{prefix}{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def _native(self, dtype_name: str) -> str:
        """The interned name of a spec dtype's native object (a marker the adapter lacks)."""
        try:
            native = self.adapter.native(dtype_name)
        except KeyError:
            native = ("<unsupported dtype>", dtype_name)
        return self._name("D", native)

    def fold(self, node: E.Node, presence: Mapping[str, bool], bound: set[str]) -> E.Node:
        """Fold every constant subexpression to a literal (families are resolved here)."""
        names = set(E.names(node))
        tensors = set(self.sig.inputs) | set(self.sig.outputs)
        runtime = {n for n in names if n in bound}
        if (not runtime and names <= set(self.const) | tensors
                and not (isinstance(node, E.Name) and node.id in tensors)):
            try:
                v = evaluate(node, Scope(self.const, self.sig.types, presence))
            except EvalError:
                v = _NOVALUE
            if v is not _NOVALUE:
                lit = _lit(v)
                if lit is not None:
                    return lit
        if isinstance(node, E.Subscript) and E.dotted_name(node.value) in self.sig.types:
            return self.fold(self.resolve_family(node, presence), presence, bound)
        if isinstance(node, E.List | E.Tuple):
            items: list[E.Node] = []
            for it in node.items:
                if isinstance(it, E.Starred):
                    inner = self.fold(it.value, presence, bound)
                    if isinstance(inner, E.List | E.Tuple):
                        items.extend(inner.items)
                    else:
                        items.append(E.Starred(inner))
                else:
                    items.append(self.fold(it, presence, bound))
            return type(node)(tuple(items))
        if isinstance(node, E.BinOp):
            return E.BinOp(node.op, self.fold(node.left, presence, bound),
                           self.fold(node.right, presence, bound))
        if isinstance(node, E.UnaryOp):
            operand = self.fold(node.operand, presence, bound)
            if node.op == "not" and isinstance(operand, E.Bool):
                return E.Bool(not operand.value)
            return E.UnaryOp(node.op, operand)
        if isinstance(node, E.BoolOp):
            # a literal decides or drops out, so what only a given input's indices can
            # compute (``not present(m) or expands_to(SM, S)``) is gone where m is absent
            decides = node.op == "or"
            kept: list[E.Node] = []
            for v in node.values:
                f = self.fold(v, presence, bound)
                if isinstance(f, E.Bool):
                    if f.value == decides:
                        return E.Bool(decides)
                    continue
                kept.append(f)
            if not kept:
                return E.Bool(not decides)
            return kept[0] if len(kept) == 1 else E.BoolOp(node.op, tuple(kept))
        if isinstance(node, E.Compare):
            return E.Compare(self.fold(node.left, presence, bound), node.ops,
                             tuple(self.fold(c, presence, bound) for c in node.comparators))
        if isinstance(node, E.IfExp):
            test = self.fold(node.test, presence, bound)
            if isinstance(test, E.Bool):
                return self.fold(node.body if test.value else node.orelse, presence, bound)
            return E.IfExp(test, self.fold(node.body, presence, bound),
                           self.fold(node.orelse, presence, bound))
        if isinstance(node, E.Call) and node.func != "present":
            return E.Call(node.func, tuple(self.fold(a, presence, bound) for a in node.args),
                          tuple((k, self.fold(v, presence, bound)) for k, v in node.kwargs))
        return node

    def resolve_family(self, node: E.Subscript, presence: Mapping[str, bool]) -> E.Node:
        fam = self.sig.types[E.dotted_name(node.value)]  # type: ignore[index]
        env_nodes = dict(zip(fam.params, node.index, strict=True))
        disc_values = {}
        for d in fam.discriminants:
            disc_values[d] = evaluate(env_nodes[d], Scope(self.const, self.sig.types, presence))
        chosen = family_case(fam, disc_values)
        # ADT field reads (layout.max_m) inside the case are folded with the discriminant value
        consts = {d: disc_values[d] for d in fam.discriminants}
        return subst(chosen, env_nodes, consts)

    def dtype_lookup(self, node: E.Node, presence_code=None) -> Lookup:
        """A computed dtype (folded: a dtype primitive's call or a conditional between dtypes)
        as one table lookup (:mod:`.dtypes`), computed once for the point: every mode's code
        looks up the same table."""
        if presence_code is not None:  # a rank reading present(): compiled in its context
            return lookup(self, node, lambda leaf: self._py(leaf, presence_code))
        lk = self.dtype_lookups.get(node)
        if lk is None:
            lk = self.dtype_lookups[node] = lookup(self, node, lambda leaf: self._py(leaf, None))
        return lk

    def code(self, node: E.Node, presence_code: Callable[[str], str] | None = None) -> str:
        """Python source for a folded expression over bound indices (``i_<name>``)."""
        return ast.unparse(self._py(node, presence_code))

    def _py(self, node: E.Node, presence_code) -> ast.expr:  # noqa: C901
        if isinstance(node, E.Name):
            if node.id in self.const:
                lit = _lit(self.const[node.id])
                if lit is None:
                    return ast.Name(self._name("C", self.const[node.id]), ast.Load())
                return self._py(lit, presence_code)
            if node.id in self.point.dtype_indices or node.id in self.sig.forall \
                    or node.id in self.sig.let:
                return ast.Name(f"i_{node.id}", ast.Load())
            if node.id in _dtype_names():
                return ast.Name(self._native(node.id), ast.Load())
            raise GenError(f"{node.id!r} has no value at call time")
        if isinstance(node, E.Int | E.Float | E.Str | E.Bool):
            return ast.Constant(node.value)
        if isinstance(node, E.NoneLit):
            return ast.Constant(None)
        if isinstance(node, E.Attr) and node.attr == "value":
            return self._py(node.value, presence_code)
        if isinstance(node, E.List | E.Tuple):
            return ast.Tuple([self._py(i, presence_code) for i in node.items], ast.Load())
        if isinstance(node, E.Starred):
            return ast.Starred(self._py(node.value, presence_code), ast.Load())
        if isinstance(node, E.Call):
            if node.func == "present":
                name = E.dotted_name(node.args[0])
                if presence_code is not None and name in self.sig.inputs:
                    return ast.parse(presence_code(name), mode="eval").body
                raise GenError(f"present({name}) was not folded")
            if node.func == "itemsize":
                return ast.Subscript(ast.Name("_isz", ast.Load()),
                                     self._py(node.args[0], presence_code), ast.Load())
            if is_dtype_call(node):
                return self.dtype_lookup(node, presence_code).code
            if node.func == "len":  # the builtin: the rank of a shape tuple
                return ast.Call(ast.Name("len", ast.Load()),
                                [self._py(node.args[0], presence_code)], [])
            prim = PRIMITIVES[node.func]
            fn = self._name("p_", prim.impl)
            return ast.Call(ast.Name(fn, ast.Load()),
                            [self._py(a, presence_code) for a in node.args],
                            [ast.keyword(k, self._py(v, presence_code)) for k, v in node.kwargs])
        if isinstance(node, E.UnaryOp | E.BinOp | E.BoolOp | E.Compare | E.IfExp):
            # rebuild through the expression module's own converter, then rename leaves
            py = E.to_python_ast(node)
            return _Rename(self, presence_code).visit(py)
        raise GenError(f"{E.unparse(node)} cannot be compiled")


_NOVALUE = object()


def _dtype_names() -> set[str]:
    from tileops.spec import DTYPES

    return set(DTYPES)


class _Rename(ast.NodeTransformer):
    """Maps the leaves of a converted expression onto generated names."""

    def __init__(self, gen: ExprCompiler, presence_code) -> None:
        self.gen = gen
        self.presence_code = presence_code

    def visit_Name(self, node: ast.Name) -> ast.AST:  # noqa: N802
        return self.gen._py(E.Name(node.id), self.presence_code)

    def visit_Call(self, node: ast.Call) -> ast.AST:  # noqa: N802
        back = E._from_py(node, "")  # the same closed grammar
        return self.gen._py(back, self.presence_code)

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:  # noqa: N802
        back = E._from_py(node, "")
        return self.gen._py(back, self.presence_code)

    def visit_List(self, node: ast.List) -> ast.AST:  # noqa: N802
        # a shape is a tuple at call time, as a list literal compiled on its own is (_py):
        # ``[*B, N] != [1, 1]`` compares tuples, not a list with a tuple
        self.generic_visit(node)
        return ast.Tuple(node.elts, ast.Load())


def subst(node: E.Node, env: Mapping[str, E.Node], consts: Mapping[str, Any]) -> E.Node:
    """Substitute family params by argument nodes; fold field reads of ADT discriminants."""
    if isinstance(node, E.Attr):
        base = E.dotted_name(node.value)
        if base in consts and isinstance(consts[base], AdtValue):
            lit = _lit(consts[base].fields[node.attr])
            if lit is not None:
                return lit
        return E.Attr(subst(node.value, env, consts), node.attr)
    if isinstance(node, E.Name):
        return env.get(node.id, node)
    if isinstance(node, E.List | E.Tuple):
        return type(node)(tuple(subst(i, env, consts) for i in node.items))
    if isinstance(node, E.Starred):
        return E.Starred(subst(node.value, env, consts))
    if isinstance(node, E.BinOp):
        return E.BinOp(node.op, subst(node.left, env, consts), subst(node.right, env, consts))
    if isinstance(node, E.UnaryOp):
        return E.UnaryOp(node.op, subst(node.operand, env, consts))
    if isinstance(node, E.Call):
        return E.Call(node.func, tuple(subst(a, env, consts) for a in node.args),
                      tuple((k, subst(v, env, consts)) for k, v in node.kwargs))
    if isinstance(node, E.Subscript):
        return E.Subscript(subst(node.value, env, consts),
                           tuple(subst(i, env, consts) for i in node.index))
    return node


def _lit(v: Any) -> E.Node | None:
    """The literal node for a folded value, or None if it has no literal form."""
    if isinstance(v, bool):
        return E.Bool(v)
    if isinstance(v, int):
        return E.Int(v) if v >= 0 else E.UnaryOp("-", E.Int(-v))
    if isinstance(v, float) and math.isfinite(v):  # -0.0 as a negation, as the parser has it
        return E.Float(v) if math.copysign(1.0, v) > 0 else E.UnaryOp("-", E.Float(-v))
    if isinstance(v, str):
        return E.Str(v)
    if v is None:
        return E.NoneLit()
    if isinstance(v, tuple | list) and all(isinstance(x, int) and not isinstance(x, bool)
                                           for x in v):
        return E.Tuple(tuple(_lit(x) for x in v))  # type: ignore[misc]
    return None

