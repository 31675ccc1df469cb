"""The reference document's tables, row by row (op-base-class-structure.zh.md):

- table 2: the three groups of instance state, when each is written and what a reset does;
- table 3: each binding field's content and initial value;
- table 4: what adding an op, a composite op, a target, a kernel implementation or a base
  class field takes, and what the base class guarantees.

The other test modules go deeper into each subject; this one is the index.
"""

from __future__ import annotations

import inspect
import re
import warnings
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
    StageError,
    register_builder,
)
from tileops.runtime.op import _UNRESOLVED
from tileops.signature import SignatureCallError

SPECS = SpecSet.load(Path(__file__).parent / "specs" / "ops.yaml")


class RowSpec(CallSpec, frozen=True):
    n: int
    dtype: torch.dtype


class RowIface(KernelInterface):
    slot = "rows"
    call_spec = RowSpec


class Rows(Kernel, RowIface):
    devices = ("cpu", "meta")
    general = True
    fail = False

    def request_tune(self) -> None:
        self.tuning = True

    def __call__(self, x, y, alpha):
        if Rows.fail:
            raise RuntimeError("kernel failed")
        torch.mul(x, alpha, out=y)


class ScaleOp(Op, specs=SPECS):
    """Table 4 row 1/2: an entry, kernel_types, a constructor and forward."""

    kernel_types = {RowIface: (Rows,)}
    construction_tensors = {"table": "T"}

    def __init__(self, *, alpha: float = 2.0, **kw):
        super().__init__(alpha=alpha, **kw)
        self.table = torch.zeros(2, dtype=torch.float64)

    def forward(self, call, x, bias, y):
        spec = RowSpec(call.device, x.shape[-1], x.dtype)
        self.kernel(RowIface, spec)(x, y, self.alpha)


class AddOp(Op, specs=SPECS):
    kernel_types = {RowIface: (Rows,)}

    def forward(self, call, a, b, out):
        torch.add(a, b, out=out)


class ScaleAddOp(Op, specs=SPECS):
    """Table 4 row 3: delegate_types, each delegate through delegate_for."""

    delegate_types = {"scale": ScaleOp, "add": AddOp}

    def forward(self, call, x, b, y):
        with self.stage("scale"):
            t = self.delegate_for("scale", alpha=self.alpha)(x)
        with self.stage("add"):
            self.delegate_for("add")(t, b, out=y)


@pytest.fixture(autouse=True)
def _kernels_succeed():
    yield
    Rows.fail = False


def exercised(op: ScaleOp, target: str | None = None) -> None:
    """Drive ``op`` through every kind of write the run group and the binding group see."""
    op(torch.ones(2, 3))
    op(torch.ones(2, 3, dtype=torch.float16), torch.ones(3, dtype=torch.float16))
    op(torch.ones(1, 3, device="meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        op.request_tune()
    with pytest.raises(SignatureCallError):
        op(torch.ones(2, 3, dtype=torch.int8))


# --- table 2 ---------------------------------------------------------------------------------------


def test_table2_row1_construction_group_is_written_once_and_kept(state) -> None:
    op = ScaleOp(alpha=3.0)
    before = state.snapshot(op)
    exercised(op)
    Rows.fail = True
    with pytest.raises(RuntimeError):
        op(torch.ones(5, 5))
    op._reset_binding()
    state.assert_construction_unchanged(op, before)
    assert op.alpha == 3.0 and op.target is None


def test_table2_row2_binding_group_is_written_by_a_call_and_reset(state) -> None:
    op = ScaleOp()
    state.assert_binding_initial(op)
    exercised(op)
    assert op._target_builder is None  # in-tree
    assert op._serving_target == IN_TREE
    assert op._entries_by_call and op._built_entries
    op._reset_binding()
    state.assert_binding_initial(op)


def test_table2_row3_run_group_is_written_after_construction_and_kept(state) -> None:
    op = ScaleOp()
    composite = ScaleAddOp()
    composite(torch.ones(3), torch.ones(3))
    exercised(op)
    written = {
        "_tune_requested": op._tune_requested,
        "_effect_branches": dict(op._effect_branches),
        "_last_call": op._last_call,
        "table": op.table,
    }
    assert written["_tune_requested"] is True
    assert len(written["_effect_branches"]) == 1
    assert written["table"].device.type == "meta"  # the construction-time tensor moved
    delegates = dict(composite._delegates)
    assert len(delegates) == 2
    op._reset_binding()
    composite._reset_binding()
    assert op._tune_requested is True
    assert op._effect_branches == written["_effect_branches"]
    assert op._last_call is written["_last_call"]
    assert op.table is written["table"]
    assert composite._delegates == delegates
    assert composite.last_call is not None and len(composite.last_call.stages) == 2


def test_table2_run_group_tune_warned_is_kept(new_target) -> None:
    name = new_target()
    register_builder(name, ScaleOp, lambda op, call: lambda x, bias, y: y.copy_(x))
    op = ScaleOp(target=name)
    op(torch.ones(2))
    with pytest.warns(RuntimeWarning):
        op.request_tune()
    op._reset_binding()
    assert op._tune_warned is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op(torch.ones(2))  # built in tuning mode after the reset: no second warning


# --- table 3 ---------------------------------------------------------------------------------------


def test_table3_row1_target_builder(new_target) -> None:
    assert ScaleOp._target_builder is _UNRESOLVED
    op = ScaleOp()
    assert op._target_builder is _UNRESOLVED
    op(torch.ones(2))
    assert op._target_builder is None  # None: the in-tree kernels
    name = new_target()

    def builder(o, c):
        return lambda x, bias, y: y.copy_(x)

    register_builder(name, ScaleOp, builder)
    op = ScaleOp(target=name)
    op(torch.ones(2))
    assert op._target_builder is builder


def test_table3_row2_serving_target(new_target) -> None:
    assert Op._serving_target is None
    op = ScaleOp()
    assert op.serving_target is None
    op(torch.ones(2))
    assert op.serving_target == op._serving_target == IN_TREE


def test_table3_row3_entries_by_call() -> None:
    op = ScaleOp()
    op(torch.ones(2))
    op(torch.ones(2))
    spec = RowSpec(torch.device("cpu"), 2, torch.float32)
    assert list(op._entries_by_call) == [(RowIface, spec)]
    assert op.kernel(RowIface, spec) is op._entries_by_call[(RowIface, spec)]


def test_table3_row4_built_entries() -> None:
    op = ScaleOp()
    op(torch.ones(2))
    spec = RowSpec(torch.device("cpu"), 2, torch.float32)
    entry = op._built_entries[RowIface][(Rows, spec)]
    assert op.built_entries == {RowIface: {(Rows, spec): entry}}
    assert op.built_entries is not op._built_entries  # a copy: callers cannot edit the cache


def test_table3_row5_target_kernels(new_target) -> None:
    name = new_target()
    register_builder(name, ScaleOp, lambda o, c: lambda x, bias, y: y.copy_(x))
    op = ScaleOp(target=name)
    assert op._target_kernels == {}
    op(torch.ones(2, 3))
    op(torch.ones(2, 3), torch.ones(3))
    cpu, f32 = torch.device("cpu"), torch.float32
    assert list(op._target_kernels) == [(cpu, (f32, None), ((2, 3), None)),
                                        (cpu, (f32, f32), ((2, 3), (3,)))]


# --- table 4 ---------------------------------------------------------------------------------------


def assert_base_handles_checks_records_and_failures(op: Op, make_args, state) -> None:
    """The guarantee of table 4 rows 1, 2 and 4."""
    before = state.snapshot(op)
    with pytest.raises(SignatureCallError):
        op(torch.ones(2, 3, dtype=torch.int32))
    state.assert_failed_and_reset(op, before)
    Rows.fail = True
    with pytest.raises(RuntimeError, match="kernel failed"):
        op(*make_args())
    state.assert_failed_and_reset(op, before)
    Rows.fail = False
    op(*make_args())
    assert op.serving_target is not None
    good = op.last_call
    assert good.indices["N"] == 3
    before = state.snapshot(op)
    Rows.fail = True
    with pytest.raises(RuntimeError, match="kernel failed"):
        op(*make_args())
    state.assert_failed_and_kept(op, before)
    assert op.last_call is good
    Rows.fail = False


def test_table4_row1_op_with_a_compile_boundary(state) -> None:
    op = ScaleOp()
    assert op._boundary is not None
    assert ScaleOp.compile_op_names
    assert_base_handles_checks_records_and_failures(op, lambda: (torch.ones(2, 3),), state)


def test_table4_row2_op_without_a_compile_boundary() -> None:
    specs = SpecSet.load(Path(__file__).parent / "specs" / "generator.yaml")

    class FillOp(Op, specs=specs):
        kernel_types = {RowIface: (Rows,)}

        def forward(self, call, y):
            y.fill_(self.value)

    op = FillOp(n=3, value=1.0)
    assert op._boundary is None
    assert torch.equal(op(), torch.ones(3))


def test_table4_row3_composite_op(state) -> None:
    op = ScaleAddOp()
    op(torch.ones(3), torch.ones(3))
    assert [s.name for s in op.last_call.stages] == ["scale", "add"]

    class Unstaged(Op, specs=SPECS, entry="ScaleAddOp"):
        delegate_types = {"add": AddOp}

        def forward(self, call, x, b, y):
            self.delegate_for("add")(x, b, out=y)

    with pytest.raises(StageError, match="outside any stage"):
        Unstaged()(torch.ones(3), torch.ones(3))


def test_table4_row4_target(state, new_target) -> None:
    name = new_target()

    def builder(op, call):
        def kernel(x, bias, y):
            if Rows.fail:
                raise RuntimeError("kernel failed")
            torch.mul(x, op.alpha, out=y)

        return kernel

    register_builder(name, ScaleOp, builder)
    op = ScaleOp(target=name)
    assert_base_handles_checks_records_and_failures(op, lambda: (torch.ones(2, 3),), state)
    assert op.serving_target == name
    in_tree = ScaleOp()
    x = torch.randn(4, 3)
    assert torch.equal(op(x), in_tree(x))
    assert op.last_call.tensors == in_tree.last_call.tensors


def test_table4_row5_kernel_implementation() -> None:
    """A new implementation: inherits Kernel and the interface, states its region, its entry
    and its preference; the op is not changed, entries are cached by (class, identity)."""
    built: list = []

    class Narrow(Kernel, RowIface):
        devices = ("cpu",)
        preferred_over = ()

        @classmethod
        def region_refusal(cls, spec):
            return None if spec.n <= 4 else f"n = {spec.n} > 4"

        @classmethod
        def identity(cls, spec):
            return spec.dtype

        @classmethod
        def entry_for(cls, spec, op):
            built.append(spec)
            return lambda x, y, alpha: torch.mul(x, -alpha, out=y)

    source = inspect.getsource(ScaleOp)
    op = ScaleOp(kernel_map={"rows": (Rows, Narrow)})
    assert torch.equal(op(torch.ones(3)), torch.full((3,), -2.0))   # Narrow's region
    assert torch.equal(op(torch.ones(9)), torch.full((9,), 2.0))    # the general one
    op(torch.ones(2))
    assert len(built) == 1  # n = 3 and n = 2 share Narrow's identity (the dtype)
    assert set(op.built_entries[RowIface]) == {
        (Narrow, torch.float32), (Rows, RowSpec(torch.device("cpu"), 9, torch.float32))}
    with pytest.raises(NoKernelError, match="Narrow: runs on cpu, not meta"):
        ScaleOp(kernel_map={"rows": Narrow}, target=IN_TREE)(torch.ones(3, device="meta"))
    assert inspect.getsource(ScaleOp) == source


def test_table4_row6_base_class_state_fields(state) -> None:
    # every field exists after construction (in __init__ or as a class attribute) ...
    for op in (ScaleOp(), ScaleAddOp()):
        state.assert_fields_present(op)
        for name in state.BINDING:
            assert name in vars(op) or name in vars(Op), name
    # ... and every binding field is on _reset_binding's list, so a reset leaves nothing
    source = inspect.getsource(Op._reset_binding)
    for name in state.BINDING:
        assert re.search(rf"self\.{name} = ", source), f"_reset_binding does not reset {name}"
    op = ScaleOp()
    exercised(op)
    op._reset_binding()
    state.assert_binding_initial(op)
