"""What every rule module shares: the report diagnostics go to, the model of an entry the
rules build up, and the entry's context with its expression checks.

The rules run in dependency order (see :mod:`.entry`): ``index-source`` fills the model's
kinds and sources, which every later rule reads through :class:`EntryContext`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ..errors import Diagnostic
from ..evaluate import bound_error_of_constants
from ..kinds import BoolK, DTypeK, Kind, KindError, ShapeK, is_numeric, kind_from_expr
from ..schema import AdtDef, Expr, OpEntry, SpecFile
from .infer import InferError, KindInference

__all__ = ["EntryContext", "EntryModel", "Report", "line_of"]


@dataclass
class EntryModel:
    """What the validator learns about an entry: every index with its kind and source."""

    name: str
    kinds: dict[str, Kind] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # name -> forall|param|let|data
    let_order: list[str] = field(default_factory=list)
    optional_inputs: set[str] = field(default_factory=set)
    nullable_outputs: set[str] = field(default_factory=set)
    #: index -> the optional inputs that alone give it (see :mod:`.solvable`)
    optional_indices: dict[str, tuple[str, ...]] = field(default_factory=dict)


class Report:
    """Collects diagnostics, each placed on the line of its path (from the spec file, or from
    a bare line table for ``types.yaml``)."""

    def __init__(self, file: str, spec: SpecFile | None, lines: Mapping[str, int] | None = None):
        self.file = file
        self.spec = spec
        self.lines = lines or {}
        self.items: list[Diagnostic] = []

    def add(self, path: str, message: str, rule: str) -> None:
        line = self.spec.line_of(path) if self.spec else line_of(self.lines, path)
        self.items.append(Diagnostic(self.file, line, path, message, rule))


def line_of(lines: Mapping[str, int], path: str) -> int | None:
    while path:
        if path in lines:
            return lines[path]
        path = path.rpartition(".")[0]
    return None


class EntryContext:
    """One entry under validation: its signature, the report, the ADTs, the ops it may name,
    and the model the rules fill in."""

    def __init__(self, name: str, entry: OpEntry, report: Report, adts: dict[str, AdtDef],
                 known_ops: Iterable[str] | None) -> None:
        self.name = name
        self.entry = entry
        self.sig = entry.signature
        self.report = report
        self.adts = adts
        self.known_ops = set(known_ops) if known_ops is not None else None
        self.model = EntryModel(name)
        self.family_kinds: dict[str, dict[str, Kind]] = {}
        #: declared names whose kind could not be read (already reported): expressions that
        #: name them are not checked again, so one bad kind gives one diagnostic
        self.broken: set[str] = set()
        self.sig_path = f"{name}.signature"

    def kinds(self, scope=None, generators=False) -> KindInference:
        tensors = {n: n in self.model.optional_inputs for n in self.sig.inputs}
        tensors.update({n: n in self.model.nullable_outputs for n in self.sig.outputs})
        return KindInference(
            self.model.kinds if scope is None else scope,
            self.sig.types,
            tensors,
            self.adts,
            generators,
            self.family_kinds,
        )

    def check(self, path: str, ex: Expr, want: str, scope=None, generators=False,
              broken: set[str] | None = None) -> Kind | None:
        """The kind of ``ex``, reported at ``path`` if it has none or is not what ``want``
        says (``bool``, ``num``, ``shape``, ``dtype`` or ``any``); None when reported or
        when ``ex`` names a broken declaration."""
        if any(n in (self.broken if broken is None else broken) for n in ex.names()):
            return None
        try:
            k = self.kinds(scope, generators).infer(ex.node)
        except InferError as err:
            self.report.add(path, f"{ex.text!r}: {err.message}", err.rule)
            return None
        bound = bound_error_of_constants(ex.node)
        if bound is not None:
            self.report.add(path, f"{ex.text!r}: {bound}", "bounds")
            return None
        bad = (
            (want == "bool" and not isinstance(k, BoolK))
            or (want == "num" and not is_numeric(k))
            or (want == "shape" and not isinstance(k, ShapeK))
            or (want == "dtype" and not isinstance(k, DTypeK))
        )
        if bad:
            noun = {"bool": "a Bool predicate", "num": "a number", "shape": "a shape",
                    "dtype": "a DType"}[want]
            self.report.add(path, f"{ex.text!r} is {k}, but {noun} is expected here", "kind")
            return None
        return k

    def kind_of(self, path: str, ex: Expr) -> Kind | None:
        """The kind a declaration writes (``Dim``, ``int | None``), reported if unknown."""
        try:
            return kind_from_expr(ex.node, set(self.adts))
        except KindError as err:
            self.report.add(path, str(err), "kind")
            return None

    def has(self, *rules: str) -> bool:
        """Whether any diagnostic so far breaks one of ``rules``."""
        return any(d.rule in rules for d in self.report.items)
