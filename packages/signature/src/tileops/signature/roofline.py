"""Traffic and roofline: the two generated functions of a point that read a record.

``traffic(c)`` counts the bytes each tensor moves, from the effects of the branch the call
took; ``roofline(c)`` evaluates the spec's ``flops`` and ``bytes`` formulas over the record's
index values (compiled like every other expression, by :mod:`.fold`). Both are written after
the checks and ``derive``, whose ``derive(c)`` they call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from tileops.spec import Signature

    from .fold import ExprCompiler

__all__ = ["roofline_lines", "traffic_lines"]


def traffic_lines(sig: Signature) -> list[str]:
    """``traffic(c)``: per tensor, ``(bytes read, bytes written)`` from the effects. An input
    is read unless it is ``write_only`` or ``shape_only``, and written when the branch writes
    it; an output is written unless it aliases an input the branch writes (that write is
    counted there)."""
    L: list[str] = []
    L.append("def traffic(c):")
    L.append("    _, os, od = derive(c)")
    L.append("    s, d, w = c.input_shapes, c.input_dtypes, c.branch[0]")
    L.append("    out = {}")
    for i, (n, decl) in enumerate(sig.inputs.items()):
        read = "0" if decl.write_only or decl.shape_only else f"_prod(s[{i}]) * _isz[d[{i}]]"
        L.append(f"    if s[{i}] is not None:")
        L.append(f"        out[{n!r}] = ({read}, _prod(s[{i}]) * _isz[d[{i}]] "
                 f"if {n!r} in w else 0)")
    for i, (n, decl) in enumerate(sig.outputs.items()):
        alias = decl.alias
        L.append(f"    if os[{i}] is not None:")
        if alias is not None:
            L.append(f"        if {alias!r} not in w:")
            L.append(f"            out[{n!r}] = (0, _prod(os[{i}]) * _isz[od[{i}]])")
        else:
            L.append(f"        out[{n!r}] = (0, _prod(os[{i}]) * _isz[od[{i}]])")
    L.append("    return out")
    L.append("")
    return L


def roofline_lines(exprs: ExprCompiler, index_names: tuple[str, ...],
                   lazy: Mapping[str, tuple[str, int, int]]) -> list[str]:
    """``roofline(c)``: ``(flops, bytes)`` from the spec's formulas over the record's index
    values (a lazily sliced Shape index sliced here); bytes from ``traffic(c)`` when the
    spec gives no formula, and no flops when it gives no roofline."""
    L: list[str] = []
    rf = exprs.plan.entry.roofline
    L.append("def roofline(c):")
    if index_names:
        L.append(f"    {', '.join('i_' + n for n in index_names)}, = c.values")
    # an index of an optional input only (the roofline never reads one) is None where the
    # input is absent: not sliced
    optional_only = set(exprs.optional_indices(
        {n: False for n in exprs.plan.optional_inputs}))
    for n, (_, a, b) in lazy.items():
        cut = f"i_{n}[{a or ''}:{f'len(i_{n}) - {b}' if b else ''}]"
        L.append(f"    i_{n} = {cut} if i_{n} is not None else None" if n in optional_only
                 else f"    i_{n} = {cut}")
    idx = {n: i for i, n in enumerate(exprs.sig.inputs)}

    def presence(name: str) -> str:
        return f"(c.input_shapes[{idx[name]}] is not None)"

    bound = set(index_names)
    if rf is None:
        L.append("    flops = 0")
    else:
        L.append(f"    flops = {exprs.code(exprs.fold(rf.flops.node, {}, bound), presence)}")
    if rf is not None and rf.bytes is not None:
        L.append(f"    nbytes = {exprs.code(exprs.fold(rf.bytes.node, {}, bound), presence)}")
    else:
        L.append("    nbytes = sum(r + w for r, w in traffic(c).values())")
    L.append("    return int(flops), int(nbytes)")
    return L
