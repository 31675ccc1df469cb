"""Composite ops: ``delegate_types``, ``delegate_for``, every sub-call recorded into a stage of
the parent's record, a sub-call outside any stage is an error, and a reset reaches the
delegates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tileops.runtime import (
    IN_TREE,
    REFERENCE,
    CallSpec,
    Kernel,
    KernelInterface,
    Op,
    SpecSet,
    StageError,
    register_builder,
)
from tileops.signature import Stage

SPECS = SpecSet.load(Path(__file__).parent / "specs" / "ops.yaml")


class Iface(KernelInterface):
    slot = "k"
    call_spec = CallSpec


class Mul(Kernel, Iface):
    devices = ("cpu", "meta")
    general = True
    fail_next = False

    def __call__(self, x, y, alpha):
        torch.mul(x, alpha, out=y)


class Add(Kernel, Iface):
    devices = ("cpu", "meta")
    general = True
    fail_next = False

    def __call__(self, a, b, out):
        if Add.fail_next:
            Add.fail_next = False
            raise RuntimeError("add failed")
        torch.add(a, b, out=out)


class ScaleOp(Op, specs=SPECS):
    kernel_types = {Iface: (Mul,)}

    def forward(self, call, x, bias, y):
        self.kernel(Iface, CallSpec(call.device))(x, y, self.alpha)


class AddOp(Op, specs=SPECS):
    kernel_types = {Iface: (Add,)}

    def forward(self, call, a, b, out):
        self.kernel(Iface, CallSpec(call.device))(a, b, out)


class ScaleAddOp(Op, specs=SPECS):
    """y = alpha * x + b in two stages; writes the output the base allocated."""

    delegate_types = {"scale": ScaleOp, "add": AddOp}

    def forward(self, call, x, b, y):
        with self.stage("scale"):
            t = self.delegate_for("scale", alpha=self.alpha)(x)
        with self.stage("add"):
            self.delegate_for("add")(t, b, out=y)


@pytest.fixture(autouse=True)
def _no_pending_failure():
    yield
    Add.fail_next = False


def test_sub_calls_are_recorded_into_stages() -> None:
    op = ScaleAddOp(alpha=3.0)
    x, b = torch.ones(2, 4), torch.ones(2, 4)
    y = op(x, b)
    assert torch.equal(y, torch.full((2, 4), 4.0))
    scale = op.delegate_for("scale", alpha=3.0)
    add = op.delegate_for("add")
    assert op.last_call.stages == (Stage("scale", (scale.last_call,)),
                                   Stage("add", (add.last_call,)))
    assert add.last_call.out_given is True
    # a fresh record per call
    first = op.last_call
    op(x, b)
    assert op.last_call is not first and len(op.last_call.stages) == 2
    assert first.stages[0].calls[0] is not op.last_call.stages[0].calls[0]


def test_composite_without_kernels_is_served_by_its_own_forward() -> None:
    op = ScaleAddOp()
    op(torch.ones(2), torch.ones(2))
    assert op.serving_target == IN_TREE
    assert op._target_builder is None
    assert op._installed_kernel_types == {}
    assert op.delegate_for("scale", alpha=2.0).serving_target == IN_TREE


def test_a_stage_may_hold_several_calls_and_stages_keep_their_order() -> None:
    class Twice(Op, specs=SPECS, entry="ScaleAddOp"):
        delegate_types = {"scale": ScaleOp, "add": AddOp}

        def forward(self, call, x, b, y):
            with self.stage("add"):
                self.delegate_for("add")(x, b, out=y)
            with self.stage("scale"):
                s = self.delegate_for("scale", alpha=1.0)
                s(y)
                s(y)

    op = Twice()
    op(torch.ones(3), torch.ones(3))
    assert [(s.name, len(s.calls)) for s in op.last_call.stages] == [("add", 1), ("scale", 2)]


def test_delegates_are_built_once_per_role_and_params() -> None:
    op = ScaleAddOp(tune=True)
    a = op.delegate_for("scale", alpha=2.0)
    assert op.delegate_for("scale", alpha=2.0) is a
    assert op.delegate_for("scale", alpha=5.0) is not a
    assert isinstance(a, ScaleOp) and a._tune_requested is True
    assert set(op._delegates) == {("scale", (("alpha", 2.0),)), ("scale", (("alpha", 5.0),))}
    with pytest.raises(LookupError, match="declares no delegate 'mul'"):
        op.delegate_for("mul")


def test_delegates_take_the_parents_target(new_target) -> None:
    name = new_target()
    register_builder(name, ScaleOp, lambda o, c: lambda x, bias, y: torch.mul(x, 10, out=y))
    register_builder(name, AddOp, lambda o, c: lambda a, b, out: torch.add(a, b, out=out))
    op = ScaleAddOp(target=name)  # no builder for ScaleAddOp itself: it composes
    assert torch.equal(op(torch.ones(2), torch.ones(2)), torch.full((2,), 11.0))
    assert op.serving_target == name
    assert op.delegate_for("scale", alpha=2.0).serving_target == name
    assert [s.name for s in op.last_call.stages] == ["scale", "add"]


def test_a_builder_for_the_composite_serves_it_whole() -> None:
    register_builder(REFERENCE, ScaleAddOp,
                     lambda o, c: lambda x, b, y: torch.add(x * o.alpha, b, out=y))
    op = ScaleAddOp(target=REFERENCE)
    assert torch.equal(op(torch.ones(2), torch.ones(2)), torch.full((2,), 3.0))
    assert op.last_call.stages == ()
    assert op._delegates == {}


def test_a_sub_call_outside_any_stage_is_an_error(state) -> None:
    class Careless(Op, specs=SPECS, entry="ScaleAddOp"):
        delegate_types = {"scale": ScaleOp, "add": AddOp}

        def forward(self, call, x, b, y):
            self.delegate_for("add")(x, b, out=y)

    op = Careless()
    before = state.snapshot(op)
    with pytest.raises(StageError, match="AddOp was called by Careless outside any stage"):
        op(torch.ones(2), torch.ones(2))
    state.assert_failed_and_reset(op, before)
    child = op.delegate_for("add")
    state.assert_binding_initial(child)
    assert child.last_call is None


def test_stages_do_not_nest() -> None:
    class Nested(Op, specs=SPECS, entry="ScaleAddOp"):
        delegate_types = {"add": AddOp}

        def forward(self, call, x, b, y):
            with self.stage("scale"), self.stage("add"):
                pass

    with pytest.raises(StageError, match="stage 'add' opened inside stage 'scale'"):
        Nested()(torch.ones(1), torch.ones(1))


def test_a_stage_the_spec_does_not_declare() -> None:
    class Misnamed(Op, specs=SPECS, entry="ScaleAddOp"):
        delegate_types = {"add": AddOp}

        def forward(self, call, x, b, y):
            with self.stage("sum"):
                self.delegate_for("add")(x, b, out=y)

    op = Misnamed()
    with pytest.raises(StageError, match=r"^Misnamed: stage 'sum' is not declared in its spec's "
                                         r"composition; declared: scale, add$"):
        op(torch.ones(2), torch.ones(2))
    assert op.last_call is None


def test_a_delegate_called_outside_its_parents_forward() -> None:
    op = ScaleAddOp()
    op(torch.ones(1), torch.ones(1))
    with pytest.raises(StageError, match="outside any stage"):
        op.delegate_for("add")(torch.ones(1), torch.ones(1))


def test_a_failing_first_call_resets_the_delegates_too(state) -> None:
    op = ScaleAddOp()
    scale, add = op.delegate_for("scale", alpha=2.0), op.delegate_for("add")
    before = {o: state.snapshot(o) for o in (op, scale, add)}
    Add.fail_next = True
    with pytest.raises(RuntimeError, match="add failed"):
        op(torch.ones(2), torch.ones(2))
    state.assert_failed_and_reset(op, before[op])
    # the parent keeps its delegates; each one's binding is back to its initial values
    assert op._delegates == {k: v for k, v in before[op].run["_delegates"][1].items()}
    for child in (scale, add):
        state.assert_binding_initial(child)
        state.assert_construction_unchanged(child, before[child])
        state.assert_run_kept(child, before[child])
    assert add.last_call is None
    # the next call chooses again, all the way down
    op(torch.ones(2), torch.ones(2))
    assert op.serving_target == scale.serving_target == add.serving_target == IN_TREE


def test_a_failing_later_call_keeps_the_delegates_bindings(state) -> None:
    op = ScaleAddOp()
    op(torch.ones(2), torch.ones(2))
    good = op.last_call
    children = list(op._delegates.values())
    before = {o: state.snapshot(o) for o in (op, *children)}
    Add.fail_next = True
    with pytest.raises(RuntimeError, match="add failed"):
        op(torch.ones(2), torch.ones(2))
    state.assert_failed_and_kept(op, before[op])
    assert op.last_call is good and len(good.stages) == 2
    for child in children:
        state.assert_binding_kept(child, before[child])


def test_iter_kernels_reaches_the_delegates() -> None:
    op = ScaleAddOp()
    op(torch.ones(2), torch.ones(2))
    op(torch.ones(2, device="meta"), torch.ones(2, device="meta"))
    kernels = list(op.iter_kernels())
    assert len(kernels) == 4
    assert {type(k) for k in kernels} == {Mul, Add}


def test_a_composite_returning_its_outputs() -> None:
    class Returns(Op, specs=SPECS, entry="ScaleAddOp"):
        delegate_types = {"scale": ScaleOp, "add": AddOp}
        allocate_outputs = False

        def forward(self, call, x, b):
            with self.stage("scale"):
                t = self.delegate_for("scale", alpha=self.alpha)(x)
            with self.stage("add"):
                return self.delegate_for("add")(t, b)

    y = Returns(alpha=1.0)(torch.ones(2), torch.ones(2))
    assert torch.equal(y, torch.full((2,), 2.0))


def test_a_stage_outside_a_call_or_in_a_non_composite_op() -> None:
    op = ScaleAddOp()
    with pytest.raises(StageError, match="opened outside the forward of a call"), \
            op.stage("scale"):
        pass

    class NotComposite(Op, specs=SPECS, entry="ScaleOp"):
        kernel_types = {Iface: (Mul,)}

        def forward(self, call, x, bias, y):
            with self.stage("mul"):
                self.kernel(Iface, CallSpec(call.device))(x, y, self.alpha)

    with pytest.raises(StageError, match="declare delegate_types"):
        NotComposite()(torch.ones(2))


# --- a composite op with a backward: one autograd node for the whole call ------------------------

_GRAD_SPECS = """\
ScaleAddGradOp:
  family: test
  status: implemented
  signature:
    forall: {S: Shape, N: Dim, T: "DType[float32 | float16]"}
    params:
      alpha: {type: float, default: 2.0}
    inputs:
      x: {dtype: T, shape: "[*S, N]"}
      b: {dtype: T, shape: "[*S, N]"}
    outputs:
      y: {dtype: T, shape: "[*S, N]"}
  composition:
    stages:
    - {name: scale, op: ScaleOp}
    - {name: add, op: AddOp}
  roofline:
    flops: "2 * prod(S) * N"
  backward:
    op: ScaleAddGradBwdOp
    inputs: {dy: "grad(y)"}
    grads: {x: dx, b: db}

ScaleAddGradBwdOp:
  family: test
  status: implemented
  signature:
    forall: {S: Shape, N: Dim, T: "DType[float32 | float16]"}
    params:
      alpha: {type: float, default: 2.0}
    inputs:
      dy: {dtype: T, shape: "[*S, N]"}
    outputs:
      dx: {dtype: T, shape: "[*S, N]"}
      db: {dtype: T, shape: "[*S, N]"}
  roofline:
    flops: "2 * prod(S) * N"

# A 0-dim output: its forward may keep its inputs' gradients.
ScaledSumOp:
  family: test
  status: implemented
  signature:
    forall: {S: Shape, T: "DType[float32 | float16]"}
    params:
      alpha: {type: float, default: 2.0}
    inputs:
      x: {dtype: T, shape: "[*S]"}
      b: {dtype: T, shape: "[*S]"}
    outputs:
      total: {dtype: T, shape: "[]"}
  composition:
    stages:
    - {name: scale, op: ScaleOp}
  roofline:
    flops: "2 * prod(S)"
  backward:
    op: ScaledSumBwdOp
    saves: [x]
    inputs: {dtotal: "grad(total)", x: x}
    grads: {x: dx, b: db}

ScaledSumBwdOp:
  family: test
  status: implemented
  signature:
    forall: {S: Shape, T: "DType[float32 | float16]"}
    params:
      alpha: {type: float, default: 2.0}
    inputs:
      dtotal: {dtype: T, shape: "[]"}
      x: {dtype: T, shape: "[*S]"}
    outputs:
      dx: {dtype: T, shape: "[*S]"}
      db: {dtype: T, shape: "[*S]"}
  roofline:
    flops: "2 * prod(S)"
"""


@pytest.fixture(scope="module")
def grad_specs(tmp_path_factory):
    path = tmp_path_factory.mktemp("specs") / "composite_grad.yaml"
    path.write_text(_GRAD_SPECS)
    # loaded with ops.yaml: the stages name its ops
    return SpecSet.load(Path(__file__).parent / "specs" / "ops.yaml", path)


@pytest.fixture(scope="module")
def grad_composite(grad_specs):
    specs = grad_specs

    class ScaleAddGradOp(Op, specs=specs):
        delegate_types = {"scale": ScaleOp, "add": AddOp}

        def forward(self, call, x, b, y):
            with self.stage("scale"):
                t = self.delegate_for("scale", alpha=self.alpha)(x)
            assert not t.requires_grad and t.grad_fn is None  # grad is off inside the node
            with self.stage("add"):
                self.delegate_for("add")(t, b, out=y)

    class ScaleAddGradBwdOp(Op, specs=specs):
        calls = 0

        def reference(self, call, dy):
            ScaleAddGradBwdOp.calls += 1
            return self.alpha * dy, dy.clone()

    return ScaleAddGradOp, ScaleAddGradBwdOp


@pytest.fixture(scope="module")
def sum_ops(grad_specs):
    specs = grad_specs

    class ScaledSumOp(Op, specs=specs):
        delegate_types = {"scale": ScaleOp}
        keep = True

        def forward(self, call, x, b, total):
            with self.stage("scale"):
                t = self.delegate_for("scale", alpha=self.alpha)(x)
            total.copy_(t.sum() + b.sum())
            if self.keep == "unlike":
                self.keep_gradient("x", torch.ones(3, dtype=torch.float64), x)
            if self.keep and self.gradient_wanted("x"):
                self.keep_gradient("x", torch.full_like(x, self.alpha), x)
            if self.keep and self.gradient_wanted("b"):
                self.keep_gradient("b", torch.ones_like(b), b)

    class ScaledSumBwdOp(Op, specs=specs):
        calls = 0

        def reference(self, call, dtotal, x):
            ScaledSumBwdOp.calls += 1
            return self.alpha * dtotal.expand(x.shape), dtotal.expand(x.shape)

    return ScaledSumOp, ScaledSumBwdOp


def test_a_composite_with_a_backward_is_one_autograd_node(grad_composite) -> None:
    fwd, bwd = grad_composite
    op = fwd(alpha=3.0)
    x = torch.randn(2, 4, requires_grad=True)
    b = torch.randn(2, 4, requires_grad=True)
    y = op(x, b)
    # one node, named after the composite, whose inputs are the caller's leaves: the
    # delegates (whose entries declare no gradient, so they would refuse) recorded nothing
    assert type(y.grad_fn).__name__ == "ScaleAddGradOpBackward"
    assert [type(f).__name__ for f, _ in y.grad_fn.next_functions] == ["AccumulateGrad"] * 2
    assert torch.equal(y.detach(), 3.0 * x.detach() + b.detach())
    assert [s.name for s in op.last_call.stages] == ["scale", "add"]
    dy = torch.randn(2, 4)
    before = bwd.calls
    y.backward(dy)
    assert bwd.calls == before + 1
    assert torch.equal(x.grad, 3.0 * dy) and torch.equal(b.grad, dy)


def test_a_composite_without_a_backward_leaves_the_node_to_its_delegates() -> None:
    # ScaleAddOp's entry declares no backward: its delegates record (here: ScaleOp, which has
    # no gradient, refuses by name), as before
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"^ScaleOp.*x requires grad"):
        ScaleAddOp()(x, torch.ones(2))


def test_a_composite_with_a_backward_compiles_to_its_own_node(grad_composite) -> None:
    fwd, _ = grad_composite
    op = fwd(alpha=3.0)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(lambda x, b: op(x, b).sum(), backend=backend, fullgraph=True)
    x = torch.randn(2, 4, requires_grad=True)
    b = torch.randn(2, 4, requires_grad=True)
    step(x, b).backward()
    calls = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    own = getattr(torch.ops.tileops, fwd.compile_op_names[0].split("::", 1)[1]).default
    assert [n.target for n in calls][:1] == [own]  # then the sum
    assert torch.equal(x.grad, torch.full((2, 4), 3.0)) and torch.equal(b.grad, torch.ones(2, 4))


def test_a_forward_keeps_its_gradients_and_the_backward_scales_them(sum_ops) -> None:
    fwd, bwd = sum_ops
    op = fwd(alpha=3.0)
    x, b = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    total = op(x, b)
    assert torch.allclose(total.detach(), 3.0 * x.detach().sum() + b.detach().sum())
    before = bwd.calls
    (2.5 * total).backward(retain_graph=True)
    assert bwd.calls == before  # the kept gradients, scaled: no backward op
    assert torch.equal(x.grad, torch.full((5,), 7.5)) and torch.equal(b.grad, torch.full((5,), 2.5))
    # kept gradients are scaled in place, so a second backward runs the backward op
    (2.0 * total).backward()
    assert bwd.calls == before + 1
    assert torch.equal(x.grad, torch.full((5,), 13.5)) and torch.equal(b.grad, torch.full((5,), 4.5))


def test_an_op_may_supply_the_scale_of_its_kept_gradients(sum_ops, monkeypatch) -> None:
    fwd, bwd = sum_ops
    seen = []

    def scale_kept(self, name, grad, dout):
        seen.append((name, grad.shape, dout.shape, float(dout)))
        return grad * (10.0 * dout)  # not the default product: the hook's is returned

    monkeypatch.setattr(fwd, "scale_kept", scale_kept)
    op = fwd(alpha=3.0)
    x, b = torch.randn(5, requires_grad=True), torch.randn(5)
    before = bwd.calls
    (2.0 * op(x, b)).backward()
    assert bwd.calls == before
    assert seen == [("x", (5,), (), 2.0)]  # only the gradients the caller needs
    assert torch.equal(x.grad, torch.full((5,), 60.0))


def test_a_forward_that_keeps_fewer_gradients_than_needed_falls_back(sum_ops) -> None:
    fwd, bwd = sum_ops
    op = fwd(alpha=3.0)
    op.keep = False
    x, b = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
    before = bwd.calls
    op(x, b).backward()
    assert bwd.calls == before + 1
    assert torch.equal(x.grad, torch.full((5,), 3.0)) and torch.equal(b.grad, torch.ones(5))


def test_gradient_wanted_only_for_what_the_caller_needs(sum_ops) -> None:
    fwd, bwd = sum_ops
    op = fwd(alpha=3.0)
    x, b = torch.randn(5, requires_grad=True), torch.randn(5)
    before = bwd.calls
    op(x, b).backward()
    assert bwd.calls == before and torch.equal(x.grad, torch.full((5,), 3.0))
    with torch.no_grad():  # no node: nothing is wanted, nothing may be kept
        op(x, b)
    assert not op.gradient_wanted("x")
    with pytest.raises(RuntimeError, match=r"^ScaledSumOp: keep_gradient\('x'\) outside a "
                                           r"forward that op.gradient_wanted\('x'\) said wants it$"):
        op.keep_gradient("x", torch.ones(5), x)


def test_a_kept_gradient_must_be_like_its_input(sum_ops) -> None:
    fwd, _ = sum_ops
    op = fwd()
    op.keep = "unlike"
    with pytest.raises(ValueError, match=r"^ScaledSumOp: the kept gradient of 'x' must be like x "
                                         r"\(torch.float32\[5\] on cpu\), got "
                                         r"torch.float64\[3\] on cpu$"):
        op(torch.randn(5, requires_grad=True), torch.randn(5))


def test_a_composite_whose_delegates_run_elsewhere_is_served_whole_by_device() -> None:
    class CudaMul(Mul):
        devices = ("cuda",)

    class CudaScale(Op, specs=SPECS, entry="ScaleOp"):
        kernel_types = {Iface: (CudaMul,)}

    class Elsewhere(Op, specs=SPECS, entry="ScaleAddOp"):
        """Composes on CUDA, where its delegate's kernel runs; the reference serves it whole
        on the CPU."""

        delegate_types = {"scale": CudaScale}

        def forward(self, call, x, b, y):
            raise AssertionError("composed on a device its delegates' kernels do not run on")

        def reference(self, call, x, b):
            return (self.alpha * x + b,)

    op = Elsewhere(alpha=3.0)
    assert torch.equal(op(torch.ones(2), torch.ones(2)), torch.full((2,), 4.0))
    assert op.serving_target == REFERENCE and op.last_call.stages == ()
    assert op._delegates == {}


def test_a_delegate_key_holds_an_adt_param() -> None:
    from tileops.runtime.composite import _freeze
    from tileops.spec import AdtValue

    masked = _freeze(AdtValue("masked", {"max_m": 64}))
    hash(masked)
    assert masked == _freeze(AdtValue("masked", {"max_m": 64}))
    assert masked != _freeze(AdtValue("masked", {"max_m": 128}))
    assert masked != _freeze(AdtValue("contiguous", {"max_m": 64}))
    nested = _freeze({"layout": AdtValue("contiguous", {"packing": True, "alignment": [8]})})
    hash(nested)
