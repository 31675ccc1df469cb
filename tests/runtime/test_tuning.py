"""Tuning: ``request_tune()`` marks the instance and reaches the entries already built (in-tree
entries; target kernels once on each device they live on); entries built later start in
tuning mode; a target kernel that cannot tune is warned about once per instance."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from tileops.runtime import CallSpec, Kernel, KernelInterface, Op, SpecSet, register_builder

SPECS = SpecSet.load(Path(__file__).parent / "specs" / "ops.yaml")


class RowSpec(CallSpec, frozen=True):
    n: int


class Iface(KernelInterface):
    slot = "k"
    call_spec = RowSpec


class Tunable(Kernel, Iface):
    devices = ("cpu", "meta")
    general = True

    def __init__(self, spec):
        super().__init__(spec)
        self.tune_requests = 0

    def request_tune(self):
        self.tune_requests += 1

    def __call__(self, x, y):
        y.copy_(x)


class Plain(Kernel, Iface):
    devices = ("cpu",)
    general = True

    def __call__(self, x, y):
        y.copy_(x)


class ScaleOp(Op, specs=SPECS):
    kernel_types = {Iface: (Tunable,)}

    def forward(self, call, x, bias, y):
        self.kernel(Iface, RowSpec(call.device, x.shape[-1]))(x, y)


class ScaleAddOp(Op, specs=SPECS):
    delegate_types = {"scale": ScaleOp}

    def forward(self, call, x, b, y):
        with self.stage("scale"):
            y.copy_(self.delegate_for("scale", alpha=1.0)(x))


def test_request_tune_reaches_built_entries_once_and_later_ones_start_tuning() -> None:
    op = ScaleOp()
    op(torch.ones(4))
    op(torch.ones(8))
    first = list(op.iter_kernels())
    assert [k.tune_requests for k in first] == [0, 0]
    op.request_tune()
    assert op._tune_requested is True
    assert [k.tune_requests for k in first] == [1, 1]
    op(torch.ones(16))
    op(torch.ones(16))
    later = [k for k in op.iter_kernels() if k not in first]
    assert [k.tune_requests for k in later] == [1]


def test_tune_at_construction() -> None:
    op = ScaleOp(tune=True)
    op(torch.ones(4))
    (entry,) = op.iter_kernels()
    assert entry.tune_requests == 1


def test_entries_that_cannot_tune_are_skipped() -> None:
    op = ScaleOp(kernel_map={"k": Plain}, tune=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op(torch.ones(4))
        op.request_tune()


class TargetKernel:
    def __init__(self, device) -> None:
        self.device = device
        self.tune_requests = 0

    def request_tune(self):
        self.tune_requests += 1

    def __call__(self, x, bias, y):
        y.copy_(x)


def test_target_kernels_are_asked_once_on_each_device(new_target) -> None:
    name = new_target()
    per_device: dict = {}

    def build(op, call):  # one kernel object serves every shape on a device
        return per_device.setdefault(call.device, TargetKernel(call.device))

    register_builder(name, ScaleOp, build)
    op = ScaleOp(target=name)
    for n in (2, 3, 4):
        op(torch.ones(n))
    op(torch.ones(2, device="meta"))
    assert len(op._target_kernels) == 4 and len(per_device) == 2
    op.request_tune()
    assert {d.type: k.tune_requests for d, k in per_device.items()} == {"cpu": 1, "meta": 1}


def test_one_target_kernel_on_two_devices_is_asked_on_each(new_target) -> None:
    name = new_target()
    shared = TargetKernel(None)
    register_builder(name, ScaleOp, lambda op, call: shared)
    op = ScaleOp(target=name)
    op(torch.ones(2))
    op(torch.ones(3))
    op(torch.ones(2, device="meta"))
    op.request_tune()
    assert shared.tune_requests == 2


def test_target_kernels_built_after_the_request_start_tuning(new_target) -> None:
    name = new_target()
    built: list = []

    def build(op, call):
        built.append(TargetKernel(call.device))
        return built[-1]

    register_builder(name, ScaleOp, build)
    op = ScaleOp(target=name, tune=True)
    op(torch.ones(2))
    op(torch.ones(2))
    assert [k.tune_requests for k in built] == [1]


def test_a_target_kernel_that_cannot_tune_is_warned_about_once_per_instance(new_target) -> None:
    name = new_target()
    register_builder(name, ScaleOp, lambda op, call: lambda x, bias, y: y.copy_(x))
    a = ScaleOp(target=name)
    a(torch.ones(2))
    with pytest.warns(RuntimeWarning, match="target's kernel cannot tune") as caught:
        a.request_tune()
        a(torch.ones(3))  # built in tuning mode: no second warning
        a.request_tune()
    assert len(caught) == 1
    assert a._tune_warned is True
    b = ScaleOp(target=name, tune=True)
    with pytest.warns(RuntimeWarning) as caught:
        b(torch.ones(2))
        b(torch.ones(5))
    assert len(caught) == 1


def test_request_tune_reaches_the_delegates() -> None:
    op = ScaleAddOp()
    op(torch.ones(4), torch.ones(4))
    child = op.delegate_for("scale", alpha=1.0)
    (entry,) = child.iter_kernels()
    op.request_tune()
    assert child._tune_requested is True and entry.tune_requests == 1
    assert op.delegate_for("scale", alpha=3.0)._tune_requested is True
