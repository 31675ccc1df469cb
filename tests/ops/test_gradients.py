"""Gradients of every shipped op whose entry declares a ``backward:`` block, by existing.

The ops are the classes :mod:`tileops.ops` exports with a resolved gradient (``_gradient``
set); nothing here names one. Their calls are the entries' workloads, scaled down
(:func:`~tileops.ops.workloads.cases_of` with ``max_elements``) and run in float64 through the
``reference`` target on CPU, under every presence combination of the optional inputs:

- ``gradcheck``: :func:`torch.autograd.gradcheck` through the public op (the autograd node
  eager calls record, its backward the backward op instance the forward holds);
- ``closed form``: each backward op's own reference (its closed-form formula, called as the
  public backward op on the ``reference`` target), fed as the spec's block says, against
  :func:`torch.autograd.grad` of the forward's torch eager equivalent (``op.eager()``), for
  every combination of its ``needs`` flags (a gradient turned off is None);
- ``needs``: a differentiable input that does not require grad gets no gradient, and the
  backward op the forward builds for that call has the input's ``needs`` flag False;
- ``upstream``: gradients flowing in as non-contiguous tensors (expanded, transposed) give the
  same gradients as torch's eager equivalent.

The backward block is read from the spec (``entry.backward``), not from the runtime's resolved
:class:`~tileops.runtime.autograd.Gradient`, so the wiring the runtime derives is checked
against the spec it came from.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

import pytest
import torch

import tileops.ops
from tileops.ops.workloads import Case, InputSpec, as_outputs, cases_of
from tileops.runtime import REFERENCE, Op
from tileops.spec import EvalError, GradOf, Scope, eval_shape, evaluate
from tileops.spec.kinds import BoolK, EnumK

#: every exported op class whose entry declares a backward, in export order
DIFFERENTIABLE: dict[str, type[Op]] = {
    n: c for n in tileops.ops.__all__
    if isinstance(c := getattr(tileops.ops, n), type) and issubclass(c, Op)
    and c._gradient is not None}

#: Elements per tensor: rows (batch axes, then M or K) shrink first, so a row length that is a
#: construction param (normalized_shape) stays whole while several rows remain where they fit
#: (a column sum over one row would hide a wrong reduction axis).
CAP = 2**14
#: Above this many input elements gradcheck runs in fast mode (one random projection of the
#: Jacobian per input rather than every column: the same check of the backward against finite
#: differences, at a few forward calls).
FULL_GRADCHECK = 512
#: Above this many elements in a tensor torch's gradcheck is not used: on a mismatch its fast
#: mode recomputes the whole Jacobian to report it (a 65536-long row is a 65536^2 matrix), so a
#: failing case would never finish. Those cases (row lengths that are construction params,
#: which scaling keeps whole) get the same projection by hand (:func:`_projected_check`).
GRADCHECK_MAX = 2**12
#: gradcheck's bounds, far inside its defaults (rtol 1e-3 lets a gradient 0.1% off pass):
#: central differences in float64 at eps 1e-6 are good to about 1e-9 here
RTOL, ATOL = 1e-6, 1e-8
#: how far from zero every floating input is drawn (see ``_inputs``)
AWAY = 0.25


def _scope(plan: Any, values: Mapping[str, Any], present: Mapping[str, bool]) -> Scope:
    """A scope over ``values`` with the entry's lets evaluated, in dependency order."""
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
        if len(left) == len(pending):
            evaluate(sig.let[left[0]].node, Scope(values, sig.types, present))
        pending = left
    return Scope(values, sig.types, present)


def _shapes(cls: type[Op], case: Case, present: Mapping[str, bool]) -> list[tuple | None]:
    """Each input's shape at the case's index values by the spec (None where absent)."""
    plan = cls._signature
    scope = _scope(plan, case.values, present)
    return [None if not present.get(n, True) else tuple(eval_shape(d.shape.node, scope))
            for n, d in plan.sig.inputs.items()]


def _structures(cls: type[Op]) -> list[Case]:
    """The scaled workloads, one per distinct call (params and shapes): in float64 the dtype
    cases of a row are the same call."""
    seen: dict[tuple, Case] = {}
    for case in cases_of(cls, max_elements=CAP):
        key = (repr(sorted(case.params.items())), tuple((i.name, i.shape) for i in case.inputs))
        seen.setdefault(key, case)
    return list(seen.values())


def _presences(cls: type[Op], case: Case | None = None) -> list[dict[str, bool]]:
    """Every combination of the optional inputs given or not; with a case, those its
    refinements admit (a clamp's number bound and tensor bound exclude each other) and its
    values shape (a case without a bound's own shape index gives no such bound)."""
    plan = cls._signature
    optional = plan.optional_inputs
    combos = [dict(zip(optional, bits, strict=True))
              for bits in itertools.product((True, False), repeat=len(optional))]
    if case is None:
        return combos

    def admitted(p: dict[str, bool]) -> bool:
        try:
            return all(evaluate(r.node, _scope(plan, case.values, p))
                       for r in plan.sig.shape_rules)
        except EvalError:  # an index of a given input the case has no value for
            return False

    return [p for p in combos if admitted(p)]


def _id(present: Mapping[str, bool]) -> str:
    given = [n for n, p in present.items() if p]
    return "+".join(given) if given else "required-only"


CASES = [pytest.param(cls, case, present, id=f"{name}-{case.label}-{_id(present)}")
         for name, cls in DIFFERENTIABLE.items() for case in _structures(cls)
         for present in _presences(cls, case)]


def _base_cases(cls: type[Op]) -> list[Case]:
    """Of the scaled workloads, one per set of Bool or enum construction params (layouts,
    effect branches): the smallest with no axis of length 1 and two axes or more (several
    rows, so a column sum and a non-contiguous gradient mean something), else the smallest."""
    plan = cls._signature
    discrete = [n for n in plan.param_names if isinstance(plan.kinds[n], BoolK | EnumK)]
    best: dict[tuple, tuple[tuple, Case]] = {}
    for case in _structures(cls):
        key = tuple(case.values.get(n) for n in discrete)
        dims = [d for i in case.inputs if i.shape is not None for d in i.shape]
        flat = max(len(i.shape) for i in case.inputs if i.shape is not None) < 2
        rank = (any(d == 1 for d in dims), flat, sum(i.numel for i in case.inputs))
        if key not in best or rank < best[key][0]:
            best[key] = (rank, case)
    return [case for _, case in best.values()]


SMALL = [pytest.param(cls, case, present, id=f"{name}-{case.label}-{_id(present)}")
         for name, cls in DIFFERENTIABLE.items() for case in _base_cases(cls)
         for present in _presences(cls, case)]


def test_the_differentiable_ops_are_found():
    """Every entry with a backward block has an exported class with a resolved gradient (an
    empty list would make every test here vacuous)."""
    assert DIFFERENTIABLE, "no exported op declares a backward"
    for cls in DIFFERENTIABLE.values():
        assert cls._signature.entry.backward is not None
    declared = {n for n in tileops.ops.__all__
                if isinstance(c := getattr(tileops.ops, n), type) and issubclass(c, Op)
                and c._signature is not None and c._signature.entry.backward is not None}
    assert declared == set(DIFFERENTIABLE)


# --- helpers -----------------------------------------------------------------------------------


def _inputs(cls: type[Op], case: Case, present: Mapping[str, bool], seed: int = 0
            ) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    # a bool input (a mask, a condition) is a fair coin; every other input float64, at least
    # AWAY from zero: central differences straddle a kink or a pole there (relu at 0, a
    # quotient's divisor near 0), where they measure nothing the gradient should match
    bools = {i.name for i in case.inputs if i.dtype == "bool"}
    # an input the entry declares integral (class indices, positions) keeps its dtype: the
    # case's generated values where it has them, else small non-negative integers (an input
    # whose dtype is an index, an int case of a binary op, is drawn in float64 as the rest)
    integral = ("uint8", "int8", "int16", "int32", "int64")
    given = {i.name: i for i in case.inputs}
    ints = {n: given.get(n) or InputSpec(n, None, d.dtype.text)
            for n, d in cls._signature.entry.signature.inputs.items()
            if d.dtype.text in integral}
    # an input the entry declares with a named floating dtype and no gradient (a float32
    # bias beside float64 logits) keeps that dtype: the signature admits no other
    entry = cls._signature.entry
    grads = entry.backward.grads if entry.backward else {}
    named = {n: getattr(torch, d.dtype.text) for n, d in entry.signature.inputs.items()
             if d.dtype.text in ("float16", "bfloat16", "float32") and n not in grads}
    out: list[torch.Tensor | None] = []
    for n, s in zip(cls._signature.input_names, _shapes(cls, case, present), strict=True):
        if s is None:
            out.append(None)
        elif n in bools:
            out.append(torch.rand(s, generator=gen) > 0.5)
        elif n in ints:
            spec = ints[n]
            dtype = getattr(torch, cls._signature.entry.signature.inputs[n].dtype.text)
            if spec.values is not None and spec.shape is not None and \
                    tuple(spec.shape) == tuple(s):
                out.append(torch.tensor(spec.values, dtype=dtype).reshape(s))
            else:
                out.append(torch.randint(0, 8, s, generator=gen, dtype=dtype))
        else:
            t = torch.randn(s, generator=gen, dtype=named.get(n, torch.float64))
            out.append(t + AWAY * torch.sign(t))
    return _in_domain(cls, case, out)


def _nan_out(cls: type[Op], case: Case, inputs: list) -> bool:
    """Whether the op's torch eager equivalent gives a NaN at ``inputs``."""
    eager = cls(target=REFERENCE, **case.params).eager()
    with torch.no_grad():
        outs = as_outputs(eager(*[t.clone() if isinstance(t, torch.Tensor) else t
                                  for t in inputs]))
    return any(isinstance(o, torch.Tensor) and o.is_floating_point() and bool(o.isnan().any())
               for o in outs)


def _in_domain(cls: type[Op], case: Case, inputs: list) -> list:
    """``inputs``, or their floating tensors' magnitudes where the function is undefined at
    the draw and defined there: a power's negative base to a fractional exponent is NaN, and so
    are its gradients and finite differences, which then compare nothing. Found by evaluating
    the op's eager equivalent, so no op is named; a NaN the magnitudes keep (a mean over rows
    that are all ignored) is the op's answer and stays."""
    if not _nan_out(cls, case, inputs):
        return inputs
    positive = [t.abs() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                for t in inputs]
    return inputs if _nan_out(cls, case, positive) else positive


def _differentiable(cls: type[Op]) -> list[int]:
    """Indices of the inputs the spec's block gives a gradient (its ``grads`` keys)."""
    plan = cls._signature
    return [plan.input_names.index(n) for n in plan.entry.backward.grads]


def _forward(op: Op, inputs: list, at: list[int]) -> Any:
    """``f(*tensors)``: the op with the tensors at positions ``at`` taken from the arguments
    (cloned: an in-place op writes its inputs, and gradcheck's leaves must stay unwritten)."""
    def f(*tensors):
        args = list(inputs)
        for i, t in zip(at, tensors, strict=True):
            args[i] = t.clone()
        return op(*args)
    return f


def _differentiable_outputs(f: Any) -> Any:
    """``f`` returning only its floating outputs: gradcheck differentiates every output it is
    given, and a None (an output not produced) or integer one (indices) has no gradient."""
    def g(*tensors):
        return tuple(o for o in as_outputs(f(*tensors))
                     if o is not None and o.is_floating_point())
    return g


def _eager_grads(op: Op, inputs: list, at: list[int], douts: list) -> list:
    """torch's gradients of the op's eager equivalent at ``inputs`` w.r.t. the inputs at
    ``at``, for upstream gradients ``douts`` (one per output; None for a None output)."""
    eager = op.eager()
    assert eager is not None, f"{type(op).__name__} declares no eager equivalent"
    leaves = [inputs[i].detach().clone().requires_grad_() for i in at]
    args = list(inputs)
    for i, t in zip(at, leaves, strict=True):
        args[i] = t.clone()  # the eager equivalent of an in-place op writes its arguments
    outs = as_outputs(eager(*args))
    pairs = [(o, g) for o, g in zip(outs, douts, strict=True) if o is not None and g is not None]
    return list(torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs],
                                    allow_unused=True))


def _douts(op: Op, inputs: list, seed: int = 1) -> list:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        outs = as_outputs(op(*[None if t is None else t.clone() for t in inputs]))
    return [None if o is None or not o.is_floating_point()
            else torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=lambda m: f"{what}: {m}")


# --- gradcheck through the public op -----------------------------------------------------------


def _projected_check(f: Any, leaves: tuple, eps: float = 1e-6) -> None:
    """gradcheck's fast mode without its slow-mode report: for random directions ``u`` (on
    the inputs) and ``v`` (on the outputs), ``v . J u`` by central differences equals
    ``(J^T v) . u`` from the backward."""
    gen = torch.Generator().manual_seed(4)
    us = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in leaves]
    outs = [o for o in as_outputs(f(*leaves)) if o is not None]
    vs = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, leaves, vs)
    analytical = sum(float((g * u).sum()) for g, u in zip(grads, us, strict=True))
    with torch.no_grad():
        plus = as_outputs(f(*(t + eps * u for t, u in zip(leaves, us, strict=True))))
        minus = as_outputs(f(*(t - eps * u for t, u in zip(leaves, us, strict=True))))
    # an output that does not move (a constant -inf a mask fills in) has a zero difference
    numerical = sum(float((torch.where(p == m, 0.0, p - m) / (2 * eps) * v).sum()) for p, m, v in
                    zip([p for p in plus if p is not None], [m for m in minus if m is not None],
                        vs, strict=True))
    assert abs(analytical - numerical) <= ATOL + RTOL * abs(numerical), \
        f"v.J.u: backward {analytical!r}, finite differences {numerical!r}"


@pytest.mark.parametrize(("cls", "case", "present"), CASES)
def test_gradcheck_float64(cls, case, present):
    op = cls(target=REFERENCE, **case.params)
    inputs = _inputs(cls, case, present)
    at = [i for i in _differentiable(cls) if inputs[i] is not None]
    leaves = tuple(inputs[i].clone().requires_grad_() for i in at)
    f = _differentiable_outputs(_forward(op, inputs, at))
    if max(t.numel() for t in inputs if t is not None) > GRADCHECK_MAX:
        _projected_check(f, leaves)
    else:
        # full mode runs a backward per output element and a forward per input element:
        # fast mode past the bound on either
        with torch.no_grad():
            outs = f(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        numel = max(sum(t.numel() for t in inputs if t is not None),
                    sum(o.numel() for o in outs if o is not None))
        assert torch.autograd.gradcheck(f, leaves, fast_mode=numel > FULL_GRADCHECK,
                                        rtol=RTOL, atol=ATOL)
    assert op.serving_target == REFERENCE
    assert op._backward_ops, "the gradient did not run through the backward op"


# --- the closed forms against torch's autograd -------------------------------------------------


def _needs_combinations(cls: type[Op]) -> list[dict[str, bool]]:
    needs = cls._signature.entry.backward.needs or {}
    return [dict(zip(needs, bits, strict=True))
            for bits in itertools.product((True, False), repeat=len(needs))]


@pytest.mark.parametrize(("cls", "case", "present"), SMALL)
def test_backward_reference_is_torchs_autograd(cls, case, present):
    """The backward op called on its own, fed by the spec's block (``grad(<output>)`` the
    upstream gradient, a saved name the forward tensor), under each ``needs`` combination:
    each gradient it returns is torch's, and one whose flag is off is None."""
    plan = cls._signature
    block = plan.entry.backward
    fwd = cls(target=REFERENCE, **case.params)
    bwd_cls = type(fwd._backward_op((True,) * len(block.needs or {})))
    assert bwd_cls.__name__ == block.op
    inputs = _inputs(cls, case, present)
    with torch.no_grad():
        # every output, those a call leaves out of its result too (returned: the runtime saves
        # them for the backward all the same), as the runtime's node has them
        outputs = as_outputs(fwd._general_call(
            tuple(None if t is None else t.clone() for t in inputs), {}))
    douts = _douts(fwd, inputs)
    at = [i for i in _differentiable(cls) if inputs[i] is not None]
    want = dict(zip(at, _eager_grads(fwd, inputs, at, douts), strict=True))
    tensors = dict(zip(plan.input_names, inputs, strict=True))
    tensors.update(zip(plan.output_names, outputs, strict=True))
    # an upstream gradient for each output a call returns; one left out gets none
    grads_of = dict(zip(fwd.returned_outputs, douts, strict=True))
    args = [None if (f := block.feeds.get(n)) is None
            else grads_of.get(f.output) if isinstance(f, GradOf) else tensors[f.name]
            for n in bwd_cls._signature.input_names]
    shared = {n: getattr(fwd, n) for n in bwd_cls._signature.param_names
              if n in plan.param_names}
    for needs in _needs_combinations(cls):
        bwd = bwd_cls(target=REFERENCE, **shared, **{block.needs[k]: v for k, v in needs.items()})
        outs = dict(zip(bwd_cls._signature.output_names, as_outputs(bwd(*args)), strict=True))
        for name, out_name in block.grads.items():
            i = plan.input_names.index(name)
            got = outs[out_name]
            what = f"{block.op}({needs}) {out_name}, the gradient of {name}"
            if inputs[i] is None:
                # an absent input has no gradient; the runtime never asks for it (its flag is
                # off), and a backward op that does not read the input (LayerNorm's bias)
                # cannot know it is absent
                continue
            if not needs.get(name, True):
                # a gradient not wanted is not computed, unless another input shares the
                # output and wants it (the fused add's dx)
                if any(needs.get(o, True) for o, v in block.grads.items()
                       if v == out_name and o != name):
                    continue
                assert got is None, f"{what} should be None"
            else:
                assert got is not None, f"{what} is None"
                _close(got, want[i], what)


# --- what requires grad decides what is computed -----------------------------------------------


@pytest.mark.parametrize(("cls", "case", "present"), SMALL)
def test_an_input_not_requiring_grad_gets_none_and_its_flag_is_off(cls, case, present):
    """For each input a ``needs`` flag covers (and is given): the call with every other
    differentiable input requiring grad and that one detached leaves its gradient None, builds
    the backward op with that flag False (and the others True), and the other gradients are
    torch's."""
    plan = cls._signature
    block = plan.entry.backward
    needs = list(block.needs or {})
    inputs = _inputs(cls, case, present)
    for off in needs:
        j = plan.input_names.index(off)
        if inputs[j] is None:
            continue
        op = cls(target=REFERENCE, **case.params)
        at = [i for i in _differentiable(cls) if inputs[i] is not None and i != j]
        leaves = [inputs[i].clone().requires_grad_() for i in at]
        args = list(inputs)
        for i, t in zip(at, leaves, strict=True):
            args[i] = t.clone()
        args[j] = inputs[j].clone()
        outs = as_outputs(op(*args))
        douts = _douts(op, inputs)
        pairs = [(o, g) for o, g in zip(outs, douts, strict=True)
                 if o is not None and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        assert args[j].grad is None and not args[j].requires_grad
        flags = tuple(n != off and inputs[plan.input_names.index(n)] is not None
                      for n in needs)
        assert list(op._backward_ops) == [flags], \
            f"{plan.name} built its backward for needs {list(op._backward_ops)}, not {flags}"
        (bwd,) = op._backward_ops.values()
        assert getattr(bwd, block.needs[off]) is False
        for n, flag in zip(needs, flags, strict=True):
            assert getattr(bwd, block.needs[n]) is flag
        for i, leaf, w in zip(at, leaves, _eager_grads(op, inputs, at, douts), strict=True):
            _close(leaf.grad, w, f"{plan.name} with {off} detached: grad of "
                                 f"{plan.input_names[i]}")


# --- non-contiguous upstream gradients --------------------------------------------------------


def _expanded(shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """A gradient broadcast from one row: stride 0 on every leading axis."""
    row = torch.randn(shape[-1:], generator=gen, dtype=torch.float64)
    return row.expand(shape)


def _transposed(shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """A gradient of ``shape`` laid out with its axes reversed (a transpose's view)."""
    t = torch.randn(shape[::-1], generator=gen, dtype=torch.float64)
    return t.permute(*reversed(range(len(shape))))


def _scalar_expanded(shape: tuple, gen: torch.Generator) -> torch.Tensor:
    """One value broadcast to ``shape`` (what ``out.sum().backward()`` hands a node)."""
    return torch.randn((), generator=gen, dtype=torch.float64).expand(shape)


LAYOUTS = {"expanded-rows": _expanded, "transposed": _transposed,
           "expanded-scalar": _scalar_expanded}
#: whether a layout makes an upstream gradient of this shape non-contiguous: a row expanded
#: over more than one leading element, two axes longer than one to transpose, a value
#: broadcast to more than one element
_LAYOUT_APPLIES = {
    "expanded-rows": lambda s: len(s) >= 2 and math.prod(s[:-1]) > 1 and s[-1] > 0,
    "transposed": lambda s: sum(n > 1 for n in s) >= 2,
    "expanded-scalar": lambda s: math.prod(s) > 1,
}


def _output_shapes(cls: type[Op], case: Case, present: Mapping[str, bool]) -> list[tuple]:
    """The shape of each output the spec gives at the case's values (a loss's 0-dim mean, a
    per-row loss's one axis)."""
    plan = cls._signature
    scope = _scope(plan, case.values, present)
    shapes = []
    for d in plan.sig.outputs.values():
        try:
            shapes.append(tuple(eval_shape(d.shape.node, scope)))
        except EvalError:  # an output the case leaves out (a nullable gradient)
            continue
    return shapes


#: the (op, case, presence, layout) combinations where the layout makes some output's
#: upstream gradient non-contiguous (a 0-dim loss has no strided gradient to hand the node)
LAYOUT_CASES = [pytest.param(*p.values, layout, id=f"{p.id}-{layout}") for p in SMALL
                for layout in LAYOUTS
                if any(_LAYOUT_APPLIES[layout](s) for s in _output_shapes(*p.values))]


@pytest.mark.parametrize(("cls", "case", "present", "layout"), LAYOUT_CASES)
def test_non_contiguous_upstream_gradients(cls, case, present, layout):
    op = cls(target=REFERENCE, **case.params)
    inputs = _inputs(cls, case, present)
    at = [i for i in _differentiable(cls) if inputs[i] is not None]
    gen = torch.Generator().manual_seed(3)
    douts = [None if g is None else LAYOUTS[layout](tuple(g.shape), gen)
             for g in _douts(op, inputs)]
    if all(g is None or g.is_contiguous() for g in douts):
        pytest.fail(f"{layout}: no upstream gradient of {case.label} is non-contiguous; "
                    f"pick a workload with more than one row")
    leaves = [inputs[i].clone().requires_grad_() for i in at]
    outs = as_outputs(_forward(op, inputs, at)(*leaves))
    pairs = [(o, g) for o, g in zip(outs, douts, strict=True) if o is not None and g is not None]
    got = torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs])
    want = _eager_grads(op, inputs, at, douts)
    for i, g, w in zip(at, got, want, strict=True):
        _close(g, w, f"{cls.__name__} ({layout} upstream): grad of "
                     f"{cls._signature.input_names[i]}")


# --- one output of several used ----------------------------------------------------------------


def _floating_outputs(cls: type[Op], case: Case, present: Mapping[str, bool]) -> list[int]:
    """The positions, in the call's result, of the outputs with a gradient (floating)."""
    op = cls(target=REFERENCE, **case.params)
    with torch.no_grad():
        outs = as_outputs(op(*_inputs(cls, case, present)))
    return [j for j, o in enumerate(outs) if o is not None and o.is_floating_point()]


#: (op, case, presence, the output used alone) for every op whose call returns several
#: outputs with a gradient
ALONE_CASES = [pytest.param(*p.values, j, id=f"{p.id}-{p.values[0]._signature.output_names[j]}")
               for p in SMALL if len(outs := _floating_outputs(*p.values)) > 1 for j in outs]


@pytest.mark.parametrize(("cls", "case", "present", "used"), ALONE_CASES)
def test_one_output_used_alone_gives_torchs_gradients(cls, case, present, used):
    """Only one output's result reaches the loss: each input's gradient is torch's autograd of
    the eager equivalent, None where torch gives None (an input no used output depends on),
    and no NaN where torch's is finite."""
    op = cls(target=REFERENCE, **case.params)
    inputs = _inputs(cls, case, present)
    at = [i for i in _differentiable(cls) if inputs[i] is not None]
    douts = [g if j == used else None for j, g in enumerate(_douts(op, inputs))]
    leaves = [inputs[i].clone().requires_grad_() for i in at]
    outs = as_outputs(_forward(op, inputs, at)(*leaves))
    got = torch.autograd.grad(outs[used], leaves, douts[used], allow_unused=True)
    want = _eager_grads(op, inputs, at, douts)
    for i, g, w in zip(at, got, want, strict=True):
        what = f"{cls.__name__}, {op.returned_outputs[used]} alone: grad of " \
               f"{cls._signature.input_names[i]}"
        assert (g is None) == (w is None), f"{what} is {g}, torch's {w}"
        if w is not None:
            _close(g, w, what)
