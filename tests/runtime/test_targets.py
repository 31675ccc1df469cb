"""Targets: builders per (target, op class), which target serves an instance (explicit, process
default, by device), ``serving_target``, and the cache of target kernels."""

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
    TargetError,
    register_builder,
    register_target,
    set_default_target,
    targets,
)

SPECS = SpecSet.load(Path(__file__).parent / "specs" / "ops.yaml")


class Iface(KernelInterface):
    slot = "scale"
    call_spec = CallSpec


class CpuKernel(Kernel, Iface):
    devices = ("cpu",)
    general = True

    def __call__(self, x, y, alpha):
        torch.mul(x, alpha, out=y)


class ScaleOp(Op, specs=SPECS):
    """In-tree kernels on cpu only."""

    kernel_types = {Iface: (CpuKernel,)}

    def forward(self, call, x, bias, y):
        self.kernel(Iface, CallSpec(call.device))(x, y, self.alpha)


class PlainScaleOp(Op, specs=SPECS, entry="ScaleOp"):
    """No in-tree kernels: only targets serve it."""


class Recorder:
    """A builder that records what it was asked for; its kernels compute alpha * x + bias."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag
        self.calls: list = []

    def __call__(self, op, call):
        params = {n: getattr(op, n) for n in type(op)._param_names}
        self.calls.append((op, call, params))

        def kernel(x, bias, y):
            y.copy_(x * params["alpha"] if bias is None else x * params["alpha"] + bias)

        kernel.tag = self.tag
        return kernel


# --- the registry ----------------------------------------------------------------------------------


def test_registering_targets_and_builders() -> None:
    with pytest.raises(ValueError, match="non-empty string"):
        register_target("")
    with pytest.raises(ValueError, match="names the in-tree kernels"):
        register_target(IN_TREE)
    with pytest.raises(TargetError, match="unknown target 'nope'"):
        register_builder("nope", ScaleOp, Recorder())
    with pytest.raises(TypeError, match="builder must be callable"):
        register_builder(REFERENCE, ScaleOp, 42)
    with pytest.raises(TargetError, match="unknown target"):
        set_default_target("nope")
    assert REFERENCE in targets.targets()
    assert targets.target_devices(REFERENCE) is None


def test_builders_are_found_through_the_class_hierarchy(new_target) -> None:
    name = new_target()
    b = Recorder()
    register_builder(name, Op, b)
    assert targets.builder_for(name, PlainScaleOp) is b
    own = Recorder()
    register_builder(name, PlainScaleOp, own)
    assert targets.builder_for(name, PlainScaleOp) is own
    assert targets.builder_for(name, ScaleOp) is b


# --- which target serves -------------------------------------------------------------------------


def test_by_device_in_tree_where_a_kernel_runs(new_target) -> None:
    register_builder(REFERENCE, ScaleOp, Recorder())
    op = ScaleOp()
    op(torch.ones(2))
    assert op.serving_target == IN_TREE
    assert op._target_builder is None


def test_by_device_a_target_where_no_in_tree_kernel_runs() -> None:
    ref = Recorder("ref")
    register_builder(REFERENCE, ScaleOp, ref)
    op = ScaleOp()
    y = op(torch.ones(2, device="meta"))
    assert y.device.type == "meta"
    assert op.serving_target == REFERENCE
    assert op._target_builder is ref


def test_by_device_the_first_registered_target_that_runs_there(new_target) -> None:
    cpu_only, anywhere = new_target(("cpu",)), new_target(None)
    register_builder(cpu_only, PlainScaleOp, Recorder(cpu_only))
    register_builder(anywhere, PlainScaleOp, Recorder(anywhere))
    on_cpu, on_meta = PlainScaleOp(), PlainScaleOp()
    on_cpu(torch.ones(1))
    on_meta(torch.ones(1, device="meta"))
    assert on_cpu.serving_target == cpu_only
    assert on_meta.serving_target == anywhere


def test_nothing_serves_the_device(state) -> None:
    op = PlainScaleOp()
    before = state.snapshot(op)
    with pytest.raises(TargetError, match="nothing serves device meta"):
        op(torch.ones(1, device="meta"))
    state.assert_failed_and_reset(op, before)


def test_explicit_beats_process_default_beats_env_beats_device(
        new_target, monkeypatch: pytest.MonkeyPatch) -> None:
    explicit, default, from_env = new_target(), new_target(), new_target()
    for name in (explicit, default, from_env):
        register_builder(name, ScaleOp, Recorder(name))
    x = torch.ones(2)

    monkeypatch.setenv("TILEOPS_TARGET", from_env)
    op = ScaleOp()
    op(x)
    assert op.serving_target == from_env

    set_default_target(default)
    op = ScaleOp()
    op(x)
    assert op.serving_target == default

    op = ScaleOp(target=explicit)
    op(x)
    assert op.serving_target == explicit

    op = ScaleOp(target=IN_TREE)
    op(x)
    assert op.serving_target == IN_TREE

    set_default_target(None)  # cleared: overrides the env too, choose by device
    op = ScaleOp()
    op(x)
    assert op.serving_target == IN_TREE


def test_process_default_naming_the_in_tree_kernels() -> None:
    set_default_target(IN_TREE)
    op = ScaleOp()
    op(torch.ones(1))
    assert op.serving_target == IN_TREE


def test_target_bound_once_per_instance(new_target) -> None:
    name = new_target()
    register_builder(name, ScaleOp, Recorder())
    op = ScaleOp()
    op(torch.ones(1))
    set_default_target(name)  # a later default does not rebind an instance
    op(torch.ones(1))
    assert op.serving_target == IN_TREE
    assert ScaleOp()._serving_target is None


def test_unknown_target_from_the_env(state, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TILEOPS_TARGET", "nowhere")
    op = ScaleOp()
    before = state.snapshot(op)
    with pytest.raises(TargetError, match="unknown target 'nowhere'"):
        op(torch.ones(1))
    state.assert_failed_and_reset(op, before)
    monkeypatch.delenv("TILEOPS_TARGET")
    op(torch.ones(1))
    assert op.serving_target == IN_TREE


def test_target_without_a_builder_for_the_op(state, new_target) -> None:
    op = ScaleOp(target=new_target())
    before = state.snapshot(op)
    with pytest.raises(TargetError, match="has no builder for ScaleOp"):
        op(torch.ones(1))
    state.assert_failed_and_reset(op, before)


@pytest.mark.parametrize("returned", [None, 3, "kernel"])
def test_a_builder_that_returns_no_kernel_is_refused_at_once(state, new_target,
                                                            returned) -> None:
    name = new_target()

    def broken(op, call):
        return returned

    register_builder(name, PlainScaleOp, broken)
    op = PlainScaleOp(target=name)
    before = state.snapshot(op)
    with pytest.raises(TargetError) as info:
        op(torch.ones(1))
    assert str(info.value) == (
        f"PlainScaleOp: the {name!r} target's builder "
        f"'test_a_builder_that_returns_no_kernel_is_refused_at_once.<locals>.broken' returned "
        f"{returned!r}, not a kernel (a callable taking the inputs, then the outputs to write)")
    state.assert_failed_and_reset(op, before)
    register_builder(name, PlainScaleOp, Recorder())  # fixed: the op is usable again
    assert torch.equal(op(torch.ones(1)), torch.ones(1) * 2.0)


def test_in_tree_asked_of_an_op_without_kernels(state) -> None:
    op = PlainScaleOp(target=IN_TREE)
    before = state.snapshot(op)
    with pytest.raises(TargetError, match="has no in-tree kernels"):
        op(torch.ones(1))
    state.assert_failed_and_reset(op, before)


def test_a_target_refuses_a_device_it_does_not_run_on(state, new_target) -> None:
    name = new_target(("cpu",))
    b = Recorder()
    register_builder(name, PlainScaleOp, b)
    op = PlainScaleOp(target=name)
    before = state.snapshot(op)
    with pytest.raises(TargetError, match="runs on cpu, not meta"):
        op(torch.ones(1, device="meta"))
    state.assert_failed_and_reset(op, before)
    assert b.calls == []
    op(torch.ones(1))
    before = state.snapshot(op)
    with pytest.raises(TargetError, match="runs on cpu, not meta"):
        op(torch.ones(1, device="meta"))
    state.assert_failed_and_kept(op, before)


# --- the builder and its kernels ---------------------------------------------------------------


def test_builder_gets_the_op_and_the_call(new_target) -> None:
    name = new_target()
    b = Recorder()
    register_builder(name, PlainScaleOp, b)
    op = PlainScaleOp(alpha=3.0, target=name)
    y = op(torch.ones(2, 2), torch.ones(2))
    assert torch.equal(y, torch.full((2, 2), 4.0))
    (seen_op, call, params), = b.calls
    assert seen_op is op
    assert call is op.last_call
    assert params == {"alpha": 3.0}


def test_target_kernels_are_keyed_by_device_dtypes_shapes_and_presence(new_target) -> None:
    name = new_target()
    b = Recorder()
    register_builder(name, PlainScaleOp, b)
    op = PlainScaleOp(target=name)
    calls = [
        (torch.ones(2, 3),),
        (torch.ones(2, 3),),                      # hit
        (torch.ones(4, 3),),                      # another shape
        (torch.ones(2, 3, dtype=torch.float16),),  # another dtype
        (torch.ones(2, 3), torch.ones(3)),        # the optional input present
        (torch.ones(2, 3), torch.ones(3)),        # hit
        (torch.ones(2, 3, device="meta"),),       # another device
    ]
    for args in calls:
        op(*args)
    assert len(b.calls) == 5
    keys = list(op._target_kernels)
    assert len(keys) == 5
    cpu, meta = torch.device("cpu"), torch.device("meta")
    f32, f16 = torch.float32, torch.float16
    assert keys == [
        (cpu, (f32, None), ((2, 3), None)),
        (cpu, (f32, None), ((4, 3), None)),
        (cpu, (f16, None), ((2, 3), None)),
        (cpu, (f32, f32), ((2, 3), (3,))),
        (meta, (f32, None), ((2, 3), None)),
    ]
    assert list(op.iter_kernels()) == list(op._target_kernels.values())


def test_reference_target_serves_any_device() -> None:
    ref = Recorder("ref")
    register_builder(REFERENCE, PlainScaleOp, ref)
    op = PlainScaleOp(alpha=2.0)
    assert torch.equal(op(torch.ones(2)), torch.full((2,), 2.0))
    assert op(torch.ones(2, device="meta")).device.type == "meta"
    assert op.serving_target == REFERENCE
    assert {k[0].type for k in op._target_kernels} == {"cpu", "meta"}


def test_target_and_in_tree_give_the_same_record(new_target) -> None:
    name = new_target()
    register_builder(name, ScaleOp, Recorder())
    a, b = ScaleOp(alpha=3.0), ScaleOp(alpha=3.0, target=name)
    x = torch.randn(3, 4)
    assert torch.equal(a(x), b(x))
    assert a.last_call.indices == b.last_call.indices
    assert a.last_call.tensors == b.last_call.tensors
    assert a.eval_roofline() == b.eval_roofline()
