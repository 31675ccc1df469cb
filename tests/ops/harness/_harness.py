"""What every part of the harness shares: the ops, their cases, the tolerances, the spec's own
inference of a call, the check of one call's outputs against the op's float64 reference
(``op.fp64_reference``), the capturing compile backend, and the one list of known defects.

The spec's inference here is computed by the spec language's evaluator (``tileops.spec``)
over a case's index values, not by the checks generated from the signature, so comparing the
two tests the generated code against the spec it came from.
"""

from __future__ import annotations

import importlib
import itertools
import json
import operator
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import tileops.ops
from tileops.ops.workloads import TOLERANCE, Case, cases_of, rel_l2, tolerance
from tileops.runtime import Op, default_specs, register_specs
from tileops.spec import EvalError, OpEntry, Scope, eval_shape, evaluate
from tileops.spec.kinds import BoolK, DTypeK, EnumK

__all__ = [
    "CPU_CAP",
    "IMPLEMENTED",
    "KNOWN_DEFECTS",
    "Capture",
    "OPS",
    "TOLERANCE",
    "admitted_dtypes",
    "base_cases",
    "case_id",
    "check_outputs",
    "returned_only",
    "defect_marks",
    "dtype_name",
    "node_outputs",
    "presence",
    "returned_by_node",
    "spec_input_shapes",
    "spec_outputs",
    "tolerance",
]


# --- the ops ----------------------------------------------------------------------------------


#: The harness covers the shipped ops. ``TILEOPS_HARNESS`` (JSON: ``{"specs": [paths],
#: "modules": [importable names]}``) points it at other ops instead: the spec files are
#: registered, the modules imported, and their implemented entries' classes are the ops (how a
#: scaffolded op is run through this very harness, tests/ops/test_scaffold.py).
_ELSEWHERE = json.loads(os.environ.get("TILEOPS_HARNESS", "null"))
if _ELSEWHERE is not None:
    register_specs(*_ELSEWHERE["specs"])
    _SOURCES = [importlib.import_module(m) for m in _ELSEWHERE["modules"]]
    _SPEC_FILES = {Path(p).resolve() for p in _ELSEWHERE["specs"]}
else:
    _SOURCES = [tileops.ops]
    _SPEC_FILES = None


def _implemented_entries() -> dict[str, OpEntry]:
    """The ``status: implemented`` entries of the shipped spec files (those in
    ``tileops.ops.SPEC_DIR``; specs a test registers elsewhere are not the library's), or of
    the files ``TILEOPS_HARNESS`` names."""
    specs = default_specs()
    root = Path(tileops.ops.SPEC_DIR).resolve()
    out = {}
    for name in specs.names():
        entry, spec_file, _ = specs.find(name)
        path = Path(spec_file.path).resolve()
        ours = path.parent == root if _SPEC_FILES is None else path in _SPEC_FILES
        if entry.status == "implemented" and ours:
            out[name] = entry
    return out


def _class_of(name: str) -> type[Op] | None:
    for module in _SOURCES:
        cls = getattr(module, name, None)
        if isinstance(cls, type) and issubclass(cls, Op):
            return cls
    return None


#: every implemented entry of the shipped specs, by name, in spec order
IMPLEMENTED: dict[str, OpEntry] = _implemented_entries()

#: the op class of each implemented entry that :mod:`tileops.ops` exports under the entry's
#: name (an entry without one fails ``test_numerics.test_every_implemented_entry_has_a_class``)
OPS: dict[str, type[Op]] = {n: cls for n in IMPLEMENTED if (cls := _class_of(n)) is not None}


# --- cases and tolerances ---------------------------------------------------------------------

#: Elements per tensor on CPU. ``tileops run`` scales to 2^20; at that size a call of the
#: reference target or of the float64 reference takes 30-80 ms on the 2-core CI machine, and
#: the workloads, the corpus and the compiled calls make several hundred of them. At 2^14 a
#: case costs about a millisecond. The builder shrinks rows (batch indices, then M or K) before
#: row lengths, so the norms keep their row lengths up to 16384, 4097 and 7 whole (65536 too:
#: a row length that is a construction param is never scaled), and GEMM keeps its N.
CPU_CAP = 2**14

# TOLERANCE: the library's own bounds (tileops.ops.workloads), which `tileops run` applies too


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def case_id(case: Case) -> str:
    return f"{case.op}-{case.label}-{case.dtype}"


def presence(case: Case) -> dict[str, bool]:
    """Whether each optional input of the case is given."""
    plan = OPS[case.op]._signature
    return {i.name: i.shape is not None for i in case.inputs if i.name in plan.optional_inputs}


def base_cases(cls: type[Op], cap: int = CPU_CAP) -> list[Case]:
    """One case per structure of the op's calls: each combination of given optional inputs
    and Bool or enum construction params (which choose layouts and effect branches) that a
    workload has. Of a structure's cases, the one with no axis of length 1 (so every view and
    every perturbed axis means something), then the smallest, is taken."""
    plan = cls._signature
    discrete = [n for n in plan.param_names if isinstance(plan.kinds[n], BoolK | EnumK)]
    best: dict[tuple, tuple[tuple, Case]] = {}
    for case in cases_of(cls, max_elements=cap):
        key = (tuple(sorted(presence(case).items())),
               tuple((n, case.values.get(n)) for n in discrete))
        dims = [d for i in case.inputs if i.shape is not None for d in i.shape]
        rank = (any(d == 1 for d in dims), sum(i.numel for i in case.inputs))
        if key not in best or rank < best[key][0]:
            best[key] = (rank, case)
    return [case for _, case in best.values()]


# --- the spec's own inference -----------------------------------------------------------------


def _scope(plan: Any, values: Mapping[str, Any], present: Mapping[str, bool]) -> Scope:
    """A scope over ``values`` with the entry's lets evaluated (again: a perturbed index
    changes the lets that read it), in dependency order."""
    sig = plan.sig
    values = {k: v for k, v in values.items() if k not in sig.let}
    pending = list(sig.let)
    while pending:
        left = []
        for n in pending:
            try:
                values[n] = evaluate(sig.let[n].node, Scope(values, sig.types, present))
            except EvalError:
                left.append(n)
        if len(left) == len(pending):  # nothing moved: evaluate one to raise its error
            evaluate(sig.let[left[0]].node, Scope(values, sig.types, present))
        pending = left
    return Scope(values, sig.types, present)


def spec_input_shapes(plan: Any, values: Mapping[str, Any],
                      present: Mapping[str, bool]) -> dict[str, tuple[int, ...] | None]:
    """Each input's shape at ``values`` by the spec (None where an optional input is absent)."""
    scope = _scope(plan, values, present)
    return {n: None if present.get(n, True) is False else eval_shape(d.shape.node, scope)
            for n, d in plan.sig.inputs.items()}


def spec_outputs(plan: Any, values: Mapping[str, Any],
                 present: Mapping[str, bool]) -> list[tuple[tuple[int, ...], str] | None]:
    """Each output's (shape, dtype name) at ``values`` by the spec; None where it is null."""
    scope = _scope(plan, values, present)
    out: list[tuple[tuple[int, ...], str] | None] = []
    for d in plan.sig.outputs.values():
        if evaluate(d.nullable.node, scope):
            out.append(None)
        else:
            out.append((eval_shape(d.shape.node, scope), evaluate(d.dtype.node, scope)))
    return out


def returned_only(op: Op, items: Sequence[Any]) -> list[Any]:
    """Of ``items``, one per declared output, those of the outputs a call of ``op`` returns
    (``returned_outputs``: an output its construction leaves out is not in the result)."""
    plan = type(op)._signature
    assert len(items) == len(plan.output_names)
    return [x for n, x in zip(plan.output_names, items, strict=True) if n in op.returned_outputs]


def admitted_dtypes(plan: Any, name: str, values: Mapping[str, Any],
                    present: Mapping[str, bool]) -> set[str]:
    """Every dtype the spec admits for input ``name``: its dtype expression over every choice
    of the DType indices it reads."""
    node = plan.sig.inputs[name].dtype.node
    indices = [m for m in plan.sig.inputs[name].dtype.names()
               if m in plan.sig.forall and isinstance(plan.kinds[m], DTypeK)]
    out = set()
    for combo in itertools.product(*(plan.kinds[m].members for m in indices)):
        scope = _scope(plan, {**values, **dict(zip(indices, combo, strict=True))}, present)
        out.add(evaluate(node, scope))
    return out


# --- one call's outputs -----------------------------------------------------------------------


def check_outputs(op: Op, given: Sequence[torch.Tensor | None],
                  before: Sequence[torch.Tensor | None], outs: Sequence[Any], refs: Sequence[Any],
                  expected: Sequence[tuple[tuple[int, ...], str] | None]) -> None:
    """The outputs of the call ``op(*given)`` (``before``: copies of ``given`` taken before the
    call) against the spec and the float64 reference ``refs``: one output per declared output,
    null exactly where the spec says, each of the shape and dtype the spec infers
    (``expected``), an output aliasing a written input *is* that input, an input the call does
    not write keeps its values, and every output is within :func:`tolerance` of float64."""
    plan = type(op)._signature
    name = plan.name
    written = set(op.last_call.written_inputs)
    names = op.returned_outputs
    assert len(outs) == len(names), \
        f"{name} returned {len(outs)} outputs, its construction returns {len(names)}"
    decls = {n: d for n, d in plan.sig.outputs.items() if n in names}
    expected = returned_only(op, expected)
    for n, t, t0 in zip(plan.input_names, given, before, strict=True):
        if t is not None and n not in written:
            assert torch.equal(t, t0), f"{name} wrote input {n}, which the call does not write"
    in_dtypes = [t.dtype for t in before if t is not None]
    for (n, decl), out, ref, exp in zip(decls.items(), outs, refs, expected, strict=True):
        if exp is None:
            assert out is None, f"{name}: output {n} should be None"
            continue
        assert (tuple(out.shape), dtype_name(out.dtype)) == exp, \
            f"{name}: output {n} is {dtype_name(out.dtype)}{list(out.shape)}, the spec says {exp}"
        if decl.alias in written:
            assert out is given[plan.input_names.index(decl.alias)], \
                f"{name}: output {n} must be the written input {decl.alias} itself"
        # a bool or integer output (a comparison, a test, integer arithmetic) is exact
        exact = not (out.dtype.is_floating_point or out.dtype.is_complex)
        err, tol = rel_l2(out, ref), 0.0 if exact else tolerance([*in_dtypes, out.dtype])
        assert err <= tol, f"{name}: output {n} is {err:.3g} from float64 (allowed {tol:g})"


# --- compiling -------------------------------------------------------------------------------


class Capture:
    """A capturing backend for ``torch.compile``: keeps each graph and, for ``op``, what it
    had bound and run when the graph arrived (tracing must have done neither)."""

    def __init__(self, op: Op) -> None:
        self.op = op
        self.graphs: list[torch.fx.GraphModule] = []
        self.state: list[tuple[str | None, Any]] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs.append(gm)
        self.state.append((self.op.serving_target, self.op.last_call))
        return gm.forward

    def compiled(self) -> Callable[..., Any]:
        op = self.op
        return torch.compile(lambda *inputs: op(*inputs), backend=self, fullgraph=True)

    def calls(self) -> list[torch.fx.Node]:
        """The calls of the one graph, less the ``getitem`` nodes that unpack a tuple."""
        assert len(self.graphs) == 1, f"{len(self.graphs)} graphs, not one"
        return [n for n in self.graphs[0].graph.nodes
                if n.op == "call_function" and n.target is not operator.getitem]


def node_outputs(node: torch.fx.Node) -> list[tuple[tuple[int, ...], str] | None]:
    """(shape, dtype name) of what a traced node returns: its fake outputs, which the custom
    op's fake implementation made (none where every output aliases an input)."""
    fakes = node.meta.get("example_value")
    fakes = () if fakes is None else fakes if isinstance(fakes, tuple) else (fakes,)
    return [None if f is None else (tuple(f.shape), dtype_name(f.dtype)) for f in fakes]


def returned_by_node(plan: Any, expected: Sequence[Any], written: Iterable[str]) -> list[Any]:
    """Of the spec's ``expected`` outputs, those a traced node returns: the ones that do not
    alias a written input (the graph hands those inputs back)."""
    written = set(written)
    return [e for d, e in zip(plan.sig.outputs.values(), expected, strict=True)
            if d.alias not in written]


# --- known defects ----------------------------------------------------------------------------


def _always(refusal: Any) -> bool:
    return True


@dataclass(frozen=True)
class KnownDefect:
    """A defect the harness finds and the library has not fixed yet: every corpus case of
    ``kind`` that ``applies`` to is marked ``xfail(strict=True)`` with ``reason``."""

    kind: str
    reason: str
    applies: Callable[[Any], bool] = _always


#: THE LIST OF KNOWN DEFECTS. The cases these mark are written as the library must behave;
#: they fail today and are marked xfail(strict=True), so the day a fix lands they XPASS, the
#: suite fails, and the entry is to be removed from this list.
KNOWN_DEFECTS: tuple[KnownDefect, ...] = ()


def defect_marks(refusal: Any) -> list[pytest.MarkDecorator]:
    """The xfail marks of the known defects a corpus case has (none for most)."""
    return [pytest.mark.xfail(strict=True, reason=d.reason)
            for d in KNOWN_DEFECTS if d.kind == refusal.kind and d.applies(refusal)]
