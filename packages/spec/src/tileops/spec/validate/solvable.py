"""The ``solvable`` rule: every forall index is solved by unification from the required
inputs: a bare axis, an affine axis with one unknown (``[2 * M + 1]``), the only
unknown-length splice of a shape (``[*B, N]``), or the dtype of a required input. The solver
tries every case of every family application, so an index one case hides is reported with
the case.

An index that only optional inputs read (``min_bound: {shape: "[*SM]", optional: true}``) has
a value only in calls that give one of them. It may appear in those inputs' shapes and in
shape rules guarded by the presence of one of them (``not present(min_bound) or
expands_to(SM, S)``), and in the shape and dtype of an output that is None wherever they are
absent (``nullable: "not grad_weight or not present(weight)"``), nowhere else: any other
output, a let or a roofline must be computable in every call.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from .. import expr as E
from ..kinds import DimK, DTypeK, IntK, Kind, ShapeK
from ..schema import TypeFamily
from .context import EntryContext

__all__ = ["check_solvable"]


def check_solvable(ctx: EntryContext) -> None:
    """``solvable``: for every choice of case of every family application in the required
    inputs, each forall index is read by unification (a dtype index from an input's dtype).
    Skipped when the declarations themselves are broken."""
    if ctx.has("kind", "unknown-name", "family", "index-source"):
        return
    targets = [n for n in ctx.sig.forall if n in ctx.model.kinds]
    required = [(n, d) for n, d in ctx.sig.inputs.items()
                if n not in ctx.model.optional_inputs]
    dtype_solved = {d.dtype.node.id for _, d in required if isinstance(d.dtype.node, E.Name)}
    apps = _family_apps([d.shape.node for _, d in required], ctx.sig.types)
    choices = [[(app, i) for i in range(len(ctx.sig.types[app[0]].cases))] for app in apps]
    unsolved: dict[str, str] = {}
    for combo in itertools.product(*choices) if choices else [()]:
        chosen = dict(combo)
        forms = [_instantiate_shape(d.shape.node, ctx.sig.types, chosen) for _, d in required]
        known = {n for n, s in ctx.model.sources.items() if s == "params"}
        solved = _solve(forms, set(targets), known, ctx.model.kinds)
        for n in targets:
            k = ctx.model.kinds[n]
            ok = n in dtype_solved if isinstance(k, DTypeK) else n in solved
            if not ok and n not in unsolved:
                unsolved[n] = ", ".join(
                    f"{app[0]}[{', '.join(map(E.unparse, app[1]))}] is "
                    f"{ctx.sig.types[app[0]].cases[i].is_.text}"
                    for app, i in combo) if combo else ""
    optional_only = _optional_only(ctx, unsolved, set(targets), apps)
    for n, where in unsolved.items():
        if n in optional_only:
            continue
        k = ctx.model.kinds[n]
        how = ("no required input has dtype " + n) if isinstance(k, DTypeK) else (
            f"{n} does not appear where unification can read it (a bare axis, an affine "
            f"axis like 2 * {n} + 1, or the only unknown-length *{n} of a required input)")
        ctx.report.add(f"{ctx.sig_path}.forall.{n}", f"forall index {n} is not solvable from the "
                       f"inputs: {how}" + (f" (when {where})" if where else ""), "solvable")


def _optional_only(ctx: EntryContext, unsolved: Mapping[str, str], targets: set[str],
                   apps: list[tuple]) -> set[str]:
    """The unsolved indices that optional inputs solve (with the required ones) and that are
    read only where those inputs are given; a use elsewhere is reported here."""
    readers: dict[str, list[str]] = {}
    for n, d in ctx.sig.inputs.items():
        if n not in ctx.model.optional_inputs:
            continue
        names = set(d.shape.names())
        if isinstance(d.dtype.node, E.Name):
            names.add(d.dtype.node.id)
        for m in names & set(unsolved):
            readers.setdefault(m, []).append(n)
    if not readers:
        return set()
    required = [d.shape.node for n, d in ctx.sig.inputs.items()
                if n not in ctx.model.optional_inputs]
    given = [d.shape.node for n, d in ctx.sig.inputs.items()
             if n in ctx.model.optional_inputs and not _family_apps([d.shape.node],
                                                                    ctx.sig.types)]
    known = {n for n, s in ctx.model.sources.items() if s == "params"}
    solved = targets - set(unsolved)
    ok: set[str] = set()
    for m in readers:
        if isinstance(ctx.model.kinds[m], DTypeK):
            ok.add(m)  # read as the dtype of an optional input
            continue
        if apps:  # family cases may hide it: left to the required inputs' report
            continue
        if m in _solve([*required, *given], targets, known | solved, ctx.model.kinds):
            ok.add(m)
    for m in ok:
        ins = readers[m]
        ctx.model.optional_indices[m] = tuple(ins)
        guard = " or ".join(f"'not present({i}) or ...'" for i in ins)
        for path, ex in _uses(ctx, m, ins):
            ctx.report.add(path, f"{ex.text!r} reads {m}, which only the optional input"
                           f"{'s' if len(ins) > 1 else ''} {', '.join(ins)} give"
                           f"{'' if len(ins) > 1 else 's'}: it may appear only in "
                           f"{'their' if len(ins) > 1 else 'its'} declaration and in shape "
                           f"rules of the form {guard}", "solvable")
    return ok


def _uses(ctx: EntryContext, m: str, readers: list[str]):
    """(path, expression) of each place of the entry that reads index ``m`` outside the
    optional inputs ``readers``, the shape rules their presence guards and the outputs that
    are None where they are absent."""
    sig, p = ctx.sig, ctx.sig_path
    for n, d in sig.inputs.items():
        fields = [("optional", d.optional), ("mutated", d.mutated)]
        if n not in readers:
            fields += [("shape", d.shape), ("dtype", d.dtype)]
        if d.values is not None:
            fields.append(("values", d.values))
        for f, ex in fields:
            if m in ex.names():
                yield f"{p}.inputs.{n}.{f}", ex
    for n, d in sig.outputs.items():
        # an output that is None wherever a reader is absent (nullable 'not present(i) or
        # ...') has its shape and dtype computed only where that reader gives its indices
        fields = [("nullable", d.nullable), ("returned", d.returned)]
        if not _guarded(d.nullable.node, readers):
            fields = [("shape", d.shape), ("dtype", d.dtype), *fields]
        for f, ex in fields:
            if m in _read(ex.node, readers):
                yield f"{p}.outputs.{n}.{f}", ex
    for n, ex in sig.let.items():
        if m in _read(ex.node, readers):
            yield f"{p}.let.{n}", ex
    for i, ex in enumerate(sig.shape_rules):
        if m in _read(ex.node, readers) and not _guarded(ex.node, readers):
            yield f"{p}.shape_rules[{i}]", ex
    roof = ctx.entry.roofline
    if roof is not None:
        for f, ex in (("flops", roof.flops), ("bytes", roof.bytes)):
            if ex is not None and m in ex.names():
                yield f"{ctx.name}.roofline.{f}", ex


def _presence_test(node: E.Node) -> tuple[str, bool] | None:
    """``(i, True)`` for ``present(i)``, ``(i, False)`` for ``not present(i)``, else None."""
    positive = True
    if isinstance(node, E.UnaryOp) and node.op == "not":
        node, positive = node.operand, False
    if isinstance(node, E.Call) and node.func == "present" and node.args:
        name = E.dotted_name(node.args[0])
        if name is not None:
            return name, positive
    return None


def _read(node: E.Node, readers: list[str]) -> set[str]:
    """The names ``node`` reads where the inputs ``readers`` may be absent: the branch of
    ``A if present(i) else B`` (``B if not present(i) else A``) that only a given ``i``
    takes is read only where ``i`` gives its indices (the clamp's ``TM if present(min_bound)
    else T``), so its names do not count."""
    if isinstance(node, E.IfExp):
        test = _presence_test(node.test)
        if test is not None and test[0] in readers:
            return _read(node.orelse if test[1] else node.body, readers)
    out = {node.id} if isinstance(node, E.Name) else set()
    for child in E.children(node):
        out |= _read(child, readers)
    return out


def _guarded(node: E.Node, readers: list[str]) -> bool:
    """Whether a rule is ``not present(i) or ...`` for one of ``readers``: true wherever
    ``i`` is absent, so the rest is evaluated only where ``i`` gives its indices."""
    if not (isinstance(node, E.BoolOp) and node.op == "or"):
        return False
    return any(isinstance(v, E.UnaryOp) and v.op == "not" and isinstance(v.operand, E.Call)
               and v.operand.func == "present" and v.operand.args
               and E.dotted_name(v.operand.args[0]) in readers for v in node.values)


def _family_apps(shapes: list[E.Node], families: Mapping[str, TypeFamily]) -> list[tuple]:
    """Each distinct family application in ``shapes``, as (family name, arguments)."""
    apps: dict[tuple, None] = {}
    for s in shapes:
        for n in E.walk(s):
            if isinstance(n, E.Subscript) and E.dotted_name(n.value) in families:
                apps[(E.dotted_name(n.value), n.index)] = None
    return list(apps)


def _substitute(node: E.Node, env: Mapping[str, E.Node]) -> E.Node:
    """``node`` with the names of ``env`` replaced (a family case's parameters by the
    application's arguments)."""
    if isinstance(node, E.Name):
        return env.get(node.id, node)
    if isinstance(node, E.List | E.Tuple):
        return type(node)(tuple(_substitute(i, env) for i in node.items))
    if isinstance(node, E.Starred):
        return E.Starred(_substitute(node.value, env))
    if isinstance(node, E.BinOp):
        return E.BinOp(node.op, _substitute(node.left, env), _substitute(node.right, env))
    if isinstance(node, E.UnaryOp):
        return E.UnaryOp(node.op, _substitute(node.operand, env))
    if isinstance(node, E.Call):
        return E.Call(node.func, tuple(_substitute(a, env) for a in node.args),
                      tuple((k, _substitute(v, env)) for k, v in node.kwargs))
    return node


def _instantiate_shape(shape: E.Node, families, chosen: Mapping[tuple, int]) -> E.Node:
    """The shape with each family application replaced by its chosen case (spliced where
    it is starred inside a list)."""
    if isinstance(shape, E.Subscript):
        name = E.dotted_name(shape.value)
        fam = families[name]
        case = fam.cases[chosen[(name, shape.index)]]
        env = dict(zip(fam.params, shape.index, strict=True))
        return _substitute(case.is_.node, env)
    if isinstance(shape, E.List):
        items: list[E.Node] = []
        for it in shape.items:
            if isinstance(it, E.Starred) and isinstance(it.value, E.Subscript) \
                    and E.dotted_name(it.value.value) in families:
                inner = _instantiate_shape(it.value, families, chosen)
                if isinstance(inner, E.List):
                    items.extend(inner.items)
                    continue
            items.append(it)
        return E.List(tuple(items))
    return shape


def _affine_unknown(node: E.Node, known: set[str], dims: set[str]) -> str | None:
    """The single unknown Dim in an invertible (+, -, * by known) expression, if any."""
    unknown = [n for n in E.names(node) if n not in known]
    if len(unknown) != 1 or unknown[0] not in dims:
        return None

    def invertible(n: E.Node) -> bool:
        if isinstance(n, E.Name | E.Int):
            return True
        if isinstance(n, E.BinOp) and n.op in ("+", "-"):
            return invertible(n.left) and invertible(n.right)
        if isinstance(n, E.BinOp) and n.op == "*":
            lu = any(x not in known for x in E.names(n.left))
            ru = any(x not in known for x in E.names(n.right))
            return not (lu and ru) and invertible(n.left) and invertible(n.right)
        if isinstance(n, E.UnaryOp) and n.op == "-":
            return invertible(n.operand)
        return not any(x not in known for x in E.names(n))

    return unknown[0] if invertible(node) else None


def _solve(forms: list[E.Node], targets: set[str], known: set[str],
           kinds: Mapping[str, Kind]) -> set[str]:
    """The names unification reads from the shape lists ``forms``, starting from ``known``
    and repeating until nothing new is solved."""
    solved = set(known)
    dims = {n for n, k in kinds.items() if isinstance(k, DimK | IntK)}
    shapes = {n for n, k in kinds.items() if isinstance(k, ShapeK)}
    changed = True
    while changed:
        changed = False
        for form in forms:
            if not isinstance(form, E.List):
                continue
            items = form.items
            unknown_stars = [i for i, it in enumerate(items) if isinstance(it, E.Starred)
                             and any(n not in solved for n in E.names(it.value))]
            if len(unknown_stars) <= 1:
                positional = range(len(items))
            else:  # only the axes before the first / after the last unknown star are placed
                positional = [*range(unknown_stars[0]), *range(unknown_stars[-1] + 1, len(items))]
            for i in positional:
                it = items[i]
                if isinstance(it, E.Starred):
                    if isinstance(it.value, E.Name) and it.value.id in shapes \
                            and it.value.id not in solved and len(unknown_stars) == 1:
                        solved.add(it.value.id)
                        changed = True
                    continue
                n = _affine_unknown(it, solved, dims)
                if n is not None and n not in solved:
                    solved.add(n)
                    changed = True
    return solved
