"""The ``adt`` rule: the shared ADTs of ``types.yaml``."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import Diagnostic
from ..expr import is_name
from ..kinds import BoolK, Kind, KindError, kind_from_expr
from ..schema import TypesFile
from .context import Report
from .infer import InferError, KindInference

__all__ = ["validate_types"]

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*(\.[A-Za-z_][A-Za-z_0-9]*)+$")


def validate_types(types: TypesFile, file: str = "types.yaml",
                   lines: Mapping[str, int] | None = None) -> list[Diagnostic]:
    """The ``adt`` rule on a ``types.yaml``: ADT names are identifiers, each ADT has
    constructors, each constructor a dotted Python class path, field kinds and a Bool
    invariant over its fields. ``lines`` (from the loader) places each diagnostic."""
    report = Report(file, None, lines)
    names = set(types.adts)
    for an, adt in types.adts.items():
        if not is_name(an):
            report.add(f"adts.{an}", f"{an!r} is not a valid ADT name", "adt")
        if not adt.constructors:
            report.add(f"adts.{an}", f"ADT {an} has no constructors", "adt")
        for cn, ctor in adt.constructors.items():
            path = f"adts.{an}.constructors.{cn}"
            if not is_name(cn):
                report.add(path, f"{cn!r} is not a valid constructor name", "adt")
            for fn in ctor.fields:
                if not is_name(fn):
                    report.add(f"{path}.fields.{fn}", f"{fn!r} is not a valid field name", "adt")
            if not _DOTTED.match(ctor.python):
                report.add(f"{path}.python", f"python must be a dotted class path "
                           f"(package.module.Class), got {ctor.python!r}", "adt")
            scope: dict[str, Kind] = {}
            for fn, fex in ctor.fields.items():
                try:
                    scope[fn] = kind_from_expr(fex.node, names)
                except KindError as err:
                    report.add(f"{path}.fields.{fn}", str(err), "adt")
            if ctor.invariant is not None:
                try:
                    k = KindInference(scope, {}, {}, types.adts).infer(ctor.invariant.node)
                    if not isinstance(k, BoolK):
                        report.add(f"{path}.invariant", f"{ctor.invariant.text!r} is {k}, but "
                                   f"an invariant is a Bool predicate", "adt")
                except InferError as err:
                    report.add(f"{path}.invariant", f"{ctor.invariant.text!r}: {err.message}",
                               err.rule)
    return report.items
