"""The seven steps of one call (ARCHITECTURE.md): the check, the effect branch and the outputs,
construction-time tensors, the target, the entry, the run and the record."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tileops.runtime import CallSpec, Kernel, KernelInterface, Op, SpecSet, register_builder
from tileops.signature import SignatureCallError

SPECS = SpecSet.load(Path(__file__).parent / "specs" / "ops.yaml")


class ScaleSpec(CallSpec, frozen=True):
    n: int
    dtype: torch.dtype


class ScaleIface(KernelInterface):
    slot = "scale"
    call_spec = ScaleSpec


class ScaleKernel(Kernel, ScaleIface):
    devices = ("cpu", "meta")
    general = True

    def __call__(self, x, bias, y, alpha):
        y.copy_(x * alpha if bias is None else x * alpha + bias)


class ScaleOp(Op, specs=SPECS):
    kernel_types = {ScaleIface: (ScaleKernel,)}

    def __init__(self, *, alpha: float = 2.0, **kw):
        super().__init__(alpha=alpha, **kw)
        self.seen: list = []

    def forward(self, call, x, bias, y):
        self.seen.append((call, x, bias, y))
        spec = ScaleSpec(call.device, x.shape[-1], x.dtype)
        self.kernel(ScaleIface, spec)(x, bias, y, self.alpha)


class TableScaleOp(Op, specs=SPECS, entry="ScaleOp"):
    """An op holding a construction-time tensor that follows the call's dtype T."""

    kernel_types = {ScaleIface: (ScaleKernel,)}
    construction_tensors = {"table": "T", "fixed": None, "unset": None}

    def __init__(self, **kw):
        super().__init__(**kw)
        self.table = torch.arange(4, dtype=torch.float64)
        self.fixed = torch.ones(2, dtype=torch.int64)
        self.unset = None

    def forward(self, call, x, bias, y):
        assert self.table.device == x.device and self.table.dtype == x.dtype
        self.kernel(ScaleIface, ScaleSpec(call.device, x.shape[-1], x.dtype))(x, bias, y, 1.0)


class AddIface(KernelInterface):
    slot = "add"
    call_spec = CallSpec


class AddKernel(Kernel, AddIface):
    devices = ("cpu", "meta")
    general = True

    def __call__(self, a, b, out):
        torch.add(a, b, out=out)


class AddOp(Op, specs=SPECS):
    kernel_types = {AddIface: (AddKernel,)}

    def forward(self, call, a, b, out):
        self.kernel(AddIface, CallSpec(call.device))(a, b, out)


class NegOp(Op, specs=SPECS):
    kernel_types = {AddIface: (AddKernel,)}

    def forward(self, call, x, y):
        torch.neg(x, out=y)


class RowStatsOp(Op, specs=SPECS):
    kernel_types = {AddIface: (AddKernel,)}

    def forward(self, call, x, mean, count):
        torch.mean(x, dim=1, out=mean)
        count.fill_(x.shape[1])


# --- step 1: the check ---------------------------------------------------------------------------


def test_a_failing_check_changes_nothing_on_the_first_call(state) -> None:
    op = ScaleOp()
    before = state.snapshot(op)
    with pytest.raises(SignatureCallError, match="T must be one of"):
        op(torch.ones(2, 3, dtype=torch.float64))
    with pytest.raises(SignatureCallError, match="bias"):
        op(torch.ones(2, 3), torch.ones(4))
    state.assert_failed_and_reset(op, before)
    assert op._effect_branches == {}
    assert op.seen == []


def test_a_failing_check_changes_nothing_after_a_success(state) -> None:
    op = ScaleOp()
    op(torch.ones(2, 3))
    before = state.snapshot(op)
    with pytest.raises(SignatureCallError):
        op(torch.ones(2, 3, dtype=torch.int32))
    state.assert_failed_and_kept(op, before)
    assert op._entries_by_call == before.binding["_entries_by_call"][1]
    assert len(op.seen) == 1


def test_call_errors_name_the_argument_and_the_spec_line() -> None:
    with pytest.raises(SignatureCallError) as info:
        RowStatsOp(width=4)(torch.ones(2, 5))
    err = info.value
    assert err.argument == "x"
    assert "ops.yaml" in err.spec
    assert "x: f32[2, 5]" in str(err)


# --- the record -----------------------------------------------------------------------------------


def test_last_call_records_the_successful_call() -> None:
    op = ScaleOp(alpha=3.0)
    x = torch.ones(4, 8)
    y = op(x)
    assert torch.equal(y, torch.full((4, 8), 3.0))
    call = op.last_call
    assert call is op.seen[-1][0]
    assert call.indices == {"alpha": 3.0, "B": (4,), "N": 8, "T": "float32"}
    assert call.tensors == {"x": ((4, 8), "float32"), "bias": None, "y": ((4, 8), "float32")}
    assert call.device == torch.device("cpu")
    assert op.eval_roofline() == (32, 256)
    op(torch.ones(2, 8, dtype=torch.float16))
    assert op.last_call is not call
    assert op.last_call.indices["T"] == "float16"


def test_eval_roofline_needs_a_call() -> None:
    with pytest.raises(RuntimeError, match="needs a call first"):
        ScaleOp().eval_roofline()


# --- inputs ---------------------------------------------------------------------------------------


def test_an_absent_optional_input_reaches_forward_as_none() -> None:
    op = ScaleOp(alpha=1.0)
    op(torch.ones(2, 3))
    assert op.seen[-1][2] is None
    bias = torch.full((3,), 5.0)
    y = op(torch.ones(2, 3), bias)
    assert op.seen[-1][2] is bias
    assert torch.equal(y, torch.full((2, 3), 6.0))


def test_inputs_by_keyword() -> None:
    op = ScaleOp(alpha=1.0)
    x, bias = torch.ones(2, 3), torch.ones(3)
    assert torch.equal(op(x=x, bias=bias), torch.full((2, 3), 2.0))
    assert torch.equal(op(x, bias=bias), torch.full((2, 3), 2.0))
    assert op(x=x).shape == (2, 3)
    assert op.seen[-1][2] is None
    with pytest.raises(TypeError, match="input 'x' given twice"):
        op(x, x=x)
    with pytest.raises(TypeError, match="unexpected argument 'z'; accepted: x, bias"):
        op(x, z=x)
    # an output the op allocates, passed as a buffer: said so
    with pytest.raises(TypeError, match=r"unexpected argument 'y' \('y' is an output this op "
                                        r"allocates; its spec declares no buffer for it, so it "
                                        r"takes none\); accepted: x, bias"):
        op(x, y=x)
    with pytest.raises(TypeError, match="takes 2 inputs"):
        op(x, bias, x, out=x)


# --- step 2: the effect branch and the outputs -------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_outputs_are_allocated_on_the_call_device(device: str) -> None:
    op = ScaleOp()
    y = op(torch.ones(2, 3, dtype=torch.bfloat16, device=device))
    assert y.device.type == device and y.dtype == torch.bfloat16 and y.shape == (2, 3)


def test_out_buffer_is_written_and_returned() -> None:
    op = AddOp()
    a, b = torch.ones(3), torch.full((3,), 2.0)
    fresh = op(a, b)
    assert torch.equal(fresh, torch.full((3,), 3.0))
    out = torch.zeros(3)
    got = op(a, b, out=out)
    assert got is out
    assert torch.equal(out, torch.full((3,), 3.0))
    assert op.last_call.out_given is True
    assert op(a, b, out=None) is not out
    # two branches: out given and not
    assert len(op._effect_branches) == 2


def test_out_buffer_of_the_wrong_shape_is_a_check_error(state) -> None:
    op = AddOp()
    before = state.snapshot(op)
    with pytest.raises(SignatureCallError, match="the buffer given for out"):
        op(torch.ones(3), torch.ones(3), out=torch.zeros(4))
    state.assert_failed_and_reset(op, before)


def test_out_buffer_with_a_target(new_target) -> None:
    name = new_target()
    register_builder(name, AddOp, lambda op, call: lambda a, b, out: torch.add(a, b, out=out))
    op = AddOp(target=name)
    out = torch.zeros(2)
    assert op(torch.ones(2), torch.ones(2), out=out) is out
    assert torch.equal(out, torch.full((2,), 2.0))


def test_aliased_output_is_the_written_input() -> None:
    x = torch.ones(3)
    y = NegOp()(x)
    assert y is not x and torch.equal(x, torch.ones(3))
    got = NegOp(inplace=True)(x)
    assert got is x
    assert torch.equal(x, -torch.ones(3))
    op = NegOp(inplace=True)
    op(torch.ones(2))
    assert op.last_call.written_inputs == ("x",)


def test_several_outputs_come_back_as_a_tuple() -> None:
    mean, count = RowStatsOp(width=2)(torch.tensor([[1.0, 3.0], [2.0, 4.0]]))
    assert torch.equal(mean, torch.tensor([2.0, 3.0]))
    assert count.dtype == torch.int64 and torch.equal(count, torch.tensor([2, 2]))


def test_effect_branches_are_cached_per_branch() -> None:
    op = ScaleOp()
    op(torch.ones(2, 3))
    op(torch.ones(5, 3), torch.ones(3))
    (branch, how), = op._effect_branches.items()
    assert branch == op.last_call.branch == ((), False, ("y",))
    assert how is not None
    AddOp()(torch.ones(2), torch.ones(2))
    add = AddOp()
    add(torch.ones(2), torch.ones(2))
    add(torch.ones(2), torch.ones(2), out=torch.ones(2))
    assert set(add._effect_branches) == {((), False, ("out",)), ((), True, ("out",))}


def test_outputs_like_a_non_contiguous_input_are_contiguous() -> None:
    x = torch.ones(3, 4).t()
    y = ScaleOp(alpha=1.0)(x)
    assert y.shape == (4, 3) and y.is_contiguous() and torch.equal(y, x)


# --- step 3: construction-time tensors ------------------------------------------------------------


def test_construction_tensors_follow_the_call_and_are_written_back() -> None:
    op = TableScaleOp()
    fixed = op.fixed
    op(torch.ones(2, 4, dtype=torch.float16))
    assert op.table.dtype == torch.float16 and op.table.device.type == "cpu"
    assert op.fixed is fixed  # follows no dtype, already on the device: untouched
    assert op.unset is None
    op(torch.ones(2, 4, device="meta"))
    assert op.table.dtype == torch.float32 and op.table.device.type == "meta"
    assert op.fixed.dtype == torch.int64 and op.fixed.device.type == "meta"


# --- steps 4 to 6 ---------------------------------------------------------------------------------


def test_first_call_binds_the_target_and_builds_the_entry() -> None:
    op = ScaleOp()
    op(torch.ones(2, 3))
    assert op.serving_target == "tileops"
    assert op._target_builder is None
    spec = ScaleSpec(torch.device("cpu"), 3, torch.float32)
    entry = op._entries_by_call[(ScaleIface, spec)]
    assert op.built_entries == {ScaleIface: {(ScaleKernel, spec): entry}}
    assert list(op.iter_kernels()) == [entry]


def test_forward_is_required_for_in_tree_kernels(state) -> None:
    class NoForward(Op, specs=SPECS, entry="ScaleOp"):
        kernel_types = {ScaleIface: (ScaleKernel,)}

    op = NoForward()
    before = state.snapshot(op)
    with pytest.raises(NotImplementedError, match="has no in-tree forward"):
        op(torch.ones(2))
    state.assert_failed_and_reset(op, before)
