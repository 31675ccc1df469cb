"""``SignatureCall``: the frozen record of one call that passed the checks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

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

    Built by generated code on every call, so it stores only what the check read, in one
    object: each construction point has its own record class (a subclass, built with the
    point; ``ConstructionPoint.record_type``) whose fields are the device, the effect branch,
    then ``s_<input>`` and ``d_<input>`` (the shape object and dtype the check read; None for
    an absent optional input) for every declared input, then ``stages``. Everything else is
    derived on access: the index values and output shapes and dtypes by the point's generated
    ``derive`` (the check's bindings again, without the checks), names, traffic and roofline
    from those. The record is read-only to callers; a composite op adds its sub-calls to
    ``stages`` (with :meth:`add_stage`) before the record becomes ``last_call``.

    Per point class (generated): ``input_shapes`` and ``input_dtypes`` (tuples, one item per
    declared input, None where an optional input is absent) and the ``stages`` field (the
    sub-calls of a composite op, one :class:`Stage` each; empty and not allocated otherwise).
    """

    device: Any  # the first present input's device (None without tensor inputs)
    branch: tuple  # (written inputs, out given, returned outputs)
    #: the construction point this record's class belongs to
    point: ClassVar[ConstructionPoint]

    @property
    def op(self) -> str:
        return self.point.plan.name

    def derived(self) -> tuple[tuple, tuple, tuple]:
        """``(values, output_shapes, output_dtypes)``, computed from the stored reads."""
        return self.point.derive(self)

    @property
    def values(self) -> tuple:
        """Index values, in ``point.index_names`` order (a Shape index sliced from an input
        is that input's whole shape here; ``indices`` slices it)."""
        return self.point.derive(self)[0]

    @property
    def output_shapes(self) -> tuple:
        """Per declared output; None where a nullable output is None."""
        return self.point.derive(self)[1]

    @property
    def output_dtypes(self) -> tuple:
        return self.point.derive(self)[2]

    @property
    def indices(self) -> dict[str, Any]:
        """Every index value: forall indices, construction params and let definitions.
        DType indices are spec names (``"bfloat16"``). An index only absent optional inputs
        give has no value and is left out."""
        out = dict(self.point.params)
        names_of = self.point.adapter.names
        lazy = self.point.lazy
        forall = self.point.plan.sig.forall
        for name, v in zip(self.point.index_names, self.values, strict=True):
            if v is None and name in forall:
                continue
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
        _, out_shapes, out_dtypes = self.derived()
        out: dict[str, tuple[tuple[int, ...], str] | None] = {}
        for n, s, d in zip(self.point.input_names, self.input_shapes, self.input_dtypes,
                           strict=True):
            out[n] = None if s is None else (tuple(s), ad.name_of(d))
        for n, s, d in zip(self.point.output_names, out_shapes, out_dtypes, strict=True):
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
        it is write_only or shape_only, a mutated input is also written, an output is written unless it
        aliases an input (whose write is already counted)."""
        return self.point.traffic(self)

    def roofline(self) -> tuple[int, int]:
        """``(flops, bytes)``: the spec's formulas; bytes from the traffic when the spec gives
        none."""
        return self.point.roofline(self)

    def add_stage(self, name: str, calls: tuple[SignatureCall, ...]) -> None:
        """Record a composite op's sub-calls of one stage (before the record is published)."""
        stages = self.stages  # type: ignore[attr-defined]
        msgspec.structs.force_setattr(self, "stages", (*stages, Stage(name, tuple(calls))))

    def compact(self) -> str:
        """``a: bf16[128, 4096], b: bf16[4096, 512]``."""
        ad = self.point.adapter
        parts = []
        for n, s, d in zip(self.point.input_names, self.input_shapes, self.input_dtypes,
                           strict=True):
            parts.append(f"{n}: None" if s is None else f"{n}: {ad.short(d)}{list(s)}")
        return ", ".join(parts)


def record_type(point: ConstructionPoint, name: str) -> type[SignatureCall]:
    """The record class of one construction point: fields ``device``, ``branch``, then
    ``s_<input>``, ``d_<input>`` per declared input, then ``stages``."""
    from operator import attrgetter

    inputs = point.input_names
    fields: list[Any] = [(f, Any) for n in inputs for f in (f"s_{n}", f"d_{n}")]
    fields.append(("stages", tuple, ()))

    def getter(prefix: str) -> Any:
        names = [f"{prefix}{n}" for n in inputs]
        if len(names) > 1:
            return attrgetter(*names)
        if names:
            one = attrgetter(names[0])
            return lambda c: (one(c),)
        return lambda c: ()

    namespace = {"point": point,
                 "input_shapes": property(getter("s_"), doc="per declared input"),
                 "input_dtypes": property(getter("d_"), doc="per declared input")}
    return msgspec.defstruct(name, fields, bases=(SignatureCall,), frozen=True, gc=False,
                             namespace=namespace, module=__name__)
