"""``SignatureCall``: the frozen record of one call that passed the checks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:  # pragma: no cover
    from .plan import ConstructionPoint

__all__ = ["SignatureCall", "Stage"]


class Stage(msgspec.Struct, frozen=True):
    """The sub-calls a composite op made in one named stage."""

    name: str
    calls: tuple[SignatureCall, ...]


class SignatureCall(msgspec.Struct, frozen=True, gc=False):
    """One call that passed the signature checks.

    Built by generated code on every call, so it stores what the checks already read (index
    values, shapes, dtypes) and derives the rest (names, traffic, roofline) on access. The
    record is read-only to callers; a composite op adds its sub-calls to ``stages`` (with
    :meth:`add_stage`) before the record becomes ``last_call``.
    """

    point: ConstructionPoint
    values: tuple  # index values, in point.index_names order
    input_shapes: tuple  # per declared input; None where an optional input is absent
    input_dtypes: tuple
    output_shapes: tuple  # per declared output; None where a nullable output is None
    output_dtypes: tuple
    device: Any
    branch: tuple  # (written inputs, out given, returned outputs)
    #: the sub-calls of a composite op, one Stage each; empty (and not allocated) otherwise
    stages: tuple = ()

    @property
    def op(self) -> str:
        return self.point.plan.name

    @property
    def indices(self) -> dict[str, Any]:
        """Every index value: forall indices, construction params and let definitions.
        DType indices are spec names (``"bfloat16"``)."""
        out = dict(self.point.params)
        names_of = self.point.adapter.names
        lazy = self.point.lazy
        for name, v in zip(self.point.index_names, self.values, strict=True):
            if name in lazy:  # a Shape index stored as the whole shape it was sliced from
                _, a, b = lazy[name]
                v = tuple(v[a:len(v) - b])
            elif isinstance(v, tuple):
                v = tuple(v)
            out[name] = names_of.get(v, v) if name in self.point.dtype_indices else v
        return out

    @property
    def tensors(self) -> dict[str, tuple[tuple[int, ...], str] | None]:
        """``name -> (shape, dtype name)`` for every declared input and output."""
        ad = self.point.adapter
        out: dict[str, tuple[tuple[int, ...], str] | None] = {}
        for n, s, d in zip(self.point.input_names, self.input_shapes, self.input_dtypes,
                           strict=True):
            out[n] = None if s is None else (tuple(s), ad.name_of(d))
        for n, s, d in zip(self.point.output_names, self.output_shapes, self.output_dtypes,
                           strict=True):
            out[n] = None if s is None else (tuple(s), ad.name_of(d))
        return out

    @property
    def written_inputs(self) -> tuple[str, ...]:
        return self.branch[0]

    @property
    def out_given(self) -> bool:
        return self.branch[1]

    @property
    def returned_outputs(self) -> tuple[str, ...]:
        return self.branch[2]

    @property
    def traffic(self) -> dict[str, tuple[int, int]]:
        """``tensor -> (bytes read, bytes written)``, from the effects: an input is read unless
        it is write_only, a mutated input is also written, an output is written unless it
        aliases an input (whose write is already counted)."""
        return self.point.traffic(self)

    def roofline(self) -> tuple[int, int]:
        """``(flops, bytes)``: the spec's formulas; bytes from the traffic when the spec gives
        none."""
        return self.point.roofline(self)

    def add_stage(self, name: str, calls: tuple[SignatureCall, ...]) -> None:
        """Record a composite op's sub-calls of one stage (before the record is published)."""
        msgspec.structs.force_setattr(self, "stages", (*self.stages, Stage(name, tuple(calls))))

    def compact(self) -> str:
        """``a: bf16[128, 4096], b: bf16[4096, 512]``."""
        ad = self.point.adapter
        parts = []
        for n, s, d in zip(self.point.input_names, self.input_shapes, self.input_dtypes,
                           strict=True):
            parts.append(f"{n}: None" if s is None else f"{n}: {ad.short(d)}{list(s)}")
        return ", ".join(parts)
