"""Property test: the generated call check against a brute-force reference checker.

Random signatures are built programmatically (input shapes from Dim names, int constants,
affine forms ``2 * H + 1`` and ``H + 3``, one ``*S`` Shape splice per input, a construction
param, dtype indices shared between inputs, constant dtypes, an optional input and a
refinement). Random calls are fed to the generated ``check``; the reference enumerates
assignments of the forall indices over small ranges (Dims 0..12, Shapes from the slices of
the actual shapes, dtypes from their declared sets), evaluates the declared shapes with
:func:`tileops.spec.eval_shape` and accepts iff some assignment matches every tensor and
every refinement. The two must accept exactly the same calls and infer the same outputs.

The tensors are plain objects with ``.shape`` and ``.dtype`` (dtype = the spec's name) read
through a custom :class:`DTypeAdapter`, so the test needs neither torch nor numpy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, note, settings
from hypothesis import strategies as st

from tileops.signature import DTypeAdapter, SignatureCallError, SignaturePlan
from tileops.spec import (
    DTYPES,
    EvalError,
    Expr,
    InputDecl,
    OpEntry,
    OutputDecl,
    ParamDecl,
    Scope,
    Signature,
    SpecError,
    eval_shape,
    evaluate,
    validate_entry,
)

DIMS = ("H", "W", "R")
DTYPE_SETS = (("float16", "float32"), ("float16", "bfloat16", "float32"), ("bfloat16",))
CONST_DTYPES = ("float32", "int32")
ACTUAL_DTYPES = ("float16", "bfloat16", "float32", "int32")
DIM_RANGE = range(13)
LET, LET_DEF = "L", "H // 2 + 1"  # a let over the first Dim, used in input shapes


class Fake:
    """A tensor-like: a shape tuple and the spec's dtype name."""

    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        self.shape = tuple(shape)
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def _checked(cond: Any, message: Any) -> None:  # the symbolic hook: raise on failure
    if not cond:
        raise AssertionError(message())


ADAPTER = DTypeAdapter("fake", {n: n for n in DTYPES}, check=_checked)


# --- random entries ------------------------------------------------------------------------


@st.composite
def shape_items(draw: Any, dims: tuple[str, ...], star: bool, param: bool) -> list[str]:
    atoms = [*dims, *(f"2 * {d} + 1" for d in dims), *(f"{d} + 3" for d in dims), "0", "1", "3"]
    if param:
        atoms.append("k")
    # axes unification cannot read (two unknowns, not affine, a let): checked once later
    # inputs have bound their indices
    hard = [*(f"{a} + {b}" for a in dims for b in dims if a < b), *(f"{d} // 2" for d in dims),
            *(f"{d} * {d}" for d in dims), LET]
    atom = st.sampled_from(atoms) | st.sampled_from(hard)
    items = draw(st.lists(atom, min_size=0, max_size=3))
    if star:
        items.insert(draw(st.integers(0, len(items))), "*S")
    return items


@st.composite
def entries(draw: Any) -> tuple[OpEntry, dict[str, Any]]:
    dims = tuple(DIMS[: draw(st.integers(1, len(DIMS)))])
    use_shape = draw(st.booleans())
    use_param = draw(st.booleans())
    dtype_sets = {"T": draw(st.sampled_from(DTYPE_SETS))}
    if draw(st.booleans()):
        dtype_sets["U"] = draw(st.sampled_from(DTYPE_SETS))
    n_required = draw(st.integers(1, 3))
    n_inputs = n_required + draw(st.integers(0, 1))
    # the optional input (if any) may come anywhere, even before the inputs that solve the
    # indices it uses
    opt_at = draw(st.integers(0, n_inputs - 1)) if n_inputs > n_required else -1
    inputs: dict[str, InputDecl] = {}
    for i in range(n_inputs):
        optional = i == opt_at
        items = draw(shape_items(dims, use_shape and draw(st.booleans()), use_param))
        dtype = draw(st.sampled_from([*dtype_sets, *CONST_DTYPES]))
        inputs[f"x{i}"] = InputDecl(dtype=Expr(dtype), shape=Expr("[" + ", ".join(items) + "]"),
                                    optional=Expr("True" if optional else "False"))
    required_names = {n for name, d in inputs.items() if d.optional.text == "False"
                      for n in [*d.shape.names(), d.dtype.text]}
    used = {n for d in inputs.values() for n in [*d.shape.names(), d.dtype.text]}
    lets = {LET: Expr(LET_DEF)} if LET in used else {}
    if lets:
        used.add(DIMS[0])
    forall: dict[str, Expr] = {}
    for d in dims:
        if d in used:
            forall[d] = Expr("Dim")
    if "S" in used:
        forall["S"] = Expr("Shape")
    for t, members in dtype_sets.items():
        if t in used:
            forall[t] = Expr(f"DType[{' | '.join(members)}]")
    solved_dims = [d for d in dims if d in required_names]
    out_atoms = [*solved_dims, *(f"{d} + 1" for d in solved_dims), "2"]
    out_items = draw(st.lists(st.sampled_from(out_atoms), max_size=3))
    if "S" in required_names and draw(st.booleans()):
        out_items.insert(draw(st.integers(0, len(out_items))), "*S")
    out_dtypes = [t for t in dtype_sets if t in required_names] + ["float32"]
    outputs = {"out": OutputDecl(dtype=Expr(draw(st.sampled_from(out_dtypes))),
                                 shape=Expr("[" + ", ".join(out_items) + "]"))}
    rules: list[Expr] = []
    if draw(st.booleans()) and solved_dims:
        a, b = draw(st.sampled_from(solved_dims)), draw(st.sampled_from(solved_dims))
        rules.append(Expr(draw(st.sampled_from(
            [f"{a} <= {b} + 1", f"{a} % 2 == 0", f"{a} != 1"]
            + (["len(S) <= 2"] if "S" in required_names else [])))))
    params = {"k": ParamDecl(type=Expr("int"), default=2)} if use_param else {}
    entry = OpEntry(family="prop", status="spec-only", signature=Signature(
        forall=forall, params=params, inputs=inputs, outputs=outputs, let=lets,
        shape_rules=tuple(rules)))
    values = {"k": draw(st.integers(0, 3))} if use_param else {}
    return entry, values


def describe(entry: OpEntry, params: dict[str, Any]) -> str:
    sig = entry.signature
    lines = [f"params {params}", "forall " + ", ".join(f"{n}: {e.text}"
                                                       for n, e in sig.forall.items())]
    for n, d in sig.inputs.items():
        opt = " (optional)" if d.optional.text != "False" else ""
        lines.append(f"  {n}: Tensor[{d.dtype.text}, {d.shape.text}]{opt}")
    for n, d in sig.outputs.items():
        lines.append(f"  -> {n}: Tensor[{d.dtype.text}, {d.shape.text}]")
    lines += [f"  let {n} = {e.text}" for n, e in sig.let.items()]
    lines += [f"  where {r.text}" for r in sig.shape_rules]
    return "\n".join(lines)


# --- random calls ----------------------------------------------------------------------------


def with_lets(entry: OpEntry, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` and every let whose names all have values."""
    out = dict(values)
    for n, e in entry.signature.let.items():
        if set(e.names()) <= set(out):
            out[n] = evaluate(e.node, Scope(out))
    return out


def declared(entry: OpEntry, scope_values: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    scope_values = with_lets(entry, scope_values)
    for n, d in entry.signature.inputs.items():
        yield n, (eval_shape(d.shape.node, Scope(scope_values)),
                  scope_values.get(d.dtype.text, d.dtype.text))


@st.composite
def calls(draw: Any, entry: OpEntry, params: dict[str, Any]) -> list[Fake | None]:
    sig = entry.signature
    if draw(st.integers(0, 2)) == 0:  # fully random tensors
        out: list[Fake | None] = []
        for d in sig.inputs.values():
            if d.optional.text != "False" and draw(st.booleans()):
                out.append(None)
                continue
            shape = draw(st.lists(st.integers(0, 6), max_size=4))
            out.append(Fake(tuple(shape), draw(st.sampled_from(ACTUAL_DTYPES))))
        return out
    # tensors that fit a random assignment, then maybe one mutation
    values: dict[str, Any] = dict(params)
    for n, k in sig.forall.items():
        if k.text == "Dim":
            values[n] = draw(st.integers(0, 5))
        elif k.text == "Shape":
            values[n] = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
        else:
            values[n] = draw(st.sampled_from(k.text[len("DType["):-1].split(" | ")))
    tensors: list[Fake | None] = []
    for (_, (shape, dtype)), d in zip(declared(entry, values), sig.inputs.values(), strict=True):
        absent = d.optional.text != "False" and draw(st.booleans())
        tensors.append(None if absent else Fake(shape, dtype))
    given_ = [i for i, t in enumerate(tensors) if t is not None]
    mutation = draw(st.sampled_from(["none", "none", "axis", "rank", "dtype"]))
    if mutation != "none":
        i = draw(st.sampled_from(given_))
        t = tensors[i]
        assert t is not None
        shape = list(t.shape)
        if mutation == "axis" and shape:
            j = draw(st.integers(0, len(shape) - 1))
            shape[j] = max(0, shape[j] + draw(st.sampled_from([-1, 1])))
        elif mutation == "rank":
            if shape and draw(st.booleans()):
                shape.pop(draw(st.integers(0, len(shape) - 1)))
            else:
                shape.insert(draw(st.integers(0, len(shape))), draw(st.integers(0, 6)))
        tensors[i] = Fake(tuple(shape), draw(st.sampled_from(ACTUAL_DTYPES))
                          if mutation == "dtype" else t.dtype)
    return tensors


# --- the brute-force reference ---------------------------------------------------------------


def reference(entry: OpEntry, params: dict[str, Any],
              tensors: list[Fake | None]) -> list[tuple[dict[str, Any], tuple]]:
    """Every assignment of the forall indices that makes the call fit, with the outputs it
    infers. A depth-first enumeration: an input is compared as soon as all its names have
    values (pruning only; every leaf is still a full assignment checked against everything)."""
    sig = entry.signature
    given_ = [(n, d, t) for (n, d), t in zip(sig.inputs.items(), tensors, strict=True)
              if t is not None]
    slices = {()} | {tuple(t.shape[a:b]) for _, _, t in given_
                     for a in range(len(t.shape) + 1) for b in range(a, len(t.shape) + 1)
                     if b - a <= 4}
    def names(d: InputDecl) -> list[str]:  # a let stands for the names it reads
        return [m for n in d.shape.names()
                for m in (sig.let[n].names() if n in sig.let else [n])]

    order: list[str] = []
    for _, d, _ in given_:
        for n in [d.dtype.text, *names(d)]:
            if n in sig.forall and n not in order:
                order.append(n)
    order += [n for n in sig.forall if n not in order]

    def domain(n: str) -> list[Any]:
        k = sig.forall[n].text
        if k == "Dim":
            return list(DIM_RANGE)
        if k == "Shape":
            return sorted(slices)
        return k[len("DType["):-1].split(" | ")

    def fits(d: InputDecl, t: Fake, values: dict[str, Any]) -> bool:
        dtype = values.get(d.dtype.text, d.dtype.text)
        try:
            return dtype == t.dtype and eval_shape(
                d.shape.node, Scope(with_lets(entry, values))) == t.shape
        except EvalError:
            return False

    found: list[tuple[dict[str, Any], tuple]] = []
    # the depth after which each input's names all have values
    ready = [max([order.index(n) + 1 for n in {d.dtype.text, *names(d)}
                  if n in sig.forall], default=0) for _, d, _ in given_]

    def search(i: int, values: dict[str, Any]) -> None:
        for (_, d, t), r in zip(given_, ready, strict=True):
            if r == i and not fits(d, t, values):
                return  # an input whose names just got their values fails: prune
        if i == len(order):
            scope = Scope(with_lets(entry, {**params, **values}))
            if not all(evaluate(r.node, scope) for r in sig.shape_rules):
                return
            outs = tuple((eval_shape(o.shape.node, scope), values.get(o.dtype.text, o.dtype.text))
                         for o in sig.outputs.values())
            found.append(({n: values[n] for n in sig.forall}, outs))
            return
        for v in domain(order[i]):
            search(i + 1, {**values, order[i]: v})

    search(0, dict(params))
    return found


# --- the property ----------------------------------------------------------------------------


def run_generated(fn: Any, tensors: list[Fake | None]) -> Any:
    try:
        return fn(*tensors)
    except SignatureCallError:
        return None
    except AssertionError:  # check_symbolic: a size check through the adapter hook
        if fn.__name__ != "check_symbolic":
            raise
        return None


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.filter_too_much])
@given(data=st.data())
def test_generated_check_accepts_exactly_what_the_reference_accepts(data: Any) -> None:
    entry, params = data.draw(entries())
    note(describe(entry, params))
    diagnostics = validate_entry("PropOp", entry)
    event("valid" if not diagnostics else f"rejected: {diagnostics[0].rule}")
    assume(not diagnostics)  # the validator rejects it (an unsolvable index, ...)
    plan = SignaturePlan("PropOp", entry, adapter=ADAPTER)
    try:
        point = plan.construct(**params)
    except SignatureCallError:  # no construction-only refinements are generated
        raise
    except SpecError as exc:  # the validator accepted it: the generator must compile it
        pytest.fail(f"valid entry rejected by the generator:\n{exc}")
    for _ in range(6):
        tensors = data.draw(calls(entry, params))
        note(f"call {tensors}")
        expected = reference(entry, params, tensors)
        got = run_generated(point.check, tensors)
        got_symbolic = run_generated(point.check_symbolic, tensors)
        event("accepted" if expected else "rejected")
        assert (got is not None) == bool(expected), (tensors, expected, got)
        assert (got_symbolic is not None) == bool(expected)
        if got is None:
            continue
        # the indices are determined by the call: every accepting assignment agrees
        # an index only absent optional inputs read fits every value and gets none
        free = _read(entry, [t is None for t in tensors]) - _read(
            entry, [t is not None for t in tensors])
        determined = {repr(({n: v for n, v in values.items() if n not in free}, outs))
                      for values, outs in expected}
        assert len(determined) == 1, expected
        values, outs = expected[0]
        indices = got.indices
        assert not free & set(indices)
        for n, v in values.items():
            if n in free:
                continue
            assert tuple(indices[n]) == v if isinstance(v, tuple) else indices[n] == v, n
        tensors_out = got.tensors
        assert [tensors_out[n] for n in entry.signature.outputs] == list(outs)
        # no effects declared: every given input is read once, the output written once
        traffic = {n: (math.prod(t.shape) * DTYPES[t.dtype], 0)
                   for n, t in zip(entry.signature.inputs, tensors, strict=True) if t is not None}
        traffic["out"] = (0, math.prod(outs[0][0]) * DTYPES[outs[0][1]])
        assert got.traffic == traffic
        assert got_symbolic.tensors == tensors_out


def _read(entry: OpEntry, which: list[bool]) -> set[str]:
    """The forall indices the shapes and dtypes of the chosen inputs name."""
    sig = entry.signature
    return {n for (_, d), w in zip(sig.inputs.items(), which, strict=True) if w
            for n in (*d.shape.names(), *d.dtype.names())} & set(sig.forall)


def test_reference_on_a_known_signature() -> None:
    # The reference itself, on the GEMM-like example: one assignment, the expected output.
    entry = OpEntry(family="prop", status="spec-only", signature=Signature(
        forall={"M": Expr("Dim"), "K": Expr("Dim"), "N": Expr("Dim"),
                "T": Expr("DType[float16 | bfloat16]")},
        inputs={"a": InputDecl(dtype=Expr("T"), shape=Expr("[M, K]")),
                "b": InputDecl(dtype=Expr("T"), shape=Expr("[K, N]"))},
        outputs={"c": OutputDecl(dtype=Expr("T"), shape=Expr("[M, N]"))}))
    found = reference(entry, {}, [Fake((3, 5), "bfloat16"), Fake((5, 2), "bfloat16")])
    assert found == [({"M": 3, "K": 5, "N": 2, "T": "bfloat16"}, (((3, 2), "bfloat16"),))]
    assert reference(entry, {}, [Fake((3, 5), "bfloat16"), Fake((4, 2), "bfloat16")]) == []
    point = SignaturePlan("GemmLike", entry, adapter=ADAPTER).construct()
    assert point.check(Fake((3, 5), "bfloat16"), Fake((5, 2), "bfloat16")).tensors["c"] == (
        (3, 2), "bfloat16")
