"""The fused call: generated code for an op's cached calls.

Two pieces, both generated from the plan's parsed names (``t_<input>``, the record's
``s_<input>`` / ``d_<input>`` fields), never by splicing spec text:

- ``class_call(plan)``: each op class with an entry and tensor inputs gets a ``__call__``
  whose inputs are positional-only parameters. It tests for tracing first (so dynamo guards
  on nothing of the instance), then hands a plain call straight to the instance's fused call
  (``op._fast``); keywords, ``out=``, a wrong number of inputs, or no fused call yet go to
  ``Op._general_call`` with the inputs exactly as given.
- ``build_fast_call(op, call)``: after a call succeeds through ``Op._run_call``, an instance
  whose calls are plain (no delegates, no parent, no construction-time tensors, outputs
  allocated by the base class) gets its fused call, compiled once (``op._fast_source`` holds
  the source). Per presence combination of the optional inputs it runs the steps of
  ``_run_call`` in the same order, with every decision that call took folded in:

  1. the signature's hot-path check body, inlined (``point.fast_bodies``); any miss goes to
     ``_run_call``, whose check raises the precise error, before anything is written;
  2. the binding it was built for is still the instance's (``_target_builder``), else
     ``_run_call``;
  3. the forward-only refusal when an input requires grad and grad mode is on;
  4. for a target, the kernel: the last one this body ran when device, dtypes and shapes
     match it, else ``_target_kernels`` under the key ``_run_call`` uses; a miss goes to
     ``_run_call``, which builds it;
  5. the outputs: ``empty_like`` of the input the output always matches when that input is
     contiguous, else the branch's cached allocator (the branch of each body is known when
     generating; a body whose branch no call has taken yet goes to ``_run_call`` and drops
     the fused call, which the next success rebuilds);
  6. the kernel (target) or ``forward`` (in-tree; its ``self.kernel`` lookup as usual);
  7. ``last_call``.

The fused call never binds, builds or selects, so it takes no lock and needs no CUDA graph
capture guard (those live on the paths it hands over). A kernel or ``forward`` that raises
leaves ``last_call`` as it was and, since the call did not bind the target, resets nothing,
as in ``_run_call``. ``_reset_binding`` drops the fused call; the next call that succeeds
through ``_run_call`` builds it again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.compiler import is_dynamo_compiling as _is_dynamo_compiling

from .registry import UNRESOLVED, empty_from_record

if TYPE_CHECKING:  # pragma: no cover
    from tileops.signature import SignatureCall

    from .op import Op

__all__ = ["NOT_GIVEN", "build_fast_call", "class_call"]


def build_fast_call(op: Op, call: SignatureCall) -> tuple[Any, str] | None:
    """``(function, source)`` of ``op``'s fused call after ``call`` succeeded, or None when
    the instance's calls need the general path."""
    cls = type(op)
    plan = cls._signature
    if (plan is None or op._parent is not None or op._composite or cls.construction_tensors
            or not cls.allocate_outputs or "forward" in vars(op)):
        return None
    builder = op._target_builder
    if builder is UNRESOLVED:
        return None
    names = plan.input_names
    if not names:
        return None
    point = op._point
    optional = set(plan.optional_inputs)
    ns: dict[str, Any] = dict(point.namespace)
    ns.update({"_rt_B": builder, "_rt_grad": _grad_enabled, "_rt_NO": NOT_GIVEN,
               "_rt_empty_like": torch.empty_like, "_rt_empty_from_record": empty_from_record,
               "_rt_forward": cls.forward})
    args = ", ".join(f"t_{n}" for n in names)
    packed = f"({args},)"
    general = f"return op._run_call({packed}, {{}})"
    L = [f"def fast(op, {args}):"]
    for n in names:  # an input the caller left out (only optional ones reach here)
        if n in optional:
            L.append(f"    if t_{n} is _rt_NO: t_{n} = None")
    for n in plan.buffer_outputs:  # out= goes to the general path: never given here
        L.append(f"    t_{n} = None")
    _bodies(L, list(plan.optional_inputs), {}, 1, point, op, names, builder, ns, general,
            packed)
    source = "\n".join(L) + "\n"
    code = compile(source, f"<tileops.runtime fused call {cls.__name__}>", "exec")
    exec(code, ns)  # noqa: S102 - generated from the plan's names, no spec text
    return ns["fast"], source


def _bodies(L: list[str], remaining: list[str], presence: dict[str, bool], depth: int,
            point: Any, op: Op, names: tuple[str, ...], builder: Any, ns: dict,
            general: str, packed: str) -> None:
    """The presence tree of the fused call: one body per combination of optional inputs,
    as in the check (``point.fast_bodies``)."""
    ind = "    " * depth
    if remaining:
        n, rest = remaining[0], remaining[1:]
        L.append(f"{ind}if t_{n} is None:")
        _bodies(L, rest, {**presence, n: False}, depth + 1, point, op, names, builder, ns,
                general, packed)
        L.append(f"{ind}else:")
        _bodies(L, rest, {**presence, n: True}, depth + 1, point, op, names, builder, ns,
                general, packed)
        return
    body = next(b for b in point.fast_bodies if b.presence == presence)
    allocate = op._effect_branches.get(body.branch)
    if allocate is None:  # a branch no call has taken yet: the general path, then rebuild
        L.append(f"{ind}op._fast = None")
        L.append(f"{ind}{general}")
        return
    # 1. the check (a miss: the general path, whose check raises the precise error)
    L.append(f"{ind}try:")
    L += [f"{ind}    {line}" for line in body.lines]
    L.append(f"{ind}    call = {body.record}")
    L.append(f"{ind}except Exception:")
    L.append(f"{ind}    {general}")
    # 4. still bound as when this was built (a reset or another binding: the general path)
    L.append(f"{ind}if op._target_builder is not _rt_B: {general}")
    given = [n for n in names if presence.get(n, True)]
    grads = " or ".join(f"t_{n}.requires_grad" for n in given)
    # (requires_grad first: it is False on the common path, which then skips the mode read)
    L.append(f"{ind}if ({grads}) and _rt_grad(): op._forward_only({packed})")
    if builder is not None:
        # 5. a target kernel: the last one this body ran, if the call has its device, dtypes
        # and shapes; else the key _run_call uses, in _target_kernels (a miss: the general
        # path builds it). The memo is this function's own: a reset drops the function.
        memo = f"_rt_memo{len(ns)}"
        ns[memo] = [(None,) * (2 * len(given) + 2)]
        dt = _tuple([f"d_{n}" if presence.get(n, True) else "None" for n in names])
        sh = _tuple([f"s_{n}" if presence.get(n, True) else "None" for n in names])
        same = " and ".join([f"d_{n} is m[{2 * i}] and s_{n} == m[{2 * i + 1}]"
                             for i, n in enumerate(given)] + [f"dev == m[{2 * len(given)}]"])
        L.append(f"{ind}dev = call.device")
        L.append(f"{ind}m = {memo}[0]")
        L.append(f"{ind}if {same}:")
        L.append(f"{ind}    kernel = m[-1]")
        L.append(f"{ind}else:")
        L.append(f"{ind}    kernel = op._target_kernels.get((dev, {dt}, {sh}))")
        L.append(f"{ind}    if kernel is None: {general}")
        reads = ", ".join(f"d_{n}, s_{n}" for n in given)
        L.append(f"{ind}    {memo}[0] = ({reads}, dev, kernel)")
    # 2. the outputs
    if allocate.__class__ is int:  # one output, like the input at that index
        src = f"t_{names[allocate]}"
        L.append(f"{ind}y = _rt_empty_like({src}) if {src}.is_contiguous() else "
                 f"_rt_empty_from_record(call)")
        outs, result = "y", "y"
    else:
        name = f"_rt_alloc{len(ns)}"
        ns[name] = allocate
        L.append(f"{ind}outputs = {name}(call, {packed}, None)")
        outs, result = "*outputs", "outputs[0] if len(outputs) == 1 else outputs"
    # 6. run; 7. publish
    args = ", ".join(f"t_{n}" for n in names)
    if builder is not None:
        L.append(f"{ind}kernel({args}, {outs})")
    else:
        L.append(f"{ind}_rt_forward(op, call, {args}, {outs})")
    L.append(f"{ind}op._last_call = call")
    L.append(f"{ind}return {result}")


def class_call(plan: Any) -> tuple[Any, str]:
    """``(__call__, source)`` for an op class: its inputs as positional-only parameters, so a
    plain call reaches the instance's fused call with no packing; anything else (keywords,
    ``out=``, too many or too few inputs, tracing, no fused call yet) goes to
    ``Op._general_call`` with the inputs exactly as given."""
    names = plan.input_names
    optional = set(plan.optional_inputs)
    params = ", ".join(f"t_{n}=_NO" for n in names)
    required = [f"t_{n} is _NO" for n in names if n not in optional]
    args = ", ".join(f"t_{n}" for n in names)
    given = " + ".join(f"(() if t_{n} is _NO else (t_{n},))" for n in names)
    # tracing is tested first: dynamo then reads (and guards on) nothing of the instance
    L = [f"def __call__(self, {params}, /, *_rest, **_kw):",
         "    if _idc():",
         f"        return self._general_call({given} + _rest, _kw)",
         "    fast = self._fast",
         f"    if fast is None or _kw or _rest{''.join(' or ' + r for r in required)}:",
         f"        return self._general_call({given} + _rest, _kw)",
         f"    return fast(self, {args})"]
    source = "\n".join(L) + "\n"
    ns: dict[str, Any] = {"_NO": NOT_GIVEN, "_idc": _is_dynamo_compiling}
    exec(compile(source, f"<tileops.runtime {plan.name}.__call__>", "exec"), ns)  # noqa: S102
    return ns["__call__"], source


class _NotGiven:
    def __repr__(self) -> str:
        return "<not given>"


#: the default of a generated ``__call__``'s input parameters: "the caller passed nothing"
NOT_GIVEN: Any = _NotGiven()


def _tuple(items: list[str]) -> str:
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


_grad_enabled = torch._C.is_grad_enabled
