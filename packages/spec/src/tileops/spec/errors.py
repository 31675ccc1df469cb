"""Errors of the spec layer: every one says where (``file:line``), in which entry path, and why."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Diagnostic", "SpecError", "SpecLoadError"]


@dataclass(frozen=True)
class Diagnostic:
    """One finding about a spec: where it is, which rule it breaks, and the message."""

    file: str
    line: int | None
    path: str  # entry path, e.g. "RMSNormFwdOp.signature.inputs.x.shape"
    message: str
    rule: str = "schema"

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        # A diagnostic is one line: a path made of a bad name ("Op\n") prints escaped.
        path = self.path if self.path.isprintable() else repr(self.path)[1:-1]
        return f"{where}: in {path}: {self.message}" if path else f"{where}: {self.message}"


class SpecError(Exception):
    """A bad spec (the spec author's fault). Carries every :class:`Diagnostic` found."""

    def __init__(self, diagnostics: list[Diagnostic] | Diagnostic) -> None:
        if isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics = list(diagnostics)
        super().__init__("\n".join(str(d) for d in self.diagnostics))


class SpecLoadError(SpecError):
    """The YAML could not be read into the schema (syntax, duplicate keys, traps, fields)."""
