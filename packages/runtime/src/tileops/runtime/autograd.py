"""Gradients: an entry's ``backward`` block wired into autograd, eager and compiled.

A forward entry declares its gradient (the spec's ``backward`` block): the backward op (an
ordinary entry of the same file with its own checks and kernels), the forward tensors it
saves, what feeds each backward input (``grad(<output>)`` or a saved tensor), which backward
output is the gradient of each differentiable input, and (``needs``) the backward's Bool
params that say whether a gradient is wanted. A saved tensor that feeds only inputs the
backward entry declares ``shape_only`` is kept as a one-element stand-in of its shape
(:func:`stand_in`), not its memory. :class:`Gradient` is that block resolved
against the two classes' plans, once per forward class (the backward class on first use,
since it may be defined after the forward one).

Eager calls record a node only when grad mode is on and a differentiable input requires grad
(``Op._run_call`` tests that after the check); the node is one :class:`torch.autograd.Function`
whose forward is the ordinary call (grad is off inside it, so it is the cached call) and whose
backward calls the backward op instance the forward op holds for that ``needs`` combination.
No ``torch.library`` dispatch is involved: the Function's own cost is the only one added, and a
call with grad off is the same code as before. A composite op whose entry declares a backward
is one node too: its delegate calls run inside the node's forward with grad off, so a chunked
composite (the fused linear cross-entropy) keeps no chunk's intermediates alive for autograd;
its backward op recomputes what it needs. A composite op without a backward records no node of
its own, and each delegate call records its own.

Under ``torch.compile`` the compile boundary registers :func:`register` on its custom op: the
same saves and the same backward op, emitted as the backward op's own custom op, so AOTAutograd
traces forward and backward with no graph break and builds no kernel while tracing. Custom ops
that write their inputs cannot carry an autograd formula in ``torch.library``; a traced call of
an in-place branch with grad needed is refused by the op (``Op._traced_call``).

A forward may compute its inputs' gradients itself (Liger-Kernel's fused linear cross-entropy
does, while each block's logits are in hand): when the call's only output is 0-dim, the
gradient of an input is the upstream gradient times a tensor the forward can produce, so inside
its own node's forward an op may ask :meth:`Op.gradient_wanted` and hand tensors over with
:meth:`Op.keep_gradient`. The node holds them (not ``save_for_backward``: they are the op's own,
written by nothing else) and its backward scales them in place by the upstream gradient, the
backward op unused (:meth:`Op.scale_kept` scales them: a torch multiply unless the op
supplies its own); where the forward kept fewer than the caller needs, or a retained graph is
run backward a second time, the backward op runs as usual. Compiled calls never keep (the
custom op's forward runs outside any node): their backward is the backward op.

An output whose result is unused gets no upstream gradient (autograd hands the node None):
where the backward op declares the input it feeds ``optional``, it is handed over absent and
the op skips that term (torch's formulas skip an undefined gradient: no ``0 * inf`` from a
term whose every product is zero), elsewhere it is zeros. A differentiable input the block
says ``reaches`` only such outputs gets no gradient (None, as torch's autograd gives it), and
the backward op is built with its ``needs`` flag off.

The backward is once-differentiable: differentiating a gradient again (``create_graph=True``,
then a backward through the gradient) raises torch's error, naming the op, even where the
incoming gradient is a constant (a loss's), where torch's own decorator lets it pass silently.
"""

from __future__ import annotations

import functools
import threading
from typing import TYPE_CHECKING, Any

import torch
from torch._C import _functions

from tileops.spec import GradOf

from . import memory

if TYPE_CHECKING:  # pragma: no cover
    from tileops.signature import SignatureCall

    from .op import Op

__all__ = ["Gradient", "backward_class", "gradient_wanted", "keep_gradient", "register",
           "register_class", "saved_by_node"]

#: (id of the spec file, entry name) -> (spec file, op class): the backward op is an entry of
#: the forward's file, found here among the classes defined for that file (the last wins)
_classes: dict[tuple[int, str], tuple[Any, type]] = {}
_lock = threading.Lock()


def register_class(cls: type[Op], spec: Any, name: str) -> None:
    """Record an op class with entry ``name`` of spec file ``spec``, for the forward ops whose
    backward it computes."""
    with _lock:
        _classes[(id(spec), name)] = (spec, cls)


def backward_class(fwd: type[Op], name: str) -> type[Op]:
    plan = fwd._signature
    assert plan is not None
    found = _classes.get((id(plan.spec), name))
    if found is None:
        raise LookupError(f"{fwd.__name__}: its backward op {name!r} has no class; define the "
                          f"Op subclass named after that entry before running a backward")
    return found[1]


class Gradient:
    """One forward class's ``backward`` block, resolved (see the module docstring)."""

    def __init__(self, fwd: type[Op], block: Any) -> None:
        plan = fwd._signature
        assert plan is not None
        self.fwd = fwd
        self.op_name: str = block.op
        ins, outs = plan.input_names, plan.output_names
        #: where each saved tensor comes from: (0, input index) or (1, output index)
        self.saved_from = tuple((0, ins.index(n)) if n in ins else (1, outs.index(n))
                                for n in block.saves)
        self.saves = tuple(block.saves)
        self._feeds_by_name = {k: ("grad", f.output) if isinstance(f, GradOf) else
                               ("saved", f.name) for k, f in block.feeds.items()}
        #: the saved tensors (by position in ``saves``) that only feed ``shape_only`` inputs of
        #: the backward op: a stand-in of their shape is kept, not their memory
        self.stand_ins = _stand_ins(plan.spec, block, self._feeds_by_name)
        self._grads_by_input = dict(block.grads)
        #: the inputs whose gradient the backward computes (by index)
        self.differentiable = frozenset(ins.index(n) for n in block.grads)
        #: (input index, Bool param of the backward op): is that gradient wanted
        self.needs = tuple((ins.index(n), p) for n, p in (block.needs or {}).items())
        #: (input index, output indices): the outputs an input reaches (``reaches``); where
        #: none of their results is used, the input gets no gradient
        self.reaches = tuple((ins.index(n), tuple(outs.index(o) for o in reached))
                             for n, reached in (block.reaches or {}).items())
        self._resolved: tuple | None = None
        #: the eager node's class, named after the op (``grad_fn`` prints
        #: ``<RMSNormFwdOpBackward ...>``)
        self.node = type(fwd.__name__, (Node,), {"__module__": fwd.__module__,
                                                 "__qualname__": fwd.__qualname__})
        #: the node's apply without ``Function.apply``'s Python wrapper (2-3 us a call): what
        #: the wrapper adds is for functorch transforms (unwrapping their dead wrappers,
        #: routing to ``custom_function_call``), which ``Op._graph_call`` refuses by name
        self.apply = _C_APPLY.__get__(None, self.node)
        #: the inputs not differentiable (by index), which must not require grad
        self.fixed_inputs = tuple(i for i in range(len(ins)) if i not in self.differentiable)
        #: one output, written to no input: a call of it whose output is 0-dim may keep
        #: gradients
        self.scalar_output = len(outs) == 1 and not any(
            d.alias for d in plan.sig.outputs.values())

    def resolved(self) -> tuple:
        """``(backward class, feeds, grads)``: per backward input ``("grad", output index)``,
        ``("saved", k)`` or None (an optional input nothing feeds); per forward input the
        backward output index of its gradient, or None."""
        r = self._resolved
        if r is None:
            bwd = backward_class(self.fwd, self.op_name)
            fplan, bplan = self.fwd._signature, bwd._signature
            assert fplan is not None and bplan is not None
            feeds = []
            for n in bplan.input_names:
                src = self._feeds_by_name.get(n)
                if src is None:
                    feeds.append(None)
                elif src[0] == "grad":
                    feeds.append(("grad", fplan.output_names.index(src[1])))
                else:
                    feeds.append(("saved", self.saves.index(src[1])))
            grads = tuple(bplan.output_names.index(self._grads_by_input[n])
                          if n in self._grads_by_input else None for n in fplan.input_names)
            # the upstream gradients an output's unused result leaves out (None) that go to
            # an input the backward op declares optional: handed over as absent, so the op
            # skips that term (var_mean's mean alone: no 0 * inf from the var term), as
            # torch's formulas skip an undefined gradient; any other is zeros
            self._absent_ok = frozenset(
                k for k, (n, f) in enumerate(zip(bplan.input_names, feeds, strict=True))
                if f is not None and f[0] == "grad" and bplan.sig.inputs[n].optional.text == "True")
            r = self._resolved = (bwd, tuple(feeds), grads)
        return r

    @staticmethod
    def output_metas(outputs: tuple) -> tuple | None:
        """What a gradient of zeros of each output needs (shape, dtype, device), for a node
        of several outputs, whose unused ones autograd hands over as None (a node of one
        output gets its gradient, or none at all: then it gives none)."""
        if len(outputs) < 2:
            return None
        return tuple(None if o is None else (o.shape, o.dtype, o.device) for o in outputs)

    def saved(self, inputs: tuple, outputs: tuple) -> list:
        """The tensors to save, from a call's inputs and outputs (a stand-in where the
        backward reads only the shape)."""
        stand = self.stand_ins
        return [stand_in(t) if k in stand else t for k, t in enumerate(
            (inputs if src == 0 else outputs)[i] for src, i in self.saved_from)]

    def run(self, op: Op, saved: tuple, grads: tuple, needs: tuple, traced: bool,
            metas: tuple | None = None, written_over: list | None = None) -> tuple:
        """The gradient of each forward input (None where not wanted, not differentiable, or
        reaching only unused outputs), from the backward op; ``traced``: emit its custom op (a
        compiled backward). ``grads`` holds None for an output whose result was not used
        (``metas``: those outputs' shapes, dtypes and devices, from :meth:`output_metas`).
        ``written_over`` gets the names of the saved tensors the backward op wrote in place
        (a second backward cannot read them)."""
        _, feeds, by_input = self.resolved()
        if self.reaches:
            # an input that reaches only outputs whose results are unused has no gradient
            # (None, as torch's autograd gives it), and its needs flag is off
            cut = [i for i, reached in self.reaches
                   if needs[i] and all(grads[o] is None for o in reached)]
            if cut:
                needs = tuple(bool(n) and i not in cut for i, n in enumerate(needs))
                if not any(needs):
                    return (None,) * len(by_input)
        bwd = op._backward_op(tuple(bool(needs[i]) for i, _ in self.needs))
        args = tuple(None if f is None else grads[f[1]] if f[0] == "grad" else saved[f[1]]
                     for f in feeds)
        if metas is not None and any(a is None and f is not None and f[0] == "grad"
                                     for a, f in zip(args, feeds, strict=True)):
            args = tuple(_zeros(metas[f[1]]) if a is None and f is not None and f[0] == "grad"
                         and k not in self._absent_ok else a
                         for k, (a, f) in enumerate(zip(args, feeds, strict=True)))
        over: tuple = ()
        if bwd._boundary.written and not traced:
            args, over = _spare_saved(bwd, args, feeds)
        # traced: the boundary's call gives every output in the entry's order, an output
        # aliasing a written input (a gradient written over a saved tensor) as that input
        # (a backward op leaving an output out of its result runs the general call, which
        # gives them all)
        outs = (bwd._boundary.call(bwd, args) if traced else
                bwd(*args) if not bwd._point.plan.may_leave_out else  # the fused call
                bwd._general_call(args, {}))
        if not isinstance(outs, tuple):
            outs = (outs,)
        for name, t in over:
            # a kernel's write is not seen by torch's version counter: counted here, so a
            # node that saved the tensor unseen (one that read it after it was made) raises
            # torch's error at its backward rather than reading the gradient as its input
            torch.autograd.graph.increment_version(t)
            if written_over is not None:
                written_over.append(name)
        return tuple(outs[k] if k is not None and needs[i] else None
                     for i, k in enumerate(by_input))

    def written_option(self, name: str) -> str:
        """The predicate under which the backward op writes over the saved forward input
        ``name`` (``inplace_grad``), for messages; empty where it writes none."""
        bwd = self.resolved()[0]
        decls = bwd._signature.sig.inputs  # type: ignore[union-attr]
        for n, feed in self._feeds_by_name.items():
            if feed == ("saved", name) and n in decls:
                text = decls[n].mutated.text.strip()
                if text not in ("", "False"):
                    return text
        return ""


def _zeros(meta: tuple | None) -> Any:
    if meta is None:  # an output the call left out: nothing to stand for
        return None
    shape, dtype, device = meta
    return torch.zeros(shape, dtype=dtype, device=device)


def _stand_ins(spec: Any, block: Any, feeds: dict) -> frozenset[int]:
    """The positions in ``block.saves`` of the saved names that feed only inputs the backward
    entry declares ``shape_only`` (read off the spec file, which holds both entries)."""
    entry = getattr(spec, "entries", {}).get(block.op)
    if entry is None:
        return frozenset()
    decls = entry.signature.inputs
    out = set()
    for k, name in enumerate(block.saves):
        fed = [n for n, (kind, src) in feeds.items() if kind == "saved" and src == name]
        if fed and all(n in decls and decls[n].shape_only for n in fed):
            out.add(k)
    return frozenset(out)


def stand_in(t: Any) -> Any:
    """A tensor of ``t``'s shape, dtype and device holding one element (every stride 0): what
    a backward that reads only the shape keeps of ``t``, as torch keeps a sum's input sizes."""
    if not isinstance(t, torch.Tensor):
        return t
    return t.new_empty(()).expand(t.shape)


def _spare_saved(bwd: Op, args: tuple, feeds: tuple) -> tuple[tuple, tuple]:
    """``args`` with a copy of each saved tensor that ``bwd`` writes in place (an input its
    params declare ``mutated``, as ``inplace_grad`` writes the gradient over the saved logits)
    where writing over it would change what someone else reads: a leaf (a parameter, an input
    the caller made and still holds, whose values would silently become the gradient) or a
    tensor another node saved for its own backward (:func:`saved_by_node`: an exp's or a
    sigmoid's output, which that node's backward reads after this one); and the ``(name,
    tensor)`` of those written as they are. Upstream gradients are autograd's to hand over and
    are written as they are."""
    names = bwd._signature.input_names  # type: ignore[union-attr]
    written = bwd._boundary.written
    out, over = [], []
    for j, (a, f) in enumerate(zip(args, feeds, strict=True)):
        if names[j] in written and f is not None and f[0] == "saved" \
                and isinstance(a, torch.Tensor):
            if a.is_leaf or saved_by_node(a) is not None:
                a = a.clone()
            else:
                over.append((names[j], a))
        out.append(a)
    return tuple(out), tuple(over)


#: per node class, the names of its saved-tensor attributes (``_raw_saved_*``)
_saved_attrs: dict[type, tuple[str, ...]] = {}


def saved_by_node(t: torch.Tensor) -> str | None:
    """The name of an autograd node that saved ``t``'s memory for its own backward, among those
    the graph shows from ``t``: the node that made it (an exp's, a sigmoid's or a tanh's keeps
    its output; a product's does not) or, for a view, the node that made its base; None where
    neither did, and for a leaf. What a node saved is read as saved (``_raw_saved_*``, and a
    Python function's own attributes), not unpacked: a tensor packed by saved-tensor hooks as
    something other than itself (a checkpoint recomputes it, an offload holds a copy) is not
    ``t``'s memory. A node that read ``t`` after it was made (another term of a loss) is not
    reachable from ``t`` and is not seen. Any view of ``t``'s storage counts."""
    if not t.numel() or not memory.has_data(t):
        return None
    nodes = [t.grad_fn]
    if t._base is not None:
        nodes.append(t._base.grad_fn)
    ptr, device = _storage_of(t), t.device
    if ptr is None:
        return None
    for node in nodes:
        if node is None:
            continue
        attrs = _saved_attrs.get(type(node))
        if attrs is None:
            attrs = _saved_attrs[type(node)] = tuple(
                a for a in dir(node) if a.startswith("_raw_saved_"))
        held: list = []
        for a in attrs:
            try:
                raw = getattr(node, a)
            except RuntimeError:  # freed: the node's backward ran
                continue
            for r in raw if isinstance(raw, (tuple, list)) else (raw,):
                try:
                    held.append(r.data)
                except (AttributeError, RuntimeError):  # none saved, or freed
                    continue
        held.extend(getattr(node, "__dict__", {}).values())  # ctx.x = tensor
        for h in held:
            for x in h if isinstance(h, (tuple, list)) else (h,):
                if isinstance(x, torch.Tensor) and x.device == device \
                        and memory.has_data(x) and _storage_of(x) == ptr:
                    return node.name()
    return None


def _storage_of(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None for a tensor without one (sparse, nested)."""
    try:
        return t.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):
        return None


_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
#: functorch transforms (vmap, grad, ...) active: Op._run_call refuses the call by name
functorch_active = torch._C._are_functorch_transforms_active


class _Keeping(threading.local):
    """The node whose forward is running on this thread, where its op may keep gradients."""

    op: Any = None
    call: Any = None
    #: the indices of the inputs whose gradient the caller needs
    wanted: frozenset = frozenset()
    kept: dict | None = None
    #: whether the call's output is 0-dim, read from the record when first asked (deriving
    #: the output shapes costs microseconds, which a call whose op never asks does not pay)
    scalar: bool | None = None


_keeping = _Keeping()


def gradient_wanted(op: Op, index: int) -> bool:
    """Inside ``op``'s own node's forward with a 0-dim output: is input ``index``'s gradient
    needed (see the module docstring)."""
    state = _keeping
    if state.op is not op or index not in state.wanted:
        return False
    if state.scalar is None:
        state.scalar = state.call.output_shapes[0] == ()
    return state.scalar


def keep_gradient(op: Op, index: int, grad: Any, inp: Any) -> None:
    """Hand over the gradient of input ``index`` for a unit upstream gradient."""
    name = op._signature.input_names[index]  # type: ignore[union-attr]
    if not gradient_wanted(op, index):
        raise RuntimeError(f"{type(op).__name__}: keep_gradient({name!r}) outside a forward "
                           f"that op.gradient_wanted({name!r}) said wants it")
    if grad.shape != inp.shape or grad.dtype != inp.dtype or grad.device != inp.device:
        raise ValueError(f"{type(op).__name__}: the kept gradient of {name!r} must be like "
                         f"{name} ({inp.dtype}{list(inp.shape)} on {inp.device}), got "
                         f"{grad.dtype}{list(grad.shape)} on {grad.device}")
    assert _keeping.kept is not None
    _keeping.kept[index] = grad


def _once_differentiable(fn: Any) -> Any:
    """torch's ``once_differentiable``, also where no incoming gradient requires grad: with
    ``create_graph=True`` the gradients always come back marked, so that differentiating them
    raises torch's error. (torch's decorator marks them only when an incoming gradient
    requires grad; a loss's gradient is a constant 1, and the marks were missed: a gradient
    penalty would silently lose its term, the inputs' gradients being detached.)"""

    @functools.wraps(fn)
    def wrapper(ctx: Any, *grads: Any) -> Any:
        with torch.no_grad():
            outputs = fn(ctx, *grads)
        if not torch.is_grad_enabled():  # no create_graph: nothing will differentiate them
            return outputs
        # the error node's inputs: the gradients (marked as requiring grad), the saved
        # tensors that require grad and the incoming gradients that do, so that a backward
        # toward the op's inputs or toward the upstream gradient (a jvp by double backward
        # differentiates with respect to it) reaches it (torch.autograd.grad(..., inputs=x)
        # skips a node that leads to no input it wants, and answered zero)
        links = [t for t in (*ctx.saved_tensors, *grads)
                 if isinstance(t, torch.Tensor) and t.requires_grad]
        err = _functions.DelayedError(
            f"{type(ctx.op).__name__}'s gradient is once-differentiable: trying to "
            f"differentiate it again (a double backward through create_graph=True)".encode(),
            len(outputs) + len(links))

        def marked(g: Any) -> Any:
            if g is None or not g.is_floating_point():
                return g
            g = g.detach()
            g.requires_grad = True
            return g

        marks = err(*[marked(g) for g in outputs], *links)
        return tuple(marks[:len(outputs)]) if isinstance(marks, tuple) else marks

    return wrapper


class Node(torch.autograd.Function):
    """The autograd node of one eager call (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, op: Op, call: SignatureCall, *inputs: Any) -> Any:
        gradient = op._gradient
        state = _keeping
        before = (state.op, state.call, state.wanted, state.kept, state.scalar)
        if gradient.scalar_output:
            state.op, state.call, state.kept, state.scalar = op, call, {}, None
            state.wanted = frozenset(i for i, n in enumerate(ctx.needs_input_grad[2:]) if n)
        else:
            state.op, state.call, state.kept = None, None, None
        written = call.branch[0]
        saved_inputs = list(inputs)
        if written:
            # a written input the gradient reads is saved as it was called: a copy before the
            # write (as torch's in-place SiLU saves its input), else the output would stand
            # for it and the gradient would be silently wrong (one read for its shape only
            # keeps a stand-in: no copy)
            names = op._signature.input_names  # type: ignore[union-attr]
            for k, (src, i) in enumerate(gradient.saved_from):
                if src == 0 and names[i] in written and saved_inputs[i] is inputs[i] \
                        and k not in gradient.stand_ins:
                    saved_inputs[i] = inputs[i].detach().clone()
        try:
            outputs = op._execute(call, inputs, None)
            ctx.kept = state.kept or None
        finally:
            state.op, state.call, state.wanted, state.kept, state.scalar = before
        ctx.spent = ()
        if ctx.kept is not None:
            # a gradient kept over its own input (cross-entropy's inplace_grad): the input no
            # longer holds the forward's values; a kernel's write is not seen by torch's
            # version counter, so it is counted here (a node that saved the input unseen
            # raises torch's error at its backward rather than reading the gradient), and a
            # second backward, which would read the input, is refused by name
            over = [i for i, g in ctx.kept.items() if memory.share_memory(g, inputs[i])]
            for i in over:
                torch.autograd.graph.increment_version(inputs[i])
            ctx.spent = tuple(op._signature.input_names[i] for i in over)  # type: ignore[union-attr]
        if written:
            ctx.mark_dirty(*(inputs[names.index(n)] for n in written))
        ctx.save_for_backward(*gradient.saved(tuple(saved_inputs), outputs))
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        ctx.metas = gradient.output_metas(outputs)
        ctx.op = op
        for o in outputs:
            if o is not None and not o.is_floating_point():  # indices, masks: no gradient
                ctx.mark_non_differentiable(*(o for o in outputs
                                              if o is not None and not o.is_floating_point()))
                break
        return outputs[0] if len(outputs) == 1 else outputs

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        """Forward-mode AD: refused by the op's name (torch's own message names no op)."""
        raise RuntimeError(
            f"{type(ctx.op).__name__}: forward-mode AD (torch.autograd.forward_ad, "
            f"torch.func.jvp) does not reach this op: its gradient is a backward; "
            f"differentiate it with torch.autograd.grad or .backward()")

    @staticmethod
    @_once_differentiable
    def backward(ctx: Any, *grads: Any) -> Any:
        op = ctx.op
        kept, ctx.kept = ctx.kept, None  # scaled in place: usable once
        needs = ctx.needs_input_grad[2:]
        if all(g is None for g in grads):  # no gradient in, none out (gradcheck asks)
            return (None,) * (2 + len(needs))
        if kept is not None and all(i in kept for i, n in enumerate(needs) if n):
            g, names = grads[0], op._signature.input_names
            return (None, None, *(op.scale_kept(names[i], kept[i], g) if n else None
                                  for i, n in enumerate(needs)))
        if ctx.spent:
            _refuse_spent(op, ctx.spent)
        written_over: list = []
        try:
            out = op._gradient.run(op, ctx.saved_tensors, grads, ctx.needs_input_grad[2:],
                                   traced=False, metas=ctx.metas, written_over=written_over)
        except RuntimeError as exc:
            # a batched backward (the engine vmaps the node over the upstream gradients):
            # torch's vmap refuses the gradient's writes naming no op
            if not str(exc).startswith(("vmap:", "Batching rule not implemented")):
                raise
            raise RuntimeError(
                f"{type(op).__name__}: a batched backward (vmap over the gradients: "
                f"torch.autograd.functional.jacobian(vectorize=True), "
                f"torch.autograd.grad(is_grads_batched=True)) does not reach this op: its "
                f"gradient writes plain tensors; compute the gradients one at a time "
                f"(vectorize=False, or a loop over the upstream gradients)") from exc
        ctx.spent = tuple(written_over)
        return (None, None, *out)


def _refuse_spent(op: Op, spent: tuple[str, ...]) -> None:
    """A backward of a node whose saved inputs ``spent`` hold their gradient (written over
    them in place by the forward or the first backward): refused by name, before torch's
    saved-tensor check names a version and no op (or, for a kernel's write it does not see, the
    gradient read as the input)."""
    names = " and ".join(spent)
    option = op._gradient.written_option(spent[0])
    how = f"{option}=True" if option.isidentifier() else option or "in place"
    fix = (f"construct the op with {option}=False" if option.isidentifier() else
           "run the forward again")
    raise RuntimeError(
        f"{type(op).__name__}: a second backward through the same call (a retained graph), "
        f"but the gradient was written over {names} in place ({how}): what the node saved of "
        f"{names} is the gradient now, not the forward's values; {fix} to run a backward "
        f"more than once")


def register(boundary: Any, op_cls: type[Op]) -> None:
    """Register ``op_cls``'s gradient on a functional custom op of its compile boundary."""
    gradient: Gradient = op_cls._gradient
    n_inputs = len(boundary.plan.input_names)
    returned = boundary.returned
    names = boundary.plan.output_names

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        produced = output if isinstance(output, tuple) else (output,)
        by_name = dict(zip(returned, produced, strict=True))
        outputs = tuple(by_name.get(n) for n in names)
        ctx.save_for_backward(*gradient.saved(tuple(inputs[:n_inputs]), outputs))
        ctx.set_materialize_grads(False)
        ctx.metas = gradient.output_metas(outputs)
        ctx.key = inputs[n_inputs]

    def backward(ctx: Any, *grads: Any) -> tuple:
        from .registry import instance_for_key

        if all(g is None for g in grads):
            return (None,) * (n_inputs + 1)
        op = instance_for_key(ctx.key)
        by_name = dict(zip(returned, grads, strict=True))
        full = tuple(by_name.get(n) for n in names)
        out = gradient.run(op, ctx.saved_tensors, full, ctx.needs_input_grad[:n_inputs],
                           traced=True, metas=ctx.metas)
        return (*out, None)

    boundary.custom_op.register_autograd(backward, setup_context=setup_context)
