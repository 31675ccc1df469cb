"""Fault injection: a builder that raises, a kernel that raises on its first or n-th call, a
refusal from every implementation. After each fault: a failing call that bound the target
resets every binding field to its initial value (table 3); one that did not keeps the binding;
either way the run group is kept, the construction group is unchanged and ``last_call`` still
shows the previous success. The next call after a reset chooses again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tileops.runtime import (
    IN_TREE,
    CallSpec,
    Kernel,
    KernelInterface,
    NoKernelError,
    Op,
    SpecSet,
    register_builder,
    set_default_target,
    targets,
)

SPECS = SpecSet.load(Path(__file__).parent / "specs" / "ops.yaml")


class Boom(RuntimeError):
    pass


class Plan:
    """Which builds and which kernel runs fail, counted from 1 over the test."""

    def __init__(self, fail_builds=(), fail_runs=()) -> None:
        self.fail_builds, self.fail_runs = set(fail_builds), set(fail_runs)
        self.builds = self.runs = 0

    def build(self) -> None:
        self.builds += 1
        if self.builds in self.fail_builds:
            raise Boom(f"build {self.builds} fails")

    def run(self) -> None:
        self.runs += 1
        if self.runs in self.fail_runs:
            raise Boom(f"run {self.runs} fails")


# --- an op served by a target ----------------------------------------------------------------


class TargetOp(Op, specs=SPECS, entry="ScaleOp"):
    construction_tensors = {"table": "T"}

    def __init__(self, **kw):
        super().__init__(**kw)
        self.table = torch.zeros(1, dtype=torch.float64)


def builder_for(plan: Plan):
    def build(op, call):
        plan.build()

        def kernel(x, bias, y):
            plan.run()
            y.copy_(x)

        return kernel

    return build


@pytest.fixture
def target_op(new_target):
    def make(plan: Plan) -> TargetOp:
        name = new_target()
        register_builder(name, TargetOp, builder_for(plan))
        return TargetOp(target=name)

    return make


def test_builder_raises_on_the_first_call(state, target_op) -> None:
    plan = Plan(fail_builds={1})
    op = target_op(plan)
    before = state.snapshot(op)
    with pytest.raises(Boom, match="build 1"):
        op(torch.ones(2, dtype=torch.float16))
    state.assert_failed_and_reset(op, before)
    # the run group kept what this call wrote: the branch recipe and the converted table
    assert len(op._effect_branches) == 1
    assert op.table.dtype == torch.float16
    # the next call chooses again and builds again
    op(torch.ones(2))
    assert plan.builds == 2 and op.serving_target == op.target
    assert len(op._target_kernels) == 1


def test_builder_raises_on_a_later_call(state, target_op) -> None:
    plan = Plan(fail_builds={2})
    op = target_op(plan)
    op(torch.ones(2))
    first = op.last_call
    before = state.snapshot(op)
    with pytest.raises(Boom, match="build 2"):
        op(torch.ones(3))
    state.assert_failed_and_kept(op, before)
    assert op.last_call is first
    assert len(op._target_kernels) == 1  # the failed key is not cached
    op(torch.ones(3))
    assert plan.builds == 3 and len(op._target_kernels) == 2


def test_target_kernel_raises_on_its_first_call(state, target_op) -> None:
    plan = Plan(fail_runs={1})
    op = target_op(plan)
    before = state.snapshot(op)
    with pytest.raises(Boom, match="run 1"):
        op(torch.ones(2))
    state.assert_failed_and_reset(op, before)
    op(torch.ones(2))
    assert plan.builds == 2  # the kernel of the failed binding was dropped, not reused


@pytest.mark.parametrize("n", [2, 3])
def test_target_kernel_raises_on_its_nth_call(state, target_op, n: int) -> None:
    plan = Plan(fail_runs={n})
    op = target_op(plan)
    for _ in range(n - 1):
        op(torch.ones(2))
    before = state.snapshot(op)
    with pytest.raises(Boom, match=f"run {n}"):
        op(torch.ones(2))
    state.assert_failed_and_kept(op, before)
    assert op._target_kernels == before.binding["_target_kernels"][1]
    op(torch.ones(2))
    assert plan.builds == 1


def test_an_interrupt_is_a_failure_too(state, new_target) -> None:
    name = new_target()

    def interrupted(x, bias, y):
        raise KeyboardInterrupt

    register_builder(name, TargetOp, lambda op, call: interrupted)
    op = TargetOp(target=name)
    before = state.snapshot(op)
    with pytest.raises(KeyboardInterrupt):
        op(torch.ones(1))
    state.assert_failed_and_reset(op, before)


# --- an op with in-tree kernels ---------------------------------------------------------------------


class RowSpec(CallSpec, frozen=True):
    n: int


class RowIface(KernelInterface):
    slot = "rows"
    call_spec = RowSpec


class Flaky(Kernel, RowIface):
    """Serves rows of at most 16; its builds and runs follow the class's plan."""

    devices = ("cpu", "meta")
    plan = Plan()

    @classmethod
    def region_refusal(cls, spec):
        return None if spec.n <= 16 else f"n = {spec.n} > 16"

    @classmethod
    def entry_for(cls, spec, op):
        cls.plan.build()
        return cls(spec)

    def __call__(self, x, y):
        type(self).plan.run()
        y.copy_(x)


class FlakyHalf(Flaky):
    """Serves even row lengths only."""

    @classmethod
    def region_refusal(cls, spec):
        return None if spec.n % 2 == 0 else f"n = {spec.n} is odd"


class InTreeOp(Op, specs=SPECS, entry="ScaleOp"):
    kernel_types = {RowIface: (Flaky,)}

    def forward(self, call, x, bias, y):
        self.kernel(RowIface, RowSpec(call.device, x.shape[-1]))(x, y)


@pytest.fixture
def plan():
    def set_plan(**kw) -> Plan:
        Flaky.plan = FlakyHalf.plan = Plan(**kw)
        return Flaky.plan

    yield set_plan
    Flaky.plan = FlakyHalf.plan = Plan()


def test_entry_build_raises_on_the_first_call(state, plan) -> None:
    p = plan(fail_builds={1})
    op = InTreeOp()
    before = state.snapshot(op)
    with pytest.raises(Boom, match="build 1"):
        op(torch.ones(4))
    state.assert_failed_and_reset(op, before)
    op(torch.ones(4))
    assert p.builds == 2 and op.serving_target == IN_TREE


def test_in_tree_kernel_raises_on_its_first_call(state, plan) -> None:
    p = plan(fail_runs={1})
    op = InTreeOp()
    before = state.snapshot(op)
    with pytest.raises(Boom, match="run 1"):
        op(torch.ones(4))
    state.assert_failed_and_reset(op, before)
    op(torch.ones(4))
    assert p.builds == 2  # the entry built under the reset binding is gone


def test_in_tree_kernel_raises_on_its_nth_call(state, plan) -> None:
    p = plan(fail_runs={3})
    op = InTreeOp()
    op(torch.ones(4))
    op(torch.ones(8))
    good = op.last_call
    before = state.snapshot(op)
    with pytest.raises(Boom, match="run 3"):
        op(torch.ones(4))
    state.assert_failed_and_kept(op, before)
    assert op.last_call is good
    assert op._entries_by_call == before.binding["_entries_by_call"][1]
    op(torch.ones(4))
    assert p.builds == 2


def test_every_implementation_refuses_the_first_call(state, plan) -> None:
    plan()
    op = InTreeOp(kernel_map={"rows": (Flaky, FlakyHalf)})
    before = state.snapshot(op)
    with pytest.raises(NoKernelError) as info:
        op(torch.ones(17))
    assert str(info.value).startswith("InTreeOp: rows: no implementation serves")  # the op's
    assert "Flaky: n = 17 > 16" in str(info.value)
    assert "FlakyHalf: n = 17 is odd" in str(info.value)
    # what serves the call instead, where the op has a reference
    hint = "InTreeOp runs it on the reference target: construct the op with target='reference'"
    has_reference = targets.builder_for(targets.REFERENCE, InTreeOp) is not None
    assert str(info.value).endswith(hint) == has_reference
    state.assert_failed_and_reset(op, before)
    with pytest.raises(NoKernelError):  # the same call again: the same answer
        op(torch.ones(17))
    state.assert_failed_and_reset(op, before)


def test_every_implementation_refuses_a_later_call(state, plan) -> None:
    p = plan()
    op = InTreeOp()
    op(torch.ones(3))
    before = state.snapshot(op)
    with pytest.raises(NoKernelError, match="Flaky: n = 32 > 16"):
        op(torch.ones(32))
    state.assert_failed_and_kept(op, before)
    assert p.builds == 1


def test_a_reset_lets_the_next_call_choose_another_target(state, plan, new_target) -> None:
    p = plan(fail_runs={1})
    other = new_target()
    register_builder(other, InTreeOp, lambda op, call: lambda x, bias, y: y.copy_(x + 1))
    set_default_target(IN_TREE)
    op = InTreeOp()
    before = state.snapshot(op)
    with pytest.raises(Boom):
        op(torch.ones(2))
    state.assert_failed_and_reset(op, before)
    set_default_target(other)
    assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0))
    assert op.serving_target == other
    assert op._entries_by_call == {} and op._built_entries == {}
    assert p.runs == 1


def test_failures_keep_the_tuning_mode(state, plan) -> None:
    plan(fail_runs={1})
    tuned: list = []

    class Tunable(Flaky):
        general = True

        def request_tune(self):
            tuned.append(self)

    op = InTreeOp(kernel_map={"rows": Tunable}, tune=True)
    before = state.snapshot(op)
    with pytest.raises(Boom):
        op(torch.ones(4))
    state.assert_failed_and_reset(op, before)
    assert op._tune_requested is True
    op(torch.ones(4))
    assert len(tuned) == 2  # the dropped entry and its rebuilt successor both started tuning
    assert tuned[1] in op._entries_by_call.values()
