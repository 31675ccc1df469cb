"""What an op people train with adds to :class:`~tileops.runtime.op.Op` beyond its autograd
node (``autograd.py``): the backward op of each combination of its ``needs`` flags, and the
kept gradients (``docs/runtime-decisions.md``, Gradients) -- a forward with a 0-dim output may
compute its inputs' gradients for a unit upstream gradient while it has what they need in hand
(:meth:`Trained.gradient_wanted`, :meth:`Trained.keep_gradient`), and the node's backward then
scales them (:meth:`Trained.scale_kept`) instead of running the backward op.

:class:`Trained` is a base of ``Op``; its methods read the instance's signature, gradient,
params and lock, which ``Op`` sets up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import autograd, memory
from .registry import backward_key, register_instance

if TYPE_CHECKING:  # pragma: no cover
    from .op import Op

__all__ = ["Trained"]


class Trained:
    """The gradient methods of :class:`~tileops.runtime.op.Op`."""

    def gradient_wanted(self, name: str) -> bool:
        """Whether this forward runs in its own autograd node, its output 0-dim, and the
        caller needs the gradient of input ``name``: the forward may then compute it (for a
        unit upstream gradient) and hand it over with :meth:`keep_gradient`, and the node's
        backward scales it instead of running the backward op (autograd.py)."""
        return autograd.gradient_wanted(self, self._signature.input_names.index(name))  # type: ignore[union-attr]

    def keep_gradient(self, name: str, grad: torch.Tensor, inp: torch.Tensor) -> None:
        """Hand over ``grad``, the gradient of input ``name`` (``inp``, which it must be like)
        for a unit upstream gradient; only where :meth:`gradient_wanted` said so."""
        autograd.keep_gradient(self, self._signature.input_names.index(name), grad, inp)  # type: ignore[union-attr]

    def may_keep_over(self, t: torch.Tensor) -> bool:
        """Whether a forward may write a kept gradient over its input ``t`` itself (the
        cross-entropy's ``inplace_grad``): not where ``t`` is a leaf (the caller's tensor, whose
        values would become its own gradient), nor where a node the graph shows from ``t``
        saved its memory for its own backward (:func:`autograd.saved_by_node`: an exp's, a
        sigmoid's or a tanh's output, which that backward would read as the gradient, or
        refuse). Elsewhere the node counts the write for torch's version check (autograd.py)."""
        return not t.is_leaf and autograd.saved_by_node(t) is None

    def scale_kept(self, name: str, grad: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
        """The kept gradient of input ``name`` scaled by the upstream gradient ``dout`` (0-dim),
        for the node's backward to return: ``grad`` multiplied in place by default. An op
        overrides it where a torch multiply costs too much: a kept gradient the size of the
        logits is read and written for it, though ``loss.backward()`` passes 1."""
        return grad.mul_(dout)

    def checks_indices(self, t: torch.Tensor) -> bool:
        """Whether a call reads the values of ``t``, an index input, on the host to refuse one
        out of range by name (one device sync), where a kernel or torch's scatter would read
        or write out of bounds (on a GPU a device-side assert, which leaves no op usable):
        for a call made directly, not for a backward op a forward built for its gradient
        (its indices are the forward's own, which autograd keeps from changes in place), nor
        while the current CUDA stream is captured into a graph (no host read there), nor for
        a tensor without data (a fake or meta one)."""
        if self._fed_by_forward or not memory.has_data(t):  # type: ignore[attr-defined]
            return False
        return not (t.is_cuda and torch.cuda.is_current_stream_capturing())

    def _backward_op(self, needs: tuple[bool, ...]) -> Op:
        """The backward op for this combination of the gradient's ``needs`` params (built
        once, held): the forward's params it shares by name, the ``needs`` flags, the
        forward's target."""
        op = self._backward_ops.get(needs)
        if op is None:
            gradient = self._gradient
            assert gradient is not None
            bwd = gradient.resolved()[0]
            params = {n: getattr(self, n) for n in bwd._param_names if n in self._param_names}
            params.update((p, v) for (_, p), v in zip(gradient.needs, needs, strict=True))
            with self._lock:
                op = self._backward_ops.get(needs)
                if op is None:
                    op = bwd(target=self.target, tune=self._tune_requested, **params)
                    op._fed_by_forward = True  # called only by this forward's gradient
                    # keyed by this instance, as a compiled backward names it (registry.py)
                    op._instance_key = register_instance(  # type: ignore[attr-defined]
                        op, backward_key(self._instance_key, needs))  # type: ignore[attr-defined]
                    self._backward_ops[needs] = op
        return op


#: the op classes whose backward class has its custom ops registered (register_backward)
_backward_registered: set[type] = set()


def register_backward(op: Op) -> None:
    """Register the custom ops of ``op``'s backward class, once a forward class: a compiled
    training step's backward calls them, and where its compiled code comes from a cache
    (another process's) no traced backward built an instance of that class. Called from the
    compile boundary's fake call, which runs for every traced call before any compiled code
    is looked up (boundary.py), so an op that is never traced pays nothing. Building the
    backward op of every gradient once registers each branch of the class. A backward op
    these params do not build is left to the backward, which names the error. The instance
    built is dropped: the op's own backward ops are those its backward asks for (a backward op
    for needs no backward asks for would be one the op never uses)."""
    cls = type(op)
    if cls in _backward_registered or cls._gradient is None:
        return
    gradient = cls._gradient
    try:
        bwd = gradient.resolved()[0]
        params = {n: getattr(op, n) for n in bwd._param_names if n in op._param_names}
        params.update((p, True) for _, p in gradient.needs)
        bwd(target=op.target, **params)  # its construction registers the class's custom ops
    except Exception:  # noqa: BLE001 - the backward reports it where it runs
        return
    _backward_registered.add(cls)
