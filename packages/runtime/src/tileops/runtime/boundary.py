"""The torch.compile boundary, generated from an op's signature.

Every op with a spec entry, call-time tensor inputs and no composition becomes one node in a
torch.compile graph: one ``torch.library.custom_op`` per effect branch, named
``tileops::<family>_<op>`` (plus the branch), whose

- schema comes from the signature (``Tensor`` / ``Tensor?`` for optional inputs, ``(a!)`` for
  inputs the branch may write, the returned outputs), with a trailing ``str key``;
- fake implementation is the signature's output inference (the generated symbolic check,
  whose size comparisons go through ``torch._check``), so it runs on fake tensors and symbolic
  shapes without building anything;
- real implementation finds the op instance through a weak registry by the string key and runs
  the ordinary eager call (checks, target, kernel entry, launch) untraced.

While dynamo traces, ``Op.__call__`` only emits the custom op: no kernel is built and no
TileLang builder is entered. The key is a string because dynamo bakes string arguments into
the graph as constants (an int key would be generalised to a SymInt once a second instance
compiles through the same frame). A garbage-collected instance frees its registry entry; a
graph that baked its key is guarded by dynamo's ID_MATCH on the instance, so a new instance
never resolves to a stale graph.

Eager calls do not go through ``torch.library``. Measured on the H200 host (2026-11-29,
torch 2.11, 1 x 4096 bf16 RMSNorm, host microseconds per cached call, best of 5 x 200;
``benchmarks/norm.py --host-only``): the eager op 23.4 us; the same op called through its
custom op (``torch.ops.tileops.norm_rms_norm_fwd``) 38.6 us; the TileLang kernel launched
directly 11.0 us (12.6 us with its output allocation); ``F.rms_norm`` 14.8 us. The
``torch.library`` dispatch alone costs about 15 us a call, more than the whole op layer, so
only tracing goes through it; a compiled graph pays it per call too, a CUDA graph does not.
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Any

from tileops.spec import Scope, evaluate
from tileops.spec import expr as E

from .registry import instance_for_key

if TYPE_CHECKING:  # pragma: no cover
    from .op import Op

__all__ = ["CompileBoundary", "boundary_for"]

_lock = threading.Lock()
_boundaries: dict[tuple[type, tuple], CompileBoundary] = {}
_owners: dict[str, type] = {}


def _snake(name: str) -> str:
    s = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()
    return s[:-3] if s.endswith("_op") else s


class CompileBoundary:
    """The custom op of one (op class, effect branch)."""

    def __init__(self, op_cls: type[Op], written: tuple[str, ...]) -> None:
        import torch

        plan = op_cls._signature
        assert plan is not None
        self.plan = plan
        self.written = written
        entry = plan.entry
        base = f"{entry.family}_{_snake(plan.name)}"
        name = base + ("__writes_" + "_".join(written) if written else "")
        # Two classes may share an entry name (tests, user subclasses): the first keeps the
        # plain name, later ones a numbered one, so no registration is ever overwritten.
        owner = _owners.setdefault(name, op_cls)
        if owner is not op_cls:
            i = 2
            while _owners.setdefault(f"{name}_{i}", op_cls) is not op_cls:
                i += 1
            name = f"{name}_{i}"
        self.name = name
        self.qualname = f"tileops::{self.name}"
        sig = plan.sig
        aliased = {n for n, d in sig.outputs.items() if d.alias in written}
        self.returned = tuple(n for n, d in sig.outputs.items() if n not in aliased)
        self.return_index = tuple(plan.output_names.index(n) for n in self.returned)
        self.nullable = {n for n, d in sig.outputs.items() if d.nullable.node != E.Bool(False)}
        args = []
        for n in sig.inputs:
            t = "Tensor?" if n in plan.optional_inputs else "Tensor"
            args.append(f"{t}(a{len(args)}!) {n}" if n in written else f"{t} {n}")
        args.append("str key")
        if len(self.returned) == 1:
            rets = "Tensor" + ("?" if self.returned[0] in self.nullable else "")
        else:
            rets = "(" + ", ".join("Tensor" + ("?" if n in self.nullable else "")
                                   for n in self.returned) + ")"
        self.schema = f"({', '.join(args)}) -> {rets}"
        n_inputs = len(plan.input_names)
        return_index = self.return_index
        single = len(self.returned) == 1

        def real(*args: Any) -> Any:
            op = instance_for_key(args[-1])
            outs = op._run_call(tuple(args[:n_inputs]), {})
            outs = outs if isinstance(outs, tuple) else (outs,)
            picked = tuple(outs[i] for i in return_index)
            if not picked:
                return None
            return picked[0] if single else picked

        def fake(*args: Any) -> Any:
            op = instance_for_key(args[-1])
            if op._gradient is not None:  # before a cached backward may name them
                from .trained import register_backward

                register_backward(op)
            inputs = args[:n_inputs]
            missing = n_inputs - len(inputs)
            call = op._point.check_symbolic(*inputs, *([None] * missing))
            fmt = op.output_memory_format
            fresh = {} if fmt is None else {"memory_format": fmt(inputs)}
            outs = []
            for i in return_index:
                shape = call.output_shapes[i]
                dtype = call.output_dtypes[i]
                if shape is None:
                    outs.append(None)
                elif op.output_layout is not None:  # as the eager call lays it out (op.py)
                    outs.append(op._laid_out(inputs, shape, dtype, call.device))
                else:
                    # an output like an input is allocated as a contiguous one (op.py)
                    kw = {} if plan.output_names[i] in op._point.output_like else fresh
                    outs.append(torch.empty(shape, dtype=dtype, device=call.device, **kw))
            if not outs:
                return None
            return outs[0] if single else tuple(outs)

        lib_op = torch.library.custom_op(self.qualname, real, mutates_args=written,
                                         schema=self.schema)
        lib_op.register_fake(fake)
        self.custom_op = lib_op
        self.overload = getattr(torch.ops.tileops, self.name).default
        if op_cls._gradient is not None and not written:
            from .autograd import register

            register(self, op_cls)  # the entry's gradient, for compiled training steps

    def call(self, op: Op, inputs: tuple) -> Any:
        """What a traced ``op(*inputs)`` becomes: one node, then the aliased inputs."""
        n = len(self.plan.input_names)
        args = tuple(inputs) + (None,) * (n - len(inputs))
        result = self.overload(*args, op._instance_key)
        if not self.written:
            return result
        produced = result if isinstance(result, tuple) else (result,) if result is not None else ()
        by_name = dict(zip(self.returned, produced, strict=True))
        outs = []
        for name, d in self.plan.sig.outputs.items():
            if name in by_name:
                outs.append(by_name[name])
            else:  # an alias of a written input
                outs.append(args[self.plan.input_names.index(d.alias)])
        return outs[0] if len(outs) == 1 else tuple(outs)


def possible_writes(op: Op) -> tuple[str, ...]:
    """The inputs this instance may write, whatever optional inputs a call gives."""
    plan = op._signature
    assert plan is not None
    return _writes(plan, op._point.constants)


def _branch_sets(op: Op) -> list[tuple[str, ...]]:
    """Every written-input set the class can have: the instance's own, plus those reached by
    flipping the Bool and enum params its ``mutated`` predicates read."""
    from tileops.spec.kinds import BoolK, EnumK

    plan = op._signature
    assert plan is not None
    names = {m for d in plan.sig.inputs.values() for m in E.names(d.mutated.node)}
    domains = []
    for n in sorted(names):
        k = plan.kinds.get(n)
        if isinstance(k, BoolK):
            domains.append((n, (False, True)))
        elif isinstance(k, EnumK):
            domains.append((n, k.values))
    out = [possible_writes(op)]
    import itertools

    for combo in itertools.product(*(d for _, d in domains)):
        params = {**op._point.constants, **dict(zip((n for n, _ in domains), combo,
                                                    strict=True))}
        w = _writes(plan, params)
        if w not in out:
            out.append(w)
    return out


def _writes(plan, params) -> tuple[str, ...]:
    written = []
    for n, d in plan.sig.inputs.items():
        if d.mutated.node == E.Bool(False):
            continue
        for present in (True, False):
            tensors = {m: present for m in plan.optional_inputs}
            try:
                if evaluate(d.mutated.node, Scope(params, plan.sig.types, tensors)):
                    written.append(n)
                    break
            except Exception:  # noqa: BLE001 - a param the predicate needs is not enumerable
                written.append(n)
                break
    return tuple(written)


def boundary_for(op: Op) -> CompileBoundary:
    """The custom op for ``op``'s effect branch. The first instance of a class registers the
    custom ops of every branch the class can take and publishes their names on the class as
    ``compile_op_names``."""
    cls = type(op)
    key = (cls, possible_writes(op))
    b = _boundaries.get(key)
    if b is None:
        with _lock:
            if _boundaries.get(key) is None:
                for written in _branch_sets(op):
                    k = (cls, written)
                    if k not in _boundaries:
                        _boundaries[k] = CompileBoundary(cls, written)
                        cls.compile_op_names = (*cls.compile_op_names,
                                                _boundaries[k].qualname)
            b = _boundaries[key]
    return b
