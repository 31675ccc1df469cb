"""The rules on an entry's declarations: index sources and param defaults, ``let`` cycles,
refinements, the roofline formulas and the composition of a composite op."""

from __future__ import annotations

from ..expr import is_name
from ..schema import Expr
from .context import EntryContext
from .values import conforms

__all__ = [
    "check_composition",
    "check_lets",
    "check_refinements",
    "check_roofline",
    "check_sources",
]


def check_sources(ctx: EntryContext) -> None:
    """``index-source`` and ``default``: every index has one source (forall, params, let or
    data) and a valid name distinct from the tensors' and the families'; the model gets each
    index's kind and source, and which tensors may be absent. A param's default must be a
    value of its kind."""
    seen: dict[str, str] = {}
    groups = [
        ("forall", ctx.sig.forall),
        ("params", ctx.sig.params),
        ("let", ctx.sig.let),
        ("data", ctx.sig.data),
    ]
    tensor_names = set(ctx.sig.inputs) | set(ctx.sig.outputs)
    for group, table in groups:
        for n in table:
            path = f"{ctx.sig_path}.{group}.{n}"
            if not is_name(n):
                ctx.report.add(path, f"{n!r} is not a valid index name", "index-source")
                continue
            if n in seen:
                ctx.report.add(
                    path,
                    f"index {n!r} has two sources: {seen[n]} and {group}; an index is "
                    f"declared exactly once",
                    "index-source",
                )
                continue
            if n in tensor_names:
                ctx.report.add(path, f"{n!r} names both an index and a tensor", "index-source")
            if n in ctx.sig.types:
                ctx.report.add(path, f"{n!r} names both an index and a type family",
                               "index-source")
            seen[n] = group
            ctx.model.sources[n] = group
    for n, ex in ctx.sig.forall.items():
        k = ctx.kind_of(f"{ctx.sig_path}.forall.{n}", ex)
        if k is not None:
            ctx.model.kinds[n] = k
        else:
            ctx.broken.add(n)
    for n, prm in ctx.sig.params.items():
        k = ctx.kind_of(f"{ctx.sig_path}.params.{n}.type", prm.type)
        if ctx.model.sources.get(n) != "params":
            continue  # a second source, already reported: the first one's kind stands
        if k is None:
            ctx.broken.add(n)
            continue
        ctx.model.kinds[n] = k
        if not prm.required:
            err = conforms(prm.default, k, ctx.adts)
            if err:
                ctx.report.add(f"{ctx.sig_path}.params.{n}.default",
                               f"default {prm.default!r} is not {k}: {err}", "default")
    for n, ex in ctx.sig.data.items():
        k = ctx.kind_of(f"{ctx.sig_path}.data.{n}", ex)
        if ctx.model.sources.get(n) != "data":
            continue  # a second source, already reported: the first one's kind stands
        if k is None:
            ctx.broken.add(n)
        else:
            ctx.model.kinds[n] = k
    for n, d in ctx.sig.inputs.items():
        if d.optional != Expr("False"):
            ctx.model.optional_inputs.add(n)
    for n, d in ctx.sig.outputs.items():
        if d.nullable != Expr("False"):
            ctx.model.nullable_outputs.add(n)


def check_lets(ctx: EntryContext) -> None:
    """``let-cycle``: the let definitions in an order where each comes after those it reads,
    or the first cycle; then each definition's kind."""
    deps = {n: [m for m in ex.names() if m in ctx.sig.let] for n, ex in ctx.sig.let.items()}
    order: list[str] = []
    state: dict[str, int] = {}

    def visit(n: str, stack: list[str]) -> bool:
        if state.get(n) == 2:
            return True
        if state.get(n) == 1:
            cyc = stack[stack.index(n):] + [n]
            ctx.report.add(f"{ctx.sig_path}.let.{cyc[0]}", "let has a cycle: " + " -> ".join(cyc),
                           "let-cycle")
            return False
        state[n] = 1
        ok = all(visit(m, stack + [n]) for m in deps[n])
        state[n] = 2
        order.append(n)
        return ok

    for n in ctx.sig.let:
        if not visit(n, []):
            return
    ctx.model.let_order = order
    for n in order:
        k = ctx.check(f"{ctx.sig_path}.let.{n}", ctx.sig.let[n], "any")
        if k is not None and ctx.model.sources.get(n) == "let":
            ctx.model.kinds[n] = k


def check_refinements(ctx: EntryContext) -> None:
    """Every refinement is a Bool predicate."""
    for i, ex in enumerate(ctx.sig.shape_rules):
        ctx.check(f"{ctx.sig_path}.shape_rules[{i}]", ex, "bool")


def check_roofline(ctx: EntryContext) -> None:
    """The roofline formulas are numbers."""
    rf = ctx.entry.roofline
    if rf is None:
        return
    ctx.check(f"{ctx.name}.roofline.flops", rf.flops, "num")
    if rf.bytes is not None:
        ctx.check(f"{ctx.name}.roofline.bytes", rf.bytes, "num")


def check_composition(ctx: EntryContext) -> None:
    """``composition``: stages are uniquely named and run known ops other than the op."""
    comp = ctx.entry.composition
    if comp is None:
        return
    seen: set[str] = set()
    for i, st in enumerate(comp.stages):
        path = f"{ctx.name}.composition.stages[{i}]"
        if st.name in seen:
            ctx.report.add(path, f"stage {st.name!r} is declared twice", "composition")
        seen.add(st.name)
        if ctx.known_ops is not None and st.op not in ctx.known_ops:
            ctx.report.add(path, f"stage {st.name!r} runs {st.op!r}, which is not a known op",
                           "composition")
        if st.op == ctx.name:
            ctx.report.add(path, f"{ctx.name} cannot be a stage of itself", "composition")

