"""The ``family`` rule: type families are total over their discriminants, with no case twice.

A family matches on one or more parameters of a finite kind (Bool, an enum, a DType or an
ADT's constructors); the cases are tried in order, ``_`` matches anything. Coverage is
computed over the product of the discriminants' domains.
"""

from __future__ import annotations

import itertools
from typing import Any

from .. import expr as E
from ..expr import is_name
from ..kinds import AdtK, Kind, is_discriminant
from .context import EntryContext
from .values import case_key, domain, fmt_value, same_value

__all__ = ["check_families"]


def check_families(ctx: EntryContext) -> None:
    """``family``: every type family matches on parameters of a finite kind, each case's
    ``when`` is a value of them, no case is covered by earlier ones, and together they are
    total; each case is a shape over the family's parameters."""
    for fname, fam in ctx.sig.types.items():
        path = f"{ctx.sig_path}.types.{fname}"
        if not is_name(fname):
            ctx.report.add(path, f"{fname!r} is not a valid type family name (an identifier "
                           f"that is not a Python keyword)", "family")
            continue
        kinds: dict[str, Kind] = {}
        for pn, pex in fam.params.items():
            k = ctx.kind_of(f"{path}.params.{pn}", pex)
            if k is not None:
                kinds[pn] = k
        fam_broken = set(fam.params) - set(kinds)
        ctx.family_kinds[fname] = kinds
        discs = fam.discriminants
        domains: list[list[Any]] = []
        for d in discs:
            if d not in fam.params:
                ctx.report.add(f"{path}.match", f"match names {d!r}, which is not a parameter "
                               f"of {fname} ({', '.join(fam.params)})", "family")
                return
            k = kinds.get(d)
            if k is None:
                return
            if not is_discriminant(k):
                ctx.report.add(f"{path}.match", f"{fname} matches on {d}, which is {k}; a "
                               f"discriminant is Bool, an enum, a DType or an ADT", "family")
                return
            domains.append(domain(k, ctx.adts))
        covered: dict[tuple, int] = {}
        for i, case in enumerate(fam.cases):
            cpath = f"{path}.cases[{i}]"
            whens = [case.when] if len(discs) == 1 else case.when
            if not isinstance(whens, list | tuple) or len(whens) != len(discs):
                ctx.report.add(cpath, f"when must give {len(discs)} values ({', '.join(discs)})",
                               "family")
                continue
            for w, dom, d in zip(whens, domains, discs, strict=True):
                if w != "_" and not any(same_value(w, v) for v in dom):
                    ctx.report.add(cpath, f"when {w!r} is not a value of {d} "
                                   f"({', '.join(map(fmt_value, dom))})", "family")
                    break
            else:
                combos = list(itertools.product(*[
                    dom if w == "_" else [w] for w, dom in zip(whens, domains, strict=True)
                ]))
                mine = [c for c in combos if case_key(c) not in covered]
                _check_fields_read(ctx, cpath, fname, case.is_.node, discs, kinds, mine)
                new = [case_key(c) for c in mine]
                if not new:
                    key = case_key(tuple(whens))
                    prev = covered[key] if key in covered else (
                        min(covered.values()) if covered else 0)
                    ctx.report.add(cpath, f"this case is already covered by case {prev} "
                                   f"(cases are tried in order; remove the duplicate)", "family")
                for c in new:
                    covered[c] = i
            scope = dict(kinds)
            ctx.check(f"{cpath}.is", case.is_, "shape", scope=scope, broken=fam_broken)
        missing = [c for c in itertools.product(*domains) if case_key(c) not in covered]
        if missing and domains:
            shown = ", ".join("(" + ", ".join(map(fmt_value, c)) + ")" if len(c) > 1 else
                              fmt_value(c[0]) for c in missing[:4])
            ctx.report.add(f"{path}.cases", f"{fname} is not total: no case for "
                           f"{' x '.join(discs)} = {shown}", "family")



def _check_fields_read(ctx: EntryContext, cpath: str, fname: str, node: E.Node,
                       discs: Any, kinds: dict[str, Kind], combos: list[tuple]) -> None:
    """A case may read a field of an ADT discriminant (``l.max_m``) only when every
    constructor the case selects has that field: a case for ``contiguous`` reading a field of
    ``masked`` would fail at construction with no field to read."""
    for pos, d in enumerate(discs):
        k = kinds.get(d)
        if not isinstance(k, AdtK) or k.name not in ctx.adts:
            continue
        ctors = ctx.adts[k.name].constructors
        selected = sorted({c[pos] for c in combos if c[pos] in ctors})
        for n in E.walk(node):
            if not (isinstance(n, E.Attr) and isinstance(n.value, E.Name) and n.value.id == d):
                continue
            lacking = [c for c in selected if n.attr not in ctors[c].fields]
            if lacking:
                owners = [c for c in ctors if n.attr in ctors[c].fields]
                where = (f"a field of {', '.join(owners)} only" if owners
                         else f"no constructor of {k.name} has it")
                ctx.report.add(cpath, f"this case of {fname} reads {d}.{n.attr}, but it selects "
                               f"{d} = {', '.join(lacking)}, which has no field {n.attr!r} "
                               f"({where})", "family")
                return
