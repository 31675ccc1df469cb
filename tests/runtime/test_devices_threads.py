"""Several devices and several threads. The two devices are torch's "cpu" and "meta" (meta
tensors have a shape, dtype and device, and the kernels here run on them)."""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path

import pytest
import torch

from tileops.runtime import CallSpec, Kernel, KernelInterface, Op, SpecSet, register_builder

SPECS = SpecSet.load(Path(__file__).parent / "specs" / "ops.yaml")
CPU, META = torch.device("cpu"), torch.device("meta")


class RowSpec(CallSpec, frozen=True):
    n: int


class Iface(KernelInterface):
    slot = "k"
    call_spec = RowSpec


class Slow(Kernel, Iface):
    """Builds slowly (a window for races) and counts its builds per spec."""

    devices = ("cpu", "meta")
    general = True
    builds: collections.Counter = collections.Counter()
    lock = threading.Lock()

    @classmethod
    def entry_for(cls, spec, op):
        time.sleep(0.002)
        with cls.lock:
            cls.builds[spec] += 1
        return cls(spec)

    def __call__(self, x, y):
        assert x.device == self.spec.device and x.shape[-1] == self.spec.n
        y.copy_(x)


class ScaleOp(Op, specs=SPECS):
    kernel_types = {Iface: (Slow,)}

    def forward(self, call, x, bias, y):
        self.kernel(Iface, RowSpec(call.device, x.shape[-1]))(x, y)


class AddOp(Op, specs=SPECS):
    kernel_types = {Iface: (Slow,)}

    def forward(self, call, a, b, out):
        torch.add(a, b, out=out)


class ScaleAddOp(Op, specs=SPECS):
    delegate_types = {"scale": ScaleOp, "add": AddOp}

    def __init__(self, **kw):
        super().__init__(**kw)
        self.records: list = []
        self.records_lock = threading.Lock()

    def forward(self, call, x, b, y):
        with self.records_lock:
            self.records.append(call)
        with self.stage("scale"):
            t = self.delegate_for("scale", alpha=1.0)(x)
        time.sleep(0.0005)  # let other threads' stages interleave
        with self.stage("add"):
            self.delegate_for("add")(t, b, out=y)


@pytest.fixture(autouse=True)
def _reset_counts():
    Slow.builds.clear()


def run_threads(n: int, work) -> list[BaseException]:
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            barrier.wait()
            work(i)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return errors


# --- two devices ----------------------------------------------------------------------------------


def test_one_instance_keeps_separate_entries_per_device() -> None:
    op = ScaleOp()
    for _ in range(2):
        assert op(torch.ones(2, 4)).device == CPU
        assert op(torch.ones(2, 4, device="meta")).device == META
    assert Slow.builds == {RowSpec(CPU, 4): 1, RowSpec(META, 4): 1}
    entries = op.built_entries[Iface]
    assert set(entries) == {(Slow, RowSpec(CPU, 4)), (Slow, RowSpec(META, 4))}
    assert {e.spec.device for e in entries.values()} == {CPU, META}
    assert op.last_call.device == META


def test_target_kernels_are_separate_per_device(new_target) -> None:
    name = new_target()
    register_builder(name, ScaleOp,
                     lambda op, call: (lambda x, bias, y, d=call.device: y.copy_(x)))
    op = ScaleOp(target=name)
    op(torch.ones(3))
    op(torch.ones(3, device="meta"))
    op(torch.ones(3))
    assert [k[0] for k in op._target_kernels] == [CPU, META]


def test_composite_on_two_devices() -> None:
    op = ScaleAddOp()
    op(torch.ones(2), torch.ones(2))
    op(torch.ones(2, device="meta"), torch.ones(2, device="meta"))
    assert op.last_call.device == META
    assert all(c.device == META for s in op.last_call.stages for c in s.calls)


# --- threads ----------------------------------------------------------------------------------------


def test_threads_on_a_fresh_instance_build_each_entry_once() -> None:
    op = ScaleOp()
    sizes = [1, 2, 3, 4]

    def work(i: int) -> None:
        for k in range(12):
            n = sizes[(i + k) % len(sizes)]
            device = "meta" if (i + k) % 3 == 0 else "cpu"
            y = op(torch.ones(2, n, device=device))
            assert y.shape == (2, n) and y.device.type == device

    assert run_threads(8, work) == []
    assert op.serving_target == "tileops"
    assert all(count == 1 for count in Slow.builds.values()), Slow.builds
    assert len(Slow.builds) == 8
    assert len(op._entries_by_call) == 8
    assert len(op.built_entries[Iface]) == 8
    assert set(op._entries_by_call.values()) == set(op.built_entries[Iface].values())


def test_threads_build_each_target_kernel_once(new_target) -> None:
    name = new_target()
    builds: collections.Counter = collections.Counter()
    bind_lock = threading.Lock()

    def build(op, call):
        time.sleep(0.002)
        with bind_lock:
            builds[(call.device, call.input_shapes)] += 1
        return lambda x, bias, y: y.copy_(x)

    register_builder(name, ScaleOp, build)
    op = ScaleOp(target=name)

    def work(i: int) -> None:
        for k in range(10):
            op(torch.ones(1 + (i + k) % 3, device="meta" if k % 2 else "cpu"))

    assert run_threads(8, work) == []
    assert len(builds) == 6 and all(v == 1 for v in builds.values())
    assert len(op._target_kernels) == 6


def test_threads_calling_a_composite_keep_their_stages_apart() -> None:
    op = ScaleAddOp()

    def work(i: int) -> None:
        n = i + 1
        for _ in range(5):
            x = torch.ones(n)
            assert torch.equal(op(x, x), torch.full((n,), 2.0))

    assert run_threads(6, work) == []
    assert len(op.records) == 30
    for call in op.records:
        (n,) = call.input_shapes[0]
        assert [s.name for s in call.stages] == ["scale", "add"]
        for stage in call.stages:
            (sub,) = stage.calls
            assert tuple(sub.input_shapes[0]) == (n,)
    assert len(op._delegates) == 2


def test_a_failing_first_call_in_one_thread_does_not_break_the_others(new_target) -> None:
    """Thread A's first call binds the target and fails; thread B already read that binding.
    B's call is still served, and nothing built for the reset binding stays cached."""
    name = new_target()
    a_built = threading.Event()
    b_read = threading.Event()

    def build(op, call):
        if call.input_shapes[0] == (1,):  # thread A: fail after B has seen the binding
            a_built.set()
            b_read.wait(5)
            raise RuntimeError("A fails")
        return lambda x, bias, y: y.copy_(x)

    register_builder(name, ScaleOp, build)
    op = ScaleOp(target=name)
    errors: dict = {}

    def a() -> None:
        try:
            op(torch.ones(1))
        except RuntimeError as exc:
            errors["a"] = exc

    def b() -> None:
        a_built.wait(5)
        # B's call reads the binding A made, then lets A fail and waits for A's reset
        original = op._build_target_kernel

        def after_reset(key, call, builder):
            b_read.set()
            deadline = time.monotonic() + 5
            while op._serving_target is not None and time.monotonic() < deadline:
                time.sleep(0.001)
            return original(key, call, builder)

        op._build_target_kernel = after_reset
        try:
            errors["b_result"] = op(torch.ones(2))
        finally:
            del op._build_target_kernel

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start()
    tb.start()
    ta.join(10)
    tb.join(10)
    assert str(errors["a"]) == "A fails"
    assert torch.equal(errors["b_result"], torch.ones(2))
    assert op._target_kernels == {}  # B's kernel was built for the reset binding
    assert op.serving_target is None
    op(torch.ones(2))
    assert op.serving_target == name


class TunableSlow(Slow):
    def __init__(self, spec):
        super().__init__(spec)
        self.tune_requests = 0

    def request_tune(self):
        time.sleep(0.002)  # other threads build meanwhile
        self.tune_requests += 1


def test_request_tune_while_threads_build_reaches_every_entry_once() -> None:
    op = ScaleOp(kernel_map={"k": TunableSlow})

    def work(i: int) -> None:
        if i == 0:
            while len(op._entries_by_call) < 3:
                time.sleep(0.001)
            op.request_tune()
            list(op.iter_kernels())
            return
        for n in range(1, 6):
            op(torch.ones(n + 5 * i))

    assert run_threads(5, work) == []
    entries = list(op.iter_kernels())
    assert len(entries) == 20
    assert [e.tune_requests for e in entries] == [1] * 20
