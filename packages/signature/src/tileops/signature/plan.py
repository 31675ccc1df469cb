"""``_SignaturePlan``: the function table generated from one spec entry.

One plan per entry, shared by every instance of the op class. For each *construction point*
(the values of the construction params) the plan generates Python source, compiles it once
and caches it:

- ``check_exact(*inputs, **outs)``: the call check. Unifies declared and actual shapes and
  dtypes (fixed dims, affine dims, variadic ``*S``, dtype indices; the first occurrence binds,
  later ones must be equal), checks refinements and the presence of optional inputs, decides
  the effect branch and returns a :class:`SignatureCall`; a failure raises a
  :class:`SignatureCallError` naming the argument, the index, both values and the spec line.
  Type families, construction params and the presence of optional inputs are folded while
  generating, so the code is straight-line: one body per presence combination.
- ``check``: the same checks for the hot path. It leaves out bindings that cannot fail and
  that no later check reads, compares a shape whose every axis is already known as one tuple,
  drops a rank check that an axis read implies, and on any miss hands the call to
  ``check_exact`` (so every error is the exact one). Both return the point's record: one
  object holding the shapes, dtypes and device the check read, and the branch.
- ``derive(record)``: the index values and the output shapes and dtypes, recomputed from the
  record's stored reads (the bindings, lets and output inference without the checks); the
  record's ``values``, ``output_shapes`` and ``output_dtypes`` come from it.
- ``check_symbolic``: the same with every size comparison routed through the adapter's
  ``check`` hook (``torch._check`` under tracing), so symbolic sizes are asserted, not
  specialised.
- ``traffic(call)`` and ``roofline(call)``: bytes read and written per tensor from the
  effects, and the spec's flops / bytes formulas, as plain generated code.

Generated code is built from the validated AST (names renamed to ``i_<index>`` and
``t_<tensor>``, constants folded to literals), never by splicing spec text; the source of any
point can be printed (:meth:`ConstructionPoint.source`).

This module holds the two objects callers see; the work is done by one module per concern,
each importing only those below it: :mod:`.construct` (the construction check),
:mod:`.gen_check` (a point's source: the presence tree and the functions), :mod:`.unify` (one
body's checks), :mod:`.infer` (outputs, branch and record), :mod:`.roofline` (traffic and
roofline), :mod:`.simplify` (the hot path's peephole pass), :mod:`.fold` (expressions at a
point) and :mod:`.common` (what they share).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from tileops.spec import AdtDef, OpEntry, SpecError, SpecFile, kind_from_expr, validate_entry
from tileops.spec import expr as E
from tileops.spec.kinds import DTypeK, Kind
from tileops.spec.primitives import AxisError
from tileops.spec.validate.infer import InferError, KindInference

from .adapters import DTypeAdapter, torch_adapter
from .call import SignatureCall, record_type
from .common import Failure, FastBody, shape_text
from .construct import (
    check_param_refinements,
    check_returned,
    const_lets,
    normalize_params,
    point_key,
    returned_outputs,
)
from .errors import SignatureCallError, SignatureIndexError
from .gen_check import Generator

__all__ = ["ConstructionPoint", "FastBody", "SignaturePlan"]


#: the default of a required input of a generated check: not given
_NOT_GIVEN = object()


class _Miss(Exception):
    """A fast check's miss: the call goes to ``check_exact`` (which raises the precise
    error)."""


# --- the plan ----------------------------------------------------------------------------------


class SignaturePlan:
    """The generated function table of one op entry (``_SignaturePlan`` in the design)."""

    def __init__(
        self,
        name: str,
        entry: OpEntry,
        *,
        spec: SpecFile | None = None,
        adts: Mapping[str, AdtDef] | None = None,
        adapter: DTypeAdapter | None = None,
        validate: bool = True,
    ) -> None:
        self.name = name
        self.entry = entry
        self.sig = entry.signature
        self.spec = spec
        self.adts = dict(adts or {})
        self._adapter = adapter
        if validate:
            diags = validate_entry(name, entry, spec=spec, adts=self.adts)
            if diags:
                raise SpecError(diags)
        self.kinds: dict[str, Kind] = {}
        for n, ex in self.sig.forall.items():
            self.kinds[n] = kind_from_expr(ex.node, set(self.adts))
        for n, p in self.sig.params.items():
            self.kinds[n] = kind_from_expr(p.type.node, set(self.adts))
        self.param_names = tuple(self.sig.params)
        self.input_names = tuple(self.sig.inputs)
        self.output_names = tuple(self.sig.outputs)
        self.optional_inputs = tuple(n for n, d in self.sig.inputs.items()
                                     if d.optional.node != E.Bool(False))
        self._dtype_lets()
        #: output -> the dtypes it may have over every call (None: its dtype is a param's)
        self.output_dtype_members: dict[str, tuple[str, ...] | None] = {
            n: self._dtype_members(d.dtype.node) for n, d in self.sig.outputs.items()}
        self.buffer_outputs = tuple(n for n, d in self.sig.outputs.items() if d.buffer)
        #: whether some construction leaves an output out of the call's result (``returned``)
        self.may_leave_out = any(d.returned.node != E.Bool(True)
                                 for d in self.sig.outputs.values())
        self._points: dict[tuple, ConstructionPoint] = {}
        self._lock = threading.Lock()

    def _dtype_lets(self) -> None:
        """The kinds of the lets that are dtypes (a computed dtype that a rule or another
        dtype expression reads, clamp's ``R``), in :attr:`kinds` with the indices'."""
        tensors = {n: n in self.optional_inputs for n in self.sig.inputs}
        tensors.update({n: d.nullable.node != E.Bool(False)
                        for n, d in self.sig.outputs.items()})
        for _ in range(len(self.sig.let)):  # a let may read another: until none is added
            added = False
            for n, ex in self.sig.let.items():
                if n in self.kinds:
                    continue
                try:
                    k = KindInference(self.kinds, self.sig.types, tensors, self.adts).infer(
                        ex.node)
                except InferError:
                    continue  # not a dtype, or reading a let that is not one
                if isinstance(k, DTypeK):
                    self.kinds[n] = k
                    added = True
            if not added:
                return

    def _dtype_members(self, node: E.Node) -> tuple[str, ...] | None:
        """The dtypes a dtype expression of the entry (an output's ``dtype``) may take over
        every call: its kind's members; None where it is no dtype."""
        tensors = {n: n in self.optional_inputs for n in self.sig.inputs}
        try:
            k = KindInference(self.kinds, self.sig.types, tensors, self.adts).infer(node)
        except InferError:
            return None
        return k.members if isinstance(k, DTypeK) else None

    @property
    def adapter(self) -> DTypeAdapter:
        if self._adapter is None:
            self._adapter = torch_adapter()
        return self._adapter

    def where(self, path: str) -> str:
        """``file:line (entry path)`` of a piece of the entry."""
        full = f"{self.name}.{path}" if path else self.name
        if self.spec is None:
            return full
        line = self.spec.line_of(full)
        return f"{self.spec.path}:{line} ({full})" if line else f"{self.spec.path} ({full})"

    # -- construction -------------------------------------------------------------------------

    def construct(self, **params: Any) -> ConstructionPoint:
        """The construction check: params against their kinds and the refinements that involve
        only params. Returns the (cached) construction point."""
        values = normalize_params(self, params)
        key = point_key(self, values)
        point = self._points.get(key)
        if point is not None:
            return point
        with self._lock:
            point = self._points.get(key)
            if point is None:
                check_param_refinements(self, values, params)
                check_returned(self, values, params)
                point = ConstructionPoint(self, values)
                self._points[key] = point
        return point


# --- a construction point -----------------------------------------------------------------------


class ConstructionPoint:
    """The generated functions of one plan at one set of construction-param values."""

    def __init__(self, plan: SignaturePlan, params: dict[str, Any]) -> None:
        self.plan = plan
        self.params = dict(params)
        self.adapter = plan.adapter
        self.input_names = plan.input_names
        self.output_names = plan.output_names
        #: the outputs the call's result holds, in order (``returned`` at these params)
        self.returned_outputs: tuple[str, ...] = returned_outputs(plan, self.params)
        self.dtype_indices = {n for n, k in plan.kinds.items() if isinstance(k, DTypeK)
                              and (n in plan.sig.forall or n in plan.sig.let)}
        self.constants: dict[str, Any] = {**self.params, **const_lets(plan, self.params)}
        gen = Generator(self)
        self.index_names: tuple[str, ...] = gen.index_names
        self.lazy: dict[str, tuple[str, int, int]] = gen.lazy
        #: output -> the input it always has the shape and dtype of (an allocator can use
        #: ``empty_like`` on that input, cheaper than building from a shape)
        self.output_like: dict[str, str] = {
            n: next(iter(v)) for n, v in gen.like_votes.items() if len(v) == 1 and None not in v}
        self.index_set = frozenset(gen.index_names)
        #: input -> "x: Tensor[T, [*B, 4096]]  (declared ...)", for messages
        self.expected_inputs: dict[str, str] = gen.expected_inputs
        self.failures: list[Failure] = gen.failures
        #: the hot-path check's bodies, one per presence combination (see FastBody); their
        #: code runs in ``namespace``
        self.fast_bodies: tuple[FastBody, ...] = tuple(gen.fast_bodies)
        self._source = gen.source
        namespace = gen.namespace
        self._namespace = namespace
        #: the globals of the generated code (read-only to callers; copy to extend)
        self.namespace: Mapping[str, Any] = MappingProxyType(namespace)
        #: the class of this point's records (fields: see SignatureCall)
        self.record_type: type[SignatureCall] = record_type(self, f"{plan.name}Call")
        namespace["_fail"] = self._fail
        namespace["_SCE"] = SignatureCallError
        namespace["_R"] = self.record_type
        namespace["_Miss"] = _Miss
        namespace["_P"] = self
        namespace["_NO"] = _NOT_GIVEN
        namespace["_arity"] = self._arity
        code = compile(self._source, f"<tileops.signature {plan.name}>", "exec")
        exec(code, namespace)  # noqa: S102 - source generated from the validated AST
        #: the call check of the hot path: a miss goes to ``check_exact``
        self.check: Callable[..., SignatureCall] = namespace["check"]
        #: every check with its precise error (what ``check`` falls back to)
        self.check_exact: Callable[..., SignatureCall] = namespace["check_exact"]
        self.check_symbolic: Callable[..., SignatureCall] = namespace["check_symbolic"]
        #: ``derive(record) -> (values, output_shapes, output_dtypes)``
        self.derive: Callable[[SignatureCall], tuple] = namespace["derive"]
        self._traffic = namespace["traffic"]
        self._roofline = namespace["roofline"]

    def source(self) -> str:
        """The generated Python source of this point."""
        return self._source

    def traffic(self, call: SignatureCall) -> dict[str, tuple[int, int]]:
        return self._traffic(call)

    def roofline(self, call: SignatureCall) -> tuple[int, int]:
        """``(flops, bytes)`` of the call by the spec's formulas; a formula whose value on
        these params and sizes is not a count (inf, nan, negative: a float param of inf) is
        refused naming the op and the formula's value."""
        try:
            flops, nbytes = self._roofline(call)
        except (OverflowError, ValueError, ArithmeticError) as exc:
            raise ValueError(f"{self.plan.name}: the roofline's formulas have no count for "
                             f"this call ({exc}); its params: "
                             f"{', '.join(f'{k}={v!r}' for k, v in self.params.items())}"
                             ) from None
        if flops < 0 or nbytes < 0:
            raise ValueError(f"{self.plan.name}: the roofline's formulas give {flops} flops and "
                             f"{nbytes} bytes for this call: a count is not negative")
        return flops, nbytes

    def _arity(self, rest: tuple, kw: dict, given: tuple) -> TypeError:
        """A check called with a required input missing, too many inputs, or a keyword it
        does not take: named by the op's signature (the generated parameters are not)."""
        opt = set(self.plan.optional_inputs)
        names = self.input_names
        outs = self.plan.buffer_outputs
        sig = ", ".join([*(f"{n}=None" if n in opt else n for n in names),
                         *(["*", *(f"{n}=None" for n in outs)] if outs else [])])
        head = f"{self.plan.name}.check({sig})"
        if rest:
            return TypeError(f"{head} takes {len(names)} inputs, got {len(names) + len(rest)}: "
                             f"{len(rest)} extra positional argument"
                             f"{'s' if len(rest) > 1 else ''} after {names[-1]}")
        if kw:
            k = next(iter(kw))
            hint = f" (inputs are passed by position: {k} is input {names.index(k) + 1})" \
                if k in names else ""
            return TypeError(f"{head}: unexpected keyword argument {k!r}{hint}; keywords: "
                             f"{', '.join(outs) or 'none'}")
        missing = [n for n, t in zip(names, given, strict=True) if t is _NOT_GIVEN]
        return TypeError(f"{head}: required input{'s' if len(missing) > 1 else ''} "
                         f"{', '.join(missing)} not given")

    def _fail(self, fid: int, env: dict) -> SignatureCallError:
        f = self.failures[fid]
        ad = self.adapter
        argument = f.argument
        if argument == "(inputs)":  # a required input is None or not a tensor
            argument = next((n for n in self.input_names
                             if not (hasattr(env.get(f"t_{n}"), "shape")
                                     and hasattr(env.get(f"t_{n}"), "dtype"))
                             and not (env.get(f"t_{n}") is None
                                      and n in self.plan.optional_inputs)), self.input_names[0])
        parts = []
        for n in self.input_names:
            t = env.get(f"t_{n}")
            if t is None:
                parts.append(f"{n}: None")
            elif hasattr(t, "shape") and hasattr(t, "dtype"):
                parts.append(f"{n}: {ad.short(t.dtype)}{shape_text(t.shape)}")
            else:
                parts.append(f"{n}: {type(t).__name__}")
        for n in self.plan.buffer_outputs:  # a given out= buffer is part of the call
            t = env.get(f"t_{n}")
            if t is not None:
                parts.append(f"{n}: {ad.short(t.dtype)}{shape_text(t.shape)}"
                             if hasattr(t, "shape") and hasattr(t, "dtype")
                             else f"{n}: {type(t).__name__}")
        t = env.get(f"t_{argument}")
        if t is not None and hasattr(t, "shape") and hasattr(t, "dtype"):
            seen = f"{argument}: {ad.short(t.dtype)}{shape_text(t.shape)}"
        else:
            seen = f"{argument}: {'None' if t is None else type(t).__name__}"
        bound = {}
        names = f.bound if f.argument != "(inputs)" else self._bound_before(env, argument)
        for n in names:
            v = env.get(f"i_{n}")
            if v is None and n in self.lazy:
                src, a, b = self.lazy[n]
                s = env.get(f"s_{src}")
                v = None if s is None else tuple(s[a:len(s) - b])
            if n in self.dtype_indices:
                v = ad.name_of(v)
            elif isinstance(v, tuple):
                v = tuple(int(x) for x in v)
            bound[n] = v
        try:
            because = f.because({**self._namespace, **env})
        except Exception as exc:  # noqa: BLE001 - the message must never hide the error
            because = f"(could not describe: {exc})"
        expected, location = f.expected, f.location
        if f.argument == "(inputs)":
            d = self.plan.sig.inputs[argument]
            expected = self.expected_inputs.get(
                argument, f"{argument}: Tensor[{d.dtype.text}, {d.shape.text}]")
            location = self.plan.where(f"signature.inputs.{argument}")
        # a dim out of range for the tensor's rank (a primitive's AxisError) is torch's
        # IndexError too
        cls = SignatureIndexError if isinstance(env.get("_e"), AxisError) else \
            SignatureCallError
        return cls(self.plan.name, argument, expected, seen, because, ", ".join(parts), bound,
                   location)

    def _bound_before(self, env: dict, argument: str) -> list[str]:
        """The indices bound before a required input turned out None or not a tensor: the
        inputs before it all passed, and the frame's locals keep the order of assignment."""
        out: dict[str, None] = {}
        sliced: list[str] = []  # Shape indices sliced from the input read last: bound after
        for key in env:  # its own axes, as the check binds them
            if key.startswith("i_") and key[2:] in self.index_set:
                out[key[2:]] = None
            elif key.startswith("s_") and key[2:] != argument:
                out.update(dict.fromkeys(sliced))
                sliced = [n for n, (src, _, _) in self.lazy.items() if src == key[2:]]
        out.update(dict.fromkeys(sliced))
        return list(out)

