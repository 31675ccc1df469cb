"""``explain``: a signature in the design documents' notation, and its generated code.

    GemmFwdOp(trans_a, trans_b : Bool) : forall (M N K : Dim) (T : DType[float16 | bfloat16]).
        Tensor[T, Mat[trans_a, M, K]] -> Tensor[T, Mat[trans_b, K, N]] -> Tensor[T, [M, N]]
"""

from __future__ import annotations

from typing import Any

from tileops.spec import OpEntry
from tileops.spec.show import render_binders, render_family

from .plan import SignaturePlan

__all__ = ["explain"]


def _tensor(d: Any) -> str:
    return f"Tensor[{d.dtype.text}, {d.shape.text}]"


def explain(target: SignaturePlan | tuple[str, OpEntry], *, code: bool = False,
            params: dict[str, Any] | None = None, adts: set[str] | None = None) -> str:
    """The signature of ``target`` (a plan, or ``(name, entry)``) in mathematical notation,
    its type families, effects and roofline; with ``code=True`` also the generated source at
    the construction point ``params`` (defaults where not given)."""
    if isinstance(target, SignaturePlan):
        plan: SignaturePlan | None = target
        name, entry, adt_names = target.name, target.entry, set(target.adts)
    else:
        plan = None
        (name, entry), adt_names = target, set(adts or ())
    sig = entry.signature
    head = name
    if sig.params:
        head += render_binders({n: p.type for n, p in sig.params.items()}, adt_names, ", ")
    quant = render_binders(sig.forall, adt_names)
    arrows = [_tensor(d) for d in sig.inputs.values()]
    outs = [_tensor(d) for d in sig.outputs.values()]
    arrows.append(outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ")")
    lines = [f"{head} : forall {quant}." if quant else f"{head} :",
             "    " + " -> ".join(arrows)]
    for fname, fam in sig.types.items():
        lines.append(f"  {render_family(fname, fam)}")
    for n, ex in sig.let.items():
        lines.append(f"  let {n} = {ex.text}")
    for ex in sig.shape_rules:
        lines.append(f"  where {ex.text}")
    effects = []
    for n, d in sig.inputs.items():
        if d.optional.text not in ("False",):
            effects.append(f"{n} optional" + ("" if d.optional.text == "True"
                                               else f" when {d.optional.text}"))
        if d.mutated.text not in ("False",):
            effects.append(f"writes {n}" + ("" if d.mutated.text == "True"
                                             else f" when {d.mutated.text}")
                           + (" (write-only)" if d.write_only else ""))
        if d.device == "any":  # exempt from the call's device comparison
            effects.append(f"{n} on any device")
        if d.shape_only:
            effects.append(f"reads only the shape of {n}")
    for n, d in sig.outputs.items():
        if d.alias:
            effects.append(f"{n} is {d.alias} when {d.alias} is written")
        if d.buffer:
            effects.append(f"{n} may be given (out=)")
        if d.nullable.text not in ("False",):
            effects.append(f"{n} is None when {d.nullable.text}")
        if d.returned.text not in ("True",):
            effects.append(f"{n} is left out of the result unless {d.returned.text}")
    if effects:
        lines.append("  effects: " + "; ".join(effects))
    if entry.roofline is not None:
        lines.append(f"  flops = {entry.roofline.flops.text}")
        lines.append("  bytes = " + (entry.roofline.bytes.text if entry.roofline.bytes
                                     else "traffic from the effects"))
    text = "\n".join(lines)
    if code:
        if plan is None:
            raise ValueError("code=True needs a SignaturePlan")
        text += "\n\n" + plan.construct(**(params or {})).source()
    return text

