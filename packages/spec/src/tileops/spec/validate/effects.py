"""The tensors of an entry and the ``effects`` rule.

An alias names an input of the same dtype and shape that is mutated, at least in some
calls: the output is that input object in the calls that write it and a fresh tensor in
the others (its dtype may be ``T if <mutated> else ...``: the input's where it is written). ``write_only`` is only on a mutated input; ``shape_only`` never on a mutated one
nor with ``values`` (its elements are never read or written); ``buffer`` never with ``alias``;
``returned`` reads construction params only, and never with ``alias`` or ``buffer``;
effect predicates depend only on construction params and presence, so they are fixed for a
constructed op; ``present(x)`` only on a tensor that may be absent (checked in
:mod:`.infer`).
"""

from __future__ import annotations

from .. import expr as E
from ..primitives import DTYPE_PRIMITIVES, GENERATORS
from ..schema import FALSE, TRUE, Expr, InputDecl, OutputDecl
from .context import EntryContext

__all__ = ["check_tensors"]


def check_tensors(ctx: EntryContext) -> None:
    """The tensors: names, dtypes and shapes of their kinds, and the ``effects`` rule:
    optional inputs come last; effect predicates read only construction params and
    presence; write_only needs mutated; shape_only excludes mutated and values; values is a generator call; aliases are consistent."""
    params_only = {n: k for n, k in ctx.model.kinds.items()
                   if ctx.model.sources.get(n) == "params"}
    first_optional = None
    for n in ctx.sig.inputs:
        if n in ctx.model.optional_inputs:
            first_optional = first_optional or n
        elif first_optional is not None:
            ctx.report.add(f"{ctx.sig_path}.inputs.{n}", f"input {n} is required but comes "
                           f"after the optional input {first_optional}; optional inputs come "
                           f"last, so a positional call can leave them out", "effects")
    for group, table in (("inputs", ctx.sig.inputs), ("outputs", ctx.sig.outputs)):
        for n, d in table.items():
            path = f"{ctx.sig_path}.{group}.{n}"
            if not E.is_name(n):
                ctx.report.add(path, f"{n!r} is not a valid tensor name", "index-source")
            if group == "inputs" and (not isinstance(d.dtype.node, E.Name)
                                      or d.dtype.node.id in ctx.sig.let):
                ctx.report.add(f"{path}.dtype", f"{d.dtype.text!r}: an input's dtype is a DType "
                               f"index or a dtype name, which the tensor's dtype is checked "
                               f"against; a computed dtype "
                               f"({', '.join(sorted(DTYPE_PRIMITIVES))}, or a let of one) is "
                               f"an output's", "kind")
            else:
                ctx.check(f"{path}.dtype", d.dtype, "dtype")
            if not isinstance(d.shape.node, E.List | E.Subscript):
                ctx.report.add(f"{path}.shape", f"{d.shape.text!r}: a shape is a list "
                               f"([M, N], [*S]) or a type family application (Mat[t, M, K])",
                               "kind")
            else:
                ctx.check(f"{path}.shape", d.shape, "shape")
            flags = (("optional", d.optional), ("mutated", d.mutated)) if group == "inputs" \
                else (("nullable", d.nullable),)
            for flag, ex in flags:
                bad = [m for m in ex.names() if m not in params_only
                       and m not in ctx.sig.inputs and m not in ctx.sig.outputs]
                if bad:
                    ctx.report.add(f"{path}.{flag}", f"{ex.text!r}: {flag} may depend only on "
                                   f"construction params and present(...); {bad[0]!r} is not "
                                   f"a construction param", "effects")
                    continue
                ctx.check(f"{path}.{flag}", ex, "bool")
            if group == "inputs":
                if d.write_only and d.mutated == Expr("False"):
                    ctx.report.add(f"{path}.write_only", "write_only is for an input the op "
                                   "writes; set mutated too", "effects")
                if d.shape_only and d.mutated != Expr("False"):
                    ctx.report.add(f"{path}.shape_only", "a shape_only input's elements are "
                                   "never read, so the op cannot write them either; drop "
                                   "mutated or shape_only", "effects")
                if d.shape_only and d.values is not None:
                    ctx.report.add(f"{path}.shape_only", "a shape_only input's elements are "
                                   "never read; a values generator would fill them for "
                                   "nothing; drop values or shape_only", "effects")
                if d.values is not None:
                    _check_values(ctx, f"{path}.values", d.values)
            else:
                _check_alias(ctx, path, n, d)
                _check_returned(ctx, path, d, params_only)
    if ctx.sig.outputs and all(d.returned == FALSE for d in ctx.sig.outputs.values()):
        ctx.report.add(f"{ctx.sig_path}.outputs", "every output is returned: false; a call must "
                       "return at least one", "effects")


def _check_returned(ctx: EntryContext, path: str, d: OutputDecl,
                    params_only: dict) -> None:
    """``returned`` is fixed for a constructed op (its result's arity never depends on a
    call): a bool or a predicate over construction params alone; an output the caller aliases
    or supplies (``alias``, ``buffer``) is always returned."""
    if d.returned == TRUE:
        return
    bad = [m for m in d.returned.names() if m not in params_only]
    if bad:
        ctx.report.add(f"{path}.returned", f"{d.returned.text!r}: returned may depend only on "
                       f"construction params (a result's arity is fixed when the op is built); "
                       f"{bad[0]!r} is not a construction param", "effects")
        return
    ctx.check(f"{path}.returned", d.returned, "bool")
    for flag, on in (("alias", d.alias is not None), ("buffer", d.buffer)):
        if on:
            ctx.report.add(f"{path}.returned", f"an output with {flag} is the caller's tensor "
                           f"and is always returned; drop returned or {flag}", "effects")


def _check_values(ctx: EntryContext, path: str, ex: Expr) -> None:
    if not (isinstance(ex.node, E.Call) and ex.node.func in GENERATORS):
        ctx.report.add(path, f"{ex.text!r}: values is a generator call, one of "
                       f"{', '.join(sorted(GENERATORS))}", "unknown-name")
        return
    ctx.check(path, ex, "any", generators=True)


def _check_alias(ctx: EntryContext, path: str, n: str, d: OutputDecl) -> None:
    if d.alias is None:
        return
    if d.buffer:
        ctx.report.add(f"{path}.buffer", "an aliased output is the input itself; it cannot also "
                       "take a caller's buffer", "effects")
    src = ctx.sig.inputs.get(d.alias)
    if src is None:
        ctx.report.add(f"{path}.alias", f"alias {d.alias!r} is not an input (inputs: "
                       f"{', '.join(ctx.sig.inputs) or 'none'})", "effects")
        return
    if src.mutated == Expr("False"):
        ctx.report.add(f"{path}.alias", f"output {n} aliases input {d.alias}, which is never "
                       f"written; declare mutated on {d.alias}", "effects")
    if not _same_where_written(src, d) or src.shape != d.shape:
        ctx.report.add(f"{path}.alias", f"output {n} aliases input {d.alias} but their types "
                       f"differ: Tensor[{src.dtype}, {src.shape}] vs "
                       f"Tensor[{d.dtype}, {d.shape}]", "effects")
    # A conditional mutation (mutated: inplace) is fine: the output is the input object
    # in the calls that write it and a fresh tensor in the others, as in the design
    # documents' activation example.


def _same_where_written(src: InputDecl, d: OutputDecl) -> bool:
    """Whether the aliased output has its input's dtype in every call that writes the input:
    the same dtype, or ``T if <mutated> else ...`` with the input's ``mutated`` predicate as
    the test (a clamp's output is promoted where it is fresh, and is ``x`` in place)."""
    if src.dtype == d.dtype:
        return True
    node = d.dtype.node
    return (isinstance(node, E.IfExp) and node.test == src.mutated.node
            and node.body == src.dtype.node)
