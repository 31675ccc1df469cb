"""Spec workloads as concrete calls: the cases of an op, their inputs, and how outputs are
compared with a float64 reference.

This is the one place that turns a spec entry's ``workloads`` into tensors; the ``tileops``
command line, the test suites and the benchmarks all use it, so a workload means the same call
everywhere.

- :func:`cases` (or :func:`cases_of` for an op class) turns each (workload row, dtype case)
  into a :class:`Case`: the constructor params of the op (its ``signature.params``) and an
  :class:`InputSpec` (shape, dtype, generated values) for every input, by evaluating the
  entry's shape expressions over the row's values the way the spec validator instantiates a
  row. Nothing here knows a particular op.
- :func:`make_inputs` draws the tensors of a case (seeded, so every contender and every run
  sees the same values).
- :func:`rel_l2` and :func:`compare` measure outputs against a reference;
  :data:`TOLERANCE` is the relative L2 error allowed against float64, by storage dtype.

Rows may be scaled down (``max_elements``): while some tensor, input or output, holds more than
``max_elements`` elements, the first ``forall`` Dim or Shape index its shape names that is
above 1 (a Shape from its leading axis) is reduced just enough for it. Shapes name batch and
row indices before row lengths (``[*B, N]``, ``[M, K]``), so rows go first and row lengths
keep their values where that suffices; parameters never change, and a row whose refinements
would break is kept whole.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tileops.spec import AdtDef, AdtValue, EvalError, OpEntry, Scope, eval_shape, evaluate
from tileops.spec import expr as E
from tileops.spec.kinds import (
    DTYPES,
    AdtK,
    AxesK,
    DimK,
    DTypeK,
    Kind,
    MaybeK,
    PerAxisK,
    ShapeK,
    kind_from_expr,
)

__all__ = [
    "TOLERANCE",
    "Case",
    "InputSpec",
    "as_outputs",
    "cases",
    "cases_of",
    "clone_inputs",
    "compare",
    "dtype_indices",
    "entry_dtypes",
    "kinds_of",
    "make_inputs",
    "rel_l2",
    "tolerance",
]

#: Relative L2 error allowed against the float64 reference, by the storage dtype. The
#: reference reads the same (already rounded) inputs, so only the op's own roundings count, and
#: every output is rounded to its storage dtype once: unit roundoff u = 2^-8 (bfloat16), 2^-11 (float16),
#: 2^-24 (float32), 2^-4 and 2^-3 (float8 e4m3 / e5m2). One rounding measures about 0.45 u
#: (``tileops run``: 1.7e-3 bf16, 2.1e-4 fp16, 6e-8 fp32). The bounds leave room for an
#: intermediate held in the storage dtype (bf16 2.6 u, fp16 4 u, float8 2 u) and, for float32,
#: for sums over rows of up to 65536 elements, whose error grows with the row (170 u). float64
#: is the reference's own precision. Integer and bool outputs must be exact.
TOLERANCE: dict[str, float] = {
    "bfloat16": 1e-2,
    "float16": 2e-3,
    "float32": 1e-5,
    "float64": 1e-12,
    "float8_e4m3fn": 1.25e-1,
    "float8_e5m2": 2.5e-1,
}


def tolerance(dtypes: Iterable[torch.dtype]) -> float:
    """The bound for an output: that of the coarsest floating dtype among ``dtypes`` (the
    call's inputs and the output itself); 0.0 (exact) when none is floating (a comparison, a
    test, integer arithmetic)."""
    tols = [TOLERANCE[str(d).removeprefix("torch.")] for d in dtypes
            if d.is_floating_point or d.is_complex]
    return max(tols, default=0.0)


@dataclass(frozen=True)
class InputSpec:
    """One input of a case: absent (``shape is None``) or a shape, a dtype name and, for
    metadata tensors, the values a generator gives."""

    name: str
    shape: tuple[int, ...] | None
    dtype: str | None
    values: tuple | None = None

    @property
    def numel(self) -> int:
        return 0 if self.shape is None else math.prod(self.shape)


@dataclass
class Case:
    """One concrete call of an op: a workload row under one dtype case."""

    op: str
    label: str
    dtypes: dict[str, str]  # DType index -> dtype name
    params: dict[str, Any]  # constructor keyword arguments (the row's params)
    inputs: list[InputSpec]
    values: dict[str, Any]  # every index value, after scaling
    scaled: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # index -> (was, now)

    @property
    def dtype(self) -> str:
        """The dtype shown for the case: the first present input's."""
        for i in self.inputs:
            if i.dtype is not None and i.shape is not None:
                return i.dtype
        return next(iter(self.dtypes.values()), "-")

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The shape shown for the case: the largest input's."""
        present = [i for i in self.inputs if i.shape is not None]
        if not present:
            return None
        return max(present, key=lambda i: i.numel).shape


def kinds_of(entry: OpEntry, adts: Mapping[str, AdtDef]) -> dict[str, Kind]:
    """The kind of every forall index, param and data index of the entry."""
    sig = entry.signature
    names = set(adts)
    out: dict[str, Kind] = {}
    for n, ex in sig.forall.items():
        out[n] = kind_from_expr(ex.node, names)
    for n, p in sig.params.items():
        out[n] = kind_from_expr(p.type.node, names)
    for n, ex in sig.data.items():
        out[n] = kind_from_expr(ex.node, names)
    return out


def dtype_indices(entry: OpEntry, adts: Mapping[str, AdtDef]) -> dict[str, tuple[str, ...]]:
    """The entry's ``forall`` DType indices and their members."""
    kinds = kinds_of(entry, adts)
    return {n: k.members for n in entry.signature.forall
            if isinstance(k := kinds[n], DTypeK)}


def entry_dtypes(entry: OpEntry, adts: Mapping[str, AdtDef]) -> list[str]:
    """Every dtype some DType index of the entry admits, in declaration order."""
    out: dict[str, None] = {}
    for members in dtype_indices(entry, adts).values():
        out.update(dict.fromkeys(members))
    return list(out)


def _to_value(v: Any, k: Kind, adts: Mapping[str, AdtDef]) -> Any:
    if isinstance(k, MaybeK):
        return None if v is None else _to_value(v, k.inner, adts)
    if isinstance(k, ShapeK) or (isinstance(k, PerAxisK | AxesK) and isinstance(v, list)):
        return tuple(v)
    if isinstance(k, AdtK) and isinstance(v, dict) and k.name in adts:
        ((ctor_name, fields),) = v.items()
        ctor = adts[k.name].constructors[ctor_name]
        return AdtValue(ctor_name, {
            fn: _to_value(fv, kind_from_expr(ctor.fields[fn].node, set(adts)), adts)
            for fn, fv in (fields or {}).items()
        })
    return v


class _Row:
    """One row under one dtype case, evaluated."""

    def __init__(self, name: str, entry: OpEntry, adts: Mapping[str, AdtDef], row,
                 case: Mapping[str, str], kinds: Mapping[str, Kind]) -> None:
        self.name, self.entry, self.adts, self.row, self.kinds = name, entry, adts, row, kinds
        sig = entry.signature
        values: dict[str, Any] = {}
        for n, k in kinds.items():
            if n in case:
                values[n] = case[n]
            elif n in row.values:
                values[n] = _to_value(row.values[n], k, adts)
            elif n in sig.params and not sig.params[n].required:
                values[n] = _to_value(sig.params[n].default, k, adts)
            elif isinstance(k, DTypeK) and len(k.members) == 1:
                values[n] = k.members[0]
        self.base = values
        self.optional = [n for n, d in sig.inputs.items() if d.optional.node != E.Bool(False)]
        self.present = {n: n in row.some for n in self.optional}

    def _scope(self, values: Mapping[str, Any], generators: bool = False) -> Scope:
        return Scope(dict(values), self.entry.signature.types, self.present, generators)

    def evaluate(self, values: dict[str, Any]) -> tuple[dict[str, Any], list[InputSpec]]:
        """Lets, then every input's shape, dtype and generated values (and, after the inputs,
        every output whose shape evaluates, as an :class:`InputSpec` named ``"->name"``: the
        sizes the scaling looks at)."""
        sig = self.entry.signature
        values = dict(values)
        pending = list(sig.let)
        while pending:  # in dependency order: evaluate what can be, until nothing moves
            left = []
            for n in pending:
                try:
                    values[n] = evaluate(sig.let[n].node, self._scope(values))
                except EvalError:
                    left.append(n)
            if len(left) == len(pending):
                n = left[0]
                values[n] = evaluate(sig.let[n].node, self._scope(values))  # raises
            pending = left
        scope = self._scope(values)
        inputs = []
        for n, d in sig.inputs.items():
            if n in self.present and not self.present[n]:
                inputs.append(InputSpec(n, None, None))
                continue
            shape = eval_shape(d.shape.node, scope)
            dtype = evaluate(d.dtype.node, scope)
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise EvalError(f"the dtype of {n} ({d.dtype.text}) is {dtype!r}, not a dtype")
            data = None
            if d.values is not None:
                data = tuple(evaluate(d.values.node, self._scope(values, generators=True)))
            inputs.append(InputSpec(n, tuple(shape), dtype, data))
        for n, d in sig.outputs.items():
            try:
                shape = eval_shape(d.shape.node, scope)
            except EvalError:
                continue  # e.g. a nullable output whose shape needs an absent input
            inputs.append(InputSpec(f"->{n}", tuple(shape), None))
        return values, inputs

    def refinements_hold(self, values: Mapping[str, Any]) -> bool:
        scope = self._scope(values)
        try:
            return all(evaluate(r.node, scope) for r in self.entry.signature.shape_rules)
        except EvalError:
            return False

    def scalable(self, tensor: str) -> list[str]:
        """The forall Dim/Shape indices ``tensor``'s shape names, in order, a ``let`` standing
        for the indices its definition reads. An index a generator reads (``class_targets(N,
        V, ...)``) shrinks like any other: each step evaluates the row again, generated
        values included, so they follow it."""
        sig = self.entry.signature
        decl = sig.outputs[tensor[2:]] if tensor.startswith("->") else sig.inputs[tensor]
        out: list[str] = []
        names = list(decl.shape.names())
        seen = set()
        while names:
            n = names.pop(0)
            if n in seen:
                continue
            seen.add(n)
            if n in sig.let:  # a let shape (broadcast(SA, SB)) shrinks through what it reads
                names[:0] = list(sig.let[n].names())
            elif n in sig.forall and isinstance(self.kinds.get(n), DimK | ShapeK):
                out.append(n)
        return out


def _numel_max(tensors: Iterable[InputSpec]) -> int:
    return max((i.numel for i in tensors), default=0)


def _shrink(row: _Row, values: dict[str, Any], tensors: list[InputSpec], cap: int):
    """Reduce indices until no tensor exceeds ``cap`` elements: each step takes the largest
    tensor (inputs and outputs) whose shape names an index above 1 (a ``let`` shape,
    ``broadcast(SA, SB)``, names the indices it reads) and shrinks the first such index (a
    Shape index from its leading axis), just enough for that tensor.
    Where shrinking a Shape's axis alone breaks the row (shapes that must broadcast), the
    axes of the other Shape indices that line up with it from the right and had the same
    length shrink with it."""
    original = dict(values)
    for _ in range(256):
        if max((t.numel for t in tensors), default=0) <= cap:
            break
        step = None
        for t in sorted(tensors, key=lambda t: -t.numel):
            if t.numel <= cap:
                break
            step = _shrink_step(row, values, t, cap)
            if step is not None:
                break
        if step is None:
            break  # nothing left to shrink in the tensors over the cap: keep what there is
        values, tensors = step
    if not row.refinements_hold(values):
        return original, None
    return values, tensors


def _shrink_step(row: _Row, values: dict[str, Any], tensor: InputSpec, cap: int):
    """``(values, tensors)`` after one index of ``tensor`` shrank, or None where none can."""
    numel = tensor.numel
    for n in row.scalable(tensor.name):
        v = values[n]
        if isinstance(v, int):
            if v <= 1:
                continue
            tries = [{**values, n: max(1, min(v - 1, v * cap // numel))}]
        else:
            dims = list(v)
            pos = next((i for i, d in enumerate(dims) if d > 1), None)
            if pos is None:
                continue
            new = max(1, min(dims[pos] - 1, dims[pos] * cap // numel))
            alone = {**values, n: (*dims[:pos], new, *dims[pos + 1:])}
            joint = dict(alone)
            back = len(dims) - pos  # the axis, counted from the right
            for m, w in values.items():
                if m != n and isinstance(row.kinds.get(m), ShapeK) and m in \
                        row.entry.signature.forall and len(w) >= back and \
                        w[len(w) - back] == dims[pos]:
                    joint[m] = (*w[:len(w) - back], new, *w[len(w) - back + 1:])
            tries = [alone, joint]
        for attempt in tries:
            try:
                evaluated = row.evaluate(attempt)
            except EvalError:
                continue
            if row.refinements_hold(evaluated[0]):
                return evaluated
        return None
    return None


def cases(name: str, entry: OpEntry, adts: Mapping[str, AdtDef], *,
          dtypes: Iterable[str] | None = None, labels: Iterable[str] | None = None,
          max_elements: int | None = None) -> list[Case]:
    """Every (workload row, dtype case) of the entry as a :class:`Case`.

    ``dtypes``: run every row in these dtypes instead of its own dtype cases (each DType index
    that admits the dtype takes it; a row no index admits it for is left out). ``labels``:
    only the rows whose label matches one of these shell patterns. ``max_elements``: scale
    rows down (see the module docstring)."""
    kinds = kinds_of(entry, adts)
    dt_indices = dtype_indices(entry, adts)
    wanted = list(dtypes) if dtypes else None
    patterns = list(labels) if labels else None
    out: list[Case] = []
    for row in entry.workloads:
        if patterns and not any(fnmatch.fnmatchcase(row.label, p) for p in patterns):
            continue
        if wanted is None:
            row_cases = [dict(c) for c in row.dtype_cases] or [{}]
        else:
            row_cases = []
            for dt in wanted:
                case = {n: dt for n, members in dt_indices.items() if dt in members}
                if case or not dt_indices:
                    row_cases.append(case)
        seen: set[tuple] = set()
        for case in row_cases:
            key = tuple(sorted(case.items()))
            if key in seen:
                continue
            seen.add(key)
            r = _Row(name, entry, adts, row, case, kinds)
            values, tensors = r.evaluate(r.base)
            scaled: dict[str, tuple[Any, Any]] = {}
            if max_elements and _numel_max(tensors) > max_elements:
                new_values, new_tensors = _shrink(r, dict(values), tensors, max_elements)
                if new_tensors is not None:
                    scaled = {n: (values[n], new_values[n]) for n in values
                              if new_values[n] != values[n] and n in entry.signature.forall}
                    values, tensors = new_values, new_tensors
            inputs = [t for t in tensors if not t.name.startswith("->")]
            params = {n: row.values[n] for n in entry.signature.params if n in row.values}
            dts = {n: values[n] for n in dt_indices if n in values}
            out.append(Case(name, row.label, dts, params, inputs, values, scaled))
    return out


def cases_of(cls: Any, **filters: Any) -> list[Case]:
    """:func:`cases` of an op class's own entry (``cls._signature``), with the same filters."""
    plan = cls._signature
    if plan is None:
        raise TypeError(f"{cls.__name__} has no spec entry, so it has no workloads")
    return cases(plan.name, plan.entry, plan.adts, **filters)


# --- tensors ----------------------------------------------------------------------------------


def make_inputs(case: Case, device: torch.device | str = "cpu",
                seed: int = 0) -> list[torch.Tensor | None]:
    """The inputs of ``case`` on ``device``, in the entry's input order: None for an absent
    optional input, the generated values for a metadata tensor, standard normal floats
    (drawn in float32 for one-byte float types, which have no normal sampler), a fair coin for
    bool and integers in [0, 8) otherwise. The same ``seed`` gives the same values on the same
    device; MPS draws on the CPU (its generator is not seedable the same way)."""
    device = torch.device(device)
    gen = torch.Generator(device=device if device.type != "mps" else "cpu")
    gen.manual_seed(seed)
    out: list[torch.Tensor | None] = []
    for spec in case.inputs:
        if spec.shape is None:
            out.append(None)
            continue
        dtype = getattr(torch, spec.dtype)
        if spec.values is not None:
            out.append(torch.tensor(spec.values, dtype=dtype, device=device).reshape(spec.shape))
        elif dtype.is_floating_point or dtype.is_complex:
            make = dtype if dtype.itemsize > 1 else torch.float32
            t = torch.randn(spec.shape, dtype=make, generator=gen, device=gen.device)
            out.append(t.to(device=device, dtype=dtype))
        elif dtype == torch.bool:
            t = torch.rand(spec.shape, generator=gen, device=gen.device) < 0.5
            out.append(t.to(device))
        else:
            t = torch.randint(0, 8, spec.shape, generator=gen, device=gen.device)
            out.append(t.to(device=device, dtype=dtype))
    return out


def clone_inputs(inputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Fresh copies of ``inputs`` (None stays None), so that an in-place op or contender
    starts from the same values as every other."""
    return [None if t is None else t.clone() for t in inputs]


def as_outputs(result: Any) -> tuple:
    """An op's or contender's return value as a tuple of outputs (a lone tensor is one)."""
    return result if isinstance(result, tuple) else (result,)


#: elements :func:`rel_l2` widens to float64 at a time: a slice's temporaries stay near 1 GiB
#: where whole tensors would not fit (a DeepSeek-V3 expert bank's gradient, 3.8e9 elements,
#: is 30 GB in float64 a copy)
_REL_L2_SLICE = 1 << 25


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||`` over the finite elements of ``ref``, divided by ``||ref||`` there, in
    float64 (the absolute error where ``ref`` is zero). A non-finite element of ``ref`` (the
    log of a negative number, the reciprocal of zero), or one that overflows ``out``'s dtype
    (the reciprocal of 1e-6 in float16), must be the same in ``out``: NaN where it is NaN, the
    same infinity where it is one. ``inf`` when the shapes differ or ``out`` is
    non-finite anywhere else, so a broken output can never pass a tolerance. Computed a slice
    of the flattened tensors at a time (:data:`_REL_L2_SLICE` elements), the norms combined."""
    if out.shape != ref.shape:
        return math.inf
    wide = torch.float64 if not out.is_complex() else torch.complex128
    flat_out, flat_ref = out.detach().reshape(-1), ref.detach().reshape(-1)
    diff = scale = 0.0
    for lo in range(0, flat_out.numel(), _REL_L2_SLICE):
        parts = _l2_parts(flat_out[lo:lo + _REL_L2_SLICE], flat_ref[lo:lo + _REL_L2_SLICE],
                          wide)
        if parts is None:
            return math.inf
        diff, scale = math.hypot(diff, parts[0]), math.hypot(scale, parts[1])
    return diff / scale if scale > 0 else diff


def _l2_parts(out: torch.Tensor, ref: torch.Tensor, wide: torch.dtype
              ) -> tuple[float, float] | None:
    """:func:`rel_l2`'s two norms over one slice (``||out - ref||`` and ``||ref||`` over the
    finite elements of ``ref``), None where the slice fails the non-finite rules."""
    o, r = out.to(wide), ref.to(wide)
    if out.is_floating_point() and ref.is_floating_point():
        # what the output's dtype makes of the reference: 1 / 1e-6 is inf in float16
        rounded = ref.to(out.dtype).to(wide)
        r = torch.where(torch.isfinite(rounded), r, rounded)
    finite = torch.isfinite(r)
    if not bool(finite.all()):
        odd = ~finite
        same = torch.isnan(r[odd]) == torch.isnan(o[odd])
        same &= torch.isnan(r[odd]) | (o[odd] == r[odd])
        if not bool(same.all()):
            return None
        o, r = o[finite], r[finite]
    if not bool(torch.isfinite(o).all()):
        return None
    return torch.linalg.vector_norm(o - r).item(), torch.linalg.vector_norm(r).item()


def compare(outs: Sequence[Any], refs: Sequence[Any]) -> float:
    """The largest :func:`rel_l2` over the outputs present (not None) in both ``outs`` and
    ``refs``, paired in order. A call that returned none of the outputs the reference has is
    an error, not a match (a contender returning None would otherwise pass every check)."""
    errs = [rel_l2(o, r) for o, r in zip(outs, refs, strict=False)
            if o is not None and r is not None]
    if not errs and any(r is not None for r in refs):
        raise ValueError(f"returned none of the outputs to compare (got {len(outs)} "
                         f"output{'s' if len(outs) != 1 else ''}, none a tensor)")
    return max(errs) if errs else 0.0
