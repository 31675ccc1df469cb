"""The ``workload`` rule: every workload row instantiates.

A row gives every forall index that is not a dtype, every required param and every data
index, with values of their kinds; each dtype case gives the dtype indices from their
declared sets. Instantiating a row evaluates ``let``, the presence of optional inputs, the
refinements, every shape (no negative axis) and the generated values of metadata inputs.
"""

from __future__ import annotations

from typing import Any

from .. import expr as E
from ..evaluate import EvalError, Scope, eval_shape, evaluate
from ..kinds import DTypeK
from ..schema import Expr, Workload
from .context import EntryContext
from .values import conforms, to_value

__all__ = ["check_workloads"]


def check_workloads(ctx: EntryContext) -> None:
    """``workload``: every row gives its indices, params and data values, of their kinds;
    `some` names optional inputs; each dtype case gives the dtype indices from their sets.
    A row that passes is then instantiated once per dtype case."""
    forall_dtype = [n for n, k in ctx.model.kinds.items()
                    if ctx.model.sources.get(n) == "forall" and isinstance(k, DTypeK)]
    needed = [n for n in ctx.sig.forall if n not in forall_dtype]
    for i, row in enumerate(ctx.entry.workloads):
        path = f"{ctx.name}.workloads[{i}]"
        errors_before = len(ctx.report.items)
        allowed = set(ctx.sig.forall) | set(ctx.sig.params) | set(ctx.sig.data)
        for k in row.values:
            if k not in allowed:
                hint = " (let values are computed, not given)" if k in ctx.sig.let else ""
                ctx.report.add(f"{path}.{k}", f"{k!r} is not an index or a param of "
                               f"{ctx.name}{hint}", "workload")
        # an index only optional inputs give is needed where the row gives one of them
        missing = [n for n in needed if n not in row.values and not (
            n in ctx.model.optional_indices
            and not set(ctx.model.optional_indices[n]) & set(row.some))]
        missing += [n for n, p in ctx.sig.params.items()
                    if p.required and n not in row.values]
        missing += [n for n in ctx.sig.data if n not in row.values]
        if missing:
            ctx.report.add(path, f"workload {row.label!r} does not give "
                           f"{', '.join(missing)}", "workload")
        for k, v in row.values.items():
            kind = ctx.model.kinds.get(k)
            if kind is not None:
                err = conforms(v, kind, ctx.adts)
                if err:
                    ctx.report.add(f"{path}.{k}", f"{k} = {v!r} is not {kind}: {err}", "workload")
        for s in row.some:
            if s not in ctx.model.optional_inputs:
                ctx.report.add(f"{path}.some", f"some names {s!r}, which is not an optional "
                               f"input ({', '.join(sorted(ctx.model.optional_inputs)) or 'none'})",
                               "workload")
        cases = list(row.dtype_cases) or [{}]
        for j, case in enumerate(cases):
            cpath = f"{path}.dtype_cases[{j}]" if row.dtype_cases else path
            for n in forall_dtype:
                members = ctx.model.kinds[n].members  # type: ignore[attr-defined]
                if n not in case and len(members) != 1 and not (
                        n in ctx.model.optional_indices
                        and not set(ctx.model.optional_indices[n]) & set(row.some)):
                    ctx.report.add(cpath, f"dtype case does not give {n} "
                                   f"({' | '.join(members)})", "workload")
                elif n in case and case[n] not in members:
                    ctx.report.add(cpath, f"{n} = {case[n]!r} is not in "
                                   f"DType[{' | '.join(members)}]", "workload")
            for n in case:
                if n not in forall_dtype:
                    ctx.report.add(cpath, f"{n!r} is not a DType index of {ctx.name}",
                                   "workload")
        if len(ctx.report.items) > errors_before:
            continue
        for j, case in enumerate(cases):
            _instantiate(ctx, row, case,
                         f"{path}.dtype_cases[{j}]" if row.dtype_cases else path)


def _instantiate(ctx: EntryContext, row: Workload, case: dict, path: str) -> None:
    """One row in one dtype case: let evaluates, omitted optional inputs may be omitted,
    refinements hold, shapes have no negative axis and generated values fill their tensor."""
    values: dict[str, Any] = {}
    for n, k in ctx.model.kinds.items():
        src = ctx.model.sources.get(n)
        if src == "let":
            continue
        if n in case:
            values[n] = case[n]
        elif n in row.values:
            values[n] = to_value(row.values[n], k, ctx.adts)
        elif src == "params":
            values[n] = to_value(ctx.sig.params[n].default, k, ctx.adts)
        elif isinstance(k, DTypeK) and len(k.members) == 1:
            values[n] = k.members[0]
    present = {n: (n in row.some) for n in ctx.model.optional_inputs}
    scope = Scope(values, ctx.sig.types, present)
    try:
        for n in ctx.model.let_order:
            values[n] = evaluate(ctx.sig.let[n].node, scope)
    except EvalError as exc:
        ctx.report.add(path, f"workload {row.label!r}: let {n} = "
                       f"{ctx.sig.let[n].text}: {exc}", "workload")
        return
    for n in ctx.model.optional_inputs:
        d = ctx.sig.inputs[n]
        if d.optional != Expr("True"):
            try:
                may_omit = evaluate(d.optional.node, scope)
            except EvalError as exc:
                ctx.report.add(path, f"workload {row.label!r}: optional of {n}: {exc}",
                               "workload")
                return
            if not may_omit and not present[n]:
                ctx.report.add(path, f"workload {row.label!r} omits {n}, which is required "
                               f"here ({d.optional.text} is False)", "workload")
    for rule in ctx.sig.shape_rules:
        try:
            ok = evaluate(rule.node, scope)
        except EvalError as exc:
            ctx.report.add(path, f"workload {row.label!r}: refinement {rule.text!r}: {exc}",
                           "workload")
            continue
        if not ok:
            shown = ", ".join(f"{n}={values[n]!r}" for n in rule.names() if n in values)
            ctx.report.add(path, f"workload {row.label!r} breaks refinement {rule.text!r} "
                           f"({shown})", "workload")
    for group, table in (("inputs", ctx.sig.inputs), ("outputs", ctx.sig.outputs)):
        for n, d in table.items():
            if group == "inputs" and n in present and not present[n]:
                continue
            try:
                shape = eval_shape(d.shape.node, scope)
            except EvalError as exc:
                ctx.report.add(path, f"workload {row.label!r}: shape of {n} "
                               f"({d.shape.text}): {exc}", "workload")
                continue
            if group == "outputs" and isinstance(d.dtype.node, E.Call):
                try:  # a computed dtype: these dtypes and ranks must have one
                    evaluate(d.dtype.node, scope)
                except EvalError as exc:
                    ctx.report.add(path, f"workload {row.label!r}: dtype of {n}: {exc}",
                                   "workload")
            if any(s < 0 for s in shape):
                ctx.report.add(path, f"workload {row.label!r}: {n} would have shape {shape} "
                               f"({d.shape.text}), with a negative axis", "workload")
            if group == "inputs" and d.values is not None:
                try:
                    data = evaluate(d.values.node, Scope(values, ctx.sig.types, present,
                                                         generators=True))
                except EvalError as exc:
                    ctx.report.add(path, f"workload {row.label!r}: values of {n}: {exc}",
                                   "workload")
                    continue
                numel = 1
                for s in shape:
                    numel *= s
                if len(data) != numel:
                    ctx.report.add(path, f"workload {row.label!r}: values of {n} "
                                   f"({d.values.text}) gives {len(data)} elements, but its shape "
                                   f"{shape} holds {numel}", "workload")
