"""Every rule on one entry, in dependency order."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..errors import Diagnostic
from ..schema import AdtDef, OpEntry, SpecFile
from .backward import check_backward
from .context import EntryContext, Report
from .effects import check_tensors
from .families import check_families
from .signature import (
    check_composition,
    check_lets,
    check_refinements,
    check_roofline,
    check_sources,
)
from .solvable import check_solvable
from .workloads import check_workloads

__all__ = ["validate_entry"]


def validate_entry(
    name: str,
    entry: OpEntry,
    *,
    spec: SpecFile | None = None,
    adts: Mapping[str, AdtDef] | None = None,
    known_ops: Iterable[str] | None = None,
) -> list[Diagnostic]:
    """Every rule on one entry. Returns the diagnostics (empty when the entry is valid).

    An entry with a ``backward:`` block names its backward op among the entries of ``spec``
    (its file); without ``spec`` that lookup cannot be made and is reported."""
    report = Report(spec.path if spec else "<entry>", spec)
    ctx = EntryContext(name, entry, report, dict(adts or {}), known_ops)
    # index-source fills the model's kinds, which every later rule reads; families before
    # anything that applies them; workloads only once the declarations are sound, since
    # instantiating a row evaluates them.
    check_sources(ctx)
    check_families(ctx)
    check_lets(ctx)
    check_tensors(ctx)
    check_refinements(ctx)
    check_solvable(ctx)
    check_roofline(ctx)
    check_composition(ctx)
    check_backward(ctx, spec)
    if not ctx.has("kind", "unknown-name", "index-source", "let-cycle", "family"):
        check_workloads(ctx)
    return report.items
