"""The bad-input corpus of an op, and the variants of good calls that must work, derived from
its signature (``type(op)._signature``: the entry's shapes, dtypes, optional inputs, params).

Every call is built from one base case of the op (:func:`~._harness.base_cases`: one per
structure of its calls) by changing one thing, and what a change means is decided by
evaluating the entry's own shape and dtype expressions at changed index values, so type
families (``Mat[trans_b, K, N]``), variadic Shape indices (``[*B, N]``) and lets need no
special case:

- ``rank``: an input with one axis more and one fewer. A fixed-rank input gains a leading
  axis or loses its first. A variadic one (``[*B, N]``) loses one below the fewest the spec
  admits; it gains one inside its Shape index, which is refused where another input shares
  that index and otherwise must WORK where the refinements still hold (a call the spec
  admits, a valid variant; masked_fill's mask cannot grow past x's rank).
- ``dim``: an axis that disagrees with an index an earlier input bound (the index perturbed
  in a later input that shares it), or with a construction param (``normalized_shape``).
- ``dtype``: each dtype outside the input's union; ``dtype-mixed``: two inputs of one DType
  index with different members of it.
- ``missing-*``: a required input left out of a positional call, passed as None, or left out
  of a keyword call; ``extra-positional``; ``keyword``: an unknown keyword, a construction
  param passed to the call, an input given twice; ``device``: one input on another device
  (cpu and meta exist on every machine).
- valid: each input (and all at once) as a strided, a column-major and an offset view.

Kinds whose calls do not depend on the structure (dtypes, arity, keywords) are made once per
op, on its first base case that has the input.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tileops.ops.workloads import Case
from tileops.spec import EvalError, evaluate
from tileops.spec import expr as E
from tileops.spec.kinds import DTYPES, DimK, DTypeK, ShapeK

from ._harness import OPS, _scope, admitted_dtypes, base_cases, presence, spec_input_shapes

__all__ = ["Refusal", "Valid", "refusals", "valid_calls"]

Tensors = list  # the good call's inputs (fresh copies), None for an absent optional input


@dataclass(frozen=True)
class Refusal:
    """A call the op must refuse. ``make(good)`` gives its ``(args, kwargs)``. The refusal's
    first line must name the op and one of ``culprits`` (where two inputs disagree, the one
    that bound the index and the other: either may be blamed; empty where no argument has a
    name, as with an extra positional);
    ``stated``: alternatives, each a group of words the message must all state (the expected
    and the seen value). ``structured``: a :class:`~tileops.signature.SignatureCallError`,
    whose ``because`` line must state them."""

    case: Case
    kind: str
    detail: str
    make: Callable[[Tensors], tuple[tuple, dict]]
    culprits: tuple[str, ...]
    stated: tuple[tuple[str, ...], ...] = ()
    structured: bool = False

    @property
    def id(self) -> str:
        return f"{self.case.op}-{self.case.label}-{self.kind}-{self.detail}"


@dataclass(frozen=True)
class Valid:
    """A call the op must accept and compute right: ``make(good)`` gives its inputs;
    ``values`` are the call's index values (for the spec's inference of its outputs)."""

    case: Case
    kind: str
    detail: str
    make: Callable[[Tensors], Tensors]
    values: dict[str, Any]

    @property
    def id(self) -> str:
        return f"{self.case.op}-{self.case.label}-{self.kind}-{self.detail}"


class _Base:
    """One base case, read through its signature."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.plan = OPS[case.op]._signature
        self.present = presence(case)
        self.values = dict(case.values)
        self.shapes = spec_input_shapes(self.plan, self.values, self.present)
        assert self.shapes == {i.name: i.shape for i in case.inputs}
        self.given = [n for n in self.plan.input_names if self.shapes[n] is not None]
        self.dtypes = {i.name: i.dtype for i in case.inputs}

    def position(self, name: str) -> int:
        return self.plan.input_names.index(name)

    def named(self, name: str, kinds: type | tuple[type, ...]) -> list[str]:
        """The forall indices of those kinds that input ``name``'s shape names."""
        sig = self.plan.sig
        return [m for m in dict.fromkeys(sig.inputs[name].shape.names())
                if m in sig.forall and isinstance(self.plan.kinds[m], kinds)]

    def shape_at(self, name: str, changes: dict[str, Any]) -> tuple[int, ...]:
        return spec_input_shapes(self.plan, {**self.values, **changes}, self.present)[name]

    def swap(self, name: str, fn: Callable[[torch.Tensor], Any]) -> Callable[[Tensors], Tensors]:
        """``good`` with input ``name`` replaced by ``fn(good[name])``."""
        i = self.position(name)
        return lambda good: [fn(t) if k == i else t for k, t in enumerate(good)]

    def refusal(self, kind: str, detail: str, name: str, fn: Callable, **kw: Any) -> Refusal:
        swap = self.swap(name, fn)
        return Refusal(self.case, kind, detail, lambda good: (tuple(swap(good)), {}), **kw)


def _zeros(shape: tuple[int, ...], dtype: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: torch.zeros(shape, dtype=getattr(torch, dtype), device=t.device)


def _normal(shape: tuple[int, ...], dtype: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def make(t: torch.Tensor) -> torch.Tensor:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
        return x.to(device=t.device, dtype=getattr(torch, dtype))

    return make


def _perturbed(v: Any) -> Any:
    """An index or param value one larger (a Shape's first axis); None if it has no size."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v + 1
    if isinstance(v, tuple | list) and v and all(type(d) is int for d in v):
        return (v[0] + 1, *v[1:])
    return None


def _first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[str, str]:
    i = next(k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    return str(a[i]), str(b[i])


# --- refusals ---------------------------------------------------------------------------------


def _rank(b: _Base) -> Iterator[Refusal | Valid]:
    for n in b.given:
        shape, dt = b.shapes[n], b.dtypes[n]
        variadic = [s for s in b.named(n, ShapeK)
                    if len(b.shape_at(n, {s: (2, *b.values[s])})) != len(shape)]
        if not variadic:
            yield b.refusal("rank", f"{n}-plus-one", n, _zeros((2, *shape), dt), culprits=(n,))
            if shape:
                yield b.refusal("rank", f"{n}-minus-one", n, _zeros(shape[1:], dt),
                                culprits=(n,))
            continue
        try:
            least = b.shape_at(n, dict.fromkeys(variadic, ()))
        except EvalError:  # a let refuses the emptied shape (reduce_shape over dim=1 at rank 0)
            least = ()
        if least:
            yield b.refusal("rank", f"{n}-below-least", n, _zeros(least[1:], dt), culprits=(n,))
        s = variadic[0]
        grown_values = {**b.values, s: (2, *b.values[s])}
        grown = b.shape_at(n, grown_values)
        sharers = tuple(m for m in b.given if m != n and s in b.named(m, ShapeK))
        if sharers:
            yield b.refusal("rank", f"{n}-plus-one", n, _zeros(grown, dt),
                            culprits=(n, *sharers))
        elif _refinements_hold(b, grown_values):
            yield Valid(b.case, "rank", f"{n}-plus-one-in-{s}", b.swap(n, _normal(grown, dt)),
                        grown_values)


def _refinements_hold(b: _Base, values: dict[str, Any]) -> bool:
    """Whether every refinement of the entry holds at ``values`` (by the spec's evaluator)."""
    try:
        scope = _scope(b.plan, values, presence(b.case))
        return all(bool(evaluate(rule.node, scope)) for rule in b.plan.sig.shape_rules)
    except EvalError:  # a primitive refuses the values (shapes that do not broadcast)
        return False


def _dims(b: _Base) -> Iterator[Refusal]:
    sig = b.plan.sig
    for index in sig.forall:
        users = [n for n in b.given if index in b.named(n, (DimK, ShapeK))]
        v = _perturbed(b.values.get(index))
        if len(users) < 2 or v is None:
            continue
        for j in users[1:]:
            new = b.shape_at(j, {index: v})
            if len(new) == len(b.shapes[j]) and new != b.shapes[j]:
                yield b.refusal("dim", f"{index}-in-{j}", j, _zeros(new, b.dtypes[j]),
                                culprits=(users[0], j),
                                stated=(_first_difference(b.shapes[j], new),), structured=True)
    for param in sig.params:
        v = _perturbed(b.values.get(param))
        if v is None:
            continue
        for n in b.given:
            try:
                new = b.shape_at(n, {param: v})
            except EvalError:  # the perturbed param fits no shape (a dim past the rank)
                continue
            if len(new) == len(b.shapes[n]) and new != b.shapes[n]:
                yield b.refusal("dim", f"{param}-in-{n}", n, _zeros(new, b.dtypes[n]),
                                culprits=(n,), stated=(_first_difference(b.shapes[n], new),),
                                structured=True)


def _dtypes(b: _Base) -> Iterator[Refusal]:
    sig = b.plan.sig
    for n in b.given:
        admitted = admitted_dtypes(b.plan, n, b.values, b.present)
        for d in (d for d in DTYPES if d not in admitted):
            # the first input of an index states the union; a later one the bound member
            stated = ((d, *sorted(admitted)), (d, b.dtypes[n]))
            yield b.refusal("dtype", f"{n}-{d}", n, _zeros(b.shapes[n], d), culprits=(n,),
                            stated=stated, structured=True)
    for index in sig.forall:
        kind = b.plan.kinds[index]
        if not isinstance(kind, DTypeK):
            continue
        users = [n for n in b.given if sig.inputs[n].dtype.node == E.Name(index)]
        if len(users) < 2:  # (an index only absent optional inputs give has no value)
            continue
        other = next((m for m in kind.members if m != b.values[index]), None)
        if other is None:
            continue
        for j in users[1:]:
            yield b.refusal("dtype-mixed", f"{index}-in-{j}-{other}", j,
                            _zeros(b.shapes[j], other), culprits=(users[0], j),
                            stated=((b.values[index], other),), structured=True)


def _arity(b: _Base) -> Iterator[Refusal]:
    names = b.plan.input_names
    first = b.position(b.given[0])
    for r in names:
        if r in b.plan.optional_inputs:
            continue
        i = b.position(r)
        yield Refusal(b.case, "missing-positional", r, lambda g, i=i: (tuple(g[:i]), {}),
                      culprits=(r,))
        yield Refusal(b.case, "missing-none", r,
                      lambda g, i=i: (tuple(None if k == i else t for k, t in enumerate(g)), {}),
                      culprits=(r,), structured=True)
        if any(m != r for m in b.given):  # else the keyword call is the empty call above
            yield Refusal(b.case, "missing-keyword", r, lambda g, r=r: ((), {
                n: t for n, t in zip(names, g, strict=True) if n != r and t is not None}),
                culprits=(r,))
    yield Refusal(b.case, "extra-positional", f"{len(names) + 1}-given",
                  lambda g: ((*g, g[first].clone()), {}), culprits=(),
                  stated=((str(len(names) + 1),),))
    yield Refusal(b.case, "keyword", "unknown", lambda g: (tuple(g), {"unknown": g[first]}),
                  culprits=("unknown",))
    for p in b.plan.param_names:
        yield Refusal(b.case, "keyword", f"param-{p}",
                      lambda g, p=p: (tuple(g), {p: b.values[p]}), culprits=(p,))
    yield Refusal(b.case, "keyword", f"{names[first]}-twice",
                  lambda g: (tuple(g), {names[first]: g[first]}), culprits=(names[first],))


def _devices(b: _Base) -> Iterator[Refusal]:
    for n in b.given[1:]:
        yield b.refusal("device", f"{n}-on-meta", n, lambda t: t.to("meta"), culprits=(n,),
                        stated=(("cpu", "meta"),))


# --- valid variants ---------------------------------------------------------------------------


def _strided(t: torch.Tensor) -> torch.Tensor:
    """Every other element of a buffer twice as long in the last axis."""
    v = torch.empty((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)[..., ::2]
    return v.copy_(t)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The last two axes laid out transposed."""
    return t.mT.contiguous().mT


def _offset(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, one element into its storage (so not aligned to 16 bytes either)."""
    v = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    return v.copy_(t)


#: view kind -> (which shapes it makes a non-trivial view of, the view)
VIEWS: dict[str, tuple[Callable[[tuple[int, ...]], bool], Callable]] = {
    "strided": (lambda s: len(s) >= 1 and s[-1] > 1, _strided),
    "column-major": (lambda s: len(s) >= 2 and s[-1] > 1 and s[-2] > 1, _column_major),
    "offset": (lambda s: True, _offset),
}


def _views(b: _Base) -> Iterator[Valid]:
    for kind, (applies, view) in VIEWS.items():
        names = [n for n in b.given if applies(b.shapes[n])]
        for n in names:
            yield Valid(b.case, kind, n, b.swap(n, view), b.values)
        if len(names) > 1:
            pos = {b.position(n) for n in names}

            def every(good, pos=pos, view=view):
                return [view(t) if k in pos else t for k, t in enumerate(good)]

            yield Valid(b.case, kind, "all", every, b.values)


# --- the corpus -------------------------------------------------------------------------------

#: kinds whose calls do not depend on the base case's structure: made once per op
_ONCE = {"dtype", "missing-positional", "missing-none", "missing-keyword", "extra-positional",
         "keyword"}


@functools.cache
def _corpus(cls: type) -> tuple[list[Refusal], list[Valid]]:
    refused: list[Refusal] = []
    valid: list[Valid] = []
    seen: set[tuple[str, str]] = set()
    for case in base_cases(cls):
        b = _Base(case)
        for item in (*_rank(b), *_dims(b), *_dtypes(b), *_arity(b), *_devices(b), *_views(b)):
            if isinstance(item, Valid):
                valid.append(item)
                continue
            if item.kind in _ONCE:
                if (item.kind, item.detail) in seen:
                    continue
                seen.add((item.kind, item.detail))
            refused.append(item)
    return refused, valid


def refusals() -> list[Refusal]:
    """The bad-input corpus of every op."""
    return [r for cls in OPS.values() for r in _corpus(cls)[0]]


def valid_calls() -> list[Valid]:
    """The valid variants of every op."""
    return [v for cls in OPS.values() for v in _corpus(cls)[1]]
