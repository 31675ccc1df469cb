"""Print an entry's signature in the notation of the design documents::

    GemmFwdOp(trans_a trans_b : Bool) : forall (M N K : Dim) (T : DType[float16 | bfloat16]).
        Tensor[T, Mat[trans_a, M, K]] -> Tensor[T, Mat[trans_b, K, N]] -> Tensor[T, [M, N]]
"""

from __future__ import annotations

from .kinds import KindError, kind_from_expr
from .schema import Expr, OpEntry

__all__ = ["render_binders", "render_entry", "render_family", "render_signature"]


def render_binders(table: dict[str, Expr], adts: set[str] | frozenset[str] = frozenset(),
                   sep: str = " ") -> str:
    """``{M: Dim, N: Dim, T: DType[...]}`` -> ``(M N : Dim) (T : DType[...])``; consecutive
    names of one kind share a binder, their names joined by ``sep``."""
    groups: list[tuple[str, list[str]]] = []
    for name, ex in table.items():
        try:
            kind = str(kind_from_expr(ex.node, adts or _names_in(ex)))
        except KindError:
            kind = ex.text
        if groups and groups[-1][0] == kind:
            groups[-1][1].append(name)
        else:
            groups.append((kind, [name]))
    return " ".join(f"({sep.join(ns)} : {k})" for k, ns in groups)


def _names_in(ex: Expr) -> set[str]:
    return set(ex.names())  # unknown capitalised names read as ADT names when printing


def _tensor(dtype: Expr, shape: Expr, suffix: str = "") -> str:
    return f"Tensor[{dtype.text}, {shape.text}]{suffix}"


def render_signature(name: str, entry: OpEntry) -> str:
    sig = entry.signature
    params = {n: p.type for n, p in sig.params.items()}
    head = name + render_binders(params)
    quant = render_binders(sig.forall)
    ins = []
    for n, d in sig.inputs.items():
        marks = []
        if d.optional.text not in ("False", "false"):
            marks.append("?" if d.optional.text in ("True", "true") else f"? if {d.optional.text}")
        if d.mutated.text not in ("False", "false"):
            marks.append("!" if d.mutated.text in ("True", "true") else f"! if {d.mutated.text}")
        if d.device == "any":
            marks.append("any device")
        ins.append(f"{n}: " + _tensor(d.dtype, d.shape) + (f" {{{', '.join(marks)}}}" if marks
                                                          else ""))
    outs = []
    for n, d in sig.outputs.items():
        extra = f" = {d.alias}" if d.alias else ""
        if d.nullable.text not in ("False", "false"):
            extra += " | None"
        if d.returned.text not in ("True", "true"):
            extra += f" {{returned if {d.returned.text}}}"
        outs.append(f"{n}: " + _tensor(d.dtype, d.shape) + extra)
    out = outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ")"
    arrow = " -> ".join([*ins, out])
    text = f"{head} : forall {quant}.\n    {arrow}" if quant else f"{head} :\n    {arrow}"
    return text


def render_entry(name: str, entry: OpEntry) -> str:
    sig = entry.signature
    lines = [f"# {name}  (family {entry.family}, {entry.status}"
             + (f", like {entry.ref_api})" if entry.ref_api else ")"),
             render_signature(name, entry)]
    for fname, fam in sig.types.items():
        lines.append(f"  where {render_family(fname, fam)}")
    for n, ex in sig.let.items():
        lines.append(f"  let {n} = {ex.text}")
    for ex in sig.shape_rules:
        lines.append(f"  require {ex.text}")
    if entry.roofline:
        lines.append(f"  flops = {entry.roofline.flops.text}")
        if entry.roofline.bytes:
            lines.append(f"  bytes = {entry.roofline.bytes.text}")
    if entry.composition:
        stages = ", ".join(f"{s.name}: {s.op}" for s in entry.composition.stages)
        lines.append(f"  stages {stages}")
    lines.append(f"  {len(entry.workloads)} workloads")
    return "\n".join(lines)


def render_family(name: str, fam) -> str:
    """``Mat[t: Bool, R: Dim, C: Dim] = match t { false -> [R, C]; true -> [C, R] }``."""
    params = ", ".join(f"{p}: {k.text}" for p, k in fam.params.items())
    match = fam.match if isinstance(fam.match, str) else ", ".join(fam.match)
    cases = "; ".join(f"{_when(c.when)} -> {c.is_.text}" for c in fam.cases)
    return f"{name}[{params}] = match {match} {{ {cases} }}"


def _when(w) -> str:
    if isinstance(w, bool):
        return str(w).lower()
    if isinstance(w, list | tuple):
        return "(" + ", ".join(_when(x) for x in w) + ")"
    return str(w)
