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
"""

from __future__ import annotations

import ast
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tileops.spec import (
    AdtDef,
    AdtValue,
    EvalError,
    OpEntry,
    Scope,
    SpecError,
    SpecFile,
    evaluate,
    kind_from_expr,
    validate_entry,
)
from tileops.spec import (
    expr as E,
)
from tileops.spec.evaluate import family_case
from tileops.spec.kinds import (
    AdtK,
    BoolK,
    DimK,
    DTypeK,
    EnumK,
    FloatK,
    IntK,
    Kind,
    MaybeK,
    PerAxisK,
    ShapeK,
)
from tileops.spec.primitives import PRIMITIVES

from .adapters import DTypeAdapter, torch_adapter
from .call import SignatureCall, record_type
from .errors import ConstructionError, SignatureCallError

__all__ = ["ConstructionPoint", "FastBody", "SignaturePlan"]


class _GenError(Exception):
    """The entry cannot be compiled at this construction point (reported as a SpecError)."""


class _LazyConflict(Exception):
    """A Shape index is sliced from different inputs in different presence branches: the
    generator starts over, slicing it eagerly."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


# --- small helpers ---------------------------------------------------------------------------


def _lit(v: Any) -> E.Node | None:
    """The literal node for a folded value, or None if it has no literal form."""
    if isinstance(v, bool):
        return E.Bool(v)
    if isinstance(v, int):
        return E.Int(v) if v >= 0 else E.UnaryOp("-", E.Int(-v))
    if isinstance(v, float) and math.isfinite(v):
        return E.Float(v) if v >= 0 else E.UnaryOp("-", E.Float(-v))
    if isinstance(v, str):
        return E.Str(v)
    if v is None:
        return E.NoneLit()
    if isinstance(v, tuple | list) and all(isinstance(x, int) and not isinstance(x, bool)
                                           for x in v):
        return E.Tuple(tuple(_lit(x) for x in v))  # type: ignore[misc]
    return None


def _fmt_value(v: Any) -> str:
    if isinstance(v, tuple | list):
        return "[" + ", ".join(map(str, v)) + "]"
    return repr(v) if isinstance(v, str) else str(v)


def _shape_text(s: Any) -> str:
    return "[" + ", ".join(str(int(x)) for x in s) + "]"


class _Off:
    """An axis offset: a constant plus runtime terms (``len(i_B)``)."""

    def __init__(self, const: int = 0, terms: tuple[str, ...] = ()) -> None:
        self.const, self.terms = const, terms

    def add(self, n: int | str) -> _Off:
        if isinstance(n, int):
            return _Off(self.const + n, self.terms)
        return _Off(self.const, (*self.terms, n))

    def code(self) -> str:
        parts = [*self.terms] + ([str(self.const)] if self.const or not self.terms else [])
        return " + ".join(parts)

    def is_const(self) -> bool:
        return not self.terms


@dataclass(frozen=True)
class FastBody:
    """One body of a point's hot-path ``check``, for callers that fuse the check into code
    of their own (the runtime's fused op call): run ``lines`` (statements over ``t_<input>``
    and the point's ``namespace``; a miss raises) under ``try``, then ``record`` (an
    expression) is the call's record. Chosen by ``presence`` (optional input -> given)."""

    presence: dict[str, bool]
    lines: tuple[str, ...]
    record: str
    #: the effect branch of this body when no ``out=`` buffer is given
    branch: tuple


@dataclass
class _Failure:
    argument: str
    expected: str
    because: Callable[[dict], str]
    bound: tuple[str, ...]
    location: str


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
        self.buffer_outputs = tuple(n for n, d in self.sig.outputs.items() if d.buffer)
        self._points: dict[tuple, ConstructionPoint] = {}
        self._lock = threading.Lock()

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
        unknown = [k for k in params if k not in self.sig.params]
        if unknown:
            self._construction_error(
                unknown[0], "one of: " + (", ".join(self.param_names) or "no params"),
                repr(params[unknown[0]]), f"{self.name} has no construction param "
                f"{unknown[0]!r}", params)
        values: dict[str, Any] = {}
        for n, p in self.sig.params.items():
            if n in params:
                v = params[n]
            elif not p.required:
                v = p.default
            else:
                self._construction_error(n, f"{n}: {self.kinds[n]}", "nothing",
                                         f"{n} is required (it has no default)", params)
            values[n] = self._normalize(n, v, self.kinds[n], params)
        key = tuple(_hashable(values[n]) for n in self.param_names)
        point = self._points.get(key)
        if point is not None:
            return point
        with self._lock:
            point = self._points.get(key)
            if point is None:
                self._check_param_refinements(values, params)
                point = ConstructionPoint(self, values)
                self._points[key] = point
        return point

    def _construction_error(self, n: str, expected: str, seen: str, because: str,
                            params: Mapping[str, Any]) -> None:
        call = ", ".join(f"{k}={_fmt_value(v)}" for k, v in params.items()) or "(no params)"
        root = n.partition(".")[0]  # an ADT field (layout.max_m) is written under its param
        where = self.where(f"signature.params.{root}") if root in self.sig.params else \
            self.where("signature.params")
        raise ConstructionError(self.name, n, expected, seen, because, call, {}, where)

    def _normalize(self, n: str, v: Any, k: Kind, params: Mapping[str, Any],  # noqa: C901
                   maybe: Kind | None = None) -> Any:
        def bad(why: str) -> None:
            # a Maybe param is reported as declared (Maybe[Int]); None was also accepted
            self._construction_error(n, f"{n}: {maybe or k}", f"{v!r} ({type(v).__name__})",
                                     why if maybe is None else f"{why}, or None", params)

        if isinstance(k, MaybeK):
            return None if v is None else self._normalize(n, v, k.inner, params, maybe=k)
        if isinstance(k, BoolK):
            if not isinstance(v, bool):
                bad(f"{n} must be True or False")
            return v
        if isinstance(k, DimK | IntK):
            if isinstance(v, bool) or not isinstance(v, int):
                bad(f"{n} must be an int")
            if isinstance(k, DimK) and v < 0:
                bad(f"{n} is a Dim and must be >= 0")
            return int(v)
        if isinstance(k, FloatK):
            if isinstance(v, bool) or not isinstance(v, int | float):
                bad(f"{n} must be a number")
            return float(v)
        if isinstance(k, ShapeK):
            if not isinstance(v, list | tuple) or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
                bad(f"{n} must be a list or tuple of non-negative ints")
            return tuple(int(x) for x in v)
        if isinstance(k, PerAxisK):
            if isinstance(v, int) and not isinstance(v, bool):
                return v
            if isinstance(v, list | tuple) and len(v) in (1, k.n) and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in v):
                return tuple(v)
            bad(f"{n} must be an int or a tuple of {k.n} ints")
        if isinstance(k, EnumK):
            if v not in k.values:
                bad(f"{n} must be one of {', '.join(map(repr, k.values))}")
            return v
        if isinstance(k, DTypeK):
            name = v if isinstance(v, str) else self.adapter.names.get(v)
            if name not in k.members:
                bad(f"{n} must be one of {', '.join(k.members)}")
            return name
        if isinstance(k, AdtK):
            return self._adt_value(n, v, k, bad, params)
        return v  # pragma: no cover - every kind is handled above

    def _adt_value(self, n: str, v: Any, k: AdtK, bad: Callable[[str], None],
                   params: Mapping[str, Any]) -> AdtValue:
        adt = self.adts[k.name]
        if isinstance(v, AdtValue):
            ctor_name, fields = v.constructor, dict(v.fields)
        else:
            path = f"{type(v).__module__}.{type(v).__qualname__}"
            match = [c for c, ctor in adt.constructors.items() if ctor.python == path]
            if not match:
                bad(f"{n} must be a {k.name}: one of "
                    + ", ".join(f"{c.python}" for c in adt.constructors.values()))
            ctor_name = match[0]
            fields = {f: getattr(v, f) for f in adt.constructors[ctor_name].fields
                      if hasattr(v, f)}  # a missing field is reported below
        ctor = adt.constructors.get(ctor_name)
        if ctor is None:
            bad(f"{ctor_name!r} is not a constructor of {k.name}")
        assert ctor is not None
        if set(fields) != set(ctor.fields):
            bad(f"{ctor_name} has fields {', '.join(ctor.fields)}")
        for fn, fex in ctor.fields.items():
            fk = kind_from_expr(fex.node, set(self.adts))
            fields[fn] = self._normalize(f"{n}.{fn}", fields[fn], fk, params)
        if ctor.invariant is not None:
            try:
                ok = evaluate(ctor.invariant.node, Scope(fields))
            except EvalError as exc:
                ok, why = False, str(exc)
            else:
                why = f"{ctor_name} breaks its invariant {ctor.invariant.text!r}"
            if not ok:
                bad(why)
        return AdtValue(ctor_name, fields)

    def _check_param_refinements(self, values: dict[str, Any], params: Mapping) -> None:
        params_only = set(self.sig.params)
        lets = _const_lets(self, values)
        scope = Scope({**values, **lets}, self.sig.types)
        for i, rule in enumerate(self.sig.shape_rules):
            names = set(rule.names())
            # present() of a Maybe param is decided here too; a rule that names a tensor
            # (present(weight)) or a call-time index is left to the call check
            if names and names <= params_only | set(lets):
                try:
                    ok = evaluate(rule.node, scope)
                except EvalError as exc:
                    ok, extra = False, f": {exc}"
                else:
                    extra = ""
                if not ok:
                    shown = ", ".join(f"{m} = {_fmt_value(scope.values[m])}"
                                      for m in rule.names() if m in scope.values)
                    call = ", ".join(f"{k}={_fmt_value(v)}" for k, v in params.items())
                    raise ConstructionError(
                        self.name, ", ".join(_params_of(self, rule.names())),
                        rule.text, shown, f"refinement {rule.text!r} does not hold{extra}",
                        call or "(no params)", {}, self.where(f"signature.shape_rules[{i}]"))


def _params_of(plan: SignaturePlan, names: list[str]) -> list[str]:
    """The construction params ``names`` read, directly or through let definitions."""
    out: dict[str, None] = {}
    seen: set[str] = set()

    def visit(n: str) -> None:
        if n in seen:
            return
        seen.add(n)
        if n in plan.sig.params:
            out[n] = None
        elif n in plan.sig.let:
            for m in plan.sig.let[n].names():
                visit(m)

    for n in names:
        visit(n)
    return list(out)


def _hashable(v: Any) -> Any:
    if isinstance(v, AdtValue):
        return (v.constructor, tuple(sorted((k, _hashable(x)) for k, x in v.fields.items())))
    if isinstance(v, list):
        return tuple(v)
    if isinstance(v, float) and v != v:  # NaN != NaN: one key for every NaN, not a new point
        return ("nan",)
    return v


def _const_lets(plan: SignaturePlan, values: Mapping[str, Any]) -> dict[str, Any]:
    """let definitions that depend only on construction params, evaluated."""
    out: dict[str, Any] = {}
    known = set(values)
    changed = True  # validated: no cycles; iterate to a fixpoint
    while changed:
        changed = False
        for n, ex in plan.sig.let.items():
            if n in out or not set(ex.names()) <= known | set(out):
                continue
            try:
                out[n] = evaluate(ex.node, Scope({**values, **out}, plan.sig.types))
            except EvalError:
                continue
            changed = True
    return out


# --- a construction point -----------------------------------------------------------------------


class ConstructionPoint:
    """The generated functions of one plan at one set of construction-param values."""

    def __init__(self, plan: SignaturePlan, params: dict[str, Any]) -> None:
        self.plan = plan
        self.params = dict(params)
        self.adapter = plan.adapter
        self.input_names = plan.input_names
        self.output_names = plan.output_names
        self.dtype_indices = {n for n, k in plan.kinds.items()
                              if isinstance(k, DTypeK) and n in plan.sig.forall}
        self.constants: dict[str, Any] = {**self.params, **_const_lets(plan, self.params)}
        gen = _Generator(self)
        self.index_names: tuple[str, ...] = gen.index_names
        self.lazy: dict[str, tuple[str, int, int]] = gen.lazy
        #: output -> the input it always has the shape and dtype of (an allocator can use
        #: ``empty_like`` on that input, cheaper than building from a shape)
        self.output_like: dict[str, str] = {
            n: next(iter(v)) for n, v in gen.like_votes.items() if len(v) == 1 and None not in v}
        self.index_set = frozenset(gen.index_names)
        #: input -> "x: Tensor[T, [*B, 4096]]  (declared ...)", for messages
        self.expected_inputs: dict[str, str] = gen.expected_inputs
        self.failures: list[_Failure] = gen.failures
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
        return self._roofline(call)

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
                parts.append(f"{n}: {ad.short(t.dtype)}{_shape_text(t.shape)}")
            else:
                parts.append(f"{n}: {type(t).__name__}")
        for n in self.plan.buffer_outputs:  # a given out= buffer is part of the call
            t = env.get(f"t_{n}")
            if t is not None:
                parts.append(f"{n}: {ad.short(t.dtype)}{_shape_text(t.shape)}"
                             if hasattr(t, "shape") and hasattr(t, "dtype")
                             else f"{n}: {type(t).__name__}")
        t = env.get(f"t_{argument}")
        if t is not None and hasattr(t, "shape") and hasattr(t, "dtype"):
            seen = f"{argument}: {ad.short(t.dtype)}{_shape_text(t.shape)}"
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
        return SignatureCallError(self.plan.name, argument, expected, seen, because,
                                  ", ".join(parts), bound, location)

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


# --- code generation ----------------------------------------------------------------------------


class _Generator:
    """Writes the source of one construction point."""

    def __init__(self, point: ConstructionPoint) -> None:
        self.point = point
        self.plan = point.plan
        self.sig = point.plan.sig
        self.adapter = point.adapter
        self.const = point.constants
        forall_dims = [n for n in self.sig.forall]
        runtime_lets = [n for n in self._let_order() if n not in self.const]
        self.index_names = tuple(forall_dims + runtime_lets)
        #: Shape indices sliced eagerly: those bound from different inputs depending on which
        #: optional inputs are given, so no one input's whole shape can stand for them
        self.eager: set[str] = set()
        while True:
            try:
                self._generate()
                break
            except _LazyConflict as conflict:
                self.eager.add(conflict.name)

    def _generate(self) -> None:
        self.namespace: dict[str, Any] = {"_isz": self.adapter.itemsizes, "_prod": math.prod}
        self.failures: list[_Failure] = []
        self.lines: list[str] = []
        #: Shape index -> (input, start, from_end): the record holds that input's whole shape
        self.lazy: dict[str, tuple[str, int, int]] = {}
        #: output -> the inputs whose shape and dtype it has, per presence combination
        self.like_votes: dict[str, set[str | None]] = {}
        #: the hot-path check's bodies, one per presence combination (see FastBody)
        self.fast_bodies: list[FastBody] = []
        self.expected_inputs: dict[str, str] = {}
        point = self.point
        opt = self.plan.optional_inputs
        header = f"# generated by tileops.signature for {self.plan.name}"
        params = ", ".join(f"{k}={_fmt_value(v)}" for k, v in point.params.items())
        self.lines.append(f"{header} at ({params})")
        # check_exact: every check with its precise error; check: the same checks on the hot
        # path, any miss handed to check_exact (which raises the precise error); then the
        # symbolic variant and derive (the bindings again, from a record's stored reads)
        for mode in ("exact", "fast", "symbolic"):
            fname = {"exact": "check_exact", "fast": "check",
                     "symbolic": "check_symbolic"}[mode]
            # A required input after an optional one also defaults to None (Python needs it);
            # passing nothing there fails the check as a missing input.
            first_opt = next((i for i, n in enumerate(self.plan.input_names) if n in opt),
                             len(self.plan.input_names))
            args = [f"t_{n}" if i < first_opt else f"t_{n}=None"
                    for i, n in enumerate(self.plan.input_names)]
            # buffer outputs are passed by their declared names (``out=``)
            kw = [f"{n}=None" for n in self.plan.buffer_outputs]
            sig = ", ".join(args + (["*"] + kw if kw else []))
            self.lines.append(f"def {fname}({sig}):")
            for n in self.plan.buffer_outputs:
                self.lines.append(f"    t_{n} = {n}")
            self._presence_tree(list(opt), {}, 1, mode)
            self.lines.append("")
        self._emit_derive()
        self._emit_traffic()
        self._emit_roofline()
        self.source = "\n".join(self.lines) + "\n"

    # -- helpers --

    def _let_order(self) -> list[str]:
        order: list[str] = []
        state: dict[str, bool] = {}

        def visit(n: str) -> None:
            if n in state:
                return
            state[n] = True
            for m in self.sig.let[n].names():
                if m in self.sig.let:
                    visit(m)
            order.append(n)

        for n in self.sig.let:
            visit(n)
        return order

    def _name(self, prefix: str, value: Any) -> str:
        name = f"_{prefix}{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def _native(self, dtype_name: str) -> str:
        try:
            native = self.adapter.native(dtype_name)
        except KeyError:
            native = ("<unsupported dtype>", dtype_name)
        return self._name("D", native)

    def _where(self, path: str) -> str:
        return self.plan.where(path)

    def fail(self, argument: str, expected: str, because: Callable[[dict], str],
             bound: list[str], path: str) -> int:
        self.failures.append(_Failure(argument, expected, because, tuple(bound),
                                      self._where(path)))
        return len(self.failures) - 1

    # -- expressions --

    def fold(self, node: E.Node, presence: Mapping[str, bool], bound: set[str]) -> E.Node:
        """Fold every constant subexpression to a literal (families are resolved here)."""
        names = set(E.names(node))
        tensors = set(self.sig.inputs) | set(self.sig.outputs)
        runtime = {n for n in names if n in bound}
        if (not runtime and names <= set(self.const) | tensors
                and not (isinstance(node, E.Name) and node.id in tensors)):
            try:
                v = evaluate(node, Scope(self.const, self.sig.types, presence))
            except EvalError:
                v = _NOVALUE
            if v is not _NOVALUE:
                lit = _lit(v)
                if lit is not None:
                    return lit
        if isinstance(node, E.Subscript) and E.dotted_name(node.value) in self.sig.types:
            return self.fold(self.resolve_family(node, presence), presence, bound)
        if isinstance(node, E.List | E.Tuple):
            items: list[E.Node] = []
            for it in node.items:
                if isinstance(it, E.Starred):
                    inner = self.fold(it.value, presence, bound)
                    if isinstance(inner, E.List | E.Tuple):
                        items.extend(inner.items)
                    else:
                        items.append(E.Starred(inner))
                else:
                    items.append(self.fold(it, presence, bound))
            return type(node)(tuple(items))
        if isinstance(node, E.BinOp):
            return E.BinOp(node.op, self.fold(node.left, presence, bound),
                           self.fold(node.right, presence, bound))
        if isinstance(node, E.UnaryOp):
            return E.UnaryOp(node.op, self.fold(node.operand, presence, bound))
        if isinstance(node, E.BoolOp):
            return E.BoolOp(node.op, tuple(self.fold(v, presence, bound) for v in node.values))
        if isinstance(node, E.Compare):
            return E.Compare(self.fold(node.left, presence, bound), node.ops,
                             tuple(self.fold(c, presence, bound) for c in node.comparators))
        if isinstance(node, E.IfExp):
            test = self.fold(node.test, presence, bound)
            if isinstance(test, E.Bool):
                return self.fold(node.body if test.value else node.orelse, presence, bound)
            return E.IfExp(test, self.fold(node.body, presence, bound),
                           self.fold(node.orelse, presence, bound))
        if isinstance(node, E.Call) and node.func != "present":
            return E.Call(node.func, tuple(self.fold(a, presence, bound) for a in node.args),
                          tuple((k, self.fold(v, presence, bound)) for k, v in node.kwargs))
        return node

    def resolve_family(self, node: E.Subscript, presence: Mapping[str, bool]) -> E.Node:
        fam = self.sig.types[E.dotted_name(node.value)]  # type: ignore[index]
        env_nodes = dict(zip(fam.params, node.index, strict=True))
        disc_values = {}
        for d in fam.discriminants:
            disc_values[d] = evaluate(env_nodes[d], Scope(self.const, self.sig.types, presence))
        chosen = family_case(fam, disc_values)
        # ADT field reads (layout.max_m) inside the case are folded with the discriminant value
        consts = {d: disc_values[d] for d in fam.discriminants}
        return _subst(chosen, env_nodes, consts)

    def code(self, node: E.Node, presence_code: Callable[[str], str] | None = None) -> str:
        """Python source for a folded expression over bound indices (``i_<name>``)."""
        return ast.unparse(self._py(node, presence_code))

    def _py(self, node: E.Node, presence_code) -> ast.expr:  # noqa: C901
        if isinstance(node, E.Name):
            if node.id in self.const:
                lit = _lit(self.const[node.id])
                if lit is None:
                    return ast.Name(self._name("C", self.const[node.id]), ast.Load())
                return self._py(lit, presence_code)
            if node.id in self.point.dtype_indices or node.id in self.sig.forall \
                    or node.id in self.sig.let:
                return ast.Name(f"i_{node.id}", ast.Load())
            if node.id in _dtype_names():
                return ast.Name(self._native(node.id), ast.Load())
            raise _GenError(f"{node.id!r} has no value at call time")
        if isinstance(node, E.Int | E.Float | E.Str | E.Bool):
            return ast.Constant(node.value)
        if isinstance(node, E.NoneLit):
            return ast.Constant(None)
        if isinstance(node, E.Attr) and node.attr == "value":
            return self._py(node.value, presence_code)
        if isinstance(node, E.List | E.Tuple):
            return ast.Tuple([self._py(i, presence_code) for i in node.items], ast.Load())
        if isinstance(node, E.Starred):
            return ast.Starred(self._py(node.value, presence_code), ast.Load())
        if isinstance(node, E.Call):
            if node.func == "present":
                name = E.dotted_name(node.args[0])
                if presence_code is not None and name in self.sig.inputs:
                    return ast.parse(presence_code(name), mode="eval").body
                raise _GenError(f"present({name}) was not folded")
            if node.func == "itemsize":
                return ast.Subscript(ast.Name("_isz", ast.Load()),
                                     self._py(node.args[0], presence_code), ast.Load())
            prim = PRIMITIVES[node.func]
            fn = self._name("p_", prim.impl)
            return ast.Call(ast.Name(fn, ast.Load()),
                            [self._py(a, presence_code) for a in node.args],
                            [ast.keyword(k, self._py(v, presence_code)) for k, v in node.kwargs])
        if isinstance(node, E.UnaryOp | E.BinOp | E.BoolOp | E.Compare | E.IfExp):
            # rebuild through the expression module's own converter, then rename leaves
            py = E.to_python_ast(node)
            return _Rename(self, presence_code).visit(py)
        raise _GenError(f"{E.unparse(node)} cannot be compiled")

    # -- the check body --

    def _presence_tree(self, remaining: list[str], presence: dict[str, bool], depth: int,
                       mode: str) -> None:
        ind = "    " * depth
        if remaining:
            n, rest = remaining[0], remaining[1:]
            # derive reads the record: an absent input's stored shape is None
            self.lines.append(f"{ind}if {'s' if mode == 'derive' else 't'}_{n} is None:")
            self._presence_tree(rest, {**presence, n: False}, depth + 1, mode)
            self.lines.append(f"{ind}else:")
            self._presence_tree(rest, {**presence, n: True}, depth + 1, mode)
            return
        try:
            b = _Body(self, presence, mode)
            body = b.lines
            if mode == "fast":
                self.fast_bodies.append(b.fast_body)
        except _GenError as exc:
            raise SpecError([_diag(self.plan, str(exc))]) from None
        self.lines += [f"{ind}{line}" for line in body]

    # -- traffic and roofline --

    def exact_call(self) -> str:
        """The call of ``check_exact`` with the arguments the check was given."""
        args = [f"t_{n}" for n in self.plan.input_names]
        args += [f"{n}=t_{n}" for n in self.plan.buffer_outputs]
        return f"check_exact({', '.join(args)})"

    def _emit_derive(self) -> None:
        """``derive(c) -> (values, output_shapes, output_dtypes)`` of a record: the check's
        bindings, lets and output inference over the shapes and dtypes it stored."""
        L = self.lines
        L.append("def derive(c):")
        for n in self.plan.input_names:
            L.append(f"    s_{n} = c.s_{n}")
            L.append(f"    d_{n} = c.d_{n}")
        self._presence_tree(list(self.plan.optional_inputs), {}, 1, "derive")
        L.append("")

    def _emit_traffic(self) -> None:
        L = self.lines
        L.append("def traffic(c):")
        L.append("    _, os, od = derive(c)")
        L.append("    s, d, w = c.input_shapes, c.input_dtypes, c.branch[0]")
        L.append("    out = {}")
        for i, (n, decl) in enumerate(self.sig.inputs.items()):
            read = "0" if decl.write_only else f"_prod(s[{i}]) * _isz[d[{i}]]"
            L.append(f"    if s[{i}] is not None:")
            L.append(f"        out[{n!r}] = ({read}, _prod(s[{i}]) * _isz[d[{i}]] "
                     f"if {n!r} in w else 0)")
        for i, (n, decl) in enumerate(self.sig.outputs.items()):
            alias = decl.alias
            L.append(f"    if os[{i}] is not None:")
            if alias is not None:
                L.append(f"        if {alias!r} not in w:")
                L.append(f"            out[{n!r}] = (0, _prod(os[{i}]) * _isz[od[{i}]])")
            else:
                L.append(f"        out[{n!r}] = (0, _prod(os[{i}]) * _isz[od[{i}]])")
        L.append("    return out")
        L.append("")

    def _emit_roofline(self) -> None:
        L = self.lines
        rf = self.plan.entry.roofline
        L.append("def roofline(c):")
        if self.index_names:
            L.append(f"    {', '.join('i_' + n for n in self.index_names)}, = c.values")
        for n, (_, a, b) in self.lazy.items():
            L.append(f"    i_{n} = i_{n}[{a or ''}:{f'len(i_{n}) - {b}' if b else ''}]")
        idx = {n: i for i, n in enumerate(self.sig.inputs)}

        def presence(name: str) -> str:
            return f"(c.input_shapes[{idx[name]}] is not None)"

        bound = set(self.index_names)
        if rf is None:
            L.append("    flops = 0")
        else:
            L.append(f"    flops = {self.code(self.fold(rf.flops.node, {}, bound), presence)}")
        if rf is not None and rf.bytes is not None:
            L.append(f"    nbytes = {self.code(self.fold(rf.bytes.node, {}, bound), presence)}")
        else:
            L.append("    nbytes = sum(r + w for r, w in traffic(c).values())")
        L.append("    return int(flops), int(nbytes)")


_NOVALUE = object()


def _dtype_names() -> set[str]:
    from tileops.spec import DTYPES

    return set(DTYPES)


class _Rename(ast.NodeTransformer):
    """Maps the leaves of a converted expression onto generated names."""

    def __init__(self, gen: _Generator, presence_code) -> None:
        self.gen = gen
        self.presence_code = presence_code

    def visit_Name(self, node: ast.Name) -> ast.AST:  # noqa: N802
        return self.gen._py(E.Name(node.id), self.presence_code)

    def visit_Call(self, node: ast.Call) -> ast.AST:  # noqa: N802
        back = E._from_py(node, "")  # the same closed grammar
        return self.gen._py(back, self.presence_code)

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:  # noqa: N802
        back = E._from_py(node, "")
        return self.gen._py(back, self.presence_code)


def _subst(node: E.Node, env: Mapping[str, E.Node], consts: Mapping[str, Any]) -> E.Node:
    """Substitute family params by argument nodes; fold field reads of ADT discriminants."""
    if isinstance(node, E.Attr):
        base = E.dotted_name(node.value)
        if base in consts and isinstance(consts[base], AdtValue):
            lit = _lit(consts[base].fields[node.attr])
            if lit is not None:
                return lit
        return E.Attr(_subst(node.value, env, consts), node.attr)
    if isinstance(node, E.Name):
        return env.get(node.id, node)
    if isinstance(node, E.List | E.Tuple):
        return type(node)(tuple(_subst(i, env, consts) for i in node.items))
    if isinstance(node, E.Starred):
        return E.Starred(_subst(node.value, env, consts))
    if isinstance(node, E.BinOp):
        return E.BinOp(node.op, _subst(node.left, env, consts), _subst(node.right, env, consts))
    if isinstance(node, E.UnaryOp):
        return E.UnaryOp(node.op, _subst(node.operand, env, consts))
    if isinstance(node, E.Call):
        return E.Call(node.func, tuple(_subst(a, env, consts) for a in node.args),
                      tuple((k, _subst(v, env, consts)) for k, v in node.kwargs))
    if isinstance(node, E.Subscript):
        return E.Subscript(_subst(node.value, env, consts),
                           tuple(_subst(i, env, consts) for i in node.index))
    return node


def _diag(plan: SignaturePlan, message: str):
    from tileops.spec import Diagnostic

    file = plan.spec.path if plan.spec else "<entry>"
    line = plan.spec.line_of(plan.name) if plan.spec else None
    return Diagnostic(file, line, plan.name, message, "solvable")


class _Body:
    """The straight-line body for one presence combination, in one of four modes:

    - ``exact``: every check raises its precise error (``check_exact``);
    - ``fast``: the same checks, but a miss (a failing check or an exception) leaves the body
      and hands the call to ``check_exact``; bindings no later check reads are left out (the
      record derives them), so the hot path reads, compares and builds one object;
    - ``symbolic``: size comparisons through the adapter's hook (``check_symbolic``);
    - ``derive``: the bindings, lets and output inference over a record's stored shapes and
      dtypes, no checks; returns ``(values, output_shapes, output_dtypes)``.
    """

    def __init__(self, gen: _Generator, presence: dict[str, bool], mode: str) -> None:
        self.g = gen
        self.sig = gen.sig
        self.presence = presence
        self.mode = mode
        self.symbolic = mode == "symbolic"
        self.lines: list[str] = []
        self.bound: list[str] = []
        self.bound_set: set[str] = set()
        self.by: dict[str, str] = {}  # index -> where it was bound ("a.shape[1]")
        # Shape indices bound by a slice are materialised only when later code reads them
        # (slicing a torch.Size costs more than the rest of a check); the record stores the
        # whole shape and the slice bounds instead.
        self.pending: dict[str, tuple[str, int, int]] = {}
        self.forms: dict[str, E.Node] = {}
        # axes that cannot be unified where they stand (two unknowns, a let, a non-affine
        # form): solved once later inputs bind their indices, or checked after the lets
        self.deferred: list[tuple[str, E.Node, str, str, str, str]] = []
        derive = mode == "derive"
        if not derive:
            self.lines.append("try:")
        self.ind = "" if derive else "    "
        for n, decl in self.sig.inputs.items():
            if n in presence and not presence[n]:
                continue
            self.unify(n, decl)
        self.solve_deferred()
        missing = [n for n in self.sig.forall if n not in self.bound_set]
        if missing:
            raise _GenError(f"forall index {missing[0]} is not bound by the inputs")
        self.lets()
        for n, it, at, disp, expected, path in self.deferred:
            if self.unbound(it):
                raise _GenError(f"{n}: axis {E.unparse(it)} cannot be unified")
            self.check_axis(n, it, at, disp, expected, path)
        self.refinements()
        self.outputs()
        if derive:
            return
        if mode == "fast":
            self.lines = _simplify_fast(self.lines)
            inner = [line[len(self.ind):] for line in self.lines[1:-1]]  # try: ... return
            record = self.lines[-1].strip()[len("return "):]
            self.fast_body = FastBody(dict(presence), tuple(inner), record, self.fresh_branch)
            self.lines.append("except Exception:")  # a miss: the exact check says why
            self.lines.append("    pass")
            self.lines.append(f"return {self.g.exact_call()}")
            return
        # a missing or non-tensor input (AttributeError, TypeError), or arithmetic of the
        # signature that fails on these sizes (a let dividing by zero, a primitive refusing)
        self.lines.append("except _SCE:")  # our own errors (a ValueError) pass through
        self.lines.append("    raise")
        self.lines.append("except (AttributeError, TypeError, ArithmeticError, ValueError) as _e:")
        fid = self.g.fail(*self._missing_failure())
        self.lines.append(f"    raise _fail({fid}, locals()) from None")

    def _missing_failure(self):
        names = [n for n in self.sig.inputs if not (n in self.presence
                                                    and not self.presence[n])]

        def because(env: dict) -> str:
            for n in names:
                t = env.get(f"t_{n}")
                if t is None:
                    return f"{n} is required, got None"
                if not (hasattr(t, "shape") and hasattr(t, "dtype")):
                    return f"{n} must be a tensor (an object with .shape and .dtype), got " \
                           f"{type(t).__name__}"
            e = env.get("_e")
            return (f"evaluating the signature on these sizes failed: {type(e).__name__}: {e}"
                    if e is not None else "a tensor could not be read")

        return ("(inputs)", "tensors for " + ", ".join(names), because, [], "signature.inputs")

    # emitted statements

    def emit(self, line: str) -> None:
        self.lines.append(self.ind + line)

    def check(self, cond_ok: str, fid: int) -> None:
        if self.mode == "derive":
            return
        if self.mode == "fast":
            self.emit(f"if not ({cond_ok}): raise _Miss")
        elif self.symbolic:
            self.emit(f"_chk({cond_ok}, _M{fid})")
            self.g.namespace.setdefault("_chk", self.g.adapter.check)
            f = self.g.failures[fid]
            self.g.namespace[f"_M{fid}"] = (
                lambda f=f: f"{self.g.plan.name}: argument {f.argument}: expected "
                            f"{f.expected} ({f.location})")
        else:
            self.emit(f"if not ({cond_ok}): raise _fail({fid}, locals())")

    def fail_id(self, arg: str, expected: str, because: Callable[[dict], str], path: str) -> int:
        return self.g.fail(arg, expected, because, list(self.bound), path)

    def bind(self, name: str, code: str, where: str) -> None:
        self.emit(f"i_{name} = {code}")
        self.bound.append(name)
        self.bound_set.add(name)
        self.by[name] = where

    # unification of one input

    def unify(self, n: str, decl) -> None:
        path = f"signature.inputs.{n}"
        shape = self.g.fold(decl.shape.node, self.presence, self.bound_set)
        if not isinstance(shape, E.List | E.Tuple):
            raise _GenError(f"shape of {n} ({decl.shape.text}) did not resolve to a list")
        expected = f"{n}: Tensor[{decl.dtype.text}, {E.unparse(E.List(shape.items))}]"
        if E.unparse(E.List(shape.items)) != decl.shape.text:
            expected += f"  (declared {decl.shape.text})"
        self.forms[n] = shape if isinstance(shape, E.List) else E.List(shape.items)
        self.g.expected_inputs.setdefault(n, expected)
        if self.mode != "derive":  # derive has the record's stored reads
            self.emit(f"s_{n} = t_{n}.shape")
            self.emit(f"d_{n} = t_{n}.dtype")
        self.unify_dtype(n, decl, expected, path)
        items = list(shape.items)
        unknown = [i for i, it in enumerate(items) if isinstance(it, E.Starred)
                   and not self._star_known(it)]
        if len(unknown) > 1:
            raise _GenError(f"{n}: shape {decl.shape.text} has two unknown-length parts")
        if self.mode == "fast" and items and not any(
                isinstance(it, E.Starred) or self.unbound(it) for it in items):
            # every axis is known already (weight: [4096]): one tuple comparison stands for
            # the rank and each axis; a miss goes to the exact check, which says which
            self.emit(f"if not (s_{n} == {_tuple_code([self.expr(it) for it in items])}): "
                      f"raise _Miss")
            return
        # rank
        fixed = _Off()
        for it in items:
            if isinstance(it, E.Starred):
                if self._star_known(it):
                    fixed = fixed.add(self._star_len(it))
            else:
                fixed = fixed.add(1)
        rank_text = E.unparse(E.List(shape.items))
        if unknown:
            fid = self.fail_id(n, expected, lambda env, n=n, fx=fixed, r=rank_text:
                               f"{n} has {len(env[f's_{n}'])} dims, but {r} needs at least "
                               f"{_eval_off(fx, env)}", path)
            self.check_plain(f"len(s_{n}) >= {fixed.code()}", fid)
        else:
            fid = self.fail_id(n, expected, lambda env, n=n, fx=fixed, r=rank_text:
                               f"{n} has {len(env[f's_{n}'])} dims, but {r} has "
                               f"{_eval_off(fx, env)}", path)
            self.check_plain(f"len(s_{n}) == {fixed.code()}", fid)
        u = unknown[0] if unknown else len(items)
        left = _Off()
        for it in items[:u]:
            left = self.unify_item(n, it, left, None, expected, path)
        if unknown:
            right = _Off()
            for it in reversed(items[u + 1:]):
                right = self.unify_item(n, it, None, right, expected, path)
            star = items[u]
            assert isinstance(star, E.Starred)
            end = f"len(s_{n}) - ({right.code()})" if (right.const or right.terms) else ""
            sl = f"s_{n}[{left.code() if (left.const or left.terms) else ''}:{end}]"
            if isinstance(star.value, E.Name) and star.value.id in self.sig.forall:
                disp = f"{n}.shape[{left.code()}:{('-' + right.code()) if end else ''}]"
                if left.is_const() and right.is_const() and star.value.id not in self.g.eager:
                    name = star.value.id
                    self.pending[name] = (f"s_{n}", left.const, right.const)
                    self.bound.append(name)
                    self.bound_set.add(name)
                    self.by[name] = disp
                    how = (n, left.const, right.const)
                    if self.g.lazy.setdefault(name, how) != how:
                        raise _LazyConflict(name)
                else:
                    self.bind(star.value.id, sl, disp)
            else:
                raise _GenError(f"{n}: cannot unify *{E.unparse(star.value)}")

    def check_plain(self, cond_ok: str, fid: int) -> None:
        # rank and dtype checks are static under tracing: always plain
        if self.mode == "derive":
            return
        if self.mode == "fast":
            self.emit(f"if not ({cond_ok}): raise _Miss")
        else:
            self.emit(f"if not ({cond_ok}): raise _fail({fid}, locals())")

    def _star_known(self, it: E.Starred) -> bool:
        return all(m in self.bound_set for m in E.names(it.value))

    def _star_len(self, it: E.Starred) -> str:
        v = self.expr(it.value)
        return f"len({v})"

    def expr(self, node: E.Node) -> str:
        """Code for ``node``, first materialising any pending Shape index it reads."""
        for m in E.names(node):
            if m in self.pending:
                src, a, b = self.pending.pop(m)
                self.emit(f"i_{m} = {src}[{a or ''}:{f'len({src}) - {b}' if b else ''}]")
        return self.g.code(node)

    def unify_item(self, n: str, it: E.Node, left: _Off | None, right: _Off | None,
                   expected: str, path: str) -> _Off:
        """One item at ``left`` (from the start) or at ``-(right + 1)`` (from the end)."""
        if isinstance(it, E.Starred):
            val = self.expr(it.value)
            ln = f"len({val})"
            if left is not None:
                sl = f"s_{n}[{left.code()}:{left.code()} + {ln}]"
                nxt = left.add(ln)
            else:
                sl = f"s_{n}[len(s_{n}) - ({right.add(ln).code()}):len(s_{n}) - ({right.code()})]"
                nxt = right.add(ln)
            text = E.unparse(it.value)
            origin = {m: self.by.get(m, "construction") for m in E.names(it.value)}
            fid = self.fail_id(n, expected, lambda env, sl=sl, text=text, val=val, o=origin:
                               f"{text} is {_fmt_value(_ev(val, env))}"
                               + "".join(f" (bound by {w})" for w in o.values()
                                         if w != "construction")
                               + f", but that part of the shape is {_fmt_value(_ev(sl, env))}",
                               path)
            self.check(f"tuple({sl}) == tuple({val})", fid)
            return nxt
        if left is not None:
            ax = left.code()
            nxt = left.add(1)
        else:
            assert right is not None
            ax = f"-({right.add(1).code()})" if right.terms else str(-(right.const + 1))
            nxt = right.add(1)
        at = f"s_{n}[{ax}]"
        disp = f"{n}.shape[{ax}]"
        unbound = self.unbound(it)
        if len(unbound) == 1 and self.solvable(it, unbound[0]):
            self.solve_axis(n, it, at, disp, expected, path, unbound[0])
        elif unbound:
            self.deferred.append((n, it, at, disp, expected, path))
        else:
            self.check_axis(n, it, at, disp, expected, path)
        return nxt

    def unbound(self, it: E.Node) -> list[str]:
        return [m for m in E.names(it) if m not in self.bound_set and m not in self.g.const]

    def solvable(self, it: E.Node, x: str) -> bool:
        """``x`` can be read off an axis ``it``: a bare forall index, or ``it`` is affine in it
        (the validator's rule: +, -, and * by a known factor)."""
        return x in self.sig.forall and (isinstance(it, E.Name) or _affine_in(it, x))

    def solve_deferred(self) -> None:
        progress = True
        while progress:  # as the validator does: until no deferred axis binds anything
            progress = False
            for d in list(self.deferred):
                n, it, at, disp, expected, path = d
                unbound = self.unbound(it)
                if len(unbound) == 1 and self.solvable(it, unbound[0]):
                    self.deferred.remove(d)
                    self.solve_axis(n, it, at, disp, expected, path, unbound[0])
                    progress = True

    def solve_axis(self, n: str, it: E.Node, at: str, disp: str, expected: str, path: str,
                   x: str) -> None:
        if isinstance(it, E.Name):
            self.bind(it.id, at, disp)
            return
        b = self.g.fold(_subst(it, {x: E.Int(0)}, {}), self.presence, self.bound_set)
        a1 = self.g.fold(_subst(it, {x: E.Int(1)}, {}), self.presence, self.bound_set)
        bc, a1c = self.expr(b), self.expr(a1)
        text = E.unparse(it)
        self.emit(f"i_{x}, _r = divmod({at} - ({bc}), ({a1c}) - ({bc}))")
        # the failure lists what was bound before: x has no value when there is no solution
        fid = self.fail_id(n, expected, lambda env, at=at, text=text, x=x, d=disp:
                           f"{d} is {_ev(at, env)}, but {text} has no solution "
                           f"{x} >= 0 there", path)
        self.bound.append(x)
        self.bound_set.add(x)
        self.by[x] = disp
        self.check(f"_r == 0 and i_{x} >= 0", fid)

    def check_axis(self, n: str, it: E.Node, at: str, disp: str, expected: str,
                   path: str) -> None:
        """``at`` must equal ``it``, whose indices are all bound."""
        code = self.expr(it)
        text = E.unparse(it)
        if isinstance(it, E.Name) and it.id in self.by:
            src = self.by[it.id]
            fid = self.fail_id(n, expected, lambda env, at=at, code=code, t=text, src=src,
                               d=disp: f"{t} bound to {_ev(code, env)} by {src}, but {d} is "
                                       f"{_ev(at, env)}", path)
        elif isinstance(it, E.Int):
            fid = self.fail_id(n, expected, lambda env, at=at, t=text, d=disp:
                               f"{d} must be {t}, but is {_ev(at, env)}", path)
        else:
            fid = self.fail_id(n, expected, lambda env, at=at, code=code, t=text, d=disp:
                               f"{d} must be {t} = {_ev(code, env)}, but is {_ev(at, env)}", path)
        self.check(f"{at} == {code}", fid)

    def unify_dtype(self, n: str, decl, expected: str, path: str) -> None:
        node = decl.dtype.node
        ad = self.g.adapter
        if isinstance(node, E.Name) and node.id in self.sig.forall:
            t = node.id
            if t not in self.bound_set:
                members = self.g.plan.kinds[t].members  # type: ignore[attr-defined]
                allowed = frozenset(ad.natives[m] for m in members if m in ad.natives)
                name = self.g._name("DT", allowed)
                fid = self.fail_id(n, expected, lambda env, n=n, t=t, ms=members:
                                   f"{n}.dtype is {ad.name_of(env[f'd_{n}'])}, but {t} must be "
                                   f"one of {', '.join(ms)}", path)
                self.check_plain(f"d_{n} in {name}", fid)
                self.bind(t, f"d_{n}", f"{n}.dtype")
                return
            src = self.by[t]
            fid = self.fail_id(n, expected, lambda env, n=n, t=t, src=src:
                               f"{t} bound to {ad.name_of(env[f'i_{t}'])} by {src}, but "
                               f"{n}.dtype is {ad.name_of(env[f'd_{n}'])}", path)
            self.check_plain(f"d_{n} == i_{t}", fid)
            return
        value = node.id if isinstance(node, E.Name) and node.id not in self.g.const \
            else self.g.const.get(node.id) if isinstance(node, E.Name) else None
        if not isinstance(value, str):
            raise _GenError(f"dtype of {n} ({decl.dtype.text}) is not a dtype")
        const = self.g._native(value)
        fid = self.fail_id(n, expected, lambda env, n=n, v=value:
                           f"{n}.dtype must be {v}, but is {ad.name_of(env[f'd_{n}'])}", path)
        self.check_plain(f"d_{n} == {const}", fid)

    def lets(self) -> None:
        for n in self.g._let_order():
            if n in self.g.const:
                continue
            node = self.g.fold(self.sig.let[n].node, self.presence, self.bound_set)
            self.emit(f"i_{n} = {self.expr(node)}")
            self.bound.append(n)
            self.bound_set.add(n)
            self.by[n] = f"let {n} = {self.sig.let[n].text}"

    def refinements(self) -> None:
        for i, rule in enumerate(self.sig.shape_rules):
            node = self.g.fold(rule.node, self.presence, self.bound_set)
            if isinstance(node, E.Bool) and node.value:
                continue  # holds at this construction point (a False one fails every call)
            code = self.expr(node)
            names = [m for m in rule.names() if m in self.bound_set or m in self.g.const]
            text = rule.text
            codes = {m: (f"i_{m}" if m in self.bound_set else repr(self.g.const[m]))
                     for m in names}
            # the argument: an input the rule names, else the first input that bound one of
            # its indices (looking through let definitions: H_out is read from H_in)
            reached = _through_lets(self.sig.let, rule.names())
            arg = next((t for t in self.sig.inputs if t in rule.names()),
                       next((t for t in self.sig.inputs
                             if any(self.by.get(m, "").startswith(f"{t}.") for m in reached)),
                            "(refinement)"))
            fid = self.fail_id(arg, f"{text}", lambda env, text=text, codes=codes:
                               f"refinement {text!r} does not hold ("
                               + ", ".join(f"{m} = {_fmt_value(_ev(c, env))}"
                                           for m, c in codes.items()) + ")",
                               f"signature.shape_rules[{i}]")
            self.check(code, fid)

    def outputs(self) -> None:
        shapes, dtypes = [], []
        ad = self.g.adapter
        written = tuple(n for n, d in self.sig.inputs.items()
                        if not (n in self.presence and not self.presence[n])
                        and self._truth(d.mutated.node))
        returned = []
        for n, d in self.sig.outputs.items():
            if self._truth(d.nullable.node):
                shapes.append("None")
                dtypes.append("None")
                continue
            returned.append(n)
            node = self.g.fold(d.shape.node, self.presence, self.bound_set)
            same = next((t for t, form in self.forms.items() if form == node), None)
            if same is not None:  # the output has an input's shape: reuse the Size read
                shapes.append(f"s_{same}")
            else:
                shapes.append(self.expr(E.Tuple(node.items)
                                        if isinstance(node, E.List) else node))
            dn = d.dtype.node
            src_dtype = self.sig.inputs[same].dtype.node if same is not None else None
            self.g.like_votes.setdefault(n, set()).add(same if src_dtype == dn else None)
            if isinstance(dn, E.Name) and dn.id in self.sig.forall:
                dtypes.append(f"i_{dn.id}")
            else:
                name = dn.id if isinstance(dn, E.Name) and dn.id not in self.g.const \
                    else self.g.const[dn.id]  # type: ignore[union-attr]
                dtypes.append(self.g._native(name))
        for i, (n, d) in enumerate(self.sig.outputs.items()):
            if not d.buffer or shapes[i] == "None" or self.mode == "derive":
                continue
            self.emit(f"if t_{n} is not None:")
            fid = self.fail_id(n, f"{n}: Tensor[{d.dtype.text}, {d.shape.text}]",
                               lambda env, n=n, sc=shapes[i], dc=dtypes[i]:
                               f"the buffer given for {n} must be "
                               f"{ad.short(_ev(dc, env))}{_shape_text(_ev(sc, env))}, but is "
                               f"{ad.short(env[f't_{n}'].dtype)}"
                               f"{_shape_text(env[f't_{n}'].shape)}",
                               f"signature.outputs.{n}")
            miss = "raise _Miss" if self.mode == "fast" else f"raise _fail({fid}, locals())"
            self.emit(f"    if not (tuple(t_{n}.shape) == {shapes[i]} and t_{n}.dtype == "
                      f"{dtypes[i]}): {miss}")
        br_given = self.g._name("BR", (written, True, tuple(returned)))
        br_fresh = self.g._name("BR", (written, False, tuple(returned)))
        self.fresh_branch = self.g.namespace[br_fresh]
        given = " or ".join(f"t_{n} is not None" for n in self.g.plan.buffer_outputs)
        branch = f"({br_given} if ({given}) else {br_fresh})" if given else br_fresh
        ins = [f"s_{n}" if not (n in self.presence and not self.presence[n]) else "None"
               for n in self.sig.inputs]
        ids = [f"d_{n}" if not (n in self.presence and not self.presence[n]) else "None"
               for n in self.sig.inputs]
        first = next((n for n in self.sig.inputs if not (n in self.presence
                                                         and not self.presence[n])), None)
        # an op without tensor inputs has no device to read (its outputs go to the default)
        device = f"t_{first}.device" if first and self.g.adapter.name == "torch" else "None"
        for n in self.g.index_names:
            if n in self.g.lazy and self.by.get(n, "").split(".")[0] != self.g.lazy[n][0]:
                raise _LazyConflict(n)
        vals = [f"s_{self.g.lazy[n][0]}" if n in self.g.lazy else f"i_{n}"
                for n in self.g.index_names]
        if self.mode == "derive":
            self.emit(f"return {_tuple_code(vals)}, {_tuple_code(shapes)}, "
                      f"{_tuple_code(dtypes)}")
            return
        # the record: one object holding what the check read (see SignatureCall)
        reads = ", ".join(f"{s}, {d}" for s, d in zip(ins, ids, strict=True))
        self.emit(f"return _R({device}, {branch}{', ' + reads if reads else ''})")

    def _truth(self, node: E.Node) -> bool:
        v = evaluate(node, Scope(self.g.const, self.sig.types, self.presence))
        return bool(v)


def _affine_in(node: E.Node, x: str) -> bool:
    """``node`` is affine in ``x``: built from +, -, unary - and * with ``x`` on one side."""
    if isinstance(node, E.Name | E.Int):
        return True
    if isinstance(node, E.BinOp) and node.op in ("+", "-"):
        return _affine_in(node.left, x) and _affine_in(node.right, x)
    if isinstance(node, E.BinOp) and node.op == "*":
        return not (x in E.names(node.left) and x in E.names(node.right)) and \
            _affine_in(node.left, x) and _affine_in(node.right, x)
    if isinstance(node, E.UnaryOp) and node.op == "-":
        return _affine_in(node.operand, x)
    return x not in E.names(node)


def _through_lets(lets: Mapping[str, Any], names: list[str]) -> list[str]:
    """``names`` and, for each let among them, the names its definition reads (transitively)."""
    out: dict[str, None] = {}

    def visit(n: str) -> None:
        if n in out:
            return
        out[n] = None
        if n in lets:
            for m in lets[n].names():
                visit(m)

    for n in names:
        visit(n)
    return list(out)


class _Miss(Exception):
    """A fast check's miss: the call goes to ``check_exact`` (which raises the precise
    error)."""


def _simplify_fast(lines: list[str]) -> list[str]:
    """The hot-path check's statements (``lines``: ``try:``, one statement per line, the
    closing ``return``) with what cannot change its outcome left out, decided on the parsed
    statements (the lines are our own generated code; each kept statement keeps its lines as
    generated). Only statements of the body itself are candidates, never the ones nested in
    a conditional block (``if t_out is not None: ...``):

    - a binding that cannot fail and that no later statement reads (an axis or a slice of a
      shape read after its rank check, a dtype read, another index; a let, a solved axis or a
      primitive may fail and is always kept), repeated until none is left, since a dropped
      binding can leave the one it read unread too;
    - a rank check ``len(s_x) >= r`` when a later statement starts by reading ``s_x[-r]`` or
      ``s_x[r - 1]``: on a shorter shape that read raises (a miss), on any other the rank
      check passes.
    """
    tree = ast.parse("\n".join(lines) + "\nexcept Exception:\n    pass\n")
    body = tree.body[0].body  # type: ignore[attr-defined]
    kept = [(st, lines[st.lineno - 1:st.end_lineno]) for st in body]
    while True:
        dead = next((k for k, (st, _) in enumerate(kept)
                     if (name := _infallible_binding(st)) is not None
                     and not any(_reads(later, name) for later, _ in kept[k + 1:])), None)
        if dead is None:
            break
        del kept[dead]
    out = [lines[0]]
    for k, (st, text) in enumerate(kept):
        rank = _rank_check(st)
        if rank is not None and any(_starts_with_read(later, *rank) for later, _ in kept[k + 1:]):
            continue
        out += text
    return out


def _name(node: ast.AST, prefix: str) -> str | None:
    return node.id if isinstance(node, ast.Name) and node.id.startswith(prefix) else None


def _infallible_binding(st: ast.stmt) -> str | None:
    """``i_X`` when ``st`` is ``i_X = s_y[...]`` (an index or slice of constants, ``len`` and
    arithmetic: the rank was checked before), ``i_X = d_y`` or ``i_X = i_Y``."""
    if not (isinstance(st, ast.Assign) and len(st.targets) == 1):
        return None
    target = _name(st.targets[0], "i_")
    v = st.value
    if target is None:
        return None
    if _name(v, "d_") or _name(v, "i_"):
        return target
    if isinstance(v, ast.Subscript) and _name(v.value, "s_") and not any(
            isinstance(n, ast.Subscript) for n in ast.walk(v.slice)):
        return target
    return None


def _reads(st: ast.stmt, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(st))


def _rank_check(st: ast.stmt) -> tuple[str, int] | None:
    """``(s_x, r)`` when ``st`` is ``if not (len(s_x) >= r): raise _Miss`` with ``r > 0``."""
    if not (isinstance(st, ast.If) and not st.orelse and len(st.body) == 1
            and isinstance(st.body[0], ast.Raise)):
        return None
    t = st.test
    if not (isinstance(t, ast.UnaryOp) and isinstance(t.op, ast.Not)):
        return None
    c = t.operand
    if not (isinstance(c, ast.Compare) and len(c.ops) == 1 and isinstance(c.ops[0], ast.GtE)
            and isinstance(c.left, ast.Call) and _name(c.left.func, "len") == "len"
            and len(c.left.args) == 1 and _name(c.left.args[0], "s_")):
        return None
    r = c.comparators[0]
    if not (isinstance(r, ast.Constant) and type(r.value) is int and r.value > 0):
        return None
    return c.left.args[0].id, r.value  # type: ignore[attr-defined]


def _starts_with_read(st: ast.stmt, shape: str, r: int) -> bool:
    """Whether the first thing ``st`` evaluates is ``shape[-r]`` or ``shape[r - 1]``."""
    if isinstance(st, ast.Assign):
        node: ast.AST = st.value
    elif isinstance(st, ast.If):
        node = st.test
    else:
        return False
    while True:  # down the operand evaluated first
        if isinstance(node, ast.UnaryOp):
            node = node.operand
        elif isinstance(node, ast.Compare | ast.BinOp):
            node = node.left
        elif isinstance(node, ast.BoolOp):
            node = node.values[0]
        else:
            break
    if not (isinstance(node, ast.Subscript) and _name(node.value, "s_") == shape):
        return False
    try:
        index = ast.literal_eval(node.slice)
    except ValueError:
        return False
    return type(index) is int and index in (-r, r - 1)


def _tuple_code(items: list[str]) -> str:
    """Source of a tuple display: ``()``, ``(a,)``, ``(a, b)``."""
    if not items:
        return "()"
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _eval_off(off: _Off, env: dict) -> int:
    return _ev(off.code(), env)


def _ev(code: str, env: dict) -> Any:
    """Evaluate a generated sub-expression against a failing call's locals (slow path only,
    for the error message; the code is our own generated text)."""
    return eval(code, {"len": len, "tuple": tuple}, env)  # noqa: S307
