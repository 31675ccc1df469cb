"""Gradients (autograd.py): an entry's ``backward`` block as one autograd node per eager call
and as the compile boundary's registered formula. The ops here are served by the reference
target (CPU), so every rule is checked without kernels."""

from __future__ import annotations

import copy
import pickle
from pathlib import Path

import pytest
import torch

from tileops.runtime import Op, SpecSet

SPECS = SpecSet.load(Path(__file__).parent / "specs" / "grad.yaml")


class ScaleGradOp(Op, specs=SPECS):
    def reference(self, call, x, bias, gain):
        y = self.alpha * x * (1 if gain is None else gain)
        return (y if bias is None else y + bias,)


class ScaleGradBwdOp(Op, specs=SPECS):
    calls = 0

    def reference(self, call, dy, gain):
        ScaleGradBwdOp.calls += 1
        dx = self.alpha * dy * (1 if gain is None else gain)
        return dx, dy.sum(dim=tuple(range(dy.dim() - 1))) if self.grad_bias else None


class AddGradOp(Op, specs=SPECS):
    def reference(self, call, a, b):
        return (a + b,)


class AddGradBwdOp(Op, specs=SPECS):
    def reference(self, call, dout):
        return (dout,)


class SquareGradOp(Op, specs=SPECS):
    def reference(self, call, x):
        return (x * x,)


class SquareGradBwdOp(Op, specs=SPECS):
    def reference(self, call, dy, x):
        return (2 * x * dy,)


class RowSumGradOp(Op, specs=SPECS):
    def reference(self, call, x):
        return (x.sum(dim=1, keepdim=True),)


class RowSumGradBwdOp(Op, specs=SPECS):
    seen: list = []

    def reference(self, call, dy, x, y):
        RowSumGradBwdOp.seen.append((x, y))
        return (dy.expand(x.shape),)


class ForkGradOp(Op, specs=SPECS):
    def reference(self, call, x, w):
        return x * w, 2 * x


class ForkGradBwdOp(Op, specs=SPECS):
    #: (dy given, grad_w) of each call
    seen: list = []

    def reference(self, call, dz, x, w, dy):
        ForkGradBwdOp.seen.append((dy is not None, self.grad_w))
        dx = 2 * dz if dy is None else 2 * dz + dy * w
        dw = (dy * x).sum(0) if self.grad_w and dy is not None else None
        return dx, dw


def _leaf(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


def test_gradcheck_through_the_public_op_with_each_presence() -> None:
    op = ScaleGradOp(alpha=1.5)
    x, bias, gain = _leaf(3, 4), _leaf(4), torch.randn(4, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: op(x), (x,))
    assert torch.autograd.gradcheck(lambda x, b: op(x, b), (x, bias))
    assert torch.autograd.gradcheck(lambda x, b: op(x, b, gain), (x, bias))


def test_the_node_is_named_after_the_op_and_grad_off_records_nothing() -> None:
    op = ScaleGradOp()
    x = _leaf(2, 3)
    y = op(x)
    assert type(y.grad_fn).__name__ == "ScaleGradOpBackward"
    with torch.no_grad():
        assert op(x).grad_fn is None
    assert op(x.detach()).grad_fn is None  # grad mode on, nothing requires grad
    assert op._fast is not None  # the plain call is the fused one


def test_needs_turns_off_a_gradient_no_input_wants() -> None:
    op = ScaleGradOp()
    x, bias = _leaf(2, 3), torch.randn(3, dtype=torch.float64)
    op(x, bias).sum().backward()
    assert x.grad is not None and bias.grad is None
    assert list(op._backward_ops) == [(False,)]
    (bwd,) = op._backward_ops.values()
    assert bwd.grad_bias is False and bwd.alpha == op.alpha
    bias.requires_grad_()
    op(x, bias).sum().backward()
    assert sorted(op._backward_ops) == [(False,), (True,)]
    torch.testing.assert_close(bias.grad, torch.full((3,), 2.0, dtype=torch.float64))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_input_reaching_only_unused_outputs_gets_no_gradient(compiled) -> None:
    # w reaches y alone: with z alone used, w's gradient is None (as torch's autograd gives
    # it), the backward op is built with grad_w off and y's gradient reaches it absent
    op = ForkGradOp()
    x, w = _leaf(3, 4), _leaf(4)

    def loss(x, w, used):
        y, z = op(x, w)
        return (z if used == "z" else y).pow(2).sum()

    if compiled:
        torch._dynamo.reset()
        loss = torch.compile(loss, backend="aot_eager", fullgraph=True)
    ForkGradBwdOp.seen.clear()
    gx, gw = torch.autograd.grad(loss(x, w, "z"), (x, w), allow_unused=True)
    assert gw is None and ForkGradBwdOp.seen == [(False, False)]
    torch.testing.assert_close(gx, 8 * x.detach())
    assert list(op._backward_ops) == [(False,)]
    ForkGradBwdOp.seen.clear()
    gx, gw = torch.autograd.grad(loss(x, w, "y"), (x, w))  # both reach y
    assert ForkGradBwdOp.seen == [(True, True)]
    y = x.detach() * w.detach()
    torch.testing.assert_close(gx, 2 * y * w.detach())
    torch.testing.assert_close(gw, (2 * y * x.detach()).sum(0))


def test_no_backward_runs_where_every_wanted_input_reaches_only_unused_outputs() -> None:
    op = ForkGradOp()
    x, w = torch.randn(3, 4, dtype=torch.float64), _leaf(4)
    y, z = op(x, w)
    assert z.requires_grad  # w requires grad, so every floating output does
    ForkGradBwdOp.seen.clear()
    (gw,) = torch.autograd.grad(z.sum(), w, allow_unused=True)
    assert gw is None and ForkGradBwdOp.seen == [] and not op._backward_ops


def test_the_backward_op_is_built_once_per_needs_and_reused() -> None:
    op = ScaleGradOp()
    x = _leaf(2, 3)
    before = ScaleGradBwdOp.calls
    for _ in range(3):
        op(x).sum().backward()
    assert ScaleGradBwdOp.calls == before + 3 and len(op._backward_ops) == 1


def test_an_input_that_is_not_differentiable_is_refused_by_name() -> None:
    op = ScaleGradOp()
    with pytest.raises(RuntimeError, match=r"^ScaleGradOp: gain requires grad, but the op is not "
                                           r"differentiable with respect to it \(differentiable: "
                                           r"x, bias\); pass a detached tensor$"):
        op(_leaf(2, 3), None, _leaf(3))
    op(_leaf(2, 3))  # the op stays usable


def test_out_with_grad_is_refused_with_torchs_rule() -> None:
    op = AddGradOp()
    a, b = _leaf(2, 2), torch.randn(2, 2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"^AddGradOp: out= arguments \(out\) do not support "
                                           r"automatic differentiation, but an input requires "
                                           r"grad \(torch's rule for out=\)"):
        op(a, b, out=torch.empty(2, 2, dtype=torch.float64))
    out = op(a, b)
    out.sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(2, 2, dtype=torch.float64))


def test_two_inputs_sharing_one_gradient_output() -> None:
    op = AddGradOp()
    a, b = _leaf(3), _leaf(3)
    assert torch.autograd.gradcheck(lambda a, b: op(a, b), (a, b))


def test_in_place_refuses_a_leaf_and_differentiates_a_non_leaf() -> None:
    op = ScaleGradOp(inplace=True)
    x = _leaf(2, 3)
    with pytest.raises(RuntimeError, match=r"^ScaleGradOp\(alpha=2.0, inplace=True\) writes its "
                                           r"input 'x' in place, and x is a leaf tensor that "
                                           r"requires grad: torch forbids"):
        op(x)
    h = x * 1.0
    y = op(h)
    assert y is h and y.grad_fn is not None
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2, 3), 2.0, dtype=torch.float64))


def test_in_place_whose_gradient_reads_the_written_input_saves_it_before_writing() -> None:
    # saved after the write, x would be the output: the node saves a copy of x before it
    op = SquareGradOp(inplace=True)
    x = _leaf(2, 3)
    h = x * 1.0
    y = op(h)
    assert y is h and y.grad_fn is not None
    torch.testing.assert_close(h.detach(), x.detach() ** 2)  # written
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())  # of x, not of its square
    with torch.no_grad():
        assert op(h) is h  # the op is usable


def test_a_double_backward_raises_naming_the_op() -> None:
    op = ScaleGradOp()
    x = _leaf(2, 3)
    (g,) = torch.autograd.grad(op(x).sum(), x, create_graph=True)
    # the gradient saves nothing of x (alpha * dy): it is rightly not a function of x, as
    # torch's own x * alpha's is not
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        torch.autograd.grad(g.sum(), x)
    # where it reads x (SquareGradOp's 2 x dy), the mark raises, naming the op, though the
    # incoming gradient (the sum's ones) requires no grad
    (g,) = torch.autograd.grad(SquareGradOp()(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=r"^SquareGradOp's gradient is once-differentiable: "
                                           r"trying to differentiate it again"):
        torch.autograd.grad(g.sum(), x)


def test_compiled_forward_registers_the_formula_and_builds_nothing_while_tracing() -> None:
    torch._dynamo.reset()
    op = ScaleGradOp(alpha=3.0)
    from torch._dynamo.backends.common import aot_autograd

    seen: list[str] = []
    bound_when_compiled: list[str | None] = []

    def record(gm, example_inputs):  # the forward graph is compiled before anything runs
        bound_when_compiled.append(op.serving_target)
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    f = torch.compile(lambda x, b: op(x, b) * 2, fullgraph=True,
                      backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    x, b = _leaf(2, 3), _leaf(3)
    f(x, b).sum().backward()
    assert bound_when_compiled[0] is None, "tracing bound a target"
    assert any("test_scale_grad" in s and "bwd" not in s for s in seen), seen
    assert any("test_scale_grad_bwd" in s for s in seen), seen
    torch.testing.assert_close(x.grad, torch.full((2, 3), 6.0, dtype=torch.float64))
    torch.testing.assert_close(b.grad, torch.full((3,), 4.0, dtype=torch.float64))


def test_compiled_in_place_with_grad_is_refused_by_name() -> None:
    torch._dynamo.reset()
    op = ScaleGradOp(inplace=True)
    f = torch.compile(lambda x: op(x * 1.0), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"writes x in place, and torch.compile cannot "
                                        r"differentiate a custom op that writes its inputs"):
        f(_leaf(2, 3))


def test_ops_pickle_and_deepcopy_as_their_construction() -> None:
    op = ScaleGradOp(alpha=0.5, target="reference")
    op(_leaf(2, 3)).sum().backward()  # caches, a backward op, a lock: none travel
    for twin in (copy.deepcopy(op), pickle.loads(pickle.dumps(op))):
        assert type(twin) is ScaleGradOp and repr(twin) == repr(op)
        assert twin._backward_ops == {} and twin.last_call is None
        assert twin._instance_key != op._instance_key
        x = _leaf(2, 3)
        twin(x).sum().backward()
        torch.testing.assert_close(x.grad, torch.full((2, 3), 0.5, dtype=torch.float64))


def test_a_backward_key_builds_the_backward_op_through_its_forward() -> None:
    from tileops.runtime.registry import backward_key, instance_for_key
    from tileops.runtime.trained import register_backward

    # needs params (the bias's flag): the key's bits are the needs; none: an empty suffix
    for op, needs in ((ScaleGradOp(), (False,)), (SquareGradOp(), ())):
        register_backward(op)  # registers the class's custom ops, builds none of op's own
        assert op._backward_ops == {}
        bwd = instance_for_key(backward_key(op._instance_key, needs))
        assert op._backward_ops == {needs: bwd}
        assert instance_for_key(backward_key(op._instance_key, needs)) is bwd


def _is_stand_in(t: torch.Tensor, like: torch.Tensor) -> bool:
    """One element of ``like``'s dtype and device, viewed with ``like``'s shape (strides 0)."""
    return (t.shape == like.shape and t.dtype == like.dtype and t.device == like.device
            and all(s == 0 for s in t.stride()) and t.untyped_storage().nbytes() == t.itemsize)


def test_a_saved_tensor_read_for_its_shape_only_is_kept_as_a_stand_in() -> None:
    import weakref

    x = _leaf(64, 32)
    h = x * 2  # an intermediate nothing else keeps
    ref = weakref.ref(h)
    y = RowSumGradOp()(h)
    kept_x, kept_y = y.grad_fn.saved_tensors  # the input and the output alike
    assert _is_stand_in(kept_x, h) and _is_stand_in(kept_y, y)
    del h, kept_x, kept_y
    assert ref() is None  # the node holds none of its memory
    RowSumGradBwdOp.seen.clear()
    dy = torch.randn(64, 1, dtype=torch.float64)
    (dx,) = torch.autograd.grad(y, x, dy)
    torch.testing.assert_close(dx, 2 * dy.expand(64, 32), rtol=0, atol=0)
    (seen_x, seen_y), = RowSumGradBwdOp.seen
    assert seen_x.shape == (64, 32) and seen_y.shape == (64, 1)


def test_a_compiled_call_keeps_the_stand_in_too() -> None:
    op = RowSumGradOp()
    x = _leaf(8, 4)
    compiled = torch.compile(lambda t: op(t * 2), backend="aot_eager", fullgraph=True)
    y = compiled(x)
    (dx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(dx, torch.full((8, 4), 2.0, dtype=torch.float64))


def test_gradcheck_through_a_stand_in() -> None:
    x = _leaf(5, 3)
    assert torch.autograd.gradcheck(RowSumGradOp(), (x,))


def test_saved_by_node_names_the_node_that_saved_a_tensors_memory() -> None:
    """What a write in place over a tensor would break, as far as the graph shows from it: the
    node that made it (or its base) where that node saved it for its own backward; nothing for
    a leaf, a product (whose backward reads its inputs), or a tensor that saved-tensor hooks
    packed as something else (a checkpoint recomputes it, an offload holds a copy)."""
    from torch.utils.checkpoint import checkpoint

    from tileops.runtime.autograd import saved_by_node

    h = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(5, 4, requires_grad=True)
    assert saved_by_node(h) is None
    assert saved_by_node(h @ w.T) is None
    assert saved_by_node(2.0 * (h @ w.T)) is None
    assert saved_by_node(torch.exp(h)) == "ExpBackward0"
    assert saved_by_node(torch.sigmoid(h)[:, 1:]) == "SigmoidBackward0"  # its base's node
    assert saved_by_node(torch.tanh(h).view(12)) == "TanhBackward0"
    assert saved_by_node(checkpoint(torch.exp, h, use_reentrant=False)) is None
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        assert saved_by_node(torch.exp(h)) is None  # a copy was saved
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (t.device, t), lambda p: p[1]):
        assert saved_by_node(torch.exp(h)) == "ExpBackward0"  # itself, in a tuple
    y = torch.exp(h)
    y.sum().backward()  # the node's saved tensors are freed
    assert saved_by_node(y) is None
    assert saved_by_node(torch.empty(0, 4, requires_grad=True).exp()) is None
